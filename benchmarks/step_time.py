"""Step-time benchmark: a non-private step, privgrad's mechanisms and Opacus, side by side.

For each (model, batch) setting, every contender gets its own copy of the same model
(same initial weights) and the same batch, all in ONE process at a fixed thread count.
After warm-up steps, the contenders run in interleaved rounds (round-robin, the order
rotated each round, so drift in machine speed hits all alike); each round times
``--steps-per-round`` steps of each contender (by default as many as make the
non-private step's round last 0.2 s of CPU time, at least 1) in CPU time
(``time.process_time``: all threads of the process) and wall time. Reported: the median
over rounds of the time per step, its ratio to the median non-private step of the same
setting, and the range over rounds of each round's CPU ratio (``cpu_ratio_range``: how
far one round's ratio strays on a shared machine).

Contenders: ``non-private`` (plain forward, mean loss, backward, SGD step; always run, it is
the baseline); every privgrad mechanism by name, run through ``make_private`` and
the body of ``PrivateTrainer.step``, the code path training uses (per-sample gradients,
the mechanism's chain, the optimizer step, the accounting), at σ = 1, C = 1; gip and
random-k with a constant k (their schedules' final 0.1 and 0.5) so that every timed step
prunes; ``opacus-flat`` (GradSampleModule + DPOptimizer) and ``opacus-ghost`` (Opacus'
ghost clipping: GradSampleModuleFastGradientClipping + DPOptimizerFastGradientClipping +
DPLossFastGradientClipping), skipped with a note when Opacus is not installed or cannot
handle the model. Named with ``--contenders`` only: ``non-private-bf16`` and ``dpsgd-bf16``
(bf16 autocast), ``dpsgd-fused`` (DP-SGD with the fused Triton norm kernels,
``EngineFlags(norm_form="fused")``: CUDA), ``dpsgd-fused-x3`` (the same kernels multiplying
by three TF32 tensor-core products, ``fused_dot="tf32x3"``), ``dpsgd-bookkept`` (no conv
layer keeps its built per-sample gradients: ``EngineFlags(keep_built=False)``),
``dpsgd-graphed`` (the per-sample part and chain replayed as a CUDA graph:
``EngineFlags(cuda_graphs=True)``; the fixed batch is a multiple of its bucket, so no padded
row is timed), ``dpsgd-chunk64`` and ``dpsgd-graphed-chunk64`` (the same two steps with CUDA
chunks of 64 MB, ``cuda_chunk_floats=1 << 24``, instead of the default 256 MB),
``dpsgd-gemm-x3`` and ``dpsgd-graphed-gemm-x3`` (the same two steps with the layers' cuBLAS
and cuDNN products as three TF32 tensor-core products each, ``gemm_dot="tf32x3"``) and
``fastdp-bk`` (fastDP, from ``.fastdp/``).

Peak extra memory: each contender again in a fresh process (this script with a hidden
``--probe``; as many at once as there are cores, after the setting's timings): build model,
batch and contender, reset the peak resident set size (write 5 to /proc/self/clear_refs),
note VmRSS, run 2 steps, read VmHWM; the difference is the
memory the steps needed beyond the state before the first step (the first step's lazy
allocations, e.g. Adam's moments, included). On CUDA: torch.cuda's peak allocated bytes
over the allocated bytes before the first step, measured in the benchmark's own process
(the caching allocator counts exactly what is allocated, so a fresh process, which costs
seconds of CUDA start-up per contender, is not needed).

Threads: ``--threads`` (default 2) sets torch's intra-op threads. OpenMP workers spin
while idle unless OMP_WAIT_POLICY=PASSIVE, which would count spinning as CPU time; the
script re-executes itself with OMP_WAIT_POLICY=PASSIVE when the variable is unset (export
it yourself to choose otherwise; the value used is reported).

    python benchmarks/step_time.py                       # the default matrix (issue 16)
    python benchmarks/step_time.py --models cnn --batch-size 256 --contenders dpsgd,gip
    python benchmarks/step_time.py --quick --json        # tiny, for CI; JSON as the last line
    # the table of results/bench/README.md:
    python benchmarks/step_time.py --table results/bench/step_time_cpu.json
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from privgrad import make_private  # noqa: E402
from privgrad.errors import PrivgradError  # noqa: E402
from privgrad.mechanisms import MECHANISMS, build_mechanism  # noqa: E402
from privgrad.app.models import build_model  # noqa: E402
from privgrad.optim import build_optimizer  # noqa: E402
from privgrad.per_sample import EngineFlags  # noqa: E402

# torch's notice on every backward through Opacus' hooks when the input needs no gradient
warnings.filterwarnings("ignore", message="Full backward hook is firing")

NOISE_MULTIPLIER, MAX_GRAD_NORM, LR = 1.0, 1.0, 0.01
MEMORY_STEPS = 2
ROUND_SECONDS = 0.2  # CPU time of the non-private step's round when --steps-per-round is not given
# gip/random-k: a constant k (each schedule's final value) so that every timed step prunes
MECHANISM_OPTIONS = {
    "gip": {"k_schedule": "constant", "index_epsilon_total": 0.01},
    "random-k": {"k_schedule": "constant"},
}
PRIVGRAD = [m for m in MECHANISMS if m != "non-private"]
OPACUS = ["opacus-flat", "opacus-ghost"]
# mixed precision (named with --contenders only): forward and backward under bf16 autocast,
# the private part in fp32 (GradSampler's precision); ratios are to the fp32 non-private step
BF16 = ["non-private-bf16", "dpsgd-bf16"]
# DP-SGD with other engine flags (named with --contenders only): "fused", every linear and
# conv layer's norms by the fused Triton kernels (privgrad/per_sample/fused.py; CUDA);
# "fused-x3", the same with three TF32 tensor-core products per float32 product
# (EngineFlags.fused_dot); "bookkept", no conv layer keeping its built per-sample gradients
# for the sum (less memory, a second weight-gradient convolution per layer)
FLAGGED = {
    "dpsgd-fused": {"norm_form": "fused"},
    "dpsgd-fused-x3": {"norm_form": "fused", "fused_dot": "tf32x3"},
    "dpsgd-bookkept": {"keep_built": False},
    "dpsgd-graphed": {"cuda_graphs": True},
    # CUDA chunks of 64 MB, the default until the fourth H100 run, against today's 256 MB
    "dpsgd-chunk64": {"cuda_chunk_floats": 1 << 24},
    "dpsgd-graphed-chunk64": {"cuda_graphs": True, "cuda_chunk_floats": 1 << 24},
    # the Grams, builds and book-kept sums as three TF32 tensor-core products each
    # (EngineFlags.gemm_dot), the eager and the captured step
    "dpsgd-gemm-x3": {"gemm_dot": "tf32x3"},
    "dpsgd-graphed-gemm-x3": {"cuda_graphs": True, "gemm_dot": "tf32x3"},
}
# fastDP's book-keeping DP-SGD, from .fastdp/ (benchmarks/fastdp_contender.py)
FASTDP = ["fastdp-bk"]
CONTENDERS = ["non-private", *PRIVGRAD, *OPACUS, *BF16, *FLAGGED, *FASTDP]


# --------------------------------------------------------------------------- models


class SelfAttentionBlock(nn.Module):
    """Post-norm encoder block as ``nn.TransformerEncoderLayer`` (ReLU, no dropout), built
    from Linear and LayerNorm so that per-sample rules (privgrad's and Opacus') apply."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        x = self.norm1(x + self.out(attended))
        return self.norm2(x + self.ff2(F.relu(self.ff1(x))))


