"""The run store: every ``privgrad train`` run in one SQLite file.

A run is inserted as ``running`` when it starts, each epoch's metrics are committed as
they come, and the final record is written in one transaction that also marks the run
``completed``. Ctrl-C (and SIGTERM/SIGHUP) marks it ``interrupted`` and an error ``failed``;
a reader never sees a half-written final record. A resumed run keeps its id and goes back
to ``running``. A running run stores its pid and host and a heartbeat every
:data:`HEARTBEAT_S` seconds; one whose process died without a word (SIGKILL, power loss)
is marked ``lost`` by the next reader.

The file is opened in WAL mode with a busy timeout, so that concurrent runs and readers
wait for each other; any SQLite failure is a one-line :class:`PrivgradError` naming the file.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

from .errors import PrivgradError

DEFAULT_DB = Path("runs") / "privgrad.db"
HEARTBEAT_S = 30.0        # a running run's heartbeat period
STALE_AFTER_S = 300.0     # a running run whose heartbeat is older than this is lost
BUSY_TIMEOUT_S = 30.0     # how long a write waits for another process's write

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL DEFAULT 'train',
    status TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    git_commit TEXT,
    config TEXT NOT NULL,
    record TEXT,
    wall_time_s REAL,
    pid INTEGER,
    host TEXT,
    heartbeat REAL
);
CREATE TABLE IF NOT EXISTS epochs (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    epoch INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
"""


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def to_json(obj) -> str:
    """JSON without NaN/Infinity literals: non-finite floats become null."""
    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o
    return json.dumps(clean(obj), allow_nan=False)


SCHEMA_VERSION = 2  # 2: pid, host and heartbeat of running runs


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
    try:
        db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error:
        db.close()
        raise
    return db


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunStore:
    """The run store at ``path`` (created with its folder if missing); it must be writable."""

    def __init__(self, path: str | Path = DEFAULT_DB):
        self.path = Path(path)
        if self.path.is_dir():
            raise PrivgradError(f"run store {self.path} is a directory; pass --db a file path such as "
                                f"{self.path / 'privgrad.db'}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PrivgradError(f"cannot create the folder of the run store {self.path} "
                                f"({e.strerror}: {e.filename}); pass --db a path in a writable folder") from e
        with self._errors():
            self.db = _connect(self.path)
            check = self.db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:  # e.g. a truncated file, whose missing pages no query has read yet
                raise sqlite3.DatabaseError(f"database disk image is malformed ({check[0][0]})")
            self.db.executescript(SCHEMA)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(runs)")}
            for column, kind in (("pid", "INTEGER"), ("host", "TEXT"), ("heartbeat", "REAL")):
                if column not in have:  # a store written by an older privgrad
                    self.db.execute(f"ALTER TABLE runs ADD COLUMN {column} {kind}")
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # also: fails now if read-only
            self.db.commit()

    @contextlib.contextmanager
    def _errors(self):
        """SQLite failures as one line naming the file and what to do."""
        try:
            yield
        except sqlite3.Error as e:
            text = str(e)
            if "readonly" in text or "read-only" in text:
                hint = "make it (and its folder) writable or pass another --db"
            elif "not a database" in text or "malformed" in text:
                hint = "it is not a valid run store (corrupt or not SQLite); move it away or pass another --db"
            elif "locked" in text or "busy" in text:
                hint = f"another process held it for over {BUSY_TIMEOUT_S:g} s; retry, or pass another --db"
            else:
                hint = "check the file and its folder, or pass another --db"
            raise PrivgradError(f"run store {self.path}: {text}; {hint}") from e

    def start(self, config: dict, kind: str = "train") -> int:
        now = time.time()
        with self._errors(), self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, status, started, git_commit, config, pid, host, heartbeat) "
                "VALUES (?, 'running', ?, ?, ?, ?, ?, ?)",
                (kind, now, git_commit(), to_json(config), os.getpid(), socket.gethostname(), now))
        return cur.lastrowid

    def mark_lost(self) -> None:
        """Marks ``lost`` every running run whose heartbeat is stale or, on this host, whose
        process is gone (a run killed without a word: SIGKILL, power loss)."""
        host, now = socket.gethostname(), time.time()
        with self._errors(), self.db:
            rows = self.db.execute("SELECT id, pid, host, COALESCE(heartbeat, started) FROM runs "
                                   "WHERE status='running'").fetchall()
            lost = [(run_id,) for run_id, pid, run_host, beat in rows
                    if now - beat > STALE_AFTER_S or (run_host == host and pid and not _pid_alive(pid))]
            self.db.executemany("UPDATE runs SET status='lost' WHERE id=? AND status='running'", lost)

    def log_epoch(self, run_id: int, epoch: int, metrics: dict) -> None:
        with self._errors(), self.db:
            self.db.execute("INSERT OR REPLACE INTO epochs VALUES (?, ?, ?)",
                            (run_id, epoch, to_json(metrics)))

    def finish(self, run_id: int, record: dict) -> None:
        with self._errors(), self.db:
            self.db.execute("UPDATE runs SET status='completed', finished=?, record=?, wall_time_s=? "
                            "WHERE id=?", (time.time(), to_json(record), record.get("wall_time_s"), run_id))

    def reopen(self, run_id: int) -> None:
        """Marks a stopped run ``running`` again (it is being resumed, by this process)."""
        with self._errors(), self.db:
            self.db.execute("UPDATE runs SET status='running', finished=NULL, pid=?, host=?, heartbeat=? "
                            "WHERE id=?", (os.getpid(), socket.gethostname(), time.time(), run_id))

    def abort(self, run_id: int, status: str) -> None:
        with self._errors(), self.db:
            self.db.execute("UPDATE runs SET status=?, finished=? WHERE id=?", (status, time.time(), run_id))

    def import_record(self, record: dict, kind: str = "train") -> int:
        """Adds a completed run from a JSON run record (e.g. one committed under results/)."""
        with self._errors(), self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, status, started, finished, git_commit, config, record, wall_time_s) "
                "VALUES (?, 'completed', ?, ?, ?, ?, ?, ?)",
                (kind, time.time(), time.time(), record.get("git_commit"), to_json(record.get("config", {})),
                 to_json(record), record.get("wall_time_s")))
        return cur.lastrowid

    def run(self, run_id: int) -> dict | None:
        found = self.runs(run_id=run_id)
        return found[0] if found else None

    def runs(self, status: str | None = None, limit: int | None = None, run_id: int | None = None) -> list[dict]:
        """The runs, newest first (dead ``running`` runs are marked ``lost`` first)."""
        self.mark_lost()
        q = "SELECT id, kind, status, started, git_commit, config, record, wall_time_s FROM runs"
        args: list = []
        if status:
            q += " WHERE status=?"
            args.append(status)
        elif run_id is not None:
            q += " WHERE id=?"
            args.append(run_id)
        q += " ORDER BY id DESC" + (f" LIMIT {int(limit)}" if limit else "")
        with self._errors():
            rows = self.db.execute(q, args).fetchall()
        return [{"id": r[0], "kind": r[1], "status": r[2], "started": r[3], "git_commit": r[4],
                 "config": json.loads(r[5]), "record": json.loads(r[6]) if r[6] else None,
                 "wall_time_s": r[7]} for r in rows]

    def epochs(self, run_id: int) -> list[dict]:
        with self._errors():
            rows = self.db.execute("SELECT epoch, metrics FROM epochs WHERE run_id=? ORDER BY epoch",
                                   (run_id,)).fetchall()
        return [{"epoch": e, **json.loads(m)} for e, m in rows]

    def close(self) -> None:
        self.db.close()


