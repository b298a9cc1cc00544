"""CPU threads for the commands that train, chosen so that a run on a shared machine does not stall.

PyTorch's default (one OpenMP thread per core, spinning while it waits) lets a run on a busy
machine crawl, its threads competing with whatever else runs. privgrad sets
``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets it) before torch starts, and
:data:`DEFAULT_THREADS` threads unless ``--threads`` or ``OMP_NUM_THREADS`` says otherwise
(torchrun sets ``OMP_NUM_THREADS=1`` per rank). One passive thread was the fastest with the
other cores busy and close to the fastest idle: whole runs timed by ``benchmarks/threads.sh``,
table in ``results/bench/threads.txt``.
No torch import at module level: the CLI imports this at start-up.
"""

from __future__ import annotations

import os

from privgrad.errors import PrivgradError

DEFAULT_THREADS = 1


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
        threads, source = DEFAULT_THREADS, "default"
    torch.set_num_threads(threads)
    return threads, source
