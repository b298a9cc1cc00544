"""privgrad reproduce: experiment configs, cell identity, skip/resume, and --quick end to end.

Every runnable experiment is run with --quick here (or, for IMDB, in test_report.py, which
builds a report from that run); a runnable experiment that needs a name privgrad lacks fails.
"""
import dataclasses
import re
import time

import pytest
from click.testing import CliRunner

from privgrad.errors import PrivgradError
from privgrad.reproduce import (REPO_ROOT, cell_key, code_version, completed_cells, list_experiments,
                                load_experiment, plan)
from privgrad.store import RunStore
from privgrad.train import TrainConfig

# mechanisms and models that other issues are adding; an experiment may wait for these only
# experiments whose --quick run happens in test_report.py, which builds a report from it
# (split so that each test file stays under a minute)
QUICK_IN_REPORT_TEST = {"bottleneck-t3-imdb", "gredp-t1-mnist", "bottleneck-t4-mnist"}
JOBS_AND_EXPORT = "bottleneck-t4-fmnist"
SEEDS_DIR = REPO_ROOT.parent / "shared" / "seeds"

EXPERIMENTS = list_experiments()
RUNNABLE = [e.id for e in EXPERIMENTS if e.runnable]


def cli(*args):
    from privgrad.cli import main
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_there_is_an_experiment_per_reproduction_target():
    ids = {e.id for e in EXPERIMENTS}
    assert {"bottleneck-t3-mnist", "bottleneck-t3-fmnist", "bottleneck-t3-imdb", "gredp-t1-mnist",
            "gredp-t1-cifar10", "spectral-t1-mnist", "spectral-t1-cifar10", "gip-t5-cifar10",
            "rdpgan-t4-mnist"} <= ids
    assert {"bottleneck-t3-mnist", "bottleneck-t3-fmnist", "bottleneck-t3-imdb"} <= set(RUNNABLE)


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=lambda e: e.id)
def test_config_cites_the_paper_and_states_what_was_scaled(exp):
    assert exp.title and exp.paper and exp.table and exp.page
    for arm in exp.arms:
        # an arm the paper does not have (a sound baseline) must say so in its note
        assert arm.paper or "not in the paper" in arm.note, f"{exp.id}/{arm.name}: no paper number"
        if arm.private:
            assert set(arm.paper) <= set(exp.arm_epsilons(arm)), f"{exp.id}/{arm.name}: paper ε not in the grid"
    if exp.runnable:
        assert exp.scaled_down.get("reason") and exp.scaled_down.get("epochs") and exp.scaled_down.get("data")
        assert exp.quick["limit_train"] <= 500 and exp.quick["epochs"] <= 1
        assert len(exp.cells(quick=True)) <= 10 and {c.seed for c in exp.cells(quick=True)} == {0}
    else:
        assert len(exp.reason) > 20


@pytest.mark.skipif(not SEEDS_DIR.exists(), reason="../shared/seeds not present")
@pytest.mark.parametrize("exp", EXPERIMENTS, ids=lambda e: e.id)
def test_paper_numbers_are_in_the_cited_table(exp):
    """Reference data: each paper number is printed within the cited table of the seed text."""
    lines = (SEEDS_DIR / exp.seed_file).read_text(errors="replace").splitlines()
    head = lines[exp.seed_line - 1]
    assert exp.table.split()[-1] in head and "table" in head.lower(), head[:120]
    window = "\n".join(lines[exp.seed_line - 1: exp.seed_line + 30])
    for arm in exp.arms:
        for value in arm.paper.values():
            forms = {f"{value:g}", f"{value:.1f}", f"{value:.2f}", f"{value / 100:.3g}"}
            assert any(re.search(r"(?<![0-9])" + re.escape(f) + r"(?![0-9])", window) for f in forms), \
                f"{exp.id}/{arm.name}: {value} not in {exp.seed_file} from line {exp.seed_line}"


def test_cell_key_is_canonical():
    a = TrainConfig(epochs=20, batch_size=512, lr=2)
    b = TrainConfig(epochs=20.0, batch_size=512.0, lr=2.0, data_dir="/elsewhere")
    assert cell_key(a) == cell_key(b)
    assert cell_key(a) != cell_key(TrainConfig(epochs=20, batch_size=512, lr=2, seed=1))
    assert cell_key(a) != cell_key(TrainConfig(epochs=20, batch_size=512, lr=2, mechanism_options={"x": 1}))
    # a field added later is hashed only away from its default (committed cells keep their keys)
    assert cell_key(a) == cell_key({k: v for k, v in dataclasses.asdict(a).items() if k != "validation"})
    assert cell_key(a) != cell_key(TrainConfig(epochs=20, batch_size=512, lr=2, validation=100))
    assert re.fullmatch(r"src-[0-9a-f]{16}", code_version()) and code_version() == code_version()


def _write(tmp_path, text, name="tiny"):
    folder = tmp_path / "experiments"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.toml").write_text(f'id = "{name}"\n' + text)
    return folder


TINY = '''
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
'''


