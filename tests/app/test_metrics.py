"""Every run writes its steps and epochs as CSV in its run folder, and TensorBoard events when
asked; a resumed run continues the files without a repeated row; `privgrad runs` and
`privgrad runs show` tell the steps done and ε spent whatever the status."""

import csv
import json

import pytest

from cli_helpers import run_cli
from privgrad.app.checkpoint import checkpoint_dir
from privgrad.app.store import RunStore
from privgrad.errors import PrivgradError

TRAIN = (
    "train",
    "--limit-train",
    "600",
    "--epochs",
    "2",
    "--batch-size",
    "100",
    "--noise-multiplier",
    "1.2",
    "--device",
    "cpu",
    "--quiet",
)


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_run_writes_its_steps_and_epochs_as_csv(tmp_path):
    db = tmp_path / "runs.db"
    code, out, err = run_cli(*TRAIN, "--db", str(db), "--json")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    folder = checkpoint_dir(db, 1)
    steps, epochs = rows(folder / "steps.csv"), rows(folder / "epochs.csv")
    assert [int(r["step"]) for r in steps] == list(range(1, 13))
    assert [int(r["epoch"]) for r in steps] == [1] * 6 + [2] * 6
    assert all(float(r["loss"]) > 0 and int(r["batch_size"]) >= 0 for r in steps)
    assert [int(r["epoch"]) for r in epochs] == [1, 2] and [int(r["steps"]) for r in epochs] == [
        6,
        12,
    ]
    last = epochs[-1]
    assert (
        float(last["epsilon"]) == record["epsilon"]
        and float(last["accuracy"]) == record["test_accuracy"]
    )
    assert float(last["effective_noise_multiplier"]) == record["effective_noise_multiplier"]
    assert all(float(r["delta"]) == record["delta"] for r in epochs)  # the δ of each ε
    assert float(last["lr"]) == record["lr"] and last["evaluated_on"] == "test"
    assert float(epochs[0]["epsilon"]) < float(last["epsilon"])
    store_epochs = RunStore(db).epochs(1)
    assert [e["epsilon"] for e in store_epochs] == [float(r["epsilon"]) for r in epochs]

    # privgrad runs plot draws these files: what it reads, and the PNG it writes
    from PIL import Image

    from privgrad.app.plots import _curves

    curves = _curves(RunStore(db), 1)
    assert curves["step"] == list(range(1, 13)) and curves["epoch_step"] == [6, 12]
    assert curves["loss"] == [float(r["loss"]) for r in steps]
    assert curves["epsilon"] == [float(r["epsilon"]) for r in epochs]
    assert curves["accuracy"][-1] == record["test_accuracy"] and curves["evaluated_on"] == "test"
    code, out, err = run_cli("runs", "plot", "1", "--db", str(db))
    assert code == 0 and "run1.png" in out, err
    assert Image.open(tmp_path / "run1.png").size == (1400, 420)
    for ids, message in ((["7"], "no run 7 in the run store"), (["1", "x"], "RUN_IDS must be")):
        code, _, err = run_cli("runs", "plot", *ids, "--db", str(db))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_plot_of_a_run_stopped_mid_epoch_shows_the_epsilon_it_spent(tmp_path, monkeypatch):
    """ε was plotted per epoch only: a run stopped at step 8 of 12 showed the 6 steps of its
    first epoch, understating what it spent; its checkpoint's ε (progress.json) ends it."""
    from cli_helpers import interrupt_at_step

    from privgrad.app.metrics import read_progress
    from privgrad.app.plots import _curves

    db = tmp_path / "runs.db"
    interrupt_at_step(monkeypatch, 9)
    assert run_cli(*TRAIN, "--db", str(db))[0] == 130
    progress = read_progress(checkpoint_dir(db, 1))
    curves = _curves(RunStore(db), 1)
    assert progress["steps"] == 8 and curves["epsilon_step"] == [6, 8]
    assert curves["epsilon"][-1] == progress["epsilon"] > curves["epsilon"][0]


def test_the_plot_says_which_run_was_scored_on_which_split(tmp_path, monkeypatch):
    """A run scored on the test set and one scored on a --validation split share the
    accuracy panel ("test / validation accuracy"); nothing said which curve was which, so a
    validation curve read as a test accuracy. The panel's legend now names each run's split."""
    import matplotlib.figure

    db = tmp_path / "runs.db"
    small = [*TRAIN, "--db", str(db), "--epochs", "1"]
    assert run_cli(*small)[0] == 0 and run_cli(*small, "--validation", "100")[0] == 0
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out: drawn.append(fig))
    assert run_cli("runs", "plot", "1", "2", "--db", str(db))[0] == 0
    accuracy = drawn[0].axes[1]
    assert accuracy.get_title() == "test / validation accuracy after each epoch"
    legend = accuracy.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == [
        "run 1: test accuracy",
        "run 2: validation accuracy",
    ]


