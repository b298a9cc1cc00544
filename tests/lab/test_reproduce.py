"""privgrad reproduce: experiment configs, cell identity, skip/resume, and --quick end to end.

Every runnable experiment is run with --quick here (or, for IMDB, in test_report.py, which
builds a report from that run); a runnable experiment that needs a name privgrad lacks fails.
"""

import dataclasses
import functools
import json
import shutil
import math
import re
import time

import pytest

from privgrad.errors import PrivgradError
from privgrad.records import code_version
from privgrad.lab.reproduce import REPO_ROOT, cell_key, list_experiments, load_experiment, plan
from privgrad.app.store import RunStore
from privgrad.app.train import TrainConfig
from cli_helpers import run_cli as cli

# mechanisms and models that other issues are adding; an experiment may wait for these only
# experiments whose --quick run happens in test_report.py, which builds a report from it
# (split so that each test file stays under a minute)
QUICK_IN_REPORT_TEST = {"bottleneck-t3-imdb", "gredp-t1-mnist", "bottleneck-t4-mnist"}
JOBS_AND_EXPORT = "bottleneck-t4-fmnist"
SEEDS_DIR = REPO_ROOT.parent / "shared" / "seeds"

EXPERIMENTS = list_experiments()
RUNNABLE = [e.id for e in EXPERIMENTS if e.runnable]


def test_there_is_an_experiment_per_reproduction_target():
    ids = {e.id for e in EXPERIMENTS}
    assert {
        "bottleneck-t3-mnist",
        "bottleneck-t3-fmnist",
        "bottleneck-t3-imdb",
        "gredp-t1-mnist",
        "gredp-t1-cifar10",
        "spectral-t1-mnist",
        "spectral-t1-cifar10",
        "gip-t5-cifar10",
        "rdpgan-t4-mnist",
    } <= ids
    assert {"bottleneck-t3-mnist", "bottleneck-t3-fmnist", "bottleneck-t3-imdb"} <= set(RUNNABLE)


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=lambda e: e.id)
def test_config_cites_the_paper_and_states_what_was_scaled(exp):
    assert exp.title and exp.paper and exp.table and exp.page
    for arm in exp.arms:
        # an arm the paper does not have (a sound baseline) must say so in its note
        assert arm.paper or "not in the paper" in arm.note, f"{exp.id}/{arm.name}: no paper number"
        if arm.private:
            assert set(arm.paper) <= set(exp.arm_epsilons(arm)), (
                f"{exp.id}/{arm.name}: paper ε not in the grid"
            )
    if exp.runnable:
        assert (
            exp.scaled_down.get("reason")
            and exp.scaled_down.get("epochs")
            and exp.scaled_down.get("data")
        )
        assert exp.quick["limit_train"] <= 500 and exp.quick["epochs"] <= 1
        assert exp.n_test_cells(quick=True) <= 10 and exp.quick.get("seeds", exp.seeds[:1]) == [0]
        if exp.search:  # the quick search stays CI-sized too
            units = exp.search_units(quick=True)
            assert (
                len(units) * max(math.prod(map(len, a.space.values())) for a, _, _ in units) <= 16
            )  # 4 searched arms × 4 values
            assert exp.search_seeds(quick=True) == [0] and exp.max_extensions(quick=True) <= 1
    else:
        assert len(exp.reason) > 20


def test_an_experiment_without_a_seed_text_has_no_paper_numbers():
    """An anchor run (no paper table among the seeds) cannot show a paper number it could not
    cite."""
    anchors = [e for e in EXPERIMENTS if not e.seed_file]
    assert "dpsgd-anchors-mnist" in {e.id for e in anchors}
    for exp in anchors:
        assert all(not arm.paper for arm in exp.arms), exp.id


@pytest.mark.parametrize("exp", [e for e in EXPERIMENTS if e.seed_file], ids=lambda e: e.id)
def test_a_paper_table_names_the_mechanisms_it_proposes(exp):
    """The report's Findings compare a paper's `proposed` mechanisms with DP-SGD and read their
    audits."""
    from privgrad.app.defaults import GAN_MODES
    from privgrad.mechanisms import MECHANISMS

    assert exp.proposed, f"{exp.id}: no 'proposed' mechanisms"
    assert set(exp.proposed) <= (set(MECHANISMS) | set(GAN_MODES)) - {
        "dpsgd",
        "dp-adam",
        "dp-gan",
        "non-private",
    }


@pytest.mark.skipif(not SEEDS_DIR.exists(), reason="../shared/seeds not present")
@pytest.mark.parametrize("exp", [e for e in EXPERIMENTS if e.seed_file], ids=lambda e: e.id)
def test_paper_numbers_are_in_the_cited_table(exp):
    """Reference data: each paper number is printed within the cited table of the seed text."""
    lines = (SEEDS_DIR / exp.seed_file).read_text(errors="replace").splitlines()
    head = lines[exp.seed_line - 1]
    assert exp.table.split()[-1] in head and "table" in head.lower(), head[:120]
    window = "\n".join(lines[exp.seed_line - 1 : exp.seed_line + 30])
    for arm in exp.arms:
        columns = [v for values in arm.paper_columns.values() for v in values if not math.isnan(v)]
        for value in [*arm.paper.values(), *columns]:
            forms = {f"{value:g}", f"{value:.1f}", f"{value:.2f}", f"{value / 100:.3g}"}
            assert any(
                re.search(r"(?<![0-9])" + re.escape(f) + r"(?![0-9])", window) for f in forms
            ), f"{exp.id}/{arm.name}: {value} not in {exp.seed_file} from line {exp.seed_line}"


