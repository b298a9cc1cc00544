"""The checks make_private runs on training data beyond its collate function
(:meth:`privgrad.batches.DatasetSource.check_collate`): one example held twice (a repeated
index, a wrapper or a Hugging Face dataset repeating a row; equal copies in memory warn), a
``__getitem__`` that reads two examples (MixUp inside the Dataset) or keeps state across
items, and inputs standardised by the training set's own statistics (a warning)."""

from __future__ import annotations

import gc
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils import data as tud
from torch.utils.data._utils.collate import default_collate

from privgrad.batches import (
    REPLACED_SEEDS,
    DatasetSource,
    TensorSource,
    _fetches_batches,
    _map_style,
    _same,
    inputs_and_labels,
)
from privgrad.errors import PrivgradError, warn_user
from privgrad.held_state import generators, snapshot, state_change
from privgrad.per_sample import held_generators
from privgrad.inputs import leaves

ROW_PROBE = 5_000  # items (a random sample beyond) check_items reads the rows of
ITEM_PROBE = 4  # items check_items loads (under REPLACED_SEEDS seeds each)
_CPU = torch.device("cpu")  # where the checks seed torch's generator (data is loaded there)


def check_items(dataset) -> None:
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
    for wrapped in _wrapped(dataset):
        n = _own_items(wrapped)
        if n:
            _check_item_state(wrapped)
            _check_item_reads(wrapped, n)
            _check_item_rows(wrapped, n)


def _own_items(dataset) -> int | None:
    """The number of items of a dataset whose ``__getitem__`` is the user's, one at a time
    (not torch's wrappers, a ``TensorDataset`` or a list, whose items read one row each, nor
    one loading rows a batch at a time, checked as a collate is); None for any other."""
    if isinstance(dataset, (tud.Subset, tud.ConcatDataset, tud.TensorDataset, list)):
        return None
    if _fetches_batches(dataset) or not hasattr(dataset, "__dict__"):
        return None
    try:
        return len(dataset)
    except TypeError:
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


def _offsets(value) -> bool:
    """Whether ``value`` is a 1-d integer tensor or array that never decreases: the offsets
    of items in a flat tensor (``tokens[starts[i]:starts[i + 1]]`` reads two of its rows for
    one example), not examples."""
    if isinstance(value, torch.Tensor):
        integer = not (value.is_floating_point() or value.is_complex()) and (
            value.dtype != torch.bool
        )
        return value.ndim == 1 and integer and bool((value[1:] >= value[:-1]).all())
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iu" and bool(np.all(np.diff(value) >= 0))
    return False


def _check_item_reads(dataset, n: int) -> None:
    """:func:`check_items`' check of reads for one dataset of ``n`` items
    (:func:`_own_items`)."""
    held = {}
    for name, value in vars(dataset).items():
        if not (isinstance(value, (torch.Tensor, np.ndarray)) or _map_style(value)):
            continue
        try:  # one row per item, or a dataset (or list of examples) of any length
            examples = not isinstance(value, (torch.Tensor, np.ndarray)) and (
                not isinstance(value, (list, tuple)) or _examples_list(value)
            )
            if n >= 2 and (len(value) == n or (examples and len(value) >= 2)):
                if not _offsets(value):
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
    gens = generators([held_value for held_value in vars(dataset).values()] + [dataset])
    try:
        for i in range(min(ITEM_PROBE, n)):
            for seed in range(REPLACED_SEEDS):
                for log in logs.values():
                    log.clear()
                rng = held_generators.forked(gens, _CPU, seed)  # its own too (a Generator)
                with rng:
                    dataset[i]
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
                if not rng.drew:  # the same rows under every seed: one load tells
                    break
    except PrivgradError:
        raise
    except Exception:
        return  # the stand-in could not follow a read: unchecked
    finally:
        _restore(dataset, held)


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
    gens = generators([dataset])
    loads, states = [], [snapshot([dataset])]
    try:
        for _ in range(2):
            with held_generators.forked(gens, _CPU, 0):
                loads.append(inputs_and_labels(default_collate([dataset[0]])))
            states.append(snapshot([dataset]))
        same = _same(*loads)
    except Exception:
        return  # an item default_collate cannot batch, or a load that failed: unchecked
    changed = state_change(states[0], states[1]) or state_change(states[1], states[2])
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
            self._log.append((self._name, int(row) % max(1, len(self._inner)), False))
        raise _Stop


REPEATED_READS = 8  # a held tensor's rows read more than this often each: a table, not rows


