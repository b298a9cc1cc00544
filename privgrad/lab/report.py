"""``privgrad report``: the reproduction page, built from run records alone.

Sources: the JSON run records committed under ``results/`` (any ``*.json`` below it: one
record, a list of records, or ``{"records": [...]}``), the audit records there, and,
optionally, the completed runs of a run store. Output (deterministic: the same records give
byte-identical text), opening with the Findings (one row per paper, computed from the
records), then the experiments in the Findings' order:

- ``<out>/REPRODUCTION.md``
- ``<out>/reproduction/index.html`` and one PNG per experiment (accuracy vs honest ε)

Every record read appears in the report: in its experiment's table (a cell of the
experiment's grid, or a *variant* run of one of its arms with other hyper-parameters),
under "Other results", and always in the appendix listing all records; every audit record
in the audit tables.
"""

from __future__ import annotations

import collections
import hashlib
import html
import json
import math
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from privgrad.errors import PrivgradError
from privgrad.lab.reproduce import (
    DEFAULT_METRIC,
    EXPERIMENTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    Choice,
    Experiment,
    cell_key,
    config_dict,
    list_experiments,
    search_state,
)

DOCS_DIR = REPO_ROOT / "docs"
MD_NAME = "REPRODUCTION.md"
HTML_SUBDIR = "reproduction"
EPS_REL_TOL = 0.02  # a record's nominal ε matches a grid value within 2 %
SPEC_URL = "../shared/spec"  # as the README refers to it

# --------------------------------------------------------------------------- records


@dataclass
class Rec:
    data: dict
    source: str
    index: int  # position in the load order (later wins for duplicates)
    fp: str = ""
    cell: str | None = None
    setting: str | None = None  # the cell key with the seed set to 0 (its seeds' common setting)
    nominal: float | None = None  # nominal ε (None: non-private / no ε target)
    target: str = "honest"
    quick: bool = False
    placed: list = field(default_factory=list)  # where the report shows it

    @property
    def acc(self) -> float | None:
        a = self.data.get("test_accuracy")
        return None if a is None or not math.isfinite(a) else 100.0 * a

    def eps(self, key: str) -> float | None:
        e = self.data.get(key)
        return None if e is None or (isinstance(e, float) and not math.isfinite(e)) else float(e)


_FP_FIELDS = (
    "mechanism",
    "dataset",
    "model",
    "test_accuracy",
    "epsilon",
    "epsilon_claimed",
    "seed",
    "steps",
    "noise_multiplier",
    "wall_time_s",
    "lr",
    "batch_size",
    "epochs",
    "clip",
    "mechanism_options",
    "model_options",
    "activation",
    "activation_params",
    "target",
    "train_size",
)


def fingerprint(record: dict) -> str:
    text = json.dumps({k: record.get(k) for k in _FP_FIELDS}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _is_record(obj) -> bool:
    """A classifier run evaluated on the test set (validation runs of a hyper-parameter
    search are not results: the harness's are shown in their experiment's search table, others'
    files are listed under "Other results")."""
    return (
        isinstance(obj, dict)
        and "mechanism" in obj
        and "dataset" in obj
        and "test_accuracy" in obj
        and "validation_accuracy" not in obj
    )


def _display_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _is_audit(obj) -> bool:
    """An empirical privacy audit (``privgrad audit``): an ε lower bound for one mechanism."""
    return isinstance(obj, dict) and "mechanism" in obj and "epsilon_lower_bound" in obj


def _is_validation_run(obj) -> bool:
    """A run scored on a validation split: a point of a hyper-parameter search (the harness's,
    tagged with its experiment and ``search_point``, or one made with ``privgrad train --validation``)."""
    return isinstance(obj, dict) and "mechanism" in obj and "validation_accuracy" in obj


def _harness_search_run(obj: dict) -> bool:
    return "search_point" in obj and "experiment" in obj


def load_results(
    results_dir: str | Path | None = None,
) -> tuple[list[tuple[dict, str]], list[tuple[dict, str]], list[tuple[dict, str]], list[str]]:
    """(record, source) for every run record under ``results_dir``; the same for every audit
    record (read by the Findings, shown in the audit tables) and every validation run (the
    harness's in their experiment's search table, others in a table of their own); and the
    JSON files there that hold none of these (listed so that nothing vanishes silently)."""
    root = Path(results_dir or RESULTS_DIR)
    records, audits, searches, others = [], [], [], []
    if not root.is_dir():
        raise PrivgradError(f"no results folder {root}; pass --results-dir an existing folder")
    for path in sorted(root.rglob("*.json")):
        shown = _display_path(path)
        try:
            obj = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            others.append(f"{shown} (not valid JSON)")
            continue
        items = (
            obj
            if isinstance(obj, list)
            else obj.get("records")
            if isinstance(obj, dict) and isinstance(obj.get("records"), list)
            else [obj]
        )
        found = [
            (it, f"{shown}" + (f"[{i}]" if len(items) > 1 else ""))
            for i, it in enumerate(items)
            if _is_record(it)
        ]
        records += found
        audited = [(it, shown) for it in items if _is_audit(it)]
        audits += audited
        searched = [(it, shown) for it in items if _is_validation_run(it)]
        searches += searched
        if len(found) + len(audited) + len(searched) < len(items):
            others.append(
                shown
                if not found
                else f"{shown} ({len(items) - len(found)} entries that are not run records)"
            )
    return records, audits, searches, others


def load_store(db: str | Path) -> list[tuple[dict, str]]:
    from privgrad.app.store import RunStore

    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}")
    store = RunStore(db)
    try:
        rows = store.runs(status="completed")
    finally:
        store.close()
    out = []
    for row in reversed(rows):  # oldest first
        rec = dict(row["record"] or {})
        if not _is_record(rec):
            continue
        rec.setdefault("config", row["config"])
        out.append((rec, f"run store {Path(db).name} #{row['id']}"))
    return out


