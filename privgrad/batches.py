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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils import data as tud
from torch.utils.data._utils.collate import default_collate

from privgrad.errors import PrivgradError, warn_user
from privgrad.held_state import (
    generators,
    holders,
    snapshot,
    state_change,
)
from privgrad.per_sample import held_generators
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
        spread = _spread(len(self))
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
        from privgrad.data_checks import check_repeated  # (which reads these sources)

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
        before = snapshot(self._holders())
        full = self._collated(examples, 0)
        after = snapshot(self._holders())
        if len(full[1]) != len(examples):
            raise PrivgradError(
                f"{self.loading} returns {len(full[1])} rows for {len(examples)} examples (it "
                "packs, splits or drops examples): privgrad clips each example's gradient, so it "
                "needs one row per example"
            )
        reproducible = _same(full, self._collated(examples, 0))
        changed = state_change(before, after) or state_change(after, snapshot(self._holders()))
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

        spread = _spread(self.size)
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

        spread = _spread(self.size)
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
        labels), with torch's, NumPy's and Python's global RNGs and the generators the collate
        holds seeded with ``seed`` (restored after). Rows of a dataset that loads a batch at a
        time are loaded together by its ``__getitems__``, as a DataLoader loads them: a Hugging
        Face dataset's
        ``set_transform`` runs on them at once (tokenizing with padding to their longest), and
        a ``__getitems__`` may mix them (standardising by their statistics), which the collate
        of loaded rows would not show."""
        held = generators(self._holders())  # a collate's own (MixUp with a generator of its own)
        with held_generators.forked(held, torch.device("cpu"), seed):
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
        return inputs_and_labels(out)

    def _holders(self) -> list:
        """What the collate (and a dataset loading rows a batch at a time) keeps state and
        generators in: a callable object, a function's closure, a partial's arguments."""
        return holders(self.collate) + ([self.dataset] if self.batched else [])

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


def _spread(size: int) -> list[int]:
    """:data:`RECOLLATE_LOOK` indices spread evenly over ``size`` examples, both ends included
    (data sorted or bucketed by length has its extremes at its ends)."""
    return np.linspace(0, size - 1, RECOLLATE_LOOK).round().astype(int).tolist()


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


COLLATE_PROBE = 6  # examples DatasetSource.check_collate collates
RECOLLATE_LOOK = 64  # examples DatasetSource.recollated reads across the dataset, for a longer one
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
