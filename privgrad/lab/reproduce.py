"""``privgrad reproduce``: one paper table as a grid of ordinary training runs.

An *experiment* is a TOML file in ``experiments/`` (format: ``docs/experiments.md``): the
paper table it reproduces (with the paper's own numbers as reference data), the dataset
and model, one ``[[arms]]`` entry per method (mechanism and hyper-parameters), the ε grid,
the seeds, what was scaled down and why, and a ``[quick]`` section small enough for CI.

Every cell of the grid (arm × ε × target × seed) is a :class:`~privgrad.app.train.TrainConfig`
run through the normal :func:`~privgrad.app.train.train` path into the run store. A cell is
identified by a canonical hash of its TrainConfig (:func:`cell_key`); it is skipped when
the run store already holds a completed run with the same key *and* the same code
version (:func:`code_version`, a hash of the training code), so an interrupted
reproduction resumes where it stopped (a cell stopped mid-run from its checkpoint:
:func:`resumable_runs`) and a code change reruns what it may affect.

An experiment with a ``[search]`` section first chooses the hyper-parameters of each
searched arm on a held-out validation split (:func:`resolve`): the same budget for every
searched arm, the setting with the best mean validation accuracy over the search seeds, a
grid extended while its best value sits on an edge; only then are the test cells planned,
with the chosen values. Every test record says how its hyper-parameters were chosen
(``"selection"``); the search records are exported beside the test records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from privgrad.errors import PrivgradError
from privgrad.records import code_version

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS_DIR = REPO_ROOT / "experiments"
RESULTS_DIR = REPO_ROOT / "results"
EXPORT_SUBDIR = "reproduce"  # full runs are exported to results/reproduce/<id>.json

TARGETS = ("honest", "claimed")
DEFAULT_METRIC = "test accuracy (%)"
# Sizes used only to weight the overall progress bar (not for any result).
_TRAIN_SIZES = {
    "mnist": 60000,
    "fashion-mnist": 60000,
    "imdb": 25000,
    "adult": 32561,
    "cifar10": 4000,
}
# Relative cost of a training example, cnn = 1: the median wall time per example of the committed
# results/reproduce records (2 CPU cores, 2026-11), for the ETA only. wrn: WRN-16-1 (wider is
# dearer).
_MODEL_COST = {
    "bilstm": 4.5,
    "lenet5": 2.5,
    "lenet5-bc": 1.5,
    "model1": 1.5,
    "model2": 25.0,
    "model3": 60.0,
    "wrn": 15.0,
}

_TOP_KEYS = {
    "id",
    "title",
    "paper",
    "table",
    "section",
    "page",
    "seed_file",
    "seed_line",
    "spec",
    "proposed",
    "metric",
    "runnable",
    "reason",
    "notes",
    "scaled_down",
    "paper_privacy",
    "base",
    "grid",
    "quick",
    "arms",
    "search",
    "columns",
}
_ARM_KEYS = {
    "name",
    "private",
    "targets",
    "paper",
    "paper_note",
    "epsilon",
    "match_activation",
    "match_record",
    "note",
    "search",
    "paper_columns",
}
# TrainConfig fields the harness sets for every cell (a config may not set them for search runs)
_HARNESS_FIELDS = frozenset(
    {"epsilon", "noise_multiplier", "target", "seed", "validation", "data_dir"}
)
# fields a search may not vary: set by the harness, part of the equal budget, or the task itself
_NOT_AXES = _HARNESS_FIELDS | {"epochs", "limit_train", "delta", "dataset"}
# TrainConfig tables whose single options a search axis may name (mechanism_options.filter_ratio)
_OPTION_TABLES = ("mechanism_options", "model_options")
# [quick] keys that are not TrainConfig overrides of the test cells
_QUICK_HARNESS_KEYS = ("epsilon", "seeds", "validation", "max_extensions")
DEFAULT_MAX_EXTENSIONS = 3
PAPER_SELECTION = {"on": "paper"}


def _train_fields() -> set[str]:
    from privgrad.app.train import TrainConfig

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
_LATER_FIELDS = {
    "validation": 0,
    "device": "auto",
    "precision": "fp32",
    "limit_test": None,
    "prior": None,
    "dataset_options": {},
}


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


# --------------------------------------------------------------------------- experiments


@dataclass
class Arm:
    name: str
    fields: dict  # TrainConfig overrides (mechanism, lr, ...)
    private: bool = True
    targets: tuple[str, ...] = ("honest",)
    paper: dict = field(default_factory=dict)  # nominal ε (None: non-private) -> paper's number
    paper_note: str = ""
    epsilon: list[float] | None = None
    match_activation: tuple[str, ...] = ()
    match_record: dict = field(
        default_factory=dict
    )  # record field (dotted path) -> value it must have
    note: str = ""
    space: dict | None = None  # search axes (name -> values); None: run at the stated setting
    paper_columns: dict = field(
        default_factory=dict
    )  # nominal ε (None: non-private) -> the paper's
    # values of the experiment's columns, in order


@dataclass
class Search:
    """The ``[search]`` section: how the searched arms' hyper-parameters are chosen."""

    validation: int  # held-out training examples the search evaluates on
    seeds: list[int]
    overrides: dict  # TrainConfig overrides of every search run (every arm alike)
    epsilon: float | None  # tune at this ε only (None: at each ε and target of the grid)
    max_extensions: int  # per axis
    space: dict  # [search.space]: the default axes (name -> values) of every arm


@dataclass
class Cell:
    experiment: str
    arm: str
    epsilon: float | None  # the nominal ε of the cell (None: non-private)
    target: str | None
    seed: int
    config: object  # TrainConfig
    key: str
    quick: bool
    point: dict | None = None  # a search cell: the grid point it evaluates
    selection: dict | None = None  # a test cell: how its hyper-parameters were chosen

    def label(self) -> str:
        if self.point is not None:
            unit = _unit_label(self.arm, self.epsilon, self.target)
            return f"search {unit} {_point_text(self.point)} seed {self.seed}"
        return f"{_unit_label(self.arm, self.epsilon, self.target)} seed {self.seed}"


def _unit_label(arm: str, epsilon: float | None, target: str | None) -> str:
    eps = "" if epsilon is None else f" ε={_g(epsilon)}"
    tgt = "" if target in (None, "honest") else f" ({target} ε)"
    return f"{arm}{eps}{tgt}"


