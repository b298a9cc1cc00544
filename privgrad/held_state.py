"""What a collate function, a dataset or a loss function holds: the random generators it
draws from and the state it keeps between calls (:mod:`privgrad.batches` and
:mod:`privgrad.data_checks` seed the one, by :mod:`privgrad.per_sample.held_generators` as for
a model's, and compare the other; the trainer compares a loss's between steps), read through
attributes, closures, partials and, for a loss, the globals its code names."""

from __future__ import annotations

import functools
import inspect
import types
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from privgrad.per_sample.held_generators import KINDS

_STATE_DEPTH = 3  # attribute levels snapshot reads below each holder
_STATE_ITEMS = 64  # entries of a list or mapping it reads
_STATE_CLONE = 4096  # elements of a tensor or array it copies (larger: identity and version)


def holders(fn) -> list:
    """The objects ``fn`` (a collate) keeps state in: itself (a callable object), its closure's
    cells (a function), a partial's arguments, a bound method's object."""
    found = []
    if isinstance(fn, functools.partial):
        found += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    if inspect.ismethod(fn):
        found.append(fn.__self__)
        fn = fn.__func__
    if inspect.isfunction(fn):
        for cell in fn.__closure__ or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    elif fn is not default_collate and hasattr(fn, "__dict__"):
        found.append(fn)
    return found


def _walk(held: list, visit, skip: tuple = (), prune=None) -> None:
    """``visit(path, value)`` on the values ``held`` reach through attributes, mapping and
    list entries, up to :data:`_STATE_DEPTH` levels; modules, classes and functions skipped,
    and objects of the types ``skip`` or for which ``prune`` is true."""
    seen = set()

    def walk(value, path, depth):
        if isinstance(value, (torch.Tensor, np.ndarray, KINDS, int, float, complex, str)):
            visit(path, value)
            return
        if depth == 0 or id(value) in seen or value is None:
            return
        if isinstance(value, (types.ModuleType, type, types.FunctionType, torch.nn.Module)):
            return
        if skip and isinstance(value, skip) or prune is not None and prune(value):
            return
        seen.add(id(value))
        if isinstance(value, Mapping):
            entries = list(value.items())[:_STATE_ITEMS]
        elif isinstance(value, (list, tuple)):
            entries = list(enumerate(value[:_STATE_ITEMS]))
        elif hasattr(value, "__dict__"):
            entries = list(vars(value).items())
        else:
            return
        for key, v in entries:
            walk(v, f"{path}.{key}" if path else str(key), depth - 1)

    for i, h in enumerate(held):
        walk(
            h,
            "" if isinstance(h, (Mapping, list, tuple)) or hasattr(h, "__dict__") else f"#{i}",
            _STATE_DEPTH,
        )


def generators(held: list) -> list:
    found = {}
    _walk(held, lambda _, v: found.setdefault(id(v), v) if isinstance(v, KINDS) else None)
    return list(found.values())


def snapshot(held: list) -> dict:
    """The values ``held`` reach (numbers, strings, tensors and arrays; a large one by its
    identity, address and version), by path."""
    found = {}

    def visit(path, v):
        if isinstance(v, KINDS):
            return
        if isinstance(v, torch.Tensor):
            v = v.detach()
            found[path] = (
                v.clone() if v.numel() <= _STATE_CLONE else (id(v), v.data_ptr(), v._version)
            )
        elif isinstance(v, np.ndarray):
            found[path] = v.copy() if v.size <= _STATE_CLONE else (id(v), v.ctypes.data)
        else:
            found[path] = v

    _walk(held, visit)
    return found


def state_change(before: dict, after: dict) -> str | None:
    """The first value (by path) both snapshots hold that differs, or None."""
    for path in before.keys() & after.keys():
        a, b = before[path], after[path]
        try:
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                same = (
                    isinstance(a, torch.Tensor)
                    and isinstance(b, torch.Tensor)
                    and a.shape == b.shape
                    and bool(torch.equal(a, b))
                )
            elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                same = bool(np.array_equal(a, b))
            else:
                same = bool(a == b)
        except Exception:
            continue
        if not same:
            return f"state {path!r}"
    return None


def loss_holders(fn, model: torch.nn.Module | None = None) -> list:
    """What a loss function keeps state in (:func:`holders`, its closure's cells by name) and
    the globals its code names (a ``queue`` a lambda reads), with a module (a loss
    ``nn.Module``, a bound method's ``LightningModule``) read as its buffers and plain tensor
    attributes, not its parameters (trained), nor its torchmetrics metrics', nor those of
    ``model``'s modules (the trainer's model: its buffers are watched on their own)."""
    plain = getattr(fn, "__func__", fn)
    code, scope = getattr(plain, "__code__", None), getattr(plain, "__globals__", {})
    named = {}
    if inspect.isfunction(plain):
        for name, cell in zip(code.co_freevars, plain.__closure__ or ()):
            try:
                named[name] = cell.cell_contents
            except ValueError:  # an empty cell
                continue
        named.update({name: scope[name] for name in code.co_names if name in scope})
    others = [h for h in holders(fn) if not any(h is v for v in named.values())]
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    for i, h in enumerate(others):  # the object of a bound method by its class's name
        named["loss_fn" if h is fn else type(h).__name__ if h is owner else f"#{i}"] = h
    skip = set() if model is None else {id(m) for m in model.modules()}
    for name, h in list(named.items()):
        if isinstance(h, torch.nn.Module):
            named[name] = _module_tensors(h, skip)
    return [named]


