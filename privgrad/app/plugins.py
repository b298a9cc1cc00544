"""The user's own code from the command line: ``python:module:function``.

``module`` is imported from the current directory or ``sys.path``. For ``--dataset`` the
function is called with no arguments and returns ``(train_dataset, test_dataset,
num_classes)`` (map-style Datasets of (input, label) pairs); for ``--model`` it is called as
``function(input_shape, num_classes)`` and returns an ``nn.Module``.

An error raised by the user's code (the function, a dataset's ``__getitem__`` met mid-run,
the model's ``forward``) is reported in one line naming the option, the exception and the
place in the user's file (:func:`user_code_error`, used by the command line); the run is
stored as ``failed``.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset, IterableDataset

from privgrad.errors import PrivgradError
from privgrad.user_code import PREFIX, import_attribute

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # privgrad/
# the folders of the user's modules loaded so far -> {option: spec}, for user_code_error
_USER_DIRS: dict[Path, dict[str, str]] = {}


def load_function(spec: str, what: str):
    """The callable named by ``python:module:function``."""
    module, module_name, fn = import_attribute(spec, what, "function")
    if not callable(fn):
        name = spec.rpartition(":")[2]
        raise PrivgradError(f"{what} '{spec}': {module_name} has no function {name}")
    if getattr(module, "__file__", None):
        _USER_DIRS.setdefault(Path(module.__file__).resolve().parent, {})[what] = spec
    return fn


def _call(spec: str, what: str, *args):
    fn = load_function(spec, what)
    try:
        return fn(*args)
    except Exception as err:  # the user's function: any error is reported, in one line
        raise PrivgradError(f"{what} '{spec}' raised {_exception_text(err)}{_where(err)}") from None


def _exception_text(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _in_forward(frames) -> bool:
    """Whether the traceback passes through an nn.Module call (a model's forward)."""
    return any(
        f.name in ("_call_impl", "_wrapped_call_impl") and "torch" in Path(f.filename).parts
        for f in frames
    )


def _in_chain(frames) -> bool:
    """Whether the traceback passes through a mechanism's chain of stages."""
    return any(Path(f.filename).name == "stages.py" and f.name == "run_stages" for f in frames)


def _user_frame(err: BaseException):
    """(frame summary, (option, spec)) of the innermost frame of ``err`` in a folder of the
    user's modules (privgrad's own files excluded), or None. When one folder holds both the
    dataset and the model: the model if the error came through a module's forward."""
    frames = traceback.extract_tb(err.__traceback__)
    found = None
    for frame in frames:
        path = Path(frame.filename).resolve()
        if PACKAGE_DIR in path.parents:
            continue
        owners = _USER_DIRS.get(path.parent)
        if owners:
            what = (
                "--mechanism"
                if "--mechanism" in owners and (len(owners) == 1 or _in_chain(frames))
                else "--model"
                if "--model" in owners and (len(owners) == 1 or _in_forward(frames))
                else next(iter(w for w in owners if w not in ("--model", "--mechanism")))
            )
            found = (frame, (what, owners[what]))
    return found


def _where(err: BaseException) -> str:
    found = _user_frame(err)
    return f" (at {Path(found[0].filename).name}:{found[0].lineno})" if found else ""


def _note_mechanism(name: str | None) -> None:
    """Adds the folder of mechanism ``name``'s module to the user's folders when it was
    declared outside privgrad (``PRIVGRAD_MECHANISMS``), so its stages' errors name it."""
    from privgrad.mechanisms.registry import mechanism_spec, mechanism_specs

    if name not in mechanism_specs():
        return
    module = sys.modules.get(getattr(mechanism_spec(name).build, "__module__", ""))
    path = Path(getattr(module, "__file__", None) or PACKAGE_DIR).resolve()
    if PACKAGE_DIR not in path.parents:
        _USER_DIRS.setdefault(path.parent, {})["--mechanism"] = name


def user_code_error(err: BaseException, specs: dict[str, str]) -> str | None:
    """One line for ``err`` if it was raised by the user's code: a frame of the traceback
    lies in a loaded user module's folder (a plugin mechanism's, for the ``--mechanism``
    run), or (for ``--model python:…``, ``specs`` giving the command's option values) the
    error came out of a module's forward in torch, such as a shape mismatch between the
    user's layers. None otherwise (privgrad's own bug keeps its traceback). A refusal
    privgrad raised from such an error (make_private's check running the model's forward)
    keeps its words and names the user's code."""
    if isinstance(err, PrivgradError):
        cause = err.__cause__
        found = _user_code(cause, specs) if isinstance(cause, Exception) else None
        return f"{err} ({found[0]}, {found[1] or 'in its forward'})" if found else None
    found = _user_code(err, specs)
    if found is None:
        return None
    whose, at = found
    if not at:
        return f"{whose}: its forward raised {_exception_text(err)}"
    return f"{whose} raised {_exception_text(err)} ({at})"


def _user_code(err: BaseException, specs: dict[str, str]) -> tuple[str, str] | None:
    """(the option naming the user's code that raised ``err``, where in its file: empty for
    an error out of a ``--model python:…``'s forward in torch), or None."""
    _note_mechanism(specs.get("--mechanism"))
    found = _user_frame(err)
    if found:
        frame, (what, spec) = found
        return f"{what} '{spec}'", f"at {Path(frame.filename).name}:{frame.lineno}, in {frame.name}"
    model = specs.get("--model")
    if model and model.startswith(PREFIX) and _in_forward(traceback.extract_tb(err.__traceback__)):
        return f"--model '{model}'", ""
    return None


def user_datasets(spec: str) -> tuple[Dataset, Dataset, int]:
    out = _call(spec, "--dataset")
    if not (isinstance(out, tuple) and len(out) == 3):
        raise PrivgradError(
            f"--dataset '{spec}' must return (train_dataset, test_dataset, num_classes)"
        )
    train, test, num_classes = out
    for split, ds in (("train", train), ("test", test)):
        if not isinstance(ds, Dataset) or isinstance(ds, IterableDataset):
            raise PrivgradError(
                f"--dataset '{spec}': the {split} set is a {type(ds).__name__}, "
                "not a map-style torch Dataset"
            )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise PrivgradError(
            f"--dataset '{spec}': num_classes must be an integer ≥ 2, got {num_classes!r}"
        )
    return train, test, num_classes


def user_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    model = _call(spec, "--model", input_shape, num_classes)
    if not isinstance(model, nn.Module):
        raise PrivgradError(f"--model '{spec}' returned a {type(model).__name__}, not an nn.Module")
    return model