def _point_text(point: dict) -> str:
    return " ".join(f"{k}={_g(v)}" for k, v in point.items())


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
    search: Search | None = None
    proposed: tuple[
        str, ...
    ] = ()  # the mechanisms the paper proposes (privgrad names), for the Findings
    columns: dict = field(
        default_factory=dict
    )  # title -> dotted record path: more measurements per row
    # the paper's own accounting ([paper_privacy]): accountant, epochs, and where the seed says so
    paper_privacy: dict = field(default_factory=dict)

    # -- grid ---------------------------------------------------------------------------

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise PrivgradError(
            f"experiment '{self.id}' has no arm '{name}'; arms: "
            + ", ".join(f"'{a.name}'" for a in self.arms)
        )

    def arm_epsilons(self, arm: Arm, quick: bool = False) -> list[float | None]:
        if not arm.private:
            return [None]
        grid = arm.epsilon if arm.epsilon is not None else self.epsilons
        if quick and "epsilon" in self.quick:
            grid = [
                e for e in grid if any(math.isclose(e, q) for q in self.quick["epsilon"])
            ] or grid[:1]
        return list(grid)

    def train_config(
        self,
        arm: Arm,
        epsilon: float | None,
        target: str | None,
        seed: int,
        quick: bool = False,
        data_dir: str | None = None,
        point: dict | None = None,
        search: bool = False,
    ):
        """The TrainConfig of one cell: [base], the arm, (for a search run) the search
        overrides, (with ``quick``) [quick], the grid ``point`` (searched values), then the
        harness fields; a search run evaluates on the validation split."""
        from privgrad.app.train import TrainConfig

        values = {**EXPERIMENT_DEFAULTS, **self.base, **arm.fields}
        if search:
            values.update(self.search.overrides)
        if quick:
            values.update({k: v for k, v in self.quick.items() if k not in _QUICK_HARNESS_KEYS})
        values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
        for name, value in (point or {}).items():
            table, _, key = name.partition(".")
            if key:  # a dotted axis sets one option: mechanism_options.filter_ratio
                values[table] = {**(values.get(table) or {}), key: value}
            else:
                values[name] = dict(value) if isinstance(value, dict) else value
        if arm.private:
            values.update(epsilon=float(epsilon), noise_multiplier=None, target=target)
        else:
            values.update(epsilon=None, noise_multiplier=0.0, target="honest")
        values.update(
            seed=int(seed),
            data_dir=data_dir,
            validation=self.search_validation(quick) if search else 0,
        )
        try:
            config = TrainConfig(**values)
            config.validate()
        except (PrivgradError, TypeError) as err:  # a badly typed or unknown value in the config
            raise PrivgradError(f"{self.path}: arm '{arm.name}': {err}") from None
        return config

    def cells(
        self,
        quick: bool = False,
        seeds: list[int] | None = None,
        arms: list[str] | None = None,
        data_dir: str | None = None,
        choices: dict | None = None,
    ) -> list[Cell]:
        """The test grid. A searched arm's cells need its choice: ``choices`` maps
        :meth:`search_key` to a selection (:meth:`Choice.selection`); without one they are left
        out."""
        if seeds is None:
            seeds = list(self.quick.get("seeds", self.seeds[:1])) if quick else list(self.seeds)
        chosen = [self.arm(n) for n in arms] if arms else self.arms
        out = []
        for arm in chosen:
            for eps in self.arm_epsilons(arm, quick):
                for target in arm.targets if arm.private else (None,):
                    selection = PAPER_SELECTION
                    if arm.space is not None:
                        selection = (choices or {}).get(self.search_key(arm, eps, target))
                        if selection is None:
                            continue
                    point = selection.get("chosen")
                    for seed in seeds:
                        cfg = self.train_config(arm, eps, target, seed, quick, data_dir, point)
                        out.append(
                            Cell(
                                self.id,
                                arm.name,
                                eps,
                                target,
                                seed,
                                cfg,
                                cell_key(cfg),
                                quick,
                                selection=dict(selection),
                            )
                        )
        return out

    def test_units(
        self, quick: bool = False, arms: list[str] | None = None
    ) -> list[tuple[Arm, float | None, str | None]]:
        """(arm, ε, target) of every row of the test grid."""
        return [
            (arm, eps, target)
            for arm in ([self.arm(n) for n in arms] if arms else self.arms)
            for eps in self.arm_epsilons(arm, quick)
            for target in (arm.targets if arm.private else (None,))
        ]

    def n_test_cells(self, quick: bool = False) -> int:
        """The size of the test grid (searched arms included, chosen or not)."""
        return len(self.test_units(quick)) * len(
            self.quick.get("seeds", self.seeds[:1]) if quick else self.seeds
        )

    def size_text(self) -> str:
        """How many runs the grid takes (for ``--list``)."""

        def count(quick):
            test = self.n_test_cells(quick)
            if not self.search:
                return f"{test}"
            runs = sum(
                math.prod(len(v) for v in arm.space.values())
                for arm, _, _ in self.search_units(quick)
            )
            return f"{runs * len(self.search_seeds(quick))} search + {test} test"

        return f"{count(False)} cells ({count(True)} with --quick)"

    # -- search -------------------------------------------------------------------------

    def search_key(self, arm: Arm, epsilon: float | None, target: str | None) -> tuple:
        """(arm, ε, target) of the search that chooses the settings of this test-grid row."""
        if not arm.private:
            return (arm.name, None, None)
        if self.search.epsilon is not None:
            return (
                arm.name,
                self.search.epsilon,
                "honest" if "honest" in arm.targets else arm.targets[0],
            )
        return (arm.name, epsilon, target)

    def search_units(
        self, quick: bool = False, arms: list[str] | None = None
    ) -> list[tuple[Arm, float | None, str | None]]:
        """(arm, ε, target) of every search to run, in grid order."""
        out, seen = [], set()
        for arm, eps, target in self.test_units(quick, arms):
            if arm.space is None:
                continue
            key = self.search_key(arm, eps, target)
            if key not in seen:
                seen.add(key)
                out.append((arm, key[1], key[2]))
        return out

    def search_seeds(self, quick: bool = False) -> list[int]:
        return (
            list(self.quick.get("seeds", self.search.seeds[:1]))
            if quick
            else list(self.search.seeds)
        )

    def search_validation(self, quick: bool = False) -> int:
        return int(self.quick["validation"]) if quick else self.search.validation

    def max_extensions(self, quick: bool = False) -> int:
        return (
            int(self.quick.get("max_extensions", self.search.max_extensions))
            if quick
            else self.search.max_extensions
        )

    def search_file(self) -> str:
        return f"results/{EXPORT_SUBDIR}/{self.id}.search.json"

    def epochs(
        self,
        arm: Arm,
        epsilon: float | None,
        target: str | None,
        quick: bool = False,
        search: bool = False,
    ) -> float:
        """The epochs an arm's search runs (``search``) or test runs train."""
        point = {k: v[0] for k, v in arm.space.items()} if search else None
        return self.train_config(arm, epsilon, target, 0, quick, point=point, search=search).epochs

    def search_epochs_caveat(self, quick: bool = False) -> str | None:
        """Says so where a private arm's search trains for other epochs than its test runs:
        σ for a fixed ε depends on the number of steps, so such a search tunes at another
        noise level than the test (None where every private search matches its test)."""
        for arm, eps, target in self.search_units(quick):
            if not arm.private:
                continue
            searched, tested = (
                self.epochs(arm, eps, target, quick, search) for search in (True, False)
            )
            if searched != tested:
                fewer = searched < tested
                return (
                    f"the search trains {_g(searched)} epochs, the test runs {_g(tested)}: "
                    f"σ for the same ε is {'smaller' if fewer else 'larger'} over "
                    f"{'fewer' if fewer else 'more'} steps, so the search tuned at "
                    f"{'less' if fewer else 'more'} noise than the test runs train with"
                )
        return None

    def search_cells(
        self,
        arm: Arm,
        epsilon: float | None,
        target: str | None,
        axes: dict,
        quick: bool = False,
        data_dir: str | None = None,
    ) -> list[Cell]:
        """Every (grid point, search seed) of ``axes``, in grid order."""
        out = []
        for values in itertools.product(*axes.values()):
            point = dict(zip(axes, values))
            for seed in self.search_seeds(quick):
                cfg = self.train_config(
                    arm, epsilon, target, seed, quick, data_dir, point, search=True
                )
                out.append(
                    Cell(
                        self.id,
                        arm.name,
                        epsilon,
                        target,
                        seed,
                        cfg,
                        cell_key(cfg),
                        quick,
                        point=point,
                    )
                )
        return out

    def missing(self, arms: list[str] | None = None) -> list[str]:
        """Mechanisms, models and datasets the arms need that this privgrad lacks."""
        from privgrad.app.data import DATASETS
        from privgrad.mechanisms import MECHANISMS
        from privgrad.app.models import MODELS

        need = []
        for arm in [self.arm(n) for n in arms] if arms else self.arms:
            values = {**self.base, **arm.fields}
            for kind, name, have in (
                ("mechanism", values.get("mechanism", "dpsgd"), MECHANISMS),
                ("model", values.get("model", "cnn"), MODELS),
                ("dataset", values.get("dataset", "mnist"), DATASETS),
            ):
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


