"""Placing records: each run record goes to a row of an experiment's grid (the latest run of a
cell, the experiment's own before another's), to a *variant* row of one of its arms, or to
"Other results".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from privgrad.errors import PrivgradError
from privgrad.lab.report.formatting import _g
from privgrad.lab.report.records import Rec, _seedless
from privgrad.lab.reproduce import Choice, Experiment, config_dict

EPS_REL_TOL = 0.02  # a record's nominal ε matches a grid value within 2 %


@dataclass
class Row:
    arm: str
    group: str  # "" for the experiment's own grid, else a variant label
    epsilon: float | None
    paper: float | None
    nominal: list[Rec] = field(default_factory=list)
    honest: list[Rec] = field(default_factory=list)
    nominal_is_honest: bool = False  # the same runs serve both columns (claimed ε = honest ε)


def _snap(eps: float | None, grid: list[float]) -> float | None:
    if eps is None:
        return None
    for g in grid:
        if math.isclose(eps, g, rel_tol=EPS_REL_TOL):
            return g
    return round(eps, 3)


def _setting(rec: dict) -> str:
    """Compact hyper-parameters of a record (a variant's label)."""
    parts = [
        f"{name}={_g(rec[key])}"
        for name, key in (("E", "epochs"), ("B", "batch_size"), ("lr", "lr"), ("C", "clip"))
        if rec.get(key) is not None
    ]
    opt = rec.get("optimizer")
    if opt:
        parts.append(
            opt + (f" m={_g(rec['momentum'])}" if rec.get("momentum") not in (None, 0) else "")
        )
    if rec.get("activation"):
        act = rec["activation"]
        if rec.get("activation_params"):
            act += (
                "("
                + ",".join(f"{k}={_g(v)}" for k, v in sorted(rec["activation_params"].items()))
                + ")"
            )
        parts.append(act)
    if rec.get("train_size"):
        parts.append(f"N={rec['train_size']}")
    for key in ("mechanism_options", "model_options"):
        if rec.get(key):
            parts.append(",".join(f"{k}={v}" for k, v in sorted(rec[key].items())))
    return " ".join(parts)


def _arm_value(exp: Experiment, arm, key: str, default=None):
    return arm.fields.get(key, exp.base.get(key, default))


def _field(rec: dict, path: str):
    """A record's value at a dotted path (None where absent)."""
    value = rec
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _arm_matches(exp: Experiment, arm, rec: dict) -> bool:
    if rec.get("mechanism") != _arm_value(exp, arm, "mechanism", "dpsgd"):
        return False
    if rec.get("dataset") != _arm_value(exp, arm, "dataset", "mnist"):
        return False
    if rec.get("model") != _arm_value(exp, arm, "model", "cnn"):
        return False
    for path, value in arm.match_record.items():
        if _field(rec, path) != value:
            return False
    act = rec.get("activation")
    return act is None or act in arm.match_activation


def _grid_cells(
    exp: Experiment, include_quick: bool, recs: list[Rec]
) -> dict[str, tuple[str, float | None, str | None]]:
    """Seedless cell key -> (arm, nominal ε, target) for the experiment's grid (any seeds:
    `privgrad reproduce --seeds N` may add seeds the config does not list). A searched arm's
    cells are those at the values its records' ``selection`` chose: a record is one of them
    only if its configuration is the arm's at those values."""
    if not exp.runnable:
        return {}
    cells = {}
    for quick in (False, True) if include_quick else (False,):
        try:
            grid = exp.cells(quick=quick, seeds=[0])
        except PrivgradError:
            continue
        for c in grid:
            cells[c.key] = (c.arm, c.epsilon, c.target)
    for r in recs:
        sel = r.data.get("selection")
        if (
            r.data.get("experiment") != exp.id
            or not isinstance(sel, dict)
            or sel.get("on") != "validation"
            or not isinstance(sel.get("chosen"), dict)
            or (r.quick and not include_quick)
        ):
            continue
        try:
            arm = exp.arm(r.data.get("arm"))
            eps, target = (r.nominal, r.target) if arm.private else (None, None)
            if arm.space is None:
                continue
            cfg = exp.train_config(arm, eps, target, 0, r.quick, point=sel["chosen"])
        except (PrivgradError, TypeError, ValueError):
            continue
        cells[_seedless(config_dict(cfg))] = (arm.name, eps, target)
    return cells


@dataclass
class Section:
    exp: Experiment
    rows: list[Row]
    missing: list[str]
    plot: str | None = None
    plot_n: list[int] = field(default_factory=list)  # the n of every point in the plot
    search: list[Choice] = field(
        default_factory=list
    )  # each searched arm's search, from its records


def place(experiments: list[Experiment], recs: list[Rec], include_quick: bool):
    """Assigns records to experiment rows; returns (sections, other records)."""
    usable = [r for r in recs if include_quick or not r.quick]
    for r in recs:
        if r.quick and not include_quick:
            r.placed.append("left out (--quick run)")
    sections, claimed = [], set()
    grid_cells = {exp.id: _grid_cells(exp, include_quick, usable) for exp in experiments}
    in_a_grid = {setting for cells in grid_cells.values() for setting in cells}
    ids = {exp.id for exp in experiments}
    for exp in experiments:
        cells = grid_cells[exp.id]
        grid_eps = sorted({e for a in exp.arms for e in (a.epsilon or exp.epsilons)})
        # one record per grid cell: the latest of the experiment's own runs (re-runs supersede
        # earlier ones), else the latest of another's with the same configuration and the code
        # version of the row's own runs (if any); so a row mixes stores only where its own
        # store lacks a cell, and never code versions
        own_versions: dict[str, set] = {}
        for r in usable:
            if r.setting in cells and _own(r, exp):
                own_versions.setdefault(r.setting, set()).add(r.data.get("code_version"))
        latest: dict[str, Rec] = {}
        for r in usable:
            if r.setting not in cells:
                continue
            theirs = own_versions.get(r.setting)
            if theirs and not _own(r, exp) and r.data.get("code_version") not in theirs:
                r.placed.append(f"not used: {exp.id}'s own runs of this setting are other code")
                continue
            prev = latest.get(r.cell)
            if prev is not None and _own(prev, exp) and not _own(r, exp):
                r.placed.append(f"not used: {exp.id} has its own run of the same cell")
                continue
            if prev is not None:
                prev.placed.append(f"superseded by a later run of the same cell ({exp.id})")
            latest[r.cell] = r
        groups: dict[tuple[str, str], dict] = {}
        for r in latest.values():
            arm, eps, target = cells[r.setting]
            groups.setdefault((arm, ""), {}).setdefault(eps, []).append(r)
            r.placed.append(f"{exp.id}: {arm}")
            claimed.add(r.fp)
        for r in usable:
            if (
                r.setting in in_a_grid
            ):  # a cell of some experiment's grid is shown there, not as a variant
                continue
            if (
                r.data.get("experiment") in ids and r.data["experiment"] != exp.id
            ):  # a harness run: its own experiment only
                continue
            arms = [a for a in exp.arms if _arm_matches(exp, a, r.data)]
            if not arms:
                continue
            opts = r.data.get("mechanism_options") or {}
            arm = max(
                arms,
                key=lambda a: sum(
                    opts.get(k) == v for k, v in _arm_value(exp, a, "mechanism_options", {}).items()
                ),
            )
            # with no runnable grid, a record that agrees with every setting the config states
            # is a row
            own = not exp.runnable and all(
                _same_setting(r.data[k], v)
                for k, v in {**exp.base, **arm.fields}.items()
                if k in r.data
            )
            label = "" if own else "variant: " + _setting(r.data)
            groups.setdefault((arm.name, label), {}).setdefault(
                _snap(r.nominal, grid_eps), []
            ).append(r)
            r.placed.append(f"{exp.id}: {arm.name} ({label})")
            claimed.add(r.fp)
        rows = []
        for arm in exp.arms:
            eps_list = exp.arm_epsilons(arm) if arm.private else [None]
            keys = [k for k in groups if k[0] == arm.name]
            keys.sort(key=lambda k: (k[1] != "", k[1]))
            if (arm.name, "") not in keys:
                keys.insert(0, (arm.name, ""))
            for key in keys:
                by_eps = groups.get(key, {})
                all_eps = list(eps_list) if key[1] == "" else []
                all_eps += [e for e in by_eps if e not in all_eps]
                for eps in sorted(all_eps, key=lambda e: -1 if e is None else e):
                    rs = sorted(
                        by_eps.get(eps, []), key=lambda r: (r.data.get("seed") or 0, r.index)
                    )
                    row = Row(arm.name, key[1], eps, arm.paper.get(eps))
                    if not arm.private or eps is None:
                        row.honest = rs
                        row.nominal, row.nominal_is_honest = rs, True
                    else:
                        row.nominal = [r for r in rs if r.target == "claimed"]
                        row.honest = [r for r in rs if r.target != "claimed"]
                        if (
                            not row.nominal
                            and row.honest
                            and all(
                                _same(r.eps("epsilon"), r.eps("epsilon_claimed"))
                                for r in row.honest
                            )
                        ):
                            row.nominal, row.nominal_is_honest = row.honest, True
                    rows.append(row)
        missing = exp.missing() if exp.runnable else []
        sections.append(Section(exp, rows, missing))
    others = [r for r in usable if r.fp not in claimed]
    for r in others:
        r.placed.append("Other results")
    return sections, others


def _own(rec: Rec, exp: Experiment) -> bool:
    """Whether a record is one of the experiment's own runs (made by its harness)."""
    return rec.data.get("experiment") == exp.id


def _same_setting(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _same(a, b) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
    )
