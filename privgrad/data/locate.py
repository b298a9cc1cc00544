"""Finding a dataset's files on disk.

Base directories are searched in this order: the explicit ``data_dir`` argument,
``$PRIVGRAD_DATA``, the repository's ``data/``, then ``<repo>/../shared/data``. Within a
base directory each dataset lives in a fixed sub-folder (:data:`SUBDIRS`); the first
candidate folder holding every required file wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from privgrad.errors import DataError, PrivgradError

REPO_ROOT = Path(__file__).resolve().parents[2]

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
    """Base directories to search, in priority order, without duplicates."""
    roots = []
    if data_dir is not None:
        roots.append(Path(data_dir).expanduser())
    env = os.environ.get("PRIVGRAD_DATA")
    if env:
        roots.append(Path(env).expanduser())
    roots += [REPO_ROOT / "data", REPO_ROOT.parent / "shared" / "data"]
    return list(dict.fromkeys(roots))


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
    raise DataError(
        f"{name}: expected {', '.join(required)} in one of: "
        f"{', '.join(str(c) for c in candidates)} (set --data-dir or $PRIVGRAD_DATA)"
    )
