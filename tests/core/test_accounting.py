import math

import pytest
from dp_accounting import dp_event

from privgrad.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon_of,
    poisson_gaussian_event,
)
from privgrad.errors import PrivgradError

GRID = [(q, s, t) for q in (0.004, 0.017, 0.1) for s in (0.8, 1.1, 2.0) for t in (100, 1000, 10000)]


# In these cells (ε > 40) dp-accounting's series for fractional orders α < 2 does not
# converge, so it drops those orders and reports a larger, still valid, ε than Opacus.
DP_ACCOUNTING_CONSERVATIVE = {(0.1, 0.8, 1000), (0.1, 0.8, 10000), (0.1, 1.1, 10000)}


@pytest.mark.parametrize("q,sigma,steps", GRID)
def test_rdp_agrees_with_opacus(q, sigma, steps):
    from opacus.accountants import RDPAccountant

    opacus = RDPAccountant()
    opacus.history = [(sigma, q, steps)]
    ours = epsilon_of([(poisson_gaussian_event(q, sigma), steps)], 1e-5, "rdp")
    theirs = opacus.get_epsilon(1e-5)
    if (q, sigma, steps) in DP_ACCOUNTING_CONSERVATIVE:
        assert theirs > 40 and ours > theirs
    else:
        assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize("q,sigma,steps", [g for g in GRID if g[2] <= 1000][::2])
def test_pld_is_never_looser_than_rdp(q, sigma, steps):
    event = [(poisson_gaussian_event(q, sigma), steps)]
    assert epsilon_of(event, 1e-5, "pld") <= epsilon_of(event, 1e-5, "rdp") * 1.001


def test_spec_step_budgets():
    """../shared/spec/bottleneck-signsgd.md: q = 1024/60000, σ = 2 reaches ε = 1 at 677 steps
    with integer orders; our RDP (more orders) is at most that, and close to it."""
    eps = epsilon_of([(poisson_gaussian_event(1024 / 60000, 2.0), 677)], 1e-5, "rdp")
    assert 0.98 < eps <= 1.0 + 1e-6


@pytest.mark.parametrize("target", [0.5, 1.0, 4.0])
def test_calibration_never_overshoots(target):
    q, steps = 256 / 60000, 1000
    sigma = calibrate_noise_multiplier(target, 1e-5, q, steps)
    assert epsilon_of([(poisson_gaussian_event(q, sigma), steps)], 1e-5) <= target
    assert epsilon_of([(poisson_gaussian_event(q, sigma * 0.99), steps)], 1e-5) > target


@pytest.mark.parametrize("target,steps", [(0.1, 100), (0.05, 1000)])
def test_calibration_reaches_small_epsilon_below_the_rdp_floor(target, steps):
    """Issue 14, case 10: RDP cannot go below ε ≈ 0.1 at δ = 1e-5 at any σ; PLD can (σ = 3.302
    gives ε = 0.09999999 for the first case), so the calibration brackets σ with PLD there."""
    sigma = calibrate_noise_multiplier(target, 1e-5, 0.01, steps)

    def eps(s):
        return epsilon_of([(poisson_gaussian_event(0.01, s), steps)], 1e-5, "pld")

    assert (
        0.99 * target <= eps(sigma) <= target and eps(sigma / 1.01) > target
    )  # valid, and within 1 %
    with pytest.raises(PrivgradError, match="no noise multiplier"):  # the RDP accountant cannot
        calibrate_noise_multiplier(target, 1e-5, 0.01, steps, "rdp")


def test_no_noise_is_infinite_epsilon():
    assert math.isinf(epsilon_of([(poisson_gaussian_event(0.01, 0.0), 10)], 1e-5))
    assert math.isinf(epsilon_of([(dp_event.NonPrivateDpEvent(), 1)], 1e-5, "rdp"))


def test_large_epsilon_and_tiny_rate_are_finite_and_positive():
    for accountant in ("pld", "rdp"):
        big = epsilon_of([(poisson_gaussian_event(0.5, 0.5), 300)], 1e-5, accountant)
        tiny = epsilon_of([(poisson_gaussian_event(1e-6, 1.0), 100)], 1e-5, accountant)
        assert math.isfinite(big) and big > 50
        assert 0 <= tiny < 0.01


