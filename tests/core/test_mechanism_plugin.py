"""A mechanism declared in one file outside the package (tests/plugins/toy_mechanism.py) is
trained through the API and the command line, listed in ``privgrad train --help`` with its
flag and defaults row, benchmarked by benchmarks/step_time.py and audited (canary, one-run;
its own stage declares what the audits may do with it); its ε is the
accountant's on the noise it actually drew (DP-SGD's, as its extra stage is post-processing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import privgrad
from privgrad.mechanisms import build_mechanism, mechanism_specs, register_mechanism
from privgrad.mechanisms.registry import unregister_mechanism

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
SPEC = "python:toy_mechanism:MECHANISM"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    import toy_mechanism

    register_mechanism(toy_mechanism.MECHANISM)
    yield toy_mechanism
    unregister_mechanism("toy-shrink")


def _env():
    env = dict(os.environ)
    env["PRIVGRAD_MECHANISMS"] = SPEC
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run(args, **kw):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=_env(), cwd=ROOT, **kw
    )


def _data(n=64, d=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_api_trains_it_with_the_accountants_epsilon(toy):
    assert list(mechanism_specs())[-1] == "toy-shrink"
    eps = {}
    for name, options in (("toy-shrink", {"shrink": 0.25}), ("dpsgd", {})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 2))
        private = privgrad.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            _data(),
            mechanism=name,
            noise_multiplier=1.0,
            batch_size=16,
            epochs=1,
            **options,
        )
        for batch in private.batches():
            private.step(batch)
        eps[name] = private.epsilon()
    assert 0 < eps["toy-shrink"] == eps["dpsgd"] < float("inf")
    with pytest.raises(privgrad.PrivgradError, match="--keep-ratio"):
        build_mechanism("toy-shrink", 1.0, 1.0, k_end=0.5)


def test_canary_and_one_run_audits_run_on_it(toy):
    from privgrad.app.audit.run import run_audit

    rec = run_audit(
        "canary", mechanism="toy-shrink", noise_multiplier=2.0, trials=200, model="small"
    )
    assert rec["mechanism"] == "toy-shrink" and rec["epsilon"] < float("inf")
    assert rec["epsilon_lower_bound"] <= rec["epsilon"]
    assert rec["vectorized"] and rec["canary"] == "dense"  # its stage declares it may be
    rec = run_audit(
        "one-run",
        mechanism="toy-shrink",
        noise_multiplier=2.0,
        canaries=100,
        n_train=100,
        epochs=1,
        batch_size=20,
    )
    assert rec["method"] == "one-run" and rec["epsilon_lower_bound"] <= rec["epsilon"]


def test_cli_lists_trains_and_audits_it(tmp_path):
    code = "from privgrad.app.cli import main; main()"
    out = _run(["-c", code, "train", "--help"])
    assert out.returncode == 0, out.stderr
    assert "toy-shrink" in out.stdout and "--shrink" in out.stdout
    assert "toy-shrink: factor on the noisy mean" in " ".join(out.stdout.split())
    assert any(line.split()[:3] == ["toy-shrink", "sgd", "lr"] for line in out.stdout.splitlines())
    db = str(tmp_path / "r.db")
    args = ["--mechanism", "toy-shrink", "--db", db, "--json", "--quiet"]
    out = _run(["-c", code, "train", *args, "--limit-train", "400", "--epochs", "1"])
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["mechanism"] == "toy-shrink" and rec["lr"] == 0.5
    assert rec["epsilon"] == pytest.approx(1.0, abs=1e-2)  # calibrated by the accountant
    out = _run(["-c", code, "train", *args, "--shrink", "2", "--limit-train", "400"])
    assert out.returncode == 2 and "--shrink must be" in out.stderr  # its declared range
    audit = ["--mechanism", "toy-shrink", "--db", db, "--json", "--trials", "100"]
    out = _run(["-c", code, "audit", *audit, "--noise-multiplier", "2"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["mechanism"] == "toy-shrink"


def test_step_time_benchmarks_it():
    out = _run(
        [
            str(ROOT / "benchmarks" / "step_time.py"),
            "--quick",
            "--json",
            "--no-memory",
            "--threads",
            "1",
            "--models",
            "cnn",
            "--contenders",
            "toy-shrink",
        ],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert "toy-shrink" in {row["contender"] for row in rows}


def test_a_numeric_option_without_a_declared_range_takes_any_finite_number(toy):
    """``option(2.0, "…")`` without ``range=`` crashed the command line with KeyError as soon
    as its flag was given; it is any finite number, as ``range=None`` reads."""
    import dataclasses

    from privgrad.errors import PrivgradError
    from privgrad.mechanisms import option
    from privgrad.validate import check_numbers

    @dataclasses.dataclass(frozen=True)
    class Loose:
        loose_factor: float = option(2.0, "a factor")

    spec = dataclasses.replace(toy.MECHANISM, name="toy-loose", options=Loose)
    register_mechanism(spec)
    try:
        check_numbers("train", {"--loose-factor": 7.5})
        with pytest.raises(PrivgradError, match="--loose-factor must be a finite number"):
            check_numbers("train", {"--loose-factor": float("nan")})
    finally:
        unregister_mechanism("toy-loose")


def test_a_plugin_that_does_not_load_is_one_line_on_the_command_line():
    """A bad PRIVGRAD_MECHANISMS entry ended every command, --help included, in a traceback."""
    env = {**_env(), "PRIVGRAD_MECHANISMS": "python:no_such_plugin_module:MECHANISM"}
    done = subprocess.run(
        [sys.executable, "-m", "privgrad", "--help"], capture_output=True, text=True, env=env,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: mechanism 'python:no_such_plugin_module:MECHANISM'")
    assert "PRIVGRAD_MECHANISMS" in done.stderr


def test_an_error_in_a_plugins_stage_is_one_line_naming_it(tmp_path):
    """A plugin stage that raises mid-run ended `privgrad train` in a traceback through
    privgrad's chain; it is now one line with the plugin's file and line, the run failed."""
    source = (PLUGINS / "toy_mechanism.py").read_text()
    old = "        state.grads = [torch.mul(g, self.factor) for g in state.grads]\n"
    assert old in source
    bad = source.replace(old, old + '        raise ValueError("the shrink went wrong")\n')
    (tmp_path / "toy_raising.py").write_text(bad)
    env = {**_env(), "PRIVGRAD_MECHANISMS": "python:toy_raising:MECHANISM"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    db = str(tmp_path / "r.db")
    args = ["train", "--mechanism", "toy-shrink", "--db", db, "--quiet", "--limit-train", "200"]
    out = subprocess.run(
        [sys.executable, "-m", "privgrad", *args, "--epochs", "1"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --mechanism 'toy-shrink' raised ValueError: the shrink")
    lineno = bad.splitlines().index('        raise ValueError("the shrink went wrong")') + 1
    assert line.endswith(f"(at toy_raising.py:{lineno}, in __call__)")
    runs = _run(["-m", "privgrad", "runs", "--db", db, "--status", "failed"])
    assert "toy-shrink" in runs.stdout, runs.stdout + runs.stderr