def test_cell_key_is_canonical():
    a = TrainConfig(epochs=20, batch_size=512, lr=2)
    b = TrainConfig(epochs=20.0, batch_size=512.0, lr=2.0, data_dir="/elsewhere")
    assert cell_key(a) == cell_key(b)
    assert cell_key(a) != cell_key(TrainConfig(epochs=20, batch_size=512, lr=2, seed=1))
    assert cell_key(a) != cell_key(
        TrainConfig(epochs=20, batch_size=512, lr=2, mechanism_options={"x": 1})
    )
    # a field added later is hashed only away from its default (committed cells keep their keys)
    assert cell_key(a) == cell_key(
        {k: v for k, v in dataclasses.asdict(a).items() if k != "validation"}
    )
    assert cell_key(a) != cell_key(TrainConfig(epochs=20, batch_size=512, lr=2, validation=100))
    assert re.fullmatch(r"src-[0-9a-f]{16}", code_version()) and code_version() == code_version()


def _write(tmp_path, text, name="tiny"):
    folder = tmp_path / "experiments"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.toml").write_text(f'id = "{name}"\n' + text)
    return folder


TINY = """
title = "tiny"
paper = "none"
table = "Table 0"
page = "n/a"
[scaled_down]
reason = "test"
[base]
dataset = "mnist"
model = "cnn"
epochs = 1
batch_size = 50
limit_train = 200
[grid]
epsilon = [1.0]
seeds = [0, 1]
[quick]
limit_train = 200
epochs = 1
[[arms]]
name = "A"
mechanism = "%s"
paper = { "1.0" = 50.0 }
"""


