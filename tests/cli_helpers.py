"""Helpers shared by the command-line tests."""

import sqlite3
import time


def run_cli(*args):
    """In-process CLI call: (exit code, stdout, stderr); an exception other than the CLI's own
    exit is raised, so a traceback can never pass for an error message."""
    from click.testing import CliRunner

    from privgrad.app.cli import main

    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def wait_for_first_epoch(proc, db, timeout: float = 300, poll: float = 0.02) -> None:
    """Waits until the training subprocess ``proc`` has stored its first epoch in the run
    store ``db`` (it must not exit before)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if (
                db.exists()
                and sqlite3.connect(db).execute("SELECT COUNT(*) FROM epochs").fetchone()[0]
            ):
                return
        except sqlite3.OperationalError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(poll)
    raise AssertionError(f"no epoch stored in {db} within {timeout} s")


def interrupt_at_step(monkeypatch, n: int) -> None:
    """Makes the ``n``-th ``PrivateTrainer.step`` raise KeyboardInterrupt, as Ctrl-C there would
    (the run checkpoints the steps before it and is stored as interrupted)."""
    from privgrad import private

    calls = {"n": 0}
    original = private.PrivateTrainer.step

    def step(self, batch):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(private.PrivateTrainer, "step", step)
