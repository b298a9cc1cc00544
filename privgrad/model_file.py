"""The trained model as a user takes it home: weights plain PyTorch loads, and its privacy record.

``save_model`` writes ``PATH`` (the model's ``state_dict``, tensors on the CPU, saved with
``torch.save``: ``torch.load(PATH, weights_only=True)`` reads it, no privgrad needed) and
``PATH`` with the suffix ``.privacy.json`` beside it: honest ε, δ, σ_eff, q, steps, the
accountant, the neighbouring relation, the mechanism, how to rebuild the model and the code
version. Both are written to a temporary file and renamed, so an interrupted write leaves no
half file. Loading for inference::

    import json, torch, privgrad.app.models
    recipe = json.load(open("model.privacy.json"))["model"]  # privgrad train's; from Python: yours
    model = privgrad.app.models.build_model(**recipe)
    model.load_state_dict(torch.load("model.pt", weights_only=True)); model.eval()

A model with ``save_pretrained`` (a Hugging Face model, a ``peft`` model, or the command
line's ``hf:`` classifier) is also written as ``save_pretrained`` writes it, to the folder
``PATH`` with the suffix ``.hf`` (``from_pretrained`` reads it), with the same privacy record
inside as ``privacy.json`` and a model card, ``README.md``, stating it (:func:`model_card`;
a card ``save_pretrained`` wrote, as peft's, is kept and the privacy section appended:
:func:`write_model_card`, as :class:`privgrad.hf_trainer.DPTrainer` saves); the sidecar names
the folder under ``"hugging_face_folder"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
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
    they hold under ``"not_covered_by_epsilon"``: publish the model with them left out. They
    also hold the weights' fingerprint (``"weights_sha256"``, :func:`weights_fingerprint`), by
    which ``make_private(prior=PATH)`` knows the weights it continues from, and this process
    remembers it: ``make_private`` on a model holding these weights, reloaded by plain
    ``load_state_dict``, is refused until ``prior=`` says how its earlier run counts."""
    path = Path(path)
    state = model.state_dict() if isinstance(model, nn.Module) else model
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(path, lambda f: torch.save(weights, f))
    except OSError as err:
        raise PrivgradError(f"cannot write the model to {path}: {err.strerror or err}") from None
    privacy = fingerprinted(privacy, weights)
    if callable(getattr(model, "save_pretrained", None)):
        folder = hf_folder_path(path)
        privacy = {**privacy, "hugging_face_folder": folder.name}
        _save_pretrained(model, folder, privacy)
    sidecar = write_privacy_record(sidecar_path(path), privacy)
    remember_saved(privacy["weights_sha256"], path, privacy)
    return path, sidecar


# weights this process saved (their fingerprint → the weights file): a model found holding
# them at make_private was trained by a run whose privacy record is beside that file
_SAVED: dict[str, Path] = {}


def carries_steps(privacy: dict) -> bool:
    """Whether the weights of a privacy record took private steps: its run's, or those of an
    earlier run it names by their events (a trainer made with ``prior=`` saves the weights it
    was given with ``"steps": 0`` and that run's events: such a file, loaded in another process,
    was taken as fresh and a new run's ε counted from zero)."""
    if not isinstance(privacy, dict):
        return False
    events = ("privacy_events", "disjoint_prior_events")
    return bool(privacy.get("steps", 0)) or any(privacy.get(k) for k in events)


def remember_saved(fingerprint: str, path: Path, privacy: dict) -> None:
    """Notes weights this process saved to ``path`` (a weights file, or the privacy record of
    a directory of weights) after private steps (a model holding them is not fresh)."""
    if carries_steps(privacy):
        _SAVED[fingerprint] = Path(path)