class _RowRead(_Reads):
    """A stand-in for a tensor or array a dataset holds: notes the row an item reads
    (``x[i]``, ``x[i, ...]``) and stops the item's loading there, unless what it read is a
    number (``index[i]`` in ``x[index[i]]``, a label, a weight) and ``modes`` does not say
    that no other read follows such reads (then the load goes on to the row an index leads
    to); any other read (a slice, a mask) stops it unnoted."""

    def __init__(self, inner, log: list, name: str, modes: dict):
        super().__init__(inner, log)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_modes", modes)

    def __getitem__(self, index):
        row = index[0] if isinstance(index, tuple) and index else index
        if isinstance(row, torch.Tensor) and row.dim() == 0 and not row.is_floating_point():
            row = row.item()
        if not isinstance(row, (int, np.integer)) or isinstance(row, bool):
            raise _Stop  # a slice, a mask, a list of rows: not followed
        value = self._inner[index]
        scalar = isinstance(value, (int, float, np.generic)) or (
            isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0
        )
        self._log.append((self._name, int(row) % len(self._inner), scalar))
        if scalar and self._modes.get(self._name) != "stop":
            return value
        raise _Stop


def _check_item_rows(dataset, n: int) -> None:
    """Refuses a dataset two of whose items read one row of a dataset, tensor or array it
    holds: a wrapper that repeats a dataset (mmengine's ``RepeatDataset``, ``idx % len``) or
    repeats some of its rows (``ClassBalancedDataset``'s repeat factors), or a dataset handing
    out the rows of its tensors more than once (``x[i % n]`` with a length past its data's,
    ``x[index[i]]`` with an index repeating rows), holds those examples more than once, as a
    ``Subset`` with repeated indices does (:func:`check_repeated`). Each item (of a dataset
    of more than :data:`ROW_PROBE`, that many at random) is loaded with every dataset it holds
    as an attribute (or list of examples: pairs, dicts or tensors; not a list of names or
    numbers: a table of class names is read by many items) replaced by a stand-in that notes
    the row read first and stops the load there, and every tensor or array of two rows or more
    by one that notes the row read and stops there too, unless it read a number another read
    follows (an index, a label). A tensor whose rows the items read more than
    :data:`REPEATED_READS` times each on average is a table (a class's vector), not examples,
    and is not refused. Two sampled items of one row of n items repeated t times meet with a
    chance of about 1 − exp(−k²(t − 1)/2n), k the sample: certain below a million items."""
    held = {
        name: value
        for name, value in vars(dataset).items()
        if _map_style(value) and (not isinstance(value, (list, tuple)) or _examples_list(value))
    }
    arrays = {}
    for name, value in vars(dataset).items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 1 and len(value) >= 2:
            arrays[name] = value
        elif isinstance(value, (list, tuple)) and len(value) >= 2 and _number(value[0]):
            arrays[name] = value  # numbers (labels, an index) a read of another may follow
    if not (held or arrays) or n < 2:
        return
    log: list = []
    modes: dict = {}  # a tensor's name → "go" (read before another, as an index) or "stop"
    stand_ins = {name: _FirstRead(value, log, name) for name, value in held.items()}
    stand_ins.update({name: _RowRead(value, log, name, modes) for name, value in arrays.items()})
    originals = {**held, **arrays}
    try:
        for name, stand_in in stand_ins.items():
            setattr(dataset, name, stand_in)
    except (AttributeError, TypeError):
        _restore(dataset, originals)
        return
    first: dict = {}  # (attribute, row) → the first item that read it
    repeats: dict = {}  # a tensor's name → the first (row, item, item) two items shared
    reads: dict = {}  # a tensor's name → how many items read it
    # a tensor's name → the rows each item read of it; whether it read a row not a number;
    # the tensors whose number led to its rows ("" for a row not reached through one)
    item_rows: dict = {}
    read_rows: set = set()
    led_by: dict = {}
    # what may hold each item's data: a row per item that is not one number (a per-item
    # label, weight or index is no example's data), or a longer flat tensor (tokens, pixels
    # sliced per item); less what an item read a number of
    per_item = {
        name
        for name, value in {**vars(dataset), **originals}.items()
        if isinstance(value, (torch.Tensor, np.ndarray, list, tuple))
        and getattr(value, "ndim", 1) >= 1
        and len(value) >= n
        and (
            getattr(value, "ndim", 1) >= 2
            or len(value) > n
            or isinstance(value, (list, tuple))
            and not _number(value[0])
        )
    }
    number_read: set = set()  # what an item read a number of (an index, a label, a weight)
    try:
        with held_generators.forked([], _CPU, 0):
            probe = (  # every item, or a random sample: a repeat shows as a shared row
                range(n)
                if n <= ROW_PROBE
                else np.sort(np.random.default_rng(0).choice(n, ROW_PROBE, replace=False))
            )
            for i in probe:
                log.clear()
                stopped = False
                try:
                    dataset[int(i)]
                except _Stop:
                    stopped = True
                for k, (name, _, scalar) in enumerate(log):
                    if scalar and name not in modes and (k + 1 < len(log) or not stopped):
                        modes[name] = "go" if k + 1 < len(log) else "stop"
                if stopped and log and log[-1][0] in held:  # a dataset's row read first
                    _refuse_repeat(dataset, held, first, log[-1][:2], int(i))
                numbers: set = set()  # the tensors this item read a number of so far
                rows_now: dict = {}
                for name, row, scalar in log:
                    if name not in arrays:
                        continue
                    rows_now.setdefault(name, set()).add(row)
                    if not scalar:
                        read_rows.add(name)
                    led_by.setdefault(name, set()).update(numbers - {name} or {""})
                    if scalar:
                        numbers.add(name)
                        number_read.add(name)
                for name, rows in rows_now.items():
                    item_rows.setdefault(name, []).append(frozenset(rows))
                for key in sorted({(a, row) for a, row, _ in log if a in arrays}):
                    reads[key[0]] = reads.get(key[0], 0) + 1
                    if key in first:
                        repeats.setdefault(key[0], (key[1], first[key], int(i)))
                    else:
                        first[key] = int(i)
        for name, (row, a, b) in repeats.items():
            rows = sum(1 for key in first if key[0] == name)
            if rows * REPEATED_READS < reads[name]:  # a table many items read
                continue
            others = per_item - number_read - {name}
            if _constants(item_rows[name], name in read_rows, led_by[name], others):
                continue
            _refuse_repeat(dataset, arrays, {(name, row): a}, (name, row), b)
    except PrivgradError:
        raise
    except Exception:
        return  # an item the stand-in could not follow: unchecked
    finally:
        _restore(dataset, originals)


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _constants(item_rows: list, rows_read: bool, led_by: set, per_item: set) -> bool:
    """Whether a held tensor that items read rows of in common is constants or a table, not
    examples, by how the items read it (:func:`_check_item_rows`): every item read the same
    rows (a per-channel mean, mean[c] for each channel c); each item read more than one of its
    numbers (bounds, as offsets[i] and offsets[i + 1] of a token tensor sliced between them,
    or constants); or its rows were reached only through numbers read of other tensors (a
    label) while the dataset holds something else with a row for every item that is not one
    number (the data): a table read by label (a one-hot row, a class weight or class mean). A
    row read directly by two items (x[i % n]), or through an index where nothing but numbers
    (the index, per-item weights) has a row per item (x[index[i]] with index repeating rows),
    is examples held twice."""
    if len(set(item_rows)) == 1:
        return True
    if not rows_read and any(len(rows) > 1 for rows in item_rows):
        return True
    return "" not in led_by and bool(per_item - led_by)