class TransformerClassifier(nn.Module):
    """Token + learned position embeddings, encoder blocks, mean over positions, linear head
    (defaults: 2 blocks, width 256, 4 heads, 10k tokens, 128 positions: 4.17 M parameters).
    The blocks are :class:`SelfAttentionBlock` s, or with ``torch_layers`` PyTorch's own
    ``nn.TransformerEncoderLayer`` (same shapes and parameter count, post-norm, ReLU, no
    dropout), whose ``nn.MultiheadAttention`` privgrad takes by its attention rule."""

    def __init__(
        self,
        num_tokens: int = 10_000,
        seq_len: int = 128,
        dim: int = 256,
        heads: int = 4,
        hidden: int = 1024,
        layers: int = 2,
        num_classes: int = 2,
        torch_layers: bool = False,
    ):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(num_tokens, dim), nn.Embedding(seq_len, dim)
        if torch_layers:
            layer = nn.TransformerEncoderLayer(dim, heads, hidden, dropout=0.0, batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        else:
            self.blocks = nn.Sequential(
                *[SelfAttentionBlock(dim, heads, hidden) for _ in range(layers)]
            )
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        # contiguous: Opacus' ghost norm of an embedding views its ids
        positions = (
            torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()
        )
        return self.head(self.blocks(self.tokens(tokens) + self.positions(positions)).mean(1))


def images(shape):
    def data(batch, gen):
        return torch.randn(batch, *shape, generator=gen), torch.randint(
            0, 10, (batch,), generator=gen
        )

    return data


def token_ids(batch, gen, num_tokens=10_000, seq_len=128):
    return (
        torch.randint(0, num_tokens, (batch, seq_len), generator=gen),
        torch.randint(0, 2, (batch,), generator=gen),
    )


class Mixtral(nn.Module):
    """A Mixtral sequence classifier from a configuration (transformers needed: pip install -e
    ".[hf]"), its logits out: 2 layers of width 256, 8 experts of width 512, 2 per token."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=10_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
            num_experts_per_tok=2, max_position_embeddings=128, num_labels=2, pad_token_id=0,
        )  # fmt: skip
        self.model = transformers.MixtralForSequenceClassification(config)

    def forward(self, tokens):
        return self.model(input_ids=tokens).logits


class Mamba(nn.Module):
    """A Mamba classifier from a configuration (transformers needed): Hugging Face's
    MambaModel, 2 layers of width 256 (inner width 512, state 16), its last position's hidden
    state through a linear head."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.MambaConfig(
            vocab_size=10_000, hidden_size=256, intermediate_size=512, state_size=16,
            num_hidden_layers=2, use_cache=False, pad_token_id=0,
        )  # fmt: skip
        self.model = transformers.MambaModel(config)
        self.head = nn.Linear(256, 2)

    def forward(self, tokens):
        return self.head(self.model(input_ids=tokens).last_hidden_state[:, -1])


