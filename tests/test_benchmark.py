"""benchmarks/step_time.py: the --quick --json run (schema, one row per contender, memory
probes) and the benchmark's models."""

import contextlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from privgrad.errors import PrivgradError
from privgrad.app.models import build_model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "step_time.py"


def _script(name: str):
    """benchmarks/<name>.py as a module, registered under its name: the scripts import each
    other (step_time, the A/B driver ab) by name."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_time = _script("step_time")
_script("ab")

REQUESTED = ["dpsgd", "gip", "opacus-ghost"]


@pytest.fixture(scope="module")
def quick_run():
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--json",
            "--threads",
            "1",
            "--models",
            "cnn",
            "--contenders",
            ",".join(REQUESTED),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_quick_json_schema_and_one_row_per_contender(quick_run):
    assert {"rows", "device", "threads", "torch"} <= set(quick_run)
    assert quick_run["device"] == "cpu" and quick_run["threads"] == 1
    assert quick_run["torch"] == torch.__version__
    assert quick_run["omp_wait_policy"] == "PASSIVE"  # the script re-executed itself with it
    rows = quick_run["rows"]
    assert [r["contender"] for r in rows] == ["non-private"] + REQUESTED
    for r in rows:
        assert {"model", "batch", "contender", "cpu_ratio", "wall_ratio", "peak_extra_mb"} <= set(r)
        assert (r["model"], r["batch"]) == ("cnn", 8)
        assert r["note"] is None, r["note"]
        assert r["cpu_ratio"] > 0 and r["wall_ratio"] > 0 and r["cpu_ms"] > 0
        lo, hi = r["cpu_ratio_range"]
        assert 0 < lo <= r["cpu_ratio"] <= hi, (lo, r["cpu_ratio"], hi)  # per-round spread
        assert r["peak_extra_mb"] > 0  # measured in its own process
    assert rows[0]["cpu_ratio"] == rows[0]["wall_ratio"] == 1.0


def test_every_contender_name_is_known():
    from privgrad.mechanisms import MECHANISMS

    assert set(step_time.CONTENDERS) == {"non-private", "opacus-flat", "opacus-ghost"} | set(
        MECHANISMS
    )
    for spec in step_time.MODELS.values():
        assert set(spec.contenders) <= set(step_time.CONTENDERS)
    assert step_time.DEFAULT_MODELS == [
        "cnn",
        "cnn-x16",
        "model3-gn",
        "transformer",
        "lenet5",
        "model1",
        "lenet5-bc",
    ]
    assert list(step_time.MODELS) == [
        *step_time.DEFAULT_MODELS,
        "wrn16-4",
    ]  # named with --models only
    assert step_time.parse_args([]).model_list == step_time.DEFAULT_MODELS
    assert step_time.parse_args(["--models", "wrn16-4"]).model_list == ["wrn16-4"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--contenders", "dpsgd,opacus"], "unknown contender"),
        (["--models", "resnet"], "unknown model"),
        (["--batch-size", "a"], "comma-separated integers"),
        (["--rounds", "0"], "must be ≥ 1"),
        (["--device", "cuda"], "no CUDA GPU"),
    ],
)
def test_bad_options_are_one_line_errors(argv, needle, capsys):
    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is available")
    with pytest.raises(SystemExit) as e:
        step_time.parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_missing_opacus_is_a_skip_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus raises ImportError
    spec = step_time.MODELS["lenet5"]
    x, y = spec.data(4, torch.Generator().manual_seed(0))
    with pytest.raises(step_time.Skip, match="opacus not installed"):
        step_time.make_contender("opacus-flat", spec, x, y, torch.device("cpu"))


@pytest.mark.parametrize(
    "name,params",
    [
        ("cnn", 26_010),
        ("cnn-x16", 6_314_250),
        ("model3-gn", 534_546),
        ("transformer", 4_172_802),
        ("wrn16-4", 2_748_890),
    ],
)
def test_benchmark_models(name, params):
    spec = step_time.MODELS[name]
    model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == params
    x, y = spec.data(2, torch.Generator().manual_seed(0))
    assert model(x).shape == (2, 2 if name == "transformer" else 10)


def test_model_options_are_checked():
    assert (
        sum(p.numel() for p in build_model("cnn", (1, 28, 28), 10, width=4).parameters()) == 398_922
    )
    with pytest.raises(PrivgradError, match="width"):
        build_model("cnn", (1, 28, 28), 10, width=0)
    with pytest.raises(PrivgradError, match="norm_groups"):
        build_model("model3", (3, 32, 32), 10, norm_groups=3)
    norms = [
        m
        for m in build_model("model3", (3, 32, 32), 10, norm_groups=16)
        if isinstance(m, torch.nn.GroupNorm)
    ]
    assert [(m.num_groups, m.num_channels) for m in norms] == [
        (16, 32),
        (16, 32),
        (16, 64),
        (16, 64),
        (16, 128),
        (16, 128),
    ]


@pytest.mark.parametrize(
    "name", ["step_time_cpu.json", "step_time_gpu.json", "step_time_gpu_wrn16-4.json"]
)
def test_bench_readme_table_is_the_committed_benchmark(name):
    """results/bench/README.md's tables are `--table` of the committed JSON, not typed in."""
    root = SCRIPT.parents[1]
    committed = json.loads((root / "results" / "bench" / name).read_text())
    assert (
        step_time.markdown_table(committed)
        in (root / "results" / "bench" / "README.md").read_text()
    )


