"""Training commands choose their CPU threads: --threads, else OMP_NUM_THREADS, else one per
usable core (results/bench/threads.txt), with a passive OpenMP wait unless the environment
says."""

import os

import torch

from privgrad.app.threads import configure_threads, default_threads


def test_threads_come_from_the_flag_the_environment_or_the_default(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        cores = len(os.sched_getaffinity(0))
        assert configure_threads() == (default_threads(), "default") == (cores, "default")
        assert torch.get_num_threads() == cores and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert configure_threads() == (2, "OMP_NUM_THREADS") and torch.get_num_threads() == 2
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's setting is kept
        assert configure_threads(1) == (1, "--threads") and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_run_record_says_how_many_threads_trained(tmp_path, monkeypatch):
    import json
    from cli_helpers import run_cli

    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(
            "train",
            "--limit-train",
            "300",
            "--epochs",
            "1",
            "--batch-size",
            "100",
            "--noise-multiplier",
            "1",
            "--device",
            "cpu",
            "--quiet",
            "--threads",
            "1",
            "--db",
            str(tmp_path / "r.db"),
            "--json",
        )
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["environment"]["threads"] == 1
    finally:
        torch.set_num_threads(before)