def _nominal(rec: dict) -> tuple[float | None, str]:
    # a run with no honest ε (RDP-GAN) can only have been calibrated to the claimed one
    no_guarantee = rec.get("epsilon") is None and rec.get("epsilon_claimed") is not None
    target = rec.get("target") or ("claimed" if no_guarantee else "honest")
    if "nominal_epsilon" in rec:
        return rec["nominal_epsilon"], target
    cfg = rec.get("config") or {}
    if cfg.get("noise_multiplier") is None and cfg.get("epsilon") is not None:
        return float(cfg["epsilon"]), cfg.get("target", target)
    if rec.get("mechanism") == "non-private":
        return None, target
    key = "epsilon_claimed" if target == "claimed" else "epsilon"
    value = rec.get(key) if rec.get(key) is not None else rec.get("epsilon_claimed")
    return (None if value is None else float(value)), target


def prepare(pairs: list[tuple[dict, str]]) -> tuple[list[Rec], int]:
    """Wraps records, drops exact duplicates (the same run from two sources)."""
    out, seen, dup = [], set(), 0
    for i, (data, source) in enumerate(pairs):
        r = Rec(data=data, source=source, index=i, fp=fingerprint(data))
        if r.fp in seen:
            dup += 1
            continue
        seen.add(r.fp)
        r.nominal, r.target = _nominal(data)
        r.quick = bool(data.get("quick"))
        try:
            r.cell = data.get("cell") or (cell_key(data["config"]) if data.get("config") else None)
            r.setting = _seedless(data["config"]) if isinstance(data.get("config"), dict) else None
        except PrivgradError:
            r.cell = r.setting = None
        out.append(r)
    return out, dup


# --------------------------------------------------------------------------- placement


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


def _seedless(config: dict) -> str:
    return cell_key({**config, "seed": 0})


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
        # latest record per grid cell (re-runs supersede earlier ones)
        latest: dict[str, Rec] = {}
        for r in usable:
            if r.setting in cells:
                prev = latest.get(r.cell)
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
            # with no runnable grid, a record that agrees with every setting the config states is a row
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


def _same_setting(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _same(a, b) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
    )


# --------------------------------------------------------------------------- formatting


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
    seeds = len({r.data.get("seed") for r in rs})
    spread = f" ± {sd:.2f}" if sd is not None else ""
    return f"{mean:.2f}{spread} (n={len(accs)}{'' if seeds == len(accs) else ', ' + str(seeds) + ' seeds'})"


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


def _config_text(exp: Experiment, arm) -> str:
    values = {**exp.base, **arm.fields}
    keys = [
        "mechanism",
        "model",
        "dataset",
        "epochs",
        "batch_size",
        "lr",
        "optimizer",
        "momentum",
        "clip",
        "activation",
        "activation_params",
        "mechanism_options",
        "model_options",
        "delta",
    ]
    parts = []
    for k in keys:
        if k in values and values[k] not in ({}, None):
            v = values[k]
            v = ", ".join(f"{kk}={vv}" for kk, vv in v.items()) if isinstance(v, dict) else _g(v)
            parts.append(f"{k}={v}")
    if arm.space is not None:
        s = exp.search
        parts.append(
            ", ".join(
                f"{k} ∈ {{{', '.join(_g(v) for v in vals)}}}" for k, vals in arm.space.items()
            )
            + f" searched on {s.validation} held-out training examples (seeds {', '.join(map(str, s.seeds))}"
            + "".join(f", {k}={_g(v)}" for k, v in s.overrides.items())
            + ("" if s.epsilon is None else f", at ε = {_g(s.epsilon)}")
            + "), extended where the best value sat on an edge; each record's `selection` has the choice"
        )
    elif exp.search is not None:
        parts.append("not searched: run at the stated setting")
    if arm.private:
        parts.append(
            "σ calibrated for "
            + " and ".join(
                {"honest": "the honest ε", "claimed": "the paper's claimed ε"}[t]
                for t in arm.targets
            )
        )
    else:
        parts.append("no clipping, no noise")
    return "; ".join(parts)


# --------------------------------------------------------------------------- comparisons and findings

