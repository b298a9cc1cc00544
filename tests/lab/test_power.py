"""The Findings' power statement on toy records: the paired-by-seed estimate (and Welch's
where the seeds differ), each of the four labels, Holm's adjustment within a paper's family,
and the minimum detectable effect."""

import math

import pytest
from scipy.stats import t, ttest_ind, ttest_rel

from privgrad.lab.report.records import Rec
from privgrad.lab.report.stats import ALPHA, assess, compare, holm, mde


def recs(accs, seeds=None):
    """Run records with these test accuracies (%), at seeds 0, 1, ... unless given."""
    seeds = range(len(accs)) if seeds is None else seeds
    return [
        Rec(data={"test_accuracy": a / 100, "seed": s}, source="toy", index=i)
        for i, (a, s) in enumerate(zip(accs, seeds))
    ]


def pair(a, b, claimed=None, seeds_b=None):
    c = compare("A", recs(a), "B", recs(b, seeds_b))
    c.claimed = claimed
    return c


def test_shared_seeds_give_the_paired_estimate():
    """Both arms ran seeds 0, 1, 2: the interval is the paired t interval on the per-seed
    differences (df = n − 1), which resolves a gain that the seed-to-seed spread would hide."""
    a, b = [90.0, 95.0, 99.0], [89.0, 93.9, 98.0]
    c = pair(a, b)
    ci = ttest_rel(a, b).confidence_interval(0.95)
    assert c.paired and c.df == 2
    assert math.isclose(c.lo, ci.low) and math.isclose(c.hi, ci.high)
    assert math.isclose(c.p, ttest_rel(a, b).pvalue)
    assert c.lo > 0  # paired: resolved
    welch = ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert welch.low < 0  # unpaired, the same runs resolve nothing


def test_different_seeds_fall_back_to_welch():
    a, b = [90.0, 95.0, 99.0], [89.0, 93.9, 98.0]
    c = pair(a, b, seeds_b=[3, 4, 5])
    ci = ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert not c.paired
    assert math.isclose(c.lo, ci.low) and math.isclose(c.hi, ci.high)
    assert math.isclose(c.p, ttest_ind(a, b, equal_var=False).pvalue)


@pytest.mark.parametrize(
    "a, b, claimed, label",
    [
        ([97.0, 97.2, 97.1], [95.0, 95.3, 95.1], None, "win resolved"),
        ([95.0, 95.3, 95.1], [97.0, 97.2, 97.1], 2.0, "loss resolved"),
        ([95.0, 95.4, 95.2], [95.1, 95.2, 95.4], 5.0, "claimed gain ruled out"),
        ([95.0, 96.0, 97.0], [95.5, 96.5, 95.0], 1.0, "underpowered"),
    ],
)
def test_each_label(a, b, claimed, label):
    c = pair(a, b, claimed)
    assess([c])
    assert c.label == label
    if label == "claimed gain ruled out":  # alone: the 95 % interval's upper end is below it
        assert c.hi < claimed and c.lo < 0 < c.hi
    if label == "underpowered":
        assert c.lo < 0 < c.hi and c.hi > claimed
        assert c.label_text() == f"underpowered (MDE {c.mde:.2f} points)"


def test_the_mde_is_the_t_formula_at_the_holm_level():
    """MDE = (t(1 − α_i/2, df) + t(0.80, df)) · SE, with α_i the comparison's Holm level."""
    diffs = [-0.5, -0.5, 2.0]
    c = pair([95.0, 96.0, 97.0], [95.5, 96.5, 95.0], 1.0)
    assess([c])
    se = (sum((d - 1 / 3) ** 2 for d in diffs) / 2) ** 0.5 / 3**0.5
    expected = (t.ppf(1 - ALPHA / 2, 2) + t.ppf(0.80, 2)) * se
    assert c.alpha == ALPHA and math.isclose(c.mde, expected)
    assert math.isclose(mde(se, 2, ALPHA), expected)


def test_n_below_two_is_underpowered_without_an_mde():
    c = pair([97.0], [95.0, 95.3, 95.1])
    assess([c])
    assert c.label == "underpowered" and c.mde is None
    assert c.label_text() == "underpowered (n < 2)"


def test_holm_adjusts_within_the_family():
    """A p of 0.035 passes alone, and fails in a family of three (Holm multiplies the smallest
    p by 3); the adjusted p-values are Holm's running maxima."""
    adjusted, levels = holm([0.01, 0.04, 0.03])
    assert [round(p, 10) for p in adjusted] == [0.03, 0.06, 0.06]
    assert levels == [ALPHA / 3, ALPHA / 1, ALPHA / 2]

    def gain():
        return pair([96.0, 96.5, 97.0], [95.0, 95.0, 95.0])  # differences 1, 1.5, 2

    alone = gain()
    assess([alone])
    assert 0.03 < alone.p < 0.04 and alone.label == "win resolved"
    family = [gain(), pair([95.0, 96.0, 97.0], [95.5, 96.5, 95.0])]
    family.append(pair([95.0, 96.0, 97.0], [96.0, 95.0, 97.0]))
    assess(family)
    assert math.isclose(family[0].p, alone.p)
    assert math.isclose(family[0].p_holm, 3 * alone.p) and family[0].p_holm > ALPHA
    assert family[0].label == "underpowered" and family[0].alpha == ALPHA / 3
    assert family[0].mde > alone.mde  # a stricter level needs a larger effect
