"""Noise schedules of RDP-ANT (Alg. 2, Eqs. 17-18) and its baselines (Eqs. 19-21).

A schedule gives σ_t for generator iteration t = 0, 1, ... and is advanced once per
iteration with that iteration's evaluation score S_{t+1} (None where none was taken).
The run stops when the paper's budget rule runs out (:class:`ClaimedBudget`), so the
number of iterations varies with the schedule, as in the paper's Tables IV-V.

* constant:  σ_t = σ_0                              (RDP-GAN, Alg. 1)
* time:      σ_t = σ_0 / (1 + k t)                  (Eq. 19)
* exp:       σ_t = σ_0 e^{-k t}                     (Eq. 20)
* step:      σ_t = σ_0 k^{⌊t / t*⌋}                 (Eq. 21, t* = 100; the floor is implied)
* ant:       σ_{t+1} = σ_t if S_{t+1} − S_ref ≥ τ else k σ_t   (Eq. 17), S_0 = 0, with
             S_ref = S_t, or with smoothing (Eq. 18, the default) the running mean
             S̄_t = (1/t) Σ_{i≤t} S_i (S̄_0 = S_0 = 0).

The ANT decisions read an evaluation score on generated samples (MNIST: a classifier
trained on the MNIST test split; Adult: one trained on the held-out adult.test). The
paper accounts for none of this (nor for its grid search over k); since RDP-ANT has no
DP guarantee to begin with, privgrad only records it.
"""

from __future__ import annotations

import math

from privgrad.errors import PrivgradError

SCHEDULES = ("constant", "ant", "time", "exp", "step")

# The decay rates of Tables IV (MNIST) and V (Adult).
PAPER_DECAY = {
    "mnist": {"time": 0.05, "step": 0.6, "exp": 0.01, "ant": 0.8},
    "adult": {"time": 0.04, "step": 0.5, "exp": 0.01, "ant": 0.7},
}


class NoiseSchedule:
    def __init__(
        self,
        kind: str,
        sigma0: float,
        decay: float | None = None,
        tau: float = 0.5,
        t_star: int = 100,
        smoothing: bool = True,
    ):
        if kind not in SCHEDULES:
            raise PrivgradError(f"unknown schedule '{kind}'; choose from: {', '.join(SCHEDULES)}")
        if not (sigma0 >= 0 and math.isfinite(sigma0)):
            raise PrivgradError(f"σ_0 must be ≥ 0, got {sigma0}")
        if kind != "constant":
            if decay is None:
                raise PrivgradError(f"the '{kind}' schedule needs a decay rate k")
            if kind in ("ant", "step") and not 0 < decay <= 1:
                raise PrivgradError(f"k must lie in (0, 1] for '{kind}', got {decay}")
            if kind in ("time", "exp") and not decay >= 0:
                raise PrivgradError(f"k must be ≥ 0 for '{kind}', got {decay}")
        if t_star < 1:
            raise PrivgradError(f"t* must be ≥ 1, got {t_star}")
        self.kind, self.sigma0, self.decay = kind, float(sigma0), decay
        self.tau, self.t_star, self.smoothing = tau, t_star, smoothing
        self.t = 0
        self._ant_sigma = float(sigma0)
        self.scores: list[float] = []  # S_1, S_2, ...
        self.decisions: list[bool] = []  # ANT: True where σ was decayed

    @property
    def needs_scores(self) -> bool:
        return self.kind == "ant"

    @property
    def sigma(self) -> float:
        """σ_t for the current iteration t."""
        t, s0, k = self.t, self.sigma0, self.decay
        if self.kind == "constant":
            return s0
        if self.kind == "time":
            return s0 / (1 + k * t)
        if self.kind == "exp":
            return s0 * math.exp(-k * t)
        if self.kind == "step":
            return s0 * k ** (t // self.t_star)
        return self._ant_sigma

    def reference_score(self) -> float:
        """S_t (Eq. 17) or S̄_t (Eq. 18); 0 before the first score (S_0 = 0)."""
        if not self.scores:
            return 0.0
        return sum(self.scores) / len(self.scores) if self.smoothing else self.scores[-1]

    def advance(self, score: float | None = None) -> None:
        """Close iteration t with its score S_{t+1}; σ_{t+1} becomes current."""
        if self.kind == "ant":
            if score is None:
                raise PrivgradError("RDP-ANT needs an evaluation score after every generator step")
            decay = score - self.reference_score() < self.tau
            if decay:
                self._ant_sigma *= self.decay
            self.decisions.append(decay)
        if score is not None:
            self.scores.append(float(score))
        self.t += 1


class ClaimedBudget:
    """The paper's budget rule: spend ε_g(σ_t) per G-iteration (Thm 3), stop when the next
    iteration would exceed ε_total (Thm 4). ``total=None``: no budget (fixed n_g)."""

    def __init__(self, total: float | None, rel_tol: float = 1e-9):
        self.total, self.spent, self.rel_tol = total, 0.0, rel_tol

    def affords(self, cost: float) -> bool:
        return self.total is None or self.spent + cost <= self.total * (1 + self.rel_tol)

    def spend(self, cost: float) -> None:
        self.spent += cost

    @property
    def remaining(self) -> float | None:
        return None if self.total is None else max(0.0, self.total - self.spent)


def iterations_within_budget(
    schedule: NoiseSchedule, cost, budget: float, max_iterations: int, scores=None
) -> int:
    """How many iterations a schedule runs before the budget rule stops it (no training).

    ``cost(σ)`` is the per-iteration ε_g; ``scores(t)`` supplies S_{t+1} for ANT.
    """
    b = ClaimedBudget(budget)
    n = 0
    while n < max_iterations and b.affords(cost(schedule.sigma)):
        b.spend(cost(schedule.sigma))
        schedule.advance(None if scores is None else scores(n))
        n += 1
    return n