DPSGD_MECHANISMS = ("dpsgd", "dp-adam", "dp-gan")  # the arms other mechanisms are compared with


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
            f"refutes the claim: {bound} > claimed ε {_eps(rec.get('epsilon_claimed'))} ({source}{trials}); "
            f"{len(f.refuting)} of {len(f.audits)} audits refute"
        )
    else:
        every = "its one audit" if len(f.audits) == 1 else f"all {len(f.audits)} audits"
        text = (
            f"does not refute the claim: lower bound ≤ claimed ε in {every} (closest: {bound} vs claimed "
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


def _anchor_text(s: Section) -> str:
    cells = [
        f"{r.arm} at ε = {_g(r.epsilon)}: {_acc_text(r.honest)}"
        + (f" (honest ε {_eps_text(r.honest, 'epsilon')})" if r.honest else "")
        for r in s.rows
        if not r.group and r.epsilon is not None
    ]
    return f"[{s.exp.id}](#{s.exp.id}): " + "; ".join(cells or ["no grid row"])


def _search_row(c: Choice) -> list[str]:
    """One search of a section's search table: every point's mean validation accuracy (the
    harness averages a point only once all its runs are done, so n is its number of cells)."""
    runs = collections.Counter(tuple(cell.point.values()) for cell in c.cells)
    chosen = None if c.chosen is None else tuple(c.chosen.values())
    points = ", ".join(
        f"{' '.join(_g(v) for v in point)}: {100 * mean:.2f} (n={runs[point]})"
        + (" ✓" if point == chosen else "")
        for point, mean in c.means.items()
    )
    state = (
        f"flat: {c.flat_text()}"
        if c.flat
        else f"waiting: {len(c.cells) - len(c.pending)} of {len(c.cells)} runs done"
        if c.chosen is None
        else "; ".join(c.edge)
        if c.edge
        else "chosen inside its grid"
    )
    return [
        c.label(),
        f"{' × '.join(c.axes)} — {points}",
        "—" if c.chosen is None else ", ".join(f"{k} {_g(v)}" for k, v in c.chosen.items()),
        state,
    ]


# --------------------------------------------------------------------------- audits


def _audit_eps(x) -> str:
    return "∞ (no guarantee)" if x is None else f"{x:.3f}"


def _audit_label(a: dict) -> str:
    """What was audited, from the record: mechanism, options, where RDP-GAN's noise went, the
    ε its σ was calibrated to."""
    cfg = a.get("config") or {}
    opts = cfg.get("mechanism_options") or {}
    label = a["mechanism"] + (
        " (" + ", ".join(f"{k} {v}" for k, v in sorted(opts.items())) + ")" if opts else ""
    )
    if a.get("noise_reading"):
        label += f", noise on: {a['noise_reading']}"
    if a["mechanism"] != "non-private" and cfg.get("target_epsilon") is not None:
        label += f", σ for {cfg.get('target', 'honest')} ε = {_g(cfg['target_epsilon'])}"
    return label


def _audit_verdict(a: dict) -> str:
    if _exceeds_honest(a):
        return "VIOLATION: lower bound > honest ε"
    if _audit_margin(a) > 0:
        return "claimed ε refuted: lower bound > claimed ε"
    return "consistent"


def _best_attack(side: dict) -> float:
    return max(att["epsilon_lower_bound"] for att in side["attacks"].values())


def audit_blocks(audits: list[tuple[dict, str]]) -> list[tuple]:
    """The audit tables: one row per ``privgrad audit`` record (canary and GAN-step audits;
    membership inference with its non-private control)."""
    B: list[tuple] = [("h2", "Empirical privacy audits", "audits")]
    if not audits:
        return B + [("p", "None.")]
    canary = sorted(
        (a for a in audits if a[0].get("method") != "mia"), key=lambda a: (a[1], _audit_label(a[0]))
    )
    mia = sorted((a for a in audits if a[0].get("method") == "mia"), key=lambda a: a[1])
    B.append(
        (
            "p",
            "One row per `privgrad audit` record under results/ (its `command` field holds the exact "
            "command; `experiments/scripts/audit.sh` runs them all). Every lower bound is a 95 % "
            "Clopper–Pearson bound on ε at the record's δ, with the threshold chosen on held-out trials. "
            "**Canary audits** release one step (q = 1) with or without a canary: a dense gradient "
            "canary of norm 10 C for generic chains, an input canary through the model's own per-sample "
            "rules for layer-aware stages (Spectral-DP, GReDP, GIP), a ±1 checkerboard image through one "
            "discriminator step of the class-conditional DCGAN for the GAN rows. μ̂ is the measured mean "
            "shift over the noise std (an estimate, not a bound); for a Gaussian mechanism the honest ε "
            "corresponds to μ = 1/σ_eff. A bound above the claimed ε refutes the claim; above the honest "
            "ε it would be an accounting error.",
        )
    )
    if canary:
        B.append(
            (
                "table",
                [
                    "Audited release",
                    "Model",
                    "Honest ε",
                    "Claimed ε",
                    "Lower bound (95 %)",
                    "μ̂ ± se",
                    "Trials per side",
                    "Held-out TPR / FPR",
                    "Verdict",
                    "Source",
                ],
                [
                    [
                        _audit_label(a),
                        str(a.get("model", "—")),
                        _audit_eps(a.get("epsilon")),
                        _audit_eps(a.get("epsilon_claimed")),
                        f"{a['epsilon_lower_bound']:.3f}",
                        f"{a['mu_hat']:.3g} ± {a['mu_hat_se']:.2g}" if "mu_hat" in a else "—",
                        f"{a['trials']:,}" if "trials" in a else "—",
                        f"{a['test']['tpr']:.2e} / {a['test']['fpr']:.2e}" if "test" in a else "—",
                        _audit_verdict(a),
                        src,
                    ]
                    for a, src in canary
                ],
            )
        )
    if mia:
        B.append(
            (
                "p",
                "**Membership inference**: a pool of training images, each a member with probability ½; "
                "the model trains on the members, and a non-private control trains on the same members "
                "from the same initialisation with the same batches and learning rate, without clipping "
                "or noise. Attacks: loss threshold (Yeom et al.) and a shadow model (Salem et al.); the ε "
                "lower bound applies Steinke et al.'s one-run theorem to the best attack's guesses.",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset, model",
                    "Honest ε",
                    "Test acc. (%)",
                    "Loss AUC",
                    "Shadow AUC",
                    "TPR @ 0.1 % / 1 % FPR (loss)",
                    "Lower bound (best attack)",
                    "Control: test acc. (%)",
                    "Control: loss AUC",
                    "Control: lower bound",
                    "Source",
                ],
                [
                    [
                        a["mechanism"],
                        f"{a.get('dataset')}, {a.get('model')}",
                        _audit_eps(a.get("epsilon")),
                        f"{100 * a['target']['test_accuracy']:.1f}",
                        f"{a['target']['attacks']['loss']['auc']:.3f}",
                        f"{a['target']['attacks']['shadow']['auc']:.3f}",
                        f"{a['target']['attacks']['loss']['tpr_at_0.1%_fpr']:.3f} / "
                        f"{a['target']['attacks']['loss']['tpr_at_1%_fpr']:.3f}",
                        f"{_best_attack(a['target']):.3f}",
                        f"{100 * a['control']['test_accuracy']:.1f}",
                        f"{a['control']['attacks']['loss']['auc']:.3f}",
                        f"{_best_attack(a['control']):.3f}",
                        src,
                    ]
                    for a, src in mia
                ],
            )
        )
    return B