def test_a_resumed_run_continues_its_metrics_without_a_repeated_row(tmp_path, monkeypatch):
    from cli_helpers import interrupt_at_step

    db = tmp_path / "runs.db"
    with monkeypatch.context() as m:
        interrupt_at_step(m, 9)
        code, _, err = run_cli(*TRAIN, "--db", str(db))
    assert code == 130
    # the message names the run and how to go on (it said 'error: interrupted' alone)
    assert "run 1 is saved after 8 of 12 steps" in err and f"privgrad resume 1 --db {db}" in err
    folder = checkpoint_dir(db, 1)
    assert len(rows(folder / "steps.csv")) == 8 and len(rows(folder / "epochs.csv")) == 1
    # rows the checkpoint does not hold (as a run killed mid-epoch leaves them) are cut on resume
    with open(folder / "steps.csv", "a") as f:
        f.write("9,2,0.5,100,1.0\n10,2,0.5,100,1.0\n")
    code, listing, _ = run_cli("runs", "--db", str(db))
    assert "interrupted" in listing and "8/12" in listing
    code, out, err = run_cli("resume", "1", "--db", str(db), "--quiet")
    assert code == 0, err
    assert [int(r["step"]) for r in rows(folder / "steps.csv")] == list(range(1, 13))
    assert [int(r["epoch"]) for r in rows(folder / "epochs.csv")] == [1, 2]


def test_two_run_stores_in_one_folder_keep_their_run_folders_apart(tmp_path, monkeypatch):
    """Run ids restart in every store: a.db's run 1 and b.db's run 1 shared checkpoints/1, so
    b's run overwrote a's interrupted checkpoint and metrics (a could no longer resume, and
    'runs' showed b's steps and ε for it)."""
    from cli_helpers import interrupt_at_step

    a, b = tmp_path / "a.db", tmp_path / "b.db"
    with monkeypatch.context() as m:
        interrupt_at_step(m, 9)
        assert run_cli(*TRAIN, "--db", str(a))[0] == 130
    assert run_cli(*TRAIN, "--db", str(b), "--epochs", "1")[0] == 0
    assert checkpoint_dir(a, 1) != checkpoint_dir(b, 1)
    code, listing, _ = run_cli("runs", "--db", str(a))
    assert "8/12" in listing, listing
    code, out, err = run_cli("runs", "--db", str(a), "--json")
    progress = json.loads(out)[0]["progress"]  # the JSON says what the listing does
    assert progress["steps"] == 8 and progress["planned_steps"] == 12 and progress["epsilon"] > 0
    code, out, err = run_cli("runs", "show", "1", "--db", str(a), "--json")
    assert json.loads(out)["progress"] == progress
    assert run_cli("resume", "1", "--db", str(a), "--quiet")[0] == 0
    assert len(rows(checkpoint_dir(a, 1) / "steps.csv")) == 12
    assert len(rows(checkpoint_dir(b, 1) / "steps.csv")) == 6


def test_a_new_run_in_a_store_made_again_reads_nothing_of_the_old_one(tmp_path):
    """A store deleted and made again starts at run 1: the old run 1's progress.json gave a run
    that never stepped 'ε spent so far … after 12 steps'."""
    from privgrad.app.train import TrainConfig, train

    db = tmp_path / "runs.db"
    assert run_cli(*TRAIN, "--db", str(db))[0] == 0
    assert (checkpoint_dir(db, 1) / "progress.json").exists()
    db.unlink()
    config = TrainConfig(
        limit_train=600, epochs=2, batch_size=100, noise_multiplier=1.2, device="cpu"
    )
    with pytest.raises(PrivgradError, match="not started"):  # declined at the plan's prompt
        train(config, store=RunStore(db), progress=False, confirm_plan=lambda advice: False)
    assert not (checkpoint_dir(db, 1) / "progress.json").exists()
    code, out, err = run_cli("runs", "show", "1", "--db", str(db))
    assert "spent so far" not in out, out
    # declining is not a failure: the run is listed as declined
    code, out, err = run_cli("runs", "--status", "declined", "--db", str(db), "--json")
    assert [run["status"] for run in json.loads(out)] == ["declined"]


def test_tensorboard_events_read_back_with_tensorboards_own_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    db, logdir = tmp_path / "runs.db", tmp_path / "tb"
    code, out, err = run_cli(*TRAIN, "--db", str(db), "--tensorboard", str(logdir), "--json")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    events = EventAccumulator(str(logdir / "run-1"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 13))
    eps = events.Scalars("epoch/epsilon")
    assert [e.step for e in eps] == [6, 12] and eps[-1].value == pytest.approx(
        record["epsilon"], rel=1e-6
    )
    assert events.Scalars("epoch/accuracy")[-1].value == pytest.approx(
        record["test_accuracy"], rel=1e-6
    )


