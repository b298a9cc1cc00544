"""Model inputs of any common shape: a tensor, a tuple/list of tensors, or a dict of tensors
(any mapping, such as Hugging Face's ``BatchEncoding``; any tuple, such as a namedtuple).

A batch's inputs are a *tree* whose leaves are tensors sharing their first dimension (the
examples). The model is called as ``model(x)``, ``model(*x)`` or ``model(**x)``; its output
may be a tensor, a dict or an object with ``.logits`` (the Hugging Face convention). In a
dict of inputs the labels may sit under ``"labels"`` (as Hugging Face models expect): they
are taken out, so that the model never sees them and the loss is computed by privgrad, per
example. Non-tensor leaves (e.g. strings) are refused: every leaf is indexed by example.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from privgrad.errors import DataError

LABEL_KEY = "labels"


def leaves(x, path: str = "inputs") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every leaf of the inputs ``x``, in order."""
    if isinstance(x, torch.Tensor):
        return [(path, x)]
    if isinstance(x, (tuple, list)):
        return [leaf for i, v in enumerate(x) for leaf in leaves(v, f"{path}[{i}]")]
    if isinstance(x, Mapping):
        return [leaf for k, v in x.items() for leaf in leaves(v, f"{path}[{k!r}]")]
    raise DataError(
        f"{path} is a {type(x).__name__}; inputs must be a tensor, a tuple/list of tensors or "
        "a dict of tensors (use collate_fn to turn other data into tensors)"
    )


def tensors_in(x) -> list[torch.Tensor]:
    """Every tensor in ``x``, a tree of tuples, lists and mappings (a ``BatchEncoding`` too,
    which torch's pytree takes for a leaf); other leaves are skipped."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in tensors_in(v)]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in tensors_in(v)]
    return []


def _map(x, fn):
    """``fn`` on every leaf, in a tree of ``x``'s types (a namedtuple, a mapping such as Hugging
    Face's ``BatchEncoding``; a mapping that cannot be built from a dict becomes a dict)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_map(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    return _like(x, {k: _map(v, fn) for k, v in x.items()})


def _like(x: Mapping, entries: dict):
    """``entries`` as a mapping of ``x``'s type (a dict where that type cannot be built from
    one)."""
    if type(x) is dict:
        return entries
    try:
        return type(x)(entries)
    except TypeError:
        return entries


def rows(x) -> int:
    """The number of examples in ``x``: the first dimension every leaf shares."""
    found = leaves(x)
    if not found:
        raise DataError("the inputs hold no tensor")
    sizes = {path: (t.shape[0] if t.dim() else None) for path, t in found}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        shown = ", ".join(f"{p}: {tuple(t.shape)}" for p, t in found)
        raise DataError(
            "every input tensor needs the examples as its first dimension, of one size; got "
            f"{shown}"
        )
    return next(iter(sizes.values()))


def to_device(x, device, non_blocking: bool = False):
    return _map(x, lambda t: t.to(device, non_blocking=non_blocking))


def replace_leaves(x, new: list):
    """``x``'s tree with its leaves replaced, in :func:`leaves`' order, by ``new``'s."""
    it = iter(new)
    return _map(x, lambda _: next(it))


def take(x, index):
    """The examples ``index`` (a slice, a boolean mask or integer indices) of every leaf."""
    return _map(x, lambda t: t[index])


def empty_rows(x, size: int):
    """Uninitialised tensors of ``x``'s structure, dtypes and devices, with ``size`` examples."""
    return _map(x, lambda t: t.new_empty((size, *t.shape[1:])))


def write_padded(dst, src) -> None:
    """``src``'s examples into the first rows of ``dst`` (same structure, at least as many
    rows); the rows after them filled with copies of ``src``'s first example."""
    for (_, d), (_, s) in zip(leaves(dst), leaves(src), strict=True):
        n = s.shape[0]
        d[:n].copy_(s)
        d[n:].copy_(s[:1].expand_as(d[n:]))


def split_labels(x, y=None):
    """``(inputs, labels)``: a dict's ``"labels"`` entry taken out, when ``y`` is not given."""
    if isinstance(x, Mapping) and LABEL_KEY in x:
        if y is not None:
            raise DataError(
                f"the inputs hold {LABEL_KEY!r} and labels were given as well: give them once"
            )
        return _like(x, {k: v for k, v in x.items() if k != LABEL_KEY}), x[LABEL_KEY]
    return x, y


def call_model(model: torch.nn.Module, x) -> torch.Tensor:
    """``model(x)``, ``model(*x)`` or ``model(**x)``, reduced to its logits."""
    if isinstance(x, Mapping):
        out = model(**x)
    elif isinstance(x, (tuple, list)):
        out = model(*x)
    else:
        out = model(x)
    return logits_of(out)


def find_logits(out: Any) -> torch.Tensor | None:
    """The logits of a model's output: a tensor, ``out.logits`` or ``out["logits"]``; None
    if it has none."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def logits_of(out: Any) -> torch.Tensor:
    """:func:`find_logits`, an error if the output has none."""
    logits = find_logits(out)
    if logits is not None:
        return logits
    raise DataError(
        f"the model returned a {type(out).__name__}; privgrad needs a tensor of logits, a dict "
        "with 'logits' or an object with .logits (loss_fn receives those logits, not the whole "
        "output: wrap the model in a module that returns the one output the loss reads)"
    )


def example_shape(x):
    """The shape of one example of the batch ``x``: a tuple for a tensor, a list or dict of
    them for a tuple/list or dict of tensors (what ``python:`` model functions receive)."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape[1:])
    if isinstance(x, (tuple, list)):
        return [example_shape(v) for v in x]
    return {k: example_shape(v) for k, v in x.items()}


def device_of(x) -> torch.device:
    return leaves(x)[0][1].device


def cat(parts: list):
    """The examples of ``parts`` (inputs of one structure) one after another."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        return type(first)(cat([p[i] for p in parts]) for i in range(len(first)))
    return {k: cat([p[k] for p in parts]) for k in first}


def copy_example(x, j: int, r: int):
    """``x`` with example ``j`` replaced by a copy of example ``r``."""

    def copy(t):
        t = t.clone()
        t[j] = t[r]
        return t

    return _map(x, copy)


def perturb_example(x, j: int, generator: torch.Generator):
    """``x`` with Gaussian noise (3 × (std + 1)) added to example ``j`` of every floating
    leaf; None when no leaf is floating (token ids: substitute an example instead)."""
    if not any(t.is_floating_point() for _, t in leaves(x)):
        return None

    def perturb(t):
        if not t.is_floating_point():
            return t
        noise = torch.randn(t[j].shape, generator=generator, dtype=t.dtype).to(t.device)
        t = t.clone()
        t[j] = t[j] + 3 * (t.std() + 1) * noise
        return t

    return _map(x, perturb)


def same_example(x, a: int, b: int) -> bool:
    return all(torch.equal(t[a], t[b]) for _, t in leaves(x))