# --------------------------------------------------------------------------- plots


def _point(rs: list[Rec]) -> tuple[float, float, float, int] | None:
    """A cell's plotted point: (mean honest ε, mean accuracy, sd or NaN, n); None without a
    finite honest ε or an accuracy."""
    accs = [r.acc for r in rs if r.acc is not None]
    eps = [r.eps("epsilon") for r in rs]
    if not accs or any(e is None for e in eps):
        return None
    mean, sd = _stats(accs)
    return statistics.fmean(eps), mean, math.nan if sd is None else sd, len(accs)


def plot_section(section: Section, path: Path) -> list[int] | None:
    """Accuracy against honest ε: each cell's mean with ± 1 sd error bars (none where n = 1).
    Returns the n of every point drawn (None: nothing to draw, no file written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PrivgradError("privgrad report needs matplotlib (pip install matplotlib)") from err
    exp = section.exp
    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs_all, ns, drew = [], [], False
    for i, arm in enumerate(exp.arms):
        col = colours[i % len(colours)]
        rows = [r for r in section.rows if r.arm == arm.name]
        if not arm.private:
            ours = [r for r in rows if r.group == "" and r.honest]
            if ours:
                m, _ = _stats([x.acc for x in ours[0].honest if x.acc is not None] or [math.nan])
                ax.axhline(m, color=col, lw=1.2, label=f"{arm.name} (ours)")
                drew = True
            if arm.paper.get(None) is not None:
                ax.axhline(arm.paper[None], color=col, lw=1.0, ls=":", label=f"{arm.name} (paper)")
                drew = True
            continue
        series = [
            ([r.honest for r in rows if not r.group], "o", "-", "ours, equal honest ε"),
            (
                [r.nominal for r in rows if not r.group and not r.nominal_is_honest],
                "s",
                "--",
                "ours, paper's nominal σ",
            ),
        ]
        series += [
            ([r.honest for r in rows if r.group == g], "x", "none", "variant runs")
            for g in dict.fromkeys(r.group for r in rows if r.group)
        ]
        labelled = set()
        for cells, marker, ls, label in series:
            pts = sorted(p for p in map(_point, cells) if p is not None)
            if not pts:
                continue
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                color=col,
                marker=marker,
                ls=ls,
                capsize=3,
                ms=5,
                label=None if label in labelled else f"{arm.name} ({label})",
            )
            labelled.add(label)
            xs_all += [p[0] for p in pts]
            ns += [p[3] for p in pts]
            drew = True
        paper = sorted((e, v) for e, v in arm.paper.items() if e is not None)
        if paper:
            ax.plot(
                [p[0] for p in paper],
                [p[1] for p in paper],
                ls=":",
                lw=1,
                marker="*",
                ms=11,
                markerfacecolor="none",
                markeredgewidth=1.3,
                color=col,
                label=f"{arm.name} (paper, its ε)",
            )
            xs_all += [p[0] for p in paper]
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xlabel("ε (honest for our runs; as the paper states it for the paper's points)")
    ax.set_ylabel(exp.metric.split(":")[0])  # a long metric's explanation is in the section's text
    ax.set_title(f"{exp.id}: {exp.table}", fontsize=11)
    if xs_all and max(xs_all) / min(xs_all) > 1.5:
        ax.set_xscale("log", base=2)
    if xs_all:
        ticks = sorted(exp.epsilons)
        for x in sorted(
            xs_all
        ):  # a run's ε next to a grid ε (0.499 by 0.5) gets no tick of its own
            if not any(math.isclose(x, t, rel_tol=0.05) for t in ticks):
                ticks.append(float(f"{x:.3g}"))
        ticks.sort()
        if len(ticks) > 8:
            ticks = sorted(set(exp.epsilons)) or ticks[:: max(1, len(ticks) // 8)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_g(t) for t in ticks])
        ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return sorted(ns)


# --------------------------------------------------------------------------- document model
# A tiny block list rendered to both markdown and HTML, so the two always say the same.


def _table_for(section: Section) -> tuple[list[str], list[list[str]], list[str]]:
    head = [
        "Method",
        "ε",
        "Paper",
        "Nominal setting: accuracy",
        "ε honest",
        "ε claimed",
        "Equal honest ε: accuracy",
        "ε honest",
        "Δ vs DP-SGD at equal honest ε [95 % CI]",
    ]
    rows, notes = [], []
    exp = section.exp
    versus = versus_dpsgd(section)
    absent = "not run" if exp.runnable else "—"
    for r in section.rows:
        arm = exp.arm(r.arm)
        name = r.arm if not r.group else f"{r.arm} — {r.group}"
        paper = "—" if r.paper is None else str(float(r.paper))
        if r.paper is not None and arm.paper_note and r.group == "":
            mark = "*" * (len(notes) + 1)
            notes.append(f"{mark} {r.arm}: {arm.paper_note}")
            paper += f" {mark}"
        if not arm.private:
            acc = _acc_text(r.honest, absent)
            rows.append([name, "∞ (none)", paper, acc, "∞", "∞", acc, "∞", "—"])
            continue
        nom_acc = _acc_text(r.nominal, absent) + (" †" if r.nominal_is_honest and r.nominal else "")
        if not r.nominal and r.group:
            nom_acc = "—"
        hon_acc = _acc_text(r.honest, absent) if (r.honest or not r.group) else "—"
        rows.append(
            [
                name,
                _eps(r.epsilon) if r.epsilon is not None else "?",
                paper,
                nom_acc,
                _eps_text(r.nominal, "epsilon"),
                _eps_text(r.nominal, "epsilon_claimed"),
                hon_acc,
                _eps_text(r.honest, "epsilon"),
                versus[(r.arm, r.epsilon)].text()
                if not r.group and (r.arm, r.epsilon) in versus
                else "—",
            ]
        )
    return head, rows, notes


def _columns_table(section: Section) -> tuple[list[str], list[list[str]]]:
    """The experiment's ``columns``: each row's runs' mean of every listed record field (rows whose
    runs record none of them are left out), and the paper's values where an arm gives them
    (``paper_columns``)."""
    exp = section.exp
    head = ["Method", "ε", "Runs", *exp.columns]
    rows = []
    for r in section.rows:
        arm = exp.arm(r.arm)
        name = r.arm if not r.group else f"{r.arm} — {r.group}"
        eps = "∞ (none)" if not arm.private else _eps(r.epsilon) if r.epsilon is not None else "?"
        paper = arm.paper_columns.get(r.epsilon if arm.private else None)
        if paper and not r.group:
            rows.append(
                [
                    f"{r.arm} (paper)",
                    eps,
                    "paper",
                    *("—" if math.isnan(v) else _g(v) for v in paper),
                ]
            )
        sets = (
            [("", r.honest)]
            if not arm.private or r.nominal_is_honest
            else [("nominal setting", r.nominal), ("equal honest ε", r.honest)]
        )
        for which, rs in sets:
            if not rs:
                continue
            cells = []
            for path in exp.columns.values():
                values = [
                    v for v in (_field(x.data, path) for x in rs) if isinstance(v, (int, float))
                ]
                cells.append(
                    f"{statistics.fmean(values):.3f}"
                    + (f" (n={len(values)})" if len(values) != len(rs) else "")
                    if values
                    else "—"
                )
            if any(c != "—" for c in cells):  # runs that record none of the fields are left out
                rows.append([name, eps, f"{which + ', ' if which else ''}n={len(rs)}", *cells])
    return head, rows


def _plot_caption(ns: list[int]) -> str:
    if not ns:
        n = "no runs of ours yet"
    elif ns[-1] == 1:
        n = "one run per point (n = 1), so no error bars"
    elif ns[0] == ns[-1]:
        n = f"error bars ± 1 sd over seeds, n = {ns[0]} runs per point"
    else:
        n = (
            f"error bars ± 1 sd over seeds, n = {ns[0]}–{ns[-1]} runs per point (each cell's n is in the "
            "table)" + ("; a point with n = 1 has no bar" if ns[0] == 1 else "")
        )
    return (
        "Each point is a cell's mean test accuracy: circles at equal honest ε, squares at the paper's "
        f"nominal σ (placed at their honest ε), crosses for variant settings; {n}. Hollow stars: the "
        "paper's numbers at the ε it states; horizontal lines: non-private means (solid: ours, dotted: paper)."
    )


def build_blocks(
    sections: list[Section],
    found: list[Finding],
    others: list[Rec],
    all_recs: list[Rec],
    audits: list[tuple[dict, str]],
    validations: list[tuple[dict, str]],
    other_files: list[str],
    n_dup: int,
    sources: str,
    include_quick: bool,
) -> list[tuple]:
    """The page: Findings first, then the sections in the order given (the Findings' order)."""
    B: list[tuple] = []
    B.append(("h1", "Reproduction of the papers' tables"))
    B.append(("h2", "Findings", "findings"))
    B.append(
        (
            "p",
            "Computed from the records (" + sources + "), never typed in: one row per paper (its "
            "experiment configs grouped by `paper`; its mechanisms are their `proposed`). **Claimed ε → "
            "honest ε:** the proposed mechanisms' runs at the paper's nominal setting (σ calibrated to the "
            "paper's own ε), per nominal ε. **Audit:** the `privgrad audit` records of those mechanisms; "
            "one refutes the claim when its 95 % lower bound on ε exceeds the claimed ε (shown: the audit "
            "whose bound exceeds its claimed ε the most, or comes closest). **Δ accuracy:** a proposed "
            "arm's mean test accuracy minus its DP-SGD arm's (same data and model) at the same honest ε, "
            "in points, counting only runs whose hyper-parameters were chosen on a validation split "
            "(`selection` on validation) on both sides; the 95 % interval is Welch's (n ≥ 2 on both "
            'sides, else "n too small to compare"); a win is called only when the interval excludes 0, '
            'else "no difference resolved". Shown: the comparison most favourable to the paper over its '
            "experiments and ε (a win, then no difference resolved, then n too small, then a loss; the "
            "largest Δ among equals). Order: papers whose claim an audit refutes first, then by how "
            "far the claimed ε understates the honest ε (largest first), then by name; the sections below "
            "follow it.",
        )
    )
    B.append(
        (
            "table",
            [
                "Paper (proposed mechanisms)",
                "Claimed ε → honest ε, paper's setting",
                "Empirical audit (ε lower bound, 95 %)",
                "Best proposed arm − tuned DP-SGD, equal honest ε: Δ accuracy [95 % CI]",
                "Verdict",
            ],
            [
                [
                    f"{f.name} ({', '.join(f.proposed) or 'none named'})",
                    _claim_text(f),
                    _audit_text(f),
                    _delta_text(f),
                    _verdict(f),
                ]
                for f in found
            ],
        )
    )
    anchors = [s for s in sections if not s.exp.seed_file]
    if anchors:
        B.append(
            (
                "p",
                "**DP-SGD anchors** (privgrad's own DP-SGD baseline, not a paper), test accuracy at "
                "equal honest ε:",
            )
        )
        B.append(("ul", [_anchor_text(s) for s in anchors]))
    B.append(
        (
            "p",
            "Generated by `privgrad report` from the run records (" + sources + "); do not edit "
            "by hand. Each paper table is an experiment config in `experiments/`; "
            "`privgrad reproduce <id>` runs its grid through the normal training path and "
            "writes the records to `results/reproduce/<id>.json`.",
        )
    )
    B.append(
        (
            "p",
            "Columns: **Paper** is the paper's own number at its stated ε (reference data, "
            "cited below each table). **Nominal setting** is our run of the published mechanism "
            "with σ calibrated so that the paper's own analysis (the claimed ε) equals the "
            "paper's ε; the honest ε of that run, from a proven accountant at the mechanism's "
            "effective noise multiplier, is shown beside it. **Equal honest ε** calibrates σ so "
            "that the honest ε equals the paper's ε: the fair comparison. Accuracy is the "
            "final-epoch test accuracy in %, mean ± sample standard deviation over seeds "
            "(n runs). † the mechanism's claimed ε equals its honest ε, so the same runs fill "
            'both columns. "not run": no record yet. **Δ vs DP-SGD**: the row\'s mean minus its '
            "DP-SGD arm's (same data and model) at the same honest ε, with Welch's 95 % interval "
            "when both have n ≥ 2; a win only when the interval excludes 0.",
        )
    )
    B.append(("h2", "Contents"))
    B.append(
        (
            "ul",
            [f"[{s.exp.id}](#{s.exp.id}): {s.exp.title} — {_status(s)}" for s in sections]
            + [
                "[Empirical privacy audits](#audits)",
                "[Other results](#other-results)",
                "[All run records](#all-run-records)",
            ],
        )
    )
    for s in sections:
        exp = s.exp
        B.append(("h2", f"{exp.title}", exp.id))
        B.append(("p", f"**Status:** {_status(s)}."))
        where = f"{exp.table}, {exp.section}" if exp.section else exp.table
        seed = f"`../shared/seeds/{exp.seed_file}`" + (
            f" line {exp.seed_line}" if exp.seed_line else ""
        )
        B.append(
            (
                "p",
                f"**Source:** {exp.paper}. {where}. Seed text: {seed}. Page: {exp.page or 'not given'}. "
                f"Implementation notes: `../shared/spec/{exp.spec}`.",
            )
        )
        if exp.metric != DEFAULT_METRIC:
            B.append(("p", f'**Metric** (the table\'s "accuracy" columns): {exp.metric}.'))
        if not exp.runnable:
            B.append(("p", f"**Not reproduced here:** {exp.reason}."))
        elif s.missing:
            B.append(
                (
                    "p",
                    f"**Waiting for:** {', '.join(s.missing)} (not in privgrad yet); the table "
                    "shows the paper's numbers until its arms can run.",
                )
            )
        head, rows, notes = _table_for(s)
        B.append(("table", head, rows))
        for n in notes:
            B.append(("small", n))
        if s.plot:
            B.append(
                ("img", s.plot, f"{exp.id}: accuracy against honest ε, paper's points as stars")
            )
            B.append(("small", _plot_caption(s.plot_n)))
        if exp.columns and any(r.nominal or r.honest for r in s.rows):
            B.append(("h3", "More measurements of these runs"))
            B.append(
                (
                    "p",
                    "Mean over each row's runs of these record fields: "
                    + "; ".join(f"{title}: `{path}`" for title, path in exp.columns.items())
                    + ".",
                )
            )
            head, rows = _columns_table(s)
            B.append(("table", head, rows))
        if s.search:
            B.append(("h3", "How the searched arms' hyper-parameters were chosen"))
            B.append(
                (
                    "p",
                    f"Validation accuracy (%) of every point tried, mean over the search seeds, on "
                    f"{exp.search.validation:,} training examples held out (`{exp.search_file()}`); "
                    "the best mean is chosen (✓), and a grid whose best value sits on its edge is extended."
                    + (f" Caveat: {caveat}." if (caveat := exp.search_epochs_caveat()) else ""),
                )
            )
            B.append(
                (
                    "table",
                    ["Search", "Validation accuracy per point (mean, n runs)", "Chosen", "State"],
                    [_search_row(c) for c in s.search],
                )
            )
        if exp.runnable:
            B.append(("h3", "How to regenerate"))
            cmds = [
                (
                    f"privgrad reproduce {exp.id}",
                    f"full grid, resumable; writes results/reproduce/{exp.id}.json",
                ),
                (f"privgrad reproduce {exp.id} --quick", "CI smoke run (tiny; not a result)"),
                ("privgrad report", "rebuild this page and docs/REPRODUCTION.md"),
            ]
            width = max(len(c) for c, _ in cmds) + 3
            B.append(("code", "\n".join(f"{c:<{width}}# {why}" for c, why in cmds)))
        B.append(("h3", "Setting"))
        items = [f"**{a.name}:** {_config_text(exp, a)}" for a in exp.arms]
        if exp.runnable:
            items.append(
                "**grid:** ε ∈ {"
                + ", ".join(_g(e) for e in exp.epsilons)
                + "}, seeds "
                + ", ".join(str(x) for x in exp.seeds)
            )
        B.append(("ul", items))
        if exp.scaled_down:
            B.append(("p", "**Scaled down from the paper:**"))
            B.append(("ul", [f"**{k}:** {v}" for k, v in exp.scaled_down.items()]))
        if exp.notes:
            B.append(("p", "**Notes:** " + " ".join(exp.notes.split())))
    B += audit_blocks(audits)
    B.append(("h2", "Other results", "other-results"))
    if others:
        B.append(
            (
                "p",
                "Committed run records that belong to no experiment above (other datasets, models "
                "or mechanisms), grouped by setting; accuracy as above.",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Setting",
                    "ε target",
                    "Accuracy",
                    "ε honest",
                    "ε claimed",
                    "Source",
                ],
                _other_rows(others),
            )
        )
    else:
        B.append(("p", "None."))
    if validations:
        B.append(
            (
                "p",
                "Validation runs made outside the harness (`privgrad train --validation`: the "
                "per-mechanism defaults' search, searches of the earlier protocol), grouped by setting "
                "without lr; each lr's validation accuracy in %, mean over its runs, the best marked ✓:",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Setting",
                    "ε",
                    "Validation accuracy per lr (n runs)",
                    "Source",
                ],
                _validation_rows(validations),
            )
        )
    if other_files:
        B.append(
            (
                "p",
                "JSON files under results/ that hold no run, audit or validation record "
                "(listed so that nothing is dropped silently):",
            )
        )
        B.append(("ul", [f"`{f}`" for f in other_files]))
    B.append(("h2", "All run records", "all-run-records"))
    extra = (
        f" {n_dup} exact duplicate record(s) (the same run from two sources) merged."
        if n_dup
        else ""
    )
    quick = (
        "" if include_quick else " Records of `--quick` runs are listed but left out of the tables."
    )
    B.append(("p", f"{len(all_recs)} records.{extra}{quick}"))
    if all_recs:
        B.append(
            (
                "table",
                [
                    "id",
                    "Source",
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Seed",
                    "Accuracy",
                    "ε honest",
                    "ε claimed",
                    "Shown in",
                ],
                [
                    [
                        r.fp,
                        r.source,
                        str(r.data.get("mechanism")),
                        str(r.data.get("dataset")),
                        str(r.data.get("model")),
                        str(r.data.get("seed")),
                        "n/a" if r.acc is None else f"{r.acc:.2f}",
                        _eps(r.eps("epsilon")),
                        _eps(r.eps("epsilon_claimed")),
                        "; ".join(r.placed),
                    ]
                    for r in all_recs
                ],
            )
        )
    return B


