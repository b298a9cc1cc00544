"""Numbers, ε and accuracies as the page writes them (one place, so that every table
rounds the same way).
"""

from __future__ import annotations

import math
import statistics

from privgrad.lab.report.records import Rec


def _g(x) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _eps(x) -> str:
    return "∞" if x is None else f"{x:.2f}"


def _stats(values: list[float]) -> tuple[float, float | None]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def _acc_text(rs: list[Rec], absent: str = "not run") -> str:
    accs = [r.acc for r in rs if r.acc is not None]
    if not rs:
        return absent
    if not accs:
        return "n/a"
    mean, sd = _stats(accs)
    given = [r.data.get("seed") for r in rs if r.data.get("seed") is not None]
    seeds = len(set(given)) + len(rs) - len(given)  # each secret seed (None) its own
    spread = f" ± {sd:.2f}" if sd is not None else ""
    more = "" if seeds == len(accs) else f", {seeds} seeds"
    return f"{mean:.2f}{spread} (n={len(accs)}{more})"


def _eps_text(rs: list[Rec], key: str) -> str:
    if not rs:
        return ""
    values = [r.eps(key) for r in rs]
    if any(v is None for v in values):
        return "∞ (no guarantee)" if key == "epsilon" else "∞"
    lo, hi = min(values), max(values)
    return (
        _eps(lo)
        if math.isclose(lo, hi, rel_tol=1e-3) or f"{lo:.2f}" == f"{hi:.2f}"
        else f"{lo:.2f}–{hi:.2f}"
    )
