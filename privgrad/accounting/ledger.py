"""Privacy events in, ε out: a thin, tested layer over dp-accounting.

Mechanisms describe each noisy step as a dp-accounting ``DpEvent`` (the sampler wraps
the noise event in ``PoissonSampledDpEvent``). A :class:`PrivacyLedger` keeps the run's
events and turns them into ε with the PLD accountant (tightest, the default) or RDP.
The ledger never needs to know which paper a noise stage came from.
"""

from __future__ import annotations

import functools
import logging
import math

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.pld import PLDAccountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import RdpAccountant

from privgrad.errors import PrivgradError

# dp-accounting logs a warning each time its series for a fractional RDP order does not
# converge; it then drops that order, which only makes ε larger (still valid).
logging.getLogger("absl").setLevel(logging.ERROR)

ACCOUNTANTS = ("pld", "rdp")
# The PLD accountant holds each composed privacy-loss distribution as a dense float64 grid
# (and its FFT needs a few more of that size). Its length grows as 1/σ² for one step and,
# composed over many steps at a large sampling rate, with the steps: a tiny σ or a long
# full-batch horizon would take tens of GB and hours. Above this many grid points the
# ledger refuses (one line) instead of starting; 3·10^7 points are 0.24 GB per grid (the
# accountant peaks near 2.5 GB) and about half a minute. A refusal never turns into a smaller
# ε: no ε is returned at all.
MAX_PLD_POINTS = 3 * 10**7
# RDP orders: Opacus' grid (1.1 … 63) extended to 256, so RDP ε is never worse than Opacus'.
RDP_ORDERS = sorted(set([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 257))))


def gaussian_event(noise_multiplier: float) -> dp_event.DpEvent:
    """One Gaussian release with sensitivity 1 and std ``noise_multiplier``."""
    if noise_multiplier <= 0 or not math.isfinite(noise_multiplier):
        return dp_event.NonPrivateDpEvent()
    return dp_event.GaussianDpEvent(noise_multiplier)


def poisson_gaussian_event(sampling_rate: float, noise_multiplier: float) -> dp_event.DpEvent:
    return dp_event.PoissonSampledDpEvent(sampling_rate, gaussian_event(noise_multiplier))


def _is_nonprivate(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.NonPrivateDpEvent):
        return True
    inner = [getattr(event, a) for a in ("event", "events") if hasattr(event, a)]
    for e in inner:
        if any(_is_nonprivate(x) for x in (e if isinstance(e, list) else [e])):
            return True
    return False


def _gaussian_points(sigma: float, sampling_rate: float, count: int, interval: float) -> float:
    """About how many grid points dp-accounting's PLD of ``count`` compositions of the
    (Poisson-subsampled, rate ``sampling_rate``) Gaussian mechanism of noise ``sigma`` takes
    at ``interval``. One step spans privacy losses of about 1/σ² + 20/σ (the ±10σ of noise
    it keeps); the composition's length is found by dp-accounting's own Chernoff bounds
    (``compute_self_convolve_bounds``, relative to the grid's length, so a coarse copy of
    the grid of about 2000 points gives it, scaled back)."""
    from dp_accounting.pld import common, privacy_loss_distribution

    single = (1 / sigma**2 + 20 / sigma) / interval
    if single > MAX_PLD_POINTS or single * count <= MAX_PLD_POINTS:
        return single * count if single <= MAX_PLD_POINTS else single  # at most count × one step
    scale = max(1.0, single / 2e3)
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=interval * scale, sampling_prob=sampling_rate
    )
    points = 0.0
    for pmf in (pld._pmf_remove, pld._pmf_add):  # noqa: SLF001 (dp-accounting keeps them private)
        probs = pmf.to_dense_pmf()._probs  # noqa: SLF001
        lower, upper = common.compute_self_convolve_bounds(probs, count, 1e-15)
        points = max(points, (upper - lower + 1) * scale)
    return points


