"""The run store: every ``privgrad train`` run in one SQLite file.

A run is inserted as ``running`` when it starts, each epoch's metrics are committed as
they come, and the final record is written in one transaction that also marks the run
``completed``. Ctrl-C marks it ``interrupted`` and an error ``failed``; a reader never
sees a half-written final record. A resumed run keeps its id and goes back to ``running``.
"""
from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import subprocess
import time
from pathlib import Path

DEFAULT_DB = Path("runs") / "privgrad.db"

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
    wall_time_s REAL
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


class RunStore:
    def __init__(self, path: str | Path = DEFAULT_DB):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.executescript(SCHEMA)

    def start(self, config: dict, kind: str = "train") -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, status, started, git_commit, config) VALUES (?, 'running', ?, ?, ?)",
                (kind, time.time(), git_commit(), to_json(config)))
        return cur.lastrowid

    def log_epoch(self, run_id: int, epoch: int, metrics: dict) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO epochs VALUES (?, ?, ?)",
                            (run_id, epoch, to_json(metrics)))

    def finish(self, run_id: int, record: dict) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status='completed', finished=?, record=?, wall_time_s=? "
                            "WHERE id=?", (time.time(), to_json(record), record.get("wall_time_s"), run_id))

    def reopen(self, run_id: int) -> None:
        """Marks a stopped run ``running`` again (it is being resumed)."""
        with self.db:
            self.db.execute("UPDATE runs SET status='running', finished=NULL WHERE id=?", (run_id,))

    def abort(self, run_id: int, status: str) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status=?, finished=? WHERE id=?", (status, time.time(), run_id))

    def import_record(self, record: dict, kind: str = "train") -> int:
        """Adds a completed run from a JSON run record (e.g. one committed under results/)."""
        with self.db:
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
        q = "SELECT id, kind, status, started, git_commit, config, record, wall_time_s FROM runs"
        args: list = []
        if status:
            q += " WHERE status=?"
            args.append(status)
        elif run_id is not None:
            q += " WHERE id=?"
            args.append(run_id)
        q += " ORDER BY id DESC" + (f" LIMIT {int(limit)}" if limit else "")
        rows = self.db.execute(q, args).fetchall()
        return [{"id": r[0], "kind": r[1], "status": r[2], "started": r[3], "git_commit": r[4],
                 "config": json.loads(r[5]), "record": json.loads(r[6]) if r[6] else None,
                 "wall_time_s": r[7]} for r in rows]

    def epochs(self, run_id: int) -> list[dict]:
        rows = self.db.execute("SELECT epoch, metrics FROM epochs WHERE run_id=? ORDER BY epoch",
                               (run_id,)).fetchall()
        return [{"epoch": e, **json.loads(m)} for e, m in rows]

    def close(self) -> None:
        self.db.close()


@contextlib.contextmanager
def recorded_run(store: RunStore | None, config: dict, kind: str = "train", run_id: int | None = None):
    """Starts a run in ``store`` (if any; or reopens run ``run_id``, being resumed) and yields
    its id; the body finishes it with ``store.finish``. Ctrl-C marks the run ``interrupted``,
    any other error ``failed``."""
    if store and run_id is not None:
        store.reopen(run_id)
    elif store:
        run_id = store.start(config, kind)
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