def load_experiment(
    name_or_path: str | Path, experiments_dir: str | Path | None = None
) -> Experiment:
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


def _paper_columns(raw, private: bool, n: int, where: str) -> dict:
    """An arm's ``paper_columns``: a list of the paper's values of the experiment's columns (a
    non-private arm), or a table of such lists keyed by ε."""
    tables = {None: raw} if not private and isinstance(raw, list) else raw
    if not isinstance(tables, dict):
        raise PrivgradError(
            f"{where}: 'paper_columns' must be a table keyed by ε of lists (a list for a "
            "non-private arm)"
        )
    out = {}
    for k, values in tables.items():
        if (
            not isinstance(values, list)
            or len(values) != n
            or not all(isinstance(v, (int, float)) for v in values)
        ):
            raise PrivgradError(
                f"{where}: paper_columns must give one number per [columns] entry ({n}), got "
                f"{values!r}"
            )
        out[k if k is None else _eps_key(k, where)] = [float(v) for v in values]
    return out


# [paper_privacy] accountant: the accountant a paper computed its ε with; "own" = the paper's own
# bound, which privgrad's claimed ε already follows (RDP-GAN's Thms 1-4); "rdp-mironov" = RDP
# converted to (ε, δ) by Mironov's ε = RDP(α) + log(1/δ)/(α − 1), the conversion a paper states
# (Spectral-DP's and GReDP's Proposition 1), where "rdp" converts as Opacus does
PAPER_ACCOUNTANTS = ("rdp", "rdp-mironov", "pld", "own")


def _parse_paper_privacy(raw, where: str) -> dict:
    """``[paper_privacy]``: how the paper computed its ε (``accountant``, one of
    :data:`PAPER_ACCOUNTANTS`, with ``accountant_source``, the seed text that says so) and, where
    the paper states them, the ``epochs`` its table trained for (``epochs_source``: the passage,
    or why there is none). The report recomputes the claimed ε with that accountant, at our
    epochs and at the paper's."""
    pw = f"{where}: [paper_privacy]"
    if not isinstance(raw, dict):
        raise PrivgradError(f"{pw} must be a table")
    bad = set(raw) - {"accountant", "accountant_source", "epochs", "epochs_source"}
    if bad:
        raise PrivgradError(f"{pw} has unknown key(s) {', '.join(sorted(bad))}")
    if not raw:
        return {}
    if raw.get("accountant") not in PAPER_ACCOUNTANTS:
        raise PrivgradError(
            f"{pw} accountant must be one of {', '.join(PAPER_ACCOUNTANTS)}, "
            f"got {raw.get('accountant')!r}"
        )
    for key in ("accountant_source", "epochs_source"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise PrivgradError(f"{pw} needs '{key}': the seed text that states it, or why not")
    epochs = raw.get("epochs")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0
    ):
        raise PrivgradError(f"{pw} epochs must be a positive number, got {epochs!r}")
    out = dict(raw)
    for key in ("accountant_source", "epochs_source"):
        out[key] = " ".join(raw[key].split())
    return out


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
    proposed = raw.get("proposed", [])
    if not isinstance(proposed, list) or not all(isinstance(m, str) and m for m in proposed):
        raise PrivgradError(
            f"{where}: 'proposed' must be a list of mechanism names, got {proposed!r}"
        )
    if not runnable and not str(raw.get("reason", "")).strip():
        raise PrivgradError(f"{where}: runnable = false needs a 'reason'")
    base = dict(raw.get("base", {}))
    bad = set(base) - fields
    if bad:
        raise PrivgradError(f"{where}: [base] has non-TrainConfig key(s) {', '.join(sorted(bad))}")
    if "validation" in base:
        raise PrivgradError(
            f"{where}: [base] sets 'validation': a validation split belongs in [search]"
        )
    search = _parse_search(raw["search"], where, fields) if "search" in raw else None
    grid = dict(raw.get("grid", {}))
    bad = set(grid) - {"epsilon", "seeds"}
    if bad:
        raise PrivgradError(
            f"{where}: [grid] takes only 'epsilon' and 'seeds', got {', '.join(sorted(bad))}"
        )
    epsilons = [float(e) for e in grid.get("epsilon", [])]
    seeds = [int(s) for s in grid.get("seeds", [0])]
    quick = dict(raw.get("quick", {}))
    bad = set(quick) - fields - set(_QUICK_HARNESS_KEYS)
    if bad:
        raise PrivgradError(f"{where}: [quick] has unknown key(s) {', '.join(sorted(bad))}")
    if runnable and not {"limit_train", "epochs"} <= set(quick):
        raise PrivgradError(f"{where}: a runnable experiment needs [quick] limit_train and epochs")
    if search is None and {"validation", "max_extensions"} & set(quick):
        raise PrivgradError(
            f"{where}: [quick] validation and max_extensions are settings of the quick "
            "search: they need a [search] section"
        )
    if search is not None and "validation" not in quick:
        raise PrivgradError(
            f"{where}: an experiment with [search] needs [quick] validation (the quick "
            "search's held-out examples)"
        )
    if search is not None:
        _check_count(quick.get("validation", 1), f"{where}: [quick] validation", 1)
        _check_count(quick.get("max_extensions", 0), f"{where}: [quick] max_extensions", 0)
    columns = raw.get("columns", {})
    if not isinstance(columns, dict) or not all(isinstance(v, str) and v for v in columns.values()):
        raise PrivgradError(
            f"{where}: [columns] maps a column title to a dotted record path, got {columns!r}"
        )
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
        if "validation" in overrides:
            raise PrivgradError(
                f"{aw} ('{a['name']}'): sets 'validation': a validation split belongs in [search]"
            )
        space = _arm_space(a, search, f"{aw} ('{a['name']}')")
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
            raise PrivgradError(
                f"{aw}: 'paper' must be a table keyed by ε (or a number for a non-private arm)"
            )
        paper_columns = _paper_columns(a.get("paper_columns", {}), private, len(columns), aw)
        arm_eps = [float(e) for e in a["epsilon"]] if "epsilon" in a else None
        if private and not (arm_eps or epsilons):
            raise PrivgradError(f"{aw}: a private arm needs an ε grid")
        values = {**base, **overrides}
        act = values.get("activation", "tanh")
        arms.append(
            Arm(
                name=a["name"],
                fields=overrides,
                private=private,
                targets=targets,
                paper=paper,
                paper_note=a.get("paper_note", ""),
                epsilon=arm_eps,
                match_activation=tuple(a.get("match_activation", [act])),
                match_record=dict(a.get("match_record", {})),
                note=a.get("note", ""),
                space=space,
                paper_columns=paper_columns,
            )
        )
    exp = Experiment(
        id=raw["id"],
        title=raw["title"],
        paper=raw["paper"],
        table=raw["table"],
        section=raw.get("section", ""),
        page=str(raw.get("page", "")),
        seed_file=raw.get("seed_file", ""),
        seed_line=raw.get("seed_line"),
        spec=raw.get("spec", ""),
        metric=raw.get("metric", DEFAULT_METRIC),
        runnable=runnable,
        reason=str(raw.get("reason", "")).strip(),
        notes=str(raw.get("notes", "")).strip(),
        scaled_down=dict(raw.get("scaled_down", {})),
        base=base,
        epsilons=epsilons,
        seeds=seeds,
        quick=quick,
        arms=arms,
        path=path,
        search=search,
        proposed=tuple(proposed),
        columns=dict(columns),
        paper_privacy=_parse_paper_privacy(raw.get("paper_privacy", {}), where),
    )
    if search is not None:
        _check_budget(exp, where)
    if runnable:
        for quick_mode in (False, True):  # every cell must build a valid TrainConfig
            exp.cells(quick=quick_mode)
            for arm, eps, target in exp.search_units(
                quick_mode
            ):  # at every point of the initial grid
                exp.search_cells(arm, eps, target, arm.space, quick_mode)
                for values in itertools.product(*arm.space.values()):
                    exp.train_config(
                        arm, eps, target, 0, quick_mode, point=dict(zip(arm.space, values))
                    )
    return exp


