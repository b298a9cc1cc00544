"""``privgrad reproduce``: one paper table as a grid of ordinary training runs.

An *experiment* is a TOML file in ``experiments/`` (format: ``docs/experiments.md``): the
paper table it reproduces (with the paper's own numbers as reference data), the dataset
and model, one ``[[arms]]`` entry per method (mechanism and hyper-parameters), the ε grid,
the seeds, what was scaled down and why, and a ``[quick]`` section small enough for CI.

Every cell of the grid (arm × ε × target × seed) is a :class:`~privgrad.train.TrainConfig`
run through the normal :func:`~privgrad.train.train` path into the run store. A cell is
identified by a canonical hash of its TrainConfig (:func:`cell_key`); it is skipped when
the run store already holds a completed run with the same key *and* the same code
version (:func:`code_version`, a hash of the training code), so an interrupted
reproduction resumes where it stopped and a code change reruns what it may affect.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PrivgradError

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS_DIR = REPO_ROOT / "experiments"
RESULTS_DIR = REPO_ROOT / "results"
EXPORT_SUBDIR = "reproduce"          # full runs are exported to results/reproduce/<id>.json

TARGETS = ("honest", "claimed")
DEFAULT_METRIC = "test accuracy (%)"
# Modules that present results but never touch a training step: editing them does not
# invalidate finished cells.
PRESENTATION_MODULES = frozenset({"cli.py", "report.py", "reproduce.py"})
# Sizes used only to weight the overall progress bar (not for any result).
_TRAIN_SIZES = {"mnist": 60000, "fashion-mnist": 60000, "imdb": 25000, "adult": 32561, "cifar10": 4000}
_MODEL_COST = {"bilstm": 6.0}

_TOP_KEYS = {"id", "title", "paper", "table", "section", "page", "seed_file", "seed_line", "spec",
             "metric", "runnable", "reason", "notes", "scaled_down", "base", "grid", "quick", "arms"}
_ARM_KEYS = {"name", "private", "targets", "paper", "paper_note", "epsilon", "match_activation", "match_record",
             "note"}


def _train_fields() -> set[str]:
    from .train import TrainConfig
    return {f.name for f in dataclasses.fields(TrainConfig)}


# --------------------------------------------------------------------------- identity


def _canon(obj):
    """Numbers as floats (so 20 and 20.0 hash alike), dicts with sorted keys."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float)):
        x = float(obj)
        return None if not math.isfinite(x) else x
    if isinstance(obj, dict):
        return {str(k): _canon(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    raise PrivgradError(f"cannot hash configuration value {obj!r}")


# What an experiment config leaves out: the TrainConfig defaults the committed configs were
# written against (before privgrad train had per-mechanism defaults), so that their cells
# keep their settings and their keys.
EXPERIMENT_DEFAULTS = {"batch_size": 2048, "lr": 2.0, "momentum": 0.9, "clip": 0.1}

# TrainConfig fields added after records were committed: hashed only when not at their
# default, so that adding a field does not change the identity of every earlier cell.
_LATER_FIELDS = {"validation": 0}


def config_dict(config) -> dict:
    """The identity-relevant part of a TrainConfig (or its asdict): everything but data_dir
    (and later fields at their default)."""
    d = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    d.pop("data_dir", None)
    for name, default in _LATER_FIELDS.items():
        if d.get(name, default) == default:
            d.pop(name, None)
    return d


def cell_key(config) -> str:
    """Canonical hash of a TrainConfig: equal configurations give equal keys."""
    text = json.dumps(_canon(config_dict(config)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_version() -> str:
    """Hash of privgrad's training code (every module but the presentation ones)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in PRESENTATION_MODULES or "__pycache__" in rel:
            continue
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + h.hexdigest()[:16]


# --------------------------------------------------------------------------- experiments


@dataclass
class Arm:
    name: str
    fields: dict                     # TrainConfig overrides (mechanism, lr, ...)
    private: bool = True
    targets: tuple[str, ...] = ("honest",)
    paper: dict = field(default_factory=dict)   # nominal ε (None: non-private) -> paper's number
    paper_note: str = ""
    epsilon: list[float] | None = None
    match_activation: tuple[str, ...] = ()
    match_record: dict = field(default_factory=dict)   # record field (dotted path) -> value it must have
    note: str = ""


@dataclass
class Cell:
    experiment: str
    arm: str
    epsilon: float | None            # the nominal ε of the cell (None: non-private)
    target: str | None
    seed: int
    config: object                   # TrainConfig
    key: str
    quick: bool

    def label(self) -> str:
        eps = "" if self.epsilon is None else f" ε={_g(self.epsilon)}"
        tgt = "" if self.target in (None, "honest") else f" ({self.target} ε)"
        return f"{self.arm}{eps}{tgt} seed {self.seed}"


@dataclass
class Experiment:
    id: str
    title: str
    paper: str
    table: str
    section: str
    page: str
    seed_file: str
    seed_line: int | None
    spec: str
    metric: str
    runnable: bool
    reason: str
    notes: str
    scaled_down: dict
    base: dict
    epsilons: list[float]
    seeds: list[int]
    quick: dict
    arms: list[Arm]
    path: Path

    # -- grid ---------------------------------------------------------------------------

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise PrivgradError(f"experiment '{self.id}' has no arm '{name}'; arms: "
                            + ", ".join(f"'{a.name}'" for a in self.arms))

    def arm_epsilons(self, arm: Arm, quick: bool = False) -> list[float | None]:
        if not arm.private:
            return [None]
        grid = arm.epsilon if arm.epsilon is not None else self.epsilons
        if quick and "epsilon" in self.quick:
            grid = [e for e in grid if any(math.isclose(e, q) for q in self.quick["epsilon"])] or grid[:1]
        return list(grid)

    def train_config(self, arm: Arm, epsilon: float | None, target: str | None, seed: int,
                     quick: bool = False, data_dir: str | None = None):
        from .train import TrainConfig
        values = {**EXPERIMENT_DEFAULTS, **self.base, **arm.fields}
        if quick:
            values.update({k: v for k, v in self.quick.items() if k not in ("epsilon", "seeds")})
        values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
        if arm.private:
            values.update(epsilon=float(epsilon), noise_multiplier=None, target=target)
        else:
            values.update(epsilon=None, noise_multiplier=0.0, target="honest")
        values.update(seed=int(seed), data_dir=data_dir)
        config = TrainConfig(**values)
        config.validate()
        return config

    def cells(self, quick: bool = False, seeds: list[int] | None = None,
              arms: list[str] | None = None, data_dir: str | None = None) -> list[Cell]:
        if seeds is None:
            seeds = list(self.quick.get("seeds", self.seeds[:1])) if quick else list(self.seeds)
        chosen = [self.arm(n) for n in arms] if arms else self.arms
        out = []
        for arm in chosen:
            for eps in self.arm_epsilons(arm, quick):
                for target in (arm.targets if arm.private else (None,)):
                    for seed in seeds:
                        cfg = self.train_config(arm, eps, target, seed, quick, data_dir)
                        out.append(Cell(self.id, arm.name, eps, target, seed, cfg, cell_key(cfg), quick))
        return out

    def missing(self, arms: list[str] | None = None) -> list[str]:
        """Mechanisms, models and datasets the arms need that this privgrad lacks."""
        from .data import DATASETS
        from .mechanisms import MECHANISMS
        from .models import MODELS
        need = []
        for arm in ([self.arm(n) for n in arms] if arms else self.arms):
            values = {**self.base, **arm.fields}
            for kind, name, have in (("mechanism", values.get("mechanism", "dpsgd"), MECHANISMS),
                                     ("model", values.get("model", "cnn"), MODELS),
                                     ("dataset", values.get("dataset", "mnist"), DATASETS)):
                if name not in have and f"{kind} '{name}'" not in need:
                    need.append(f"{kind} '{name}'")
        return need

    def regenerate_command(self, quick: bool = False) -> str:
        return f"privgrad reproduce {self.id}" + (" --quick" if quick else "")


def _g(x) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def _eps_key(text, where: str) -> float | None:
    if text in ("none", "non-private", "inf", "∞"):
        return None
    try:
        return float(text)
    except (TypeError, ValueError):
        raise PrivgradError(f"{where}: paper numbers are keyed by ε, got key {text!r}") from None


def load_experiment(name_or_path: str | Path, experiments_dir: str | Path | None = None) -> Experiment:
    """Reads ``experiments/<id>.toml`` (or a path to a .toml file) and checks it."""
    path = Path(name_or_path)
    if path.suffix != ".toml" or not path.exists():
        path = Path(experiments_dir or EXPERIMENTS_DIR) / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(e.id for e in list_experiments(experiments_dir)) or "none"
        raise PrivgradError(f"unknown experiment '{name_or_path}' (no {path}); known: {known}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise PrivgradError(f"{path}: invalid TOML: {err}") from None
    return parse_experiment(raw, path)


def parse_experiment(raw: dict, path: Path) -> Experiment:
    where = str(path)
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise PrivgradError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("id", "title", "paper", "table", "arms"):
        if key not in raw:
            raise PrivgradError(f"{where}: missing '{key}'")
    if raw["id"] != path.stem:
        raise PrivgradError(f"{where}: id '{raw['id']}' must equal the file name '{path.stem}'")
    fields = _train_fields()
    runnable = bool(raw.get("runnable", True))
    if not runnable and not str(raw.get("reason", "")).strip():
        raise PrivgradError(f"{where}: runnable = false needs a 'reason'")
    base = dict(raw.get("base", {}))
    bad = set(base) - fields
    if bad:
        raise PrivgradError(f"{where}: [base] has non-TrainConfig key(s) {', '.join(sorted(bad))}")
    grid = dict(raw.get("grid", {}))
    bad = set(grid) - {"epsilon", "seeds"}
    if bad:
        raise PrivgradError(f"{where}: [grid] takes only 'epsilon' and 'seeds', got {', '.join(sorted(bad))}")
    epsilons = [float(e) for e in grid.get("epsilon", [])]
    seeds = [int(s) for s in grid.get("seeds", [0])]
    quick = dict(raw.get("quick", {}))
    bad = set(quick) - fields - {"epsilon", "seeds"}
    if bad:
        raise PrivgradError(f"{where}: [quick] has unknown key(s) {', '.join(sorted(bad))}")
    if runnable and not {"limit_train", "epochs"} <= set(quick):
        raise PrivgradError(f"{where}: a runnable experiment needs [quick] limit_train and epochs")
    arms, names = [], set()
    for i, a in enumerate(raw["arms"]):
        aw = f"{where}: arm {i + 1}"
        if "name" not in a:
            raise PrivgradError(f"{aw}: missing 'name'")
        if a["name"] in names:
            raise PrivgradError(f"{aw}: duplicate arm name '{a['name']}'")
        names.add(a["name"])
        overrides = {k: v for k, v in a.items() if k not in _ARM_KEYS}
        bad = set(overrides) - fields
        if bad:
            raise PrivgradError(f"{aw} ('{a['name']}'): unknown key(s) {', '.join(sorted(bad))}")
        private = bool(a.get("private", True))
        targets = tuple(a.get("targets", ["honest"]))
        if not targets or set(targets) - set(TARGETS):
            raise PrivgradError(f"{aw}: targets must be among {TARGETS}, got {list(targets)}")
        paper_raw = a.get("paper", {})
        if not private and isinstance(paper_raw, (int, float)):
            paper = {None: float(paper_raw)}
        elif isinstance(paper_raw, dict):
            paper = {_eps_key(k, aw): float(v) for k, v in paper_raw.items()}
        else:
            raise PrivgradError(f"{aw}: 'paper' must be a table keyed by ε (or a number for a "
                                "non-private arm)")
        arm_eps = [float(e) for e in a["epsilon"]] if "epsilon" in a else None
        if private and not (arm_eps or epsilons):
            raise PrivgradError(f"{aw}: a private arm needs an ε grid")
        values = {**base, **overrides}
        act = values.get("activation", "tanh")
        arms.append(Arm(name=a["name"], fields=overrides, private=private, targets=targets,
                        paper=paper, paper_note=a.get("paper_note", ""), epsilon=arm_eps,
                        match_activation=tuple(a.get("match_activation", [act])),
                        match_record=dict(a.get("match_record", {})), note=a.get("note", "")))
    exp = Experiment(
        id=raw["id"], title=raw["title"], paper=raw["paper"], table=raw["table"],
        section=raw.get("section", ""), page=str(raw.get("page", "")),
        seed_file=raw.get("seed_file", ""), seed_line=raw.get("seed_line"), spec=raw.get("spec", ""),
        metric=raw.get("metric", DEFAULT_METRIC), runnable=runnable,
        reason=str(raw.get("reason", "")).strip(), notes=str(raw.get("notes", "")).strip(),
        scaled_down=dict(raw.get("scaled_down", {})), base=base, epsilons=epsilons, seeds=seeds,
        quick=quick, arms=arms, path=path)
    if runnable:
        for quick_mode in (False, True):   # every cell must build a valid TrainConfig
            exp.cells(quick=quick_mode)
    return exp


def list_experiments(experiments_dir: str | Path | None = None) -> list[Experiment]:
    folder = Path(experiments_dir or EXPERIMENTS_DIR)
    return [load_experiment(p) for p in sorted(folder.glob("*.toml"))]


# --------------------------------------------------------------------------- the run store


def _record_cell(record: dict, config: dict | None) -> str | None:
    if record.get("cell"):
        return record["cell"]
    return cell_key(config) if config else None


def completed_cells(store, version: str | None) -> dict[str, dict]:
    """cell key -> latest completed record with that key (and code version, unless None)."""
    done: dict[str, dict] = {}
    for row in reversed(store.runs(status="completed")):        # oldest first; later wins
        rec = row["record"] or {}
        try:
            key = _record_cell(rec, row["config"])
        except PrivgradError:
            continue
        if key is None or (version is not None and rec.get("code_version") != version):
            continue
        done[key] = {**rec, "run_id": row["id"]}
    return done


def _cost(cell: Cell) -> float:
    cfg = cell.config
    n = cfg.limit_train or _TRAIN_SIZES.get(cfg.dataset, 10000)
    return max(1.0, cfg.epochs * n * _MODEL_COST.get(cfg.model, 1.0) / 1000) + 2.0


# --------------------------------------------------------------------------- running


def _cell_payload(cell: Cell, db: str, version: str, commit: str | None, progress: bool) -> dict:
    return {"config": dataclasses.asdict(cell.config), "db": db, "progress": progress,
            "meta": {"experiment": cell.experiment, "arm": cell.arm, "cell": cell.key,
                     "nominal_epsilon": cell.epsilon, "quick": cell.quick, "code_version": version,
                     "git_commit": commit,
                     "command": cell_command(cell)}}


def cell_command(cell: Cell) -> str:
    return (f"privgrad reproduce {cell.experiment}{' --quick' if cell.quick else ''} "
            f"--arm '{cell.arm}'  # cell {cell.key}")


def run_cell(payload: dict) -> dict:
    """Runs one cell through :func:`privgrad.train.train` and tags its stored record.

    Returns the record, or ``{"error": message}``: one cell's failure never stops the grid.
    """
    from .store import RunStore
    from .train import TrainConfig, train
    config = TrainConfig(**payload["config"])
    meta = payload["meta"]
    store = RunStore(payload["db"])
    try:
        with _cached_datasets():
            record = train(config, store=store, progress=payload["progress"], command=meta["command"])
        record.update({k: v for k, v in meta.items() if k != "command"})
        record["config"] = config_dict(config)
        store.finish(record["run_id"], record)       # the same run, now tagged with its cell
        return record
    except PrivgradError as err:
        return {"error": str(err)}
    except KeyboardInterrupt:
        raise
    except Exception as err:   # a bug in one mechanism must not hide the other cells' results
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        store.close()


_DATA_CACHE: dict = {}


class _cached_datasets:
    """Within a reproduction, each dataset is read from disk once per process.

    train() loads its data itself; the grid runs many cells on the same data, and reading
    IMDB alone takes seconds. The cache holds what ``load_dataset`` returned (the training
    code copies what it slices) and is bypassed if train.py stops using ``load_dataset``.
    """

    def __enter__(self):
        from . import train as train_module
        self.module = train_module
        self.original = getattr(train_module, "load_dataset", None)
        if self.original is not None and not getattr(self.original, "_privgrad_cached", False):
            original = self.original

            def cached(name, data_dir=None, limit_train=None):
                key = (name, str(data_dir), limit_train)
                if key not in _DATA_CACHE:
                    if len(_DATA_CACHE) >= 4:
                        _DATA_CACHE.clear()
                    _DATA_CACHE[key] = original(name, data_dir, limit_train)
                return _DATA_CACHE[key]
            cached._privgrad_cached = True
            train_module.load_dataset = cached
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.module.load_dataset = self.original
        return False


def _init_worker(threads: int) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(threads)


@dataclass
class Plan:
    experiment: Experiment
    cells: list[Cell]
    done: dict[str, dict]            # cell key -> record, for cells skipped
    todo: list[Cell]


def check_runnable(experiment: Experiment, arms: list[str] | None = None) -> None:
    """One-line PrivgradError if the experiment (or the chosen arms) cannot run here."""
    if not experiment.runnable:
        raise PrivgradError(f"experiment '{experiment.id}' cannot be reproduced here: {experiment.reason}")
    missing = experiment.missing(arms)
    if missing:
        runnable_arms = [a.name for a in experiment.arms if not experiment.missing([a.name])]
        hint = (f"; run the others with {' '.join(repr('--arm=' + n) for n in runnable_arms)}"
                if runnable_arms else "")
        raise PrivgradError(f"experiment '{experiment.id}' needs {', '.join(missing)}, which this "
                            f"privgrad does not have (yet){hint}")


def plan(experiment: Experiment, store, quick: bool = False, seeds: list[int] | None = None,
         arms: list[str] | None = None, force: bool = False, any_version: bool = False,
         data_dir: str | None = None) -> Plan:
    check_runnable(experiment, arms)
    cells = experiment.cells(quick=quick, seeds=seeds, arms=arms, data_dir=data_dir)
    finished = {} if force else completed_cells(store, None if any_version else code_version())
    done = {c.key: finished[c.key] for c in cells if c.key in finished}
    todo, seen = [], set()
    for c in cells:
        if c.key not in done and c.key not in seen:
            todo.append(c)
            seen.add(c.key)
    return Plan(experiment, cells, done, todo)


def reproduce(experiment: Experiment, db: str | Path, quick: bool = False, seeds: list[int] | None = None,
              jobs: int = 1, arms: list[str] | None = None, force: bool = False,
              any_version: bool = False, progress: bool = True, data_dir: str | None = None,
              echo=print) -> dict:
    """Runs the cells of ``experiment`` that are not done yet; returns a summary dict."""
    from tqdm.auto import tqdm

    from .store import RunStore, git_commit
    check_runnable(experiment, arms)
    store = RunStore(db)
    try:
        p = plan(experiment, store, quick, seeds, arms, force, any_version, data_dir)
    finally:
        store.close()
    version, commit = code_version(), git_commit()
    echo(f"{experiment.id}{' (quick)' if quick else ''}: {len(p.cells)} cells, {len(p.done)} already "
         f"done with this config and code version ({version}), {len(p.todo)} to run")
    results, failures = dict(p.done), []
    total = sum(_cost(c) for c in p.todo)
    bar = tqdm(total=total, disable=not progress or not p.todo, smoothing=0, dynamic_ncols=True,
               desc=experiment.id, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                              "[{elapsed} elapsed, about {remaining} left]")
    finished = 0

    def advance(cell: Cell, record: dict) -> None:
        nonlocal finished
        finished += 1
        bar.set_description_str(f"{experiment.id} {finished}/{len(p.todo)} cells", refresh=False)
        bar.update(_cost(cell))
        if "error" in record:
            failures.append((cell, record["error"]))
            bar.write(f"  ✗ {cell.label()}: {record['error']}", file=sys.stderr)
        else:
            results[cell.key] = record
            mark = "smoke run: not a result:" if quick else "✓"  # --quick cells learn next to nothing
            bar.write(f"  {mark} {cell.label()}: accuracy {record['test_accuracy']:.4f}, "
                      f"ε {_fmt(record.get('epsilon'))} (claimed {_fmt(record.get('epsilon_claimed'))}) "
                      f"[{record.get('wall_time_s', 0):.0f} s]", file=sys.stderr)

    bar.set_description_str(f"{experiment.id} 0/{len(p.todo)} cells")
    started = time.time()
    try:
        if jobs <= 1 or len(p.todo) <= 1:
            for cell in p.todo:
                advance(cell, run_cell(_cell_payload(cell, str(db), version, commit,
                                                     progress and jobs <= 1)))
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed
            threads = max(1, (os.cpu_count() or 1) // jobs)
            with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_init_worker, initargs=(threads,)) as pool:
                futures = {pool.submit(run_cell, _cell_payload(c, str(db), version, commit, False)): c
                           for c in p.todo}
                try:
                    for fut in as_completed(futures):
                        try:
                            record = fut.result()
                        except Exception as err:      # a worker died
                            record = {"error": f"{type(err).__name__}: {err}"}
                        advance(futures[fut], record)
                except KeyboardInterrupt:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        bar.close()
    return {"experiment": experiment.id, "cells": p.cells, "skipped": len(p.done),
            "ran": len(p.todo) - len(failures), "failures": failures, "records": results,
            "code_version": version, "wall_time_s": time.time() - started}


def _fmt(eps) -> str:
    return "∞" if eps is None or (isinstance(eps, float) and math.isinf(eps)) else f"{eps:.3f}"


# --------------------------------------------------------------------------- export


def export_records(experiment: Experiment, cells: list[Cell], records: dict[str, dict],
                   results_dir: str | Path | None = None) -> Path | None:
    """Writes the grid's completed records to ``results/reproduce/<id>.json`` (a JSON list),
    keeping records of cells that file already holds and this run did not redo."""
    from .store import to_json
    path = Path(results_dir or RESULTS_DIR) / EXPORT_SUBDIR / f"{experiment.id}.json"
    order = {c.key: i for i, c in enumerate(cells)}
    fresh = {k: {kk: vv for kk, vv in r.items() if kk != "run_id"} for k, r in records.items() if k in order}
    if not fresh:
        return None
    kept = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = []
        kept = [r for r in old if isinstance(r, dict) and r.get("cell") not in fresh]
    new = sorted(fresh.items(), key=lambda kv: order[kv[0]])
    out = kept + [r for _, r in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(to_json(out)), indent=1, ensure_ascii=False) + "\n")
    return path
