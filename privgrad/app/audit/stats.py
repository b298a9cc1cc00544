"""Statistics of the audits: confidence intervals, ε lower bounds, attack metrics.

Everything here is plain numpy/scipy on scores, so it can be tested on simulated
mechanisms whose ε is known exactly.

Two-point lower bound (Jagielski et al. 2020; Nasr et al. 2021). If a mechanism M is
(ε, δ)-DP for neighbours D0, D1, every set S of outputs satisfies

    P[M(D1) ∈ S] ≤ e^ε P[M(D0) ∈ S] + δ   and   P[M(D0) ∈ S] ≤ e^ε P[M(D1) ∈ S] + δ.

With S = {t ≥ τ} (TPR = P[t ≥ τ | D1], FPR = P[t ≥ τ | D0]), the first gives
ε ≥ log((TPR − δ)/FPR) and the second, applied to the complement, gives
ε ≥ log((1 − FPR − δ)/(1 − TPR)). Both right-hand sides grow with TPR and shrink with
FPR, so replacing TPR by a one-sided Clopper–Pearson lower bound and FPR by an upper
bound, each at level α/2, gives a bound that holds with probability ≥ 1 − α (union
bound) for both forms at once. The threshold τ is chosen on trials that are not used to
evaluate it, so the search over τ costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, stats

from privgrad.errors import PrivgradError


# ---------------------------------------------------------------------------------------
# Clopper–Pearson
# ---------------------------------------------------------------------------------------


def clopper_pearson(k, n, alpha: float = 0.05, side: str = "two-sided"):
    """Exact binomial confidence bounds (lo, hi) for k successes in n trials.

    ``side='two-sided'``: P[p ∉ [lo, hi]] ≤ α, each tail α/2.
    ``side='lower'``: P[p < lo] ≤ α (hi = 1). ``side='upper'``: P[p > hi] ≤ α (lo = 0).
    Vectorised over k (and n).
    """
    if not 0 < alpha < 1:
        raise PrivgradError(f"α must lie in (0, 1), got {alpha}")
    k, n = np.broadcast_arrays(np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64))
    if np.any(k < 0) or np.any(k > n):
        raise PrivgradError("Clopper–Pearson needs 0 ≤ k ≤ n")
    a_lo, a_hi = {
        "two-sided": (alpha / 2, alpha / 2),
        "lower": (alpha, None),
        "upper": (None, alpha),
    }.get(side, (0, 0))
    if a_lo == 0:
        raise PrivgradError(f"side must be 'two-sided', 'lower' or 'upper', got '{side}'")
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.zeros_like(k)
        hi = np.ones_like(k)
        if a_lo is not None:
            pos = k > 0
            lo = np.where(pos, stats.beta.ppf(a_lo, np.where(pos, k, 1), n - k + 1), 0.0)
        if a_hi is not None:
            below = k < n
            hi = np.where(below, stats.beta.ppf(1 - a_hi, k + 1, np.where(below, n - k, 1)), 1.0)
    if lo.ndim == 0:
        return float(lo), float(hi)
    return lo, hi


# ---------------------------------------------------------------------------------------
# Two-point (canary) lower bound
# ---------------------------------------------------------------------------------------


def epsilon_from_rates(tpr_lo, fpr_hi, delta: float):
    """max(0, log((TPR − δ)/FPR), log((1 − FPR − δ)/(1 − TPR))) at TPR = tpr_lo, FPR = fpr_hi.

    With tpr_lo a lower and fpr_hi an upper confidence bound this is a lower confidence
    bound on the ε of any (ε, δ)-DP mechanism (see the module docstring).
    """
    tpr_lo, fpr_hi = np.asarray(tpr_lo, np.float64), np.asarray(fpr_hi, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(
            (tpr_lo - delta > 0) & (fpr_hi > 0), np.log((tpr_lo - delta) / fpr_hi), -np.inf
        )
        b = np.where(
            (1 - fpr_hi - delta > 0) & (tpr_lo < 1),
            np.log((1 - fpr_hi - delta) / (1 - tpr_lo)),
            -np.inf,
        )
    out = np.maximum(0.0, np.maximum(a, b))
    return float(out) if out.ndim == 0 else out


@dataclass
class TwoPointBound:
    """The result of :func:`epsilon_lower_bound` (all counts are on the evaluation trials)."""

    epsilon_lower_bound: float
    confidence: float
    threshold: float
    direction: int  # +1: "D1" when t ≥ τ; −1: "D1" when t ≤ τ
    true_positives: int
    false_positives: int
    n_eval: int  # evaluation trials per side
    n_select: int  # threshold-selection trials per side
    tpr: float
    fpr: float
    tpr_lower: float
    fpr_upper: float
    delta: float

    def as_dict(self) -> dict:
        return asdict(self)


def _threshold_candidates(s0: np.ndarray, s1: np.ndarray, max_candidates: int) -> np.ndarray:
    pooled = np.unique(np.concatenate([s0, s1]))
    if len(pooled) <= max_candidates:
        return pooled
    # the best thresholds lie in the tails: geometric ranks from both ends, plus a linear grid
    n = len(pooled)
    geo = np.unique(np.geomspace(1, n, max_candidates // 3).astype(np.int64)) - 1
    lin = np.linspace(0, n - 1, max_candidates // 3).astype(np.int64)
    return pooled[np.unique(np.concatenate([geo, n - 1 - geo, lin]))]


def _counts_at_least(sorted_scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    return len(sorted_scores) - np.searchsorted(sorted_scores, thresholds, side="left")


def _bound_at(k1, k0, n1, n0, delta, alpha):
    tpr_lo, _ = clopper_pearson(k1, n1, alpha / 2, "lower")
    _, fpr_hi = clopper_pearson(k0, n0, alpha / 2, "upper")
    return epsilon_from_rates(tpr_lo, fpr_hi, delta), tpr_lo, fpr_hi


def epsilon_lower_bound(
    scores0,
    scores1,
    delta: float,
    alpha: float = 0.05,
    selection_fraction: float = 0.5,
    max_candidates: int = 3000,
) -> TwoPointBound:
    """A (1 − α)-confidence lower bound on ε from i.i.d. trial scores under D0 and D1.

    The first ``selection_fraction`` of each side's trials chooses the threshold and the
    direction of the test (maximising the same bound computed on them); the remaining
    trials evaluate it: TPR and FPR get one-sided Clopper–Pearson bounds at α/2 each and
    :func:`epsilon_from_rates` turns them into ε. Trials must be i.i.d. and in the order
    they were drawn (the split is by position).
    """
    if not 0 < delta < 1:
        raise PrivgradError(f"δ must lie in (0, 1), got {delta}")
    if not 0 < selection_fraction < 1:
        raise PrivgradError(f"the selection fraction must lie in (0, 1), got {selection_fraction}")
    s0 = np.asarray(scores0, dtype=np.float64).ravel()
    s1 = np.asarray(scores1, dtype=np.float64).ravel()
    if not (np.isfinite(s0).all() and np.isfinite(s1).all()):
        raise PrivgradError("audit scores must be finite")
    k0_sel, k1_sel = int(len(s0) * selection_fraction), int(len(s1) * selection_fraction)
    if min(k0_sel, k1_sel, len(s0) - k0_sel, len(s1) - k1_sel) < 1:
        raise PrivgradError("too few trials to split into selection and evaluation sets")
    sel0, ev0 = s0[:k0_sel], s0[k0_sel:]
    sel1, ev1 = s1[:k1_sel], s1[k1_sel:]

    best = (-1.0, 0.0, 1)
    for direction in (1, -1):
        a0, a1 = np.sort(direction * sel0), np.sort(direction * sel1)
        cand = _threshold_candidates(a0, a1, max_candidates)
        eps, _, _ = _bound_at(
            _counts_at_least(a1, cand), _counts_at_least(a0, cand), len(a1), len(a0), delta, alpha
        )
        i = int(np.argmax(eps))
        if eps[i] > best[0]:
            best = (float(eps[i]), float(direction * cand[i]), direction)
    _, threshold, direction = best
    tp = int(np.sum(direction * ev1 >= direction * threshold))
    fp = int(np.sum(direction * ev0 >= direction * threshold))
    eps, tpr_lo, fpr_hi = _bound_at(tp, fp, len(ev1), len(ev0), delta, alpha)
    return TwoPointBound(
        float(eps),
        1 - alpha,
        threshold,
        direction,
        tp,
        fp,
        len(ev0),
        k0_sel,
        tp / len(ev1),
        fp / len(ev0),
        float(tpr_lo),
        float(fpr_hi),
        delta,
    )


# ---------------------------------------------------------------------------------------
# Gaussian mechanism: exact ε and a (non-rigorous) μ estimate
# ---------------------------------------------------------------------------------------


def gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with μ = sensitivity/std (Balle & Wang 2018, Thm 8)."""
    if mu <= 0:
        return 0.0
    a = stats.norm.cdf(-epsilon / mu + mu / 2)
    b = math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2))
    return float(a - b)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε at δ of the Gaussian mechanism with μ = sensitivity/std (μ-GDP)."""
    if not 0 < delta < 1:
        raise PrivgradError(f"δ must lie in (0, 1), got {delta}")
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, mu) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-12))


def gaussian_mu_estimate(scores0, scores1) -> tuple[float, float]:
    """(μ̂, standard error): the mean shift of the scores in units of their pooled std.

    For a linear mechanism with Gaussian noise the canary statistic is exactly Gaussian,
    and μ̂ estimates sensitivity/std (1/σ_eff per step at q = 1). An estimate, not a
    bound: nothing here is guaranteed for other mechanisms.
    """
    s0 = np.asarray(scores0, np.float64)
    s1 = np.asarray(scores1, np.float64)
    sd = math.sqrt((s0.var(ddof=1) + s1.var(ddof=1)) / 2)
    shift = s1.mean() - s0.mean()
    if sd <= 1e-9 * abs(shift) or sd == 0:  # no noise (up to floating-point round-off)
        return (math.copysign(math.inf, shift) if shift != 0 else 0.0), 0.0
    mu = shift / sd
    n = min(len(s0), len(s1))
    return float(mu), float(math.sqrt(2 / n + mu * mu / (4 * n)))


MU_EXCESS_SE = 5  # standard errors by which μ̂ must pass the honest μ to count as a failure


def mu_exceeds(mu_hat: float, se: float, mu_honest: float | None) -> bool:
    """Whether the estimated shift μ̂ passes the honest μ (sensitivity / noise, composed) by
    more than :data:`MU_EXCESS_SE` standard errors, or the two sides never overlap (μ̂ = ∞,
    a release without noise): one example then moves the release more than the accounting
    assumes. Sound mechanisms' committed audits lie within 1 standard error of it or below."""
    if mu_honest is None or not math.isfinite(mu_honest):
        return False
    return mu_hat == math.inf or (se > 0 and mu_hat > mu_honest + MU_EXCESS_SE * se)


