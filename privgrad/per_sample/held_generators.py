"""Random generators a model holds as attributes (augmentation that draws from a
``torch.Generator`` of its own, NumPy's or Python's), beside the global RNGs.

make_private's checks run a forward (or load and collate examples) several times and
compare: they seed these alike each time, as they seed the global RNGs, and leave them as they
were (:class:`forked`; :mod:`privgrad.per_sample.independence`, :mod:`privgrad.batches`,
:mod:`privgrad.data_checks`).
"""

from __future__ import annotations

import operator
import random
from itertools import chain

import numpy as np
import torch
from torch import nn

KINDS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def held_generators(module: nn.Module) -> list:
    """The generators ``module`` and its submodules hold as attributes, each once."""
    found = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, KINDS):
                found.setdefault(id(value), value)
    return list(found.values())


def states(generators: list) -> list:
    """Their states, to :func:`restore`."""
    return [state(g) for g in generators]


def restore(generators: list, saved: list) -> None:
    for g, state in zip(generators, saved):
        if isinstance(g, torch.Generator):
            g.set_state(state)
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = state
        elif isinstance(g, np.random.RandomState):
            g.set_state(state)
        else:
            g.setstate(state)


def seed(generators: list, value: int) -> None:
    """Each seeded with ``value`` (as the checks seed the global RNGs)."""
    for g in generators:
        if isinstance(g, torch.Generator):
            g.manual_seed(value)
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = type(g.bit_generator)(value).state
        elif isinstance(g, np.random.RandomState):
            g.seed(value % 2**32)
        else:
            g.seed(value)


def state(g):
    """``g``'s state, to restore."""
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    if isinstance(g, np.random.RandomState):
        return g.get_state()
    return g.getstate()


class forked:
    """The global RNGs forked (torch's, CPU and ``device``'s, NumPy's and Python's) and
    ``generators`` (a model's, :func:`held_generators`; a collate's or a dataset's), all
    seeded with ``seed`` if given, and all left as they were after the block. ``drew``:
    whether the block drew from any of them (seeded only); ``drawn``: the host RNGs' states
    it left."""

    def __init__(self, generators: list, device: torch.device, seed: int | None = None):
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda"
            else []
        )
        self.fork, self.seed, self.device = torch.random.fork_rng(devices=devices), seed, device
        self.held = generators

    def __enter__(self):
        self.fork.__enter__()
        self.host = random.getstate(), np.random.get_state()
        self.held_states = states(self.held)
        if self.seed is not None:
            seed(self.held, self.seed)
            torch.random.default_generator.manual_seed(self.seed)
            random.seed(self.seed)
            np.random.seed(self.seed % 2**32)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(self.seed)
            self.seeded = self._states()

    def _states(self) -> tuple:
        """Every generator the block may draw from, as it stands."""
        cuda = ()
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                cuda = (torch.cuda.get_rng_state(),)
        return (
            torch.random.default_generator.get_state(),
            *cuda,
            random.getstate(),
            np.random.get_state(),
            states(self.held),
        )

    def __exit__(self, *exc):
        self.drawn = random.getstate(), np.random.get_state()  # how far the block drew
        self.drew = self.seed is not None and not same_state(self.seeded, self._states())
        random.setstate(self.host[0])
        np.random.set_state(self.host[1])
        restore(self.held, self.held_states)
        return self.fork.__exit__(*exc)


def same_state(a, b) -> bool:
    """Whether two generator states (tensors, arrays, dicts, tuples of them) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        if len(a) != len(b):
            return False
        if {*map(type, chain(a, b))} == {int}:  # Python's RNG: 625 ints, compared at once
            return all(map(operator.eq, a, b))
        return all(same_state(u, v) for u, v in zip(a, b))
    return a == b