def weights_fingerprint(state: dict) -> str:
    """SHA-256 of a state_dict's tensors (names, dtypes, shapes and bytes, in name order); a
    lazy module's uninitialised parameter or buffer counts by its name alone (it holds no
    values yet, so no saved weights either)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if isinstance(t, nn.parameter.UninitializedTensorMixin):
            digest.update(f"{name}|uninitialized|".encode())
            continue
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def trained_fingerprint(state: dict, trained) -> str | None:
    """:func:`weights_fingerprint` of the entries of ``state`` a privacy record's
    ``trained_parameters`` names (``"trained_sha256"``): adapters (or any trained part) read
    back onto a base other than the one saved with them (another dtype or revision) are still
    the record's weights. None where the record names none or ``state`` lacks one."""
    if not isinstance(trained, list) or not trained or any(n not in state for n in trained):
        return None
    return weights_fingerprint({n: state[n] for n in trained})


def fingerprinted(record: dict, state: dict) -> dict:
    """``record`` with the fingerprints of the weights ``state`` it is saved beside:
    ``weights_sha256`` (:func:`weights_fingerprint`) and, where it names its
    ``trained_parameters``, ``trained_sha256`` (:func:`trained_fingerprint`)."""
    record = {**record, "weights_sha256": weights_fingerprint(state)}
    trained = trained_fingerprint(state, record.get("trained_parameters"))
    if trained is not None:
        record["trained_sha256"] = trained
    return record


def module_fingerprints() -> Callable[[nn.Module], str]:
    """:func:`weights_fingerprint` of a module's ``state_dict``, hashed once per module: for
    one call that asks about a model (and the Hugging Face model a wrapper holds) several
    times. Not to be kept past that call: the weights may change."""
    seen: dict[int, str] = {}

    def fingerprint_of(module: nn.Module) -> str:
        if id(module) not in seen:
            seen[id(module)] = weights_fingerprint(module.state_dict())
        return seen[id(module)]

    return fingerprint_of


def load_model(model: nn.Module, path: str | Path) -> nn.Module:
    """Loads the weights at ``path`` into ``model`` (``load_state_dict``, strict) and marks the
    model with their privacy record (``<stem>.privacy.json`` beside them), checking that it is
    theirs: ``make_private`` on the model then refuses to start until ``prior=`` says how that
    run counts (``prior=path``: its privacy events are composed into the new run's ε, the
    weights' ε on data the runs share; ``prior="disjoint"``: the new data shares no example
    with that run's). Returns the model. For inference alone, plain ``torch.load`` is the
    same."""
    path = Path(path)
    weights = torch.load(path, weights_only=True, map_location="cpu")
    record = read_privacy_record(path)
    saved = record.get("weights_sha256")
    read = weights_fingerprint(weights) if saved is not None or carries_steps(record) else None
    if saved is not None and saved != read:
        raise PrivgradError(
            f"the weights at {path} are not the ones its privacy record "
            f"{sidecar_path(path)} was written for (their fingerprints differ)"
        )
    model.load_state_dict(weights)
    if carries_steps(record):
        from privgrad.private import note_loaded_values

        # the model's now (strict: the same names), the file's unless load_state_dict cast a
        # tensor to the model's dtype
        state = model.state_dict()
        cast = any(
            isinstance(t, torch.Tensor) and state[k].dtype != t.dtype for k, t in weights.items()
        )
        fingerprint = weights_fingerprint(state) if cast else read
        model._privgrad_prior = (path, fingerprint)
        # a model given these weights by a copy (load_state_dict), whole or a layer of them, is
        # one of theirs too: whole, found by their fingerprint; in part, by each tensor's value
        remember_saved(fingerprint, path, record)
        trained = record.get("trained_parameters")  # named by records since 2026-12-07
        if isinstance(trained, list):
            note_loaded_values([weights[k] for k in trained if k in weights], str(path))
    return model


