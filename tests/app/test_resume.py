"""Checkpoints and `privgrad resume`: a stopped run ends exactly as if it had never stopped."""

import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch

from privgrad.app.checkpoint import checkpoint_dir, load_checkpoint
from privgrad.errors import PrivgradError
from privgrad.app.store import RunStore
from privgrad.app.train import TrainConfig, train
from cli_helpers import interrupt_at_step, run_cli as cli, wait_for_first_epoch

USER_CODE = textwrap.dedent('''
    import time

    import torch
    from torch import nn
    from torch.utils.data import Dataset


    class Slow(Dataset):
        """Examples read one by one, slowly (a stand-in for files on disk)."""

        def __init__(self, x, y, delay):
            self.x, self.y, self.delay = x, y, delay

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            time.sleep(self.delay)
            return self.x[i], int(self.y[i])


    def data(delay=0.0):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 1, 6, 6, generator=g)
        y = (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1)
        return Slow(x[:300], y[:300], delay), Slow(x[300:], y[300:], 0.0), 3


    def slow_data():  # the same examples, read slowly enough to stop the run mid-way
        return data(delay=0.003)


    def model(input_shape, num_classes):
        d = input_shape[0] * input_shape[1] * input_shape[2]
        return nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, num_classes))
''')

ARGS = dict(
    model="python:userdata:model",
    epochs=3,
    batch_size=30,
    noise_multiplier=1.0,
    lr=0.5,
    clip=1.0,
    seed=7,
    device="cpu",
)


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "userdata.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(record, final model) of the run never stopped."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "userdata.py").write_text(USER_CODE)
    with pytest.MonkeyPatch.context() as m:
        m.chdir(folder)
        record = train(
            TrainConfig(dataset="python:userdata:data", **ARGS),
            RunStore(folder / "runs.db"),
            progress=False,
        )
    return (
        record,
        final_model(folder / "runs.db", record["run_id"]),
        RunStore(folder / "runs.db").epochs(1),
    )


def final_model(db, run_id):
    return load_checkpoint(checkpoint_dir(db, run_id))["trainer"]["model"]


def test_sigterm_after_epoch_1_then_resume_is_bit_identical(user_code, reference):
    import json

    ref, theirs, ref_epochs = reference

    db = user_code / "runs" / "runs.db"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "privgrad.app.cli",
            "train",
            "--dataset",
            "python:userdata:slow_data",
            *flags,
            "--db",
            str(db),
            "--quiet",
        ],
        cwd=user_code,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_first_epoch(proc, db)  # stop it as soon as epoch 1 is stored
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    store = RunStore(db)
    assert store.run(1)["status"] == "interrupted"
    stopped_at = load_checkpoint(checkpoint_dir(db, 1))["trainer"]["steps"]
    assert 10 <= stopped_at < ref["steps"]

    code, out, err = cli("resume", "1", "--db", str(db), "--json", "--quiet")
    assert code == 0, err
    record = json.loads(out.splitlines()[-1])
    for key in (
        "test_accuracy",
        "epsilon",
        "epsilon_claimed",
        "epsilon_rdp",
        "noise_multiplier",
        "steps",
    ):
        assert record[key] == ref[key], key
    assert record["resumes"] == 1 and record["run_id"] == 1
    mine = final_model(db, 1)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    runs = RunStore(db).runs()
    assert [(r["id"], r["status"]) for r in runs] == [(1, "completed")]  # one run, not two
    assert [e["epoch"] for e in RunStore(db).epochs(1)] == [1, 2, 3]
    assert RunStore(db).epochs(1) == ref_epochs


def interrupted_run(db, monkeypatch, at_step=13):
    """A run of python:userdata:data stopped by Ctrl-C at its ``at_step``-th step."""
    with monkeypatch.context() as m:
        interrupt_at_step(m, at_step)
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(dataset="python:userdata:data", **ARGS), RunStore(db), progress=False)


def test_ctrl_c_mid_epoch_checkpoints_the_last_step_and_resumes(user_code, monkeypatch, reference):
    db = user_code / "runs.db"
    interrupted_run(db, monkeypatch)
    assert load_checkpoint(checkpoint_dir(db, 1))["trainer"]["steps"] == 12  # mid-epoch 2
    code, out, err = cli("resume", "1", "--db", str(db), "--quiet")
    assert code == 0, err
    mine = final_model(db, 1)
    assert all(torch.equal(mine[k], reference[1][k]) for k in mine)
    record = RunStore(db).run(1)["record"]
    assert record["epsilon"] == reference[0]["epsilon"]
    assert "started_by_code_version" not in record  # started and resumed by this code


