"""Comparisons of two arms' test accuracy, with the power to tell.

A comparison is the difference of mean test accuracy (points) between a proposed arm and its
DP-SGD arm. Where both arms ran the same seeds (each once), the estimate is paired by seed: a
one-sample t on the per-seed differences (df = n − 1), which removes the variation that the seed
shares between the arms (data order, initialisation). Otherwise it is Welch's t (Satterthwaite
df). The 95 % interval is the estimate ± t(0.975, df) · SE.

The Findings test one paper's comparisons as a family, with Holm's step-down correction, and
give each one of four labels (see :func:`assess`), with the minimum detectable effect

    MDE = (t(1 − α_i / 2, df) + t(0.80, df)) · SE

the difference a two-sided t-test at the comparison's Holm level α_i = α / (m − i + 1) (i its
rank by p among the family's m) detects with 80 % power: the usual normal-approximation formula
with t quantiles, from the observed spread and n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privgrad.lab.report.formatting import _stats
from privgrad.lab.report.records import Rec

ALPHA = 0.05  # two-sided level of every test, before Holm
POWER = 0.80  # the power at which the MDE is stated
LABELS = ("win resolved", "loss resolved", "claimed gain ruled out", "underpowered")


@dataclass
class Comparison:
    """Mean test accuracy of arm ``a`` minus arm ``b`` (points), with a 95 % interval (``lo``,
    ``hi``) when both have n ≥ 2: paired by seed (``paired``) or Welch's. ``claimed`` is the
    paper's own Δ at that ε (None: the paper gives no number for one of the arms); the Holm
    fields are set by :func:`assess`."""

    a: str
    b: str
    delta: float
    na: int
    nb: int
    lo: float | None = None
    hi: float | None = None
    se: float | None = None
    df: float | None = None
    paired: bool = False
    claimed: float | None = None
    p_holm: float | None = None  # Holm-adjusted two-sided p of Δ = 0
    p_claim_holm: float | None = None  # Holm-adjusted one-sided p of Δ ≥ claimed
    alpha: float | None = None  # the comparison's Holm level (for its MDE)
    mde: float | None = None
    label: str | None = None
    # (a, b): each side's validation runs behind its chosen hyper-parameters (search points ×
    # search seeds, from its records' ``selection``); 0: not searched; None: not known
    budgets: tuple[int | None, int | None] = (None, None)

    # (a, b): whether each side's chosen setting sits on its search grid's edge (the records'
    # ``selection.edge``: extensions exhausted, or a hard limit such as ρ = 0)
    edges: tuple[bool, bool] = (False, False)

    def edge_text(self) -> str:
        """ "X's chosen setting sits on its search grid's edge" per side that does ("" if none)."""
        names = [n for n, e in zip((self.a, self.b), self.edges) if e]
        return "; ".join(f"{n}'s chosen setting sits on its search grid's edge" for n in names)

    @property
    def unequal_budget(self) -> bool:
        """Both sides' search budgets are known and differ."""
        a, b = self.budgets
        return a is not None and b is not None and a != b

    def budget_text(self) -> str:
        """ "search budget unequal: A x vs B y validation runs" ("" when equal or unknown)."""
        if not self.unequal_budget:
            return ""
        a, b = self.budgets
        return f"search budget unequal: {self.a} {a} vs {self.b} {b} validation runs"

    @property
    def outcome(self) -> str:
        if self.lo is None:
            return "n too small to compare"
        return "win" if self.lo > 0 else "loss" if self.hi < 0 else "no difference resolved"

    @property
    def p(self) -> float | None:
        """Two-sided p of Δ = 0 (None: n < 2 on a side)."""
        return None if self.se is None else _t_p(self.delta, self.se, self.df, two_sided=True)

    @property
    def p_claim(self) -> float | None:
        """One-sided p of "Δ ≥ the paper's claimed gain" (None: no claimed gain or n < 2)."""
        if self.se is None or self.claimed is None or self.claimed <= 0:
            return None
        return _t_p(self.delta - self.claimed, self.se, self.df, two_sided=False)

    def test_text(self) -> str:
        if self.se is None:
            return "n < 2"
        kind = "paired t" if self.paired else "Welch t"
        return f"{kind}, df {self.df:.1f}" if not self.paired else f"{kind}, df {self.df:.0f}"

    def text(self) -> str:
        interval = "" if self.lo is None else f" [{self.lo:+.2f}, {self.hi:+.2f}]"
        said = {"win": f"{self.a} wins", "loss": f"{self.b} wins"}.get(self.outcome, self.outcome)
        pairing = ", paired" if self.paired else ""
        return f"{self.delta:+.2f}{interval} (n={self.na}/{self.nb}{pairing}): {said}"

    def label_text(self) -> str:
        if self.label != "underpowered":
            return str(self.label)
        mde = "n < 2" if self.mde is None else f"MDE {self.mde:.2f} points"
        return f"underpowered ({mde})"