def read_privacy_record(path: str | Path) -> dict:
    """The privacy record of the weights at ``path`` (or the record at ``path`` itself, a
    ``.json`` file: ``.privacy.json``, or a DPTrainer's ``privacy.json``); a missing or
    unreadable one is one line."""
    path = Path(path)
    where = path if path.suffix == ".json" else sidecar_path(path)
    try:
        record = json.loads(where.read_text())
    except (OSError, ValueError) as err:
        raise PrivgradError(f"cannot read the privacy record {where}: {err}") from None
    if not isinstance(record, dict):
        raise PrivgradError(f"the privacy record {where} is not a JSON object")
    return record


def saved_run_of(model: nn.Module, fingerprint_of=None) -> Path | None:
    """The weights file of a privgrad run whose weights ``model`` holds now: loaded by
    :func:`load_model` (and unchanged since), or saved by this process (found by their
    fingerprint, computed only when this process saved any); None if neither.
    ``fingerprint_of``: the caller's :func:`module_fingerprints`, if it hashes them too."""
    fingerprint_of = fingerprint_of or module_fingerprints()
    marked = getattr(model, "_privgrad_prior", None)
    folder = _pretrained_record(model, fingerprint_of)
    if marked is None and not _SAVED and folder is None:
        return None
    fingerprint = fingerprint_of(model)
    if marked is not None and marked[1] == fingerprint:
        return marked[0]
    return _SAVED.get(fingerprint) or folder


def _pretrained_record(model: nn.Module, fingerprint_of) -> Path | None:
    """The privacy record of the folder ``from_pretrained`` read ``model`` (or the Hugging
    Face model a wrapper holds) from, where privgrad saved it after private steps (its
    ``privacy.json``: ``save_model``'s ``.hf`` folder, a DPTrainer output) and the model holds
    those weights: in another process than the one that saved them, such a model was taken
    as fresh, and a new run's ε counted from zero."""
    for inner in (model, getattr(model, "wrapped_pretrained", None)):
        where = getattr(inner, "name_or_path", None)
        if not isinstance(inner, nn.Module) or not isinstance(where, (str, os.PathLike)):
            continue
        record = Path(where) / PRIVACY_FILE
        if not str(where) or not record.is_file():
            continue
        try:
            privacy = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if carries_steps(privacy) and privacy.get("weights_sha256") == fingerprint_of(inner):
            return record
    return None


CARD_FILE = "README.md"  # a Hugging Face folder's model card
CARD_TAGS = ("differential-privacy", "privgrad")
# the privacy section of a model card, between these lines, so that a card written by someone
# else (the user, the Trainer's create_model_card, peft) keeps its text and a save rewrites
# only this section
CARD_BEGIN = "<!-- privgrad: the privacy record's section, rewritten at each save -->"
CARD_END = "<!-- end of privgrad's section -->"


def model_card(privacy: dict) -> str:
    """A Hugging Face model card (``README.md``) stating the privacy record's guarantee, its
    parameters and what ε does not cover, every figure read from ``privacy``: front matter
    with :data:`CARD_TAGS`, then :func:`privacy_section`."""
    lines = ["---", "tags:", *(f"- {tag}" for tag in CARD_TAGS), "---", ""]
    return (
        "\n".join(lines)
        + "\n"
        + privacy_section(privacy, "# Trained with differential privacy (privgrad)")
    )


def write_model_card(folder: str | Path, privacy: dict, note: str | None = None) -> Path:
    """The model card ``folder/README.md`` stating ``privacy``: :func:`model_card` where the
    folder has none; where it has one (the user's, the Trainer's ``create_model_card``, peft's),
    its text kept and the privacy section put in place of the one an earlier save wrote, or
    appended; ``note``, a paragraph of the section's end. Returns the path; an unwritable
    place is one line."""
    path = Path(folder) / CARD_FILE
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError) as err:
        raise PrivgradError(f"cannot read the model card {path}: {err}") from None
    if text is None:
        card = model_card(privacy)
    else:
        section = privacy_section(privacy, "## Differential privacy (privgrad)", note)
        begin, end = text.find(CARD_BEGIN), text.find(CARD_END)
        if begin >= 0 and end > begin:
            card = text[:begin] + section.rstrip("\n") + text[end + len(CARD_END) :]
        else:
            card = text.rstrip("\n") + "\n\n" + section
    try:
        _atomic(path, lambda f: f.write(card.encode("utf-8")))
    except OSError as err:
        raise PrivgradError(f"cannot write the model card {path}: {err.strerror or err}") from None
    return path


