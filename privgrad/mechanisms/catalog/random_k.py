"""Random-k (GIP paper, Prop. 1): as GIP with a fresh uniform mask, which costs no privacy.
The stages are in :mod:`privgrad.mechanisms.gip`."""

from dataclasses import dataclass

from privgrad.mechanisms.catalog.gip import (
    GROUP_SIZE_HELP,
    GROUPING_HELP,
    K_END_HELP,
    K_START_HELP,
    PRUNE_ORDER_HELP,
)
from privgrad.mechanisms.registry import Defaults, MechanismSpec, option
from privgrad.validate import AT_LEAST_ONE, RATE


@dataclass(frozen=True)
class Options:
    k_schedule: str = option("exponential", "k schedule: constant, linear or exponential (default)")
    k_start: float = option(1.0, K_START_HELP, range=RATE)
    k_end: float = option(0.5, K_END_HELP, range=RATE, flag="--keep-ratio")
    group_size: int = option(256, GROUP_SIZE_HELP, range=AT_LEAST_ONE)
    grouping: str = option("contiguous", GROUPING_HELP)
    prune_order: str = option("clip-then-prune", PRUNE_ORDER_HELP)
    total_steps: int | None = option(None, "the run's length (default: planned)", cli=False)


def build(noise_multiplier, max_grad_norm, **options):
    from privgrad.mechanisms.gip import random_k

    return random_k(noise_multiplier, max_grad_norm, **options)


MECHANISM = MechanismSpec(
    name="random-k",
    build=build,
    options=Options,
    defaults=Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="GIP (seed 001), Random-k, Prop. 1",
    chain="as gip with a fresh uniform mask (no privacy cost)",
)