class MobileNet(nn.Module):
    """MobileNetV2's inverted residuals (Sandler et al. 2018), small, with GroupNorm for its
    BatchNorm (gcd(32, channels) groups, as privgrad.layers.replace_batch_norm makes them):
    1×1 expansion ×4, 3×3 depthwise, 1×1 projection, ReLU6; widths 32, 48, 64 on 32×32
    images."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def norm(c):
            return nn.GroupNorm(math.gcd(32, c), c)

        def block(c_in, c_out, stride):
            wide = 4 * c_in
            return nn.Sequential(
                nn.Conv2d(c_in, wide, 1, bias=False), norm(wide), nn.ReLU6(),
                nn.Conv2d(wide, wide, 3, stride, 1, groups=wide, bias=False), norm(wide),
                nn.ReLU6(), nn.Conv2d(wide, c_out, 1, bias=False), norm(c_out),
            )  # fmt: skip

        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), norm(32), nn.ReLU6())
        self.blocks = nn.ModuleList(
            [block(32, 32, 1), block(32, 48, 2), block(48, 48, 1), block(48, 64, 2)]
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            y = b(x)
            x = x + y if y.shape == x.shape else y  # the residual where shapes allow
        return self.head(x.mean((2, 3)))


@dataclass
class ModelSpec:
    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batches: tuple[int, ...]
    contenders: tuple[str, ...]
    default: bool = True  # in the default matrix (else only when named with --models)


MNIST, CIFAR = (1, 28, 28), (3, 32, 32)
WITH_OPACUS = ("non-private", "dpsgd", *OPACUS)
SPECTRAL = ("non-private", "dpsgd", "spectral-dp", "gredp")
MODELS = {
    "cnn": ModelSpec(
        lambda: build_model("cnn", MNIST, 10),
        images(MNIST),
        (256, 1024),
        (
            "non-private",
            "dpsgd",
            "dp-adam",
            "dp-signsgd",
            "dp-signadam",
            "gip",
            "random-k",
            *OPACUS,
        ),
    ),
    # opacus-flat is left out by default: its per-sample gradients alone take B × 6.3 M floats
    # (6.5 GB at B = 256); ask for it with --contenders
    "cnn-x16": ModelSpec(
        lambda: build_model("cnn", MNIST, 10, width=16),
        images(MNIST),
        (256,),
        ("non-private", "dpsgd", "opacus-ghost"),
    ),
    "model3-gn": ModelSpec(
        lambda: build_model("model3", CIFAR, 10, norm_groups=16), images(CIFAR), (128,), WITH_OPACUS
    ),
    "transformer": ModelSpec(TransformerClassifier, token_ids, (64,), WITH_OPACUS),
    "lenet5": ModelSpec(lambda: build_model("lenet5", MNIST, 10), images(MNIST), (256,), SPECTRAL),
    "model1": ModelSpec(
        lambda: build_model("model1", MNIST, 10, act="relu"), images(MNIST), (256,), SPECTRAL
    ),
    "lenet5-bc": ModelSpec(
        lambda: build_model("lenet5-bc", MNIST, 10), images(MNIST), (256,), SPECTRAL
    ),
    # a model of the size people train on a GPU (GIP's WRN-16-4, 2.75 M parameters): about
    # 0.5 GMAC per image forward, so a step at B = 256 takes seconds on two CPU cores; named
    # with --models only (the GPU session runs it)
    "wrn16-4": ModelSpec(
        lambda: build_model("wrn", CIFAR, 10, act="relu", depth=16, width=4),
        images(CIFAR),
        (256,),
        WITH_OPACUS,
        default=False,
    ),
    # "transformer" from nn.TransformerEncoderLayer (nn.MultiheadAttention inside); named
    # with --models only
    "transformer-torch": ModelSpec(
        lambda: TransformerClassifier(torch_layers=True),
        token_ids,
        (64,),
        WITH_OPACUS,
        default=False,
    ),
    # depthwise convolutions (rules.GroupedConvGrads); named with --models only
    "mobilenet": ModelSpec(MobileNet, images(CIFAR), (128,), WITH_OPACUS, default=False),
    # a mixture of experts (privgrad/per_sample/experts.py); named with --models only
    "mixtral": ModelSpec(Mixtral, token_ids, (32,), ("non-private", "dpsgd"), default=False),
    # a state-space model: its mixers replayed by the generic rule for their conv1d, dt_proj,
    # A_log and D (rules.READ_CHILDREN); named with --models only
    "mamba": ModelSpec(Mamba, token_ids, (32,), ("non-private", "dpsgd"), default=False),
}
DEFAULT_MODELS = [name for name, spec in MODELS.items() if spec.default]


# --------------------------------------------------------------------------- contenders


class Skip(Exception):
    """A contender that cannot run this setting (the reason goes in its row)."""


def non_private_step(model, x, y, precision: torch.dtype | None = None):
    """A plain SGD step; with ``precision``, its forward under autocast at that dtype."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=precision, enabled=precision is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


