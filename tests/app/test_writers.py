"""One writer per run: a run still being trained cannot be resumed by a second process; a
rank that stops answering fails a data-parallel run within a bounded time (stored
``failed``); ``--nproc`` beyond the machine's cores or memory is refused before launching.

The race and resource cases run real ``privgrad`` processes, each bounded in time, and kill
what they started."""

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from privgrad import distributed
from privgrad.errors import PrivgradError
from privgrad.app.store import STALE_AFTER_S, RunStore

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TRAIN = [
    "train",
    "--limit-train",
    "400",
    "--validation",
    "50",
    "--batch-size",
    "64",
    "--epochs",
    "200",
    "--noise-multiplier",
    "1",
    "--quiet",
]


def privgrad(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "privgrad", *args],
        env=kwargs.pop("env", ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def query(db, sql, args=()):
    try:
        with sqlite3.connect(db, timeout=30) as con:
            return con.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(
                f"the process ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}"
            )
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=60)


# --------------------------------------------------------------------------- resume


def test_resume_of_a_run_still_training_is_refused_until_its_process_is_gone(tmp_path):
    db = str(tmp_path / "runs.db")
    trainer = privgrad(*TRAIN, "--db", db, cwd=tmp_path)
    resumer = None
    try:
        # running, with a checkpoint to resume from (its first epoch is logged after it)
        wait_for(
            lambda: query(
                db,
                "SELECT 1 FROM runs r JOIN epochs e ON e.run_id = r.id WHERE r.status = 'running'",
            ),
            180,
            "logged epoch",
            trainer,
        )
        assert query(db, "SELECT pid FROM runs") == [(trainer.pid,)]
        start = time.monotonic()
        resumer = privgrad("resume", "1", "--db", db, "--quiet", cwd=tmp_path)
        # either refused (it exits) or, the bug, it takes the run over (its pid is stored)
        wait_for(
            lambda: (
                resumer.poll() is not None
                or query(db, "SELECT 1 FROM runs WHERE pid=?", (resumer.pid,))
            ),
            120,
            "answer from 'privgrad resume'",
        )
        assert query(db, "SELECT pid FROM runs") == [(trainer.pid,)], (
            "a second process took over a live run"
        )
        _, err = resumer.communicate(timeout=60)
        assert resumer.returncode == 2 and time.monotonic() - start < 120
        assert err.strip().splitlines() == [err.strip()]  # one line
        assert f"run 1 is still being written by process {trainer.pid}" in err
        assert trainer.poll() is None and query(db, "SELECT status FROM runs") == [("running",)]

        trainer.kill()  # gone without a word: its pid is dead, so the run may be resumed
        trainer.wait(timeout=60)
        resumer = privgrad("resume", "1", "--db", db, "--quiet", cwd=tmp_path)
        wait_for(
            lambda: query(
                db, "SELECT 1 FROM runs WHERE pid=? AND status='running'", (resumer.pid,)
            ),
            180,
            "resume of the dead run",
            resumer,
        )
    finally:
        stop(trainer)
        if resumer is not None:
            stop(resumer)


def test_two_claims_of_one_run_cannot_both_win(tmp_path):
    store = RunStore(tmp_path / "r.db")
    run_id = store.start({"mechanism": "dpsgd"})
    store.abort(run_id, "interrupted")
    store.reopen(run_id)  # the first resume claims it (this process)
    with pytest.raises(
        PrivgradError, match=f"run {run_id} is still being written by process {os.getpid()}"
    ):
        RunStore(tmp_path / "r.db").reopen(run_id)  # a second one, even from the same process
    store.abort(run_id, "interrupted")
    RunStore(tmp_path / "r.db").reopen(run_id)  # released: claimable again


def test_owner_alive_checks_pid_reuse_host_and_heartbeat():
    from privgrad.app.store import _process_started, owner_alive

    host, now = socket.gethostname(), time.time()
    me = os.getpid()
    assert owner_alive(me, host, now)
    init_started = _process_started(1)  # an old live process: alive even with a stale heartbeat
    if init_started is not None and now - init_started > STALE_AFTER_S + 1:
        assert owner_alive(1, host, init_started + 1)
    # a live process that started after the run's last heartbeat reused the pid: not the owner
    child = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.1)
        assert not owner_alive(child.pid, host, now - 60)
        assert owner_alive(child.pid, host, time.time())
        os.kill(child.pid, signal.SIGSTOP)  # a stopped owner would write again once continued
        assert owner_alive(child.pid, host, time.time())
    finally:
        child.kill()
        child.wait()
    assert not owner_alive(child.pid, host, time.time())  # dead
    # another host: its pids mean nothing here, only the heartbeat counts
    assert owner_alive(1, "elsewhere", now - 5) and not owner_alive(
        1, "elsewhere", now - STALE_AFTER_S - 5
    )
    assert owner_alive(None, host, now - 5) and not owner_alive(None, host, now - STALE_AFTER_S - 5)


