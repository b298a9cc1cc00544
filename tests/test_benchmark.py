"""benchmarks/step_time.py: the --quick --json run (schema, one row per contender, memory
probes) and the benchmark's models."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from privgrad.errors import PrivgradError
from privgrad.app.models import build_model
from kernel_guard import skip_unless_fused_runs  # tests/kernel_guard.py

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

    assert set(step_time.CONTENDERS) == {
        "non-private",
        "opacus-flat",
        "opacus-ghost",
        "non-private-bf16",
        "dpsgd-bf16",
        "dpsgd-fused",
        "dpsgd-fused-x3",
        "dpsgd-bookkept",
        "dpsgd-graphed",
        "dpsgd-chunk64",
        "dpsgd-graphed-chunk64",
        "dpsgd-gemm-x3",
        "dpsgd-graphed-gemm-x3",
        "fastdp-bk",
    } | set(MECHANISMS)
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
        "transformer-torch",
        "mobilenet",
        "mixtral",
        "mamba",
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
        ("transformer-torch", 4_172_802),
        ("wrn16-4", 2_748_890),
        ("mixtral", 9_250_560),
        ("mamba", 3_436_802),
    ],
)
def test_benchmark_models(name, params):
    spec = step_time.MODELS[name]
    model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == params
    x, y = spec.data(2, torch.Generator().manual_seed(0))
    assert model(x).shape == (2, 2 if name.startswith(("transformer", "mixtral", "mamba")) else 10)


def test_torch_transformer_model_runs_a_quick_round():
    """The model from nn.TransformerEncoderLayer: privgrad's DP-SGD step and Opacus' (its
    nn.MultiheadAttention replaced by Opacus' DPMultiheadAttention) time against the
    non-private one, or Opacus is a skip with a note where it is not installed."""
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--json",
            "--no-memory",
            "--threads",
            "1",
            "--models",
            "transformer-torch",
            "--contenders",
            "dpsgd,opacus-ghost",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    by_name = {r["contender"]: r for r in rows if r["model"] == "transformer-torch"}
    assert by_name["dpsgd"]["cpu_ms"] > 0 and by_name["dpsgd"]["note"] is None
    assert by_name["opacus-ghost"]["cpu_ms"] or by_name["opacus-ghost"]["note"]


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
    "name",
    [
        "step_time_cpu.json",
        "step_time_gpu.json",
        "step_time_gpu_wrn16-4.json",
        "step_time_gpu_5bdb6c7.json",
        "step_time_gpu_a5efe05.json",
        "step_time_gpu_padded_a5efe05.json",
        "step_time_gpu_613dc9e.json",
        "step_time_gpu_chunks_613dc9e.json",
        "step_time_gpu_639f338.json",
    ],
)
def test_bench_readme_table_is_the_committed_benchmark(name):
    """results/bench/README.md's tables are `--table` of the committed JSON, not typed in."""
    root = SCRIPT.parents[1]
    committed = json.loads((root / "results" / "bench" / name).read_text())
    assert (
        step_time.markdown_table(committed)
        in (root / "results" / "bench" / "README.md").read_text()
    )


gpu_profile = _script("gpu_profile")


@pytest.mark.parametrize(
    "name",
    [
        "gpu_profile.json",
        "gpu_profile_5bdb6c7.json",
        "gpu_profile_a5efe05.json",
        "gpu_profile_613dc9e.json",
    ],
)
def test_bench_readme_profile_table_is_the_committed_profile(name):
    """The GPU profile tables in results/bench/README.md are `gpu_profile.py --table` of the
    committed JSON, and their ratios are computed from the rows (a kernel-time ratio of 1.00
    only for the non-private step itself)."""
    root = SCRIPT.parents[1]
    text = (root / "results" / "bench" / name).read_text()
    saved = json.loads(text.strip().splitlines()[-1])
    table = gpu_profile.markdown_table(saved)
    assert table in (root / "results" / "bench" / "README.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert all((r[2] == "non-private") == (r[6] == "1.00") for r in rows)


graph_probe = _script("graph_probe")


@pytest.mark.parametrize(
    "name", ["graph_probe_5bdb6c7.jsonl", "graph_probe_nonprivate_a5efe05.jsonl"]
)
def test_bench_readme_graph_probe_table_is_the_committed_probe(name):
    """The CUDA-graph tables in results/bench/README.md are `graph_probe.py --table` of the
    committed rows; a refused part names the privgrad line that refused, a captured one has
    its replay time."""
    root = SCRIPT.parents[1]
    path = root / "results" / "bench" / name
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert (
        graph_probe.markdown_table(rows) in (root / "results" / "bench" / "README.md").read_text()
    )
    assert all(
        r["captured"] == ("replay_ms" in r) and r["captured"] != ("where" in r) for r in rows
    )


def test_graph_probe_parts_run_eagerly_on_cpu():
    """Every part graph_probe.py captures on a GPU runs as built here (eagerly, on CPU): the
    stage parts replay DP-SGD's stages on the state the stages before them left."""
    cpu = torch.device("cpu")
    for part in graph_probe.PARTS:
        call, gens = graph_probe._part(part, "cnn", 8, cpu)
        call()
        assert gens == []  # a CPU noise generator is never registered with a CUDA graph
    spec = step_time.MODELS["cnn"]
    x, y = spec.data(8, torch.Generator().manual_seed(0))
    trainer = step_time.privgrad_step("dpsgd", spec.build(), x, y).trainer
    per_sample, _ = trainer.grad_sampler.compute(x, y, trainer.loss_fn)
    summed = graph_probe._stage(trainer, per_sample, 1)()  # the Sum stage, after the clip
    assert summed.grads is not None and summed.noise == []  # summed, no noise yet
    noised = graph_probe._stage(trainer, per_sample, 2)()
    assert len(noised.noise) == 1 and all(
        not torch.equal(a, b) for a, b in zip(noised.grads, summed.grads)
    )


held_memory = _script("held_memory")


def test_bench_readme_held_memory_table_is_the_script_on_the_committed_gpu_run():
    """The book-keeping memory table in results/bench/README.md is held_memory.py's output on
    the committed GPU run; WRN-16-4's held inputs and output gradients are 4 bytes times the
    activations' sizes (a wrong count would move its floor)."""
    root = SCRIPT.parents[1]
    saved = json.loads((root / "results" / "bench" / "step_time_gpu_5bdb6c7.json").read_text())
    table = held_memory.rows(saved)
    assert (
        held_memory.markdown_table(table) in (root / "results" / "bench" / "README.md").read_text()
    )
    wrn = next(r for r in table if (r["model"], r["batch"]) == ("wrn16-4", 256))
    # the first conv's output alone: 256 samples x 16 channels x 32 x 32, float32
    assert wrn["output_grads_mb"] > 256 * 16 * 32 * 32 * 4 / 2**20
    assert wrn["floor"] < wrn["dpsgd"]


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


def test_conv_rules_times_the_fused_kernel_after_checking_its_norms(capsys):
    """--fused adds the fused kernel's norms to every layer (Triton's interpreter here; on
    CUDA always), checked against the rule's norms before timing."""
    skip_unless_fused_runs()
    conv_rules.main(["--quick", "--json", "--fused", "--rounds", "1", "--calls", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["clock"] == "cpu" and result["device"] == "cpu"
    rows = [r for r in result["rows"] if r["contender"] == "fused"]
    assert [r["layer"] for r in rows] == list(conv_rules.QUICK) and all(
        r["cpu_ms"] > 0 for r in rows
    )


def test_conv_rules_refuses_a_contender_whose_norms_differ():
    fs, _ = conv_rules.contenders(
        conv_rules.QUICK["tiny.conv1"], 1 << 26, torch.Generator().manual_seed(0)
    )
    conv_rules.check_norms(fs, "tiny.conv1")  # they agree
    right = fs["build-patches"]
    fs["build-patches"] = lambda: right() * 1.01  # a 1 % error is caught
    with pytest.raises(AssertionError, match="build-patches"):
        conv_rules.check_norms(fs, "tiny.conv1")


def _made_with(script, monkeypatch, model: str) -> dict:
    """{contender: (mechanism, EngineFlags)} an A/B script's variants are made with (its
    ``make_contender`` recorded instead of run)."""
    monkeypatch.setattr(
        script, "make_contender", lambda mech, spec, x, y, device, flags=None: (mech, flags)
    )
    return script.variants(step_time.MODELS[model], None, None, "cpu")


def test_no_benchmark_patches_privgrad():
    """Variants are made with EngineFlags: no script switches an attribute of privgrad."""
    import re

    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"setattr\((?!args,)|with_attribute", text), path.name


gram_cells_ab = _script("gram_cells_ab")


def test_gram_cells_ab_contenders_take_the_rules_choice_and_the_patches(monkeypatch):
    """The A/B is not vacuous: with the flags of its contenders, the CNN's second conv takes
    its Gram from cells (the rule's choice) and from patches."""
    from privgrad.per_sample.rules import ConvGrads

    made = _made_with(gram_cells_ab, monkeypatch, "cnn")
    assert {n: (m, f.conv_gram) for n, (m, f) in made.items()} == {
        "dpsgd-cells": ("dpsgd", "auto"),
        "dpsgd-patches": ("dpsgd", "patches"),
    }
    conv = torch.nn.Conv2d(16, 32, 4, stride=2)
    x, g = torch.zeros(1, 16, 12, 12), torch.zeros(1, 32, 5, 5)
    assert [ConvGrads(conv, [x], [g], f).gram_by_cells for _, f in made.values()] == [True, False]


spectral_chunk_ab = _script("spectral_chunk_ab")


def test_spectral_chunk_ab_runs_its_fixed_contender_with_chunks_for_all_threads(monkeypatch):
    made = _made_with(spectral_chunk_ab, monkeypatch, "lenet5")
    assert {n: (m, f.spectral_chunk_per_thread) for n, (m, f) in made.items()} == {
        "gredp fixed": ("gredp", False),
        "gredp per-thread": ("gredp", True),
        "spectral-dp fixed": ("spectral-dp", False),
        "spectral-dp per-thread": ("spectral-dp", True),
    }
    assert spectral_chunk_ab.PER_THREAD == made["gredp fixed"][1].spectral_chunk_bytes


gram_blocks_ab = _script("gram_blocks_ab")


def test_gram_blocks_ab_compares_the_blocks_with_the_full_grams_they_replaced(monkeypatch):
    made = _made_with(gram_blocks_ab, monkeypatch, "transformer")
    assert {n: (m, f.gram_blocks_from) for n, (m, f) in made.items()} == {
        "dpsgd-blocks": ("dpsgd", 64),
        "dpsgd-full": ("dpsgd", None),
    }


spectral_padding_ab = _script("spectral_padding_ab")


def test_spectral_padding_ab_compares_kept_zeros_with_padding_afresh(monkeypatch):
    made = _made_with(spectral_padding_ab, monkeypatch, "lenet5")
    assert {n: (m, f.spectral_padding) for n, (m, f) in made.items()} == {
        f"{m}-{p}": (m, p) for m in ("gredp", "spectral-dp") for p in ("kept-zeros", "afresh")
    }


cuda_ab = _script("cuda_ab")


@pytest.mark.parametrize(
    "model, mechanisms", [("cnn", ["dpsgd"]), ("lenet5", ["spectral-dp", "gredp"])]
)
def test_cuda_ab_runs_its_contenders_with_the_cpu_choices(monkeypatch, model, mechanisms):
    """Its cpu-chunks contender runs with the CUDA chunk budget at the CPU's size (for the
    rules and the spectral mechanisms alike: both take it from ``rules.chunk_bytes``), its
    cpu-builds contender with the CPU's build forms, its tf32 contender without the float32
    guard; each changes nothing else."""
    from privgrad.per_sample import EngineFlags, rules

    made = _made_with(cuda_ab, monkeypatch, model)
    default, cuda = EngineFlags(), torch.device("cuda")
    assert list(made) == [
        m + s for m in mechanisms for s in ("", "-cpu-chunks", "-cpu-builds", "-tf32")
    ]
    for m in mechanisms:
        assert made[m] == (m, default)
        chunks = made[m + "-cpu-chunks"][1]
        assert rules.chunk_bytes(cuda, 0, chunks) == 4 * default.chunk_floats
        assert rules.chunk_bytes(cuda, 0, default) == 4 * default.cuda_chunk_floats
        assert made[m + "-cpu-builds"][1] == EngineFlags(conv_build="cpu")
        assert made[m + "-tf32"][1] == EngineFlags(float32_guard=False)
    # the CPU builds it switches to are the rule's own choice off CUDA
    conv = torch.nn.Conv2d(4, 3, 3)
    x, g = [torch.zeros(1, 4, 5, 5)], [torch.zeros(1, 3, 3, 3)]
    cpu_builds = made[mechanisms[0] + "-cpu-builds"][1]
    assert rules.ConvGrads(conv, x, g, cpu_builds).build_form == "grouped"
    assert rules.ConvGrads(conv, x, g).build_form == "grouped"


def test_the_float32_guard_off_leaves_the_tf32_settings_alone():
    from privgrad.per_sample.rules import float32_arithmetic

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.allow_tf32, matmul.allow_tf32
    try:
        cudnn.allow_tf32 = matmul.allow_tf32 = True
        with float32_arithmetic(False):
            assert cudnn.allow_tf32 and matmul.allow_tf32
        with float32_arithmetic():
            assert not cudnn.allow_tf32 and not matmul.allow_tf32
        assert cudnn.allow_tf32 and matmul.allow_tf32
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


lag_sum_ab = _script("lag_sum_ab")


def test_lag_sum_ab_contenders_run_the_two_forms_of_the_rule():
    """Each contender's DP-SGD step runs its engine with its lag-sum form, and the CNN's
    conv layers that take the Gram from cells get that form."""
    from privgrad.per_sample.rules import ConvGrads
    from privgrad.private import per_sample_cross_entropy

    spec = step_time.MODELS["cnn"]  # its second conv takes the Gram form from cells
    x, y = spec.data(4, torch.Generator().manual_seed(0))
    for name, step in lag_sum_ab.variants(spec, x, y, torch.device("cpu")).items():
        step()
        form = name.removeprefix("dpsgd-")
        psg, _ = step.trainer.grad_sampler.compute(x, y, per_sample_cross_entropy)
        convs = [layer for layer in psg.layers if isinstance(layer, ConvGrads)]
        assert psg.flags.lag_sum == form
        assert any(c.inputs is not None and c.gram_by_cells for c in convs)
        assert all(c.flags.lag_sum == form for c in convs)


def _after_two_steps(name: str, batch: int):
    """(trainer, its parameters flattened) after two steps of contender ``name`` on the CNN,
    from the same weights, batch and noise seed at every call."""
    spec, gen = step_time.MODELS["cnn"], torch.Generator().manual_seed(1)
    x = torch.randn(batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    step = step_time.make_contender(name, spec, x, y, torch.device("cpu"))
    step()
    step()
    return step.trainer, torch.cat([p.detach().flatten() for p in step.trainer.model.parameters()])


def test_graphed_contender_steps_as_dpsgd_does():
    """dpsgd-graphed is DP-SGD's step captured as a CUDA graph (run eagerly, padded, here):
    two steps from the same weights, batch and noise seed give the same parameters to float
    rounding, through the graphed path."""
    eager, expected = _after_two_steps("dpsgd", 5)
    graphed, got = _after_two_steps("dpsgd-graphed", 5)
    assert eager._graphed is None and graphed._graphed is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, dot", [("dpsgd-fused", "ieee"), ("dpsgd-fused-x3", "tf32x3")])
def test_fused_contender_steps_as_dpsgd_does(name, dot):
    """dpsgd-fused(-x3) is DP-SGD with the fused norm kernels (Triton's interpreter here):
    two steps from the same weights, batch and noise seed give the same parameters to float
    rounding, so the benchmark times the same mechanism."""
    skip_unless_fused_runs()
    eager, expected = _after_two_steps("dpsgd", 4)
    fused, got = _after_two_steps(name, 4)
    flags = fused.grad_sampler.flags
    assert (eager.grad_sampler.flags.norm_form, flags.norm_form, flags.fused_dot) == (
        "auto",
        "fused",
        dot,
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


live_memory = _script("live_memory")


def test_live_memory_counts_what_a_step_makes_and_holds_at_its_peak():
    """The CPU tracker's peak is the most bytes that the step's own tensors hold at once:
    a 1 MB tensor kept while a 2 MB one is made gives 3 MB, what existed before gives none,
    and a tensor freed before the next is made does not add."""
    before = torch.zeros(1 << 20)  # 4 MB, there before the step

    def step():
        kept = torch.ones(1 << 18)  # 1 MB
        torch.ones(1 << 19).sum()  # 2 MB, made while `kept` lives, then freed
        torch.ones(1 << 17).sum()  # 0.5 MB, made after the 2 MB one is gone
        before.add_(kept.sum())

    live = live_memory.peak_of(step)
    assert 3 * live_memory.MB <= live.peak <= 3 * live_memory.MB + 8  # and a scalar's 4 bytes
    assert sorted(size for size, _ in live.at_peak)[-2:] == [1 << 20, 2 << 20]
    assert {label.split(" @")[0] for _, label in live.at_peak} == {"ones.default", "sum.default"}


def test_live_memory_quick_run_reports_each_contender_against_non_private(capsys):
    assert (
        live_memory.main(
            ["--models", "cnn", "--batch-size", "8", "--contenders", "dpsgd", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["contender"]: r for r in out["rows"]}
    assert set(rows) == {"non-private", "dpsgd"}
    assert rows["non-private"]["x_non_private"] == 1
    for r in rows.values():
        assert r["peak_extra_mb"] > 0
        assert 0 < sum(h["mb"] for h in r["held_at_peak"]) <= r["peak_extra_mb"] + 1e-9


def test_live_memory_saves_one_code_version_per_file_and_tabulates_before_after(tmp_path):
    """--out adds rows to a file (a rerun of a row replaces it) and refuses a run of another
    commit; --table sets two such files beside a GPU run's peaks, the ratio over the GPU's
    non-private peak."""

    def result(commit, contender, mb):
        rows = [{"model": "m", "batch": 8, "contender": contender, "peak_extra_mb": mb}]
        return {"git_commit": commit, "forms": "f", "command": f"run {mb}", "rows": rows}

    before, after = tmp_path / "before.json", tmp_path / "after.json"
    live_memory.save(str(before), result("aaaaaaa1", "dpsgd", 300.0))
    live_memory.save(str(after), result("bbbbbbb2", "non-private", 90.0))
    live_memory.save(str(after), result("bbbbbbb2", "dpsgd", 150.0))
    live_memory.save(str(after), result("bbbbbbb2", "dpsgd", 120.0))
    saved = json.loads(after.read_text())
    assert [r["peak_extra_mb"] for r in saved["rows"]] == [90.0, 120.0]
    assert saved["commands"] == ["run 90.0", "run 150.0", "run 120.0"]
    with pytest.raises(SystemExit, match="git_commit"):
        live_memory.save(str(after), result("ccccccc3", "dpsgd", 1.0))
    gpu = {
        "git_commit": "ddddddd4",
        "rows": [
            {"model": "m", "batch": 8, "contender": "non-private", "peak_extra_mb": 100.0},
            {"model": "m", "batch": 8, "contender": "dpsgd", "peak_extra_mb": 299.0},
        ],
    }
    table = live_memory.markdown_table(
        json.loads(before.read_text()), json.loads(after.read_text()), gpu
    )
    assert "| m | 8 | dpsgd | 299 | 300 | 120 | 1.20 |" in table
    assert "| m | 8 | non-private | 100 | – | 90 | – |" in table


def test_bench_readme_live_memory_table_is_the_script_on_the_committed_runs():
    """The live-memory table in results/bench/README.md is live_memory.py --table on the
    committed before/after runs and the H100 run, each file of one clean commit."""
    bench = SCRIPT.parents[1] / "results" / "bench"
    before, after, gpu = (
        json.loads((bench / name).read_text())
        for name in (
            "live_memory_e1fa810.json",
            "live_memory_398d925.json",
            "step_time_gpu_a5efe05.json",
        )
    )
    assert live_memory.markdown_table(before, after, gpu) in (bench / "README.md").read_text()
    for saved, short in ((before, "e1fa810"), (after, "398d925")):
        assert saved["git_commit"].startswith(short) and not saved["git_commit"].endswith("dirty")


def test_gpu_session_limits_fit_one_device_call():
    """benchmarks/gpu_session.sh runs as one device call of at most 600 s: its default steps'
    time limits (pytest, each step_time group, the sketches, the profile) add up to less, and
    so do the opt-in graph-load part's (its rounds, after its load's start) with the pytest's
    at the limit the call benchmarks/gpu_prepare.sh prints gives it, and the sketches'."""
    text = (SCRIPT.parent / "gpu_session.sh").read_text()
    load = re.search(r"^if want graph-load; then$(.*?)^fi$", text, re.M | re.S).group(1)
    rest = text.replace(load, "")
    limits = [int(n) for n in re.findall(r'^\s*timeout "?(?:\$\{PYTEST_LIMIT:-)?(\d+)', rest, re.M)]
    groups = re.search(r"^for group in (.*); do$", rest, re.M).group(1)
    default = re.search(r"GPU_PARTS:-([^}]*)\}", text).group(1).split()
    opt_in = [g for g in re.findall(r'"([^"]+)"', groups) if g.split(":")[0] not in default]
    assert opt_in == ["mixtral:60:"]  # named in GPU_PARTS only
    limits += [int(g.split(":")[1]) for g in re.findall(r'"([^"]+)"', groups) if g not in opt_in]
    assert len(limits) == 7 and sum(limits) < 600
    rounds = len(re.search(r"^\s*for round in ([\d ]+); do$", load, re.M).group(1).split())
    (round_limit,) = [
        int(n) for n in re.findall(r"^\s*timeout (\d+) python3 -m pytest", load, re.M)
    ]
    (start,) = [int(n) for n in re.findall(r"^\s*sleep (\d+)$", load, re.M)]
    prepare = (SCRIPT.parent / "gpu_prepare.sh").read_text()
    assert 'GPU_PARTS="graph-load pytest sketch"' in prepare
    pytest_limit = int(re.search(r"PYTEST_LIMIT=(\d+)", prepare).group(1))
    (sketch,) = [int(n) for n in re.findall(r"timeout (\d+) python3 benchmarks/sketch_cost", text)]
    assert start + rounds * round_limit + pytest_limit + sketch < 600


def test_live_memory_passes_over_a_lazy_modules_uninitialised_parameters():
    """Tensors alive before the step include whatever the process holds, such as a lazy
    module's parameters, which have no storage to read, or a functional tensor another test
    left (whose storage's pointer raises): they are passed over."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    lazy = torch.nn.LazyLinear(3)  # noqa: F841 (alive while the tracker looks)
    with FunctionalTensorMode():
        traced = torch.ones(3)  # noqa: F841
    live = live_memory.peak_of(lambda: torch.ones(1 << 18).sum())
    assert live.peak >= live_memory.MB


def test_sketch_cost_times_the_step_and_the_record_of_its_parameters(capsys):
    """benchmarks/sketch_cost.py (issue 42's GPU script runs it on CUDA): a DP-SGD step and the
    record of its parameters' sketches, each timed, the record a part of the step's time."""
    _script("sketch_cost").main(["--models", "cnn:8", "--rounds", "1", "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert (row["model"], row["batch"], row["tensors"]) == ("cnn", 8, 8)
    assert 0 < row["record_wall_ms"] < row["step_wall_ms"] and 0 < row["record_share_wall"] < 1
