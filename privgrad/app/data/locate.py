"""Finding a dataset's files on disk.

A folder the user names is the only one searched: the explicit ``data_dir`` argument if
given, else ``$PRIVGRAD_DATA`` if set; otherwise the repository's ``data/``, then
``<repo>/../shared/data``. Within a base directory each dataset lives in a fixed sub-folder
(:data:`SUBDIRS`); the first candidate folder holding every required file wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from privgrad.errors import DataError, PrivgradError

REPO_ROOT = Path(__file__).resolve().parents[3]

SUBDIRS: dict[str, tuple[str, ...]] = {
    "mnist": ("mnist",),
    "fashion-mnist": ("fashion-mnist",),
    "imdb": ("imdb",),
    "adult": ("adult",),
    "cifar10": (
        "cifar-10-batches-py",
        "cifar10/cifar-10-batches-py",
        "cifar10-subset/cifar-10-batches-py",
    ),
}


def data_roots(data_dir: str | Path | None = None) -> list[Path]:
    """Base directories to search, in priority order: ``data_dir`` alone if given, else
    ``$PRIVGRAD_DATA`` alone if set, else the repository's and the shared data folders."""
    if data_dir is not None:
        return [Path(data_dir).expanduser()]
    env = os.environ.get("PRIVGRAD_DATA")
    if env:
        return [Path(env).expanduser()]
    return [REPO_ROOT / "data", REPO_ROOT.parent / "shared" / "data"]


def find_dataset_dir(name: str, required: list[str], data_dir: str | Path | None = None) -> Path:
    """Return the first folder for dataset ``name`` that contains all ``required`` files.

    Raises :class:`DataError` (one line: dataset, expected files, every place searched)
    when no candidate folder has them all.
    """
    if name not in SUBDIRS:
        raise PrivgradError(f"unknown dataset {name!r}; valid names: {', '.join(SUBDIRS)}")
    candidates = [root / sub for root in data_roots(data_dir) for sub in SUBDIRS[name]]
    for folder in candidates:
        if all((folder / f).is_file() for f in required):
            return folder
    partial = [
        f"{folder} lacks {', '.join(f for f in required if not (folder / f).is_file())}"
        for folder in candidates
        if folder.is_dir()
    ]
    raise DataError(
        f"{name}: expected {', '.join(required)} in one of: "
        f"{', '.join(str(c) for c in candidates)}"
        + "".join(f"; {p}" for p in partial)
        + (" (set --data-dir or $PRIVGRAD_DATA)" if data_dir is None else "")
    )
