"""Loading run, audit and validation records from ``results/`` (and a run store), and
wrapping each run record as a :class:`Rec` with its fingerprint, cell and nominal ε.

Every JSON file is read; files that hold no record are reported, not dropped, so that nothing
vanishes from the page silently.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from privgrad.errors import PrivgradError
from privgrad.lab.reproduce import REPO_ROOT, RESULTS_DIR, cell_key


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
    tagged with its experiment and ``search_point``, or one made with
    ``privgrad train --validation``)."""
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


def _seedless(config: dict) -> str:
    return cell_key({**config, "seed": 0})