def test_a_run_resumed_by_other_code_names_the_code_that_started_it(user_code, monkeypatch):
    """The checkpoint carries the code version that started the run (through resumes): a run
    that other code resumes (privgrad upgraded meanwhile) goes on, and its record names both."""
    from privgrad.records import code_version

    db = user_code / "runs.db"
    with monkeypatch.context() as m:
        m.setattr("privgrad.app.train.code_version", lambda: "src-earlier")
        interrupted_run(db, m)
    assert load_checkpoint(checkpoint_dir(db, 1))["loop"]["code_version"] == "src-earlier"
    code, _, err = cli("resume", "1", "--db", str(db), "--quiet")
    assert code == 0, err
    record = RunStore(db).run(1)["record"]
    assert record["resumes"] == 1 and record["code_version"] == code_version()
    assert record["started_by_code_version"] == "src-earlier"


def test_an_altered_checkpoint_is_refused(user_code, monkeypatch):
    db = user_code / "runs.db"
    interrupted_run(db, monkeypatch)
    path = checkpoint_dir(db, 1) / "checkpoint.pt"
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 1
    path.write_bytes(bytes(blob))
    code, _, err = cli("resume", "1", "--db", str(db), "--quiet")
    assert code == 2 and "SHA-256" in err and "Traceback" not in err
    assert RunStore(db).run(1)["status"] == "interrupted"


def test_a_checkpoint_of_another_configuration_is_refused(user_code, monkeypatch):
    db = user_code / "runs.db"
    interrupted_run(db, monkeypatch)
    with sqlite3.connect(db) as con:
        con.execute(
            "UPDATE runs SET config=replace(config, '\"lr\": 0.5', '\"lr\": 0.25') WHERE id=1"
        )
    code, _, err = cli("resume", "1", "--db", str(db), "--quiet")
    assert code == 2 and "another configuration" in err


def test_a_completed_or_unknown_run_is_not_resumed(user_code):
    db = user_code / "runs.db"
    train(
        TrainConfig(dataset="python:userdata:data", **{**ARGS, "epochs": 1}),
        RunStore(db),
        progress=False,
    )
    assert "already completed" in cli("resume", "1", "--db", str(db))[2]
    assert "no run 5" in cli("resume", "5", "--db", str(db))[2]
    with pytest.raises(PrivgradError, match="no checkpoint"):
        load_checkpoint(user_code / "nowhere")


def _set_sigma(event, sigma):
    if isinstance(event, dict):
        return {
            k: (sigma if k == "noise_multiplier" else _set_sigma(v, sigma))
            for k, v in event.items()
        }
    return [_set_sigma(v, sigma) for v in event] if isinstance(event, list) else event


def _one_step(trainer_state):
    for key in ("ledger", "claimed_ledger"):
        trainer_state[key] = [[e, 1] for e, _ in trainer_state[key][:1]]
    trainer_state["steps"] = 1
    trainer_state["sampler"]["draws"] = 1


EDITS = {
    "sigma 50": lambda s: s["trainer"].update(
        ledger=_set_sigma(s["trainer"]["ledger"], 50.0),
        claimed_ledger=_set_sigma(s["trainer"]["claimed_ledger"], 50.0),
    ),
    "steps 1": lambda s: _one_step(s["trainer"]),
    "loop not a dict": lambda s: s.update(loop="x"),
    "code version not a string": lambda s: s["loop"].update(code_version=7),
    "no ledger": lambda s: s["trainer"].pop("ledger"),
    "ledger of strings": lambda s: s["trainer"].update(ledger=["a", "b"]),
    "no RNG state": lambda s: s.update(torch_rng=[1, 2]),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_checkpoint_with_a_recomputed_hash_is_refused(user_code, monkeypatch, edit):
    """The SHA-256 only catches accidents: whoever edits the ledger can recompute it. The
    ledger is checked against the configuration and the step count, the structure part by part."""
    from privgrad.app.checkpoint import save_checkpoint

    db = user_code / "runs.db"
    interrupted_run(db, monkeypatch)
    saved = load_checkpoint(checkpoint_dir(db, 1))
    EDITS[edit](saved)
    save_checkpoint(checkpoint_dir(db, 1), saved)  # a valid hash over the edited content
    code, out, err = cli("resume", "1", "--db", str(db), "--quiet", "--json")
    assert code == 2, out
    assert "not loaded" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (
        err
    )
    assert RunStore(db).run(1)["status"] in ("interrupted", "failed")
