"""Training data as a private step reads it: one Poisson batch at a time.

:func:`training_source` accepts a pair of tensors, a ``TensorDataset``, a map-style
``Dataset`` or a ``DataLoader``. A ``Dataset`` is read lazily: only the examples of the
batch being drawn are loaded (``dataset[i]``, then the collate function), so it need not
fit in memory. A ``DataLoader`` keeps its dataset, collate function and workers; its
sampler is *replaced* by privgrad's Poisson sampler, and a custom sampler is refused,
because the accountant's q assumes Poisson sampling and nothing else (Opacus #813).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.utils import data as tud
from torch.utils.data._utils.collate import default_collate

from privgrad.errors import PrivgradError
from privgrad.inputs import LABEL_KEY, rows, split_labels, take

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
        self.dataset, self.collate = dataset, collate_fn or default_collate
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


class _EmptySafeCollate:
    """The user's collate function; an empty Poisson batch gives an empty (x, y)."""

    def __init__(self, collate, empty):
        self.collate, self.empty = collate, empty

    def __call__(self, examples):
        return self.collate(examples) if examples else self.empty


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
    if isinstance(data, tud.DataLoader):
        check_loader(data)
        warnings.warn(
            "privgrad replaces the DataLoader's sampler with Poisson sampling: each example joins "
            "a batch independently with probability q = batch_size / len(dataset), as the "
            "accountant assumes; its dataset, collate_fn and workers are kept",
            stacklevel=3,
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
