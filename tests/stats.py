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
    observed = np.array([(sizes < lo).sum()] + [(sizes == k).sum() for k in edges] + [(sizes > hi).sum()])
    probs = np.array([stats.binom.cdf(lo - 1, n, q)] + list(stats.binom.pmf(edges, n, q))
                     + [stats.binom.sf(hi, n, q)])
    expected = probs * len(sizes)
    # merge sparse bins so that every expected count is at least 5
    obs_m, exp_m, o, e = [], [], 0.0, 0.0
    for ob, ex in zip(observed, expected):
        o, e = o + ob, e + ex
        if e >= 5:
            obs_m.append(o); exp_m.append(e); o = e = 0.0
    obs_m[-1] += o; exp_m[-1] += e
    return stats.chisquare(obs_m, exp_m).pvalue > alpha
