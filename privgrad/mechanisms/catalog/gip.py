"""GIP (Alg. 1–2, Eq. 11): clip → sum → private top-k mask (Mallows, pure ε-DP) →
N(0, σ²C²) → ⊙ mask → ÷B. The stages are in :mod:`privgrad.mechanisms.gip`."""

from dataclasses import dataclass

from privgrad.mechanisms.registry import Defaults, MechanismSpec, option
from privgrad.validate import AT_LEAST_ONE, OPEN_UNIT, RATE

GROUPING_HELP = "'contiguous' (paper) or 'per-tensor' (authors' code)"
PRUNE_ORDER_HELP = "'clip-then-prune' (paper) or 'prune-then-clip' (code)"
K_END_HELP = "final fraction k of coordinates kept"
K_START_HELP = "keep fraction at the first step"
GROUP_SIZE_HELP = "group size ℓ (256)"


@dataclass(frozen=True)
class Options:
    k_schedule: str = option("linear", "k schedule: constant, linear (default) or exponential")
    k_start: float = option(1.0, K_START_HELP, range=RATE)
    k_end: float = option(0.1, K_END_HELP, range=RATE, flag="--keep-ratio")
    group_size: int = option(256, GROUP_SIZE_HELP, range=AT_LEAST_ONE)
    grouping: str = option("contiguous", GROUPING_HELP)
    prune_order: str = option("clip-then-prune", PRUNE_ORDER_HELP)
    index_budget_fraction: float = option(
        0.01, "share of ε spent on index selection (0.01)", range=OPEN_UNIT
    )
    index_epsilon_total: float | None = option(
        None, "ε spent on index selection over the run (default: from the fraction)", cli=False
    )
    total_steps: int | None = option(None, "the run's length (default: planned)", cli=False)


def build(noise_multiplier, max_grad_norm, **options):
    from privgrad.mechanisms.gip import gip

    return gip(noise_multiplier, max_grad_norm, **options)


MECHANISM = MechanismSpec(
    name="gip",
    build=build,
    options=Options,
    defaults=Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="GIP (seed 001), Alg. 1-2",
    chain="clip → sum → private top-k mask (Mallows) → N(0, σ²C²) → ⊙ mask → ÷B",
)
