"""The run store: WAL mode, one-line errors for every SQLite failure, and runs whose
process died without a word shown as ``lost``."""

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from privgrad.app import store as store_module
from privgrad.app.cli import main
from privgrad.app.store import STALE_AFTER_S, RunStore, recorded_run


def run_cli(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_store_is_opened_in_wal_mode(tmp_path):
    RunStore(tmp_path / "r.db").close()
    assert sqlite3.connect(tmp_path / "r.db").execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_sigkilled_run_is_shown_as_lost(tmp_path):
    """A real process killed with SIGKILL (no handler runs) is 'lost' on the next
    'privgrad runs', not 'running'; a live one stays 'running'."""
    db = tmp_path / "r.db"
    script = textwrap.dedent(f"""
        import time
        from privgrad.app.store import RunStore, recorded_run
        with recorded_run(RunStore({str(db)!r}), {{"mechanism": "dpsgd"}}) as run_id:
            print(run_id, flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"
        assert [r["status"] for r in RunStore(db).runs()] == ["running"]  # alive: still running
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    code, out, err = run_cli("runs", "--db", str(db))
    assert code == 0, err
    assert out.splitlines()[1].split()[:3] == ["1", "train", "lost"]
    code, out, _ = run_cli("runs", "--db", str(db), "--status", "lost", "--json")
    assert code == 0 and '"status": "lost"' in out


def test_stale_heartbeat_means_lost_even_on_another_host(tmp_path):
    store = RunStore(tmp_path / "r.db")
    now = time.time()
    for beat in (
        now - STALE_AFTER_S - 60,
        now - 5,
    ):  # run 1: stale; run 2: fresh (pid unknown there)
        run_id = store.start({"mechanism": "dpsgd"})
        store.db.execute(
            "UPDATE runs SET host='elsewhere', pid=1, heartbeat=? WHERE id=?", (beat, run_id)
        )
        store.db.commit()
    with recorded_run(store, {"mechanism": "dpsgd"}):  # this process: alive, fresh heartbeat
        assert {r["id"]: r["status"] for r in store.runs()} == {
            1: "lost",
            2: "running",
            3: "running",
        }


def test_heartbeat_is_written_while_the_run_lives(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.05)
    store = RunStore(tmp_path / "r.db")
    with recorded_run(store, {}) as run_id:
        store.db.execute("UPDATE runs SET status='lost', heartbeat=0 WHERE id=?", (run_id,))
        store.db.commit()
        deadline = time.time() + 30
        while (
            store.db.execute("SELECT heartbeat FROM runs").fetchone()[0] == 0
            and time.time() < deadline
        ):
            time.sleep(0.05)
        beat, status = store.db.execute("SELECT heartbeat, status FROM runs").fetchone()
        assert beat > time.time() - 30 and status == "running"  # a run wrongly marked lost recovers
        store.finish(run_id, {"wall_time_s": 0})
    time.sleep(0.2)
    assert store.db.execute("SELECT status FROM runs").fetchone() == ("completed",)


def test_store_of_an_older_privgrad_is_upgraded(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript("""
        CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL DEFAULT 'train',
            status TEXT NOT NULL, started REAL NOT NULL, finished REAL, git_commit TEXT,
            config TEXT NOT NULL, record TEXT, wall_time_s REAL);
        CREATE TABLE epochs (run_id INTEGER NOT NULL REFERENCES runs(id), epoch INTEGER NOT NULL,
            metrics TEXT NOT NULL, PRIMARY KEY (run_id, epoch));
        INSERT INTO runs (status, started, config) VALUES ('running', 0, '{}');
    """)
    db.close()
    store = RunStore(tmp_path / "old.db")
    assert [r["status"] for r in store.runs()] == ["lost"]  # left 'running' forever by the old code
    assert store.start({}) == 2


def _garbage(path):
    path.write_bytes(os.urandom(5000))


def _truncated(path):
    store = RunStore(path)
    for _ in range(200):
        store.import_record({"note": "x" * 500})
    store.close()
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


@pytest.mark.parametrize("make", [_garbage, _truncated])
@pytest.mark.parametrize("command", ["runs", "train"])
def test_corrupt_store_is_one_line_naming_the_file(tmp_path, monkeypatch, make, command):
    import privgrad.app.train

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded before the run store was checked")

    monkeypatch.setattr(privgrad.app.train, "load_dataset", no_data)
    db = tmp_path / "bad.db"
    make(db)
    code, out, err = run_cli(
        command, "--db", str(db), *(["--limit-train", "100"] if command == "train" else [])
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: run store {db}: ") and "--db" in err


@pytest.mark.parametrize("command", ["runs", "train"])
def test_read_only_store_is_refused_before_loading_data(tmp_path, monkeypatch, command):
    """SQLite opens a file it may not write read-only (root may write any file, so the
    test opens it read-only itself)."""
    import privgrad.app.train

    monkeypatch.setattr(
        privgrad.app.train, "load_dataset", lambda *a, **k: pytest.fail("data loaded first")
    )
    db = tmp_path / "ro.db"
    RunStore(db).close()
    connect = sqlite3.connect
    monkeypatch.setattr(
        store_module.sqlite3,
        "connect",
        lambda path, **kw: connect(f"file:{path}?mode=ro", uri=True, **kw),
    )
    code, out, err = run_cli(command, "--db", str(db))
    assert code == 2 and err.count("\n") == 1
    assert f"run store {db}: attempt to write a readonly database; make it" in err


def test_directory_or_uncreatable_folder_as_store(tmp_path):
    code, _, err = run_cli("train", "--db", str(tmp_path))
    assert (
        code == 2
        and err
        == f"error: run store {tmp_path} is a directory; pass --db a file path "
        f"such as {tmp_path / 'privgrad.db'}\n"
    )
    (tmp_path / "file").write_text("")
    code, _, err = run_cli("train", "--db", str(tmp_path / "file" / "sub" / "r.db"))
    assert code == 2 and err.count("\n") == 1
    assert "cannot create the folder of the run store" in err and str(tmp_path / "file") in err


def test_host_and_pid_are_recorded(tmp_path):
    store = RunStore(tmp_path / "r.db")
    store.start({})
    assert store.db.execute("SELECT pid, host FROM runs").fetchone() == (
        os.getpid(),
        socket.gethostname(),
    )
