"""What every record privgrad writes carries, and how it is written.

``git_commit`` and ``code_version`` say which code made a record (the second hashes the
package minus the modules that only present results, so editing a table's layout does not
invalidate finished runs); ``environment`` says where it ran; :func:`provenance` is these
and privgrad's version, as every writer records them; ``to_json`` writes a record without
NaN/Infinity literals.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# Modules that present results but never touch a training step (paths inside the package).
PRESENTATION = ("app/cli.py", "lab/")


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=PACKAGE_DIR, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=PACKAGE_DIR,
        ).stdout.strip()
        return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Where a run ran: what can change its numbers when its code does not (the same code and
    seed gave other GAN values in another session, results/README.md, RDP-GAN): the software
    (numpy and scipy do the accountant's arithmetic: with the same inputs, DP-GAN's ε moved in
    its eighth digit between two sessions), the CPU and the instruction set its kernels use, the
    threads they split sums over, and the GPU, named only when the run used CUDA."""
    import torch

    return {
        "torch": str(torch.__version__),  # a TorchVersion, which a weights-only load refuses
        "python": platform.python_version(),
        **{name: _version(name) for name in ("numpy", "scipy", "dp-accounting")},
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_initialized() else None,
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def provenance() -> dict:
    """The fields every record carries to name what made it: privgrad's version, the commit
    (``-dirty`` for a working tree with changes), the training code's hash and the environment."""
    from privgrad import __version__

    return {
        "privgrad_version": __version__,
        "git_commit": git_commit(),
        "code_version": code_version(),
        "environment": environment(),
    }


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


def code_version() -> str:
    """Hash of privgrad's training code (every module but the presentation ones)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        if rel.startswith(PRESENTATION) or "__pycache__" in rel:
            continue
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + h.hexdigest()[:16]