def test_runs_show_prints_the_run_its_epochs_and_its_privacy_record(tmp_path):
    db = tmp_path / "runs.db"
    assert run_cli(*TRAIN, "--db", str(db))[0] == 0
    code, out, err = run_cli("runs", "show", "1", "--db", str(db))
    assert code == 0, err
    assert "completed" in out and "epoch" in out and "σ_eff" in out and "ε (honest" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]) >= 2
    code, _, err = run_cli("runs", "show", "9", "--db", str(db))
    assert code == 2 and "no run 9" in err


def test_tensorboard_keeps_every_step_across_a_resume(tmp_path, monkeypatch):
    """The resumed writer purged from the checkpoint's own step (steps count from 1), and
    TensorBoard then dropped that step's point: 11 of 12."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cli_helpers import interrupt_at_step

    db, logdir = tmp_path / "runs.db", tmp_path / "tb"
    with monkeypatch.context() as m:
        interrupt_at_step(m, 9)
        assert run_cli(*TRAIN, "--db", str(db), "--tensorboard", str(logdir))[0] == 130
    code, _, err = run_cli("resume", "1", "--db", str(db), "--quiet", "--tensorboard", str(logdir))
    assert code == 0, err
    events = EventAccumulator(str(logdir / "run-1"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))


def test_a_run_from_the_api_writes_the_same_csv_files(tmp_path):
    """A run driven from the API (make_private and one's own loop, or attach's optimizer)
    wrote no metrics: only `privgrad train` had steps.csv and epochs.csv. MetricsLog(folder)
    writes them from the trainer: one row per private step (none for a micro-batch that did
    not step), one per epoch with the honest ε spent so far, δ, σ_eff, steps and lr read from
    the trainer, and the epoch's mean step loss."""
    import math

    import torch

    import privgrad
    from privgrad.app.metrics import MetricsLog, read_rows

    g = torch.Generator().manual_seed(0)
    data = torch.randn(300, 6, generator=g), torch.randint(0, 3, (300,), generator=g)
    model = torch.nn.Linear(6, 3)
    private = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), data, target_epsilon=2.0,
        epochs=2, batch_size=60, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    losses, eps = [], []
    with MetricsLog(tmp_path / "run") as log:
        for _ in range(2):
            for batch in private.batches():
                losses.append(private.step(batch))
                log.after_step(private, losses[-1], len(batch))
            row = log.after_epoch(private, accuracy=0.5)
            eps.append(private.epsilon())
            assert row["epsilon"] == eps[-1]
    steps, epochs = (
        read_rows(tmp_path / "run" / "steps.csv"),
        read_rows(tmp_path / "run" / "epochs.csv"),
    )
    assert [int(r["step"]) for r in steps] == list(range(1, 11))
    assert [int(r["epoch"]) for r in steps] == [1] * 5 + [2] * 5
    assert [float(r["loss"]) for r in steps] == losses and steps[0]["batch_size"].isdigit()
    assert [int(r["steps"]) for r in epochs] == [5, 10]
    assert [float(r["epsilon"]) for r in epochs] == eps and 0 < eps[0] < eps[1] <= 2.0
    assert float(epochs[0]["loss"]) == sum(losses[:5]) / 5
    sigma = private.mechanism.noise_record(private.n_layers, 60).effective
    assert all(float(r["effective_noise_multiplier"]) == sigma for r in epochs)
    assert all(float(r["delta"]) == 1e-5 and float(r["lr"]) == 0.5 for r in epochs)
    assert epochs[1]["accuracy"] == "0.5" and epochs[1]["evaluated_on"] == "test"

    # the own loop: attach's optimizer, a Poisson batch in micro-batches of at most 16
    model = torch.nn.Linear(6, 3)
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.5), data, target_epsilon=2.0,
        epochs=1, batch_size=60, max_grad_norm=1.0, seed=0, max_physical_batch_size=16,
    )  # fmt: skip
    log = MetricsLog(tmp_path / "own")
    drawn, sizes = 0, []  # each drawn batch's examples, over its micro-batches
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        log.after_step(optimizer)
        drawn += len(y)
        if optimizer.stepped:
            sizes, drawn = sizes + [drawn], 0
    log.after_epoch(optimizer)
    log.close()
    steps, epochs = (
        read_rows(tmp_path / "own" / "steps.csv"),
        read_rows(tmp_path / "own" / "epochs.csv"),
    )
    assert (
        [int(r["step"]) for r in steps] == list(range(1, 6)) == list(range(1, optimizer.steps + 1))
    )
    assert all(math.isfinite(float(r["loss"])) for r in steps)
    # the batch size column was left empty for attach's optimizer: the whole drawn batch's now
    assert [int(r["batch_size"]) for r in steps] == sizes and max(sizes) > 16
    assert len(epochs) == 1 and float(epochs[0]["epsilon"]) == optimizer.epsilon()
    assert epochs[0]["accuracy"] == "" and epochs[0]["evaluated_on"] == ""
    with pytest.raises(PrivgradError, match="make_private's trainer or attach's optimizer"):
        MetricsLog(tmp_path / "x").after_step(model)


