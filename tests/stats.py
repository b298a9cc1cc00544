"""Statistical checks with tolerances derived from the sample size.

Each returns a bool so that tests can assert both that the real code passes and that a
planted bug (e.g. noise at σ/√2, fixed-size batches) fails.
"""

import math

import numpy as np
from scipy import stats


def std_matches(samples, expected_std: float, z: float = 6.0) -> bool:
    """Sample std within z standard errors of ``expected_std`` (SE ≈ std/√(2n))."""
    samples = np.asarray(samples, dtype=np.float64).ravel()
    se = expected_std / math.sqrt(2 * len(samples))
    return abs(samples.std() - expected_std) < z * se


def follows_binomial(sizes, n: int, q: float, alpha: float = 1e-4) -> bool:
    """Chi-square goodness of fit of observed counts to Binomial(n, q)."""
    sizes = np.asarray(sizes)
    lo, hi = int(stats.binom.ppf(1e-3, n, q)), int(stats.binom.ppf(1 - 1e-3, n, q))
    edges = np.arange(lo, hi + 1)
    observed = np.array(
        [(sizes < lo).sum()] + [(sizes == k).sum() for k in edges] + [(sizes > hi).sum()]
    )
    probs = np.array(
        [stats.binom.cdf(lo - 1, n, q)]
        + list(stats.binom.pmf(edges, n, q))
        + [stats.binom.sf(hi, n, q)]
    )
    return chi_square_pvalue(observed, probs) > alpha


def chi_square_pvalue(counts, probs) -> float:
    """Chi-square goodness of fit of bin ``counts`` to ``probs``, sparse bins merged so
    that every expected count is at least 5."""
    expected = np.asarray(probs, dtype=np.float64) * np.sum(counts)
    obs_m, exp_m, o, e = [], [], 0.0, 0.0
    for ob, ex in zip(counts, expected):
        o, e = o + ob, e + ex
        if e >= 5:
            obs_m.append(o)
            exp_m.append(e)
            o = e = 0.0
    obs_m[-1] += o
    exp_m[-1] += e
    return stats.chisquare(obs_m, exp_m).pvalue


def fake_per_sample(grads):
    """PerSampleGrads from explicit per-sample tensors, one 'layer' per tensor."""
    import torch
    from torch import nn

    from privgrad.per_sample import MaterializedGrads, PerSampleGrads

    params = [nn.Parameter(torch.zeros(g.shape[1:])) for g in grads]
    return PerSampleGrads(
        [MaterializedGrads([p], [g]) for p, g in zip(params, grads)], grads[0].shape[0]
    )
