"""The command line: one-line errors, the JSON record, the run store."""

import json
import sqlite3
import subprocess
import sys

import pytest

from privgrad.app.store import RunStore
from privgrad.app.train import TrainConfig, train
from cli_helpers import interrupt_at_step, run_cli, wait_for_first_epoch


EPS = ["epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "1", "--steps", "10"]
TINY = ["--limit-train", "100", "--limit-test", "50", "--epochs", "1", "--quiet"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--epsilon", "0"], "--epsilon must be a finite number > 0, got 0.0"),
        (["train", "--epsilon", "-1"], "--epsilon must be"),
        (["train", "--delta", "1.5"], "--delta must be a finite number in (0, 1), got 1.5"),
        (["train", "--delta", "0"], "--delta must be"),
        (
            ["train", "--noise-multiplier", "-0.5"],
            "--noise-multiplier must be a finite number in [0, 1000000]",
        ),
        (["train", "--mechanism", "dp-magic", "--limit-train", "10"], "unknown mechanism"),
        (
            ["train", "--mechanism", "python:mine:MECHANISM", "--limit-train", "10"],
            "(PRIVGRAD_MECHANISMS=python:mine:MECHANISM)",
        ),
        (["train", "--dataset", "svhn"], "unknown dataset"),
        (["train", "--validation", "-1"], "--validation must be an integer ≥ 0, got -1"),
        (["train", "--limit-train", "100", "--validation", "100"], "leaves no training data"),
        (EPS + ["--delta", "2"], "--delta must be"),
        # issue 14, case 3: no silent run without a guarantee, no NaN model
        (
            ["train", "--clip", "inf", "--epsilon", "1"],
            "--clip must be a finite number > 0, got inf",
        ),
        (["train", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        # case 7: no overflow
        (["train", "--epochs", "inf"], "--epochs must be a finite number in (0, 1000000], got inf"),
        (
            EPS[:-1] + ["100000000000"],
            "--steps must be an integer in [0, 10000000], got 100000000000",
        ),
        # case 8: zero, infinite and NaN values; a folder that does not exist
        (["audit", "--trials", "0"], "--trials must be an integer in [1, 100000000], got 0"),
        (
            EPS[:4] + ["inf"] + EPS[5:],
            "--noise-multiplier must be a finite number in [0, 1000000], got inf",
        ),
        (
            EPS[:4] + ["nan"] + EPS[5:],
            "--noise-multiplier must be a finite number in [0, 1000000], got nan",
        ),
        (
            ["report", "--results-dir", "/nonexistent"],
            "no results folder /nonexistent; pass --results-dir",
        ),
        (
            ["reproduce", "--list", "--experiments-dir", "/nonexistent"],
            "no experiments folder /nonexistent",
        ),
        # case 11: the error names the option the user typed
        (["train", "--keep-ratio", "0.1"], "mechanism 'dpsgd' does not use option(s) --keep-ratio"),
        (["train", "--seed", "nan"], "Invalid value for '--seed': 'nan' is not a valid integer."),
        # options the run would not use, which it ran without and recorded as given
        (
            ["train", "--mechanism", "dp-adam", "--momentum", "0.5", *TINY],
            "--momentum applies to SGD; this run's optimizer is adam (dp-adam's own)",
        ),
        (
            ["train", "--optimizer", "adam", "--momentum", "0.5", *TINY],
            "--momentum applies to SGD; this run's optimizer is adam: leave --momentum out",
        ),
        (
            ["train", "--mechanism", "non-private", "--clip", "0.5", *TINY],
            "--clip: the non-private mechanism does not clip; for clipping without noise, use "
            "--mechanism dpsgd --noise-multiplier 0",
        ),
        (
            ["train", "--noise-multiplier", "1", "--target", "claimed", *TINY],
            "--target claimed calibrates σ to --epsilon; with --noise-multiplier there is",
        ),
        (["train", "--precision", "fp8"], "Invalid value for '--precision': 'fp8' is not one of"),
        # an image model on Adult's feature vectors (wrn failed in its first conv, a traceback)
        (
            ["train", "--dataset", "adult", "--model", "wrn", "--limit-train", "100"],
            "model 'wrn' takes images (channels, height, width); the data's examples have shape "
            "(108,): use bilstm (token ids), mlp",
        ),
    ],
)
def test_invalid_input_gives_one_line_error(args, needle, tmp_path):
    code, _, err = (
        run_cli(*args, "--db", str(tmp_path / "r.db")) if args[0] == "train" else run_cli(*args)
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (
        err
    )


def test_adult_trains_with_the_built_in_mlp(tmp_path):
    code, out, err = run_cli(
        "train", "--dataset", "adult", "--model", "mlp", "--limit-train", "400", "--epochs", "1",
        "--json", "--db", str(tmp_path / "r.db"),
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out.splitlines()[-1])
    assert record["model"] == "mlp" and record["train_size"] == 400
    assert record["steps"] == round(1 / record["sampling_rate"])
    assert 0 <= record["test_accuracy"] <= 1 and 0 < record["epsilon"] < 1.01


def test_error_in_a_real_process_has_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "privgrad.app.cli", "train", "--epsilon", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --epsilon must be a finite number > 0, got 0.0"


def test_missing_data_names_file_and_places(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from privgrad.app.cli import main
    from privgrad.app.data import locate

    monkeypatch.setattr(locate, "REPO_ROOT", tmp_path / "repo")  # hide data/ and ../shared/data
    monkeypatch.delenv("PRIVGRAD_DATA", raising=False)
    result = CliRunner().invoke(
        main,
        [
            "train",
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            str(tmp_path / "none"),
            "--db",
            str(tmp_path / "r.db"),
        ],
    )
    line = result.stderr.strip()
    assert result.exit_code == 2 and len(line.splitlines()) == 1
    assert str(tmp_path / "none") in line and "train-images-idx3-ubyte.gz" in line
    assert str(tmp_path / "repo" / "data") not in line  # a named folder is the only one searched
    result = CliRunner().invoke(
        main, ["train", "--dataset", "fashion-mnist", "--db", str(tmp_path / "r.db")]
    )
    assert result.exit_code == 2 and str(tmp_path / "repo" / "data") in result.stderr


def test_a_delta_below_the_pld_accountants_reach_is_said_so(tmp_path):
    """PLD's ε = ∞ at δ = 1e-300 is its truncated tails, not a missing guarantee (RDP's is
    finite); without noise both are ∞ with no guarantee; calibration says why it fails."""
    code, out, _ = run_cli(
        "epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "1", "--steps", "10",
        "--delta", "1e-300",
    )  # fmt: skip
    assert code == 0 and "ε (PLD) = ∞ (δ is below what the PLD accountant resolves" in out, out
    assert "ε (RDP) = 72." in out
    code, out, _ = run_cli(
        "epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "0", "--steps", "10"
    )
    assert code == 0 and out.count("∞ (no DP guarantee)") == 2, out
    code, _, err = run_cli(
        "train", "--limit-train", "200", "--delta", "1e-300", "--quiet", "--db",
        str(tmp_path / "r.db"),
    )  # fmt: skip
    assert code == 2 and "beyond what the accountants resolve" in err, err


def test_epsilon_command_json():
    code, out, _ = run_cli(
        "epsilon",
        "--sampling-rate",
        "0.017",
        "--noise-multiplier",
        "2.0",
        "--steps",
        "677",
        "--json",
    )
    assert code == 0
    out = json.loads(out.strip().splitlines()[-1])
    assert out["epsilon_pld"] <= out["epsilon_rdp"] < 1.1


def test_train_json_record_and_run_store(tmp_path):
    db = tmp_path / "runs.db"
    code, out, err = run_cli(
        "train",
        "--limit-train",
        "600",
        "--epochs",
        "1",
        "--batch-size",
        "100",
        "--epsilon",
        "2",
        "--json",
        "--quiet",
        "--db",
        str(db),
        "--out",
        str(tmp_path / "r.json"),
    )
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    # the relation the accountant proves ε for (dp-accounting's default: add or remove one example)
    assert record["neighbouring"] == "add/remove one example (Poisson sampling)"
    for key in [
        "mechanism",
        "dataset",
        "model",
        "test_accuracy",
        "epsilon",
        "epsilon_claimed",
        "delta",
        "noise_multiplier",
        "effective_noise_multiplier",
        "sampling_rate",
        "steps",
        "epochs",
        "seed",
        "wall_time_s",
        "neighbouring",
    ]:
        assert key in record
    assert record["steps"] == 6 and record["sampling_rate"] == pytest.approx(100 / 600)
    assert 1.9 < record["epsilon"] <= 2.0 and record["epsilon_claimed"] == record["epsilon"]
    assert json.loads((tmp_path / "r.json").read_text())["epsilon"] == record["epsilon"]
    runs = RunStore(db).runs()
    assert runs[0]["status"] == "completed" and runs[0]["record"]["epsilon"] == record["epsilon"]
    assert len(RunStore(db).epochs(runs[0]["id"])) == 1
    code, listing, _ = run_cli("runs", "--db", str(db))
    assert code == 0 and "completed" in listing


def test_bf16_run_records_its_precision_and_spends_the_fp32_epsilon(tmp_path):
    """--precision reaches the trainer (the record says bf16, a resumed run keeps it through
    its TrainConfig) and changes the gradients, not the mechanism: ε as in fp32."""
    records = {}
    for precision in ("fp32", "bf16"):
        code, out, err = run_cli(
            "train", "--limit-train", "600", "--epochs", "1", "--batch-size", "100",
            "--epsilon", "2", "--json", "--quiet", "--precision", precision,
            "--db", str(tmp_path / "runs.db"),
        )  # fmt: skip
        assert code == 0, err
        records[precision] = json.loads(out.strip().splitlines()[-1])
    assert records["bf16"]["precision"] == "bf16" and records["fp32"]["precision"] == "fp32"
    assert records["bf16"]["epsilon"] == records["fp32"]["epsilon"]
    stored = RunStore(tmp_path / "runs.db").runs()
    assert sorted(r["config"]["precision"] for r in stored) == ["bf16", "fp32"]


def test_validation_split_is_fixed_disjoint_and_replaces_the_test_set(tmp_path):
    import torch
    from privgrad.app.train import split_validation

    x, y = torch.arange(1000).float()[:, None], torch.arange(1000)
    tx, ty, vx, vy = split_validation(x, y, 200)
    assert len(vx) == 200 and len(tx) == 800 and set(ty.tolist()).isdisjoint(vy.tolist())
    assert torch.equal(split_validation(x, y, 200)[3], vy)  # the same split every time
    assert torch.all(ty[1:] > ty[:-1])  # the rest keep their order
    assert not torch.all(vy[1:] - vy[:-1] == 1)  # not simply the last rows
    code, out, err = run_cli(
        "train",
        "--limit-train",
        "600",
        "--validation",
        "100",
        "--epochs",
        "1",
        "--batch-size",
        "100",
        "--epsilon",
        "2",
        "--json",
        "--quiet",
        "--db",
        str(tmp_path / "r.db"),
    )
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["test_accuracy"] is None and 0 <= record["validation_accuracy"] <= 1
    assert record["validation_size"] == 100 and record["train_size"] == 500
    assert record["sampling_rate"] == pytest.approx(100 / 500)
    assert "validation accuracy" in err
    code, listed, err = run_cli("runs", "--db", str(tmp_path / "r.db"))
    assert code == 0 and f"{record['validation_accuracy']:.4f}" in listed, listed  # it showed -


def test_limit_test_evaluates_on_a_fixed_sample_of_the_test_set(tmp_path, monkeypatch):
    import torch
    from privgrad.app.train import TrainConfig, load_training_data
    from privgrad.errors import PrivgradError

    full_x, full_y = load_training_data(TrainConfig())["eval"]
    x, y = load_training_data(TrainConfig(limit_test=300))["eval"]
    again = load_training_data(TrainConfig(limit_test=300, seed=5))["eval"]
    assert len(full_y) == 10_000 and len(y) == 300 and torch.equal(again[0], x)  # the same sample
    rows = {tuple(r) for r in full_x.flatten(1)[:, ::7].tolist()}
    assert all(tuple(r) in rows for r in x.flatten(1)[:, ::7].tolist())  # test examples
    assert not torch.equal(y, full_y[:300])  # not the first ones (IMDB's are sorted by label)
    assert len(load_training_data(TrainConfig(limit_test=10**6))["eval"][1]) == 10_000
    # a run with a validation split evaluates on it, whatever limit_test says
    held = load_training_data(TrainConfig(limit_train=600, validation=100, limit_test=5))["eval"]
    assert len(held[1]) == 100
    # a user's Dataset (python:module:function) is sampled the same way
    (tmp_path / "limit_test_data.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "def data():\n"
        "    x = torch.arange(80.0)[:, None]\n"
        "    return TensorDataset(x, torch.zeros(80, dtype=torch.long)), "
        "TensorDataset(x[:50], torch.zeros(50, dtype=torch.long)), 2\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:  # (a module name of its own, forgotten after: other tests import their own userdata)
        config = TrainConfig(dataset="python:limit_test_data:data", limit_test=7)
        test = load_training_data(config)["eval"]
    finally:
        sys.modules.pop("limit_test_data", None)
    picked = [int(test[i][0]) for i in range(len(test))]
    assert len(picked) == 7 and picked == sorted(set(picked)) and max(picked) < 50
    assert picked != list(range(7))
    with pytest.raises(PrivgradError, match="--limit-test must be an integer ≥ 1, got 0"):
        TrainConfig(limit_test=0).validate()
    code, _, err = run_cli("train", "--limit-test", "0", "--quiet")
    assert code != 0 and "--limit-test must be an integer ≥ 1, got 0" in err


def test_interrupted_run_is_recorded_as_interrupted(tmp_path, monkeypatch):
    interrupt_at_step(monkeypatch, 3)
    store = RunStore(tmp_path / "runs.db")
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(limit_train=500, epochs=1, batch_size=50), store=store, progress=False)
    row = (
        sqlite3.connect(tmp_path / "runs.db").execute("SELECT status, record FROM runs").fetchone()
    )
    assert row == ("interrupted", None)


def test_a_run_stopped_before_its_first_checkpoint_says_there_is_nothing_to_resume(
    tmp_path, monkeypatch
):
    """Ctrl-C while a run starts (data, calibration) left it stored without a checkpoint, and
    the message offered 'privgrad resume N', which then failed with 'no checkpoint at ...'."""
    from privgrad.app import train as train_module

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "make_private", stop)
    code, _, err = run_cli("train", "--limit-train", "300", "--db", str(tmp_path / "r.db"))
    assert code == 130 and "run 1 stopped before its first checkpoint" in err, err
    assert "privgrad resume" not in err


def test_sigterm_is_handled_like_ctrl_c(tmp_path, monkeypatch):
    """SIGTERM (schedulers, CI time-outs) stops a run as Ctrl-C does: stored 'interrupted'."""
    import os
    import signal

    from privgrad import private
    from privgrad.signals import Terminated, terminations_as_interrupts

    calls = {"n": 0}
    original = private.PrivateTrainer.step

    def step(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batch)

    monkeypatch.setattr(private.PrivateTrainer, "step", step)
    store = RunStore(tmp_path / "runs.db")
    with pytest.raises(Terminated) as stop, terminations_as_interrupts():
        train(TrainConfig(limit_train=500, epochs=1, batch_size=50), store=store, progress=False)
    assert stop.value.exit_code == 128 + signal.SIGTERM and calls["n"] == 3
    row = (
        sqlite3.connect(tmp_path / "runs.db").execute("SELECT status, record FROM runs").fetchone()
    )
    assert row == ("interrupted", None)
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is restored


def test_sigterm_to_the_cli_process_stores_interrupted(tmp_path):
    import signal

    db = tmp_path / "t.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "privgrad.app.cli",
            "train",
            "--limit-train",
            "1000",
            "--batch-size",
            "100",
            "--epochs",
            "200",
            "--noise-multiplier",
            "1",
            "--db",
            str(db),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_first_epoch(proc, db)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert "interrupted by SIGTERM" in err.decode() and "Traceback" not in err.decode()
    row = sqlite3.connect(db).execute("SELECT status, record FROM runs").fetchone()
    assert row == ("interrupted", None)


def test_the_claimed_epsilon_is_shown_by_rdp_too(tmp_path):
    """The claimed ε was composed by PLD only; the papers composed theirs by RDP, which the
    record and both outputs now give beside it (rebuilt here from the record's events by the
    reproduction report's own code)."""
    from privgrad.lab.report.privacy import run_privacy

    db = str(tmp_path / "runs.db")
    code, out, err = run_cli(
        "train", "--mechanism", "gip", "--limit-train", "600", "--epochs", "1",
        "--batch-size", "100", "--epsilon", "2", "--json", "--db", db,
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    rebuilt = run_privacy(record, 2.0)
    assert not isinstance(rebuilt, str), rebuilt
    assert record["epsilon_claimed_rdp"] == pytest.approx(rebuilt.claimed("rdp"), rel=1e-3)
    assert record["epsilon_claimed_rdp"] > record["epsilon_claimed"] > record["epsilon"] * 0.999
    line = f"{record['epsilon_claimed_rdp']:.4f} by RDP, the accountant the papers used"
    assert line in err
    code, shown, _ = run_cli("runs", "show", "1", "--db", db)
    assert code == 0 and line in shown
    assert "epochs=1, batch_size=100, " in shown  # as typed (it showed 1.0 and 100.0)


def test_activation_and_model_options_with_a_model_of_ones_own_are_refused(tmp_path, monkeypatch):
    """--activation (and --width, --depth, --block-size) reach privgrad's built-in models
    only: a python: model trained with its own architecture while the run record said
    "activation": "relu" (or width 2), without a word; an hf: model ignored --activation so
    too. Without them the same run trains."""
    (tmp_path / "act_model.py").write_text(
        "import torch\n"
        "def net(input_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["train", "--model", "python:act_model:net", "--limit-train", "100", "--limit-test",
            "50", "--epochs", "1", "--quiet", "--db", str(tmp_path / "r.db")]  # fmt: skip
    try:
        code, _, err = run_cli(*args, "--activation", "relu")
        assert code == 2 and err.strip().splitlines() == [
            "error: --activation applies to privgrad's built-in models; --model "
            "'python:act_model:net' has its own activations (an hf: model its config's, e.g. "
            "hidden_act; a python: model your function's): leave --activation out"
        ], err
        code, _, err = run_cli(*args, "--width", "2")  # ignored the same way
        assert code == 2 and "--model 'python:act_model:net' takes no model options (--width" in err
        code, _, err = run_cli(*args)
        assert code == 0, err
    finally:
        sys.modules.pop("act_model", None)


def test_warnings_are_one_clean_line(tmp_path):
    """A warning during a command (here δ ≥ 1/n) reads as the CLI's own, 'warning: ...' on one
    line: Python's format named click's core.py (the library's warnings point at the caller's
    line, which on the command line is click's) and printed its source line after it. The API
    keeps warnings.warn (a user filters them or makes them errors): the command restores
    Python's warnings.showwarning when it ends."""
    import warnings

    shown = warnings.showwarning
    code, out, err = run_cli("train", *TINY, "--delta", "0.05", "--db", str(tmp_path / "r.db"))
    assert code == 0, err
    lines = [line for line in err.splitlines() if "1/n" in line]
    assert lines == [
        "warning: δ = 0.05 is not below 1/n = 1/100: a mechanism that releases one example "
        "outright meets (ε, δ)-DP at this δ; use δ < 1/n (e.g. 1e-5 for 100 examples)"
    ], err
    assert "UserWarning" not in err and ".py:" not in err and "return callback" not in err
    assert warnings.showwarning is shown


def test_runs_show_lists_the_options_the_run_used(tmp_path):
    """`privgrad runs show` listed every stored default, used or not: momentum=0.9 for
    dp-adam (Adam has none), clip, δ and target=honest for the non-private run, target with a
    fixed σ, activation=tanh for a python: model, validation=0. It shows the options that
    applied, and the optimizer the mechanism chose; --json keeps the whole configuration."""
    import dataclasses

    db = tmp_path / "runs.db"
    store = RunStore(db)
    runs = {
        "dp-adam": TrainConfig(mechanism="dp-adam"),
        "non-private": TrainConfig(mechanism="non-private"),
        "sigma": TrainConfig(noise_multiplier=1.5, validation=500),
        "own model": TrainConfig(model="python:mymodels:net", optimizer="sgd"),
    }
    ids = {}
    for name, config in runs.items():
        config = config.with_defaults(1000)
        ids[name] = store.start(dataclasses.asdict(config))
        store.finish(ids[name], {"mechanism": config.mechanism, "epsilon": 1.0, "delta": 1e-5})

    def options(name):
        code, out, err = run_cli("runs", "show", str(ids[name]), "--db", str(db))
        assert code == 0, err
        return dict(kv.split("=", 1) for kv in out.splitlines()[1].strip().split(", "))

    adam = options("dp-adam")
    assert adam["optimizer"] == "adam" and "momentum" not in adam
    assert adam["clip"] == "0.1" and adam["target"] == "honest" and adam["activation"] == "tanh"
    assert "validation" not in adam
    plain = options("non-private")
    assert plain["optimizer"] == "sgd" and plain["momentum"] == "0.9"
    assert not {"clip", "delta", "target", "noise_multiplier", "epsilon"} & set(plain)
    sigma = options("sigma")
    assert sigma["noise_multiplier"] == "1.5" and "target" not in sigma
    assert sigma["validation"] == "500" and sigma["delta"] == "1e-05"
    own = options("own model")
    assert own["optimizer"] == "sgd" and "activation" not in own
    code, out, _ = run_cli("runs", "show", str(ids["dp-adam"]), "--db", str(db), "--json")
    assert json.loads(out)["config"]["momentum"] == 0.9


def test_an_image_model_of_another_size_names_the_models_that_fit():
    """CIFAR-10 with the default model (cnn, 28×28) said only that cnn takes 28×28 images; a
    newcomer had to find which of the nine models take 32×32 ones. The error names them."""
    from privgrad.app.models import build_model
    from privgrad.errors import PrivgradError

    with pytest.raises(PrivgradError) as err:
        build_model("cnn", (3, 32, 32), 10)
    assert str(err.value) == (
        "model 'cnn' takes 28×28 images, the data has shape (3, 32, 32): use model2, model3, "
        "wrn (these take 32×32 images), mlp (any example, flattened), or your own "
        "(--model python:...)"
    )
    for name in ("model2", "model3", "wrn"):
        assert build_model(name, (3, 32, 32), 10) is not None


def test_a_failed_run_keeps_its_error_for_runs_show(tmp_path, monkeypatch):
    """A run that failed was listed 'failed' and nothing more: `privgrad runs show` (and its
    --json) had no word of why, once the terminal's error line was gone. The store keeps the
    error's line (the CLI's message, or another exception's type and message); a resume
    clears it. A store of the previous schema gains the column."""
    import sqlite3

    (tmp_path / "bn_model.py").write_text(
        "import torch\n"
        "def net(input_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 8),\n"
        "                               torch.nn.BatchNorm1d(8), torch.nn.Linear(8, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    db = str(tmp_path / "runs.db")
    code, _, err = run_cli("train", *TINY, "--model", "python:bn_model:net", "--db", db)
    assert code == 2 and "BatchNorm mixes the examples" in err, err
    code, out, _ = run_cli("runs", "show", "1", "--db", db)
    lines = out.splitlines()
    assert lines[0].startswith("run 1 (train): failed") and lines[1].startswith(
        "  error: layer '2' (BatchNorm1d): BatchNorm mixes the examples of a batch"
    ), out
    code, out, _ = run_cli("runs", "show", "1", "--db", db, "--json")
    assert json.loads(out)["error"].startswith("layer '2' (BatchNorm1d): BatchNorm mixes")

    from privgrad import private

    def boom(self, batch):
        raise RuntimeError("out of\nmemory")

    monkeypatch.setattr(private.PrivateTrainer, "step", boom)
    with pytest.raises(RuntimeError):
        run_cli("train", *TINY, "--db", db)
    assert RunStore(db).run(2)["error"] == "RuntimeError: out of memory"
    store = RunStore(db)
    store.reopen(2)  # resumed: running again, without the error
    assert store.run(2)["status"] == "running" and "error" not in store.run(2)

    old = tmp_path / "old.db"  # a store written before the column
    with sqlite3.connect(old) as con:
        con.execute(
            "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL "
            "DEFAULT 'train', status TEXT NOT NULL, started REAL NOT NULL, finished REAL, "
            "git_commit TEXT, config TEXT NOT NULL, record TEXT, wall_time_s REAL, pid INTEGER, "
            "host TEXT, heartbeat REAL)"
        )
        con.execute("INSERT INTO runs (status, started, config) VALUES ('failed', 0, '{}')")
    con.close()
    assert "error" not in RunStore(old).run(1)