def privacy_section(privacy: dict, heading: str, note: str | None = None) -> str:
    """The model card's privacy section, between :data:`CARD_BEGIN` and :data:`CARD_END`,
    under ``heading``, ``note`` its last paragraph but the record's name."""

    def fig(key, fmt="{:.4g}"):
        value = privacy.get(key)
        return fmt.format(value) if isinstance(value, (int, float)) else "?"

    eps, delta = privacy.get("epsilon"), privacy.get("delta")
    lines = [CARD_BEGIN, heading, ""]
    mechanism = privacy.get("mechanism", "?")
    prior = privacy.get("prior") if isinstance(privacy.get("prior"), dict) else None
    composed = prior is not None and str(prior.get("how", "")).startswith("composed")
    if isinstance(eps, (int, float)) and math.isfinite(eps) and privacy.get("dp_guarantee"):
        whom = "each example of this run's training data" if prior and not composed else None
        lines.append(
            f"Trained with `{mechanism}`: **(ε, δ) = ({eps:.4g}, {delta:g})** differential "
            f"privacy for {whom or 'each training example'} "
            f"({privacy.get('neighbouring', '?')} neighbours), ε from the "
            f"{str(privacy.get('accountant', '?')).upper()} accountant applied to the noise the "
            f"mechanism added: effective noise multiplier {fig('effective_noise_multiplier')} "
            f"(nominal {fig('noise_multiplier')}), sampling rate {fig('sampling_rate')}"
            + (
                f" (Poisson batches of expected size {fig('batch_size')}), "
                if isinstance(privacy.get("batch_size"), (int, float))
                else ", "
            )
            + f"{fig('steps', '{}')} steps{' in this run' if prior else ''}, clip norm "
            f"{fig('clip')}."
        )
        if prior:
            before = prior.get("epsilon")
            before = f"ε = {before:.4g}" if isinstance(before, (int, float)) else "ε unknown here"
            if composed:
                lines += [
                    "",
                    f"This run started from the weights of an earlier run (`{prior.get('weights')}`"
                    f", {before} there) on the same or overlapping data, and ε composes that "
                    "run's privacy events with this run's: it counts every step these weights "
                    "have taken, more than the steps above.",
                ]
            else:
                lines += [
                    "",
                    f"This run started from the weights of an earlier run (`{prior.get('weights')}`"
                    f", {before} there) on data stated to share no example with this run's: "
                    "the examples of that run's data have that run's guarantee, not this one.",
                ]
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
    if note:
        lines += ["", note]
    lines += ["", "The whole privacy record: `privacy.json`.", CARD_END]
    return "\n".join(lines) + "\n"


def _save_pretrained(model: nn.Module, folder: Path, privacy: dict) -> None:
    """``model.save_pretrained`` into ``folder`` with ``privacy`` inside, written to a
    temporary folder first and then put in place of any older one (an interrupted write
    leaves the older folder whole, or none). The record inside fingerprints the weights
    ``from_pretrained`` gives back (a wrapper's, such as the command line's ``hf:`` classifier,
    are its ``wrapped_pretrained`` model's), which this process remembers as
    :func:`save_model` remembers the file's."""
    inner = getattr(model, "wrapped_pretrained", model)
    fingerprint = weights_fingerprint(inner.state_dict())
    privacy = {**privacy, "weights_sha256": fingerprint}
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        write_privacy_record(tmp / PRIVACY_FILE, privacy)
        write_model_card(tmp, privacy)  # after save_pretrained's own card (peft's), if any
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
    remember_saved(fingerprint, folder / PRIVACY_FILE, privacy)


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