def _status(s: Section) -> str:
    if not s.exp.runnable:
        n = len({r.fp for row in s.rows for r in row.nominal + row.honest})
        return "not run by `privgrad reproduce`" + (
            f"; {n} records from other commands" if n else ""
        )
    if s.missing:
        return "waiting for " + ", ".join(s.missing)
    runs = sum(
        len(r.honest) + (0 if r.nominal_is_honest else len(r.nominal))
        for r in s.rows
        if not r.group
    )
    cells = s.exp.n_test_cells()
    return f"{min(runs, cells)} of {cells} grid runs done" if runs else "runnable, not run yet"


def _other_rows(others: list[Rec]) -> list[list[str]]:
    groups: dict[tuple, list[Rec]] = {}
    for r in others:
        d = r.data
        key = (
            str(d.get("mechanism")),
            str(d.get("dataset")),
            str(d.get("model")),
            _setting(d),
            -1.0 if r.nominal is None else round(r.nominal, 3),
            r.target,
        )
        groups.setdefault(key, []).append(r)
    rows = []
    for key in sorted(groups):
        rs = groups[key]
        srcs = sorted({r.source.split("[")[0] for r in rs})
        rows.append(
            [
                key[0],
                key[1],
                key[2],
                key[3],
                "∞ (none)" if key[4] < 0 else f"{_eps(key[4])} ({key[5]})",
                _acc_text(rs),
                _eps_text(rs, "epsilon"),
                _eps_text(rs, "epsilon_claimed"),
                ", ".join(srcs),
            ]
        )
    return rows