# --------------------------------------------------------------------------- a stopped rank


def _descendants(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def _rank_of(pid: int) -> int | None:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)


def _pending_signals(pid: int) -> int:
    """The signals pending for process ``pid`` (its threads' and its own), as a bit mask."""
    masks = [
        int(line.split()[1], 16)
        for line in open(f"/proc/{pid}/status")
        if line.startswith(("SigPnd:", "ShdPnd:"))
    ]
    return masks[0] | masks[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_a_stopped_rank_fails_the_run_within_a_bounded_time(tmp_path):
    """Rank 1 gets SIGSTOP mid-training: rank 0's next collective times out after
    PRIVGRAD_COLLECTIVE_TIMEOUT_S (10 s here), the run is stored ``failed``, torchrun sends the
    stopped rank SIGTERM, and the launcher exits with one line. torchrun waits a fixed 30 s
    before it SIGKILLs a rank that ignores SIGTERM (its own grace, not privgrad's); the test
    sends that SIGKILL itself once the SIGTERM is pending, instead of waiting."""
    db = str(tmp_path / "runs.db")
    launcher = privgrad(
        *TRAIN,
        "--db",
        db,
        "--nproc",
        "2",
        cwd=tmp_path,
        env={**ENV, "PRIVGRAD_COLLECTIVE_TIMEOUT_S": "10"},
    )
    rank1, ranks = None, []
    try:
        wait_for(lambda: query(db, "SELECT 1 FROM epochs"), 240, "logged epoch", launcher)
        ranks = _descendants(launcher.pid)
        rank1 = wait_for(lambda: {_rank_of(p): p for p in ranks}.get(1), 30, "rank 1")
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        sigterm = 1 << (signal.SIGTERM - 1)
        wait_for(lambda: _pending_signals(rank1) & sigterm, 60, "torchrun's SIGTERM", launcher)
        took = time.monotonic() - stopped
        assert query(db, "SELECT status FROM runs") == [("failed",)]
        assert took < 30
        os.kill(rank1, signal.SIGKILL)  # what torchrun does 30 s later
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 2, err
        assert err.strip().splitlines() == [err.strip()], err  # one line
        assert "rank 0: another rank did not answer within 10 s" in err
        assert query(db, "SELECT status FROM runs") == [("failed",)]
    finally:
        for pid, sig in [(rank1, signal.SIGCONT), *((p, signal.SIGKILL) for p in ranks)]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, TypeError):
                pass
        stop(launcher)


def test_collective_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.collective_timeout() == distributed.COLLECTIVE_TIMEOUT_S
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "7.5")
    assert distributed.collective_timeout() == 7.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(PrivgradError, match=distributed.TIMEOUT_ENV):
            distributed.collective_timeout()


# --------------------------------------------------------------------------- --nproc


def test_nproc_above_the_cores_is_refused_before_anything_runs(tmp_path):
    """One more rank than cores (the issue's --nproc 64 was OOM-killed; launch's unit test
    below covers 64 without launching anything)."""
    db = tmp_path / "runs.db"
    cores = len(os.sched_getaffinity(0))
    args = [*TRAIN, "--epochs", "1", "--db", str(db), "--nproc", str(cores + 1)]
    result = subprocess.run(
        [sys.executable, "-m", "privgrad", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: --nproc {cores + 1} exceeds the {cores} CPU core(s) this process "
        f"may use; use at most --nproc {cores}"
    )
    assert not db.exists() or query(str(db), "SELECT * FROM runs") == []


def test_nproc_beyond_memory_is_refused_and_nothing_is_launched(monkeypatch):
    import torch.distributed.run

    launched = []
    monkeypatch.setattr(torch.distributed.run, "run", launched.append)
    monkeypatch.setattr(distributed, "usable_cores", lambda: 64, raising=False)
    monkeypatch.setattr(distributed, "available_memory", lambda: 3 * (1 << 30) + 5, raising=False)
    with pytest.raises(PrivgradError, match="--nproc 65 exceeds the 64 CPU core"):
        distributed.launch(65, ["train"])
    with pytest.raises(
        PrivgradError,
        match=r"--nproc 4 needs about 4 GiB \(1 GiB per process\), more than "
        r"the 3\.0 GiB available; use at most --nproc 3",
    ):
        distributed.launch(4, ["train"])
    for bad in (0, -1):
        with pytest.raises(PrivgradError, match="--nproc must be ≥ 1"):
            distributed.launch(bad, ["train"])
    assert launched == []
    distributed.launch(3, ["train"])  # fits: launched
    assert len(launched) == 1