def _check_count(value, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PrivgradError(f"{where} must be an integer ≥ {minimum}, got {value!r}")
    return value


def _parse_search(raw, where: str, fields: set[str]) -> Search:
    if not isinstance(raw, dict):
        raise PrivgradError(f"{where}: [search] must be a table")
    raw = dict(raw)
    sw = f"{where}: [search]"
    space = raw.pop("space", None)
    space = {} if space is None else _parse_space(space, f"{sw}.space")
    if "validation" not in raw:
        raise PrivgradError(f"{sw} needs 'validation' (the number of held-out training examples)")
    validation = _check_count(raw.pop("validation"), f"{sw} validation", 1)
    seeds = raw.pop("seeds", None)
    if (
        not isinstance(seeds, list)
        or not seeds
        or len(set(seeds)) < len(seeds)
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)
    ):
        raise PrivgradError(
            f"{sw} needs 'seeds', a list of distinct integers (e.g. [0, 1]), got {seeds!r}"
        )
    epsilon = raw.pop("epsilon", None)
    if epsilon is not None and (
        isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0
    ):
        raise PrivgradError(f"{sw} epsilon must be a number > 0, got {epsilon!r}")
    max_extensions = _check_count(
        raw.pop("max_extensions", DEFAULT_MAX_EXTENSIONS), f"{sw} max_extensions", 0
    )
    bad = set(raw) - fields
    if bad:
        raise PrivgradError(f"{sw} has unknown key(s) {', '.join(sorted(bad))}")
    bad = set(raw) & _HARNESS_FIELDS
    if bad:
        raise PrivgradError(
            f"{sw} cannot set {', '.join(sorted(bad))}: the harness sets it for every run"
        )
    return Search(
        validation=validation,
        seeds=seeds,
        overrides=raw,
        epsilon=None if epsilon is None else float(epsilon),
        max_extensions=max_extensions,
        space=space,
    )


def _arm_space(arm: dict, search: Search | None, where: str) -> dict | None:
    """The arm's search axes: its own ``search`` table, else [search.space]; None for
    ``search = false`` or an experiment without [search]."""
    own = arm.get("search")
    if own is not None and search is None:
        raise PrivgradError(f"{where}: 'search' needs a [search] section")
    if search is None or own is False:
        return None
    if own is None:
        if not search.space:
            raise PrivgradError(
                f"{where}: no search space: give [search.space], 'search = {{ lr = [...] }}' "
                "or 'search = false' (run at the stated setting)"
            )
        return {k: list(v) for k, v in search.space.items()}
    if not isinstance(own, dict):
        raise PrivgradError(
            f"{where}: 'search' must be a table of axes (search = {{ lr = [...] }}) or false"
        )
    return _parse_space(own, f"{where}: search")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _parse_space(space: dict, where: str) -> dict[str, list]:
    if not isinstance(space, dict) or not space:
        raise PrivgradError(
            f"{where}: a search space is a table of at least one axis, e.g. lr = [0.5, 1, 2]"
        )
    fields = _train_fields()
    out = {}
    for name, values in space.items():
        table, dot, key = name.partition(".")
        if dot and (table not in _OPTION_TABLES or not key or "." in key):
            raise PrivgradError(
                f"{where}: unknown search axis '{name}' (a dotted axis names one option of "
                f"{' or '.join(_OPTION_TABLES)}, e.g. mechanism_options.filter_ratio)"
            )
        if not dot and name not in fields:
            raise PrivgradError(f"{where}: unknown search axis '{name}' (not a TrainConfig field)")
        if name in _NOT_AXES:
            raise PrivgradError(
                f"{where}: '{name}' cannot be searched (the harness sets it, or it is part of "
                "the equal budget)"
            )
        if not isinstance(values, list) or len(values) < 2:
            raise PrivgradError(
                f"{where}: search axis '{name}' needs a list of at least 2 values, got {values!r}"
            )
        if all(_is_number(v) for v in values):
            if any(not b > a for a, b in zip(values, values[1:])):
                raise PrivgradError(
                    f"{where}: the values of search axis '{name}' must increase, got {values}"
                )
        elif len({json.dumps(v, sort_keys=True) for v in values}) < len(values):
            raise PrivgradError(f"{where}: search axis '{name}' repeats a value: {values}")
        out[name] = list(values)
    return out


def _check_budget(exp: Experiment, where: str) -> None:
    """Every searched arm gets the same budget: grid points, seeds, epochs, validation size
    (seeds and validation are [search]'s own, so alike by construction)."""
    searched = [a for a in exp.arms if a.space is not None]
    if not searched:
        return
    first = searched[0]
    size = math.prod(len(v) for v in first.space.values())
    for arm in searched[1:]:
        n = math.prod(len(v) for v in arm.space.values())
        if n != size:
            raise PrivgradError(
                f"{where}: arm '{arm.name}' searches {n} grid points, arm '{first.name}' {size}: "
                "every searched arm gets the same budget"
            )
    for quick in (False, True):
        epochs = {}
        for arm, eps, target in exp.search_units(quick):
            epochs.setdefault(arm.name, exp.epochs(arm, eps, target, quick, search=True))
        if len(set(epochs.values())) > 1:
            arm = next(n for n, e in epochs.items() if e != epochs[first.name])
            raise PrivgradError(
                f"{where}: arm '{arm}' searches with {_g(epochs[arm])} epochs, arm '{first.name}' "
                f"with {_g(epochs[first.name])}{' (with --quick)' if quick else ''}: every "
                "searched arm gets the same budget (set epochs in [search])"
            )


def list_experiments(experiments_dir: str | Path | None = None) -> list[Experiment]:
    folder = Path(experiments_dir or EXPERIMENTS_DIR)
    if not folder.is_dir():
        raise PrivgradError(
            f"no experiments folder {folder}; pass --experiments-dir an existing folder"
        )
    return [load_experiment(p) for p in sorted(folder.glob("*.toml"))]


# --------------------------------------------------------------------------- the run store


def _record_cell(record: dict, config: dict | None) -> str | None:
    if record.get("cell"):
        return record["cell"]
    return cell_key(config) if config else None


def completed_cells(store, version: str | None) -> dict[str, dict]:
    """cell key -> latest completed record with that key (and code version, unless None)."""
    done: dict[str, dict] = {}
    for row in reversed(store.runs(status="completed")):  # oldest first; later wins
        rec = row["record"] or {}
        try:
            key = _record_cell(rec, row["config"])
        except PrivgradError:
            continue
        if key is None or (version is not None and rec.get("code_version") != version):
            continue
        done[key] = {**rec, "run_id": row["id"]}
    return done


def committed_cells(
    experiment: Experiment, version: str | None, results_dir: str | Path | None = None
) -> dict[str, dict]:
    """cell key -> record, from the experiment's exported files (``results/reproduce/<id>.json``
    and ``<id>.search.json``), with that code version unless None: what a fresh checkout,
    whose run store is empty, resumes a committed grid from."""
    done: dict[str, dict] = {}
    for suffix in ("", ".search"):
        path = _export_path(experiment, results_dir, suffix)
        for rec in _read_export(path, "repair it or leave out --from-results"):
            if (
                isinstance(rec, dict)
                and rec.get("cell")
                and (version is None or rec.get("code_version") == version)
            ):
                done[rec["cell"]] = rec
    return done