def _validation_rows(validations: list[tuple[dict, str]]) -> list[list[str]]:
    groups: dict[tuple, dict[float, list[float]]] = {}
    sources: dict[tuple, set[str]] = {}
    for r, src in validations:
        setting = _setting({k: v for k, v in r.items() if k != "lr"})
        key = (
            str(r.get("mechanism")),
            str(r.get("dataset")),
            str(r.get("model")),
            setting,
            -1.0 if r.get("epsilon") is None else round(float(r["epsilon"]), 2),
        )
        groups.setdefault(key, {}).setdefault(float(r.get("lr") or 0), []).append(
            100 * r["validation_accuracy"]
        )
        sources.setdefault(key, set()).add(src.rsplit("/", 1)[0] + "/")
    rows = []
    for key in sorted(groups):
        means = {lr: statistics.fmean(v) for lr, v in sorted(groups[key].items())}
        best = max(means, key=means.get)
        cells = ", ".join(
            f"{_g(lr)}: {m:.2f} (n={len(groups[key][lr])})" + (" ✓" if lr == best else "")
            for lr, m in means.items()
        )
        rows.append(
            [
                *key[:4],
                "∞" if key[4] < 0 else f"{key[4]:.2f}",
                cells,
                ", ".join(sorted(sources[key])),
            ]
        )
    return rows