conv_rules = _script("conv_rules")


def test_conv_rules_quick_run_times_every_contender_of_every_layer(capsys):
    conv_rules.main(["--quick", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for layer, cells in (
        ("tiny.conv1", False),
        ("tiny.conv2", True),
    ):  # 3×3 of stride 2, of stride 1
        names = [
            "weight-grad",
            "ghost-patches",
            *(["ghost-cells"] if cells else []),
            "build-correlation",
            "build-grouped",
            "build-patches",
            "book-keeping-sum",
            "rule",
        ]
        rows = [r for r in result["rows"] if r["layer"] == layer]
        assert [r["contender"] for r in rows] == names
        assert all(r["cpu_ms"] > 0 for r in rows) and rows[0]["ratio"] == 1.0


def test_conv_rules_refuses_a_contender_whose_norms_differ():
    fs, _ = conv_rules.contenders(
        conv_rules.QUICK["tiny.conv1"], 1 << 26, torch.Generator().manual_seed(0)
    )
    conv_rules.check_norms(fs, "tiny.conv1")  # they agree
    right = fs["build-patches"]
    fs["build-patches"] = lambda: right() * 1.01  # a 1 % error is caught
    with pytest.raises(AssertionError, match="build-patches"):
        conv_rules.check_norms(fs, "tiny.conv1")


gram_cells_ab = _script("gram_cells_ab")


def test_gram_cells_ab_switches_the_gram_form_for_its_patches_contender():
    """The A/B is not vacuous: its patches contender runs with the cell Gram switched off,
    the cells contender with the rule's own choice, and the rule is restored after each."""
    from privgrad.per_sample.rules import ConvGrads

    conv = torch.nn.Conv2d(16, 32, 4, stride=2)
    layer = ConvGrads(conv, [torch.zeros(1, 16, 12, 12)], [torch.zeros(1, 32, 5, 5)])
    seen = []
    step = lambda: seen.append(layer.gram_by_cells)  # noqa: E731
    gram_cells_ab.with_gram_form(step, cells=True)()
    gram_cells_ab.with_gram_form(step, cells=False)()
    assert seen == [True, False] and layer.gram_by_cells


spectral_chunk_ab = _script("spectral_chunk_ab")


def test_spectral_chunk_ab_runs_its_fixed_contender_with_the_old_chunk_size():
    """At 2 threads the fixed contender's chunks are half the per-thread size (the old total),
    the rule's are the per-thread size; the module constant is restored after each."""
    import privgrad.mechanisms.spectral as spectral

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        step = lambda: seen.append(spectral._CHUNK_BYTES)  # noqa: E731
        spectral_chunk_ab.with_chunk(step, fixed=True)()
        spectral_chunk_ab.with_chunk(step, fixed=False)()
    finally:
        torch.set_num_threads(threads)
    per_thread = spectral_chunk_ab.PER_THREAD
    assert seen == [per_thread // 2, per_thread] and spectral._CHUNK_BYTES == per_thread


gram_blocks_ab = _script("gram_blocks_ab")


def test_gram_blocks_ab_compares_the_blocks_with_the_full_grams_they_replaced(monkeypatch):
    """Its reference gives the same norms as the rule's blocks (a fair A/B); its full-Gram
    contender runs with the rule's ghost norm switched to that reference, its blocks
    contender with the rule's own, and the rule is restored after each."""
    from privgrad.per_sample import rules

    gen = torch.Generator().manual_seed(0)
    a, g = torch.randn(2, 70, 5, generator=gen), torch.randn(2, 70, 3, generator=gen)
    torch.testing.assert_close(
        gram_blocks_ab.full_grams(a, g), rules._gram_dot(a, g), rtol=1e-4, atol=0
    )
    blocks, seen = rules._gram_dot, []
    monkeypatch.setattr(
        gram_blocks_ab, "make_contender", lambda *args: lambda: seen.append(rules._gram_dot)
    )
    steps = gram_blocks_ab.variants(None, None, None, "cpu")
    steps["dpsgd-full"]()
    steps["dpsgd-blocks"]()
    assert seen == [gram_blocks_ab.full_grams, blocks] and rules._gram_dot is blocks


spectral_padding_ab = _script("spectral_padding_ab")


def test_spectral_padding_ab_compares_kept_zeros_with_padding_afresh(monkeypatch):
    """Its afresh reference gives the rule's spectra (a fair A/B); its afresh contender runs
    with the rule's chunk spectra switched to that reference, and the rule is restored."""
    from privgrad.mechanisms import spectral
    from privgrad.mechanisms.spectral import SpectralConvGrads, SpectralTransform
    from privgrad.mechanisms.stages import StepState
    from privgrad.app.models import build_model
    from privgrad.per_sample import GradSampler
    from privgrad.private import per_sample_cross_entropy

    torch.manual_seed(0)
    model = build_model("lenet5", (1, 28, 28), 10)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    psg = GradSampler(model).compute(x, y, per_sample_cross_entropy)[0]
    layer = next(
        la
        for la in SpectralTransform()(StepState(psg, 1.0, torch.Generator())).per_sample.layers
        if isinstance(la, SpectralConvGrads)
    )
    L = (spectral.fast_len(layer.M[0]), spectral.fast_len(layer.M[1]))
    x0, g0 = layer.base.inputs[0], layer.base.grads[0]
    for got, want in zip(
        layer._chunk_spectra(0, x0, g0, L, [None, None]),
        spectral_padding_ab.padded_afresh(layer, 0, x0, g0, L, [None, None]),
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    rule, seen = SpectralConvGrads._chunk_spectra, []
    monkeypatch.setattr(
        spectral_padding_ab,
        "make_contender",
        lambda *args: lambda: seen.append(SpectralConvGrads._chunk_spectra),
    )
    steps = spectral_padding_ab.variants(None, None, None, "cpu")
    steps["gredp-afresh"]()
    steps["gredp-kept-zeros"]()
    assert (
        seen == [spectral_padding_ab.padded_afresh, rule]
        and SpectralConvGrads._chunk_spectra is rule
    )


cuda_ab = _script("cuda_ab")


def test_cuda_ab_runs_its_contenders_with_the_cpu_choices_and_restores_the_rule():
    """Its cpu-chunks contender runs with the CUDA chunk budget at the CPU's size, for the
    rules and the spectral mechanisms alike (both take it from ``rules.chunk_bytes``), its
    cpu-builds contender with the CPU's build forms; the rule is back after each."""
    from privgrad.per_sample import rules

    seen = []

    def step():
        cpu_builds = vars(rules.ConvGrads)["build_form"] is cuda_ab.CPU_BUILDS
        spectral_floats = rules.chunk_bytes(torch.device("cuda"), 0) // 4
        seen.append((rules.CUDA_CHUNK_FLOATS, spectral_floats, cpu_builds))

    rule = rules.CUDA_CHUNK_FLOATS
    cuda_ab.with_cpu_chunks(step)()
    cuda_ab.with_cpu_builds(step)()
    step()
    assert seen == [
        (rules._CHUNK_FLOATS, rules._CHUNK_FLOATS, False),
        (rule, rule, True),
        (rule, rule, False),
    ]
    # the CPU builds it switches to are the rule's own choice off CUDA
    conv = rules.ConvGrads(
        torch.nn.Conv2d(4, 3, 3), [torch.zeros(1, 4, 5, 5)], [torch.zeros(1, 3, 3, 3)]
    )
    assert cuda_ab.CPU_BUILDS.fget(conv) == conv.build_form == "grouped"


def test_cuda_ab_tf32_contender_runs_without_the_float32_guard_everywhere_it_is_used():
    from privgrad.mechanisms import base
    from privgrad.per_sample import engine, rules

    guards = (rules.float32_arithmetic, engine.float32_arithmetic, base.float32_arithmetic)
    seen = []

    def step():
        seen.append((rules.float32_arithmetic, engine.float32_arithmetic, base.float32_arithmetic))

    cuda_ab.with_tf32(step)()
    step()
    assert seen == [(contextlib.nullcontext,) * 3, guards]


lag_sum_ab = _script("lag_sum_ab")


def test_lag_sum_ab_contenders_are_the_two_forms_of_the_rule(monkeypatch):
    """Each contender's DP-SGD step sums the cell Gram's lags with its own form; the rule's
    choice is back afterwards."""
    from privgrad.per_sample import rules

    seen = []
    for form in ("view", "slices"):
        real = getattr(rules, f"_lag_sum_by_{form}")
        monkeypatch.setattr(
            rules,
            f"_lag_sum_by_{form}",
            lambda *a, form=form, real=real: seen.append(form) or real(*a),
        )
    rule = rules._lag_sum
    spec = step_time.MODELS["cnn"]  # its second conv takes the Gram form from cells
    x, y = spec.data(4, torch.Generator().manual_seed(0))
    for name, step in lag_sum_ab.variants(spec, x, y, torch.device("cpu")).items():
        seen.clear()
        step()
        assert seen and set(seen) == {name.removeprefix("dpsgd-")}, (name, seen)
        assert rules._lag_sum is rule