def test_unknown_mechanism_is_a_one_line_error(tmp_path):
    folder = _write(tmp_path, TINY % "dp-magic")
    code, _, err = cli(
        "reproduce", "tiny", "--experiments-dir", str(folder), "--db", str(tmp_path / "r.db")
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert "needs mechanism 'dp-magic'" in lines[0]


def test_not_runnable_experiment_is_a_one_line_error(tmp_path):
    code, _, err = cli("reproduce", "gip-t5-cifar10", "--db", str(tmp_path / "r.db"))
    assert code == 2 and err.strip().startswith(
        "error: experiment 'gip-t5-cifar10' cannot be reproduced here"
    )
    code, _, err = cli("reproduce", "no-such-table", "--db", str(tmp_path / "r.db"))
    assert (
        code == 2
        and "unknown experiment 'no-such-table'" in err
        and len(err.strip().splitlines()) == 1
    )


@pytest.mark.parametrize(
    "bad,needle",
    [
        (
            '\n[[arms]]\nname = "B"\nmechanism = "dpsgd"\nlearning_rate = 1\n',
            "unknown key(s) learning_rate",
        ),
        ('\n[[arms]]\nname = "A"\nmechanism = "dpsgd"\n', "duplicate arm name"),
        ('\n[[arms]]\nname = "B"\nmechanism = "dpsgd"\ntargets = ["paper"]\n', "targets must be"),
    ],
)
def test_config_mistakes_are_caught(tmp_path, bad, needle):
    folder = _write(tmp_path, TINY % "dpsgd" + bad)
    with pytest.raises(PrivgradError, match=re.escape(needle)):
        load_experiment("tiny", folder)
    (folder / "other.toml").write_text((folder / "tiny.toml").read_text())
    with pytest.raises(PrivgradError, match="must equal the file name"):
        load_experiment(folder / "other.toml")


def test_proposed_must_be_a_list_of_mechanism_names(tmp_path):
    folder = _write(tmp_path, 'proposed = "gredp"' + TINY % "dpsgd")
    with pytest.raises(PrivgradError, match="'proposed' must be a list of mechanism names"):
        load_experiment("tiny", folder)
    assert load_experiment(
        "tiny", _write(tmp_path, 'proposed = ["gredp"]' + TINY % "dpsgd")
    ).proposed == ("gredp",)


def test_list_shows_every_experiment():
    code, out, _ = cli("reproduce", "--list")
    assert code == 0 and all(e.id in out for e in EXPERIMENTS)


@pytest.fixture(scope="module")
def quick_db(tmp_path_factory):
    return tmp_path_factory.mktemp("reproduce") / "runs.db"


def test_no_two_quick_experiments_share_a_cell(tmp_path):
    """test_quick_runs_end_to_end runs every experiment into one store: a quick cell two
    experiments share would be found done, recorded under the other experiment's name."""
    store = RunStore(tmp_path / "runs.db")
    owners: dict[str, set] = {}
    for exp_id in RUNNABLE:
        if exp_id in QUICK_IN_REPORT_TEST:
            continue
        p = plan(load_experiment(exp_id), store, quick=True, any_version=True)
        for cell in [*p.cells, *p.search_cells]:
            owners.setdefault(cell.key, set()).add(exp_id)
    store.close()
    assert not {key: ids for key, ids in owners.items() if len(ids) > 1}


@pytest.mark.parametrize("exp_id", [e for e in RUNNABLE if e not in QUICK_IN_REPORT_TEST])
def test_quick_runs_end_to_end(exp_id, quick_db, tmp_path):
    exp = load_experiment(exp_id)
    assert not exp.missing(), f"{exp_id} is marked runnable but needs {exp.missing()}"
    # one experiment also exercises --jobs (worker processes) and --export
    extra = (
        ["--jobs", "2", "--export", "--results-dir", str(tmp_path)]
        if exp_id == JOBS_AND_EXPORT
        else []
    )
    code, _, err = cli("reproduce", exp_id, "--quick", "--db", str(quick_db), "--quiet", *extra)
    assert code == 0, err
    store = RunStore(quick_db)
    p = plan(exp, store, quick=True, any_version=True)  # (others may edit code meanwhile)
    store.close()
    done, cells = p.finished, p.cells
    assert not p.waiting and len(cells) == exp.n_test_cells(quick=True)
    for cell in cells:
        rec = done[cell.key]
        assert rec["experiment"] == exp_id and rec["quick"] is True and rec["arm"] == cell.arm
        assert 0 <= rec["test_accuracy"] <= 1 and rec["train_size"] == exp.quick["limit_train"]
        assert "validation_accuracy" not in rec and rec["config"].get("validation", 0) == 0
        assert rec["selection"]["on"] == (
            "paper" if exp.arm(cell.arm).space is None else "validation"
        )
        assert rec["selection"] == cell.selection
        if cell.epsilon is not None:
            target_eps = rec["epsilon"] if cell.target == "honest" else rec["epsilon_claimed"]
            assert target_eps <= cell.epsilon * (1 + 1e-6) and target_eps > 0.9 * cell.epsilon
    for cell in (
        p.search_cells
    ):  # search runs evaluate on held-out training examples, never on the test set
        rec = done[cell.key]
        assert rec.get("test_accuracy") is None and 0 <= rec["validation_accuracy"] <= 1
        assert rec["validation_size"] == exp.quick["validation"] == rec["config"]["validation"]
        assert rec["train_size"] == exp.quick["limit_train"] - exp.quick["validation"]
        assert rec["search_point"] == cell.point and all(
            functools.reduce(lambda d, part: d[part], k.split("."), rec["config"]) == v
            for k, v in cell.point.items()
        )  # a dotted axis (mechanism_options.filter_ratio) is one option of its table
    assert f"{len(cells) + len(p.search_cells)} cells run, 0 skipped, 0 failed" in err
    assert (
        err.count("smoke run: not a result") == len(cells) + len(p.search_cells) and "✓" not in err
    )  # --quick: no verdict
    if extra:
        exported = json.loads((tmp_path / "reproduce" / f"{exp_id}.json").read_text())
        assert [r["cell"] for r in exported] == [c.key for c in cells]
        assert all(r["experiment"] == exp_id and "run_id" not in r for r in exported)
        assert [r["selection"] for r in exported] == [c.selection for c in cells]
        # a fresh checkout (empty run store) resumes from the committed records with --from-results,
        # only those made by the same code unless --any-version
        n_search = len(p.search_cells)
        resumed = f"search: {n_search} done, 0 to run; test grid: {len(cells)} done, 0 to run"
        fresh = [
            "reproduce",
            exp_id,
            "--quick",
            "--db",
            str(tmp_path / "fresh.db"),
            "--dry-run",
            "--results-dir",
            str(tmp_path),
        ]
        assert resumed in cli(*fresh, "--from-results")[1]
        nothing = "search: 0 done, "  # (how many to run depends on the extensions, unknown yet)
        assert nothing in cli(*fresh)[1]
        for name in (f"{exp_id}.json", f"{exp_id}.search.json"):
            path = tmp_path / "reproduce" / name
            path.write_text(
                json.dumps(
                    [{**r, "code_version": "src-other"} for r in json.loads(path.read_text())]
                )
            )
        assert nothing in cli(*fresh, "--from-results")[1]
        assert resumed in cli(*fresh, "--from-results", "--any-version")[1]


def test_rerun_skips_done_cells_and_resumes_after_interruption(quick_db):
    exp = load_experiment("bottleneck-t3-fmnist")  # a searched experiment: search and test cells
    store = RunStore(quick_db)
    p = plan(exp, store, quick=True)
    if p.todo or p.search_todo or p.waiting:  # run on its own: make the quick run here
        code, _, err = cli(
            "reproduce", "bottleneck-t3-fmnist", "--quick", "--db", str(quick_db), "--quiet"
        )
        assert code == 0, err
    p = plan(exp, store, quick=True)
    assert not p.todo and not p.search_todo and not p.waiting and len(p.cells) == 3
    every = len(p.cells) + len(p.search_cells)
    # a second invocation runs nothing
    start = time.time()
    code, _, err = cli(
        "reproduce", "bottleneck-t3-fmnist", "--quick", "--db", str(quick_db), "--quiet"
    )
    assert code == 0 and f"0 cells run, {every} skipped" in err and time.time() - start < 20
    # a cell whose run was interrupted is run again, and only that one
    victim = p.done[p.cells[1].key]["run_id"]
    store.abort(victim, "interrupted")
    p2 = plan(exp, store, quick=True)
    assert [c.key for c in p2.todo] == [p.cells[1].key] and not p2.search_todo
    code, out, err = cli(
        "reproduce", "bottleneck-t3-fmnist", "--quick", "--db", str(quick_db), "--dry-run"
    )
    assert code == 0 and "2 done, 1 to run" in out
    code, _, err = cli(
        "reproduce", "bottleneck-t3-fmnist", "--quick", "--db", str(quick_db), "--quiet"
    )
    assert code == 0 and f"1 cells run, {every - 1} skipped" in err
    # another code version: every search cell is to be redone (the test cells wait for the
    # searches), unless --any-version
    import privgrad.lab.reproduce as rp

    real = rp.code_version
    try:
        rp.code_version = lambda: "src-0000000000000000"
        other = plan(exp, store, quick=True)  # the searches start again from their initial grids
        searched = {c.key for c in p.search_cells}
        assert other.search_todo and {c.key for c in other.search_todo} <= searched
        assert not other.todo and other.waiting
        done = plan(exp, store, quick=True, any_version=True)
        assert not done.todo and not done.search_todo and not done.waiting
    finally:
        rp.code_version = real
    forced = plan(exp, store, quick=True, force=True)
    assert {c.key for c in forced.search_todo} == {
        c.key for c in other.search_todo
    } and forced.waiting
    store.close()


# --------------------------------------------------------------------------- the tuning protocol

SEARCHED = (
    TINY.replace(
        "[quick]",
        """[search]
validation = 50
seeds = [0, 1]
max_extensions = 2
[search.space]
lr = [0.5, 1, 2, 4]
[quick]
validation = 50""",
    ).replace(
        "[grid]\nepsilon = [1.0]\nseeds = [0, 1]", "[grid]\nepsilon = [1.0, 2.0]\nseeds = [0, 1, 2]"
    )
    + """
[[arms]]
name = "B"
mechanism = "dp-signsgd"
paper = { "1.0" = 50.0 }
search = { lr = [0.001, 0.002, 0.003, 0.004] }
[[arms]]
name = "C"
mechanism = "dpsgd"
lr = 2.0
paper = { "1.0" = 50.0 }
search = false
"""
)

# Synthetic validation accuracy, (mechanism, ε) -> lr -> (seed 0, seed 1).
VALIDATION = {
    # interior optimum of the mean (lr 1); seed 0 alone or the best single run would pick lr 2,
    # seed 1 lr 0.5
    ("dpsgd", 1.0): {0.5: (0.70, 0.89), 1: (0.85, 0.85), 2: (0.90, 0.70), 4: (0.50, 0.50)},
    # rising without end: the high edge is extended twice (8, 16), then marked
    ("dpsgd", 2.0): {
        0.5: (0.1,) * 2,
        1: (0.2,) * 2,
        2: (0.3,) * 2,
        4: (0.4,) * 2,
        8: (0.5,) * 2,
        16: (0.6,) * 2,
    },
    # best at the low edge of a linear grid: the next value, lr = 0, is not allowed (a hard limit)
    ("dp-signsgd", 1.0): {
        0.001: (0.9, 0.9),
        0.002: (0.5, 0.5),
        0.003: (0.5, 0.5),
        0.004: (0.5, 0.5),
    },
    # high edge, extended by the grid's step to 0.005, which ties with 0.004: the first in grid
    # order wins
    ("dp-signsgd", 2.0): {
        0.001: (0.5,) * 2,
        0.002: (0.6,) * 2,
        0.003: (0.7,) * 2,
        0.004: (0.8,) * 2,
        0.005: (0.8,) * 2,
    },
    # flat (every run predicts the majority class): both edges grow, and it stays flat
    ("dp-adam", 1.0): {lr: (0.4908,) * 2 for lr in (0.25, 0.5, 1, 2, 4, 8)},
    # flat on its grid; of the two edges grown, the high one learns
    ("dp-adam", 2.0): {**{lr: (0.4908,) * 2 for lr in (0.25, 0.5, 1, 2, 4)}, 8: (0.6, 0.7)},
}


@pytest.fixture
def fake_train(monkeypatch):
    """privgrad.app.train.train replaced by a table of synthetic validation accuracies; every
    search run also reports a test accuracy that ranks the settings the other way round,
    so a selection that looked at it would choose differently. Returns the configs it ran."""
    import privgrad.app.train

    calls = []

    def train(config, store=None, progress=True, command=None):
        calls.append(config)
        run_id = store.start(dataclasses.asdict(config))
        rec = {
            "mechanism": config.mechanism,
            "dataset": config.dataset,
            "model": config.model,
            "seed": config.seed,
            "lr": config.lr,
            "epsilon": config.epsilon,
            "epsilon_claimed": config.epsilon,
            "test_accuracy": 0.5,
        }
        if config.validation:
            lr = min(VALIDATION[config.mechanism, config.epsilon], key=lambda v: abs(v - config.lr))
            assert math.isclose(lr, config.lr), config.lr
            acc = VALIDATION[config.mechanism, config.epsilon][lr][config.seed]
            rec.update(
                validation_accuracy=acc, validation_size=config.validation, test_accuracy=1 - acc
            )
        store.finish(run_id, rec)
        return {**rec, "run_id": run_id}

    monkeypatch.setattr(privgrad.app.train, "train", train)
    return calls


def test_exports_of_one_file_take_turns_and_a_corrupt_file_is_not_overwritten(tmp_path):
    """Two processes exporting one experiment (--arm runs side by side) must not lose each
    other's records: the second waits for the first's lock, then keeps its records."""
    import fcntl
    import threading
    from privgrad.lab.reproduce import export_records

    exp = load_experiment("tiny", _write(tmp_path, TINY % "dpsgd"))
    a, b = exp.cells()[:2]
    res = tmp_path / "results"
    export_records(exp, [a, b], {a.key: {"cell": a.key, "arm": "A"}}, res)
    path = res / "reproduce" / "tiny.json"
    lock = open(path.with_name(path.name + ".lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process is mid-export
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (
            export_records(exp, [a, b], {b.key: {"cell": b.key, "arm": "A"}}, res),
            done.set(),
        )
    )
    worker.start()
    assert not done.wait(0.5)  # it waits for the lock
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    worker.join(10)
    assert done.is_set() and [r["cell"] for r in json.loads(path.read_text())] == [a.key, b.key]
    path.write_text('[{"cell": "x"')  # half-written by something else
    with pytest.raises(PrivgradError, match="not valid JSON"):
        export_records(exp, [a, b], {a.key: {"cell": a.key, "arm": "A"}}, res)
    assert path.read_text() == '[{"cell": "x"'


def test_an_edited_config_s_export_replaces_the_old_records_of_its_rows(tmp_path):
    """After a config edit (spectral-t1-cifar4k-model2: 30 → 10 epochs) the export holds each
    row and seed once, under the new config; another seed's and another row's records stay."""
    from privgrad.lab.reproduce import export_records

    res = tmp_path / "results"
    before = load_experiment("tiny", _write(tmp_path, TINY % "dpsgd"))
    (a0, a1), path = before.cells(), res / "reproduce" / "tiny.json"

    def rec(c, **kw):
        return {
            "cell": c.key,
            "arm": c.arm,
            "nominal_epsilon": c.epsilon,
            "target": "honest",
            "seed": c.seed,
            **kw,
        }

    other_row = {**rec(a0), "cell": "x", "nominal_epsilon": 2.0}
    export_records(before, [a0, a1], {a0.key: rec(a0, epochs=1), a1.key: rec(a1, epochs=1)}, res)
    path.write_text(json.dumps(json.loads(path.read_text()) + [other_row]))
    after = load_experiment(
        "tiny",
        _write(tmp_path, (TINY % "dpsgd").replace("epochs = 1\nbatch", "epochs = 2\nbatch", 1)),
    )
    b0, b1 = after.cells()
    assert b0.key != a0.key
    export_records(after, [b0, b1], {b0.key: rec(b0, epochs=2)}, res)
    assert [(r["cell"], r.get("epochs")) for r in json.loads(path.read_text())] == [
        (a1.key, 1),
        ("x", None),
        (b0.key, 2),
    ]


def test_dry_run_export_writes_the_records_done_so_far_and_runs_nothing(tmp_path, fake_train):
    """A long run's progress can be committed: --dry-run --export writes what a finished run's
    export would hold of the cells done so far (search and test records), and runs nothing."""
    folder = _write(tmp_path, SEARCHED % "dpsgd")
    db, res = str(tmp_path / "r.db"), tmp_path / "results"
    args = (
        "reproduce",
        "tiny",
        "--experiments-dir",
        str(folder),
        "--db",
        db,
        "--results-dir",
        str(res),
    )
    code, _, err = cli(*args, "--quiet")
    assert code == 0, err
    full = {
        name: json.loads((res / "reproduce" / name).read_text())
        for name in ("tiny.json", "tiny.search.json")
    }
    shutil.rmtree(res)
    store = RunStore(db)
    victim = next(r for r in store.runs(status="completed") if not r["config"]["validation"])
    store.abort(victim["id"], "interrupted")
    store.close()
    fake_train.clear()
    code, out, _ = cli(*args, "--dry-run")
    assert code == 0 and not res.exists() and not fake_train  # without --export: nothing written
    code, _, err = cli(*args, "--dry-run", "--export")
    assert code == 0 and "records written to" in err and not fake_train
    assert (
        json.loads((res / "reproduce" / "tiny.search.json").read_text()) == full["tiny.search.json"]
    )
    partial = json.loads((res / "reproduce" / "tiny.json").read_text())
    assert partial == [r for r in full["tiny.json"] if r["cell"] != victim["record"]["cell"]]
    assert len(partial) == len(full["tiny.json"]) - 1


def test_search_chooses_by_mean_validation_accuracy_extends_edges_then_runs_the_test_grid(
    tmp_path, fake_train
):
    folder = _write(tmp_path, SEARCHED % "dpsgd")
    db, res = str(tmp_path / "r.db"), tmp_path / "results"
    args = (
        "reproduce",
        "tiny",
        "--experiments-dir",
        str(folder),
        "--db",
        db,
        "--results-dir",
        str(res),
    )
    code, out, _ = cli(
        *args, "--dry-run"
    )  # nothing run yet: C (paper) can be planned, A and B wait
    assert (
        code == 0
        and "search: 0 done, 32 to run (more if a grid edge is extended); test grid: 0 done, "
        "6 to run, 4 row(s) waiting for their search"
        in out
    )
    code, _, err = cli(*args, "--quiet")
    assert code == 0, err
    n_search = 8 + 12 + 8 + 10  # A ε=2: +8, +16; B ε=2: +0.005 (2 seeds each)
    assert f"{n_search + 18} cells run, 0 skipped, 0 failed" in err
    # every search run came before every test run, and no search run used the test split
    kinds = [c.validation > 0 for c in fake_train]
    assert kinds == [True] * n_search + [False] * 18
    exported = json.loads((res / "reproduce" / "tiny.json").read_text())
    sel = {(r["arm"], r["nominal_epsilon"]): r["selection"] for r in exported}
    assert len(exported) == 18 and all(
        r["lr"] == r["selection"].get("chosen", {"lr": 2.0})["lr"] for r in exported
    )
    a1 = sel["A", 1.0]
    assert a1["on"] == "validation" and a1["search"] == "results/reproduce/tiny.search.json"
    assert (
        a1["chosen"] == {"lr": 1} and a1["axes"] == {"lr": [0.5, 1, 2, 4]} and a1["edge"] is False
    )
    assert (
        a1["validation"] == 50
        and a1["seeds"] == [0, 1]
        and math.isclose(a1["validation_accuracy"], 0.85)
    )
    a2 = sel["A", 2.0]
    assert a2["chosen"] == {"lr": 16.0} and a2["axes"] == {"lr": [0.5, 1, 2, 4, 8.0, 16.0]}
    assert a2["edge"] is True and "high edge of its grid after 2 extension(s)" in a2["edge_note"]
    b1 = sel["B", 1.0]
    assert (
        b1["chosen"] == {"lr": 0.001}
        and b1["edge"] is True
        and "hard limit: lr = 0 is not allowed" in b1["edge_note"]
    )
    b2 = sel["B", 2.0]
    assert b2["chosen"] == {"lr": 0.004} and b2["axes"] == {
        "lr": [0.001, 0.002, 0.003, 0.004, 0.005]
    }
    assert b2["edge"] is False
    assert sel["C", 1.0] == sel["C", 2.0] == {"on": "paper"}
    search = json.loads((res / "reproduce" / "tiny.search.json").read_text())
    assert len(search) == n_search and all(
        "validation_accuracy" in r and r["search_point"] for r in search
    )
    assert not any("selection" in r for r in search)
    # an exported record of an earlier choice of a row is dropped at the next export; other
    # rows' are kept
    path = res / "reproduce" / "tiny.json"
    old = next(r for r in exported if r["arm"] == "A" and r["nominal_epsilon"] == 1.0)
    stale = {**old, "cell": "0" * 16, "selection": {**a1, "chosen": {"lr": 2}}}
    elsewhere = {**old, "cell": "1" * 16, "arm": "Z"}
    path.write_text(json.dumps(exported + [stale, elsewhere]))
    code, _, err = cli(*args, "--quiet")
    cells = [r["cell"] for r in json.loads(path.read_text())]
    assert code == 0 and "0" * 16 not in cells and "1" * 16 in cells and len(cells) == 19
    # a second run runs nothing; an interrupted search run is redone, and only it
    fake_train.clear()
    code, _, err = cli(*args, "--quiet", "--no-export")
    assert code == 0 and f"0 cells run, {n_search + 18} skipped" in err and not fake_train
    store = RunStore(db)
    victim = next(
        r
        for r in store.runs(status="completed")
        if r["config"]["validation"] and r["config"]["lr"] == 16.0
    )
    store.abort(victim["id"], "interrupted")
    store.close()
    code, out, _ = cli(*args, "--dry-run")
    assert "search A ε=2: lr [0.5, 1, 2, 4, 8, 16]: 11 of 12 search runs done" in out
    assert "search A ε=1: lr [0.5, 1, 2, 4]: 8 of 8 search runs done; chose lr=1" in out
    code, _, err = cli(*args, "--quiet", "--no-export")
    assert code == 0 and "1 cells run" in err and len(fake_train) == 1 and fake_train[0].lr == 16.0


def test_a_flat_search_grows_at_both_edges_and_chooses_nothing_if_it_stays_flat(
    tmp_path, fake_train
):
    """A grid whose every point scores the same mean (each run predicting one class) says nothing
    about where to go: both edges are extended; a grid still flat when it can grow no more
    chooses nothing (its first point would be an arbitrary pick) and its test cells do not run."""
    folder = _write(tmp_path, SEARCHED.replace('mechanism = "%s"', 'mechanism = "dp-adam"', 1))
    db, res = str(tmp_path / "r.db"), tmp_path / "results"
    args = (
        "reproduce",
        "tiny",
        "--experiments-dir",
        str(folder),
        "--db",
        db,
        "--results-dir",
        str(res),
    )
    code, out, err = cli(*args)
    assert code == 0, err
    assert (
        "A ε=1: lr [0.25, 0.5, 1, 2, 4, 8]: 12 of 12 search runs done; FLAT: every point scored "
        "the same mean validation accuracy (0.4908), also after extending both edges"
    ) in out + err
    searched = [(c.epsilon, c.lr) for c in fake_train if c.validation and c.mechanism == "dp-adam"]
    assert sorted(set(searched)) == [(e, lr) for e in (1.0, 2.0) for lr in (0.25, 0.5, 1, 2, 4, 8)]
    exported = json.loads((res / "reproduce" / "tiny.json").read_text())
    assert not [r for r in exported if r["arm"] == "A" and r["nominal_epsilon"] == 1.0]
    a2 = {
        json.dumps(r["selection"])
        for r in exported
        if r["arm"] == "A" and r["nominal_epsilon"] == 2.0
    }
    assert len(a2) == 1 and json.loads(a2.pop())["chosen"] == {"lr": 8.0}
    code, out, _ = cli(*args, "--dry-run")
    assert "wait  A ε=1: its test cells are planned once its search has chosen" in out
    from privgrad.lab.report import MD_NAME, build_report

    build_report(tmp_path / "docs", results_dir=res, experiments_dir=folder)
    row = next(
        line
        for line in (tmp_path / "docs" / MD_NAME).read_text().splitlines()
        if line.startswith("| A ε=1 |")
    )
    assert row.endswith(
        "| — | flat: every point scored the same mean validation accuracy (0.4908), also after "
        "extending both edges: nothing to choose, its test cells are not run; move or widen the "
        "grid in the config |"
    ), row
    # a --quick run checks the pipeline end to end: it takes the first point of a flat grid, and
    # says so
    code, _, err = cli(
        "reproduce",
        "tiny",
        "--quick",
        "--experiments-dir",
        str(folder),
        "--db",
        str(tmp_path / "q.db"),
        "--quiet",
        "--no-export",
    )
    assert code == 0, err
    store = RunStore(tmp_path / "q.db")
    p = plan(load_experiment("tiny", folder), store, quick=True)
    store.close()
    sel = next(c.selection for c in p.cells if c.arm == "A" and c.epsilon == 1.0)
    assert not p.waiting and sel["chosen"] == {"lr": 0.25} and sel["edge"] is True
    assert (
        sel["edge_note"]
        == "flat (every point 0.4908): the first point taken, as a --quick run does"
    )


def test_search_at_one_epsilon_serves_every_epsilon(tmp_path, fake_train):
    folder = _write(
        tmp_path,
        SEARCHED.replace("max_extensions = 2", "max_extensions = 2\nepsilon = 1.0") % "dpsgd",
    )
    exp = load_experiment("tiny", folder)
    assert [(a.name, e) for a, e, _ in exp.search_units()] == [("A", 1.0), ("B", 1.0)]
    code, _, err = cli(
        "reproduce",
        "tiny",
        "--experiments-dir",
        str(folder),
        "--db",
        str(tmp_path / "r.db"),
        "--quiet",
        "--no-export",
    )
    assert code == 0, err
    store = RunStore(tmp_path / "r.db")
    p = plan(exp, store)
    store.close()
    assert not p.todo and {c.selection["chosen"]["lr"] for c in p.cells if c.arm == "A"} == {1}
    assert {c.epsilon for c in p.cells if c.arm == "A"} == {1.0, 2.0}


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            (
                "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
                "search = { lr = [0.001, 0.002, 0.003] }",
            ),
            "arm 'B' searches 3 grid points, arm 'A' 4: every searched arm gets the same budget",
        ),
        (
            (
                "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
                "search = { lr = [0.001, 0.002], clip = [0.1, 1] }",
            ),
            None,
        ),  # 2 × 2 = 4 points: the same budget
        (
            ('name = "B"\n', 'name = "B"\nepochs = 2\n'),
            "arm 'B' searches with 2 epochs, arm 'A' with 1",
        ),
        (
            ('name = "B"\n', 'name = "B"\nepochs = 2\n', "[search]\n", "[search]\nepochs = 3\n"),
            None,
        ),
        (
            (
                "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
                "search = { epochs = [1, 2, 3, 4] }",
            ),
            "'epochs' cannot be searched",
        ),
        (
            (
                "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
                'search = { "mechanism_options.noise_on" = ["sum", "average"], lr = [1, 2] }',
            ),
            None,
        ),  # a dotted axis names one mechanism option: 2 × 2 = 4 points
        (
            (
                "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
                'search = { "optimizer.lr" = [1, 2, 3, 4] }',
            ),
            "unknown search axis 'optimizer.lr' (a dotted axis names one option of",
        ),
        (("lr = [0.5, 1, 2, 4]", "lr = [2, 1, 0.5, 4]"), "must increase"),
        (("lr = [0.5, 1, 2, 4]", "lr = [0.5]"), "at least 2 values"),
        (("validation = 50\nseeds = [0, 1]", "seeds = [0, 1]"), "[search] needs 'validation'"),
        (("[quick]\nvalidation = 50", "[quick]"), "needs [quick] validation"),
        (("[search.space]\nlr = [0.5, 1, 2, 4]\n", ""), "arm 1 ('A'): no search space"),
        (("search = false", "search = true"), "'search' must be a table of axes"),
        (("[search]\n", "[search]\nseed = 3\n"), "cannot set seed"),
    ],
)
def test_search_configs_are_checked(tmp_path, edit, needle):
    text = SEARCHED % "dpsgd"
    for old, new in zip(edit[::2], edit[1::2]):
        assert old in text
        text = text.replace(old, new)
    folder = _write(tmp_path, text)
    if needle is None:
        load_experiment("tiny", folder)
        return
    with pytest.raises(PrivgradError, match=re.escape(needle)):
        load_experiment("tiny", folder)
    code, _, err = cli(
        "reproduce", "tiny", "--experiments-dir", str(folder), "--db", str(tmp_path / "r.db")
    )
    assert (
        code == 2
        and len(err.strip().splitlines()) == 1
        and err.startswith("error:")
        and needle in err
    )


