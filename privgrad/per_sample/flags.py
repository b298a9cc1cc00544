"""Performance flags of the per-sample engine.

:class:`EngineFlags` gathers the choices that change how fast a private step runs and how
much memory it takes, never what it computes: whichever value a field takes, the per-sample
norms and the clipped sums agree to float rounding (tests/core/test_per_sample.py and
tests/core/test_layers.py check every form against single-example autograd), and the
mechanism, its noise and its accounting are the same. The defaults are the forms the engine
picks by itself; the benchmarks pass other values to measure the alternatives
(results/bench/engine_notes.md).

The flags are given to :class:`~privgrad.per_sample.engine.GradSampler` (``flags=``), which
hands them to every layer rule and to the :class:`~privgrad.per_sample.engine.PerSampleGrads`
it returns, where the mechanisms read them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from privgrad.errors import PrivgradError

NormForm = Literal["auto", "ghost", "build", "fused"]
ConvGram = Literal["auto", "cells", "patches"]
ConvBuild = Literal["auto", "cpu", "patches", "correlation", "grouped"]
LagSum = Literal["auto", "view", "slices"]
SpectralPadding = Literal["kept-zeros", "afresh"]
FusedDot = Literal["ieee", "tf32x3"]
GemmDot = Literal["ieee", "tf32x3"]
ReplayForm = Literal["auto", "vmap", "loop"]

_CHOICES = {
    "norm_form": ("auto", "ghost", "build", "fused"),
    "conv_gram": ("auto", "cells", "patches"),
    "conv_build": ("auto", "cpu", "patches", "correlation", "grouped"),
    "lag_sum": ("auto", "view", "slices"),
    "spectral_padding": ("kept-zeros", "afresh"),
    "fused_dot": ("ieee", "tf32x3"),
    "gemm_dot": ("ieee", "tf32x3"),
    "replay_form": ("auto", "vmap", "loop"),
}


@dataclass(frozen=True)
class EngineFlags:
    """Speed and memory choices of the per-sample engine; none changes the mechanism.

    "auto" lets a rule choose per layer, by its cost model and the device; any other value
    forces that form on every layer it applies to.
    """

    chunk_floats: int = 1 << 20
    """Off CUDA, per-sample work runs over chunks of samples whose temporaries hold about
    this many floats (cache-sized)."""

    cuda_chunk_floats: int = 1 << 26
    """On CUDA, the same budget. A chunk there only bounds memory (256 MB of float32): steps
    are bound by kernel launches, so fewer, larger chunks are faster. On an H100, 256 MB
    against 64 MB was no slower on any benchmark model, WRN-16-4's step 4–28 % faster, at
    the same peak memory but model3-GN's (results/bench/README.md, fourth H100 run)."""

    keep_built: bool = True
    """Whether a conv layer may keep its built (B × P) per-sample gradients for the clipped
    sum (an einsum) instead of book-keeping (a second weight-gradient convolution). False
    always book-keeps."""

    keep_built_floats: int = 1 << 22
    """A conv layer keeps its built gradients up to this many floats, or up to twice the
    floats it already holds (inputs and output gradients) if that is more."""

    norm_form: NormForm = "auto"
    """How linear and conv layers take per-sample norms: "ghost", the Gram form
    ‖Σ_t g_t a_tᵀ‖² = Σ_{t,t'} (a_t·a_t')(g_t·g_t') (Li et al. 2022; Bu et al. 2023);
    "build", the per-sample gradients built in chunks; "fused", built tile by tile in
    registers and squared there by a Triton kernel, never written (privgrad/per_sample/fused.py:
    CUDA, or CPU under Triton's interpreter; a conv called more than once in a forward pass
    takes "auto"'s form; masked per-sample gradients, GIP's prune-then-clip, stay unbuilt
    too: the kernel masks each tile before squaring it); "auto", the cheaper of ghost and
    build by Bu et al.'s count (2T² against p·d for a conv, T² against d_in·d_out for a
    linear), and on CUDA the fused kernel for the linear layers where it was measured faster
    than the Gram form (:func:`~privgrad.per_sample.rules.auto_takes_fused`)."""

    conv_gram: ConvGram = "auto"
    """Where a conv's Gram form takes its patch products a_t·a_t': "cells", from the Gram of
    the input's stride-sized cells summed along the kernel's lags (only where the kernel is
    a whole number of cells); "patches", from the patches' Gram; "auto", the cheaper."""

    conv_build: ConvBuild = "auto"
    """How a conv builds per-sample weight gradients: "patches" (the patches copied in one
    strided copy, times the output gradient in one batched matmul), "correlation" (each
    input channel correlated with every sample's output gradient), "grouped" (the weight
    gradient of the convolution stacking the samples as groups); "auto": patches on CUDA,
    else as "cpu": correlation for ≤ 3 input channels, grouped for more."""

    lag_sum: LagSum = "auto"
    """How the cell Gram is summed along the kernel's lags: "view", one reduction over a
    strided view; "slices", the sum of the lagged slices; "auto": view on CUDA, slices
    elsewhere."""

    gram_blocks_from: int | None = 64
    """From this many positions T on, the ghost norm forms only the three distinct blocks of
    the symmetric Grams' 2 × 2 split (¾ of the multiply-adds); None: always the full Grams."""

    float32_guard: bool = True
    """Per-sample norms, builds and clipped sums run in full float32 on CUDA whatever
    PyTorch's TF32 settings. False leaves TF32 wherever PyTorch allows it: only to measure
    the guard's cost, since a clipped sum rounded ~1e-3 apart from the norms that clipped it
    lets a sample contribute about that fraction more than the clip norm. No effect on CPU."""

    fused_dot: FusedDot = "ieee"
    """How the fused kernels (``norm_form`` "fused") multiply float32 tiles under the guard:
    "ieee", float32 multiply-adds (no tensor cores); "tf32x3", Triton's three TF32
    tensor-core products per product (each operand split into high and low TF32 parts, the
    low × low product dropped: a rounding of about 2⁻²² against float32's 2⁻²⁴, far from
    TF32's 2⁻¹¹). CUDA only (the interpreter multiplies in float32 either way)."""

    gemm_dot: GemmDot = "ieee"
    """How the Linear (and Hugging Face Conv1D) and Conv2d rules' cuBLAS/cuDNN products under
    the guard (Grams, built gradients, book-kept sums) multiply float32: "ieee", float32
    multiply-adds (no tensor cores); "tf32x3", each product as three TF32 tensor-core products
    of the operands' high and low TF32 parts, hi·hi + hi·lo + lo·hi
    (:func:`~privgrad.per_sample.rules.products`: within 3·2⁻²⁰|x||y| of the exact product,
    against float32's 2⁻²⁴ and one TF32 product's 2⁻¹¹; sums accumulate in float32 either
    way). Off CUDA the three products run in float32 (only to check the form)."""

    replay_form: ReplayForm = "auto"
    """How the generic rule replays a layer without a rule one example at a time: "vmap",
    ``torch.func.vmap`` of ``torch.func.grad`` (the examples batched); "loop", autograd on
    each example in turn (a forward that draws random numbers is refused, as vmap refuses
    it); "auto", the loop off CUDA for a layer that reads its children's parameters (a
    state-space mixer, :func:`~privgrad.per_sample.rules.read_children`), vmap otherwise.
    Measured on two CPU cores, one Mamba mixer of width 256 (inner 512, state 16) at 32
    examples of 128 tokens: 27.7 s by vmap, 2.4 s by the loop, against 15.1 s for its
    batched forward and backward (transformers' reference scan indexes its (B, I, T, N)
    tensors one position at a time, and each index's backward writes a whole zero tensor:
    the cost grows with the batch, and torch.func's accumulation is out of place)."""

    spectral_chunk_bytes: int = 1 << 21
    """Spectral mechanisms (Spectral-DP, GReDP) compute spectra in chunks of samples of about
    this many bytes (per intra-op thread with ``spectral_chunk_per_thread``) off CUDA; on
    CUDA the chunk is ``cuda_chunk_floats`` float32s."""

    spectral_chunk_per_thread: bool = True
    """Whether ``spectral_chunk_bytes`` is per intra-op thread (each thread's share stays
    cache-resident) or for all threads together."""

    spectral_keep_bytes: int = 1 << 28
    """A spectral conv layer keeps its spectra between the clip and the sum stages when they
    take at most this many bytes, and recomputes them in the sum stage otherwise."""

    spectral_padding: SpectralPadding = "kept-zeros"
    """How spectral mechanisms pad each chunk's signals for the FFTs: "kept-zeros", written
    into zero-padded buffers that keep their zeros across chunks; "afresh", padded again per
    chunk (``F.pad``, ``flip`` and the FFT's own padding)."""

    cuda_graphs: bool = False
    """Whether :class:`~privgrad.private.PrivateTrainer` runs its steps' per-sample part and
    chain (forward, backward, norms, clip, sum, noise) as one CUDA graph per padded batch size,
    replayed (:mod:`privgrad.graphed`): a Poisson batch of n examples runs padded to the next
    multiple of ``graph_bucket`` with rows that contribute exactly zero, and the finite check
    is read after the chain (a non-finite example sends the step back to the eager path, as if
    the flag were off). Only for chains whose stages are all ``graph_safe`` (DP-SGD's), fp32,
    one process, no physical micro-batches, and steps privgrad runs itself (not the own-loop
    path, whose forward and backward are the user's); off CUDA the same padded step runs
    eagerly. Each padded size keeps its own graph and memory pool (at most ``graph_cache``)."""

    graph_bucket: int = 32
    """With ``cuda_graphs``, batches are padded to a multiple of this many examples: fewer
    graphs (and their memory) against more padded rows computed."""

    graph_cache: int = 8
    """With ``cuda_graphs``, at most this many captured steps (padded size × example shape)
    are kept; capturing another drops the least recently replayed, and its memory pool."""

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise PrivgradError(
                    f"EngineFlags.{name} must be one of {', '.join(allowed)}; "
                    f"got {getattr(self, name)!r}"
                )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _CHOICES or isinstance(value, bool) or value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise PrivgradError(f"EngineFlags.{f.name} must be an integer ≥ 1; got {value!r}")
        for name in ("keep_built", "float32_guard", "spectral_chunk_per_thread", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise PrivgradError(f"EngineFlags.{name} must be True or False")


DEFAULT_FLAGS = EngineFlags()


def gemm_dot(flags: EngineFlags) -> str:
    """The rules' cuBLAS/cuDNN products under ``flags``: "tf32" without the guard (whatever
    PyTorch allows), else ``flags.gemm_dot``."""
    return flags.gemm_dot if flags.float32_guard else "tf32"


def fused_dot(flags: EngineFlags) -> str:
    """The fused kernels' float32 products under ``flags``: "tf32" without the guard, else
    ``flags.fused_dot``."""
    return flags.fused_dot if flags.float32_guard else "tf32"
