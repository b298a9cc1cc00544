"""Comparisons of two arms' test accuracy: the difference of means with its Welch 95 %
interval."""

from __future__ import annotations

import math
from dataclasses import dataclass

from privgrad.lab.report.formatting import _stats
from privgrad.lab.report.records import Rec


@dataclass
class Comparison:
    """Mean test accuracy of arm ``a`` minus arm ``b`` (points), with a Welch 95 % interval
    (``lo``, ``hi``) when both have n ≥ 2."""

    a: str
    b: str
    delta: float
    na: int
    nb: int
    lo: float | None = None
    hi: float | None = None

    @property
    def outcome(self) -> str:
        if self.lo is None:
            return "n too small to compare"
        return "win" if self.lo > 0 else "loss" if self.hi < 0 else "no difference resolved"

    def text(self) -> str:
        interval = "" if self.lo is None else f" [{self.lo:+.2f}, {self.hi:+.2f}]"
        said = {"win": f"{self.a} wins", "loss": f"{self.b} wins"}.get(self.outcome, self.outcome)
        return f"{self.delta:+.2f}{interval} (n={self.na}/{self.nb}): {said}"


def compare(a: str, recs_a: list[Rec], b: str, recs_b: list[Rec]) -> Comparison | None:
    """``a`` against ``b`` on their runs' test accuracy (None when either has none). A win is
    called only when the Welch 95 % interval on the difference of means excludes 0."""
    xa, xb = (
        [r.acc for r in recs_a if r.acc is not None],
        [r.acc for r in recs_b if r.acc is not None],
    )
    if not xa or not xb:
        return None
    (ma, sa), (mb, sb) = _stats(xa), _stats(xb)
    c = Comparison(a, b, ma - mb, len(xa), len(xb))
    if sa is not None and sb is not None:
        va, vb = sa**2 / len(xa), sb**2 / len(xb)
        half = 0.0
        if va + vb > 0:
            from scipy.stats import t

            df = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
            half = float(t.ppf(0.975, df)) * math.sqrt(va + vb)
        c.lo, c.hi = c.delta - half, c.delta + half
    return c