def pld_points(event: dp_event.DpEvent, count: int, interval: float) -> float:
    """About how many grid points the PLD accountant needs for ``count`` compositions of
    ``event`` (its Gaussian parts; other events count 0)."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return pld_points(event.event, count * event.count, interval)
    if isinstance(event, dp_event.ComposedDpEvent):
        return sum(pld_points(e, count, interval) for e in event.events)
    if isinstance(event, dp_event.GaussianDpEvent) and event.noise_multiplier > 0:
        # composed in closed form: one Gaussian of noise σ/√count
        return _gaussian_points(event.noise_multiplier / math.sqrt(count), 1.0, 1, interval)
    if (
        isinstance(event, dp_event.PoissonSampledDpEvent)
        and isinstance(event.event, dp_event.GaussianDpEvent)
        and event.event.noise_multiplier > 0
        and event.sampling_probability > 0
    ):
        return _gaussian_points(
            event.event.noise_multiplier, event.sampling_probability, count, interval
        )
    return 0.0


class AccountingTooLarge(PrivgradError):
    """The PLD accountant would need more than MAX_PLD_POINTS grid points."""

    def __init__(self, message: str, points: float):
        super().__init__(message)
        self.points = points


def check_pld_size(events: list[tuple[dp_event.DpEvent, int]], interval: float = 1e-4) -> None:
    """Refuses (one line) a composition whose PLD grid would exceed MAX_PLD_POINTS."""
    points = sum(pld_points(e, n, interval) for e, n in events if n > 0)
    if points > MAX_PLD_POINTS:
        sigmas = sorted({s for e, _ in events for s in _noise_multipliers(e)})
        steps = sum(n for _, n in events)
        raise AccountingTooLarge(
            f"the PLD accountant would need about {points:.1e} grid points ({steps} "
            f"step{'s' * (steps != 1)}"
            + (f", σ = {sigmas[0]:g}" if sigmas else "")
            + f"), over its limit of {MAX_PLD_POINTS:.0e} "
            f"(about {8 * MAX_PLD_POINTS / 1e9:.2g} GB per grid): use a larger noise multiplier or "
            "fewer steps",
            points,
        )


def _noise_multipliers(event: dp_event.DpEvent) -> list[float]:
    if isinstance(event, dp_event.GaussianDpEvent):
        return [event.noise_multiplier]
    inner = [getattr(event, a) for a in ("event", "events") if hasattr(event, a)]
    return [
        s for e in inner for x in (e if isinstance(e, list) else [e]) for s in _noise_multipliers(x)
    ]


NeighborRel = privacy_accountant.NeighboringRelation


@functools.lru_cache(maxsize=4, typed=True)
def _subsampled_gaussian_pld(sigma: float, q: float, interval: float, relation: NeighborRel):
    """dp-accounting's PLD of *one* Poisson-subsampled Gaussian step, built once per exact
    (σ, q, interval, relation). Building it takes seconds (it inverts the privacy loss at
    every grid point), composing it takes milliseconds, and a run asks for ε every epoch
    with the same one-step PLD: the cache makes that one build per run. PLD objects are
    never modified (compose and self_compose return new ones), so a cached one gives the
    very bits a fresh one would. Four are kept (a run has one or two kinds of step, its
    honest and claimed σ): one step's grid can take megabytes at a small σ."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=interval,
        sampling_prob=q,
        neighboring_relation=relation,
    )


class CachedPLDAccountant(PLDAccountant):
    """dp-accounting's ``PLDAccountant`` with the one-step PLD of a Poisson-subsampled
    Gaussian taken from :func:`_subsampled_gaussian_pld`: the same calls in the same order,
    so the same ε to the bit; every other event goes to the parent class unchanged."""

    def _maybe_compose(self, event, count, do_compose):
        if (
            do_compose
            and isinstance(event, dp_event.PoissonSampledDpEvent)
            and isinstance(event.event, dp_event.GaussianDpEvent)
            and event.sampling_probability != 0
            and event.event.noise_multiplier != 0
        ):
            one_step = _subsampled_gaussian_pld(
                event.event.noise_multiplier,
                event.sampling_probability,
                self._value_discretization_interval,
                self.neighboring_relation,
            )
            self._pld = self._pld.compose(one_step.self_compose(count))
            return None
        return super()._maybe_compose(event, count, do_compose)


def epsilon_of(
    events: list[tuple[dp_event.DpEvent, int]],
    delta: float,
    accountant: str = "pld",
    pld_interval: float = 1e-4,
) -> float:
    """ε at ``delta`` of the composition of (event, count) pairs; ``math.inf`` if no DP.

    PLD uses pessimistic discretisation: a coarser ``pld_interval`` is faster and still
    an upper bound.
    """
    validate_delta(delta)
    events = [(e, n) for e, n in events if n > 0]
    if not events:
        return 0.0
    if any(_is_nonprivate(e) for e, _ in events):
        return math.inf
    composed = dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(e, n) for e, n in events])
    if accountant == "pld":
        check_pld_size(events, pld_interval)
        acc = CachedPLDAccountant(value_discretization_interval=pld_interval)
    elif accountant == "rdp":
        acc = RdpAccountant(orders=RDP_ORDERS)
    else:
        raise PrivgradError(
            f"unknown accountant '{accountant}'; choose from: {', '.join(ACCOUNTANTS)}"
        )
    if not acc.supports(composed):
        raise PrivgradError(f"the {accountant} accountant cannot analyse {composed}")
    eps = float(acc.compose(composed).get_epsilon(delta))
    if accountant == "pld" and math.isinf(eps):
        eps = _pld_epsilon_in_logs(acc._pld, delta)  # noqa: SLF001
    if math.isnan(eps) or eps < 0:
        raise PrivgradError(f"the {accountant} accountant returned an invalid ε ({eps})")
    return eps


