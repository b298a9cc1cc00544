"""The trained model as a user takes it home: weights plain PyTorch loads, and its privacy record.

``save_model`` writes ``PATH`` (the model's ``state_dict``, tensors on the CPU, saved with
``torch.save``: ``torch.load(PATH, weights_only=True)`` reads it, no privgrad needed) and
``PATH`` with the suffix ``.privacy.json`` beside it: honest ε, δ, σ_eff, q, steps, the
accountant, the neighbouring relation, the mechanism, how to rebuild the model and the code
version. Both are written to a temporary file and renamed, so an interrupted write leaves no
half file. Loading for inference::

    import torch, privgrad.app.models
    model = privgrad.app.models.build_model("cnn", (1, 28, 28), 10)   # the sidecar's "model" entry
    model.load_state_dict(torch.load("model.pt", weights_only=True)); model.eval()

A model with ``save_pretrained`` (a Hugging Face model, a ``peft`` model, or the command
line's ``hf:`` classifier) is also written as ``save_pretrained`` writes it, to the folder
``PATH`` with the suffix ``.hf`` (``from_pretrained`` reads it), with the same privacy record
inside as ``privacy.json`` (as :class:`privgrad.hf_trainer.DPTrainer` saves); the sidecar
names it under ``"hugging_face_folder"``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.records import to_json

SIDECAR_SUFFIX = ".privacy.json"
HF_SUFFIX = ".hf"  # the save_pretrained folder beside the weights
PRIVACY_FILE = "privacy.json"  # the privacy record inside a save_pretrained folder
# entries of a privacy record computed from the private training rows without noise, which its
# ε does not cover: the sidecar names those it holds under "not_covered_by_epsilon" (a dotted
# name: an entry of a dict entry, the vocabulary an IMDB model's inputs are encoded with)
UNNOISED = ("nonfinite_examples", "validation_accuracy", "inputs.vocabulary")


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.stem + SIDECAR_SUFFIX)


def hf_folder_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.stem + HF_SUFFIX)


def save_model(model: nn.Module | dict, path: str | Path, privacy: dict) -> tuple[Path, Path]:
    """Writes the weights of ``model`` (a module or a state_dict) to ``path`` and ``privacy``
    (a dict of plain values) beside it; returns both paths. A module with ``save_pretrained``
    is written by it too, to :func:`hf_folder_path` with ``privacy`` inside, which the sidecar
    names. An unwritable place is one line. The records list the entries of :data:`UNNOISED`
    they hold under ``"not_covered_by_epsilon"``: publish the model with them left out."""
    path = Path(path)
    state = model.state_dict() if isinstance(model, nn.Module) else model
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(path, lambda f: torch.save(weights, f))
    except OSError as err:
        raise PrivgradError(f"cannot write the model to {path}: {err.strerror or err}") from None
    if callable(getattr(model, "save_pretrained", None)):
        folder = hf_folder_path(path)
        privacy = {**privacy, "hugging_face_folder": folder.name}
        _save_pretrained(model, folder, privacy)
    return path, write_privacy_record(sidecar_path(path), privacy)


def _save_pretrained(model: nn.Module, folder: Path, privacy: dict) -> None:
    """``model.save_pretrained`` into ``folder`` with ``privacy`` inside, written to a
    temporary folder first and then put in place of any older one (an interrupted write
    leaves the older folder whole, or none)."""
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        write_privacy_record(tmp / PRIVACY_FILE, privacy)
        if folder.exists():
            old = folder.with_name(folder.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except OSError as err:
        raise PrivgradError(
            f"cannot write the model's save_pretrained folder {folder}: {err.strerror or err}"
        ) from None


def write_privacy_record(path: str | Path, privacy: dict) -> Path:
    """Writes ``privacy`` (a dict of plain values) to ``path`` as JSON, listing the entries of
    :data:`UNNOISED` it holds under ``"not_covered_by_epsilon"``; returns the path. An
    unwritable place is one line."""
    path = Path(path)
    unnoised = [k for k in UNNOISED if _holds(privacy, k)]
    if unnoised:
        privacy = {**privacy, "not_covered_by_epsilon": unnoised}
    text = json.dumps(json.loads(to_json(privacy)), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(path, lambda f: f.write(text.encode()))
    except OSError as err:
        raise PrivgradError(
            f"cannot write the privacy record to {path}: {err.strerror or err}"
        ) from None
    return path


def _holds(privacy: dict, dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    if not rest:
        return head in privacy
    value = privacy.get(head)
    return isinstance(value, dict) and rest in value


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
