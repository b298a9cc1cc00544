"""The Findings: one verdict per paper, from its experiments' records (claimed against
honest ε at the paper's setting), the audits of its mechanisms, and its tuned comparisons with
DP-SGD at equal honest ε.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privgrad.lab.report.formatting import _eps, _eps_text, _g
from privgrad.lab.report.placement import Section, _arm_value
from privgrad.lab.report.records import Rec
from privgrad.lab.report.stats import Comparison, compare
from privgrad.lab.reproduce import Experiment

DPSGD_MECHANISMS = ("dpsgd", "dp-adam", "dp-gan")  # the arms other mechanisms are compared with


def _baseline(exp: Experiment, arm):
    """The DP-SGD arm a private arm of another mechanism is compared with: the first one with
    the same dataset and model (None for DP-SGD arms themselves and non-private arms)."""

    def mech(a):
        return _arm_value(exp, a, "mechanism", "dpsgd")

    def task(a):
        return _arm_value(exp, a, "dataset", "mnist"), _arm_value(exp, a, "model", "cnn")

    if not arm.private or mech(arm) in DPSGD_MECHANISMS:
        return None
    return next(
        (a for a in exp.arms if a.private and mech(a) in DPSGD_MECHANISMS and task(a) == task(arm)),
        None,
    )


def _tuned(rs: list[Rec]) -> list[Rec]:
    """The runs whose hyper-parameters were chosen on a validation split."""
    return [r for r in rs if (r.data.get("selection") or {}).get("on") == "validation"]


def versus_dpsgd(section: Section, keep=lambda rs: rs) -> dict[tuple[str, float], Comparison]:
    """(arm, ε) -> a grid row's runs at equal honest ε against its DP-SGD arm's at that ε
    (``keep`` filters both sides' runs first)."""
    exp, out = section.exp, {}
    rows = {(r.arm, r.epsilon): r for r in section.rows if not r.group}
    for (name, eps), row in rows.items():
        base = _baseline(exp, exp.arm(name))
        if base is not None and (base.name, eps) in rows:
            c = compare(name, keep(row.honest), base.name, keep(rows[(base.name, eps)].honest))
            if c is not None:
                out[(name, eps)] = c
    return out


@dataclass
class Finding:
    """One paper's row of the Findings table, from its experiments' records and the audits of
    the mechanisms it proposes."""

    name: str
    proposed: list[str]
    sections: list[Section]
    claims: dict  # nominal ε -> the proposed arms' runs at the paper's setting
    audits: list[tuple[dict, str]]
    comparisons: list[tuple[Comparison, str, float]]  # tuned, with experiment id and ε

    @property
    def ratio(self) -> float | None:
        """The largest honest ε / claimed ε of a run at the paper's setting (∞: no guarantee)."""
        ratios = [_understatement(r) for rs in self.claims.values() for r in rs]
        return max(ratios) if ratios else None

    @property
    def refuting(self) -> list[tuple[dict, str]]:
        return [a for a in self.audits if _audit_margin(a[0]) > 0]

    @property
    def best(self) -> tuple[Comparison, str, float] | None:
        """The tuned comparison most favourable to the paper: by outcome (a win, then no difference
        resolved, then n too small, then a loss), then the largest Δ; the first of equals."""
        rank = ("loss", "n too small to compare", "no difference resolved", "win")
        return max(
            self.comparisons, key=lambda c: (rank.index(c[0].outcome), c[0].delta), default=None
        )

    @property
    def unbounded(self) -> bool:
        """Every run at the paper's setting has honest ε ∞: no run of the proposed mechanisms can
        stand at a finite honest ε beside DP-SGD, so no tuned comparison can exist."""
        return bool(self.claims) and all(
            math.isinf(_understatement(r)) for rs in self.claims.values() for r in rs
        )

    def order(self) -> tuple:
        """Claims an audit refutes first, then the largest understatement of ε, then by name."""
        return (not self.refuting, -(1.0 if self.ratio is None else self.ratio), self.name)


def _understatement(r: Rec) -> float:
    """A run's honest ε / claimed ε (∞: the honest ε is ∞, no guarantee)."""
    return math.inf if r.eps("epsilon") is None else r.eps("epsilon") / r.eps("epsilon_claimed")


def _exceeds_honest(audit: dict) -> bool:
    """The audit's lower bound exceeds the honest ε: an accounting error."""
    return audit.get("epsilon") is not None and audit["epsilon_lower_bound"] > audit["epsilon"]


def _audit_margin(audit: dict) -> float:
    """Lower bound minus claimed ε (> 0: the audit refutes the claim)."""
    claimed = audit.get("epsilon_claimed")
    return -math.inf if claimed is None else audit["epsilon_lower_bound"] - claimed


def findings(sections: list[Section], audits: list[tuple[dict, str]]) -> list[Finding]:
    """One Finding per paper (experiments grouped by their ``paper``; those without a seed
    text are anchors, not papers), in the order of :meth:`Finding.order`."""
    papers: dict[str, list[Section]] = {}
    for s in sections:
        if s.exp.seed_file:
            papers.setdefault(s.exp.paper, []).append(s)
    out = []
    for group in papers.values():
        proposed = list(dict.fromkeys(m for s in group for m in s.exp.proposed))
        claims, comparisons = {}, []
        for s in group:
            exp = s.exp
            mine = {
                a.name
                for a in exp.arms
                if a.private and _arm_value(exp, a, "mechanism", "dpsgd") in proposed
            }
            for row in s.rows:  # a record two experiments show counts once
                if row.arm in mine:
                    claims.setdefault(row.epsilon, {}).update(
                        (r.fp, r) for r in row.nominal if r.eps("epsilon_claimed") is not None
                    )
            comparisons += [
                (c, exp.id, eps)
                for (name, eps), c in versus_dpsgd(s, _tuned).items()
                if name in mine
            ]
        claims = {
            e: list(rs.values())
            for e, rs in sorted(claims.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
            if rs
        }
        out.append(
            Finding(
                group[0].exp.title.split(",")[0],
                proposed,
                group,
                claims,
                [a for a in audits if a[0]["mechanism"] in proposed],
                comparisons,
            )
        )
    return sorted(out, key=Finding.order)


def _claim_text(f: Finding) -> str:
    if not f.claims:
        return "no run at the paper's setting yet"
    parts = []
    for rs in f.claims.values():
        worst = max(map(_understatement, rs))
        factor = (
            ""
            if math.isinf(worst)
            else " (equal)"
            if math.isclose(worst, 1, abs_tol=5e-3)
            else f" (×{worst:.2f})"
        )
        parts.append(f"{_eps_text(rs, 'epsilon_claimed')} → {_eps_text(rs, 'epsilon')}{factor}")
    return "; ".join(parts)


def _audit_text(f: Finding) -> str:
    if not f.audits:
        return "no audit yet"
    rec, source = max(f.audits, key=lambda a: _audit_margin(a[0]))
    trials = f", {rec['trials']:,} trials" if rec.get("trials") else ""
    bound = f"lower bound {rec['epsilon_lower_bound']:.2f}"
    if f.refuting:
        text = (
            f"refutes the claim: {bound} > claimed ε {_eps(rec.get('epsilon_claimed'))} "
            f"({source}{trials}); "
            f"{len(f.refuting)} of {len(f.audits)} audits refute"
        )
    else:
        every = "its one audit" if len(f.audits) == 1 else f"all {len(f.audits)} audits"
        text = (
            f"does not refute the claim: lower bound ≤ claimed ε in {every} (closest: {bound} vs "
            "claimed "
            f"ε {_eps(rec.get('epsilon_claimed'))}, {source}{trials})"
        )
    over = [a for a, _ in f.audits if _exceeds_honest(a)]
    return text + (f"; {len(over)} exceed the honest ε (an accounting error)" if over else "")


def _delta_text(f: Finding) -> str:
    if f.best is None:
        return (
            "none possible: the proposed mechanisms give no finite honest ε to match DP-SGD at"
            if f.unbounded
            else "no tuned comparison yet"
        )
    c, exp_id, eps = f.best
    text = f"{c.a} − {c.b} at ε = {_g(eps)} ({exp_id}): {c.text()}"
    if len(f.comparisons) > 1:
        tally = [
            (sum(x.outcome == o for x, _, _ in f.comparisons), o)
            for o in ("win", "loss", "no difference resolved", "n too small to compare")
        ]
        text += (
            f"; the most favourable of {len(f.comparisons)} comparisons ("
            + ", ".join(f"{o}: {n}" for n, o in tally if n)
            + ")"
        )
    return text


def _verdict(f: Finding) -> str:
    r = f.ratio
    eps = (
        "no run at the paper's setting yet"
        if r is None
        else "the claimed ε has no guarantee behind it (honest ε ∞)"
        if math.isinf(r)
        else "claimed ε = honest ε"
        if math.isclose(r, 1, abs_tol=5e-3)
        else f"claimed ε understates the honest ε by ×{r:.2f}"
        if r > 1
        else f"claimed ε is conservative (honest ε ×{r:.2f})"
    )
    audit = (
        "no audit yet"
        if not f.audits
        else "audit refutes the claim"
        if f.refuting
        else "the audit does not refute the claim"
        if len(f.audits) == 1
        else "audits do not refute the claim"
    )
    if f.best is None:
        acc = (
            "no equal-honest-ε comparison is possible" if f.unbounded else "no tuned comparison yet"
        )
    else:
        c, n = f.best[0], f"(n = {f.best[0].na}/{f.best[0].nb})"
        acc = {
            "win": f"{c.a} beats tuned {c.b} by {c.delta:.2f} points {n}",
            "loss": f"tuned {c.b} is better by {-c.delta:.2f} points {n}",
            "no difference resolved": f"no difference resolved vs tuned {c.b} {n}",
            "n too small to compare": f"n too small to compare with tuned {c.b} {n}",
        }[c.outcome]
    text = "; ".join((eps, audit, acc)) + "."
    return text[0].upper() + text[1:]
