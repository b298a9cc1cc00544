"""The run store: every ``privgrad train`` run in one SQLite file.

A run is inserted as ``running`` when it starts, each epoch's metrics are committed as
they come, and the final record is written in one transaction that also marks the run
``completed``. Ctrl-C (and SIGTERM/SIGHUP) marks it ``interrupted``, a plan the user
declined at the prompt ``declined`` and an error ``failed``;
a reader never sees a half-written final record. A resumed run keeps its id and goes back
to ``running``. A running run stores its pid and host and a heartbeat every
:data:`HEARTBEAT_S` seconds; one whose process died without a word (SIGKILL, power loss)
is marked ``lost`` by the next reader.

One writer per run: a run is resumed (:meth:`RunStore.reopen`) only if the process that
owns it is gone. The check and the claim are one SQLite write transaction, so two resumes
cannot both win. The owner counts as alive (see :func:`owner_alive`) when the run is
``running`` or ``lost`` and, on this host, its pid is alive and that process started no
later than the run's last heartbeat (a later start is another process that reused the pid);
where a process's start time cannot be read, or on another host (whose pids mean nothing
here), when the heartbeat is fresh (younger than :data:`STALE_AFTER_S`). A stopped
(SIGSTOP) owner is alive: it would write again once continued.

The file is opened in WAL mode with a busy timeout, so that concurrent runs and readers
wait for each other; any SQLite failure is a one-line :class:`PrivgradError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path

from privgrad.errors import PlanDeclined, PrivgradError
from privgrad.records import git_commit, to_json

DEFAULT_DB = Path("runs") / "privgrad.db"
HEARTBEAT_S = 30.0  # a running run's heartbeat period
STALE_AFTER_S = 300.0  # a running run whose heartbeat is older than this is lost
BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write

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
    heartbeat REAL,
    error TEXT
);
CREATE TABLE IF NOT EXISTS epochs (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    epoch INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
"""


SCHEMA_VERSION = 3  # 2: pid, host and heartbeat of running runs; 3: a failed run's error


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


PID_REUSE_SLACK_S = 2.0  # clock slack when comparing a process's start with a heartbeat


