"""Guidance before a private run: how loud its noise is against its signal, and a default
expected batch for small training sets. Pure Python (no torch), so the CLI's defaults can use it.

**The measure.** ``r = σ·√d / B``: σ the effective noise multiplier, d the number of trained
parameters, B the expected (Poisson) batch. One DP-SGD update averages B clipped per-example
gradients, each of norm ≤ C, and adds N(0, σ²C²·I_d)/B; the noise's expected norm is
σC√d/B (√d is its norm's scale in d dimensions), the signal's norm is at most C (reached when
the clipped gradients agree). So r is the noise's norm in units of the largest possible signal:
r ≥ 1 means no update can be mostly signal, whatever the data. It is known before training
(σ is calibrated from q, steps and ε), it is unit-free (C cancels), and it names the levers:
a larger B lowers it directly, fewer steps lower σ. It is a per-step measure: it ignores that
noise averages out over steps, which is why its threshold is read from runs, not set to 1.

**The threshold and the rule** come from ``results/small_data/`` (made by
``experiments/scripts/small_data.py``: ImageFolders of 1,000–5,000 MNIST images, DP-SGD,
the cnn model, ε = 1, a grid of expected batch × epochs, 3 seeds, chosen on validation
accuracy); its README has the table and the reasoning, summarised in :data:`THRESHOLD_TEXT`
and :data:`RULE_TEXT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# above this many training examples, today's rule (expected batch = 1/40 of them) stays
SMALL_DATA_BELOW = 10_000
LARGE_DATA_FRACTION = 1 / 40

# Warn above this r. In results/small_data no plan with a larger r reached 50 % mean
# validation accuracy (chance is 10 %); the constant is the largest r at which a plan did,
# rounded up to 0.1 (tests/app/test_guidance.py checks it against the records).
NOISE_TO_SIGNAL_WARN = 2.8

# Small training sets: expected batch B = BATCH_PER_EPOCH × epochs, i.e. a run of about n/40
# steps (steps ≈ epochs·n/B). In the table, the best expected batch at each (N, epochs) grew
# with the epochs and hardly with N: B/epochs of the best cells lay between ~30 and ~70, and
# 40 is their geometric mean rounded (tests/app/test_guidance.py checks it against the
# records). Kept within [n/40, MAX_SMALL_FRACTION·n] (the largest fraction measured).
BATCH_PER_EPOCH = 40
MAX_SMALL_FRACTION = 0.8

# Below this many steps a plan is warned too (a second failure the table shows: with few
# steps the model barely moves, whatever r): every cell with r ≤ NOISE_TO_SIGNAL_WARN and at
# least MIN_STEPS steps reached 50 % mean validation accuracy (tests/app/test_guidance.py).
MIN_STEPS = 20

THRESHOLD_TEXT = (
    f"Warn when r > {NOISE_TO_SIGNAL_WARN:g}: the largest r (rounded up to 0.1) at which any "
    "cell of the table reached 50 % mean validation accuracy (chance: 10 %); no cell above it "
    f"did. Below it, cells failed only with few steps: every cell with at least {MIN_STEPS} "
    "steps reached 50 %, so a plan with fewer is warned too."
)
RULE_TEXT = (
    f"For fewer than {SMALL_DATA_BELOW:,} training examples, the default expected batch is "
    f"B = {BATCH_PER_EPOCH} × epochs (a run of about n/40 steps), kept within "
    f"[n/40, {MAX_SMALL_FRACTION:g}·n] (privgrad.app.guidance.small_data_batch_size); from "
    f"{SMALL_DATA_BELOW:,} on, n/40 as today. Epochs stay as given (privgrad's default 20)."
)


def noise_to_signal(sigma: float, batch_size: float, parameters: int) -> float:
    """r = σ·√d / B: the expected norm of the noise in one averaged update against the
    largest norm of its signal (the clip norm C, which cancels)."""
    if batch_size <= 0 or parameters <= 0 or sigma < 0:
        raise ValueError(f"need σ ≥ 0, B > 0, d > 0; got σ={sigma}, B={batch_size}, d={parameters}")
    return sigma * math.sqrt(parameters) / batch_size


def small_data_batch_size(train_size: int, epochs: float) -> float:
    """The default expected batch for ``train_size`` training examples and ``epochs``: n/40
    from SMALL_DATA_BELOW on (today's rule); below it BATCH_PER_EPOCH·epochs (a run of about
    n/40 steps), kept within [n/40, MAX_SMALL_FRACTION·n], at least 1."""
    n = train_size
    low = n * LARGE_DATA_FRACTION
    if n >= SMALL_DATA_BELOW:
        return max(1.0, low)
    return max(1.0, min(max(BATCH_PER_EPOCH * epochs, low), MAX_SMALL_FRACTION * n))


@dataclass(frozen=True)
class Guidance:
    ratio: float  # r = σ√d/B
    statement: str  # one line, always printed before training
    warning: str | None  # one line when the plan is predicted to fail, else None


def plan_guidance(
    sigma: float,
    batch_size: float,
    parameters: int,
    train_size: int,
    steps: int,
    epsilon: float | None,
    epochs: float,
) -> Guidance:
    """The statement of a planned run's noise-to-signal and, when the noise is predicted to
    swamp the update (r > NOISE_TO_SIGNAL_WARN) or the plan has fewer than MIN_STEPS steps,
    a warning naming the options to change (``--batch-size`` from
    :func:`small_data_batch_size`, and the other levers where that batch alone would leave r
    over the threshold; ``--epochs``)."""
    r = noise_to_signal(sigma, batch_size, parameters)
    eps = "∞" if epsilon is None else f"{epsilon:g}"
    statement = (
        f"noise-to-signal r = σ·√d/B = {sigma:.3g}·√{parameters:,}/{batch_size:g} = {r:.2f} "
        f"(noise norm per update against the clip norm; ε = {eps}, {steps} steps, "
        f"{train_size:,} examples; above {NOISE_TO_SIGNAL_WARN:g} the noise swamps the update)"
    )
    if r > NOISE_TO_SIGNAL_WARN:
        suggested = small_data_batch_size(train_size, epochs)
        levers = (
            f"fewer --epochs, a larger --epsilon, more data or fewer trained parameters "
            f"(d = {parameters:,}) lower it"
        )
        if suggested > batch_size * 1.01:
            fix = f"try --batch-size {suggested:g} (the small-data rule, results/small_data/)"
            at_rule = r * batch_size / suggested  # σ fixed; recalibrated, σ grows with B
            if at_rule > NOISE_TO_SIGNAL_WARN:  # the batch alone cannot bring r under
                fix += f", which alone leaves r above {at_rule:.1f}; {levers}"
        else:
            fix = levers
        warning = (
            f"warning: r = {r:.2f} > {NOISE_TO_SIGNAL_WARN:g}: the noise is predicted to swamp "
            f"the update (in results/small_data no such run reached 50 % accuracy); {fix}"
        )
        return Guidance(r, statement, warning)
    if steps < MIN_STEPS:
        fix = (
            f"try --epochs {math.ceil(epochs * MIN_STEPS / steps):g}"
            if steps > 0
            else "more --epochs or a smaller --batch-size"
        )
        warning = (
            f"warning: only {steps} steps (< {MIN_STEPS}): the model will barely move (in "
            f"results/small_data such runs often stayed below 50 % accuracy); {fix}"
        )
        return Guidance(r, statement, warning)
    return Guidance(r, statement, None)