def _t_p(estimate: float, se: float, df: float, two_sided: bool) -> float:
    """p of a t statistic estimate / se (one-sided: the lower tail); se = 0 gives 0 or 1."""
    from scipy.stats import t

    if se == 0:
        if two_sided:
            return 1.0 if estimate == 0 else 0.0
        return 0.0 if estimate < 0 else 1.0
    stat = estimate / se
    return float(2 * t.sf(abs(stat), df)) if two_sided else float(t.cdf(stat, df))


def _by_seed(rs: list[Rec]) -> dict | None:
    """Seed -> accuracy, or None when a seed is missing or repeated (then no pairing)."""
    out = {}
    for r in rs:
        seed = r.data.get("seed")
        if seed is None or seed in out or r.acc is None:
            return None
        out[seed] = r.acc
    return out


def compare(a: str, recs_a: list[Rec], b: str, recs_b: list[Rec]) -> Comparison | None:
    """``a`` against ``b`` on their runs' test accuracy (None when either has none): paired by
    seed when both ran the same n ≥ 2 seeds once each, else Welch."""
    from scipy.stats import t

    xa = [r.acc for r in recs_a if r.acc is not None]
    xb = [r.acc for r in recs_b if r.acc is not None]
    if not xa or not xb:
        return None
    (ma, sa), (mb, sb) = _stats(xa), _stats(xb)
    c = Comparison(a, b, ma - mb, len(xa), len(xb))
    sa_seed, sb_seed = _by_seed(recs_a), _by_seed(recs_b)
    if sa_seed and sb_seed and sa_seed.keys() == sb_seed.keys() and len(sa_seed) > 1:
        diffs = [sa_seed[s] - sb_seed[s] for s in sorted(sa_seed)]
        c.paired, c.df = True, float(len(diffs) - 1)
        c.se = _stats(diffs)[1] / math.sqrt(len(diffs))
    elif sa is not None and sb is not None:
        va, vb = sa**2 / len(xa), sb**2 / len(xb)
        c.se = math.sqrt(va + vb)
        c.df = (
            (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
            if va + vb > 0
            else float(len(xa) + len(xb) - 2)
        )
    if c.se is not None:
        half = float(t.ppf(1 - ALPHA / 2, c.df)) * c.se if c.se > 0 else 0.0
        c.lo, c.hi = c.delta - half, c.delta + half
    return c


def holm(ps: list[float]) -> tuple[list[float], list[float]]:
    """Holm's step-down adjustment of a family's p-values: (adjusted p, each test's level).
    The i-th smallest p is compared with α / (m − i + 1); its adjusted p is the running maximum
    of min(1, (m − j + 1) p_(j)) over j ≤ i, so "adjusted p < α" is Holm's rejection."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    adjusted, levels, running = [0.0] * m, [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        adjusted[i], levels[i] = running, ALPHA / (m - rank)
    return adjusted, levels


def mde(se: float, df: float, alpha: float, power: float = POWER) -> float:
    """Minimum detectable effect of a two-sided t-test at level ``alpha`` with ``power``:
    (t(1 − α/2, df) + t(power, df)) · SE."""
    from scipy.stats import t

    return float(t.ppf(1 - alpha / 2, df) + t.ppf(power, df)) * se


def assess(family: list[Comparison]) -> None:
    """Labels one paper's comparisons (in place), each with exactly one of :data:`LABELS`:

    - "win resolved" / "loss resolved": the Holm-adjusted two-sided p of Δ = 0 is below α;
    - "claimed gain ruled out": otherwise, the paper claims a gain (Δ > 0) and the
      Holm-adjusted one-sided p of "Δ ≥ the claimed gain" is below α / 2 (with one comparison:
      the 95 % interval's upper end lies below the claimed gain);
    - "underpowered": neither; its MDE says how large a difference it could have resolved.
    """
    tested = [c for c in family if c.p is not None]
    adjusted, levels = holm([c.p for c in tested])
    for c, p, level in zip(tested, adjusted, levels):
        c.p_holm, c.alpha, c.mde = p, level, mde(c.se, c.df, level)
    claims = [c for c in tested if c.p_claim is not None]
    for c, p in zip(claims, holm([c.p_claim for c in claims])[0]):
        c.p_claim_holm = p
    for c in family:
        if c.p_holm is not None and c.p_holm < ALPHA:
            c.label = "win resolved" if c.delta > 0 else "loss resolved"
        elif c.p_claim_holm is not None and c.p_claim_holm < ALPHA / 2:
            c.label = "claimed gain ruled out"
        else:
            c.label = "underpowered"