def _refuse_repeat(dataset, held: dict, first: dict, key: tuple, i: int) -> None:
    """Notes ``key`` (an attribute and its row) as item ``i``'s, or refuses it read twice."""
    if key not in first:
        first[key] = i
        return
    raise PrivgradError(
        f"{type(dataset).__name__} holds an example more than once: its items "
        f"{first[key]} and {i} both read row {key[1]} of its {key[0]!r} "
        f"({type(held[key[0]]).__name__} of {len(held[key[0]])} rows): a wrapper that repeats "
        "a dataset or some of its rows (mmengine's RepeatDataset, ClassBalancedDataset), or a "
        "dataset handing out a row more than once (x[i % len(x)] with a length past its "
        "data's, x[index[i]] with an index repeating rows), oversamples, and each copy joins "
        "a Poisson batch and is clipped on its own, so one example moves a step by up to C "
        "per copy, which ε does not count (twice held, its ε at σ = 1, q = 0.1, 100 steps is "
        "16.2, not 7.05); give each example once (train for more epochs instead of repeating "
        "it), balance classes by weighting each example's loss in loss_fn, and keep what is "
        "one person's (the crops of one image) in one item"
    )


def _restore(dataset, held: dict) -> None:
    for name, value in held.items():
        try:
            setattr(dataset, name, value)
        except (AttributeError, TypeError):
            pass


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