def _module_tensors(module: torch.nn.Module, skip: set) -> dict:
    """The buffers and plain tensor attributes of ``module`` and its submodules, by name, not
    descending into those whose id is in ``skip`` or torchmetrics metrics."""
    found, stack = {}, [("", module)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in skip or _metric(m):
            continue
        for key, value in (*m._buffers.items(), *vars(m).items()):
            if isinstance(value, (torch.Tensor, np.ndarray)) and not isinstance(
                value, torch.nn.Parameter
            ):
                found[prefix + key] = value
        stack += [(f"{prefix}{key}.", c) for key, c in m._modules.items() if c is not None]
    return found


_NOT_TENSORS = {dict, OrderedDict, bool, int, float, str, type(None), tuple, list, set}


def plain_tensors(named_modules: list) -> dict:
    """The tensors and arrays the modules of ``named_modules`` (a model's, as (name, module))
    hold as plain attributes (``self.bank = torch.cat(...)``), by qualified name: neither
    parameters nor buffers, nor what shadows a parameter for a call (privgrad's engine). A
    module's usual attributes are passed over by type, as ``isinstance`` on a tensor is slow."""
    return {
        f"{module_name}.{key}" if module_name else key: value
        for module_name, m in named_modules
        for key, value in vars(m).items()
        if type(value) not in _NOT_TENSORS
        and isinstance(value, (torch.Tensor, np.ndarray))
        and not isinstance(value, torch.nn.Parameter)
        and key not in m._parameters
    }


def _metric(module: torch.nn.Module) -> bool:
    """A torchmetrics metric (a LightningModule's accuracy): its state counts what it was shown,
    not what the loss reads."""
    return any(c.__module__.split(".")[0] == "torchmetrics" for c in type(module).__mro__)


def tensor_state(held: list, skip: set, numbers: bool = False, weights=None) -> dict:
    """:func:`snapshot` of the tensors and arrays ``held`` reach, but those whose id is in
    ``skip`` (the model's parameters and buffers); numbers are left out (a schedule the loop
    sets, a temperature, is public), and with ``numbers`` (a loss's or a model's plain state)
    so are tensors and arrays of one number (0-d: a loss kept for logging as loss.detach(), a
    call or step counter, a weight or temperature the loop schedules), as their ``.item()``
    would be, and the training loop's own objects it holds (:func:`_training_machinery`).
    ``weights`` (a model's state_dict names → shapes): a mapping of those names to tensors of
    those shapes (a copy of the model's state_dict kept as the best so far) is a snapshot of
    the weights, which follow the private steps, and is left out."""
    found = {}

    def visit(path, v):
        if numbers and isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0:
            return
        if isinstance(v, torch.Tensor) and id(v) not in skip:
            v = v.detach()
            found[path] = (
                v.clone() if v.numel() <= _STATE_CLONE else (id(v), v.data_ptr(), v._version)
            )
        elif isinstance(v, np.ndarray) and id(v) not in skip:
            found[path] = v.copy() if v.size <= _STATE_CLONE else (id(v), v.ctypes.data)

    def snapshot_of_weights(value) -> bool:
        return (
            isinstance(value, Mapping)
            and bool(value)
            and all(
                isinstance(v, torch.Tensor) and weights.get(k) == tuple(v.shape)
                for k, v in value.items()
            )
        )

    _walk(
        held,
        visit,
        _training_machinery() if numbers else (),
        snapshot_of_weights if weights else None,
    )
    return found


def _training_machinery() -> tuple:
    """The types of the training loop's own objects, which an object holding the loss (a
    runner with a ``loss`` method) may hold too: an optimizer (its moments follow the
    private steps: privgrad's DPOptimizer among them), an LR scheduler, privgrad's trainer
    and Poisson loader. Their tensors change at every step, and are not what the loss
    reads."""
    from privgrad.own_loop import PoissonLoader
    from privgrad.private import PrivateTrainer

    return (
        torch.optim.Optimizer,
        torch.optim.lr_scheduler.LRScheduler,
        PrivateTrainer,
        PoissonLoader,
    )


def tensor_change(before: dict, after: dict) -> str | None:
    """The first tensor or array (by path) that changed from ``before`` to ``after``, or
    appeared; None where none did."""
    new = sorted(after.keys() - before.keys())
    if new:
        return f"{new[0]!r} (new since)"
    changed = state_change(before, after)
    return changed and changed.removeprefix("state ")