def _own_epoch(model, optimizer, loader, log) -> None:
    """One epoch of an own loop over ``loader``, logged to ``log``."""
    import torch

    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        log.after_step(optimizer)
    log.after_epoch(optimizer)


def test_a_resumed_own_loop_is_warned_when_its_log_cuts_the_earlier_rows(tmp_path):
    """A user's own loop resumed in a new process opened MetricsLog(folder) as the guide showed
    it, and the rows of the steps before the checkpoint vanished from steps.csv and epochs.csv
    without a word (the resumed epoch numbered 1 again). Now the first row warns, naming
    steps_done and epochs_done; with them, the earlier rows stay and the epochs count on."""
    import warnings

    import torch

    import privgrad
    from privgrad.app.metrics import MetricsLog, read_rows

    g = torch.Generator().manual_seed(0)
    data = torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g)

    def attached():
        model = torch.nn.Linear(6, 3)
        return privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.5), data, target_epsilon=2.0,
            epochs=2, batch_size=50, max_grad_norm=1.0, seed=0,
        )  # fmt: skip

    model, optimizer, loader = attached()
    with MetricsLog(tmp_path / "run") as log:
        _own_epoch(model, optimizer, loader, log)
    state, first = optimizer.state_dict(), optimizer.steps

    for given in (False, True):
        model, optimizer, loader = attached()
        optimizer.load_state_dict(state)
        kw = {"steps_done": first, "epochs_done": 1} if given else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with MetricsLog(tmp_path / "run", **kw) as log:
                _own_epoch(model, optimizer, loader, log)
        mine = [str(w.message) for w in caught if "MetricsLog" in str(w.message)]
        if not given:
            assert len(mine) == 1 and "steps_done" in mine[0] and f"1–{first}" in mine[0]
            # redo the first epoch's rows for the second pass
            model, optimizer, loader = attached()
            with MetricsLog(tmp_path / "run") as log:
                _own_epoch(model, optimizer, loader, log)
        else:
            assert mine == []
    steps, epochs = (
        read_rows(tmp_path / "run" / "steps.csv"),
        read_rows(tmp_path / "run" / "epochs.csv"),
    )
    assert [int(r["step"]) for r in steps] == list(range(1, optimizer.steps + 1))
    assert [int(r["epoch"]) for r in epochs] == [1, 2]


def test_runs_plot_draws_the_folder_a_metrics_log_wrote_from_ones_own_loop(tmp_path):
    """MetricsLog(folder) writes privgrad train's steps.csv and epochs.csv from one's own loop,
    but `privgrad runs plot` took only run ids of a run store: a folder was refused as not a
    run id. It is drawn now (default PNG: plot.png in it), beside a stored run too."""
    import torch
    from PIL import Image

    import privgrad
    from privgrad.app.metrics import MetricsLog

    g = torch.Generator().manual_seed(0)
    data = torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g)
    model = torch.nn.Linear(6, 3)
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.5), data, target_epsilon=2.0,
        epochs=2, batch_size=50, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    with MetricsLog(tmp_path / "mine") as log:
        for _ in range(2):
            _own_epoch(model, optimizer, loader, log)
    folder = str(tmp_path / "mine")
    code, out, err = run_cli("runs", "plot", folder, "--db", str(tmp_path / "none.db"))
    assert code == 0 and "plot.png" in out, err
    assert Image.open(tmp_path / "mine" / "plot.png").size == (1400, 420)
    db = tmp_path / "runs.db"
    assert run_cli(*TRAIN, "--db", str(db), "--epochs", "1")[0] == 0
    code, out, err = run_cli(
        "runs", "plot", "1", folder, "--db", str(db), "--out", str(tmp_path / "b.png")
    )
    assert code == 0 and (tmp_path / "b.png").exists(), err
    code, _, err = run_cli("runs", "plot", str(tmp_path / "empty"), "--db", str(db))
    assert code == 2 and "RUN_IDS must be run ids (integers ≥ 1) or folders" in err
