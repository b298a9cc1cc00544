"""Numeric command-line options: one table of ranges, checked at the boundary for every command.

Every int or float option (or argument) of every command has a :class:`Range` here (by
flag, or by command and flag where commands differ; a mechanism's options declare theirs);
a value that is not finite or lies outside its range is refused with one line before the
command does anything. No heavy imports: the CLI imports this module at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privgrad.errors import PrivgradError

MAX_STEPS = 10**7  # the PLD accountant needs about 1 GB and 20 s at 10^7 steps
MAX_EPOCHS = 10**6
# σ above 10^6 buys nothing (one full-batch step at σ = 10^6 has ε = 0 for any δ ≥ 10^-6) and
# σ·C·N(0, 1) overflows float32 (3.4e38) long before 1e300: such a run trained to NaN and
# failed only at its end, storing nothing.
MAX_NOISE_MULTIPLIER = 1e6
# canary trials per side (one-run: canaries; mia: pool): the committed audits use at most
# 4·10^6; the canary audit keeps two float64 scores per trial (1.6 GB at 10^8).
MAX_TRIALS = 10**8
# generated GAN samples are held at once: 2·10^5 MNIST images are 0.63 GB (the paper and
# the defaults use 10^4 for the final score, 500 per score during training).
MAX_GAN_SAMPLES = 2 * 10**5


@dataclass(frozen=True)
class Range:
    """A closed or open interval of finite numbers."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x) -> bool:
        if isinstance(x, float) and not math.isfinite(x):
            return False
        return (self.low < x if self.low_open else self.low <= x) and (
            x < self.high if self.high_open else x <= self.high
        )

    def describe(self) -> str:
        if self.high == math.inf:
            return (
                "finite"
                if self.low == -math.inf
                else f"{'>' if self.low_open else '≥'} {_num(self.low)}"
            )
        return (
            f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
            f"{')' if self.high_open else ']'}"
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


ANY = Range()
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
OPEN_UNIT = Range(0, 1, True, True)  # (0, 1)
RATE = Range(0, 1, low_open=True)  # (0, 1]
STEPS = Range(1, MAX_STEPS)

RANGES: dict[str, Range] = {
    "--epsilon": POSITIVE,
    "--delta": OPEN_UNIT,
    "--noise-multiplier": Range(0, MAX_NOISE_MULTIPLIER),
    "--epochs": Range(0, MAX_EPOCHS, low_open=True),
    "--batch-size": POSITIVE,
    "--lr": POSITIVE,
    "--momentum": Range(0, 1, high_open=True),
    "--clip": POSITIVE,
    "--ts-scale": POSITIVE,
    "--ts-temperature": POSITIVE,
    "--ts-offset": ANY,
    "--block-size": AT_LEAST_ONE,
    "--depth": Range(10),
    "--seed": Range(0, 2**62 - 1),  # privgrad.seeds.MAX_SEED
    "--limit-train": AT_LEAST_ONE,
    "--vocab-size": Range(1, 1_000_000),  # embedding rows (IMDB has under 100,000 words)
    "--max-len": Range(1, 10_000),  # int64 ids of 50,000 reviews: 4 GB at the bound
    "--limit-test": AT_LEAST_ONE,
    "--validation": NON_NEGATIVE,
    "--nproc": AT_LEAST_ONE,
    "--sampling-rate": RATE,
    "--steps": STEPS,
    "--limit": AT_LEAST_ONE,
    "--generator-steps": STEPS,
    "--discriminator-steps": AT_LEAST_ONE,
    "--alpha": Range(1, low_open=True),
    "--loss-bound": POSITIVE,
    "--decay": NON_NEGATIVE,
    "--tau": NON_NEGATIVE,
    "--t-star": AT_LEAST_ONE,
    "--latent-dim": AT_LEAST_ONE,
    "--width": AT_LEAST_ONE,
    "--eval-every": AT_LEAST_ONE,
    "--eval-samples": Range(1, MAX_GAN_SAMPLES),
    "--final-samples": Range(1, MAX_GAN_SAMPLES),
    "--seeds": AT_LEAST_ONE,
    "--jobs": AT_LEAST_ONE,
    "--trials": Range(1, MAX_TRIALS),
    "--background": NON_NEGATIVE,
    "--n-train": AT_LEAST_ONE,
    "--confidence": OPEN_UNIT,
    "--threads": Range(1, 1024),
    "--physical-batch-size": AT_LEAST_ONE,
}
COMMAND_RANGES: dict[tuple[str, str], Range] = {
    ("epsilon", "--steps"): Range(0, MAX_STEPS),
    ("resume", "RUN_ID"): Range(1, 2**63 - 1),  # SQLite's INTEGER
    ("export", "RUN_ID"): Range(1, 2**63 - 1),
    ("show", "RUN_ID"): Range(1, 2**63 - 1),
}


def range_of(command: str, flag: str) -> Range:
    """The range of ``flag``; a mechanism option's is declared with the mechanism
    (:func:`privgrad.mechanisms.registry.option`). A KeyError for a flag without one."""
    found = COMMAND_RANGES.get((command, flag)) or RANGES.get(flag)
    if found is None:
        from privgrad.mechanisms.registry import option_range

        found = option_range(flag)
    if found is None:
        raise KeyError(flag)
    return found


def check_numbers(command: str, values: dict[str, int | float | None]) -> None:
    """Refuses (one line) the first value of ``{flag: value}`` outside its range; None is unset."""
    for flag, value in values.items():
        if value is None:
            continue
        allowed = range_of(command, flag)
        if value not in allowed:
            what = "an integer" if isinstance(value, int) else "a finite number"
            rule = "" if allowed == ANY else " " + allowed.describe()
            raise PrivgradError(f"{flag} must be {what}{rule}, got {value}")


# the forward's and backward's precision (make_private(precision=), --precision): autocast's
# dtype, the private part staying fp32 (privgrad.per_sample.GradSampler)
PRECISIONS = ("fp32", "bf16", "fp16")


def validate_precision(value, name: str = "precision") -> None:
    if value not in PRECISIONS:
        raise PrivgradError(f"{name} must be one of {', '.join(PRECISIONS)}, got {value!r}")
