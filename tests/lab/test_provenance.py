"""Provenance (issue 41, item 3): every record privgrad writes names the code that made it
(``git_commit`` and ``code_version``) and where it ran (``environment``), privgrad/records.py."""

import json

import numpy
import scipy
import torch

from cli_helpers import run_cli
from privgrad.lab.reproduce import RESULTS_DIR
from privgrad.records import code_version, environment, git_commit, provenance

TRAIN = (
    "train",
    "--limit-train",
    "300",
    "--epochs",
    "1",
    "--batch-size",
    "100",
    "--noise-multiplier",
    "1.2",
    "--device",
    "cpu",
    "--quiet",
)


def test_a_train_record_and_its_model_sidecar_name_the_commit_and_the_code_version(tmp_path):
    out = tmp_path / "record.json"
    model = tmp_path / "model.pt"
    code, _, err = run_cli(
        *TRAIN, "--db", str(tmp_path / "r.db"), "--out", str(out), "--save-model", str(model)
    )
    assert code == 0, err
    record = json.loads(out.read_text())
    sidecar = json.loads((tmp_path / "model.privacy.json").read_text())
    for written in (record, sidecar):
        assert {k: written[k] for k in provenance()} == provenance()
    assert (record["git_commit"], record["code_version"]) == (git_commit(), code_version())


def test_the_own_loop_privacy_record_names_the_commit_and_the_code_version():
    import privgrad

    model = torch.nn.Linear(4, 2)
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        batch_size=16,
    )
    record = private.privacy_record()
    assert (record["git_commit"], record["code_version"]) == (git_commit(), code_version())
    assert record["environment"] == environment()


def test_the_environment_names_the_software_and_the_cpu_and_a_gpu_only_once_cuda_ran():
    env = environment()
    assert env["torch"] == torch.__version__ and env["python"].count(".") == 2
    assert (env["numpy"], env["scipy"]) == (numpy.__version__, scipy.__version__)
    assert env["dp-accounting"] == "0.6.0"  # pyproject.toml pins it
    assert env["cpu"] and env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["threads"] == torch.get_num_threads()
    assert env["gpu"] is None or torch.cuda.is_initialized()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        assert environment()["gpu"] == torch.cuda.get_device_name()


# --------------------------------------------------------------------------- the committed records

CLEAN = {"mechanism": "dpsgd", "git_commit": "a" * 40, "code_version": "src-0123456789abcdef"}


def write(root, rel, obj):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def pending_toml(*entries, reasons=("slow",)):
    text = "[reasons]\n" + "".join(f'{r} = "too slow to rerun here"\n' for r in reasons)
    for file, missing in entries:
        text += (
            f'\n[[pending]]\nfile = "{file}"\nmissing = {json.dumps(missing)}\nwhy = "slow"\n'
            'command = "privgrad train --out results/x.json"\n'
        )
    return text


def test_every_committed_record_names_a_clean_commit_and_a_code_version():
    """Every run, harness, audit and GAN record under results/ (a file of one record, a list, a
    ``{"records": [...]}`` object, or JSON lines) has a git_commit without -dirty and a
    code_version, and a file's records share one code version (a reproduce store's test runs, its
    search runs), unless results/provenance_pending.toml says why not and how to rerun it; and
    no pending entry outlives its fault. results/bench/ is left out: benchmark timings are
    measurements of the code's speed, not records of a training, harness, audit or GAN run."""
    from privgrad.lab.report.records import provenance_problems

    assert provenance_problems() == []


def test_a_planted_fault_is_caught_and_a_pending_entry_must_say_exactly_what_is_missing(tmp_path):
    from privgrad.lab.report.records import PENDING_NAME, provenance_problems

    write(tmp_path, "a/clean.json", CLEAN)
    write(tmp_path, "bench/timing.json", {"seconds": 1.0})  # not a record: never checked
    assert provenance_problems(tmp_path) == []

    write(tmp_path, "a/dirty.json", {**CLEAN, "git_commit": "b" * 40 + "-dirty"})
    write(tmp_path, "a/bare.json", {"records": [{"mechanism": "dpsgd"}]})
    mixed = [CLEAN, {**CLEAN, "code_version": "src-fedcba9876543210"}]
    write(tmp_path, "reproduce/x.search.json", mixed)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "runs.jsonl").write_text(
        json.dumps(CLEAN) + "\n" + json.dumps({**CLEAN, "code_version": None}) + "\n"
    )
    assert provenance_problems(tmp_path) == [
        "a/bare.json: no code_version, no git_commit (rerun it, or list it in "
        "provenance_pending.toml)",
        "a/dirty.json: dirty (rerun it, or list it in provenance_pending.toml)",
        "reproduce/x.search.json: mixed versions (rerun it, or list it in provenance_pending.toml)",
        "small/runs.jsonl: no code_version (rerun it, or list it in provenance_pending.toml)",
    ]

    pending = tmp_path / PENDING_NAME
    entries = [
        ("a/bare.json", ["no code_version", "no git_commit"]),
        ("a/dirty.json", ["dirty"]),
        ("reproduce/x.search.json", ["mixed versions"]),
        ("small/runs.jsonl", ["no code_version"]),
    ]
    pending.write_text(pending_toml(*entries))
    assert provenance_problems(tmp_path) == []

    # the list only shrinks: a rerun file, a removed one, a wrong account, an unused reason
    write(tmp_path, "a/dirty.json", CLEAN)
    (tmp_path / "a" / "bare.json").unlink()
    pending.write_text(
        pending_toml(*entries[:2], ("reproduce/x.search.json", ["dirty"]), entries[3])
    )
    assert provenance_problems(tmp_path) == [
        "a/dirty.json: clean now; remove its entry from provenance_pending.toml",
        "reproduce/x.search.json: provenance_pending.toml says dirty; its records: mixed versions",
        "a/bare.json: in provenance_pending.toml but no such record file",
    ]
    pending.write_text(pending_toml(*entries[2:], reasons=("slow", "other")))
    assert provenance_problems(tmp_path) == [f"{pending}: reasons no entry names: other"]


