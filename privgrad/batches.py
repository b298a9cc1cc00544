"""Training data as a private step reads it: one Poisson batch at a time.

:func:`training_source` accepts a pair of tensors, a ``TensorDataset``, a map-style
``Dataset`` or a ``DataLoader``. A ``Dataset`` is read lazily: only the examples of the
batch being drawn are loaded (``dataset[i]``, then the collate function), so it need not
fit in memory. A ``DataLoader`` keeps its dataset, collate function and workers; its
sampler is *replaced* by privgrad's Poisson sampler, and a custom sampler is refused,
because the accountant's q assumes Poisson sampling and nothing else (Opacus #813).
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import random
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils import data as tud
from torch.utils.data._utils.collate import default_collate

from privgrad.errors import PrivgradError, warn_user
from privgrad.inputs import LABEL_KEY, leaves, replace_leaves, rows, split_labels, take

# DataLoader options that are kept when its sampler is replaced
LOADER_OPTIONS = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "in_order",
)


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch drawn by a trainer's Poisson sampler (``PrivateTrainer.batches``);
    ``PrivateTrainer.step`` takes it once. ``seq`` numbers the trainer's draws."""

    x: object  # a tensor, or a tuple/list/dict of tensors (privgrad.inputs)
    y: torch.Tensor
    seq: int
    issuer: object = field(repr=False)

    def __len__(self) -> int:
        return len(self.y)


