"""Random generators a model holds as attributes (augmentation that draws from a
``torch.Generator`` of its own, NumPy's or Python's), beside the global RNGs.

make_private's checks run a forward several times and compare: they seed these alike for
each forward, as they seed the global RNGs, and leave them as they were
(:mod:`privgrad.per_sample.independence`).
"""

from __future__ import annotations

import random

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