def _export_path(experiment: Experiment, results_dir: str | Path | None, suffix: str = "") -> Path:
    """``results/reproduce/<id><suffix>.json`` (``suffix`` "" for the test grid, ".search")."""
    return Path(results_dir or RESULTS_DIR) / EXPORT_SUBDIR / f"{experiment.id}{suffix}.json"


def _read_export(path: Path, remedy: str) -> list:
    """The records an exported file holds ([] if there is none); invalid JSON is an error
    that names ``remedy``."""
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PrivgradError(f"{path} is not valid JSON ({err}); {remedy}") from None


def _finished(
    experiment: Experiment,
    store,
    force: bool,
    any_version: bool,
    from_results: bool,
    results_dir: str | Path | None,
) -> dict[str, dict]:
    """The cells that count as done: the run store's, plus (``from_results``) the committed ones."""
    if force:
        return {}
    version = None if any_version else code_version()
    committed = committed_cells(experiment, version, results_dir) if from_results else {}
    return {**committed, **completed_cells(store, version)}


def _cost(cell: Cell) -> float:
    cfg = cell.config
    n = cfg.limit_train or _TRAIN_SIZES.get(cfg.dataset, 10000)
    return max(1.0, cfg.epochs * n * _MODEL_COST.get(cfg.model, 1.0) / 1000) + 2.0


# --------------------------------------------------------------------------- search


def next_value(values: list, side: str):
    """The next value of a numeric axis beyond its ``"low"`` or ``"high"`` edge: by the grid's
    ratio at that edge when every value is positive and the grid is not linear (a geometric
    grid keeps its ratio), else by the step at that edge (a linear grid keeps its step)."""
    inner, edge = (values[1], values[0]) if side == "low" else (values[-2], values[-1])
    steps = [b - a for a, b in zip(values, values[1:])]
    linear = all(math.isclose(d, steps[0], rel_tol=1e-9) for d in steps)
    ratios = [b / a for a, b in zip(values, values[1:])] if all(v > 0 for v in values) else []
    geometric = bool(ratios) and all(math.isclose(r, ratios[0], rel_tol=1e-9) for r in ratios)
    value = edge * (edge / inner) if geometric or (ratios and not linear) else edge + (edge - inner)
    if all(isinstance(v, int) for v in values):
        value = round(value)
        if value == edge:  # a ratio too small to move an integer
            value = edge + (1 if side == "high" else -1)
        return value
    return float(f"{value:.12g}")


@dataclass
class Choice:
    """One search (an arm at one ε and target): its grid as extended so far, the search
    cells of that grid, and, once they are all done, the chosen setting."""

    experiment: Experiment
    arm: Arm
    epsilon: float | None
    target: str | None
    quick: bool
    axes: dict  # axis -> values tried (the arm's grid plus extensions)
    cells: list[Cell]  # search cells of that grid
    pending: list[Cell]  # those not done yet (the choice waits for them)
    means: dict  # grid point (tuple of values) -> mean validation accuracy, points done
    chosen: dict | None = None  # set once every cell is done and no edge is to be extended
    edge: list[str] = field(default_factory=list)  # why a chosen value still sits on an edge
    flat: bool = False  # every point of the fully extended grid scored the same: no choice

    @property
    def key(self) -> tuple:
        return (self.arm.name, self.epsilon, self.target)

    def label(self) -> str:
        return _unit_label(self.arm.name, self.epsilon, self.target)

    def selection(self) -> dict:
        """The ``selection`` field of the test records this choice sets."""
        exp = self.experiment
        out = {
            "on": "validation",
            "search": exp.search_file(),
            "chosen": dict(self.chosen),
            "axes": {k: list(v) for k, v in self.axes.items()},
            "edge": bool(self.edge),
            "validation": exp.search_validation(self.quick),
            "seeds": exp.search_seeds(self.quick),
            "epsilon": self.epsilon,
            "target": self.target,
            "validation_accuracy": self.means[tuple(self.chosen.values())],
        }
        if self.edge:
            out["edge_note"] = "; ".join(self.edge)
        return out

    def state(self) -> str:
        """One line: the grid, what is done, what was chosen (for --dry-run and the log)."""
        grid = ", ".join(f"{k} [{', '.join(_g(v) for v in vals)}]" for k, vals in self.axes.items())
        done = len(self.cells) - len(self.pending)
        text = f"{self.label()}: {grid}: {done} of {len(self.cells)} search runs done"
        if self.flat:
            return text + f"; FLAT: {self.flat_text()}"
        if self.chosen is None:
            return text + (
                "; best so far "
                f"{_point_text(dict(zip(self.axes, max(self.means, key=self.means.get))))}"
                if self.means
                else ""
            )
        chosen_mean = self.means[tuple(self.chosen.values())]
        text += f"; chose {_point_text(self.chosen)} (mean validation accuracy {chosen_mean:.4f})"
        return text + (f"; ON AN EDGE: {'; '.join(self.edge)}" if self.edge else "")

    def flat_text(self) -> str:
        acc = next(iter(self.means.values()))
        return (
            f"every point scored the same mean validation accuracy ({acc:.4f}), also after "
            "extending both edges: nothing to choose, its test cells are not run; move or widen "
            "the grid in the config"
        )


def _mean_accuracies(cells: list[Cell], done: dict[str, dict]) -> dict[tuple, float]:
    """Grid point -> mean validation accuracy over the search seeds, for points whose every
    seed is done (grid order). Only validation accuracy is read: the test set chooses nothing."""
    scores: dict[tuple, list[float]] = {}
    incomplete = set()
    for c in cells:
        point = tuple(c.point.values())
        rec = done.get(c.key)
        if rec is None:
            incomplete.add(point)
            continue
        acc = rec.get("validation_accuracy")
        if acc is None:
            raise PrivgradError(
                f"the record of {c.label()} (run {rec.get('run_id')}) has no validation accuracy"
            )
        scores.setdefault(point, []).append(float(acc))
    return {p: sum(v) / len(v) for p, v in scores.items() if p not in incomplete}


def resolve(
    experiment: Experiment,
    arm: Arm,
    epsilon: float | None,
    target: str | None,
    done: dict[str, dict],
    quick: bool = False,
    data_dir: str | None = None,
) -> Choice:
    """The state of one search given the done cells: the setting with the best mean
    validation accuracy (ties: the first in grid order); while a chosen numeric value sits
    on an edge of its axis, that axis is extended by one value (:func:`next_value`, at most
    ``max_extensions`` times per axis) and the new points must run before anything is chosen.
    A flat grid, whose every point has the same mean (every run predicting one class, say),
    holds no information about where to go: it grows at both edges, and if it is still flat
    when it can grow no more, nothing is chosen (``flat``) rather than its first point (a
    ``quick`` run, which checks the pipeline, takes the first point and says so).
    The same done cells always give the same state, so a search resumes where it stopped."""
    axes = {k: list(v) for k, v in arm.space.items()}
    extended = dict.fromkeys(axes, 0)
    limit = experiment.max_extensions(quick)
    while True:
        cells = experiment.search_cells(arm, epsilon, target, axes, quick, data_dir)
        pending = [c for c in cells if c.key not in done]
        means = _mean_accuracies(cells, done)
        choice = Choice(
            experiment,
            arm,
            epsilon,
            target,
            quick,
            {k: list(v) for k, v in axes.items()},
            cells,
            pending,
            means,
        )
        if pending:
            return choice
        best = None
        for point, mean in means.items():
            if best is None or mean > means[best]:
                best = point
        chosen = dict(zip(axes, best))
        flat = len(means) > 1 and len(set(means.values())) == 1
        grew = False
        for name, values in axes.items():
            if not all(_is_number(v) for v in values):
                continue
            i = values.index(chosen[name])
            sides = (
                ["low", "high"]
                if flat
                else ["low"]
                if i == 0
                else ["high"]
                if i == len(values) - 1
                else []
            )
            for side in sides:
                value = values[0] if side == "low" else values[-1]
                if extended[name] >= limit:
                    choice.edge.append(
                        f"{name} = {_g(value)} is the {side} edge of its grid after "
                        f"{extended[name]} extension(s)"
                    )
                    continue
                new = next_value(values, side)
                try:
                    cfg = experiment.train_config(
                        arm, epsilon, target, 0, quick, data_dir, {**chosen, name: new}, search=True
                    )
                    if name.startswith("mechanism_options."):  # the mechanism checks its options
                        from privgrad.mechanisms.registry import build_mechanism

                        build_mechanism(
                            cfg.mechanism, 0.0, cfg.clip or 1.0, **cfg.mechanism_options
                        )
                except PrivgradError as err:
                    choice.edge.append(
                        f"{name} = {_g(value)} is the {side} edge of its grid, a hard limit: "
                        f"{name} = {_g(new)} is not allowed ({err})"
                    )
                    continue
                values = axes[name] = [new] + values if side == "low" else values + [new]
                extended[name] += 1
                grew = True
        if not grew:
            if flat and not quick:
                choice.flat, choice.edge = True, []
                return choice
            if flat:  # a --quick run checks the pipeline end to end and chooses nothing of note
                choice.edge = [
                    f"flat (every point {_g(next(iter(means.values())))}): the first point taken, "
                    "as a --quick run does"
                ]
            choice.chosen = chosen
            return choice