@pytest.mark.parametrize(
    "search_epochs,words",
    [
        (None, None),
        ("2", None),
        ("1", ("smaller", "fewer", "less")),
        ("3", ("larger", "more", "more")),
    ],
)
def test_a_private_search_of_other_epochs_than_the_test_is_flagged(tmp_path, search_epochs, words):
    """σ for a fixed ε depends on the steps: a search shorter than the test runs tunes at less
    noise (spectral-t1-cifar4k-model3's 10-epoch choice diverged in 30-epoch test runs)."""
    text = (SEARCHED % "dpsgd").replace("epochs = 1\nbatch_size", "epochs = 2\nbatch_size", 1)
    if search_epochs is not None:
        text = text.replace("[search]\n", f"[search]\nepochs = {search_epochs}\n")
    caveat = load_experiment("tiny", _write(tmp_path, text)).search_epochs_caveat()
    if words is None:
        assert caveat is None
    else:
        assert caveat == (
            f"the search trains {search_epochs} epochs, the test runs 2: σ for the same ε is "
            f"{words[0]} over {words[1]} steps, so the search tuned at {words[2]} noise than the "
            "test runs train with"
        )


def test_an_arm_search_needs_a_search_section(tmp_path):
    folder = _write(tmp_path, TINY % "dpsgd" + "search = { lr = [1, 2] }\n")
    with pytest.raises(PrivgradError, match=r"'search' needs a \[search\] section"):
        load_experiment("tiny", folder)