def test_unknown_mechanism_is_a_one_line_error(tmp_path):
    folder = _write(tmp_path, TINY % "dp-magic")
    code, _, err = cli("reproduce", "tiny", "--experiments-dir", str(folder), "--db", str(tmp_path / "r.db"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert "needs mechanism 'dp-magic'" in lines[0]


def test_not_runnable_experiment_is_a_one_line_error(tmp_path):
    code, _, err = cli("reproduce", "gip-t5-cifar10", "--db", str(tmp_path / "r.db"))
    assert code == 2 and err.strip().startswith("error: experiment 'gip-t5-cifar10' cannot be reproduced here")
    code, _, err = cli("reproduce", "no-such-table", "--db", str(tmp_path / "r.db"))
    assert code == 2 and "unknown experiment 'no-such-table'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bad,needle", [
    ('\n[[arms]]\nname = "B"\nmechanism = "dpsgd"\nlearning_rate = 1\n', "unknown key(s) learning_rate"),
    ('\n[[arms]]\nname = "A"\nmechanism = "dpsgd"\n', "duplicate arm name"),
    ('\n[[arms]]\nname = "B"\nmechanism = "dpsgd"\ntargets = ["paper"]\n', "targets must be"),
])
def test_config_mistakes_are_caught(tmp_path, bad, needle):
    folder = _write(tmp_path, TINY % "dpsgd" + bad)
    with pytest.raises(PrivgradError, match=re.escape(needle)):
        load_experiment("tiny", folder)
    (folder / "other.toml").write_text((folder / "tiny.toml").read_text())
    with pytest.raises(PrivgradError, match="must equal the file name"):
        load_experiment(folder / "other.toml")


def test_list_shows_every_experiment():
    code, out, _ = cli("reproduce", "--list")
    assert code == 0 and all(e.id in out for e in EXPERIMENTS)


@pytest.fixture(scope="module")
def quick_db(tmp_path_factory):
    return tmp_path_factory.mktemp("reproduce") / "runs.db"


@pytest.mark.parametrize("exp_id", [e for e in RUNNABLE if e not in QUICK_IN_REPORT_TEST])
def test_quick_runs_end_to_end(exp_id, quick_db, tmp_path):
    exp = load_experiment(exp_id)
    assert not exp.missing(), f"{exp_id} is marked runnable but needs {exp.missing()}"
    # one experiment also exercises --jobs (worker processes) and --export
    extra = ["--jobs", "2", "--export", "--results-dir", str(tmp_path)] if exp_id == JOBS_AND_EXPORT else []
    code, _, err = cli("reproduce", exp_id, "--quick", "--db", str(quick_db), "--quiet", *extra)
    assert code == 0, err
    store = RunStore(quick_db)
    done = completed_cells(store, None)     # (any code version: others may edit code meanwhile)
    store.close()
    cells = exp.cells(quick=True)
    for cell in cells:
        rec = done[cell.key]
        assert rec["experiment"] == exp_id and rec["quick"] is True and rec["arm"] == cell.arm
        assert 0 <= rec["test_accuracy"] <= 1 and rec["train_size"] == exp.quick["limit_train"]
        if cell.epsilon is not None:
            target_eps = rec["epsilon"] if cell.target == "honest" else rec["epsilon_claimed"]
            assert target_eps <= cell.epsilon * (1 + 1e-6) and target_eps > 0.9 * cell.epsilon
    assert f"{len(cells)} cells run, 0 skipped, 0 failed" in err
    assert err.count("smoke run: not a result") == len(cells) and "✓" not in err   # --quick: no verdict
    if extra:
        import json
        exported = json.loads((tmp_path / "reproduce" / f"{exp_id}.json").read_text())
        assert [r["cell"] for r in exported] == [c.key for c in cells]
        assert all(r["experiment"] == exp_id and "run_id" not in r for r in exported)


def test_rerun_skips_done_cells_and_resumes_after_interruption(quick_db):
    exp = load_experiment("bottleneck-t3-mnist")
    store = RunStore(quick_db)
    if plan(exp, store, quick=True).todo:   # run on its own: make the quick run here
        code, _, err = cli("reproduce", "bottleneck-t3-mnist", "--quick", "--db", str(quick_db), "--quiet")
        assert code == 0, err
    p = plan(exp, store, quick=True)
    assert not p.todo
    # a second invocation runs nothing
    start = time.time()
    code, _, err = cli("reproduce", "bottleneck-t3-mnist", "--quick", "--db", str(quick_db), "--quiet")
    assert code == 0 and "0 cells run, 3 skipped" in err and time.time() - start < 20
    # a cell whose run was interrupted is run again, and only that one
    victim = p.done[p.cells[1].key]["run_id"]
    store.abort(victim, "interrupted")
    p2 = plan(exp, store, quick=True)
    assert [c.key for c in p2.todo] == [p.cells[1].key]
    code, out, err = cli("reproduce", "bottleneck-t3-mnist", "--quick", "--db", str(quick_db), "--dry-run")
    assert code == 0 and "2 done, 1 to run" in out
    code, _, err = cli("reproduce", "bottleneck-t3-mnist", "--quick", "--db", str(quick_db), "--quiet")
    assert code == 0 and "1 cells run, 2 skipped" in err
    # another code version: everything is to be redone, unless --any-version
    import privgrad.reproduce as rp
    real = rp.code_version
    try:
        rp.code_version = lambda: "src-0000000000000000"
        assert len(plan(exp, store, quick=True).todo) == 3
        assert len(plan(exp, store, quick=True, any_version=True).todo) == 0
    finally:
        rp.code_version = real
    assert len(plan(exp, store, quick=True, force=True).todo) == 3
    store.close()