def search_state(
    experiment: Experiment,
    done: dict[str, dict],
    quick: bool = False,
    arms: list[str] | None = None,
    data_dir: str | None = None,
) -> list[Choice]:
    """Every search of the experiment (its searched arms, per ε and target unless
    ``[search] epsilon``), resolved against ``done``."""
    if experiment.search is None:
        return []
    return [
        resolve(experiment, arm, eps, target, done, quick, data_dir)
        for arm, eps, target in experiment.search_units(quick, arms)
    ]


# --------------------------------------------------------------------------- running


def _cell_payload(
    cell: Cell, db: str, version: str, commit: str | None, progress: bool, resume: int | None
) -> dict:
    return {
        "config": dataclasses.asdict(cell.config),
        "db": db,
        "progress": progress,
        "resume": resume,  # the cell's stopped run, to go on from its checkpoint
        "meta": {
            "experiment": cell.experiment,
            "arm": cell.arm,
            "cell": cell.key,
            "nominal_epsilon": cell.epsilon,
            "quick": cell.quick,
            "code_version": version,
            "git_commit": commit,
            **(
                {"search_point": cell.point}
                if cell.point is not None
                else {"selection": cell.selection}
            ),
            "command": cell_command(cell),
        },
    }


def cell_command(cell: Cell) -> str:
    return (
        f"privgrad reproduce {cell.experiment}{' --quick' if cell.quick else ''} "
        f"--arm '{cell.arm}'  # cell {cell.key}"
    )


def run_cell(payload: dict) -> dict:
    """Runs one cell through :func:`privgrad.app.train.train` (or, for a cell whose run was
    stopped, :func:`~privgrad.app.train.resume` from its checkpoint) and tags its stored record.

    Returns the record, or ``{"error": message}``: one cell's failure never stops the grid.
    """
    from privgrad.signals import restore_defaults
    from privgrad.app.store import RunStore
    from privgrad.app.train import TrainConfig, resume, train

    if _WORKER["interrupted"]:  # a cell still queued for an interrupted worker never starts
        raise KeyboardInterrupt("this worker was interrupted")
    config = TrainConfig(**payload["config"])
    meta = payload["meta"]
    store = RunStore(payload["db"])
    try:
        with _cached_datasets():
            if payload.get("resume") is not None:
                try:
                    record = resume(payload["resume"], store, progress=payload["progress"])
                except Exception:
                    _retire(store, payload["resume"])
                    raise
            else:
                record = train(
                    config, store=store, progress=payload["progress"], command=meta["command"]
                )
        record.update({k: v for k, v in meta.items() if k != "command"})
        record["config"] = config_dict(config)
        store.finish(record["run_id"], record)  # the same run, now tagged with its cell
        return record
    except PrivgradError as err:
        return {"error": str(err)}
    except KeyboardInterrupt:
        if _WORKER["pid"] == os.getpid():
            _WORKER["interrupted"] = True
            restore_defaults()  # cleanup done: the parent's terminate() now ends us
        raise
    except Exception as err:  # a bug in one mechanism must not hide the other cells' results
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        store.close()


# A run's statuses when it stopped before its end: ``interrupted`` (a signal) or ``lost``
# (killed without a word). Only such a run may be resumed or retired.
STOPPED = ("interrupted", "lost")


def _retire(store, run_id: int) -> None:
    """Marks ``failed`` a stopped run that could not go on (unless a process writes it), so
    that the grid's next invocation starts its cell afresh instead of failing on it again."""
    try:
        if store.run(run_id)["status"] in STOPPED:
            store.check_no_writer(run_id)
            store.abort(run_id, "failed")
    except PrivgradError:
        pass


def resumable_runs(store, cells: list[Cell], version: str) -> dict[str, int]:
    """cell key -> the newest stopped run (``interrupted``, or ``lost``: killed without a word)
    of the cell's configuration that can go on with this code: no process writes it, and its
    checkpoint loads, holds the cell's configuration and was started by this code version (the
    checkpoint carries it through resumes, privgrad/app/train.py). Resuming it gives the record
    an uninterrupted run would, so a grid stopped mid-cell loses at most the steps since the
    last checkpoint (each epoch's end, or the step a signal stopped)."""
    from privgrad.app.checkpoint import checkpoint_dir, load_checkpoint
    from privgrad.records import to_json

    wanted = {c.key: json.loads(to_json(dataclasses.asdict(c.config))) for c in cells}
    found: dict[str, int] = {}
    for row in store.runs():  # newest first
        if row["status"] not in STOPPED or row["kind"] != "train" or not row["config"]:
            continue
        key = cell_key(row["config"])
        if key not in wanted or key in found or row["config"] != wanted[key]:
            continue
        try:
            store.check_no_writer(row["id"])
            saved = load_checkpoint(checkpoint_dir(store.path, row["id"]))
        except PrivgradError:
            continue
        if (
            isinstance(saved, dict)
            and isinstance(saved.get("loop"), dict)
            and saved["loop"].get("code_version") == version
            and json.loads(to_json(saved.get("config"))) == wanted[key]
        ):
            found[key] = row["id"]
    return found


_DATA_CACHE: dict = {}


class _cached_datasets:
    """Within a reproduction, each dataset is read from disk once per process.

    train() loads its data itself; the grid runs many cells on the same data, and reading
    IMDB alone takes seconds. The cache holds what ``load_dataset`` returned (the training
    code copies what it slices) and is bypassed if train.py stops using ``load_dataset``.
    """

    def __enter__(self):
        from privgrad.app import train as train_module

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


# A --jobs worker process: its pid, and whether a signal has interrupted it. ProcessPoolExecutor
# hands a worker the next queued cell even after the pool was shut down (cancel_futures cannot
# withdraw cells already in its call queue): an interrupted worker must start none of them.
_WORKER = {"pid": None, "interrupted": False}


def _init_worker(threads: int) -> None:
    import threading
    from tqdm.auto import tqdm
    from privgrad.signals import interrupt_once

    _WORKER["pid"] = os.getpid()
    interrupt_once()
    # A worker draws no bars; tqdm's default lock is a named semaphore that a worker stopped
    # mid-cell never unlinks (the resource tracker then warns of leaked semaphores).
    tqdm.set_lock(threading.RLock())
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads)