@pytest.mark.parametrize(
    "values,low,high",
    [
        ([0.5, 1, 2, 4], 0.25, 8.0),  # geometric: the grid's ratio
        ([0.1, 0.2, 0.3], 0.0, 0.4),  # linear: its step
        ([0.1, 0.3, 1.0], 0.1 / 3, 1 / 0.3),  # neither: the ratio at that edge
        ([-1.0, 0.0, 2.0], -2.0, 4.0),  # not positive: the step at that edge
        ([256, 512], 128, 1024),  # integers stay integers
        ([1, 2, 3], 0, 4),
    ],
)
def test_next_value_beyond_an_edge(values, low, high):
    from privgrad.lab.reproduce import next_value

    assert math.isclose(next_value(values, "low"), low, abs_tol=1e-12)
    assert math.isclose(next_value(values, "high"), high)
    assert isinstance(next_value(values, "high"), int) == all(isinstance(v, int) for v in values)


def test_sigterm_to_reproduce_stops_its_worker_cells(tmp_path):
    """SIGTERM sent to `privgrad reproduce --jobs 2` alone (as a scheduler sends it) stops the
    cells running in its worker processes too: they are stored 'interrupted', the command
    exits at once instead of waiting for them to finish, and no worker outlives it by taking
    one of the cells still queued (4 cells on 2 workers: the pool has queued a third)."""
    import contextlib
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    from cli_helpers import wait_for_first_epoch

    long = TINY.replace("epochs = 1\nbatch_size = 50", "epochs = 400\nbatch_size = 50", 1)
    long = long.replace("seeds = [0, 1]", "seeds = [0, 1, 2, 3]", 1)
    folder = _write(tmp_path, long % "dpsgd")
    db = tmp_path / "r.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "privgrad",
            "reproduce",
            "tiny",
            "--experiments-dir",
            str(folder),
            "--db",
            str(db),
            "--jobs",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_for_first_epoch(proc, db)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        survivors = _group_alive_after(proc.pid, seconds=5)
    finally:  # a failure must not leave orphaned workers training: kill the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert not survivors, "worker processes outlived `privgrad reproduce` after its SIGTERM"
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert "Traceback" not in err.decode()
    assert "leaked semaphore" not in err.decode(), err.decode()
    statuses = [s for (s,) in sqlite3.connect(db).execute("SELECT status FROM runs")]
    assert statuses and set(statuses) == {"interrupted"}, statuses