def _process_started(pid: int) -> float | None:
    """When process ``pid`` of this machine started (seconds since the epoch), from
    ``/proc`` (Linux); None where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5): starttime, clock ticks after boot
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_alive(
    pid: int | None, host: str | None, heartbeat: float, now: float | None = None
) -> bool:
    """Whether the process that wrote a running run's ``pid``, ``host`` and last ``heartbeat``
    may still be alive (and so may still write the run).

    On this host: its pid is alive and (pid reuse) that process started no later than the
    heartbeat it wrote, give or take :data:`PID_REUSE_SLACK_S`; without ``/proc``, the pid is
    alive and the heartbeat fresh. Elsewhere, or with no pid: the heartbeat is fresh (younger
    than :data:`STALE_AFTER_S`), since a remote pid cannot be checked."""
    now = time.time() if now is None else now
    fresh = now - heartbeat <= STALE_AFTER_S
    if host != socket.gethostname() or not pid:
        return fresh
    if not _pid_alive(pid):
        return False
    started = _process_started(pid)
    return fresh if started is None else started <= heartbeat + PID_REUSE_SLACK_S


class RunStore:
    """The run store at ``path`` (created with its folder if missing); it must be writable."""

    def __init__(self, path: str | Path = DEFAULT_DB):
        self.path = Path(path)
        if self.path.is_dir():
            raise PrivgradError(
                f"run store {self.path} is a directory; pass --db a file path such as "
                f"{self.path / 'privgrad.db'}"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PrivgradError(
                f"cannot create the folder of the run store {self.path} "
                f"({e.strerror}: {e.filename}); pass --db a path in a writable folder"
            ) from e
        with self._errors():
            self.db = _connect(self.path)
            check = self.db.execute("PRAGMA quick_check").fetchall()
            if check != [
                ("ok",)
            ]:  # e.g. a truncated file, whose missing pages no query has read yet
                raise sqlite3.DatabaseError(f"database disk image is malformed ({check[0][0]})")
            self.db.executescript(SCHEMA)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(runs)")}
            for column, kind in (
                ("pid", "INTEGER"),
                ("host", "TEXT"),
                ("heartbeat", "REAL"),
                ("error", "TEXT"),
            ):
                if column not in have:  # a store written by an older privgrad
                    self.db.execute(f"ALTER TABLE runs ADD COLUMN {column} {kind}")
            self.db.execute(
                f"PRAGMA user_version = {SCHEMA_VERSION}"
            )  # also: fails now if read-only
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
                hint = (
                    "it is not a valid run store (corrupt or not SQLite); move it away or pass "
                    "another --db"
                )
            elif "locked" in text or "busy" in text:
                hint = (
                    f"another process held it for over {BUSY_TIMEOUT_S:g} s; retry, or pass "
                    "another --db"
                )
            else:
                hint = "check the file and its folder, or pass another --db"
            raise PrivgradError(f"run store {self.path}: {text}; {hint}") from e

    def start(self, config: dict, kind: str = "train") -> int:
        now = time.time()
        with self._errors(), self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, status, started, git_commit, config, pid, host, "
                "heartbeat) VALUES (?, 'running', ?, ?, ?, ?, ?, ?)",
                (kind, now, git_commit(), to_json(config), os.getpid(), socket.gethostname(), now),
            )
        return cur.lastrowid

    def mark_lost(self) -> None:
        """Marks ``lost`` every running run whose heartbeat is stale or, on this host, whose
        process is gone (a run killed without a word: SIGKILL, power loss)."""
        host, now = socket.gethostname(), time.time()
        with self._errors(), self.db:
            rows = self.db.execute(
                "SELECT id, pid, host, COALESCE(heartbeat, started) FROM runs "
                "WHERE status='running'"
            ).fetchall()
            lost = [
                (run_id,)
                for run_id, pid, run_host, beat in rows
                if now - beat > STALE_AFTER_S or (run_host == host and pid and not _pid_alive(pid))
            ]
            self.db.executemany(
                "UPDATE runs SET status='lost' WHERE id=? AND status='running'", lost
            )

    def log_epoch(self, run_id: int, epoch: int, metrics: dict) -> None:
        with self._errors(), self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO epochs VALUES (?, ?, ?)", (run_id, epoch, to_json(metrics))
            )

    def finish(self, run_id: int, record: dict) -> None:
        with self._errors(), self.db:
            self.db.execute(
                "UPDATE runs SET status='completed', finished=?, record=?, wall_time_s=? "
                "WHERE id=?",
                (time.time(), to_json(record), record.get("wall_time_s"), run_id),
            )

    def reopen(self, run_id: int) -> None:
        """Marks a stopped run ``running`` again (it is being resumed, by this process).
        Refuses, in the same write transaction, a run whose process may still be alive
        (:meth:`check_no_writer`): two processes must never write one run."""
        with self._errors(), self.db:
            self.db.execute("BEGIN IMMEDIATE")  # the check and the claim: one writer at a time
            self.check_no_writer(run_id)
            self.db.execute(
                "UPDATE runs SET status='running', finished=NULL, pid=?, host=?, heartbeat=?, "
                "error=NULL WHERE id=?",
                (os.getpid(), socket.gethostname(), time.time(), run_id),
            )

    def check_no_writer(self, run_id: int) -> None:
        """Raises a one-line :class:`PrivgradError` if run ``run_id`` is ``running`` (or
        ``lost``, which a live process's heartbeat turns back into ``running``) and its
        process may still be alive (:func:`owner_alive`)."""
        with self._errors():
            row = self.db.execute(
                "SELECT status, pid, host, COALESCE(heartbeat, started) FROM runs WHERE id=?",
                (run_id,),
            ).fetchone()
        if row is None or row[0] not in ("running", "lost"):
            return
        status, pid, host, beat = row
        now = time.time()
        if owner_alive(pid, host, beat, now):
            where = f"process {pid} on {host}" if pid else f"a process on {host}"
            raise PrivgradError(
                f"run {run_id} is still being written by {where} (status {status}, last heartbeat "
                f"{max(0.0, now - beat):.0f} s ago); stop that process first: two processes must "
                "not write one run"
            )

    def abort(self, run_id: int, status: str, error: str | None = None) -> None:
        """Marks run ``run_id`` stopped with ``status``; ``error``: why it failed."""
        with self._errors(), self.db:
            self.db.execute(
                "UPDATE runs SET status=?, finished=?, error=? WHERE id=?",
                (status, time.time(), error, run_id),
            )

    def import_record(self, record: dict, kind: str = "train") -> int:
        """Adds a completed run from a JSON run record (e.g. one committed under results/)."""
        with self._errors(), self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, status, started, finished, git_commit, config, record, "
                "wall_time_s) "
                "VALUES (?, 'completed', ?, ?, ?, ?, ?, ?)",
                (
                    kind,
                    time.time(),
                    time.time(),
                    record.get("git_commit"),
                    to_json(record.get("config", {})),
                    to_json(record),
                    record.get("wall_time_s"),
                ),
            )
        return cur.lastrowid

    def run(self, run_id: int) -> dict | None:
        found = self.runs(run_id=run_id)
        return found[0] if found else None

    def train_run(self, run_id: int, only: str) -> dict:
        """Run ``run_id``, which must be a 'privgrad train' run: one line otherwise, ``only``
        saying what only those runs do ('resume')."""
        run = self.run(run_id)
        if run is None:
            raise PrivgradError(f"no run {run_id} in the run store {self.path}")
        if run["kind"] != "train":
            raise PrivgradError(
                f"run {run_id} is a '{run['kind']}' run; only 'privgrad train' runs {only}"
            )
        return run

    def runs(
        self, status: str | None = None, limit: int | None = None, run_id: int | None = None
    ) -> list[dict]:
        """The runs, newest first (dead ``running`` runs are marked ``lost`` first)."""
        self.mark_lost()
        q = (
            "SELECT id, kind, status, started, git_commit, config, record, wall_time_s, error "
            "FROM runs"
        )
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
        return [
            {
                "id": r[0],
                "kind": r[1],
                "status": r[2],
                "started": r[3],
                "git_commit": r[4],
                "config": json.loads(r[5]),
                "record": json.loads(r[6]) if r[6] else None,
                "wall_time_s": r[7],
                **({"error": r[8]} if r[8] else {}),  # why a failed run failed
            }
            for r in rows
        ]

    def epochs(self, run_id: int) -> list[dict]:
        with self._errors():
            rows = self.db.execute(
                "SELECT epoch, metrics FROM epochs WHERE run_id=? ORDER BY epoch", (run_id,)
            ).fetchall()
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
                with (
                    contextlib.closing(db),
                    db,
                ):  # a run marked lost while its machine slept runs again,
                    db.execute(
                        # unless resumed
                        "UPDATE runs SET heartbeat=?, status='running' WHERE id=? "
                        "AND status IN ('running', 'lost') AND pid=? AND host=?",  # by another
                        (time.time(), self.run_id, os.getpid(), socket.gethostname()),
                    )
            except sqlite3.Error:
                # store busy or gone: the next beat retries; the run's own writes report errors
                continue

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def _error_line(err: BaseException) -> str:
    """What a failed run's error says, on one line: privgrad's message as the CLI prints it,
    another exception's type too."""
    text = " ".join(str(err).split())
    return text if isinstance(err, PrivgradError) else f"{type(err).__name__}: {text}".rstrip(": ")


@contextlib.contextmanager
def recorded_run(
    store: RunStore | None, config: dict, kind: str = "train", run_id: int | None = None
):
    """Starts a run in ``store`` (if any; or reopens run ``run_id``, being resumed) and yields
    its id; the body finishes it with ``store.finish``. Ctrl-C marks the run ``interrupted``,
    a declined plan (:class:`PlanDeclined`) ``declined``, any other error ``failed``; a
    heartbeat is written while the body runs."""
    if store and run_id is not None:
        store.reopen(run_id)
    elif store:
        run_id = store.start(config, kind)
    heartbeat = _Heartbeat(store.path, run_id) if store else None
    if heartbeat:
        heartbeat.start()
    try:
        yield run_id
    except KeyboardInterrupt as stop:
        if store:
            store.abort(run_id, "interrupted")
            stop.stopped_run = (store.path, run_id, kind)  # the CLI's message names it
        raise
    except PlanDeclined:
        if store:
            store.abort(run_id, "declined")
        raise
    except BaseException as err:
        if store:
            store.abort(run_id, "failed", _error_line(err))
        raise
    finally:
        if heartbeat:
            heartbeat.stop()