@dataclass
class Plan:
    experiment: Experiment
    cells: list[Cell]  # the test cells that can be planned now
    done: dict[str, dict]  # cell key -> record, for test cells skipped
    todo: list[Cell]
    search: list[Choice] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # test-grid rows whose search is not finished
    finished: dict[str, dict] = field(default_factory=dict)  # every done cell of the run store

    @property
    def search_cells(self) -> list[Cell]:
        return _unique(c for ch in self.search for c in ch.cells)

    @property
    def search_todo(self) -> list[Cell]:
        return _unique(c for ch in self.search for c in ch.pending)

    def records(self) -> dict[str, dict]:
        """Test-cell key -> its done record, with the cell's ``selection`` (as chosen now)."""
        return {
            c.key: {**self.finished[c.key], "selection": c.selection}
            for c in self.cells
            if c.key in self.finished
        }

    def search_records(self) -> dict[str, dict]:
        return {c.key: self.finished[c.key] for c in self.search_cells if c.key in self.finished}

    def describe(self) -> list[str]:
        """The lines of --dry-run: every cell done or to run, each search's state, what waits."""
        lines = []
        if self.experiment.search is not None:
            for c in self.search_cells:
                lines.append(
                    f"{'done' if c.key in self.finished else 'todo':<5} {c.key}  {c.label()}"
                )
            lines += [f"search {ch.state()}" for ch in self.search]
        lines += [
            f"{'done' if c.key in self.done else 'todo':<5} {c.key}  {c.label()}"
            for c in self.cells
        ]
        lines += [
            f"wait  {w}: its test cells are planned once its search has chosen"
            for w in self.waiting
        ]
        if self.experiment.search is None:
            return lines + [f"{len(self.done)} done, {len(self.todo)} to run"]
        n = len(self.search_cells)
        todo = len(self.search_todo)
        more = (
            " (more if a grid edge is extended)"
            if any(ch.chosen is None for ch in self.search)
            else ""
        )
        lines.append(
            f"search: {n - todo} done, {todo} to run{more}; "
            f"test grid: {len(self.done)} done, {len(self.todo)} to run, "
            f"{len(self.waiting)} row(s) waiting for their search"
        )
        return lines


def _unique(cells) -> list[Cell]:
    out, seen = [], set()
    for c in cells:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def check_runnable(experiment: Experiment, arms: list[str] | None = None) -> None:
    """One-line PrivgradError if the experiment (or the chosen arms) cannot run here."""
    if not experiment.runnable:
        raise PrivgradError(
            f"experiment '{experiment.id}' cannot be reproduced here: {experiment.reason}"
        )
    missing = experiment.missing(arms)
    if missing:
        runnable_arms = [a.name for a in experiment.arms if not experiment.missing([a.name])]
        hint = (
            f"; run the others with {' '.join(repr('--arm=' + n) for n in runnable_arms)}"
            if runnable_arms
            else ""
        )
        raise PrivgradError(
            f"experiment '{experiment.id}' needs {', '.join(missing)}, which this "
            f"privgrad does not have (yet){hint}"
        )


def plan(
    experiment: Experiment,
    store,
    quick: bool = False,
    seeds: list[int] | None = None,
    arms: list[str] | None = None,
    force: bool = False,
    any_version: bool = False,
    data_dir: str | None = None,
    from_results: bool = False,
    results_dir: str | Path | None = None,
) -> Plan:
    check_runnable(experiment, arms)
    finished = _finished(experiment, store, force, any_version, from_results, results_dir)
    return _plan(experiment, finished, quick, seeds, arms, data_dir)


def _plan(
    experiment: Experiment,
    finished: dict[str, dict],
    quick: bool,
    seeds: list[int] | None,
    arms: list[str] | None,
    data_dir: str | None,
) -> Plan:
    """The searches as far as ``finished`` takes them, then the test cells they allow."""
    search = search_state(experiment, finished, quick, arms, data_dir)
    choices = {ch.key: ch.selection() for ch in search if ch.chosen is not None}
    cells = experiment.cells(
        quick=quick, seeds=seeds, arms=arms, data_dir=data_dir, choices=choices
    )
    waiting = [
        _unit_label(arm.name, eps, target)
        for arm, eps, target in experiment.test_units(quick, arms)
        if arm.space is not None and experiment.search_key(arm, eps, target) not in choices
    ]
    done = {c.key: finished[c.key] for c in cells if c.key in finished}
    todo = _unique(c for c in cells if c.key not in done)
    return Plan(experiment, cells, done, todo, search, waiting, finished)


def reproduce(
    experiment: Experiment,
    db: str | Path,
    quick: bool = False,
    seeds: list[int] | None = None,
    jobs: int = 1,
    arms: list[str] | None = None,
    force: bool = False,
    any_version: bool = False,
    progress: bool = True,
    data_dir: str | None = None,
    from_results: bool = False,
    results_dir: str | Path | None = None,
    echo=print,
) -> dict:
    """Runs the cells of ``experiment`` that are not done yet (in the run store, or with
    ``from_results`` among its committed records): first the searches, round by round (a
    round's results may extend a grid), then the test grid with the chosen settings.
    Returns a summary dict."""
    from privgrad.app.store import RunStore
    from privgrad.records import git_commit

    check_runnable(experiment, arms)
    store = RunStore(db)
    try:
        finished = _finished(experiment, store, force, any_version, from_results, results_dir)
    finally:
        store.close()
    version, commit = code_version(), git_commit()
    before = set(finished)
    started = time.time()
    failures: list[tuple[Cell, str]] = []
    with _Workers(jobs) as workers:  # kept from the first search round to the test grid
        run = dict(
            experiment=experiment, db=db, version=version, commit=commit, workers=workers,
            progress=progress,
        )  # fmt: skip
        if experiment.search is not None:
            failed: set[str] = set()
            for round_ in itertools.count(1):
                p = _plan(experiment, finished, quick, seeds, arms, data_dir)
                todo = [c for c in p.search_todo if c.key not in failed]
                if not todo:
                    break
                echo(
                    f"{experiment.id}{' (quick)' if quick else ''}: search round {round_}: "
                    f"{len(p.search_cells) - len(p.search_todo)} search runs done, "
                    f"{len(todo)} to run"
                )
                records, bad = _run_batch(todo, f"{experiment.id} search", **run)
                finished.update(records)
                failures += bad
                failed |= {c.key for c, _ in bad}
            for ch in p.search:
                echo(
                    f"  {ch.state()}"
                    + (
                        ""
                        if ch.chosen is not None or ch.flat
                        else ": search incomplete, its test cells were not run"
                    )
                )
        caveat = experiment.search_epochs_caveat(quick) if experiment.search is not None else None
        if caveat:
            echo(f"  note: {caveat}")
        p = _plan(experiment, finished, quick, seeds, arms, data_dir)
        echo(
            f"{experiment.id}{' (quick)' if quick else ''}: {len(p.cells)} cells, "
            f"{len(p.done)} already done with this config and code version ({version}), "
            f"{len(p.todo)} to run"
        )
        records, bad = _run_batch(p.todo, experiment.id, **run)
        finished.update(records)
        failures += bad
        p = _plan(experiment, finished, quick, seeds, arms, data_dir)
        every = {c.key for c in p.cells + p.search_cells}
        return {
            "experiment": experiment.id,
            "cells": p.cells,
            "skipped": len(every & before),
            "ran": len((set(finished) - before) & every),
            "failures": failures,
            "records": p.records(),
            "search_cells": p.search_cells,
            "search_records": p.search_records(),
            "plan": p,
            "code_version": version,
            "wall_time_s": time.time() - started,
        }