@pytest.fixture(scope="module")
def two_epoch_grid(tmp_path_factory):
    """A two-cell grid of two epochs (4 steps each), and a run store where it ran uninterrupted."""
    import privgrad.lab.reproduce as rp

    folder = tmp_path_factory.mktemp("two_epochs")
    two_epochs = TINY.replace("epochs = 1\nbatch_size = 50", "epochs = 2\nbatch_size = 50", 1)
    exp = load_experiment("tiny", _write(folder, two_epochs % "dpsgd"))
    rp.reproduce(exp, folder / "reference.db", progress=False, echo=lambda *a, **k: None)
    return exp, folder / "reference.db"


@pytest.mark.parametrize(
    "then", ["same code", "killed", "other code", "corrupt file", "unusable state"]
)
def test_a_cell_stopped_mid_run_goes_on_from_its_checkpoint(
    tmp_path, monkeypatch, then, two_epoch_grid
):
    """A grid stopped inside a cell resumes that cell from its checkpoint, as the same run,
    to the record an uninterrupted grid gives (same accuracy, ε and epoch rows). A stopped run
    that other code started, or whose checkpoint does not load, is left as it is and the cell
    starts afresh; one whose checkpoint loads but cannot go on fails once, is marked failed,
    and the next invocation starts the cell afresh."""
    import privgrad.lab.reproduce as rp
    from privgrad.app.checkpoint import FILENAME, checkpoint_dir, load_checkpoint, save_checkpoint
    from cli_helpers import interrupt_at_step

    exp, reference = two_epoch_grid
    quiet = dict(progress=False, echo=lambda *a, **k: None)
    ref = {r["record"]["cell"]: r for r in RunStore(reference).runs()}
    db = tmp_path / "r.db"
    with monkeypatch.context() as m:
        if then == "other code":  # the checkpoint says which code started the run
            m.setattr("privgrad.app.train.code_version", lambda: "src-other")
        interrupt_at_step(m, 11)  # cell 1: steps 1-8 (2 epochs of 4); cell 2 stops at its 3rd
        with pytest.raises(KeyboardInterrupt):
            rp.reproduce(exp, db, **quiet)
    store = RunStore(db)
    assert [r["status"] for r in store.runs()] == ["interrupted", "completed"]
    assert store.epochs(2) == [] and load_checkpoint(checkpoint_dir(db, 2))["trainer"]["steps"] == 2
    folder = checkpoint_dir(db, 2)
    victim = rp.cell_key(store.run(2)["config"])
    if then == "killed":  # SIGKILL: no 'interrupted' written, the process gone (it is 'lost')
        import sqlite3
        import subprocess
        import sys

        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        with sqlite3.connect(db) as raw:
            raw.execute("UPDATE runs SET status='running', pid=? WHERE id=2", (gone.pid,))
        assert store.run(2)["status"] == "lost"
    if then == "same code":  # --dry-run says which cells go on from a checkpoint
        dry = ["reproduce", "tiny", "--experiments-dir", str(reference.parent / "experiments")]
        code, out, _ = cli(*dry, "--db", str(db), "--dry-run")
        assert code == 0 and "1 to run" in out
        assert "1 of the cells to run go on from their checkpoints (runs 2)" in out
    if then == "corrupt file":
        (folder / FILENAME).write_bytes((folder / FILENAME).read_bytes()[:-10])
    if then == "unusable state":  # loads (its hash is recomputed), but holds no trainer steps
        state = load_checkpoint(folder)
        del state["trainer"]["steps"]
        save_checkpoint(folder, state)
        out = rp.reproduce(exp, db, **quiet)
        assert [c.key for c, _ in out["failures"]] == [victim] and out["ran"] == 0
        assert store.run(2)["status"] == "failed"
    out = rp.reproduce(exp, db, **quiet)
    assert not out["failures"] and out["ran"] == 1
    runs = {r["id"]: r for r in store.runs()}
    if then in ("same code", "killed"):
        assert sorted(runs) == [1, 2] and runs[2]["status"] == "completed"
        mine = runs[2]["record"]
        assert mine["resumes"] == 1 and mine["cell"] == victim
        assert "started_by_code_version" not in mine  # started and finished by this code
    else:  # the stopped run stays stopped; a new run makes its cell
        assert runs[2]["status"] == ("failed" if then == "unusable state" else "interrupted")
        assert sorted(runs) == [1, 2, 3]
        (mine,) = [r["record"] for i, r in runs.items() if i > 2 and r["record"]["cell"] == victim]
        assert "resumes" not in mine
    other = ref[victim]["record"]
    for key in ("test_accuracy", "epsilon", "epsilon_claimed", "steps", "seed"):
        assert mine[key] == other[key], key

    def timeless(rows):
        return [{k: v for k, v in row.items() if "time" not in k} for row in rows]

    assert timeless(store.epochs(mine["run_id"])) == timeless(
        RunStore(reference).epochs(ref[victim]["id"])
    )


