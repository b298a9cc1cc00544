"""Checkpoints of a training run: one file, written atomically, with a SHA-256 over its content.

The file is a header line ``privgrad-checkpoint 1 <sha256>`` followed by the ``torch.save``
bytes of the state (model, optimizer, sampler and noise RNGs, both privacy ledgers, the
configuration, the step count). It is written to a temporary file and renamed over the old
one, so a crash or Ctrl-C mid-write leaves the previous checkpoint intact. Loading checks the
hash before unpickling (``weights_only``: plain data and tensors only) and refuses a
mismatch.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from privgrad.app.store import DEFAULT_DB
from privgrad.errors import PrivgradError

FILENAME = "checkpoint.pt"
MAGIC = b"privgrad-checkpoint 1 "


def checkpoint_dir(db: str | Path, run_id: int) -> Path:
    """The run folder: ``checkpoints/<run_id>/`` next to the default run store
    (``runs/checkpoints/<id>/``), ``checkpoints/<store file name>/<run_id>/`` next to any
    other. Run ids restart in every store: two stores in one folder shared run folders, and
    one's run overwrote the other's checkpoint and metrics."""
    db = Path(db)
    base = db.parent / "checkpoints"
    return (base if db.name == DEFAULT_DB.name else base / db.name) / str(run_id)


def clear_run_folder(directory: str | Path) -> None:
    """Removes a new run's checkpoint and progress left in its folder by an earlier store's run
    of the same id (a store deleted and made again); its CSV files are cut by the metrics log."""
    for name in (FILENAME, FILENAME + ".tmp", "progress.json", "progress.json.tmp"):
        (Path(directory) / name).unlink(missing_ok=True)


def save_checkpoint(directory: str | Path, state: dict) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    import torch  # here, so that `privgrad runs` (which finds run folders) needs no torch

    torch.save(state, buffer)
    payload = buffer.getvalue()
    path, tmp = directory / FILENAME, directory / (FILENAME + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | Path) -> dict:
    """The state saved in ``directory``; a missing, foreign or altered file is refused."""
    path = Path(directory) / FILENAME
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise PrivgradError(f"no checkpoint at {path} ({err.strerror})") from None
    header, _, payload = blob.partition(b"\n")
    if not header.startswith(MAGIC):
        raise PrivgradError(f"{path} is not a privgrad checkpoint")
    if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC) :]:
        raise PrivgradError(
            f"{path}: the SHA-256 of its content does not match its header; "
            "the checkpoint is corrupt or was altered, and is not loaded"
        )
    try:
        import torch

        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as err:  # the hash matched, so this is a checkpoint privgrad cannot read
        raise PrivgradError(
            f"{path} cannot be read as plain data and tensors ({_reason(err)}); it is not loaded"
        ) from None


def _reason(err: Exception) -> str:
    """The cause in torch's refusal, without its advice to retry with ``weights_only=False``
    or to allowlist a class (either would run code the file names: never for a file whose
    content privgrad did not write itself)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        cause = text.split("WeightsUnpickler error:", 1)[1]
        cause = " ".join(cause.split("Check the documentation")[0].split())
        cause = cause.split(" Please use")[0].split(". Please")[0].rstrip(".")
        return cause or type(err).__name__
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return (
        f"{type(err).__name__}: {first}"
        if first and "weights_only" not in first
        else type(err).__name__
    )
