"""CPU threads for the commands that train, chosen so that a run on a shared machine does not stall.

PyTorch's default (one OpenMP thread per core, spinning while it waits) lets a run on a busy
machine crawl, its threads competing with whatever else runs. privgrad sets
``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets it) before torch starts, and one
thread per usable core (:func:`default_threads`) unless ``--threads`` or ``OMP_NUM_THREADS``
says otherwise (torchrun sets ``OMP_NUM_THREADS=1`` per rank). Whole runs timed by
``benchmarks/threads.sh`` (``results/bench/threads.txt``, 5 runs each, medians, on 2 cores):
against one passive thread, two passive threads took 0.86× the wall time idle and 1.05× with
the other core busy, two spinning threads (PyTorch's own default) 0.98× and 1.54×. Passive
threads on every core are the fastest idle and within 10 % of the fastest loaded; spinning is
what stalls. Measured on 2 cores only.
No torch import at module level: the CLI imports this at start-up.
"""

from __future__ import annotations

import os

from privgrad.errors import PrivgradError


def default_threads() -> int:
    """One passive thread per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def configure_threads(threads: int | None = None) -> tuple[int, str]:
    """Sets the wait policy (before torch's OpenMP starts) and torch's thread count; returns
    (threads, where the number came from)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None and threads < 1:
        raise PrivgradError(f"--threads must be at least 1, got {threads}")
    import torch

    if threads is not None:
        source = "--threads"
    elif (
        os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1
    ):
        threads, source = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        threads, source = default_threads(), "default"
    torch.set_num_threads(threads)
    return threads, source
