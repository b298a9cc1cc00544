"""A new user's first commands: a light CLI import, help that lists the valid values, the
per-mechanism defaults, the tiny run and the non-private control with defaults alone."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from privgrad.app import console
from privgrad.app.cli import main
from privgrad.app.data import DATASETS
from privgrad.app.defaults import (
    DATASET_NAMES,
    MECHANISM_DEFAULTS,
    MECHANISM_NAMES,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    defaults_table,
)
from privgrad.app.gan.train import GanConfig, GanTrainer
from privgrad.mechanisms import MECHANISMS, build_mechanism
from privgrad.app.models import MODELS
from privgrad.optim import OPTIMIZERS
from cli_helpers import run_cli as cli

HEAVY = ("torch", "scipy", "dp_accounting", "matplotlib")


def test_light_names_are_the_registries():
    assert MECHANISM_NAMES == tuple(MECHANISMS)
    assert MODEL_NAMES == tuple(MODELS)
    assert DATASET_NAMES == tuple(DATASETS)
    assert OPTIMIZER_NAMES == tuple(OPTIMIZERS)
    assert tuple(MECHANISM_DEFAULTS) == tuple(MECHANISMS)
    for name, row in MECHANISM_DEFAULTS.items():
        assert row.optimizer == build_mechanism(name).optimizer, name


def test_cli_help_and_runs_import_no_torch(tmp_path):
    """`privgrad --help`, every `privgrad <cmd> --help` and `privgrad runs` in a fresh
    interpreter: none of them imports torch, scipy, dp_accounting or matplotlib."""
    db = tmp_path / "r.db"
    from privgrad.app.store import RunStore

    RunStore(db).close()
    script = f"""
import sys
from click.testing import CliRunner
from privgrad.app import console
from privgrad.app.cli import main
calls = [["--help"]] + [[name, "--help"] for name in main.commands]
calls.append(["runs", "--db", {str(db)!r}])
for args in calls:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (args, result.output)
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_help_lists_every_registered_name():
    helps = {p.opts[0]: p.help for p in main.commands["train"].params}
    for option, registry in (
        ("--mechanism", MECHANISMS),
        ("--model", MODELS),
        ("--dataset", DATASETS),
        ("--optimizer", OPTIMIZERS),
    ):
        for name in registry:
            assert name in helps[option].split("one of: ")[1].split(";")[0].split("  [")[0].split(
                ", "
            ), (option, name)
    code, out, _ = cli("train", "--help")
    assert code == 0
    for line in defaults_table().splitlines():  # the defaults table, in the help and in the README
        assert line in out
        assert line in (Path(__file__).parents[2] / "README.md").read_text()


def test_tiny_run_and_non_private_with_defaults_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "interactive", lambda: True)  # as in a terminal
    code, out, err = cli(
        "train", "--limit-train", "2000", "--epochs", "1", "--db", str(tmp_path / "r.db"), "--json"
    )
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    defaults = MECHANISM_DEFAULTS["dpsgd"]
    assert rec["batch_size"] == 50 and rec["steps"] == 40  # batch: 1/40 of the training set
    assert (rec["lr"], rec["momentum"], rec["clip"]) == (
        defaults.lr,
        defaults.momentum,
        defaults.clip,
    )
    assert rec["epsilon"] == pytest.approx(1.0, abs=1e-2)
    assert "calibrating σ" in err and "loading torch" in err  # says what it does before the bar
    code, out, err = cli(
        "train",
        "--mechanism",
        "non-private",
        "--limit-train",
        "400",
        "--epochs",
        "1",
        "--db",
        str(tmp_path / "r.db"),
        "--json",
    )
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["noise_multiplier"] == 0 and rec["dp_guarantee"] is False and rec["epsilon"] is None
    assert rec["lr"] == MECHANISM_DEFAULTS["non-private"].lr and "ε (honest, PLD) = ∞" in err
    assert rec["clip"] is None  # it does not clip: no clipping norm in its record


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--mechanism", "dpsgd", "--keep-ratio", "0.5"], "--keep-ratio"),
        (["--mechanism", "gip", "--keep-ratio", "2"], "--keep-ratio"),
        (["--mechanism", "dpsgd", "--noise-type", "paper"], "--noise-type"),
    ],
)
def test_errors_name_the_options_as_typed(args, needle, tmp_path):
    code, _, err = cli(
        "train", *args, "--limit-train", "100", "--epochs", "1", "--db", str(tmp_path / "r.db")
    )
    assert code == 2 and err.startswith("error: ") and needle in err and "--k-end" not in err


class Postfix:
    def __init__(self):
        self.sigmas = []

    def update(self, n):
        pass

    def set_postfix(self, sigma, score):
        self.sigmas.append(float(sigma))


def test_gan_bar_shows_the_sigma_of_the_summary():
    from privgrad.app.gan.data import load_gan_data

    trainer = GanTrainer(
        GanConfig(
            mode="dp-gan",
            dataset="mnist",
            epsilon=2.0,
            generator_steps=2,
            discriminator_steps=1,
            batch_size=32,
            width=8,
            latent_dim=16,
        ),
        load_gan_data("mnist", limit_train=300),
    )
    bar = Postfix()
    trainer.run(progress=bar)
    assert trainer.noise_multiplier > 0 and not math.isclose(trainer.noise_multiplier, 0)
    assert bar.sigmas == [pytest.approx(trainer.noise_multiplier, rel=1e-2)] * 2


def test_mechanism_option_ranges_are_declared_with_the_mechanisms():
    """The ranges of the mechanisms' numeric flags come from their declarations (registry)
    and are the ones privgrad.validate held before."""
    from privgrad.validate import AT_LEAST_ONE, OPEN_UNIT, RANGES, RATE, Range, range_of

    expected = {
        "--filter-ratio": Range(0, 1, high_open=True),
        "--keep-ratio": RATE,
        "--k-start": RATE,
        "--group-size": AT_LEAST_ONE,
        "--index-budget-fraction": OPEN_UNIT,
    }
    assert {flag: range_of("train", flag) for flag in expected} == expected
    assert not set(expected) & set(RANGES)  # declared once, with the mechanism