def _pld_epsilon_in_logs(pld, delta: float) -> float:
    """ε at ``delta`` of a PLD, as dp-accounting's ``_get_epsilon_for_delta`` (pld_pmf.py)
    computes it, with its lower mass Σ p·e^(−loss) held as a logarithm. dp-accounting
    divides by that mass, which overflows float64 once ε passes about 709: it then returns
    ∞, read as "no DP guarantee", for a finite ε. Asked only when it did."""
    pmfs = pld._pmf_remove, pld._pmf_add  # noqa: SLF001
    both = [_pmf_epsilon_in_logs(pmf.to_dense_pmf(), delta) for pmf in pmfs]
    return math.nan if any(map(math.isnan, both)) else max(both)


def _pmf_epsilon_in_logs(dense, delta: float) -> float:
    infinity_mass, probs = dense._infinity_mass, dense._probs[::-1]  # noqa: SLF001
    if infinity_mass > delta:
        return math.inf
    top = dense._lower_loss + len(probs) - 1  # noqa: SLF001
    losses = (top - np.arange(len(probs))) * dense._discretization  # noqa: SLF001
    # after the k + 1 largest losses: the mass above ε, and log of Σ p·e^(−loss) over them
    upper = infinity_mass + np.cumsum(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        # the FFT leaves some probabilities slightly negative; they count with their sign
        log_plus = np.logaddexp.accumulate(np.log(np.maximum(probs, 0)) - losses)
        log_minus = np.logaddexp.accumulate(np.log(np.maximum(-probs, 0)) - losses)
        log_lower = log_plus + np.log1p(-np.exp(log_minus - log_plus))
        eps = np.log(upper - delta) - log_lower
    # dp-accounting stops before adding the next loss once ε (from the losses so far) ≥ it
    stop = (upper > delta) & np.isfinite(log_lower)
    stop[:-1] &= eps[:-1] >= losses[1:]
    stop[-1] = False
    last = int(np.argmax(stop)) if stop.any() else -1
    return 0.0 if upper[last] <= delta or eps[last] <= 0 else float(eps[last])


class PrivacyLedger:
    """The events of one run, consecutive equal events merged into one count."""

    def __init__(self):
        self.entries: list[list] = []  # [event, count]

    def record(self, event: dp_event.DpEvent, count: int = 1) -> None:
        if self.entries and self.entries[-1][0] == event:
            self.entries[-1][1] += count
        else:
            self.entries.append([event, count])

    @property
    def steps(self) -> int:
        return sum(n for _, n in self.entries)

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        return epsilon_of([tuple(x) for x in self.entries], delta, accountant)

    def state_dict(self) -> list:
        """The entries as plain data (event trees of names and numbers), for checkpoints."""
        return encode_entries(self.entries)

    def load_state_dict(self, state: list) -> None:
        self.entries = [list(x) for x in decode_entries(state)]


def encode_entries(entries) -> list:
    """``(event, count)`` entries as plain data, ``[[encode_event(event), count], ...]``: what
    checkpoints and privacy records store."""
    return [[encode_event(e), int(n)] for e, n in entries]


def decode_entries(state) -> tuple:
    """Inverse of :func:`encode_entries`, as a tuple of ``(event, count)``."""
    return tuple((decode_event(e), int(n)) for e, n in state)


def encode_event(event: dp_event.DpEvent) -> dict:
    def enc(v):
        if isinstance(v, dp_event.DpEvent):
            return encode_event(v)
        return [enc(x) for x in v] if isinstance(v, (list, tuple)) else v

    return {
        "dp_event": type(event).__name__,
        **{f.name: enc(getattr(event, f.name)) for f in attr.fields(type(event))},
    }


def decode_event(data: dict) -> dp_event.DpEvent:
    """Inverse of :func:`encode_event`; refuses anything that is not a dp-accounting event."""

    def dec(v):
        if isinstance(v, dict):
            return decode_event(v)
        return [dec(x) for x in v] if isinstance(v, list) else v

    cls = getattr(dp_event, str(data.get("dp_event")), None) if isinstance(data, dict) else None
    if not (isinstance(cls, type) and issubclass(cls, dp_event.DpEvent)):
        raise PrivgradError(f"not a privacy event: {data!r}")
    try:
        return cls(**{k: dec(v) for k, v in data.items() if k != "dp_event"})
    except TypeError as err:
        raise PrivgradError(f"not a privacy event: {data!r} ({err})") from None


def validate_delta(delta: float) -> None:
    if not (0 < delta < 1):
        raise PrivgradError(f"δ must lie in (0, 1), got {delta}")


def validate_epsilon(epsilon: float) -> None:
    if not (epsilon > 0) or math.isinf(epsilon):
        raise PrivgradError(f"ε must be a finite number > 0, got {epsilon}")


@functools.lru_cache(maxsize=256)
def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, sampling_rate: float, steps: int, accountant: str = "pld"
) -> float:
    """Smallest (to 0.1 %) effective noise multiplier σ with ε(q, σ, T) ≤ target.

    RDP at integer orders (fast, looser) brackets σ from above; PLD on a coarse but still
    pessimistic grid narrows it (halving the lower end while it is not one: at large ε, RDP's
    σ can be more than twice PLD's); the result is checked with the reporting accountant, so
    ε at the returned σ never exceeds the target (trust checklist item 2). Below RDP's
    floor (ε ≈ log(1/δ)/63 at any σ) the PLD accountant brackets σ itself.
    """
    validate_epsilon(target_epsilon)
    validate_delta(delta)
    if steps <= 0:
        raise PrivgradError("the number of steps must be positive")

    event = lambda sigma: [(poisson_gaussian_event(sampling_rate, sigma), steps)]  # noqa: E731
    coarse = min(1e-3, target_epsilon / 100)  # PLD grid: pessimism well below the target

    def rdp_integer_orders(sigma):
        acc = RdpAccountant(orders=list(range(2, 65)))
        return acc.compose(
            dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(*event(sigma)[0])])
        ).get_epsilon(delta)

    def search(fn, lo, hi, tol=1e-3):
        while hi - lo > tol * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fn(mid) > target_epsilon else (lo, mid)
        return hi

    bound, hi = rdp_integer_orders, 1.0
    while bound(hi) > target_epsilon:
        hi *= 2
        if hi > 1e4 and bound is rdp_integer_orders and accountant == "pld":
            bound, hi = (lambda s: epsilon_of(event(s), delta, "pld", coarse)), 1.0  # noqa: E731
        elif hi > 1e4:
            tiny = (
                " (δ below about 1e-14 is beyond what the accountants resolve: the PLD "
                "accountant truncates each tail at about 1e-15, and RDP's ε stays above "
                "log(1/δ)/63)"
                if delta < 1e-14
                else ""
            )
            raise PrivgradError(
                f"no noise multiplier ≤ 1e4 reaches ε = {target_epsilon} "
                f"with q = {sampling_rate}, {steps} steps, δ = {delta}{tiny}"
            )
    try:
        return _calibrate(event, bound, search, hi, target_epsilon, delta, accountant, coarse)
    except AccountingTooLarge as err:
        raise AccountingTooLarge(
            f"no noise multiplier that the PLD accountant can analyse within its limit of "
            f"{MAX_PLD_POINTS:.0e} grid points reaches ε = {target_epsilon:g} (q = "
            f"{sampling_rate:g}, {steps} step{'s' * (steps != 1)}; about {err.points:.1e} "
            "needed): choose a smaller ε or fewer steps",
            err.points,
        ) from None