class _Heartbeat(threading.Thread):
    """Writes a running run's heartbeat every :data:`HEARTBEAT_S` seconds (own connection)."""

    def __init__(self, path: Path, run_id: int):
        super().__init__(name=f"privgrad-heartbeat-{run_id}", daemon=True)
        self.path, self.run_id, self.stopped = path, run_id, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                db = _connect(self.path)
                with contextlib.closing(db), db:  # a run marked lost while its machine slept runs again
                    db.execute("UPDATE runs SET heartbeat=?, status='running' WHERE id=? "
                               "AND status IN ('running', 'lost')", (time.time(), self.run_id))
            except sqlite3.Error:
                continue  # store busy or gone: the next beat retries; the run's own writes report errors

    def stop(self) -> None:
        self.stopped.set()
        self.join()


@contextlib.contextmanager
def recorded_run(store: RunStore | None, config: dict, kind: str = "train", run_id: int | None = None):
    """Starts a run in ``store`` (if any; or reopens run ``run_id``, being resumed) and yields
    its id; the body finishes it with ``store.finish``. Ctrl-C marks the run ``interrupted``,
    any other error ``failed``; a heartbeat is written while the body runs."""
    if store and run_id is not None:
        store.reopen(run_id)
    elif store:
        run_id = store.start(config, kind)
    heartbeat = _Heartbeat(store.path, run_id) if store else None
    if heartbeat:
        heartbeat.start()
    try:
        yield run_id
    except KeyboardInterrupt:
        if store:
            store.abort(run_id, "interrupted")
        raise
    except BaseException:
        if store:
            store.abort(run_id, "failed")
        raise
    finally:
        if heartbeat:
            heartbeat.stop()