class PrivgradStep:
    """One private step of ``trainer`` on the fixed batch: the body of PrivateTrainer.step
    (step() takes only batches its Poisson sampler drew; drawing one would add data loading
    to privgrad's side only)."""

    def __init__(self, trainer, x, y):
        self.trainer, self.x, self.y = trainer, x, y

    def __call__(self):
        self.trainer._step(self.x, self.y)


def privgrad_step(name, model, x, y, flags: EngineFlags | None = None, precision: str = "fp32"):
    """``name``'s step, its engine run with ``flags`` (default: the engine's own choices) and
    its forward and backward at ``precision``."""
    mech = build_mechanism(name, NOISE_MULTIPLIER, MAX_GRAD_NORM, **MECHANISM_OPTIONS.get(name, {}))
    opt = build_optimizer(mech.optimizer, model.parameters(), LR)
    trainer = make_private(
        model, opt, (x, y), mechanism=mech, noise_multiplier=NOISE_MULTIPLIER, batch_size=len(x),
        seed=0,  # every contender's noise alike (a benchmark releases nothing)
    )  # fmt: skip
    if flags is not None:
        trainer.grad_sampler.flags = flags
    trainer.grad_sampler.precision = precision
    return PrivgradStep(trainer, x, y)


def opacus_step(name, model, x, y):
    try:
        import opacus  # noqa: F401
    except ImportError:
        raise Skip("opacus not installed (pip install -e '.[bench]')") from None
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from opacus.validators import ModuleValidator

    if any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        # Opacus' own way: nn.MultiheadAttention replaced by its DPMultiheadAttention
        model = ModuleValidator.fix(model)
    dp = dict(
        noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=len(x)
    )
    if name == "opacus-flat":
        gsm = GradSampleModule(model)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR), **dp)
        loss = F.cross_entropy
    else:
        gsm = GradSampleModuleFastGradientClipping(
            model, max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True
        )
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=LR), **dp)
        loss = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())

    def step():
        opt.zero_grad(set_to_none=True)
        loss(gsm(x), y).backward()
        opt.step()

    return step


