"""Fused per-sample squared norms: ‖∇W_i‖² tile by tile, never writing ∇W_i (issue 42).

A linear layer's per-sample weight gradient is ∇W_i = G_iᵀ A_i (G_i: T × d_out output
gradients, A_i: T × d_in inputs); a Conv2d's is the same product with A_i the input's
patches, ∇W_i[o, (c, κ)] = Σ_t G_i[o, t] x_i[c, stride·t + dilation·κ] (x zero-padded).
Each Triton program here takes one sample and one (d_out × d_in) tile of ∇W_i, accumulates
it in registers over the positions t (for a conv, gathering the patch entries straight from
x: no unfold, no im2col copy), squares and sums it, and writes one partial sum; the partials
of a sample are then added in a fixed order (deterministic, no atomics). The (B × d_out ×
d_in) tensor a built norm writes and reads back never exists. Arithmetic: that of building
(B·T·d_in·d_out multiply-adds); memory traffic: one read of A and G per tile row.

On CUDA tensors the kernels are compiled by Triton. CPU tensors are taken only under
``TRITON_INTERPRET=1`` (set before Triton is imported), Triton's interpreter: numpy, slow,
for checking the kernels where there is no GPU (tests/conftest.py sets it there, so CI runs
every kernel).
Float32 inputs are multiplied as ``dot`` says: "ieee" (float32 multiply-adds), "tf32x3" (three
TF32 tensor-core products, about float32's rounding: ``EngineFlags.fused_dot``) or "tf32"
(``EngineFlags.float32_guard`` False); 16-bit inputs are multiplied as they are, with a
float32 accumulator.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from privgrad.errors import PrivgradError


@functools.cache
def _triton_installed() -> bool:
    """Looked up once: ``find_spec`` takes ~65 µs, and the rules ask every layer, every step."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device``: Triton installed, and the device
    CUDA or Triton's interpreter on (``TRITON_INTERPRET=1``)."""
    if not _triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels(device: torch.device):
    """The kernels module, once :func:`runs_on` holds for ``device`` (else a clear error)."""
    if runs_on(device):
        from privgrad.per_sample import fused_kernels

        return fused_kernels
    if not _triton_installed():
        raise PrivgradError(
            "EngineFlags(norm_form='fused') needs Triton (pip install triton; CUDA builds of "
            "PyTorch bring it); the other norm forms run without it"
        )
    raise PrivgradError(
        f"EngineFlags(norm_form='fused') runs its Triton kernels on CUDA tensors; on "
        f"{device.type} only in Triton's interpreter (TRITON_INTERPRET=1 before Triton is "
        f"imported: slow, for checking). Use norm_form='auto' there"
    )


def _block(n: int, cap: int) -> int:
    """A power-of-two tile side ≥ 16 (tl.dot's least) covering n, at most ``cap``."""
    return max(16, min(cap, 1 << max(0, n - 1).bit_length()))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


DOTS = ("ieee", "tf32x3", "tf32")


def _operands(a: torch.Tensor, b: torch.Tensor, dot: str):
    """The two operands in one dtype (float32 if theirs differ, or off CUDA: Triton 3.9's
    interpreter multiplies 16-bit tiles wrongly) and tl.dot's input precision: ``dot`` for
    float32 on CUDA ("ieee" off it), Triton's default for 16-bit."""
    if dot not in DOTS:
        raise PrivgradError(f"the fused kernels' dot is one of {', '.join(DOTS)}; got {dot!r}")
    if a.dtype != b.dtype or not a.is_cuda:
        a, b = a.float(), b.float()
    if a.dtype != torch.float32:
        return a, b, None
    return a, b, dot if a.is_cuda else "ieee"


def _tiling(batch: int, rows: int, cols: int, positions: int, device: torch.device):
    """How a kernel tiles a (rows × cols) weight gradient summed over ``positions``: the tile
    sides (rows, cols: at most 64; positions: at most 32), the number of column tiles, and the
    float32 (B × tiles) buffer of partial sums, one per program. The programs run on a 1-D
    grid of B·tiles (up to 2³¹ − 1): a second grid axis would stop at 65,535 tiles, which a
    vocabulary-sized output layer exceeds."""
    blocks = _block(rows, 64), _block(cols, 64), _block(positions, 32)
    tiles_cols = _cdiv(cols, blocks[1])
    tiles = _cdiv(rows, blocks[0]) * tiles_cols
    return blocks, tiles_cols, torch.empty(batch, tiles, device=device, dtype=torch.float32)


def _keep(keep: torch.Tensor | None, rows: int, cols: int, out: torch.Tensor):
    """A weight mask as the kernels read it: float32 0/1, viewed (rows × cols), and its two
    strides; without one, a placeholder pointer (``out``, never read) and zero strides."""
    if keep is None:
        return out, 0, 0
    k = keep.to(device=out.device, dtype=torch.float32).reshape(rows, cols)
    return (k, *k.stride())


def linear_norms_sq(
    a: torch.Tensor, g: torch.Tensor, dot: str = "ieee", keep: torch.Tensor | None = None
) -> torch.Tensor:
    """‖g_iᵀ a_i‖²_F per sample for a (B, T, d_in) and g (B, T, d_out), in float32 (B,); with a
    (d_out × d_in) 0/1 ``keep`` (a mask shared by the samples), ‖keep ⊙ g_iᵀ a_i‖²_F."""
    kernels = _kernels(a.device)
    a, g, precision = _operands(a, g, dot)
    B, T, d_in = a.shape
    d_out = g.shape[2]
    (bo, bi, bt), tiles_in, partials = _tiling(B, d_out, d_in, T, a.device)
    if B:
        k, *k_strides = _keep(keep, d_out, d_in, partials)
        kernels.linear_norms[(partials.numel(),)](
            a, g, k, partials, T, d_in, d_out, partials.shape[1], tiles_in,
            *a.stride(), *g.stride(), *k_strides,
            BLOCK_O=bo, BLOCK_I=bi, BLOCK_T=bt, PRECISION=precision, MASKED=keep is not None,
        )  # fmt: skip
    return partials.sum(1)


def conv2d_norms_sq(
    x: torch.Tensor,
    g: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    dot: str = "ieee",
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """‖∇W_i‖² per sample for one call of a Conv2d (groups 1, zero padding) with input x
    (B, C_in, H, W) and output gradient g (B, C_out, H_out, W_out), in float32 (B,); with a
    weight-shaped 0/1 ``keep`` (a mask shared by the samples), ‖keep ⊙ ∇W_i‖²."""
    kernels = _kernels(x.device)
    x, g, precision = _operands(x, g, dot)
    B, c_in, h, w = x.shape
    c_out, h_out, w_out = g.shape[1:]
    (kh, kw), P = kernel_size, h_out * w_out
    K = c_in * kh * kw
    (bo, bk, bp), tiles_k, partials = _tiling(B, c_out, K, P, x.device)
    if B:
        k, *k_strides = _keep(keep, c_out, K, partials)
        kernels.conv2d_norms[(partials.numel(),)](
            x, g, k, partials, c_in, h, w, w_out, P, c_out, K, partials.shape[1], tiles_k,
            *x.stride(), *g.stride(), *k_strides, *stride, *padding, *dilation,
            KH=kh, KW=kw, BLOCK_O=bo, BLOCK_K=bk, BLOCK_P=bp, PRECISION=precision,
            MASKED=keep is not None,
        )  # fmt: skip
    return partials.sum(1)
