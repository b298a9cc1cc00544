"""Pure ε-DP steps (e.g. GIP's private index selection) composed with Gaussian steps.

A pure ε-DP release is recorded as a dp-accounting ``RandomizedResponseDpEvent`` with
two buckets and noise parameter p = 2/(1+e^ε): binary randomized response with the same
ε is a dominating pair for *every* ε-DP mechanism (Kairouz et al. 2015), under any
neighbouring relation, so composing its privacy-loss distribution is exact worst-case
composition. dp-accounting's accountants refuse RR events under add/remove (they model
RR's own replace-one input), so this module composes them itself:

* **basic** (the paper's Thm 2): ε(δ) of the other events + Σ ε of the pure events;
* **tight**: the PLD (or RDP) of the other events composed with the binary-RR PLD
  (``from_randomized_response``, symmetric) / RDP of every pure event;
* **best** (honest ε): the smaller of the two, both being valid upper bounds. The PLD
  grid rounds a tiny per-step ε up to one grid step, so for many very cheap pure steps
  basic composition is the smaller one.

Why composition is valid although the mask and the noisy values use the *same* Poisson
batch: the Mallows bound (GIP Thm 1, s₁ = the diameter of S_k) holds between *any* two
batches, so (i) conditioned on the Gaussian output the index selection is still ε-DP,
and (ii) when the mask is drawn first (prune-then-clip) the step is the Poisson
subsample of a batch mechanism dominated by RR(ε) ⊗ N(·, σ²); its subsampled pair
(qP + (1−q)Q, Q) is a post-processing of the pair (RR⁺ ⊗ (qN₁+(1−q)N₀), RR⁻ ⊗ N₀) by the
kernel that keeps the RR bit with probability w(y) = qN₁(y)/(qN₁(y)+(1−q)N₀(y)) and
redraws it from RR⁻ otherwise. Either way the product of the subsampled-Gaussian and RR
pairs dominates the step. No subsampling amplification is credited to the index part.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon as rdp_to_epsilon

from privgrad.errors import PrivgradError
from privgrad.accounting.ledger import (
    RDP_ORDERS,
    NeighborRel,
    _subsampled_gaussian_pld,
    calibrate_noise_multiplier,
    epsilon_of,
    poisson_gaussian_event,
    validate_delta,
    validate_epsilon,
)

METHODS = ("best", "basic", "tight")
PLD_INTERVAL = 1e-4  # the ledger's default grid, so that calibration and reporting agree


def pure_dp_event(epsilon: float) -> dp_event.DpEvent:
    """The event of one pure ε-DP release: binary RR with p = 2/(1+e^ε).

    p is rounded down by one ulp so that the RR actually analysed is never *more*
    private than ε (its ε is at most ~2e-16 larger). ε = 0 is a no-op.
    """
    if not (epsilon >= 0) or math.isinf(epsilon):
        raise PrivgradError(f"a pure-DP ε must be finite and ≥ 0, got {epsilon}")
    if epsilon == 0:
        return dp_event.NoOpDpEvent()
    e = math.exp(-epsilon)  # p = 2e^{−ε}/(1+e^{−ε}): no overflow; p = 0 (ε = ∞) past ~745
    p = math.nextafter(2.0 * e / (1.0 + e), 0.0)
    return dp_event.RandomizedResponseDpEvent(noise_parameter=p, num_buckets=2)


def pure_epsilon(event: dp_event.DpEvent) -> float | None:
    """ε of a binary-RR event (the ε for which it is pure DP), else ``None``."""
    if isinstance(event, dp_event.RandomizedResponseDpEvent) and event.num_buckets == 2:
        p = event.noise_parameter
        if p <= 0:
            return math.inf
        return math.log1p(2.0 * (1.0 - p) / p)  # log((1 − p/2) / (p/2))
    return None


def split_pure(entries) -> tuple[list[tuple[dp_event.DpEvent, int]], list[tuple[float, int]]]:
    """(other events, pure ε's) of a list of (event, count), with equal events merged.

    Composed and self-composed events are flattened; merging makes the composition (and
    its rounding) independent of how the ledger happened to group the steps.
    """
    others: dict = {}
    pure: dict = {}

    def walk(event, count):
        if count <= 0 or isinstance(event, dp_event.NoOpDpEvent):
            return
        if isinstance(event, dp_event.ComposedDpEvent):
            for e in event.events:
                walk(e, count)
        elif isinstance(event, dp_event.SelfComposedDpEvent):
            walk(event.event, count * event.count)
        elif (eps := pure_epsilon(event)) is not None:
            pure[eps] = pure.get(eps, 0) + count
        else:
            others[event] = others.get(event, 0) + count

    for event, count in entries:
        walk(event, count)
    return list(others.items()), sorted(pure.items())


def basic_composition(
    entries, delta: float, accountant: str = "pld", pld_interval: float = PLD_INTERVAL
) -> float:
    """ε(δ) of the non-pure events + Σ count·ε of the pure ones (GIP Thm 2)."""
    others, pure = split_pure(entries)
    return epsilon_of(others, delta, accountant, pld_interval) + math.fsum(e * n for e, n in pure)


def _gaussian_pld(event, count: int, interval: float):
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
        event.event, dp_event.GaussianDpEvent
    ):
        q, sigma = event.sampling_probability, event.event.noise_multiplier
        if q == 0:
            return None
        return _subsampled_gaussian_pld(
            sigma, q, interval, NeighborRel.ADD_OR_REMOVE_ONE
        ).self_compose(count)
    if isinstance(event, dp_event.GaussianDpEvent):
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier / math.sqrt(count),
            value_discretization_interval=interval,
            neighboring_relation=NeighborRel.ADD_OR_REMOVE_ONE,
        )
    raise NotImplementedError(type(event).__name__)


def rr_rdp(epsilon: float, orders) -> np.ndarray:
    """RDP of binary RR with parameter ε (the tight RDP of any ε-DP mechanism):
    (1/(α−1))·log((a^α b^{1−α} + b^α a^{1−α})), a = e^ε/(1+e^ε), b = 1/(1+e^ε).

    Written as log1p(f)/(α−1) with f = expm1((α−1)ε)·expm1(αε)·e^{(1−α)ε}/(1+e^ε), in logs:
    no cancellation, so tiny ε (GIP's ~1e-9 per step) keeps full relative precision.
    """
    a = np.asarray(orders, dtype=np.float64)
    if epsilon == 0:
        return np.zeros_like(a)

    def log_expm1(y):  # log(e^y − 1) for y > 0, stable for tiny and huge y
        return y + np.log(-np.expm1(-y))

    log_f = (
        log_expm1((a - 1) * epsilon)
        + log_expm1(a * epsilon)
        + (1 - a) * epsilon
        - np.logaddexp(0.0, epsilon)
    )
    return np.logaddexp(0.0, log_f) / (a - 1)


def tight_composition(
    entries, delta: float, accountant: str = "pld", pld_interval: float = PLD_INTERVAL
) -> float:
    """ε(δ) of the exact composition of the events with one binary RR per pure step.

    PLD handles (Poisson-sampled) Gaussian events; other non-pure events make it return
    ``math.inf`` (then basic composition is used). RDP adds the RR RDP to the
    accountant's RDP curve.
    """
    validate_delta(delta)
    others, pure = split_pure(entries)
    if any(isinstance(e, dp_event.NonPrivateDpEvent) for e, _ in others) or any(
        math.isinf(e) for e, _ in pure
    ):
        return math.inf
    if accountant == "pld":
        pld = None
        try:
            parts = [_gaussian_pld(e, n, pld_interval) for e, n in others]
        except NotImplementedError:
            return math.inf
        parts += [
            pld_lib.from_randomized_response(
                pure_dp_event(e).noise_parameter, 2, value_discretization_interval=pld_interval
            ).self_compose(n)
            for e, n in pure
        ]
        for part in parts:
            if part is not None:
                pld = part if pld is None else pld.compose(part)
        return 0.0 if pld is None else max(0.0, float(pld.get_epsilon_for_delta(delta)))
    if accountant == "rdp":
        acc = RdpAccountant(orders=RDP_ORDERS)
        composed = dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(e, n) for e, n in others])
        if not acc.supports(composed):
            return math.inf
        rdp = np.asarray(acc.compose(composed).rdp, dtype=np.float64)
        for e, n in pure:
            rdp = rdp + n * rr_rdp(e, RDP_ORDERS)
        if not rdp.any():
            return 0.0
        return max(0.0, float(rdp_to_epsilon(RDP_ORDERS, rdp, delta)[0]))
    raise PrivgradError(f"unknown accountant '{accountant}'")


def composed_epsilon(
    entries,
    delta: float,
    accountant: str = "pld",
    method: str = "best",
    pld_interval: float = PLD_INTERVAL,
) -> float:
    """ε(δ) of a run's (event, count) entries, pure-DP events included.

    ``method``: 'basic' (paper's Thm 2), 'tight' or 'best' = min(basic, tight). Without
    pure events all three equal the accountant's ε (``epsilon_of``).
    """
    if method not in METHODS:
        raise PrivgradError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
    entries = [tuple(x) for x in entries]
    if not split_pure(entries)[1]:
        method = "any"  # the three methods are one computation
    key = (_events_key(entries), repr(delta), accountant, method, repr(pld_interval))
    return _remembered(
        _EPSILONS, key, lambda: _composed_epsilon(entries, delta, accountant, method, pld_interval)
    )


# composed_epsilon and calibrate_with_pure_dp are functions of their arguments' values alone,
# and are asked the same question more than once: a training run asks for the same ε several
# times (the last epoch's, the run record's, the claimed ε where the claimed ledger is the
# honest one), and a grid calibrates σ for every cell of one ε, q and step count (each
# calibration builds a dozen one-step PLDs at about half a second each). So the last 256
# answers of each are kept. The key is the exact value (repr: every float to the bit, every
# event with its class), so a kept answer is the very bits a fresh one would be; errors are
# not kept.
_EPSILONS: dict = {}
_CALIBRATIONS: dict = {}


def _events_key(entries) -> tuple:
    return tuple((repr(e), repr(n)) for e, n in entries)


def _remembered(cache: dict, key, compute):
    if key not in cache:
        value = compute()
        if len(cache) >= 256:
            cache.pop(next(iter(cache)), None)
        cache[key] = value
    return cache[key]


def _composed_epsilon(entries, delta, accountant, method, pld_interval) -> float:
    if method == "any":
        return epsilon_of(entries, delta, accountant, pld_interval)
    if method == "basic":
        return basic_composition(entries, delta, accountant, pld_interval)
    tight = tight_composition(entries, delta, accountant, pld_interval)
    if method == "tight":
        return tight
    return min(basic_composition(entries, delta, accountant, pld_interval), tight)


def pure_total(events) -> float:
    """Σ count·ε over the pure events of a list of (event, count)."""
    return math.fsum(e * n for e, n in split_pure(events)[1])


def calibrate_with_pure_dp(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    pure_events,
    method: str = "best",
) -> float:
    """Smallest effective σ (to ~0.1 %) with composed ε ≤ target, given σ-independent pure
    events (list of (event, count)) that the run will add to ``steps`` Gaussian steps.

    'basic' is the paper's recipe (σ for ε − Σε_pure, i.e. 0.99ε at a 1 % index budget);
    'best' then lowers σ while the tight composition still meets the target.
    """
    pure_events = [tuple(x) for x in pure_events]
    key = tuple(map(repr, (target_epsilon, delta, sampling_rate, steps, method)))
    return _remembered(
        _CALIBRATIONS,
        key + _events_key(pure_events),
        lambda: _calibrate_with_pure_dp(
            target_epsilon, delta, sampling_rate, steps, pure_events, method
        ),
    )


def _calibrate_with_pure_dp(target_epsilon, delta, sampling_rate, steps, pure_events, method):
    validate_epsilon(target_epsilon)
    spent = pure_total(pure_events)
    if spent >= target_epsilon:
        raise PrivgradError(
            f"the pure-DP steps alone spend ε = {spent:.4g} ≥ the target "
            f"{target_epsilon}; lower the index budget"
        )
    sigma = calibrate_noise_multiplier(
        (target_epsilon - spent) * (1 - 1e-9), delta, sampling_rate, steps
    )
    if method == "basic" or not spent:
        return sigma
    if method != "best":
        raise PrivgradError(f"calibration method must be 'basic' or 'best', got '{method}'")

    def tight(s):
        return tight_composition(
            [(poisson_gaussian_event(sampling_rate, s), steps)] + list(pure_events), delta, "pld"
        )

    good, e_good = sigma, tight(sigma)
    if e_good >= target_epsilon * 0.999:  # the tight bound gains (almost) nothing here
        return sigma
    # ε ≈ c/σ locally: regula falsi between a feasible and an infeasible σ, few PLD calls.
    bad = None
    guess = sigma * e_good / target_epsilon
    for _ in range(6):
        e = tight(guess)
        if e <= target_epsilon:
            good, e_good = guess, e
        else:
            bad, e_bad = guess, e
        if bad is None:
            guess = good * e_good / target_epsilon * 0.999
            continue
        if good - bad < 1e-3 * good:
            break
        w = (target_epsilon - e_good) / (e_bad - e_good)
        guess = min(
            max(good + w * (bad - good), bad + 1e-4 * (good - bad)), good - 1e-4 * (good - bad)
        )
    return good


__all__ = [
    "pure_dp_event",
    "pure_epsilon",
    "split_pure",
    "basic_composition",
    "tight_composition",
    "composed_epsilon",
    "pure_total",
    "calibrate_with_pure_dp",
    "rr_rdp",
]
