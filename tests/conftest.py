import os

import pytest
import torch

# The fused norm form's Triton kernels (privgrad/per_sample/fused.py) take CPU tensors only in
# Triton's interpreter, which must be on before Triton is imported: without CUDA (CI) every
# fused-form test runs the kernels there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs on pytest-xdist workers (pyproject.toml's addopts), one per core this process
# may use, and each worker takes one core: one torch thread, and OMP_NUM_THREADS=1 for the
# CLI's thread setting and the subprocesses tests start, so that n workers do not run n × cores
# threads (most tests are small or single-threaded: the accountant, process start-up). Tests of
# the thread settings set their own environment.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _secret_seeds_by_test(request, monkeypatch):
    """Given no seed, privgrad draws a secret one from the OS (privgrad.seeds): a test whose
    outcome hangs on the draw (a NaN row sampled or not) would fail by chance. In this
    process, a test's draws come from a stream seeded by its name instead: each draw a new
    seed, as from the OS, the same in every run. Subprocesses draw from the OS."""
    import random
    import zlib

    import privgrad.seeds

    stream = random.Random(zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(privgrad.seeds, "randbits", stream.getrandbits)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may run on (a container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# Tests in two speeds. `python -m pytest -m "not slow"` is the quick check (under 2 minutes
# on an idle 2-core machine: its tests took about 100 s of CPU time in all when this list
# was made); `python -m pytest` runs everything, as CI does. The slow ones are integration
# tests (whole training runs, subprocesses, end-to-end reproductions), statistical ones and
# large numerical grids, named here rather than marked in their files: a module (every test
# in it) or a test function (all its parameters), each with the reason it is slow.
# tests/test_slow_list.py checks that every name here still names a test.
SLOW = {
    # integration: whole runs, stopped and resumed, and subprocesses
    "tests/app/test_resume.py": "runs trained, stopped (SIGTERM, Ctrl-C) and resumed",
    "tests/app/test_robustness.py": "every bound and traceback case, resource ones in subprocesses",
    "tests/test_examples.py": "runs the shipped examples on data slices",
    "tests/lab/test_reproduce.py::test_quick_runs_end_to_end": "every --quick reproduction",
    "tests/lab/test_reproduce.py::test_rerun_skips_done_cells_and_resumes_after_interruption": (
        "a --quick reproduction, interrupted and rerun"
    ),
    "tests/lab/test_reproduce.py::test_sigterm_to_reproduce_stops_its_worker_cells": (
        "a reproduction's worker processes stopped by SIGTERM"
    ),
    "tests/lab/test_report.py::test_quick_runs_render_in_the_report": (
        "--quick reproductions, then the report built from them"
    ),
    "tests/lab/test_report.py::test_committed_report_matches_a_fresh_regeneration": (
        "rebuilds the whole committed report"
    ),
    "tests/core/test_distributed.py": "process groups of two ranks (gloo), a run with --nproc 2",
    "tests/app/test_gan.py": "GAN training on MNIST and the gan command",
    "tests/test_benchmark.py::test_quick_json_schema_and_one_row_per_contender": (
        "a --quick benchmark run"
    ),
    "tests/test_benchmark.py::test_conv_rules_quick_run_times_every_contender_of_every_layer": (
        "times every convolution rule"
    ),
    "tests/app/test_writers.py::"
    "test_resume_of_a_run_still_training_is_refused_until_its_process_is_gone": (
        "three CLI training processes"
    ),
    "tests/app/test_writers.py::test_a_stopped_rank_fails_the_run_within_a_bounded_time": (
        "a two-rank run with one rank stopped"
    ),
    "tests/app/test_cli.py::test_sigterm_to_the_cli_process_stores_interrupted": (
        "a CLI training process stopped by SIGTERM"
    ),
    "tests/app/test_defaults.py::test_tiny_run_and_non_private_with_defaults_alone": (
        "two runs at the defaults on 2,000 MNIST digits"
    ),
    "tests/app/test_defaults.py::test_gan_bar_shows_the_sigma_of_the_summary": "a GAN run",
    "tests/app/test_data.py::test_imdb_full": "reads the whole IMDB corpus (50,000 reviews)",
    "tests/core/test_mechanism_plugin.py::test_cli_lists_trains_and_audits_it": (
        "a plugin mechanism listed, trained and audited through the CLI"
    ),
    "tests/core/test_mechanism_plugin.py::test_step_time_benchmarks_it": "a step-time benchmark",
    "tests/core/test_own_loop.py::test_same_parameters_and_identical_epsilon_as_the_trainer": (
        "every mechanism trained twice, by the own loop and by the trainer"
    ),
    "tests/core/test_microbatch.py::test_peak_memory_of_a_step_is_bounded_by_the_chunk": (
        "a subprocess measuring the peak memory of a whole-batch and a chunked step"
    ),
    "tests/app/test_writers.py::test_nproc_above_the_cores_is_refused_before_anything_runs": (
        "a CLI process"
    ),
    "tests/core/test_own_loop.py::test_mean_and_sum_reductions": (
        "7 own-loop runs, one with GIP's calibration (tight composition search)"
    ),
    "tests/core/test_own_data.py::test_state_dict_resumes_bit_identically_even_mid_epoch": (
        "runs trained, stopped and resumed, GIP's calibration in one"
    ),
    "tests/core/test_integrity.py::test_a_checkpointed_ledger_loads_back": (
        "5 mechanisms trained, checkpointed and loaded"
    ),
    "tests/test_benchmark.py::test_torch_transformer_model_runs_a_quick_round": (
        "a benchmark round of a transformer"
    ),
    # statistical and numerical grids: many settings each
    "tests/core/test_accounting.py::test_calibration_never_overshoots": (
        "three calibrations of σ over 1,000 steps"
    ),
    "tests/core/test_spectral.py::"
    "test_fast_spectral_norms_and_clipped_sum_equal_the_materialised_spectra": (
        "24 layer shapes, each spectrum materialised"
    ),
    "tests/core/test_spectral.py::"
    "test_kernel_sum_fast_path_releases_what_the_full_correlation_sum_releases": (
        "12 settings, each full correlation sum computed"
    ),
    "tests/core/test_accounting.py::test_rdp_agrees_with_opacus": "27 settings against Opacus",
    "tests/core/test_accounting.py::test_pld_is_never_looser_than_rdp": "9 PLD compositions",
    "tests/core/test_accounting.py::test_large_epsilon_and_tiny_rate_are_finite_and_positive": (
        "a PLD of 300 steps at q = 0.5, σ = 0.5 (a large grid)"
    ),
    "tests/app/test_audit.py": "privacy audits: thousands of mechanism trials, training runs",
    "tests/core/test_independence.py::"
    "test_the_probe_accepts_a_random_model_iff_it_has_no_mixing_block": "random models, many draws",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module, _, name = item.nodeid.partition("::")
        if module in SLOW or f"{module}::{name.partition('[')[0]}" in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def device(request):
    """Every device present: a test taking ``device`` runs on the CPU and, where a GPU is
    present (a GPU session runs these; CI has none), on CUDA too."""
    return request.param


@pytest.fixture
def float32_convolutions(monkeypatch):
    """cuDNN's convolutions default to TF32 (~1e-3 relative rounding): tests that compare
    computation paths to float32 tolerance on CUDA run them in float32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def empty_batch():
    """draw(trainer): the trainer's next batch, drawn by its own sampler, made empty (the
    Poisson draw with no example), as ``step`` takes only the trainer's own batches."""

    def draw(trainer):
        sample = trainer.sampler.sample
        trainer.sampler.sample = lambda: sample()[:0]
        try:
            return next(trainer.batches(1))
        finally:
            del trainer.sampler.sample

    return draw
