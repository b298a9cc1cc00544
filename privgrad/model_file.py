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
inside as ``privacy.json`` (as :class:`privgrad.hf_trainer.DPTrainer` saves) and a model card,
``README.md``, stating it (:func:`model_card`); the sidecar names the folder under
``"hugging_face_folder"``.
"""

from __future__ import annotations

import json
import math
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


def model_card(privacy: dict) -> str:
    """A Hugging Face model card (``README.md``) stating the privacy record's guarantee, its
    parameters and what ε does not cover, every figure read from ``privacy``."""

    def fig(key, fmt="{:.4g}"):
        value = privacy.get(key)
        return fmt.format(value) if isinstance(value, (int, float)) else "?"

    eps, delta = privacy.get("epsilon"), privacy.get("delta")
    lines = ["---", "tags:", "- differential-privacy", "- privgrad", "---", ""]
    lines.append("# Trained with differential privacy (privgrad)")
    lines.append("")
    mechanism = privacy.get("mechanism", "?")
    if isinstance(eps, (int, float)) and math.isfinite(eps) and privacy.get("dp_guarantee"):
        lines.append(
            f"Trained with `{mechanism}`: **(ε, δ) = ({eps:.4g}, {delta:g})** differential "
            f"privacy for each training example ({privacy.get('neighbouring', '?')} "
            f"neighbours), ε from the {str(privacy.get('accountant', '?')).upper()} accountant "
            f"applied to the noise the mechanism added: effective noise multiplier "
            f"{fig('effective_noise_multiplier')} (nominal {fig('noise_multiplier')}), sampling "
            f"rate {fig('sampling_rate')}, {fig('steps', '{}')} steps, clip norm {fig('clip')}."
        )
        claimed = privacy.get("epsilon_claimed")
        if isinstance(claimed, (int, float)) and not math.isclose(claimed, eps, rel_tol=1e-6):
            lines += ["", f"The mechanism's paper claims ε = {claimed:.4g}: not a guarantee."]
        lines += ["", f"The run's seed: {privacy.get('seed_source', '?')}."]
        if "train_size" in privacy:
            lines[-1] += f" ε treats the training-set size ({privacy['train_size']}) as public."
    else:
        lines.append(f"Trained with `{mechanism}` **without a differential privacy guarantee**.")
    unnoised = privacy.get("not_covered_by_epsilon") or [k for k in UNNOISED if _holds(privacy, k)]
    if unnoised:
        lines += ["", "Computed from the training data without noise, so not covered by ε: "]
        lines[-1] += ", ".join(f"`{k}`" for k in unnoised) + " (in `privacy.json`)."
    lines += ["", "The whole privacy record: `privacy.json`."]
    return "\n".join(lines) + "\n"


def _save_pretrained(model: nn.Module, folder: Path, privacy: dict) -> None:
    """``model.save_pretrained`` into ``folder`` with ``privacy`` inside, written to a
    temporary folder first and then put in place of any older one (an interrupted write
    leaves the older folder whole, or none)."""
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        write_privacy_record(tmp / PRIVACY_FILE, privacy)
        (tmp / "README.md").write_text(model_card(privacy))
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
