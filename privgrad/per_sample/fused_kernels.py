"""The Triton kernels of :mod:`privgrad.per_sample.fused` (imported only when the fused norm
form runs, so that ``import privgrad`` never imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def linear_norms(
    a_ptr, g_ptr, keep_ptr, out_ptr, T, D_IN, D_OUT, TILES, TILES_IN,
    s_ab, s_at, s_ai, s_gb, s_gt, s_go, s_ko, s_ki,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """out[b, tile] = ‖(G_bᵀ A_b)[tile]‖², the tile's rows o and columns i; with ``MASKED``,
    ‖(keep ⊙ G_bᵀ A_b)[tile]‖² for a 0/1 (D_OUT × D_IN) ``keep``. One program per (b, tile),
    numbered b·TILES + tile on a 1-D grid."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets
    b, tile = pid // TILES, pid % TILES
    offs_o = (tile // TILES_IN) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_i = (tile % TILES_IN) * BLOCK_I + tl.arange(0, BLOCK_I)
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        g = tl.load(
            g_ptr + b * s_gb + offs_o[:, None] * s_go + offs_t[None, :] * s_gt,
            mask=(offs_o[:, None] < D_OUT) & (offs_t[None, :] < T),
            other=0.0,
        )
        a = tl.load(
            a_ptr + b * s_ab + offs_t[:, None] * s_at + offs_i[None, :] * s_ai,
            mask=(offs_t[:, None] < T) & (offs_i[None, :] < D_IN),
            other=0.0,
        )
        acc += tl.dot(g, a, input_precision=PRECISION)
    if MASKED:
        acc *= _keep_tile(keep_ptr, offs_o, offs_i, s_ko, s_ki, D_OUT, D_IN)
    tl.store(out_ptr + pid, tl.sum(acc * acc))


@triton.jit
def conv2d_norms(
    x_ptr, g_ptr, keep_ptr, out_ptr, C_IN, H, W, W_OUT, P, C_OUT, K, TILES, TILES_K,
    s_xb, s_xc, s_xh, s_xw, s_gb, s_go, s_gh, s_gw, s_ko, s_kk,
    SH, SW, PH, PW, DH, DW,
    KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """out[b, tile] = ‖∇W_b[tile]‖² for a Conv2d (groups 1): rows o, columns
    k = (c, κ_h, κ_w) in the weight's order, the patch entries gathered from x; with
    ``MASKED``, ‖(keep ⊙ ∇W_b)[tile]‖² for a 0/1 (C_OUT × K) ``keep``. One program per
    (b, tile), numbered b·TILES + tile on a 1-D grid."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets
    b, tile = pid // TILES, pid % TILES
    offs_o = (tile // TILES_K) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = (tile % TILES_K) * BLOCK_K + tl.arange(0, BLOCK_K)
    c = offs_k // (KH * KW)
    kh = (offs_k // KW) % KH
    kw = offs_k % KW
    acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        oh, ow = offs_p // W_OUT, offs_p % W_OUT
        g = tl.load(
            g_ptr + b * s_gb + offs_o[:, None] * s_go + oh[None, :] * s_gh + ow[None, :] * s_gw,
            mask=(offs_o[:, None] < C_OUT) & (offs_p[None, :] < P),
            other=0.0,
        )
        ih = oh[:, None] * SH - PH + kh[None, :] * DH
        iw = ow[:, None] * SW - PW + kw[None, :] * DW
        inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        x = tl.load(
            x_ptr + b * s_xb + c[None, :] * s_xc + ih * s_xh + iw * s_xw,
            mask=inside & (offs_p[:, None] < P) & (offs_k[None, :] < K),
            other=0.0,
        )
        acc += tl.dot(g, x, input_precision=PRECISION)
    if MASKED:
        acc *= _keep_tile(keep_ptr, offs_o, offs_k, s_ko, s_kk, C_OUT, K)
    tl.store(out_ptr + pid, tl.sum(acc * acc))


@triton.jit
def _keep_tile(keep_ptr, rows, cols, s_row, s_col, N_ROWS, N_COLS):
    """The (rows × cols) tile of a float32 0/1 mask (0 outside it)."""
    return tl.load(
        keep_ptr + rows[:, None] * s_row + cols[None, :] * s_col,
        mask=(rows[:, None] < N_ROWS) & (cols[None, :] < N_COLS),
        other=0.0,
    )