def test_ledger_merges_equal_events_and_handles_changing_sigma():
    ledger = PrivacyLedger()
    for sigma in [1.0] * 50 + [2.0] * 50:
        ledger.record(poisson_gaussian_event(0.01, sigma))
    assert ledger.steps == 100 and len(ledger.entries) == 2
    both = ledger.epsilon(1e-5)
    only_first = epsilon_of([(poisson_gaussian_event(0.01, 1.0), 50)], 1e-5)
    assert both > only_first


def test_invalid_inputs():
    with pytest.raises(PrivgradError):
        calibrate_noise_multiplier(0, 1e-5, 0.01, 10)
    with pytest.raises(PrivgradError):
        epsilon_of([(poisson_gaussian_event(0.01, 1.0), 1)], 1.5)


def test_pld_epsilon_past_float_range_is_finite():
    """dp-accounting divides by Σ p·e^(−loss), which overflows once ε passes about 709: it
    returned ∞ ("no DP guarantee") at 24 steps between finite ε at 23 and 25 steps."""
    from privgrad.accounting.ledger import CachedPLDAccountant

    def eps(steps, accountant="pld"):
        event = [(poisson_gaussian_event(0.04, 0.07), steps)]
        return epsilon_of(event, 1e-5, accountant, pld_interval=1e-2)

    raw = CachedPLDAccountant(value_discretization_interval=1e-2)
    raw.compose(dp_event.SelfComposedDpEvent(poisson_gaussian_event(0.04, 0.07), 24))
    assert math.isinf(raw.get_epsilon(1e-5))  # the case this guards
    assert 700 < eps(23) < eps(24) < eps(25) < 730
    assert eps(24) < eps(24, "rdp")


@pytest.mark.parametrize("q,sigma,steps", [(0.2, 0.5, 30), (0.04, 1.0, 200), (1.0, 2.0, 10)])
def test_log_space_epsilon_is_dp_accountings(q, sigma, steps):
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from privgrad.accounting.ledger import _pld_epsilon_in_logs

    pld = pld_lib.from_gaussian_mechanism(
        sigma, value_discretization_interval=1e-3, sampling_prob=q
    ).self_compose(steps)
    for delta in (1e-5, 1e-2, 0.9):
        theirs = pld.get_epsilon_for_delta(delta)
        assert _pld_epsilon_in_logs(pld, delta) == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_log_space_epsilon_of_two_losses():
    """Loss 720 with mass 1e-4, else 0: δ(ε) = 1e-4 (1 − e^(ε−720)) = 5e-5 at ε = 720 − ln 2,
    where dp-accounting returns ∞."""
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    from privgrad.accounting.ledger import _pld_epsilon_in_logs

    probs = np.zeros(721)
    probs[0], probs[720] = 1 - 1e-4, 1e-4
    pld = PrivacyLossDistribution(pld_pmf.DensePLDPmf(1.0, 0, probs, 0.0, True))
    assert math.isinf(pld.get_epsilon_for_delta(5e-5))
    assert _pld_epsilon_in_logs(pld, 5e-5) == pytest.approx(720 - math.log(2), rel=1e-12)
    assert _pld_epsilon_in_logs(pld, 2e-4) == 0.0


def test_calibration_brackets_on_the_coarse_grid_when_rdp_is_loose(monkeypatch):
    """At ε = 300 (q = 0.04, 50 steps) PLD's σ lies below half of RDP's: the bracket is
    widened on the coarse grid, and the reporting grid is asked once (it was asked ten
    times, about 7 s each, stepping σ down by 10 %)."""
    import privgrad.accounting.ledger as ledger

    fine_calls = []
    real = ledger.epsilon_of

    def counting(events, delta, accountant="pld", pld_interval=1e-4):
        fine_calls.extend([events[0][0]] * (pld_interval == 1e-4))
        return real(events, delta, accountant, pld_interval)

    monkeypatch.setattr(ledger, "epsilon_of", counting)
    sigma = ledger.calibrate_noise_multiplier(300.0, 1e-5, 0.04, 50)
    assert len(fine_calls) == 1
    eps = lambda s: real([(poisson_gaussian_event(0.04, s), 50)], 1e-5)  # noqa: E731
    assert eps(sigma) <= 300 < eps(sigma / 1.002)