# --------------------------------------------------------------------------- renderers

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1d232a;
       background: #fafbfc; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; background: #fff; }
h1 { font-size: 1.8em; margin-top: 0.3em; }
h2 { font-size: 1.35em; margin-top: 2.2em; padding-top: 0.6em; border-top: 2px solid #e3e7eb; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.86em; }
th, td { border: 1px solid #d5dbe1; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef2f6; }
tbody tr:nth-child(even) { background: #f7f9fb; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.9em; }
pre { background: #f3f5f7; padding: 10px 12px; overflow-x: auto; border-radius: 4px; }
p code, li code { background: #f1f3f5; padding: 0 3px; border-radius: 3px; }
img { max-width: 100%; border: 1px solid #e3e7eb; margin: 0.6em 0; }
.small { font-size: 0.82em; color: #4a5560; margin: 0.2em 0; }
.wide { overflow-x: auto; }
"""


def _inline_html(text: str) -> str:
    """Escapes text, then renders `code`, **bold** and [label](#anchor)."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"\[([^\]]+)\]\((#[A-Za-z0-9_.-]+)\)", r'<a href="\2">\1</a>', out)
    return out


def _is_num(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "∞—") and len(cell) < 40


def render_html(blocks: list[tuple], title: str) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<main>",
    ]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            anchor = f' id="{html.escape(b[2])}"' if len(b) > 2 else ""
            out.append(f"<{kind}{anchor}>{_inline_html(b[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{_inline_html(b[1])}</p>")
        elif kind == "small":
            out.append(f'<p class="small">{_inline_html(b[1])}</p>')
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "code":
            out.append(f"<pre><code>{html.escape(b[1], quote=False)}</code></pre>")
        elif kind == "img":
            out.append(f'<p><img src="{html.escape(b[1])}" alt="{html.escape(b[2])}"></p>')
        elif kind == "table":
            head, rows = b[1], b[2]
            out.append('<div class="wide"><table>')
            out.append(
                "<thead><tr>"
                + "".join(f"<th>{html.escape(h)}</th>" for h in head)
                + "</tr></thead>"
            )
            out.append("<tbody>")
            for row in rows:
                out.append(
                    "<tr>"
                    + "".join(
                        f'<td class="num">{html.escape(c)}</td>'
                        if j and _is_num(c)
                        else f"<td>{html.escape(c)}</td>"
                        for j, c in enumerate(row)
                    )
                    + "</tr>"
                )
            out.append("</tbody></table></div>")
        else:  # pragma: no cover
            raise ValueError(kind)
    out += ["</main>", "</body>", "</html>", ""]
    return "\n".join(out)


def _md_cell(text: str) -> str:
    """A table cell as plain text, as the HTML page shows it: Markdown and HTML characters
    (record text may hold any) are backslash-escaped."""
    return re.sub(r"([\\`*_\[\]<>|&])", r"\\\1", text).replace("\n", " ")


def render_markdown(blocks: list[tuple], img_prefix: str) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            level = {"h1": "#", "h2": "##", "h3": "###"}[kind]
            if len(b) > 2:
                out.append(f'<a id="{b[2]}"></a>\n')
            out.append(f"{level} {b[1]}\n")
        elif kind == "p":
            out.append(b[1] + "\n")
        elif kind == "small":
            out.append(f"<sub>{b[1]}</sub>\n")
        elif kind == "ul":
            out.append("\n".join(f"- {i}" for i in b[1]) + "\n")
        elif kind == "code":
            out.append(f"```bash\n{b[1]}\n```\n")
        elif kind == "img":
            out.append(f"![{b[2]}]({img_prefix}{b[1]})\n")
        elif kind == "table":
            head, rows = b[1], b[2]
            lines = [
                "| " + " | ".join(_md_cell(h) for h in head) + " |",
                "|" + "|".join("---" for _ in head) + "|",
            ]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines) + "\n")
    return "\n".join(out)


# --------------------------------------------------------------------------- entry points


def build_report(
    out_dir: str | Path | None = None,
    results_dir: str | Path | None = None,
    db: str | Path | None = None,
    experiments_dir: str | Path | None = None,
    include_quick: bool = False,
) -> dict:
    """Writes ``REPRODUCTION.md`` and ``reproduction/`` (HTML + PNG) under ``out_dir``."""
    out = Path(out_dir or DOCS_DIR)
    experiments = list_experiments(experiments_dir or EXPERIMENTS_DIR)
    pairs, audits, searches, other_files = load_results(results_dir)
    sources = f"`{_display_path(Path(results_dir or RESULTS_DIR))}/`"
    if db:
        pairs += load_store(db)
        sources += f" and the run store `{Path(db).name}`"
    recs, n_dup = prepare(pairs)
    sections, others = place(experiments, recs, include_quick)
    for s in sections:
        done = {
            r["cell"]: r
            for r, _ in searches
            if _harness_search_run(r) and r.get("experiment") == s.exp.id and not r.get("quick")
        }
        s.search = search_state(s.exp, done) if done and s.exp.runnable else []
    found = findings(sections, audits)
    sections = [s for f in found for s in f.sections] + [s for s in sections if not s.exp.seed_file]
    html_dir = out / HTML_SUBDIR
    if html_dir.exists():
        for old in html_dir.glob("*.png"):
            if old.name != "screenshot.png":
                old.unlink()
    html_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for s in sections:
        if not s.exp.runnable and not any(r.honest or r.nominal for r in s.rows):
            continue
        name = f"{s.exp.id}.png"
        ns = plot_section(s, html_dir / name)
        if ns is not None:
            s.plot, s.plot_n = name, ns
            plots.append(html_dir / name)
    validations = [(r, src) for r, src in searches if not _harness_search_run(r)]
    blocks = build_blocks(
        sections,
        found,
        others,
        recs,
        audits,
        validations,
        other_files,
        n_dup,
        sources,
        include_quick,
    )
    title = "privgrad: reproduction of the papers' tables"
    (html_dir / "index.html").write_text(render_html(blocks, title))
    md_path = out / MD_NAME
    md_path.write_text(render_markdown(blocks, f"{HTML_SUBDIR}/"))
    return {
        "markdown": md_path,
        "html": html_dir / "index.html",
        "plots": plots,
        "n_records": len(recs),
        "sections": sections,
        "findings": found,
        "others": others,
        "records": recs,
    }


def check_report(out_dir: str | Path | None = None, **kwargs) -> list[str]:
    """Differences between the report in ``out_dir`` and a fresh regeneration (empty: none)."""
    out = Path(out_dir or DOCS_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="privgrad-report-"))
    try:
        build_report(tmp, **kwargs)
        stale = []
        for rel in (MD_NAME, f"{HTML_SUBDIR}/index.html"):
            have = out / rel
            if not have.exists():
                stale.append(f"{have}: missing")
            elif have.read_text() != (tmp / rel).read_text():
                stale.append(f"{have}: differs from a fresh regeneration")
        fresh = {p.name for p in (tmp / HTML_SUBDIR).glob("*.png")}
        have = {p.name for p in (out / HTML_SUBDIR).glob("*.png")} - {"screenshot.png"}
        for name in sorted(fresh ^ have):
            stale.append(
                f"{out / HTML_SUBDIR / name}: {'missing' if name in fresh else 'not in a fresh regeneration'}"
            )
        return stale
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
