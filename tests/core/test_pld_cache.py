"""epsilon_of's PLD accountant caches one-step PLDs (privgrad.accounting.ledger) and gives
dp-accounting's plain PLDAccountant's ε to the bit."""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from privgrad.accounting.ledger import (
    AccountingTooLarge,
    _subsampled_gaussian_pld,
    epsilon_of,
    poisson_gaussian_event,
)
from privgrad.accounting.pure_dp import composed_epsilon, pure_dp_event, tight_composition
from privgrad.errors import PrivgradError

G = poisson_gaussian_event
GRID = 1e-3  # a coarser grid than the default 1e-4: the same code path, 10x fewer points
CASES = {
    "one event": [(G(0.1, 1.0), 10)],
    "ledger split": [(G(0.1, 1.0), 10), (G(0.1, 1.0), 20)],
    "two sigmas": [(G(0.1, 1.0), 10), (G(0.05, 2.0), 7), (G(0.1, 1.0), 3)],
    "composed step": [(dp_event.ComposedDpEvent([G(0.1, 1.5), G(0.1, 3.0)]), 12)],
    "plain gaussian": [(dp_event.GaussianDpEvent(4.0), 5), (G(0.1, 1.0), 2)],
    "q = 0 and count 0": [(G(0.0, 1.0), 5), (G(0.1, 1.0), 0), (G(0.2, 2.0), 4)],
    "non-private": [(G(0.1, 1.0), 3), (dp_event.NonPrivateDpEvent(), 1)],
    "empty": [],
}


def plain_pld_epsilon(entries, delta):
    """dp-accounting's own PLDAccountant, nothing cached (epsilon_of's special cases aside)."""
    entries = [(e, n) for e, n in entries if n > 0]
    if not entries:
        return 0.0
    if any(isinstance(e, dp_event.NonPrivateDpEvent) for e, _ in entries):
        return math.inf
    composed = dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(e, n) for e, n in entries])
    return float(
        PLDAccountant(value_discretization_interval=GRID).compose(composed).get_epsilon(delta)
    )


@pytest.mark.parametrize("entries", CASES.values(), ids=CASES)
def test_cached_pld_epsilon_is_the_plain_accountant_s_to_the_bit(entries):
    want = plain_pld_epsilon(entries, 1e-5)
    for _ in range(2):  # the second call is served by the cache
        got = epsilon_of(entries, 1e-5, "pld", GRID)
        assert got == want or (math.isnan(got) and math.isnan(want)), (got, want)
    assert composed_epsilon([list(e) for e in entries], 1e-5, "pld", "best", GRID) == want


def test_the_cache_holds_one_build_per_step_kind():
    _subsampled_gaussian_pld.cache_clear()
    for steps in (10, 20, 30):  # one epoch after another
        epsilon_of([(G(0.1, 1.25), steps)], 1e-5, "pld", GRID)
    info = _subsampled_gaussian_pld.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_epsilon_of_keeps_its_refusals():
    with pytest.raises(PrivgradError, match="δ|delta"):
        epsilon_of([(G(0.1, 1.0), 1)], 2.0, "pld", GRID)
    with pytest.raises(AccountingTooLarge):
        epsilon_of([(G(1.0, 0.01), 1000)], 1e-5, "pld")
    unsupported = dp_event.PoissonSampledDpEvent(0.1, dp_event.UnsupportedDpEvent())
    with pytest.raises(PrivgradError, match="cannot analyse"):
        epsilon_of([(unsupported, 1)], 1e-5, "pld", GRID)


def test_tight_composition_with_pure_steps_is_unchanged_by_the_cache():
    entries = [[G(0.1, 1.0), 30], [pure_dp_event(0.01), 30]]
    _subsampled_gaussian_pld.cache_clear()
    first = tight_composition(entries, 1e-5, "pld", GRID)
    second = tight_composition(entries, 1e-5, "pld", GRID)
    assert first == second and _subsampled_gaussian_pld.cache_info().hits >= 1


def test_a_repeated_question_is_answered_from_the_memo_with_the_same_bits():
    from privgrad.accounting import pure_dp

    entries = [[G(0.1, 1.0), 30]]
    first = composed_epsilon(entries, 1e-5, "pld", "best", GRID)
    key = next(k for k in pure_dp._EPSILONS if k[0] == ((repr(G(0.1, 1.0)), "30"),))
    assert key[3] == "any"  # no pure step: basic, tight and best are one computation
    assert composed_epsilon([(G(0.1, 1.0), 30)], 1e-5, "pld", "basic", GRID) == first
    assert first == epsilon_of([(G(0.1, 1.0), 30)], 1e-5, "pld", GRID)
    # another count, δ, grid or σ (to the last bit) is another question
    sigma = math.nextafter(1.0, 2.0)
    assert composed_epsilon([[G(0.1, sigma), 30]], 1e-5, "pld", "best", GRID) == epsilon_of(
        [(G(0.1, sigma), 30)], 1e-5, "pld", GRID
    )
    assert composed_epsilon(entries, 1e-6, "pld", "best", GRID) > first
    assert composed_epsilon([[G(0.1, 1.0), 31]], 1e-5, "pld", "best", GRID) > first


def test_a_repeated_calibration_is_answered_from_the_memo_with_the_same_bits(monkeypatch):
    from privgrad.accounting import pure_dp
    from privgrad.accounting.pure_dp import calibrate_with_pure_dp

    pure = [(pure_dp_event(0.01), 3)]
    pure_dp._CALIBRATIONS.clear()
    first = calibrate_with_pure_dp(2.0, 1e-5, 0.25, 4, pure, "best")
    _subsampled_gaussian_pld.cache_clear()
    again = calibrate_with_pure_dp(2.0, 1e-5, 0.25, 4, [list(p) for p in pure], "best")
    assert again == first and _subsampled_gaussian_pld.cache_info().misses == 0  # no PLD built
    # another method, δ, q, pure budget, step count or target (one ulp lower) is another
    # question: each reaches the calibration (a stand-in that records it), none the memo
    asked = []
    monkeypatch.setattr(pure_dp, "_calibrate_with_pure_dp", lambda *a: asked.append(a) or 1.0)
    questions = [
        (2.0, 1e-5, 0.25, 4, pure, "basic"),
        (2.0, 1e-6, 0.25, 4, pure, "best"),
        (2.0, 1e-5, 0.5, 4, pure, "best"),
        (2.0, 1e-5, 0.25, 4, [(pure_dp_event(0.1), 3)], "best"),
        (2.0, 1e-5, 0.25, 5, pure, "best"),
        (math.nextafter(2.0, 0.0), 1e-5, 0.25, 4, pure, "best"),
    ]
    for question in questions:
        assert calibrate_with_pure_dp(*question) == 1.0
    assert [a[:4] + a[5:] for a in asked] == [q[:4] + q[5:] for q in questions]
    assert calibrate_with_pure_dp(2.0, 1e-5, 0.25, 4, pure, "best") == first