def _group_alive_after(pgid: int, seconds: float) -> bool:
    """Whether any process of group ``pgid`` is still alive ``seconds`` s from now (exited
    ones that nobody reaps are not alive)."""
    import time
    from pathlib import Path

    deadline = time.time() + seconds
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive or time.time() > deadline:
            return bool(alive)
        time.sleep(0.2)


def test_a_dotted_search_axis_sets_one_mechanism_option(tmp_path):
    """mechanism_options.<key> as a search axis replaces that option only: the arm's other
    options stay, and the test cell at the chosen value has the same options."""
    text = (
        (SEARCHED % "dpsgd")
        .replace('mechanism = "dp-signsgd"', 'mechanism = "spectral-dp"')
        .replace(
            "search = { lr = [0.001, 0.002, 0.003, 0.004] }",
            'mechanism_options = { noise = "paper", filter_ratio = 0.5 }\n'
            'search = { "mechanism_options.filter_ratio" = [0.25, 0.5], lr = [1, 2] }',
        )
    )
    exp = load_experiment("tiny", _write(tmp_path, text))
    arm = exp.arm("B")
    point = {"mechanism_options.filter_ratio": 0.25, "lr": 2}
    cfg = exp.train_config(arm, 1.0, "honest", 0, point=point, search=True)
    assert cfg.mechanism_options == {"noise": "paper", "filter_ratio": 0.25}
    assert cfg.lr == 2 and cfg.validation == 50
    assert arm.fields["mechanism_options"] == {"noise": "paper", "filter_ratio": 0.5}
    test = exp.train_config(arm, 1.0, "honest", 0, point=point)
    assert test.mechanism_options == cfg.mechanism_options and test.validation == 0