class TensorSource:
    """In-memory inputs (a tensor, or a tuple/list/dict of tensors) and labels: a batch is
    the examples ``idx`` of each."""

    def __init__(self, x, y: torch.Tensor):
        if rows(x) != len(y):
            raise PrivgradError(f"{rows(x)} inputs and {len(y)} labels: they differ in length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def empty(self) -> tuple[object, torch.Tensor]:
        return take(self.x, slice(0, 0)), self.y[:0]

    def load(
        self, index_lists: Iterable[torch.Tensor], seed: int = 0
    ) -> Iterator[tuple[object, torch.Tensor]]:
        for idx in index_lists:
            yield take(self.x, idx), self.y[idx]

    def recollated(self, n: int) -> tuple[int, tuple, tuple, bool] | None:
        """The first ``n − 1`` examples with and without the example with the most nonzero
        entries (the longest, of token ids padded to one length) among :data:`RECOLLATE_LOOK`
        spread over the data, as ``(k, full, without, False)`` (as
        :meth:`DatasetSource.recollated`), where it has more than each of them; else None. A
        model that trims the padding every row of a batch shares (to the batch's longest)
        depends on that example wherever it is drawn, and the probe's first examples may all
        be short (:func:`~privgrad.per_sample.independence.check_recollated`)."""
        n = min(n, len(self))
        if n < 2:
            return None
        spread = np.linspace(0, len(self) - 1, RECOLLATE_LOOK).round().astype(int).tolist()
        look = list(dict.fromkeys([*range(n - 1), *spread]))
        sizes = [
            sum(int(torch.count_nonzero(t)) for _, t in leaves(take(self.x, slice(i, i + 1))))
            for i in look
        ]
        longest = max(range(len(look)), key=sizes.__getitem__)
        if sizes[longest] <= max(sizes[: n - 1]):
            return None
        base = list(range(n - 1))
        full = torch.tensor([*base, look[longest]])
        return n - 1, (take(self.x, full), self.y[full]), (take(self.x, base), self.y[base]), False


class DatasetSource:
    """A map-style ``Dataset`` read batch by batch through a ``DataLoader`` whose batch
    sampler is the trainer's stream of Poisson index lists."""

    def __init__(self, dataset: tud.Dataset, collate_fn=None, **loader_options):
        if isinstance(dataset, tud.IterableDataset):
            raise PrivgradError(
                "an IterableDataset cannot be Poisson-sampled: privgrad needs a map-style "
                "Dataset (with __len__ and __getitem__)"
            )
        try:
            self.size = len(dataset)
        except TypeError:
            raise PrivgradError(
                f"the dataset ({type(dataset).__name__}) has no length; privgrad needs a "
                "map-style Dataset (with __len__ and __getitem__)"
            ) from None
        check_repeated(dataset)
        self.dataset, self.collate = dataset, collate_fn or default_collate
        self.batched = _fetches_batches(dataset)  # a DataLoader then loads rows by __getitems__
        self.loading = (  # what the checks' refusals name
            f"the dataset's __getitems__ ({type(dataset).__name__}'s, which loads a batch's rows "
            "at once, as a Hugging Face dataset's set_transform runs on them) with collate_fn"
            if self.batched
            else "collate_fn"
        )
        self.loader_options = loader_options
        self._empty = None

    def __len__(self) -> int:
        return self.size

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of no examples with the inputs' shape and type (from example 0's)."""
        if self._empty is None:
            x, y = inputs_and_labels(self.collate([self.dataset[0]]))
            self._empty = take(x, slice(0, 0)), y[:0]
        return self._empty

    def check_collate(self) -> None:
        """Refuses a collate function under which one example changes another's collated row
        (standardising by the batch's statistics): make_private's probe alters examples
        after collation, so it never sees one. The first :data:`COLLATE_PROBE` examples are
        collated with and without each of them (the last alone missed a batch scaled by its
        largest value held by another), under the same seeds; the others' rows
        must agree, on the span both have where padding to the batch's longest makes their
        lengths differ (aligned at the start or at the end). A collate that draws random
        numbers (masking for a language model) cannot be compared so: a warning says so, and
        where its draws follow the seed, :meth:`_check_replaced` compares it under one seed."""
        if self.collate is default_collate and not self.batched:
            return
        examples = [self._example(i) for i in range(min(COLLATE_PROBE, self.size))]
        if len(examples) < 2:
            return
        before = _snapshot(self._holders())
        full = self._collated(examples, 0)
        after = _snapshot(self._holders())
        if len(full[1]) != len(examples):
            raise PrivgradError(
                f"{self.loading} returns {len(full[1])} rows for {len(examples)} examples (it "
                "packs, splits or drops examples): privgrad clips each example's gradient, so it "
                "needs one row per example"
            )
        reproducible = _same(full, self._collated(examples, 0))
        changed = _changed(before, after) or _changed(after, _snapshot(self._holders()))
        if not reproducible and changed:
            raise PrivgradError(
                f"{self.loading} keeps state across batches: collating examples "
                f"0-{len(examples) - 1} twice, its {changed} changed and so did the batch, with "
                "every random generator seeded alike. A collate that carries what it saw from "
                "one batch to the next (standardising by a running mean of the batches before) "
                "lets one example move every later batch's rows, which DP-SGD's bound of C on "
                "one example's effect at each step does not cover; normalise by constants "
                "fixed before training (from public data) and keep collate_fn to stacking and "
                "padding"
            )
        drawn = not (reproducible and _same(full, self._collated(examples, 1)))
        for k in [] if drawn else reversed(range(len(examples))):  # each: a max is anyone's
            rest = [i for i in range(len(examples)) if i != k]
            others = take(full[0], rest), full[1][rest]
            if _same(others, self._collated([examples[i] for i in rest], 0)):
                continue
            raise PrivgradError(
                f"{self.loading} changes the other examples' rows when one example leaves the "
                f"batch (collating examples 0-{len(examples) - 1}, then without example {k}): a "
                "collate that mixes examples (standardising by the batch's statistics, sorting "
                "them) breaks DP-SGD's bound on one example's effect, and make_private cannot "
                "check it after collation; transform each example in the Dataset's __getitem__ and "
                "keep collate_fn to stacking and padding, in order (a packed RNN sorts inside "
                "the model: pack_padded_sequence(..., enforce_sorted=False))"
            )
        if reproducible:  # its draws (if any) follow the seed: one example replaced, same draws
            self._check_replaced(examples)  # (one that mixes at random drew alike at 0 and 1)
        if drawn:
            warn_user(
                f"{self.loading} draws random numbers, so privgrad cannot check that it keeps each "
                "example's row apart from the others'; it must (a collate that mixes examples, "
                "e.g. standardising by the batch's statistics, voids the privacy guarantee)"
            )

    def check_items(self) -> None:
        """Refuses a dataset whose item reads more than one example: MixUp or CutMix inside
        ``__getitem__`` (each item mixed with another drawn at random, as ildoonet/cutmix's
        ``CutMix`` wrapper does) puts one example into other items, which no check of the
        collated batch sees. The datasets wrapped by torch's ``Subset`` and
        ``ConcatDataset`` (and the dataset itself) that hold a container of as many rows as
        they have items (another dataset, a list, a tensor or an array, as attributes), or a
        dataset or list of examples of any length (a MixUp reading ``base[idx[i]]``), get it
        replaced by a stand-in that notes the rows read, and :data:`ITEM_PROBE` items are
        loaded under :data:`REPLACED_SEEDS` seeds; an item that reads two rows of it is
        refused. A read the stand-in cannot follow (the container passed whole to a function)
        leaves that dataset unchecked."""
        for dataset in _wrapped(self.dataset):
            _check_item_state(dataset)
            _check_item_reads(dataset)
            _check_item_rows(dataset)

    def _check_replaced(self, examples: list) -> None:
        """Refuses a collate (one that draws random numbers too, seeded alike, it draws alike)
        under which one example changes another's collated row: ``examples`` collated under one seed
        with their last replaced by another example of its collated size, which leaves the
        batch's size and shape, so the draws, as they were; the others' rows must not change.
        MixUp or CutMix across the batch in a collate_fn (torchvision's ``v2.MixUp``, mixing
        each row with its neighbour's, as its documentation shows) put one example into its
        neighbour's row; with/without comparisons cannot see it, since the draws change with
        the batch's size."""
        n, last = len(examples), self._collated(examples[-1:], 0)

        def shape(collated):
            return [t.shape for _, t in leaves(collated)]

        def others(collated):  # the rows of all but the last example
            return take(collated[0], slice(0, n - 1)), collated[1][: n - 1]

        spread = np.linspace(0, self.size - 1, RECOLLATE_LOOK).round().astype(int).tolist()
        for i in dict.fromkeys([*range(n - 1), *range(n, min(self.size, 2 * n)), *spread]):
            other = copy.deepcopy(examples[i]) if i < n - 1 else self._example(i)  # (apart)
            alone = self._collated([other], 0)
            if shape(alone) != shape(last) or _same(alone, last):
                continue
            for seed in range(REPLACED_SEEDS):  # one that mixes only at random: several draws
                full = self._collated(examples, seed)
                if not _same(others(full), others(self._collated(examples[:-1] + [other], seed))):
                    raise PrivgradError(
                        f"{self.loading} changes the other examples' rows when one example is "
                        f"replaced by another under the same random draws (examples 0-{n - 1}, "
                        f"then the last replaced by example {i}): a collate that mixes examples "
                        "(MixUp or CutMix across the batch, as torchvision's v2.MixUp in a "
                        "collate_fn) puts one example into another's row, so its leaving moves "
                        "that row's clipped gradient too, beyond DP-SGD's bound of C on one "
                        "example's effect; augment each example alone in the Dataset's "
                        "__getitem__ and keep collate_fn to stacking and padding"
                    )
            return

    def recollated(self, n: int) -> tuple[int, tuple, tuple, bool] | None:
        """A batch collated twice, with and without one example whose leaving changes the
        collated shape of its inputs or labels, as ``(k, full, without, made_up)``, each
        (inputs, labels), ``k`` the example's row in ``full``: among the first ``n`` examples
        and :data:`RECOLLATE_LOOK` spread over the whole dataset (one sorted or bucketed by
        length has its extremes at its ends), each collated alone for its size, the ``n − 1``
        smallest and the largest that changes their shape (a collate that pads to the batch's
        longest), else the ``n − 1`` largest and the smallest that does (one that crops to its
        shortest). Where none does (every example of one length), the example is made up
        (``made_up``): the largest with each sequence in it twice over, else the smallest cut
        to its first half (:func:`_resized`), since a neighbouring dataset may hold an example
        of another length, unless the collate draws random numbers (a language model's masking
        of each position draws them anew for another shape); None where neither changes the
        shape (a collate that pads or crops to one fixed length). A collate that draws random
        numbers for each position (a language model's masking) draws the others' anew for
        another shape, so ``without`` is then ``full``'s other rows cut to its shape, with
        ``full``'s draws (:meth:`_kept`). make_private's probe removes a row of the
        collated batch, which keeps the padding; these let it see a model that reads the
        padding, or a crop that cuts the others' inputs
        (:func:`~privgrad.per_sample.independence.check_recollated`)."""
        n = min(n, self.size)
        if (self.collate is default_collate and not self.batched) or n < 2:
            return None

        def shape(collated):  # the labels' too: a list of labels padded to the batch's longest
            return [t.shape[1:] for _, t in leaves(collated)]

        spread = np.linspace(0, self.size - 1, RECOLLATE_LOOK).round().astype(int).tolist()
        examples = [self._example(i) for i in dict.fromkeys([*range(n), *spread])]
        sizes = [sum(s.numel() for s in shape(self._collated([e], 0))) for e in examples]
        ascending = sorted(range(len(examples)), key=lambda i: sizes[i])
        bases = []  # per order: its n − 1 first examples, collated under seeds 0 and 1
        for order in (ascending, ascending[::-1]):
            base = [examples[i] for i in order[: n - 1]]
            without = self._collated(base, 0), self._collated(base, 1)
            bases.append((order, base, without))
            for i in reversed(order[n - 1 :]):
                if sizes[i] == sizes[order[n - 2]]:
                    break  # the rest are the size of one in the batch already
                full = self._collated(base + [examples[i]], 0)
                if shape(full) != shape(without[0]):
                    kept = self._kept(full, base + [examples[i]], *without)
                    return n - 1, full, without[0] if kept is None else kept, False
        for (order, base, without), longer in zip(bases, (True, False)):
            made_up = base + [_resized(examples[order[-1]], longer)]
            try:
                full = self._collated(made_up, 0)
            except PrivgradError:
                continue  # a collate that cannot take it (stacking fixed shapes)
            if shape(full) != shape(without[0]):
                kept = self._kept(full, made_up, *without)
                if kept is None and not _same(*without):
                    return None  # draws anew for another shape, not kept: no comparison
                return n - 1, full, without[0] if kept is None else kept, True
        return None

    def _kept(self, full: tuple, examples: list, without: tuple, without_1: tuple) -> tuple | None:
        """For a collate that draws random numbers (else None): ``full`` (``examples`` collated
        under seed 0) without its last row, cut to the shape of ``without`` (the others
        collated under seed 0; ``without_1`` under seed 1), so with ``full``'s draws: a
        collate that draws each position apart (a language model's masking) draws anew for
        another shape, and its draws for a batch without the last example are as likely to be
        these. Each leaf is cut at its start or its end, where its entries that neither seed
        changes agree with ``without``'s; None where neither agrees, or where ``without`` is
        the longer (a crop)."""
        if _same(without, without_1):
            return None
        full_1 = self._collated(examples, 1)
        cut = []
        trees = [leaves(c, "batch") for c in (full, full_1, without, without_1)]
        for (_, s0), (_, s1), (_, t0), (_, t1) in zip(*trees, strict=True):
            s0, s1 = s0[:-1], s1[:-1]
            if s0.dim() != t0.dim() or any(m < n for m, n in zip(s0.shape, t0.shape)):
                return None
            for at_end in (False, True):
                index = tuple(
                    slice(m - n, m) if at_end else slice(0, n) for m, n in zip(s0.shape, t0.shape)
                )
                steady = (s0[index] == s1[index]) & (t0 == t1)
                if _close(s0[index][steady], t0[steady]):
                    cut.append(s0[index])
                    break
            else:
                return None
        return replace_leaves(full, cut)

    def _example(self, i: int):
        """Example ``i`` as the checks collate it: loaded, or where the dataset loads rows a
        batch at a time (``__getitems__``), its index, loaded with the others it is collated
        with."""
        return _Row(i) if self.batched else self.dataset[i]

    def _collated(self, examples: list, seed: int) -> tuple[object, torch.Tensor]:
        """``collate`` on a copy of ``examples`` (a collate may change what it is given, as
        ``f.pop("label")`` does: a step's collate gets examples just loaded) as (inputs,
        labels), with torch's, NumPy's and Python's global RNGs seeded with ``seed``
        (restored after). Rows of a dataset that loads a batch at a time are loaded together
        by its ``__getitems__``, as a DataLoader loads them: a Hugging Face dataset's
        ``set_transform`` runs on them at once (tokenizing with padding to their longest), and
        a ``__getitems__`` may mix them (standardising by their statistics), which the collate
        of loaded rows would not show."""
        py, np_state = random.getstate(), np.random.get_state()
        held = _generators(self._holders())  # a collate's own (MixUp with a generator of its own)
        held_states = [_generator_state(g) for g in held]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            _seed_generators(held, seed)
            try:
                if self.batched:
                    rows = self.dataset.__getitems__([e.index for e in examples])
                else:
                    rows = copy.deepcopy(examples)
                out = self.collate(rows)
            except Exception as err:
                raise PrivgradError(
                    f"{self.loading} failed on examples 0-{len(examples) - 1} of the dataset, "
                    f"which make_private collates to check it ({type(err).__name__}: {err})"
                ) from err
            finally:
                random.setstate(py)
                np.random.set_state(np_state)
                _restore_generators(held, held_states)
        return inputs_and_labels(out)

    def _holders(self) -> list:
        """What the collate (and a dataset loading rows a batch at a time) keeps state and
        generators in: a callable object, a function's closure, a partial's arguments."""
        return _holders(self.collate) + ([self.dataset] if self.batched else [])

    def load(
        self, index_lists: Iterable[torch.Tensor], seed: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Collated batches; ``seed`` seeds the workers' RNGs (random transforms)."""
        loader = tud.DataLoader(
            self.dataset,
            batch_sampler=(idx.tolist() for idx in index_lists),
            collate_fn=_EmptySafeCollate(self.collate, self.empty()),
            generator=torch.Generator().manual_seed(seed),
            **self.loader_options,
        )
        for out in loader:
            yield inputs_and_labels(out)


@dataclass(frozen=True)
class _Row:
    """Row ``index`` of a dataset that loads rows a batch at a time (``__getitems__``)."""

    index: int


def _fetches_batches(dataset) -> bool:
    """Whether a DataLoader loads ``dataset``'s rows a batch at a time (``__getitems__``, as
    torch's fetcher calls it) beyond torch's own wrappers passing rows through one by one."""
    if isinstance(dataset, tud.Subset):
        return _fetches_batches(dataset.dataset)
    if isinstance(dataset, tud.StackDataset):
        parts = dataset.datasets
        return any(map(_fetches_batches, parts.values() if isinstance(parts, dict) else parts))
    return callable(getattr(dataset, "__getitems__", None))


def _resized(example, longer: bool):
    """``example`` with each sequence in it (a tensor or array past its scalars, a string, a
    list of numbers or strings) twice over, or cut to its first half: an example of another
    length, for :meth:`DatasetSource.recollated`. Its containers (tuples, lists of other
    things, mappings) keep their structure; numbers (a class label) stay as they are."""
    if isinstance(example, (torch.Tensor, np.ndarray)) and example.ndim:
        if longer:
            return (
                torch.cat([example, example])
                if isinstance(example, torch.Tensor)
                else np.concatenate([example, example])
            )
        return example[: max(1, len(example) // 2)]
    if isinstance(example, str) or (
        isinstance(example, list)
        and example
        and all(isinstance(v, (int, float, str)) for v in example)
    ):
        return example + example if longer else example[: max(1, len(example) // 2)]
    if isinstance(example, Mapping):
        return {k: _resized(v, longer) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        parts = [_resized(v, longer) for v in example]
        return type(example)(*parts) if hasattr(example, "_fields") else type(example)(parts)
    return example


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_STATE_DEPTH = 3  # attribute levels _snapshot reads below each holder
_STATE_ITEMS = 64  # entries of a list or mapping it reads
_STATE_CLONE = 4096  # elements of a tensor or array it copies (larger: identity and version)


def _holders(fn) -> list:
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


def _walk(holders: list, visit) -> None:
    """``visit(path, value)`` on the values ``holders`` reach through attributes, mapping and
    list entries, up to :data:`_STATE_DEPTH` levels; modules, classes and functions skipped."""
    seen = set()

    def walk(value, path, depth):
        if isinstance(value, (torch.Tensor, np.ndarray, _GENERATORS, int, float, complex, str)):
            visit(path, value)
            return
        if depth == 0 or id(value) in seen or value is None:
            return
        if isinstance(value, (types.ModuleType, type, types.FunctionType, torch.nn.Module)):
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

    for i, h in enumerate(holders):
        walk(
            h,
            "" if isinstance(h, (Mapping, list, tuple)) or hasattr(h, "__dict__") else f"#{i}",
            _STATE_DEPTH,
        )


def _generators(holders: list) -> list:
    found = {}
    _walk(holders, lambda _, v: found.setdefault(id(v), v) if isinstance(v, _GENERATORS) else None)
    return list(found.values())


def _generator_state(g):
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.get_state() if isinstance(g, np.random.RandomState) else g.getstate()


def _restore_generators(generators: list, states: list) -> None:
    for g, state in zip(generators, states):
        if isinstance(g, torch.Generator):
            g.set_state(state)
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = state
        elif isinstance(g, np.random.RandomState):
            g.set_state(state)
        else:
            g.setstate(state)


def _seed_generators(generators: list, seed: int) -> None:
    for g in generators:
        if isinstance(g, torch.Generator):
            g.manual_seed(seed)
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = type(g.bit_generator)(seed).state
        elif isinstance(g, np.random.RandomState):
            g.seed(seed)
        else:
            g.seed(seed)


def _snapshot(holders: list) -> dict:
    """The values ``holders`` reach (numbers, strings, tensors and arrays; a large one by its
    identity, address and version), by path."""
    found = {}

    def visit(path, v):
        if isinstance(v, _GENERATORS):
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

    _walk(holders, visit)
    return found


def _changed(before: dict, after: dict) -> str | None:
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


def _wrapped(dataset) -> list:
    """``dataset`` and the datasets torch's ``Subset`` and ``ConcatDataset`` wrap in it."""
    if isinstance(dataset, tud.Subset):
        return [dataset, *_wrapped(dataset.dataset)]
    if isinstance(dataset, tud.ConcatDataset):
        return [dataset, *(d for part in dataset.datasets for d in _wrapped(part))]
    return [dataset]


class _Reads:
    """A stand-in for a container a dataset holds, noting the row of each read
    (``container[i]``, ``container[i, ...]``) in ``log``; anything else is the container's."""

    def __init__(self, inner, log: list):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_log", log)

    def __getitem__(self, index):
        row = index[0] if isinstance(index, tuple) and index else index
        if isinstance(row, torch.Tensor) and row.dim() == 0:
            row = row.item()
        if isinstance(row, (int, np.integer)) and not isinstance(row, bool):
            self._log.append(int(row) % len(self._inner))
        return self._inner[index]

    def __len__(self):
        return len(self._inner)

    def __iter__(self):
        return iter(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _check_item_reads(dataset) -> None:
    """:meth:`DatasetSource.check_items` for one dataset (not torch's wrappers, whose items
    read one row each)."""
    if isinstance(dataset, (tud.Subset, tud.ConcatDataset, tud.TensorDataset, list)):
        return
    if _fetches_batches(dataset) or not hasattr(dataset, "__dict__"):
        return  # rows loaded a batch at a time are checked as a collate is
    try:
        n = len(dataset)
    except TypeError:
        return
    held = {}
    for name, value in vars(dataset).items():
        if not (isinstance(value, (torch.Tensor, np.ndarray)) or _map_style(value)):
            continue
        try:  # one row per item, or a dataset (or list of examples) of any length
            examples = not isinstance(value, (torch.Tensor, np.ndarray)) and (
                not isinstance(value, (list, tuple)) or _examples_list(value)
            )
            if n >= 2 and (len(value) == n or (examples and len(value) >= 2)):
                held[name] = value
        except TypeError:
            continue
    if not held:
        return
    logs = {name: [] for name in held}
    try:
        for name, value in held.items():
            setattr(dataset, name, _Reads(value, logs[name]))
    except (AttributeError, TypeError):  # a read-only attribute (a property, __slots__)
        _restore(dataset, held)
        return
    py, np_state = random.getstate(), np.random.get_state()
    gens = _generators([held_value for held_value in vars(dataset).values()] + [dataset])
    gen_states = [_generator_state(g) for g in gens]
    try:
        for i in range(min(ITEM_PROBE, n)):
            for seed in range(REPLACED_SEEDS):
                for log in logs.values():
                    log.clear()
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    random.seed(seed)
                    np.random.seed(seed)
                    _seed_generators(gens, seed)  # its own (a torch.Generator it holds)
                    seeded = torch.get_rng_state(), random.getstate(), np.random.get_state()[1]
                    own = [_generator_state(g) for g in gens]
                    dataset[i]
                    drew = not (
                        torch.equal(torch.get_rng_state(), seeded[0])
                        and random.getstate() == seeded[1]
                        and np.array_equal(np.random.get_state()[1], seeded[2])
                        and all(_same_state(a, _generator_state(g)) for a, g in zip(own, gens))
                    )
                for name, log in logs.items():
                    rows = sorted(set(log))
                    if len(rows) < 2:
                        continue
                    raise PrivgradError(
                        f"{type(dataset).__name__}.__getitem__ reads more than one example: "
                        f"item {i} read rows {rows[0]} and {rows[1]} of its {name!r} "
                        f"({type(held[name]).__name__} of {len(held[name])} rows): "
                        "MixUp or CutMix inside a Dataset (each item mixed with another drawn "
                        "at random, as ildoonet/cutmix's CutMix does) puts one example into "
                        "other items, so its leaving moves their clipped gradients too, beyond "
                        "DP-SGD's bound of C on one example's effect (one example mixed into "
                        "one other item of 17 moved the clipped sum by 2.74 C); augment each "
                        "example from its own row alone (rows that are one person's data, "
                        "such as the frames of one recording, belong in one row)"
                    )
                if not drew:  # the same rows under every seed: one load tells
                    break
    except PrivgradError:
        raise
    except Exception:
        return  # the stand-in could not follow a read: unchecked
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        _restore_generators(gens, gen_states)
        _restore(dataset, held)


def _same_state(a, b) -> bool:
    """Whether two generator states (a tensor, a dict, a tuple) are equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    return a == b


def _examples_list(value) -> bool:
    """Whether a list or tuple holds examples (an (input, label) pair, a dict, a tensor, as its
    first item), not names or numbers (a table of class names, an index)."""
    return bool(len(value)) and isinstance(value[0], (tuple, list, Mapping, torch.Tensor))


def _check_item_state(dataset) -> None:
    """Refuses a dataset whose ``__getitem__`` keeps state across items: item 0 loaded twice
    under one seed (every generator the dataset holds seeded alike) comes out different and
    a number, tensor or array the dataset holds changed (a running mean of the items loaded
    so far to normalise by), so one example moves every item loaded after it, as a collate
    keeping state across batches does (:meth:`DatasetSource.check_collate`)."""
    if isinstance(dataset, (tud.Subset, tud.ConcatDataset, tud.TensorDataset, list)):
        return
    if _fetches_batches(dataset) or not hasattr(dataset, "__dict__"):
        return
    try:
        if len(dataset) < 1:
            return
    except TypeError:
        return
    gens = _generators([dataset])
    gen_states = [_generator_state(g) for g in gens]
    py, np_state = random.getstate(), np.random.get_state()
    loads, states = [], [_snapshot([dataset])]
    try:
        for _ in range(2):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                random.seed(0)
                np.random.seed(0)
                _seed_generators(gens, 0)
                loads.append(inputs_and_labels(default_collate([dataset[0]])))
            states.append(_snapshot([dataset]))
        same = _same(*loads)
    except Exception:
        return  # an item default_collate cannot batch, or a load that failed: unchecked
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        _restore_generators(gens, gen_states)
    changed = _changed(states[0], states[1]) or _changed(states[1], states[2])
    if not same and changed:
        raise PrivgradError(
            f"{type(dataset).__name__}.__getitem__ keeps state across items: item 0 loaded "
            f"twice came out different, and its {changed} changed, with every random generator "
            "seeded alike. A dataset that carries what it loaded from one item to the next "
            "(normalising by a running mean of the items so far) lets one example move every "
            "item loaded after it, which DP-SGD's bound of C on one example's effect does not "
            "cover; normalise by constants fixed before training (from public data)"
        )


class _Stop(Exception):
    """Raised by :class:`_FirstRead` once an item's first read of a dataset is noted."""


class _FirstRead(_Reads):
    """A stand-in for a dataset a dataset holds: notes the row an item reads first, and stops
    the item's loading there (nothing is loaded)."""

    def __init__(self, inner, log: list, name: str):
        super().__init__(inner, log)
        object.__setattr__(self, "_name", name)

    def __getitem__(self, index):
        row = index.item() if isinstance(index, torch.Tensor) and index.dim() == 0 else index
        if isinstance(row, (int, np.integer)) and not isinstance(row, bool):
            self._log.append((self._name, int(row) % max(1, len(self._inner))))
        raise _Stop


def _check_item_rows(dataset) -> None:
    """Refuses a dataset two of whose items read one row of a dataset it holds: a wrapper that
    repeats a dataset (mmengine's ``RepeatDataset``, ``idx % len``) or repeats some of its rows
    (``ClassBalancedDataset``'s repeat factors) holds those examples more than once, as a
    ``Subset`` with repeated indices does (:func:`check_repeated`). Each item (of a dataset
    of more than :data:`ROW_PROBE`, that many at random) is loaded with every dataset it holds
    as an attribute (or list of examples: pairs, dicts or tensors; not a list of names or
    numbers, a tensor or an array: a table of class names is read by many items) replaced by
    a stand-in that notes the row read first and stops the load there. Two
    sampled items of one row of n items repeated t times meet with a chance of about
    1 − exp(−k²(t − 1)/2n), k the sample: certain below a million items."""
    if isinstance(dataset, (tud.Subset, tud.ConcatDataset, tud.TensorDataset, list)):
        return
    if _fetches_batches(dataset) or not hasattr(dataset, "__dict__"):
        return
    try:
        n = len(dataset)
    except TypeError:
        return
    held = {
        name: value
        for name, value in vars(dataset).items()
        if _map_style(value) and (not isinstance(value, (list, tuple)) or _examples_list(value))
    }
    if not held or n < 2:
        return
    log: list = []
    try:
        for name, value in held.items():
            setattr(dataset, name, _FirstRead(value, log, name))
    except (AttributeError, TypeError):
        _restore(dataset, held)
        return
    first: dict = {}  # (attribute, row) → the first item that read it
    py, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            probe = (  # every item, or a random sample: a repeat shows as a shared row
                range(n)
                if n <= ROW_PROBE
                else np.sort(np.random.default_rng(0).choice(n, ROW_PROBE, replace=False))
            )
            for i in probe:
                log.clear()
                try:
                    dataset[int(i)]
                except _Stop:
                    pass
                if len(log) != 1:
                    continue
                key = log[0]
                if key in first:
                    raise PrivgradError(
                        f"{type(dataset).__name__} holds an example more than once: its items "
                        f"{first[key]} and {i} both read row {key[1]} of its {key[0]!r} "
                        f"({type(held[key[0]]).__name__}): a "
                        "wrapper that repeats a dataset or some of its rows (mmengine's "
                        "RepeatDataset, ClassBalancedDataset) oversamples, and each copy "
                        "joins a Poisson batch and is clipped on its own, so one example "
                        "moves a step by up to C per copy, which ε does not count (twice "
                        "held, its ε at σ = 1, q = 0.1, 100 steps is 16.2, not 7.05); give "
                        "each example once (train for more epochs instead of repeating it), "
                        "and balance classes by weighting each example's loss in loss_fn"
                    )
                first[key] = int(i)
    except PrivgradError:
        raise
    except Exception:
        return  # an item the stand-in could not follow: unchecked
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        _restore(dataset, held)


def _restore(dataset, held: dict) -> None:
    for name, value in held.items():
        try:
            setattr(dataset, name, value)
        except (AttributeError, TypeError):
            pass


COLLATE_PROBE = 6  # examples DatasetSource.check_collate collates
RECOLLATE_LOOK = 64  # examples DatasetSource.recollated reads across the dataset, for a longer one
ROW_PROBE = 5_000  # items (a random sample beyond) DatasetSource.check_items reads the rows of
ITEM_PROBE = 4  # items DatasetSource.check_items loads (under REPLACED_SEEDS seeds each)
REPLACED_SEEDS = (
    8  # seeds DatasetSource._check_replaced collates under (MixUp at p = 0.5: 1/256 missed)
)


def _same(a: tuple, b: tuple, drop_last: bool = False) -> bool:
    """Whether two collated (inputs, labels) hold the same rows (``a``'s last left out with
    ``drop_last``): the same leaves, equal where a padded dimension's lengths differ on the
    span both have, aligned at its start or its end."""
    found_a, found_b = leaves(a, "batch"), leaves(b, "batch")
    if [p for p, _ in found_a] != [p for p, _ in found_b]:
        return False
    for (_, s), (_, t) in zip(found_a, found_b):
        s = s[:-1] if drop_last and s.dim() else s
        if s.dim() != t.dim() or s.shape[:1] != t.shape[:1] or s.dtype != t.dtype:
            return False
        span = [min(m, n) for m, n in zip(s.shape[1:], t.shape[1:])]
        starts = tuple(slice(0, n) for n in span)
        if _close(s[(slice(None), *starts)], t[(slice(None), *starts)]):
            continue
        ends_s = tuple(slice(m - n, m) for m, n in zip(s.shape[1:], span))
        ends_t = tuple(slice(m - n, m) for m, n in zip(t.shape[1:], span))
        if not _close(s[(slice(None), *ends_s)], t[(slice(None), *ends_t)]):
            return False
    return True


def _close(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Equal, or for floating tensors within float32 rounding of their scale (a collate that
    computes on a batch may round a row differently at another batch size)."""
    if not u.is_floating_point():
        return torch.equal(u, v)
    scale = float(u.abs().max()) if u.numel() else 0.0
    return torch.allclose(u, v, rtol=1e-5, atol=1e-6 * max(1.0, scale), equal_nan=True)


class _EmptySafeCollate:
    """The user's collate function; an empty Poisson batch gives an empty (x, y)."""

    def __init__(self, collate, empty):
        self.collate, self.empty = collate, empty

    def __call__(self, examples):
        if not examples:
            return self.empty
        try:
            return self.collate(examples)
        except RuntimeError as err:
            # torch's default collate on examples of different lengths names no fix
            if self.collate is not default_collate or "equal size" not in str(err):
                raise
            raise PrivgradError(
                f"the examples of a batch could not be stacked ({str(err).splitlines()[0]}): "
                "examples of different lengths (unpadded token ids) need padding, each "
                "example padded to one length in the dataset, or a DataLoader whose "
                "collate_fn pads the batch (torch.nn.utils.rnn.pad_sequence, or "
                "transformers.DataCollatorWithPadding), passed as the data"
            ) from err


def inputs_and_labels(out) -> tuple[object, torch.Tensor]:
    """(inputs, labels) of a collated batch: a pair, or a dict holding its labels under
    ``"labels"`` (the Hugging Face convention); inputs may be any tree of tensors
    (:mod:`privgrad.inputs`)."""
    if isinstance(out, Mapping):
        if LABEL_KEY not in out:
            raise PrivgradError(
                f"a dict example must hold its label under {LABEL_KEY!r} (the Hugging Face "
                f"convention); it has {sorted(out)}"
            )
        x, y = split_labels(out)
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        x, y = out
    else:
        raise PrivgradError(
            "each example must be an (input, label) pair or a dict with 'labels', collated into "
            f"(inputs, labels); got {type(out).__name__}"
        )
    if not isinstance(y, torch.Tensor) or y.dim() == 0 or rows(x) != len(y):
        raise PrivgradError(
            f"the batch has {rows(x)} inputs but its labels are "
            f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
        )
    return x, y


def _map_style(data) -> bool:
    """Whether ``data`` is a map-style dataset by its methods, as a DataLoader reads one (a
    list of examples, a Hugging Face ``datasets.Dataset``): ``__len__`` and ``__getitem__``,
    and not a tensor, array, string or mapping (a whole batch, or keys, not examples)."""
    return (
        hasattr(data, "__len__")
        and hasattr(data, "__getitem__")
        and not isinstance(data, (torch.Tensor, str, bytes, Mapping))
        and not hasattr(data, "__array__")
    )


def training_source(data) -> TensorSource | DatasetSource:
    """The source for ``data``: (inputs, labels) in memory (inputs a tensor or a
    tuple/list/dict of tensors), a TensorDataset, a Dataset (or any object a DataLoader reads
    as one: a list of examples, a Hugging Face ``datasets.Dataset``) or a DataLoader."""
    if isinstance(data, (TensorSource, DatasetSource)):
        return data
    if isinstance(data, tud.TensorDataset):
        if len(data.tensors) != 2:
            raise PrivgradError(
                f"a TensorDataset of (inputs, labels) is needed; this one has "
                f"{len(data.tensors)} tensors"
            )
        return TensorSource(*data.tensors)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and isinstance(data[1], torch.Tensor)
        and isinstance(data[0], (torch.Tensor, tuple, list, Mapping))
    ):
        return TensorSource(*data)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and any(hasattr(part, "__array__") and not isinstance(part, torch.Tensor) for part in data)
    ):  # (x, y) as NumPy arrays (or pandas): read as a dataset of two examples, it failed later
        raise PrivgradError(
            f"(inputs, labels) must be tensors, got ({type(data[0]).__name__}, "
            f"{type(data[1]).__name__}): convert them, e.g. (torch.as_tensor(x, "
            "dtype=torch.float32), torch.as_tensor(y, dtype=torch.long))"
        )
    if isinstance(data, tud.DataLoader):
        check_loader(data)
        warn_user(
            "privgrad replaces the DataLoader's sampler with Poisson sampling: each example joins "
            "a batch independently with probability q = batch_size / len(dataset), as the "
            "accountant assumes; its dataset, collate_fn and workers are kept"
        )
        return DatasetSource(
            data.dataset,
            data.collate_fn,
            **{k: getattr(data, k) for k in LOADER_OPTIONS if hasattr(data, k)},
        )
    if isinstance(data, tud.Dataset) or _map_style(data):
        return DatasetSource(data)
    raise PrivgradError(
        f"cannot train on a {type(data).__name__}: give (inputs, labels) tensors, a "
        "TensorDataset, a map-style Dataset or a DataLoader"
    )


def _example_ids(dataset, seen: dict) -> np.ndarray | None:
    """One id per item of ``dataset``, the same for items that are one example of one dataset
    reached through torch's ``Subset`` and ``ConcatDataset``, or one (input, label) object a
    list holds twice (``examples + minority``); None where a length is unknown."""
    if isinstance(dataset, tud.Subset):
        inner = _example_ids(dataset.dataset, seen)
        return None if inner is None else inner[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, tud.ConcatDataset):
        parts = [_example_ids(d, seen) for d in dataset.datasets]
        return None if any(p is None for p in parts) else np.concatenate(parts)
    if isinstance(dataset, list):  # containers are never shared but by holding one twice
        objects, views = seen.setdefault("objects", {}), seen.setdefault("views", {})
        ids = []
        for e in dataset:
            if id(e) in objects:
                ids.append(objects[id(e)])
                continue
            view = _view_key(e)  # (x[i], y[i]) made anew for each copy: one row of memory
            if view is not None and view in views:
                objects[id(e)] = views[view]
                ids.append(views[view])
                continue
            ids.append(_fresh_ids(seen, 1, e, objects))
            if view is not None:
                views[view] = ids[-1]
        return np.array(ids, dtype=np.int64)
    arrow = _arrow_ids(dataset, seen)
    if arrow is not None:  # a Hugging Face dataset: the memory of its table's rows
        return arrow
    try:
        size = len(dataset)
    except TypeError:
        return None
    starts = seen.setdefault("datasets", {})
    if id(dataset) not in starts:
        starts[id(dataset)] = _fresh_ids(seen, size)
    return np.arange(starts[id(dataset)], starts[id(dataset)] + size, dtype=np.int64)


def _list_ids(examples: list) -> np.ndarray:
    """:func:`_example_ids` of a list, reading the memory of its items (:func:`_view_key`)
    only where their contents are equal (:func:`_list_hashes`, which check_copies reuses): a
    list of distinct examples is not walked twice."""
    objects: dict = {}
    seen: dict = {}
    ids = np.array(
        [objects[id(e)] if id(e) in objects else _fresh_ids(seen, 1, e, objects) for e in examples],
        dtype=np.int64,
    )
    hashes = _list_hashes(examples).numpy()
    order = np.argsort(hashes, kind="stable")
    equal = hashes[order][1:] == hashes[order][:-1]
    views: dict = {}
    for i in np.unique(np.concatenate([order[1:][equal], order[:-1][equal]])):
        view = _view_key(examples[i])
        if view is not None:
            ids[i] = views.setdefault(view, ids[i])
    return ids


_LIST_HASHES: dict = {}  # id(list) → (the list, its items' hashes), until check_copies


def _list_hashes(examples: list) -> torch.Tensor:
    """:func:`_item_hash` of each item, computed once per list for check_repeated and
    check_copies."""
    hit = _LIST_HASHES.get(id(examples))
    if hit is not None and hit[0] is examples and len(hit[1]) == len(examples):
        return hit[1]
    collecting = gc.isenabled()
    gc.disable()  # the keys' tuples would start collections that walk every example
    try:
        hashes = torch.tensor([_item_hash(e) for e in examples], dtype=torch.int64)
    finally:
        if collecting:
            gc.enable()
    if len(_LIST_HASHES) >= 4:
        _LIST_HASHES.clear()
    _LIST_HASHES[id(examples)] = (examples, hashes)
    return hashes


def _view_key(example) -> tuple | None:
    """Where ``example`` (an (input, label) tuple, list or mapping) holds memory, the memory
    each tensor views (storage, offset, shape, strides), each array's, each list of numbers
    as an object, and its other leaves' values: two such examples with one key are one
    record taken twice, as ``[dataset[i] for i in indices]`` of a ``TensorDataset`` with a
    repeated index builds, or ``[dict(e) for e in minority]`` of dicts of token id lists (a
    copy of the dict, not of its lists). None for an example holding none."""
    found, held = [], []

    def walk(v, top=False):
        if isinstance(v, torch.Tensor):
            held.append(v.untyped_storage().data_ptr())
            found.append(("tensor", held[-1], v.storage_offset(), v.shape, v.stride(), v.dtype))
        elif isinstance(v, np.ndarray):
            held.append(v.__array_interface__["data"][0])
            found.append(("array", held[-1], v.shape, v.strides, v.dtype.str))
        elif isinstance(v, Mapping):
            for k in v:
                found.append(("key", repr(k)))
                walk(v[k])
        elif isinstance(v, list) and not top and v and _scalar(v[0]):
            held.append(id(v))  # a list object lives once: two examples holding it are one
            found.append(("list", id(v)))
        elif isinstance(v, (tuple, list)):
            found.append(("seq", len(v)))
            for item in v:
                walk(item)
        else:
            found.append(("value", type(v).__name__, repr(v)))

    if not isinstance(example, (tuple, list, Mapping)):
        return None
    walk(example, top=True)
    return tuple(found) if held and all(held) else None


def _scalar(v) -> bool:
    return isinstance(v, (int, float, bool, str, np.generic))


def _is_arrow_dataset(dataset) -> bool:
    """A Hugging Face ``datasets.Dataset`` (an Arrow table, with an index mapping)."""
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "_data")


def _arrow_ids(dataset, seen: dict) -> np.ndarray | None:
    """One id per item of a Hugging Face ``datasets.Dataset``: the memory of its row, read from
    its table's first column (the Arrow buffer and the row's position in it), through its index
    mapping (``_indices``, which ``select``, ``shuffle`` and ``train_test_split`` set). Rows of
    one memory are one example: ``select`` with a repeated index, ``concatenate_datasets`` of
    a dataset and a part of it (its tables share their buffers). None for anything else."""
    if not _is_arrow_dataset(dataset):
        return None
    try:
        table = getattr(dataset._data, "table", dataset._data)
        spaces = seen.setdefault("arrow", {})
        parts = []
        for chunk in table.column(0).chunks:
            buffer = next((b for b in chunk.buffers()[1:] if b is not None), None)
            if buffer is None:
                return None
            base = spaces.setdefault(buffer.address, -(len(spaces) + 1) * 2**40)
            parts.append(base + chunk.offset + np.arange(len(chunk), dtype=np.int64))
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if dataset._indices is not None:
            rows = rows[np.asarray(dataset._indices.column(0).to_numpy(), dtype=np.int64)]
        return rows
    except Exception:  # another layout: not read
        return None


def _fresh_ids(seen: dict, n: int, example=None, objects: dict | None = None) -> int:
    """The first of ``n`` ids no item was given yet; noted as ``example``'s where it is a
    non-empty container (a tuple, list or dict example held twice is one example)."""
    first = seen.get("next", 0)
    seen["next"] = first + n
    if objects is not None and isinstance(example, (tuple, list, Mapping)) and len(example):
        objects[id(example)] = first
    return first


def check_repeated(dataset) -> None:
    """Refuses a dataset that holds one example more than once through torch's ``Subset``
    (repeated indices) or ``ConcatDataset`` (a dataset with itself or an overlapping part), or
    a list that holds one example object twice:
    oversampling, the way to balance classes once a ``WeightedRandomSampler`` is refused. Each
    copy joins a Poisson batch on its own and is clipped on its own, so one example moves a
    step by up to C per copy while ε assumes C and q = B / (its copies counted as examples):
    at σ = 1, q = 0.1, 100 steps an example held twice has ε = 16.2 (dp-accounting PLD of the
    mixture of shifts 0, C, 2C), not the 7.05 printed."""
    if not isinstance(dataset, (tud.Subset, tud.ConcatDataset, list)) and (
        not _is_arrow_dataset(dataset)
    ):
        return
    ids = _list_ids(dataset) if isinstance(dataset, list) else _example_ids(dataset, {})
    if ids is None or len(ids) < 2:
        return
    order = np.sort(ids, kind="stable")
    repeated = order[1:][order[1:] == order[:-1]]
    if not len(repeated):
        return
    items = np.flatnonzero(ids == repeated[0])
    raise PrivgradError(
        f"the dataset holds {len(np.unique(repeated))} example(s) more than once (items "
        f"{', '.join(map(str, items[:3].tolist()))} are one example): a Subset (or a Hugging "
        "Face dataset's select) with repeated indices, a ConcatDataset with a dataset and "
        "itself (or an overlapping part) "
        "or a list holding an example twice (examples + minority, or [data[i] for i in "
        "indices] of a TensorDataset with a repeated index), or a Hugging Face dataset "
        "concatenated with a part of itself (concatenate_datasets) "
        "oversamples, and each copy joins a Poisson batch and is clipped on its own, so one "
        "example moves a step by up to C per copy, which ε does not count (twice held, its ε "
        "at σ = 1, q = 0.1, 100 steps is 16.2, not 7.05); give each example once, and balance "
        "classes by weighting each example's loss in loss_fn"
    )


def _row_hashes(tensors: list[torch.Tensor], n: int) -> torch.Tensor:
    """A 64-bit hash of each of the ``n`` rows of ``tensors`` (each of ``n`` rows, any dtype),
    of their bytes: rows equal bit for bit in every tensor hash alike (about 0.1 s for
    MNIST's 60,000 images)."""
    parts = [
        t.detach().reshape(n, -1).contiguous().view(torch.uint8).cpu().numpy() for t in tensors
    ]
    if len(parts) == 2:  # inputs and labels: the usual case, without a generator per row
        a, b = parts
        return torch.tensor([hash((a[i].tobytes(), b[i].tobytes())) for i in range(n)])
    return torch.tensor([hash(tuple(p[i].tobytes() for p in parts)) for i in range(n)])


def _item_hash(item) -> int:
    """A 64-bit hash of an in-memory example's contents (tensors, arrays, strings, numbers, in
    tuples, lists and mappings): equal contents hash alike. A flat list of numbers or strings
    (token ids) is hashed as one tuple, in C."""

    def key(v):
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().contiguous()
            return (
                "T",
                str(v.dtype),
                tuple(v.shape),
                v.reshape(-1).view(torch.uint8).numpy().tobytes(),
            )
        if isinstance(v, np.ndarray):
            return ("A", v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes())
        if isinstance(v, Mapping):
            return ("M", tuple((repr(k), key(x)) for k, x in v.items()))
        if isinstance(v, (tuple, list)):
            flat = tuple(v)
            try:
                if not v or isinstance(v[0], (int, float, str, bool)):
                    return ("L", hash(flat))  # numbers or strings: hashed in C
            except TypeError:  # an unhashable item after all
                pass
            return ("S", tuple(key(x) for x in v))
        return ("V", type(v).__name__, repr(v))

    return hash(key(item))


def _content_hashes(data) -> torch.Tensor | None:
    """A 64-bit hash of each item's contents (inputs and label) for training data
    held in memory: tensors (:class:`TensorSource`, a ``TensorDataset``), a list of examples,
    and torch's ``Subset`` and ``ConcatDataset`` of those; None for anything else (a lazy
    ``Dataset`` is not read whole)."""
    if isinstance(data, TensorSource):
        return _row_hashes([t for _, t in leaves(data.x)] + [data.y], len(data))
    if isinstance(data, DatasetSource):
        return _content_hashes(data.dataset)
    if isinstance(data, tud.TensorDataset):
        return _row_hashes(list(data.tensors), len(data))
    if isinstance(data, tud.Subset):
        inner = _content_hashes(data.dataset)
        return None if inner is None else inner[torch.as_tensor(data.indices, dtype=torch.long)]
    if isinstance(data, tud.ConcatDataset):
        parts = [_content_hashes(d) for d in data.datasets]
        return None if any(p is None for p in parts) else torch.cat(parts)
    if isinstance(data, list):
        return _list_hashes(data)
    return None


COPIES_WARNING = "training examples are exact copies of another"  # the warning's words


def check_copies(source) -> None:
    """Warns where in-memory training data (tensors, a ``TensorDataset``, a list of examples)
    holds examples equal to another, inputs and label bit for bit: a minority class oversampled
    by ``torch.cat([x, x[minority]])`` or ``repeat_interleave`` holds one person's record twice,
    each copy joins a Poisson batch and is clipped on its own, so that record moves a step by
    up to 2 C and its ε is 16.2 where 7.05 is printed (σ = 1, q = 0.1, 100 steps). Equal
    records of different people are examples each (Adult holds 24 such rows, IMDB at 80
    tokens 107), and contents cannot tell them apart, so this warns; copies held by one
    object (:func:`check_repeated`) are refused."""
    hashes = _content_hashes(source)
    _LIST_HASHES.clear()  # (kept from check_repeated for this call only)
    if hashes is None or len(hashes) < 2:
        return
    _, inverse, counts = torch.unique(hashes, return_inverse=True, return_counts=True)
    copies = int((counts - 1).sum())
    if not copies:
        return
    group = int(torch.argmax(counts))
    pair = torch.nonzero(inverse == group).flatten()[:2].tolist()
    warn_user(
        f"{copies} of the {len(hashes)} {COPIES_WARNING} (inputs and label equal; e.g. "
        f"examples {pair[0]} and {pair[1]}, {int(counts[group])} copies): if copies are one "
        "person's record held more than once (a class oversampled by torch.cat([x, "
        "x[minority]]) or repeat_interleave), each copy joins a Poisson batch and is clipped "
        "on its own, so that record moves a step by up to C per copy and its ε is not the one "
        "printed (twice held: 16.2 for 7.05 at σ = 1, q = 0.1, 100 steps); give each record "
        "once and weight each example's loss in loss_fn instead. Equal records of different "
        "people are separate examples and need no change"
    )


STANDARDISED_TOL = 1e-4  # a column's |mean| and |std − 1| below it: standardised by itself


def _feature_tables(data) -> list[torch.Tensor]:
    """The 2-d float input tensors (examples × features) of in-memory training data."""
    if isinstance(data, TensorSource):
        found = [t for _, t in leaves(data.x)]
    elif isinstance(data, DatasetSource) and isinstance(data.dataset, tud.TensorDataset):
        found = list(data.dataset.tensors[:-1])
    else:
        return []
    return [t for t in found if t.dim() == 2 and t.is_floating_point() and len(t) >= 10]


def check_standardised(source) -> None:
    """Warns where a 2-d float input of in-memory training data has a column standardised by
    its own statistics (mean 0 and standard deviation 1, either ddof, to
    :data:`STANDARDISED_TOL`: scikit-learn's ``StandardScaler`` fit on the training set, or
    ``(x - x.mean(0)) / x.std(0)``), which no chance column has: every example's input then
    depends on every other example, outside ε. One row of 1,000 with a feature of 100 where
    the others are N(0, 1) moved the clipped sum (σ = 0, q = 1) by 9.78 C through them."""
    for t in _feature_tables(source):
        v = t.detach()
        mean = v.sum(0, dtype=torch.float64) / len(v)
        # E[x²] − mean²: exact enough where it matters, a mean near 0 (one float32 pass)
        square = (v * v).sum(0, dtype=torch.float64) - len(v) * mean.square()
        var0, var1 = square / len(v), square / (len(v) - 1)
        varying = var0 > 1e-12
        close = (mean.abs() <= STANDARDISED_TOL) & (
            ((var0.sqrt() - 1).abs() <= STANDARDISED_TOL)
            | ((var1.sqrt() - 1).abs() <= STANDARDISED_TOL)
        )
        columns = torch.nonzero(varying & close).flatten().tolist()
        if not columns:
            continue
        warn_user(
            f"{len(columns)} of the {t.shape[1]} input columns of the training data are "
            f"standardised by the training data's own mean and standard deviation (column "
            f"{columns[0]}: mean {float(mean[columns[0]]):.1e}, std 1 to {STANDARDISED_TOL:g}; "
            "StandardScaler fit on the training set, or (x - x.mean(0)) / x.std(0)): every "
            "example's input then depends on every other example, which ε does not cover "
            "(one row of 1,000 with a feature of 100, the others N(0, 1), moved the clipped "
            "sum by 9.78 C through them); scale by constants fixed without the training data "
            "(public statistics, a known range) or by each example's own values"
        )
        return


def check_loader(loader: tud.DataLoader) -> None:
    """Refuses a DataLoader whose sampling is not the default one privgrad replaces."""
    why = (
        "privgrad draws its own Poisson batches and its ε assumes exactly that sampling, so a "
        "sampler that changes which examples are drawn (e.g. WeightedRandomSampler, Opacus #813) "
        "cannot be honoured; build the DataLoader without sampler=/batch_sampler="
    )
    if isinstance(loader.dataset, tud.IterableDataset):
        raise PrivgradError(
            "an IterableDataset cannot be Poisson-sampled: privgrad needs a map-style "
            "Dataset (with __len__ and __getitem__)"
        )
    sampler = loader.sampler
    default = type(sampler) is tud.SequentialSampler or (
        type(sampler) is tud.RandomSampler
        and not sampler.replacement
        and sampler._num_samples is None
    )
    if not default:
        raise PrivgradError(f"the DataLoader's sampler is a {type(sampler).__name__}: {why}")
    if loader.batch_sampler is None:
        raise PrivgradError(
            "the DataLoader has batch_size=None (no batching): give it the expected "
            "Poisson batch size"
        )
    if type(loader.batch_sampler) is not tud.BatchSampler:
        raise PrivgradError(
            f"the DataLoader's batch_sampler is a {type(loader.batch_sampler).__name__}: {why}"
        )
