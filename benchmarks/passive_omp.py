"""Re-executes a benchmark script with ``OMP_WAIT_POLICY=PASSIVE`` when the variable is unset.

OpenMP workers spin while idle unless the policy is passive, and the spinning would count
as CPU time. The runtime reads the variable when it loads (with torch), so each script calls
:func:`reexec_with_passive_omp` first, before importing torch; an exported value is kept.
"""

from __future__ import annotations

import os
import sys


def reexec_with_passive_omp(script: str) -> None:
    """Replaces this process by ``script`` run again with the policy set, unless it is set."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]])