def _run_batch(
    cells: list[Cell],
    desc: str,
    experiment: Experiment,
    db,
    version: str,
    commit: str | None,
    workers: _Workers,
    progress: bool,
) -> tuple[dict[str, dict], list[tuple[Cell, str]]]:
    """Runs ``cells`` (in ``workers``' processes) under one progress bar, each stopped one from
    its checkpoint (:func:`resumable_runs`); returns (cell key -> record, [(cell, error)])."""
    from tqdm.auto import tqdm
    from privgrad.app.store import RunStore

    results, failures = {}, []
    if not cells:
        return results, failures
    store = RunStore(db)
    try:
        stopped = resumable_runs(store, cells, version)
    finally:
        store.close()
    total = sum(_cost(c) for c in cells)
    bar = tqdm(
        total=total,
        disable=not progress,
        smoothing=0,
        dynamic_ncols=True,
        desc=desc,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed} elapsed, about {remaining} left]",
    )
    finished = 0

    def advance(cell: Cell, record: dict) -> None:
        nonlocal finished
        finished += 1
        bar.set_description_str(f"{desc} {finished}/{len(cells)} cells", refresh=False)
        bar.update(_cost(cell))
        if "error" in record:
            failures.append((cell, record["error"]))
            bar.write(f"  ✗ {cell.label()}: {record['error']}", file=sys.stderr)
        else:
            results[cell.key] = record
            mark = (
                "smoke run: not a result:" if cell.quick else "✓"
            )  # --quick cells learn next to nothing
            which = "validation accuracy" if record.get("test_accuracy") is None else "accuracy"
            acc = record[
                "validation_accuracy" if which == "validation accuracy" else "test_accuracy"
            ]
            bar.write(
                f"  {mark} {cell.label()}: {which} {acc:.4f}, "
                f"ε {_fmt(record.get('epsilon'))} (claimed {_fmt(record.get('epsilon_claimed'))}) "
                f"[{record.get('wall_time_s', 0):.0f} s"
                f"{', resumed' if record.get('resumes') else ''}]",
                file=sys.stderr,
            )

    bar.set_description_str(f"{desc} 0/{len(cells)} cells")
    if stopped:
        bar.write(
            f"  {len(stopped)} stopped cell(s) go on from their checkpoints "
            f"(runs {', '.join(map(str, sorted(stopped.values())))})",
            file=sys.stderr,
        )

    def payload(cell: Cell, progress: bool) -> dict:
        return _cell_payload(cell, str(db), version, commit, progress, stopped.get(cell.key))

    try:
        if workers.jobs <= 1 or len(cells) <= 1:
            for cell in cells:
                advance(cell, run_cell(payload(cell, progress and workers.jobs <= 1)))
        else:
            from concurrent.futures import as_completed

            pool = workers.pool()
            futures = {pool.submit(run_cell, payload(c, False)): c for c in cells}
            for fut in as_completed(futures):
                try:
                    record = fut.result()
                except Exception as err:  # a worker died
                    record = {"error": f"{type(err).__name__}: {err}"}
                advance(futures[fut], record)
    finally:
        bar.close()
    return results, failures


class _Workers:
    """``--jobs`` worker processes, started for the first batch of cells that needs them and
    kept for the search's later rounds and the test grid: a start imports torch and reads the
    data again in each process (about 10 s a round for a quick Fashion-MNIST run)."""

    def __init__(self, jobs: int):
        self.jobs, self._pool = jobs, None

    def pool(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(
                max_workers=self.jobs,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(max(1, (os.cpu_count() or 1) // self.jobs),),
            )
        return self._pool

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, kind, *_) -> bool:
        if self._pool is None:
            return False
        if kind is not None and issubclass(kind, KeyboardInterrupt):  # Ctrl-C, SIGTERM, SIGHUP
            running = list(self._pool._processes.values())  # alone: the running cells stop
            self._pool.shutdown(wait=False, cancel_futures=True)  # too, stored 'interrupted'
            _stop_workers(running)
        else:
            self._pool.shutdown()
        return False


def _stop_workers(workers, grace: float = 60.0) -> None:
    """Ends the pool's worker processes: SIGTERM, repeated while a worker still finishes the
    interrupted cell's cleanup (it ignores signals until then), SIGKILL after ``grace`` s."""
    deadline = time.monotonic() + grace
    while workers and time.monotonic() < deadline:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join(0.2)
        workers = [w for w in workers if w.is_alive()]
    for worker in workers:
        worker.kill()
        worker.join()


def _fmt(eps) -> str:
    return "∞" if eps is None or (isinstance(eps, float) and math.isinf(eps)) else f"{eps:.3f}"


# --------------------------------------------------------------------------- export


def export_plan(p: Plan, results_dir: str | Path | None = None) -> list[Path]:
    """Exports a plan's done cells (a finished :func:`reproduce`'s ``summary["plan"]``, or the
    plan of ``--dry-run``): the test records to ``<id>.json`` and the search records (if any)
    to ``<id>.search.json``; returns the files written."""
    paths = [
        export_records(p.experiment, p.cells, p.records(), results_dir),
        export_records(
            p.experiment, p.search_cells, p.search_records(), results_dir, suffix=".search"
        ),
    ]
    return [p for p in paths if p is not None]


def export_records(
    experiment: Experiment,
    cells: list[Cell],
    records: dict[str, dict],
    results_dir: str | Path | None = None,
    suffix: str = "",
) -> Path | None:
    """Writes the grid's completed records to ``results/reproduce/<id><suffix>.json`` (a JSON
    list), keeping records of cells that file already holds and this run did not redo, except
    those of a searched row whose search has since chosen other values and those of a row,
    seed (and search point) this export holds under another configuration (the config was
    edited since: its records replace the old ones). Processes exporting
    the same file at once (``--arm`` runs side by side) take turns (an exclusive lock on
    ``<file>.lock``), and the file is replaced whole, never left half-written; a file that is
    not valid JSON is an error rather than overwritten."""
    import fcntl

    from privgrad.records import to_json

    path = _export_path(experiment, results_dir, suffix)
    order = {c.key: i for i, c in enumerate(cells)}
    fresh = {
        k: {kk: vv for kk, vv in r.items() if kk != "run_id"}
        for k, r in records.items()
        if k in order
    }
    if not fresh:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = _read_export(
            path,
            "its records would be lost: repair or move it, then export again "
            "(the run store keeps every run)",
        )
        chosen = {
            (c.arm, c.epsilon, c.target or "honest"): c.selection["chosen"]
            for c in cells
            if c.selection and c.selection["on"] == "validation"
        }
        redone = {
            _row_seed(c.arm, c.epsilon, c.target, c.seed, c.point) for c in cells if c.key in fresh
        }
        kept = [
            r
            for r in old
            if isinstance(r, dict)
            and r.get("cell") not in fresh
            and not _superseded(r, chosen)
            and _row_seed(
                r.get("arm"),
                r.get("nominal_epsilon"),
                r.get("target"),
                r.get("seed"),
                r.get("search_point"),
            )
            not in redone
        ]
        new = sorted(fresh.items(), key=lambda kv: order[kv[0]])
        out = kept + [r for _, r in new]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(json.loads(to_json(out)), indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    return path


def _row_seed(
    arm: str | None, epsilon: float | None, target: str | None, seed: int | None, point: dict | None
) -> tuple:
    """What one record of an export stands for: its row, seed and (a search run's) grid point."""
    return (
        arm,
        epsilon,
        target or "honest",
        seed,
        json.dumps(point, sort_keys=True) if point else None,
    )


def _superseded(record: dict, chosen: dict) -> bool:
    """A test record chosen by a search whose row now has other chosen values."""
    sel = record.get("selection") or {}
    row = (record.get("arm"), record.get("nominal_epsilon"), record.get("target") or "honest")
    return sel.get("on") == "validation" and row in chosen and sel.get("chosen") != chosen[row]