def subsampled_gaussian_statistic(steps_scores, shift: float, sampling_rate: float) -> np.ndarray:
    """Σ_t log(1 − q + q·exp(a·x_t − a²/2)) over the columns of ``steps_scores`` (trials ×
    steps, each column a step's score in units of its noise std, a = ``shift``): the
    log-likelihood ratio of T Poisson-sampled Gaussian steps (the canary in each step's batch
    with probability q, shift a when in), i.e. the Neyman–Pearson statistic for that release.
    At q = 1 it is a·Σ_t x_t − T·a²/2, an increasing function of the mean-shift sum."""
    x = np.asarray(steps_scores, np.float64)
    if sampling_rate >= 1:
        return (shift * x - shift * shift / 2).sum(-1)
    return np.logaddexp(
        math.log1p(-sampling_rate), math.log(sampling_rate) + shift * x - shift * shift / 2
    ).sum(-1)


def simulated_gaussian_bound(
    mu: float,
    sampling_rate: float,
    steps: int,
    trials: int,
    statistic: str,
    delta: float,
    alpha: float = 0.05,
    selection_fraction: float = 0.5,
    seed: int = 0,
) -> float:
    """The lower bound a canary audit with these trials, steps, q and statistic reaches on
    one simulated replicate of the ideal release it audits: T steps of a Poisson-sampled
    Gaussian mechanism whose canary shift is μ noise stds when in the batch (μ = 1/σ_eff
    for a canary clipped to C). Its power: a claimed ε is refutable by this audit only if
    the bound at the honest μ exceeds it; at the claimed μ it stays below the claim."""
    if statistic not in ("mean-shift", "likelihood-ratio"):
        raise PrivgradError(f"no simulated power for the '{statistic}' statistic")
    rng = np.random.default_rng(seed)
    sides = []
    for side in (0, 1):
        total = np.zeros(trials)
        for _ in range(steps):
            x = rng.standard_normal(trials)
            if side:
                x += mu * (rng.random(trials) < sampling_rate)
            if statistic == "mean-shift":
                total += x
            else:
                total += subsampled_gaussian_statistic(x[:, None], mu, sampling_rate)
        sides.append(total)
    return epsilon_lower_bound(
        sides[0], sides[1], delta, alpha, selection_fraction
    ).epsilon_lower_bound