def _calibrate(event, bound, search, hi, target_epsilon, delta, accountant, coarse) -> float:
    sigma = search(bound, 0.0, hi, 1e-2)
    if accountant == "pld":
        on_grid = lambda s: epsilon_of(event(s), delta, "pld", coarse)  # noqa: E731
        lo = sigma / 2
        while on_grid(lo) <= target_epsilon:  # RDP can be far looser than PLD (large ε)
            sigma, lo = lo, lo / 2
        sigma = search(on_grid, lo, sigma)
    else:
        sigma = search(lambda s: epsilon_of(event(s), delta, "rdp"), sigma * 0.9, sigma)
    fine = functools.cache(lambda s: epsilon_of(event(s), delta, accountant))
    if fine(sigma) < 0.99 * target_epsilon:  # the coarse grid was too pessimistic (many steps)
        lo = sigma * 0.9
        while fine(lo) <= target_epsilon:
            lo *= 0.9
        sigma = search(fine, lo, sigma)
    while fine(sigma) > target_epsilon:
        sigma *= 1.001
    return sigma


__all__ = [
    "PrivacyLedger",
    "epsilon_of",
    "calibrate_noise_multiplier",
    "gaussian_event",
    "poisson_gaussian_event",
    "ACCOUNTANTS",
    "dp_accounting",
]