def test_the_page_line_names_each_version_and_commit_marking_dirty_and_pending():
    from privgrad.lab.report.records import provenance_text

    pairs = [
        (CLEAN, "results/a.json[0]"),
        (CLEAN, "results/a.json[1]"),
        ({**CLEAN, "git_commit": "b" * 40 + "-dirty"}, "results/b.json"),
        ({"mechanism": "dpsgd"}, "results/c.json"),
    ]
    assert provenance_text(pairs, {"results/b.json", "results/c.json"}) == (
        "no code version · no commit (1, pending rerun), src-01234567 · aaaaaaa (2), "
        "src-01234567 · bbbbbbb-dirty (1, pending rerun)"
    )


def test_each_section_of_the_page_names_its_code_under_its_header(tmp_path):
    """One line under the section's header: its runs' code versions and commits, a -dirty
    commit and a pending file's runs marked; the audits' section likewise."""
    from privgrad.lab.report import MD_NAME, build_report
    from privgrad.lab.report.records import PENDING_NAME
    from privgrad.lab.reproduce import config_dict
    from test_report import toy  # tests/lab is on sys.path

    exps, res = tmp_path / "experiments", tmp_path / "results"
    exp = toy(exps, "toy-prov", "Toy")
    records = []
    for c in exp.cells():
        cfg = c.config
        records.append(
            {
                **{k: getattr(cfg, k) for k in ("mechanism", "dataset", "model", "seed")},
                **{k: getattr(cfg, k) for k in ("epochs", "lr", "batch_size", "clip")},
                "test_accuracy": 0.9 + cfg.seed / 100,
                "epsilon": 1.0,
                "epsilon_claimed": 1.0,
                "experiment": exp.id,
                "arm": c.arm,
                "cell": c.key,
                "nominal_epsilon": c.epsilon,
                "config": config_dict(cfg),
                "git_commit": ("b" * 40 + "-dirty") if cfg.seed == 2 else "a" * 40,
                "code_version": CLEAN["code_version"],
            }
        )
    write(res, "reproduce/toy-prov.json", records)
    audit = {**CLEAN, "method": "canary", "epsilon_lower_bound": 0.1, "epsilon": 1.0}
    write(res, "audit/canary.json", audit)
    (res / PENDING_NAME).write_text(pending_toml(("reproduce/toy-prov.json", ["dirty"])))
    build_report(tmp_path / "docs", results_dir=res, experiments_dir=exps)
    md = (tmp_path / "docs" / MD_NAME).read_text()
    section = md.split("## Toy, Table 1 (a toy table)\n\n", 1)[1]
    assert section.startswith(
        "**Code** (version · commit (runs)): src-01234567 · aaaaaaa (2, pending rerun), "
        "src-01234567 · bbbbbbb-dirty (1, pending rerun).\n"
    )
    audits = md.split("## Empirical privacy audits\n\n", 1)[1]
    assert audits.startswith("**Code** (version · commit (runs)): src-01234567 · aaaaaaa (1).\n")


def _mixed_rows(results_dir=None) -> list[str]:
    """The report's rows (one arm at one ε) whose runs hold more than one code version."""
    from privgrad.lab.report import load_results
    from privgrad.lab.report.placement import place
    from privgrad.lab.report.records import prepare
    from privgrad.lab.reproduce import list_experiments

    recs, _ = prepare(load_results(results_dir)[0])
    sections, _ = place(list_experiments(), recs, include_quick=False)
    return [
        f"{s.exp.id}: {row.arm} {row.group} at ε {row.epsilon}: {sorted(versions)}"
        for s in sections
        for row in s.rows
        for runs in ((row.honest,) if row.nominal_is_honest else (row.honest, row.nominal))
        if len(versions := {str(r.data.get("code_version")) for r in runs}) > 1
    ]


def test_no_row_of_the_committed_report_pools_two_code_versions(tmp_path):
    """A row's runs were all made by one code version: a section takes its own store's runs of
    a cell before another store's (privgrad/lab/report/placement.py), so a rerun store does not
    mix its new runs with another store's old ones in a row. A planted record of another
    version in a committed store is caught."""
    assert _mixed_rows() == []
    store = RESULTS_DIR / "reproduce" / "gip-mnist.json"
    records = json.loads(store.read_text())
    records[0]["code_version"] = "src-planted0"
    (tmp_path / "reproduce").mkdir()
    (tmp_path / "reproduce" / store.name).write_text(json.dumps(records))
    assert len(_mixed_rows(tmp_path)) == 1