# ---------------------------------------------------------------------------------------
# One-run audit (Steinke, Nasr & Jagielski 2023)
# ---------------------------------------------------------------------------------------


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Bound on P[≥ v of r guesses correct] for an (ε, δ)-DP mechanism (their Theorem 3).

    m canaries, each included independently with probability ½; the auditor guesses r of
    them (abstains on the rest) and v guesses are right. With p = e^ε/(1 + e^ε) and
    f(u) = P[Binomial(r, p) ≥ u]:

        P[V ≥ v] ≤ f(v) + 2mδ · max_{1 ≤ i ≤ v} (f(v − i) − f(v)) / i.
    """
    if not 0 <= v <= r <= m:
        raise PrivgradError(f"need 0 ≤ v ≤ r ≤ m, got v={v}, r={r}, m={m}")
    if v == 0:
        return 1.0
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))
    extra = 0.0
    if delta > 0:
        window = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))  # P[v-i ≤ B < v]
        extra = float(np.max(window / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * extra)


def one_run_epsilon(
    m: int,
    r: int,
    v: int,
    delta: float,
    alpha: float = 0.05,
    step: float = 0.05,
    max_epsilon: float = 50.0,
) -> float:
    """Lower confidence bound on ε from v correct of r guesses among m canaries.

    The largest ε such that the null "(ε', δ)-DP" is rejected at level α for every
    ε' ≤ ε: the first crossing of :func:`one_run_p_value` above α, found by a scan in
    steps of ``step`` and then bisection (the first crossing is valid even where the
    p-value is not monotone in ε). 0 when even ε = 0 is not rejected.
    """
    pv = lambda e: one_run_p_value(m, r, v, e, delta)  # noqa: E731
    if pv(0.0) > alpha:
        return 0.0
    lo = 0.0
    while lo < max_epsilon and pv(lo + step) <= alpha:
        lo += step
    if lo >= max_epsilon:
        return max_epsilon
    hi = lo + step
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pv(mid) <= alpha else (lo, mid)
    return lo


def default_guess_counts(m: int) -> list[int]:
    fractions = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
    counts = sorted({max(2, 2 * int(round(f * m / 2))) for f in fractions})
    return [c for c in counts if c <= m] or [m]


def one_run_bound_from_scores(
    scores, included, delta: float, alpha: float = 0.05, guess_counts: list[int] | None = None
) -> dict:
    """Guess, count and bound: the r highest scores are guessed "in", split evenly with the
    r lowest guessed "out" (r/2 each); the bound is taken at the best r of ``guess_counts``,
    each tested at level α/len(guess_counts) (Bonferroni, so the search is accounted)."""
    scores = np.asarray(scores, np.float64).ravel()
    included = np.asarray(included, bool).ravel()
    m = len(scores)
    if len(included) != m or m < 2:
        raise PrivgradError("one score and one inclusion bit per canary (at least 2) are needed")
    guess_counts = guess_counts or default_guess_counts(m)
    level = alpha / len(guess_counts)
    order = np.argsort(scores, kind="stable")
    best = None
    for r in guess_counts:
        k_in, k_out = r - r // 2, r // 2
        v = int(included[order[m - k_in :]].sum()) + int((~included[order[:k_out]]).sum())
        eps = one_run_epsilon(m, r, v, delta, level)
        if best is None or eps > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": eps, "guesses": r, "correct": v}
    best.update(canaries=m, confidence=1 - alpha, bonferroni_over=guess_counts, delta=delta)
    return best


# ---------------------------------------------------------------------------------------
# Membership-inference metrics
# ---------------------------------------------------------------------------------------


def auc(member_scores, nonmember_scores) -> float:
    """Area under the ROC curve (Mann–Whitney U / (n1·n0); ties count ½)."""
    s1 = np.asarray(member_scores, np.float64).ravel()
    s0 = np.asarray(nonmember_scores, np.float64).ravel()
    if len(s1) == 0 or len(s0) == 0:
        raise PrivgradError("AUC needs members and non-members")
    ranks = stats.rankdata(np.concatenate([s1, s0]))
    return float((ranks[: len(s1)].sum() - len(s1) * (len(s1) + 1) / 2) / (len(s1) * len(s0)))


def auc_standard_error(n1: int, n0: int, value: float = 0.5) -> float:
    """Hanley & McNeil (1982) standard error of the AUC (value 0.5: the null's)."""
    q1, q2 = value / (2 - value), 2 * value * value / (1 + value)
    var = (value * (1 - value) + (n1 - 1) * (q1 - value**2) + (n0 - 1) * (q2 - value**2)) / (
        n1 * n0
    )
    return float(math.sqrt(max(var, 0.0)))


def tpr_at_fpr(member_scores, nonmember_scores, fpr: float) -> float:
    """Largest TPR of a rule "member if score > τ" whose empirical FPR is ≤ ``fpr``."""
    s1 = np.asarray(member_scores, np.float64).ravel()
    s0 = np.sort(np.asarray(nonmember_scores, np.float64).ravel())[::-1]
    k = int(math.floor(fpr * len(s0) + 1e-9))  # false positives allowed
    tau = -np.inf if k >= len(s0) else s0[k]
    return float(np.mean(s1 > tau))
