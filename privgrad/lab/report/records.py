"""Loading run, audit and validation records from ``results/`` (and a run store), and
wrapping each run record as a :class:`Rec` with its fingerprint, cell and nominal ε.

Every JSON file is read; files that hold no record are reported, not dropped, so that nothing
vanishes from the page silently.

Provenance (issue 41, item 3): every committed record names the code that made it, with a
``git_commit`` that is not ``-dirty`` and a ``code_version``, and the records of one file
share one code version; :func:`provenance_problems` lists where ``results/`` falls short of
that beyond what ``results/provenance_pending.toml`` excuses (each entry: the file, what it
lacks, why it was not rerun, the command that reruns it), and :func:`provenance_text`
says it in a line of the page.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
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


def read_items(path: Path) -> list:
    """The entries of one results file: a JSON list, the ``records`` list of a
    ``{"records": [...]}`` object, or the one JSON value; a ``.jsonl`` file, one per line.
    Raises ValueError where the file is not valid JSON (or not UTF-8)."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    obj = json.loads(text)
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("records"), list):
        return obj["records"]
    return [obj]


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
            items = read_items(path)
        except ValueError:
            others.append(f"{shown} (not valid JSON)")
            continue
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


# --------------------------------------------------------------------------- provenance

PENDING_NAME = "provenance_pending.toml"
# folders of results/ that hold measurements, not run records (benchmark timings)
NOT_RECORDS = ("bench",)
FAULTS = ("dirty", "no code_version", "no git_commit", "mixed versions")


def record_faults(items: list) -> list[str]:
    """What a file's records lack (in :data:`FAULTS` order): a ``git_commit`` (or one without
    ``-dirty``), a ``code_version``, or one code version shared by them all."""
    faults = set()
    for it in items:
        if not isinstance(it, dict):
            continue
        commit = it.get("git_commit")
        if not commit:
            faults.add("no git_commit")
        elif str(commit).endswith("-dirty"):
            faults.add("dirty")
        if not it.get("code_version"):
            faults.add("no code_version")
    if (
        len({it["code_version"] for it in items if isinstance(it, dict) and it.get("code_version")})
        > 1
    ):
        faults.add("mixed versions")
    return [f for f in FAULTS if f in faults]


def record_files(results_dir: str | Path | None = None) -> dict[str, list | None]:
    """Every ``*.json`` and ``*.jsonl`` file under ``results_dir`` but :data:`NOT_RECORDS`, by
    its path relative to it, with its entries (None: not valid JSON)."""
    root = Path(results_dir or RESULTS_DIR)
    out: dict[str, list | None] = {}
    for path in sorted([*root.rglob("*.json"), *root.rglob("*.jsonl")]):
        rel = path.relative_to(root).as_posix()
        if rel.split("/", 1)[0] in NOT_RECORDS:
            continue
        try:
            out[rel] = read_items(path)
        except ValueError:
            out[rel] = None
    return out


def load_pending(results_dir: str | Path | None = None) -> dict[str, dict]:
    """``results_dir/provenance_pending.toml``: file (relative to ``results_dir``) -> its entry
    (``missing``, ``why``, ``command``), each ``why`` a key of its ``[reasons]`` table, given as
    that reason's text. No file: nothing is pending. A malformed one raises PrivgradError."""
    path = Path(results_dir or RESULTS_DIR) / PENDING_NAME
    if not path.exists():
        return {}
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PrivgradError(f"{path} is not valid TOML ({err})") from None
    reasons = raw.get("reasons", {})
    out: dict[str, dict] = {}
    for entry in raw.get("pending", []):
        f = entry.get("file")
        if not isinstance(f, str) or f in out:
            raise PrivgradError(f"{path}: an entry without a file, or {f} twice")
        if entry.get("why") not in reasons or not entry.get("command"):
            raise PrivgradError(
                f"{path}: {f}'s why must name a [reasons] key, and it needs a command"
            )
        if not entry.get("missing") or set(entry["missing"]) - set(FAULTS):
            raise PrivgradError(f"{path}: {f}'s missing must be some of {', '.join(FAULTS)}")
        out[f] = {**entry, "reason": entry["why"], "why": reasons[entry["why"]]}
    unused = set(reasons) - {e["reason"] for e in out.values()}
    if unused:
        raise PrivgradError(f"{path}: reasons no entry names: {', '.join(sorted(unused))}")
    return out


def provenance_problems(results_dir: str | Path | None = None) -> list[str]:
    """Where the records under ``results_dir`` fall short of their provenance (see the module's
    docstring), beyond what its pending list excuses; and the pending entries that no longer
    hold (the file is gone or now clean, or lacks something other than it says), so that the
    list only shrinks. Empty: none."""
    files = record_files(results_dir)
    try:
        pending = load_pending(results_dir)
    except PrivgradError as err:
        return [str(err)]
    problems = []
    for rel, items in files.items():
        if items is None:
            problems.append(f"{rel}: not valid JSON")
            continue
        if not all(isinstance(it, dict) for it in items):
            problems.append(f"{rel}: holds entries that are not records (JSON objects)")
        faults = record_faults(items)
        said = pending.get(rel, {}).get("missing")
        if faults and said is None:
            problems.append(f"{rel}: {', '.join(faults)} (rerun it, or list it in {PENDING_NAME})")
        elif said is not None and not faults:
            problems.append(f"{rel}: clean now; remove its entry from {PENDING_NAME}")
        elif said is not None and set(said) != set(faults):
            problems.append(
                f"{rel}: {PENDING_NAME} says {', '.join(said)}; its records: {', '.join(faults)}"
            )
    for rel in pending:
        if rel not in files:
            problems.append(f"{rel}: in {PENDING_NAME} but no such record file")
    return problems


def pending_sources(results_dir: str | Path | None = None) -> set[str]:
    """The pending files, as the page names their records' sources."""
    root = Path(results_dir or RESULTS_DIR)
    return {_display_path(root / rel) for rel in load_pending(root)}


def _short(version: str | None, commit: str | None) -> str:
    v = "no code version" if not version else str(version)[:12]
    if not commit:
        return f"{v} · no commit"
    c = str(commit)
    return f"{v} · {c[:7]}" + ("-dirty" if c.endswith("-dirty") else "")


def provenance_text(pairs: list[tuple[dict, str]], pending: set[str]) -> str:
    """The code behind some records, one group per code version and commit: ``src-1a2b3c4d ·
    5ad9998-dirty (12, pending rerun)`` (``-dirty``: uncommitted changes; pending rerun: its
    file is in the pending list)."""
    groups: dict[str, list[int]] = {}
    for rec, source in pairs:
        n = groups.setdefault(_short(rec.get("code_version"), rec.get("git_commit")), [0, 0])
        n[0] += 1
        n[1] += source.split("[", 1)[0] in pending
    return ", ".join(
        f"{key} ({n}{', pending rerun' if waiting else ''})"
        for key, (n, waiting) in sorted(groups.items())
    )