def fastdp_step(model, x, y):
    from fastdp_contender import FastDPUnavailable, fastdp_step as step  # this folder

    try:
        return step(model, x, y, NOISE_MULTIPLIER, MAX_GRAD_NORM, LR)
    except FastDPUnavailable as e:
        raise Skip(f"fastDP unavailable: {e}") from None


@contextmanager
def skip_on_failure(name):
    """Turns privgrad's refusal of a model, or any failure of Opacus, into a :class:`Skip`."""
    try:
        yield
    except PrivgradError as e:
        raise Skip(f"privgrad refuses: {e}") from None
    except Exception as e:
        if name in OPACUS + FASTDP and not isinstance(e, Skip):
            who = "fastDP" if name in FASTDP else "Opacus"
            raise Skip(f"{who} cannot handle this model: {type(e).__name__}: {e}") from None
        raise


def make_contender(name, spec, x, y, device, flags: EngineFlags | None = None):
    """The contender's step on a fresh copy of the model (same seed: same initial weights);
    a privgrad contender's engine runs with ``flags`` (default: its own choices)."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    with skip_on_failure(name):
        if name == "non-private":
            return non_private_step(model, x, y)
        if name == "non-private-bf16":
            return non_private_step(model, x, y, torch.bfloat16)
        if name == "dpsgd-bf16":
            return privgrad_step("dpsgd", model, x, y, flags, precision="bf16")
        if name in FLAGGED:
            other = replace(flags or EngineFlags(), **FLAGGED[name])
            return privgrad_step(name.split("-")[0], model, x, y, other)
        if name in OPACUS:
            return opacus_step(name, model, x, y)
        if name in FASTDP:
            return fastdp_step(model, x, y)
        return privgrad_step(name, model, x, y, flags)


def run_steps(name, step, n):
    with skip_on_failure(name):
        for _ in range(n):
            step()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- measuring


def interleaved_rounds(calls: dict, rounds: int, per_round: int, sync=lambda: None):
    """Runs every callable ``per_round`` times in each of ``rounds`` rounds, the order rotated
    each round; returns ({name: [CPU s per call, one per round]}, {name: [wall s per call]}).
    ``sync`` runs before and after each timed block (a device's queue)."""
    names = list(calls)
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = calls[name]
            sync()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                call()
            sync()
            cpu[name].append((time.process_time() - c0) / per_round)
            wall[name].append((time.perf_counter() - w0) / per_round)
    return cpu, wall


def time_setting(spec, batch, contenders, args, device, log):
    """{contender: (cpu seconds per step, wall seconds per step) medians, (min, max) over
    rounds of the round's CPU ratio to the non-private step}, skip notes and the steps per round."""
    x, y = (t.to(device) for t in spec.data(batch, torch.Generator().manual_seed(0)))
    steps, skipped = {}, {}
    for name in contenders:
        try:
            steps[name] = make_contender(name, spec, x, y, device)
            run_steps(name, steps[name], args.warmup)
        except Skip as e:
            steps.pop(name, None)
            skipped[name] = str(e)
            log(f"  {name}: skipped ({e})")
    if "non-private" not in steps:
        raise SystemExit(f"error: the non-private step failed: {skipped.get('non-private')}")
    per_round = args.steps_per_round
    if per_round is None:
        c0 = time.process_time()
        run_steps("non-private", steps["non-private"], 1)
        per_round = max(1, round(ROUND_SECONDS / max(time.process_time() - c0, 1e-6)))
    names = list(steps)
    cpu, wall = interleaved_rounds(steps, args.rounds, per_round, lambda: synchronize(device))
    del steps
    gc.collect()
    base = cpu["non-private"]
    ranges = {
        n: (min(c / b for c, b in zip(cpu[n], base)), max(c / b for c, b in zip(cpu[n], base)))
        for n in names
    }
    return (
        {n: (statistics.median(cpu[n]), statistics.median(wall[n]), ranges[n]) for n in names},
        skipped,
        per_round,
    )


def _proc_status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"no {field} in /proc/self/status")


def probe(model, batch, contender, args, device):
    """In a fresh process: peak extra memory (MB) of ``args.memory_steps`` steps (see the
    module's docstring)."""
    spec = MODELS[model]
    x, y = (t.to(device) for t in spec.data(batch, torch.Generator().manual_seed(0)))
    try:
        step = make_contender(contender, spec, x, y, device)
    except Skip as e:
        return {"skipped": str(e)}
    gc.collect()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS
            base = _proc_status("VmRSS")
        except OSError as e:
            return {"skipped": f"cannot measure peak memory here: {e}"}
    try:
        run_steps(contender, step, args.memory_steps)
    except Skip as e:
        return {"skipped": str(e)}
    synchronize(device)
    peak = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _proc_status("VmHWM")
    )
    return {"peak_extra_mb": round((peak - base) / 2**20, 1)}


def peak_extra_mbs(model, batch, contenders, args):
    """{contender: (peak extra MB, why none)} of :func:`probe`; on CPU the fresh processes
    run as many at once as there are cores (each one's VmHWM is its own)."""
    if args.device == "cuda":
        return {c: peak_extra_mb(model, batch, c, args) for c in contenders}
    workers = max(1, min(len(contenders), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(workers) as pool:
        found = pool.map(lambda c: peak_extra_mb(model, batch, c, args), contenders)
        return dict(zip(contenders, found))


def peak_extra_mb(model, batch, contender, args):
    if args.device == "cuda":
        result = probe(model, batch, contender, args, torch.device("cuda"))
        gc.collect()
        torch.cuda.empty_cache()
        return result.get("peak_extra_mb"), result.get("skipped")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--probe",
        model,
        str(batch),
        contender,
        "--threads",
        str(args.threads),
        "--device",
        args.device,
    ]
    if args.quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, f"memory probe failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result.get("peak_extra_mb"), result.get("skipped")


# --------------------------------------------------------------------------- command line


def _names(text, known, what, ap):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(
            f"unknown {what} {', '.join(unknown) or repr(text)}; choose from: {', '.join(known)}"
        )
    return names


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    ap.add_argument(
        "--models",
        help=f"comma-separated, from: {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    ap.add_argument(
        "--contenders",
        help="comma-separated, from: "
        + ", ".join(CONTENDERS)
        + " (default: each model's list; non-private always runs)",
    )
    ap.add_argument(
        "--batch-size",
        help="comma-separated batch sizes for every chosen model "
        "(default: each model's, e.g. cnn 256,1024)",
    )
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 7; --quick 2)")
    ap.add_argument(
        "--steps-per-round",
        type=int,
        help="steps per contender per round (default: enough for "
        f"{ROUND_SECONDS} s of non-private CPU time; --quick 1)",
    )
    ap.add_argument("--warmup", type=int, help="warm-up steps per contender (default 2; --quick 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    ap.add_argument(
        "--quick", action="store_true", help="tiny run for CI: batch 8, 2 rounds of 1 step"
    )
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object (last line of stdout)"
    )
    ap.add_argument(
        "--table",
        metavar="JSON",
        help="print the Markdown table of a saved --json output "
        "(results/bench/README.md's) and exit",
    )
    ap.add_argument(
        "--probe", nargs=3, metavar=("MODEL", "BATCH", "CONTENDER"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    q = args.quick
    for name, default, quick in (("rounds", 7, 2), ("steps_per_round", None, 1), ("warmup", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else default)
    args.memory_steps = 1 if q else MEMORY_STEPS
    if min(args.rounds, args.steps_per_round or 1, args.warmup, args.threads) < 1:
        ap.error("--rounds, --steps-per-round, --warmup and --threads must be ≥ 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is available to torch " + torch.__version__)
    args.model_list = (
        _names(args.models, list(MODELS), "model(s)", ap) if args.models else DEFAULT_MODELS
    )
    args.contender_list = (
        _names(args.contenders, CONTENDERS, "contender(s)", ap) if args.contenders else None
    )
    try:
        args.batches = [int(b) for b in args.batch_size.split(",")] if args.batch_size else None
    except ValueError:
        ap.error(f"--batch-size takes comma-separated integers, got {args.batch_size!r}")
    if args.batches and min(args.batches) < 1:
        ap.error("batch sizes must be ≥ 1")
    return args


def settings(args):
    for model in args.model_list:
        spec = MODELS[model]
        batches = args.batches or ((8,) if args.quick else spec.batches)
        wanted = args.contender_list or spec.contenders
        contenders = ["non-private"] + [c for c in dict.fromkeys(wanted) if c != "non-private"]
        for batch in batches:
            yield model, batch, contenders


def _ratio_cell(row: dict) -> str:
    """The CPU ratio, with its range over rounds when the result has one (the reference
    row, non-private, has none: it is 1 in every round)."""
    if row["cpu_ratio"] is None:
        return "–"
    spread = row.get("cpu_ratio_range")
    shown = spread and spread[0] != spread[1]
    return f"{row['cpu_ratio']:.2f}" + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if shown else "")


def markdown_table(result: dict) -> str:
    """results/bench/README.md's table of a ``--json`` result, one row per contender (the CPU
    ratio's range over rounds in brackets)."""
    lines = [
        "| model | batch | contender | CPU ms/step | × non-private (CPU) | × non-private (wall) "
        "| peak extra MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cells = [
            f"{r['cpu_ms']:.1f}" if r["cpu_ms"] is not None else "–",
            _ratio_cell(r),
            f"{r['wall_ratio']:.2f}" if r["wall_ratio"] is not None else "–",
            f"{r['peak_extra_mb']:.0f}" if r["peak_extra_mb"] is not None else "–",
        ]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['contender']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.load(f)))
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.probe:
        model, batch, contender = args.probe
        print(json.dumps(probe(model, int(batch), contender, args, device)))
        return
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    t0 = time.perf_counter()
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    meta = {
        "device": args.device,
        "device_name": device_name(device),
        "threads": args.threads,
        "torch": torch.__version__,
        "opacus": opacus_version,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "memory": None
        if args.no_memory
        else (
            f"peak extra over {args.memory_steps} steps, "
            + (
                "torch.cuda max_memory_allocated, in the benchmark's process"
                if args.device == "cuda"
                else "one fresh process per contender (VmHWM after clear_refs)"
            )
        ),
    }
    if not args.json:
        log(
            f"{meta['device_name']}, torch {meta['torch']}, opacus {opacus_version or '-'}, "
            f"{args.threads} threads, OMP_WAIT_POLICY={meta['omp_wait_policy']}; "
            f"median of {args.rounds} rounds after {args.warmup} warm-up steps; "
            "ratios to non-private"
        )
    rows = []
    for model, batch, contenders in settings(args):
        spec = MODELS[model]
        n_params = sum(p.numel() for p in spec.build().parameters())
        log(
            f"\n{model}, batch {batch}, {n_params:,} parameters"
            if not args.json
            else f"{model}, batch {batch}: timing …"
        )
        times, skipped, per_round = time_setting(spec, batch, contenders, args, device, log)
        if args.json and not args.no_memory:
            log(f"{model}, batch {batch}: memory probes …")
        elif not args.json:
            log(f"  {per_round} steps per round")
        base_cpu, base_wall, _ = times["non-private"]
        if not args.json:
            log(
                f"  {'contender':<14} {'cpu ms':>9} {'wall ms':>9} {'cpu ×':>7} {'wall ×':>7} "
                f"{'peak MB':>9}"
            )
        probed = {} if args.no_memory else peak_extra_mbs(model, batch, list(times), args)
        setting_rows = []
        for name in contenders:
            row = {
                "model": model,
                "batch": batch,
                "contender": name,
                "params": n_params,
                "steps_per_round": per_round,
                "cpu_ms": None,
                "wall_ms": None,
                "cpu_ratio": None,
                "cpu_ratio_range": None,
                "wall_ratio": None,
                "peak_extra_mb": None,
                "note": skipped.get(name),
            }
            if name in times:
                c, w, (lo, hi) = times[name]
                row.update(
                    cpu_ms=round(c * 1e3, 2),
                    wall_ms=round(w * 1e3, 2),
                    cpu_ratio_range=[round(lo, 3), round(hi, 3)],
                    cpu_ratio=round(c / base_cpu, 3),
                    wall_ratio=round(w / base_wall, 3),
                )
                if not args.no_memory:
                    row["peak_extra_mb"], row["note"] = probed[name]
            rows.append(row)
            setting_rows.append(row)
            if not args.json:
                cells = [
                    (row["cpu_ms"], 9, 2),
                    (row["wall_ms"], 9, 2),
                    (row["cpu_ratio"], 7, 2),
                    (row["wall_ratio"], 7, 2),
                    (row["peak_extra_mb"], 9, 1),
                ]
                log(
                    f"  {name:<14} "
                    + " ".join("-".rjust(w) if v is None else f"{v:{w}.{d}f}" for v, w, d in cells)
                    + (f"  ({row['note']})" if row["note"] else "")
                )
        if args.json:  # each setting's rows as they finish: a run cut short keeps them
            log(f"{model}, batch {batch}: rows {json.dumps(setting_rows)}")
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps({"rows": rows, **meta}))
    else:
        log(f"\n{meta['seconds']:.0f} s")


if __name__ == "__main__":
    main()
