"""Per-layer rules for per-sample gradients.

A rule turns what one forward/backward pass recorded for a layer, the layer's input
``a`` and the gradient ``g`` of the summed loss with respect to its output, into the
layer's per-sample parameter gradients. Each rule offers three views, so that DP-SGD
never has to build a (batch × parameters) tensor it does not need:

* ``norms_sq()``: per-sample squared L2 norm of the layer's gradient, shape (B,);
* ``weighted_sum(w)``: Σ_i w_i ∇_θ ℓ_i for every parameter (the clipped sum);
* ``per_sample()``: the per-sample gradients, each of shape (B, *param.shape).

Linear layers on sequences and convolutions share one rule: an unfolded convolution is
a linear map applied at L positions, so ∇W_i = Σ_t g_{i,t} a_{i,t}ᵀ (Opacus' approach).
Norms use the "ghost" Gram trick when it is cheaper (Li et al. 2022, Bu et al. 2023):
‖Σ_t g_t a_tᵀ‖² = Σ_{t,t'} (a_t·a_t')(g_t·g_t').

Where a rule has several forms of the same result (Gram or built norms, how a conv builds,
chunk sizes), :class:`~privgrad.per_sample.flags.EngineFlags` chooses; the defaults let the
rule pick per layer and device. Measurements behind the defaults: results/bench/engine_notes.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial, wraps
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from privgrad.per_sample import fused
from privgrad.per_sample.flags import DEFAULT_FLAGS, EngineFlags, fused_dot, gemm_dot


@contextmanager
def float32_arithmetic(enabled: bool = True):
    """Per-sample norms and clipped sums in full float32 on CUDA, whatever PyTorch's TF32
    settings (cuDNN convolutions take TF32's 10-bit mantissas by default): a clipped sum
    rounded at ~1e-3 apart from the norms that clipped it would let a sample contribute
    about that fraction more than the clip norm. No effect on CPU arithmetic. With
    ``enabled=False`` (``EngineFlags.float32_guard``) the settings are left alone."""
    if not enabled:
        yield
        return
    with _tf32_allowed(False):
        yield


@contextmanager
def _tf32_allowed(allowed: bool):
    """cuBLAS's and cuDNN's TF32 settings set to ``allowed`` inside, restored after: off for
    the guard, on for :func:`products`' three products of operands split into TF32 parts."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.allow_tf32, matmul.allow_tf32
    cudnn.allow_tf32 = matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


def tf32_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo exactly, for float32 x: hi is x with its 13 low mantissa bits cleared (on
    TF32's grid, so a tensor core reads it unrounded) and lo the rest, |lo| < 2⁻¹⁰|x|."""
    hi = (x.view(torch.int32) & -(1 << 13)).view(torch.float32)
    return hi, x - hi


def products(op: Callable, x: torch.Tensor, y: torch.Tensor, dot: str = "ieee") -> torch.Tensor:
    """``op(x, y)`` for an op linear in each operand (a matmul, a weight-gradient convolution)
    with the products ``dot`` names (:func:`~privgrad.per_sample.flags.gemm_dot`): "ieee"
    and "tf32", one call under the arithmetic in force; "tf32x3", for float32 operands,
    op(x_hi, y_hi) + (op(x_hi, y_lo) + op(x_lo, y_hi)) on TF32 tensor cores
    (:func:`tf32_split`; lo × lo dropped): each product within 3·2⁻²⁰ of |x||y| (float32:
    2⁻²⁴; one TF32 product: 2⁻¹¹), accumulated in float32. Off CUDA the three run in float32."""
    if dot != "tf32x3" or x.dtype != torch.float32 or y.dtype != torch.float32:
        return op(x, y)
    (x_hi, x_lo), (y_hi, y_lo) = tf32_split(x), tf32_split(y)
    with _tf32_allowed(True):
        return op(x_hi, y_hi) + (op(x_hi, y_lo) + op(x_lo, y_hi))


def sq_norms(t: torch.Tensor) -> torch.Tensor:
    """Per-sample squared L2 norms ‖t_i‖² over all axes but the first: one fused reduction,
    without a temporary of the squares."""
    flat = t.flatten(1) if t.dim() > 1 else t.unsqueeze(1)  # (B,): a 0-dim parameter's
    return torch.linalg.vector_norm(flat, dim=1).square()


# 1/K of :func:`guarded_norms_sq`: an example's norm is taken as at least its magnitude / K
CANCELLATION_GUARD = 2.0**-8


def magnitudes(a: torch.Tensor, g: torch.Tensor, has_bias: bool = False) -> torch.Tensor:
    """U_i = Σ_t ‖a_{i,t}‖·‖g_{i,t}‖ per sample (with a bias, √(U_W² + (Σ_t ‖g_{i,t}‖)²)): a
    bound on ‖Σ_t g_t a_tᵀ‖ by the triangle inequality, and the scale of the float32
    rounding in every form of that gradient (its Gram norm, its build, the book-kept sum),
    which add up terms of that size. A sum of non-negative terms: no cancellation."""
    gn = torch.linalg.vector_norm(g, dim=2)
    u = (torch.linalg.vector_norm(a, dim=2) * gn).sum(1)
    return torch.sqrt(u.square() + gn.sum(1).square()) if has_bias else u


def guarded_norms_sq(norms_sq: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``norms_sq``, or (magnitude / K)² where that is larger (K = 1 /
    :data:`CANCELLATION_GUARD`): the squared norm a clipping stage divides by.

    A per-sample gradient Σ_t g_t a_tᵀ whose terms nearly cancel (tokens or patches of
    huge, opposite inputs: a_1 = (2²⁰, 100), a_2 = (−2²⁰, 0)) is tiny or moderate, while its
    float32 Gram norm Σ_{t,t'} (a_t·a_t')(g_t·g_t') adds terms of size U² that round to
    2⁻²⁴U² apiece: such an example's Gram norm came out 0 where its true norm was 70 C,
    so it was not clipped and moved the clipped sum by 70 C (700 C at a_1 = 2³⁰), while the
    accountant assumed C. Its rounding is bounded by a small multiple of 2⁻²⁴·U², so a norm
    of at least U/K keeps the computed norm within a factor √(1 + O(2⁻²⁴K²)) of the true
    one, and weights the example by at most K·C/U, which bounds the rounding of the clipped
    sum it enters by O(2⁻²⁴K) C. Benign examples are not touched: tokens with unrelated
    gradients have U/‖∇‖ ≈ √T (16 at T = 256, 256 at T = 65,536); an example over-clipped
    by the guard only counts for less."""
    return torch.maximum(norms_sq, (magnitude * CANCELLATION_GUARD).square())


def gram_dot(
    a: torch.Tensor,
    g: torch.Tensor,
    blocks_from: int | None = 64,
    dot: str = "ieee",
    with_magnitudes: bool = False,
):
    """The ghost norm Σ_{t,t'} (a_t·a_t')(g_t·g_t') per sample, for a (B, T, d_a) and
    g (B, T, d_g), the Grams' products as ``dot`` says (:func:`products`). Both Grams are
    symmetric, so from T = ``blocks_from`` on only the three distinct blocks of their 2 × 2
    split are formed (¾ of the multiply-adds; for small T the extra calls cost more than they
    save); None: the full Grams. ``with_magnitudes``: also U = Σ_t ‖a_t‖·‖g_t‖
    (:func:`magnitudes`), read off the Grams' diagonals."""

    def block(x, y, u, v, diagonal=False):
        gram_a = products(torch.bmm, x, y.transpose(1, 2), dot)
        gram_g = products(torch.bmm, u, v.transpose(1, 2), dot)
        out = (gram_a * gram_g).sum((1, 2))
        if not (with_magnitudes and diagonal):
            return out, 0
        return out, _diagonal_magnitudes(gram_a, gram_g)

    T = a.shape[1]
    if blocks_from is None or T < blocks_from:
        out, u = block(a, a, g, g, True)
    else:
        h = T // 2
        a1, a2, g1, g2 = a[:, :h], a[:, h:], g[:, :h], g[:, h:]
        (w1, u1), (w2, u2) = block(a1, a1, g1, g1, True), block(a2, a2, g2, g2, True)
        out, u = w1 + w2 + 2 * block(a1, a2, g1, g2)[0], u1 + u2
    return (out, u) if with_magnitudes else out


def _diagonal_magnitudes(gram_a: torch.Tensor, gram_g: torch.Tensor) -> torch.Tensor:
    """Σ_t ‖a_t‖·‖g_t‖ per sample from the diagonals ‖a_t‖², ‖g_t‖² of two (B, T, T) Grams
    (sums of squares: no cancellation)."""
    d_a, d_g = gram_a.diagonal(0, 1, 2), gram_g.diagonal(0, 1, 2)
    return (d_a.clamp(min=0) * d_g.clamp(min=0)).sqrt().sum(1)


def _total(tensors):
    """Sum of a non-empty sequence of tensors without Python's 0 + t copy."""
    it = iter(tensors)
    out = next(it)
    for t in it:
        out = out + t
    return out


class LayerGrads:
    """Per-sample gradients of one layer's direct parameters, lazily computed."""

    params: list[nn.Parameter]
    flags: EngineFlags = DEFAULT_FLAGS  # a rule's choices of form (rules that have any)

    def norms_sq(self) -> torch.Tensor:
        return _total(sq_norms(p) for p in self.per_sample())

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        return [torch.einsum("b,b...->...", weights, p) for p in self.per_sample()]

    def per_sample(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def settle(self) -> None:
        """Called once the layer's output gradients are all in, during the backward pass: a
        rule may replace what it stores by a smaller form holding the same gradients."""

    def masked(self, keep: list[torch.Tensor]) -> "LayerGrads":
        """The per-sample gradients with the coordinates where ``keep`` (one boolean mask per
        parameter, shared by every sample) is False zeroed: materialised here; a rule that
        can take masked norms without them returns :class:`MaskedGrads`."""
        return MaterializedGrads(self.params, _apply_masks(self.per_sample(), keep))


def _apply_masks(grads: list[torch.Tensor], keep: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample gradients times one boolean mask per parameter (broadcast over samples)."""
    return [g * k.to(g.dtype) for g, k in zip(grads, keep)]


class MaskedGrads(LayerGrads):
    """A layer's per-sample gradients under masks shared by every sample (GIP's
    prune-then-clip), kept unbuilt: the norms are the rule's ``masked_norms_sq``, and the sum
    is the masked sum, Σ_i w_i (M ⊙ g_i) = M ⊙ Σ_i w_i g_i."""

    def __init__(self, inner: LayerGrads, keep: list[torch.Tensor]):
        self.inner, self.keep, self.params = inner, keep, inner.params

    def norms_sq(self) -> torch.Tensor:
        return self.inner.masked_norms_sq(self.keep)

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        return [s.masked_fill(~k, 0.0) for s, k in zip(self.inner.weighted_sum(weights), self.keep)]

    def per_sample(self) -> list[torch.Tensor]:
        return _apply_masks(self.inner.per_sample(), self.keep)


class MaterializedGrads(LayerGrads):
    """Per-sample gradients already held as tensors (e.g. after a per-sample transform)."""

    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]):
        self.params, self._grads = params, grads

    def per_sample(self) -> list[torch.Tensor]:
        return self._grads


class TrainableSubset(LayerGrads):
    """The per-sample gradients of a layer's trainable parameters when some are frozen."""

    def __init__(self, inner: LayerGrads):
        self.keep = [i for i, p in enumerate(inner.params) if p.requires_grad]
        self.params = [inner.params[i] for i in self.keep]
        self.inner = inner

    def per_sample(self) -> list[torch.Tensor]:
        grads = self.inner.per_sample()
        return [grads[i] for i in self.keep]


class TiedGrads(LayerGrads):
    """The per-sample gradients of layers that share a parameter (tied weights: a language
    model's output layer and its token embedding): a shared parameter's gradient is the sum
    of the layers' contributions, g_i = Σ_k g^k_i, so its norm takes their cross terms,
    ‖g_i‖² = Σ_k ‖g^k_i‖² + 2 Σ_{k<l} ⟨g^k_i, g^l_i⟩ (an embedding and a linear layer's
    without building either, :func:`_embedding_linear_dot`; others from built gradients).
    Its members were settled one by one as the engine built them."""

    def __init__(self, members: list[LayerGrads]):
        self.members = members
        self.params = list({id(p): p for m in members for p in m.params}.values())

    def _shared(self, k: int, j: int) -> list[tuple[int, int]]:
        """Index pairs (in member k's params, in member j's) of the parameters k and j share."""
        at = {id(p): n for n, p in enumerate(self.members[j].params)}
        return [(n, at[id(p)]) for n, p in enumerate(self.members[k].params) if id(p) in at]

    def norms_sq(self) -> torch.Tensor:
        """Σ_k ‖g^k_i‖² + 2 Σ_{k<l} ⟨g^k_i, g^l_i⟩, at least Σ_k ‖g^k_i‖² / K²
        (:func:`guarded_norms_sq`): members whose gradients nearly cancel (g^1 = (M, s),
        g^2 = (−M, 0) for a weight two layers read with opposite huge inputs) gave a float32
        sum of 0, or below 0 (a NaN norm that made every parameter NaN), where the true norm
        was 141 C, and the example went unclipped."""
        members = _total(m.norms_sq() for m in self.members)
        out = members
        built: dict[int, list[torch.Tensor]] = {}  # a member's per-sample gradients, built once

        def per_sample(k: int) -> list[torch.Tensor]:
            if k not in built:
                built[k] = self.members[k].per_sample()
            return built[k]

        for k in range(len(self.members)):
            for j in range(k + 1, len(self.members)):
                shared = self._shared(k, j)
                if shared:
                    out = out + 2 * self._dot(k, j, shared, per_sample)
        return guarded_norms_sq(out, members.sqrt())

    def _dot(self, k: int, j: int, shared: list[tuple[int, int]], per_sample) -> torch.Tensor:
        """Σ over the parameters members k and j share of ⟨g^k_i, g^j_i⟩, per sample."""
        one, two = self.members[k], self.members[j]
        for x, y, order in ((one, two, shared), (two, one, [(b, a) for a, b in shared])):
            if type(x) is EmbeddingGrads and type(y) is LinearGrads and order == [(0, 0)]:
                return _embedding_linear_dot(x, y)
        g1, g2 = per_sample(k), per_sample(j)
        return _total((g1[a] * g2[b]).flatten(1).sum(1) for a, b in shared)

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        return self._summed([m.weighted_sum(weights) for m in self.members])

    def per_sample(self) -> list[torch.Tensor]:
        return self._summed([m.per_sample() for m in self.members])

    def _summed(self, per_member: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """One tensor per parameter of :attr:`params` from one per member's parameter: a
        shared parameter's are added."""
        out: dict[int, torch.Tensor] = {}
        for m, tensors in zip(self.members, per_member):
            for p, t in zip(m.params, tensors):
                out[id(p)] = t if id(p) not in out else out[id(p)] + t
        return [out[id(p)] for p in self.params]


def _embedding_linear_dot(e: "EmbeddingGrads", lin: "LinearGrads") -> torch.Tensor:
    """⟨∇E_i, ∇W_i⟩ for an embedding E and a linear layer's weight W, the same (V × d)
    tensor: with ∇E_i = Σ_t onehot(x_t) gₑ_tᵀ and ∇W_i = Σ_s g_s a_sᵀ,
    ⟨∇E_i, ∇W_i⟩ = Σ_{s,t} g_s[x_t] ⟨a_s, gₑ_t⟩, a (T_W × T_E) product per sample."""
    b, t_w, t_e = lin.a.shape[0], lin.a.shape[1], e.idx.shape[1]
    picked = torch.gather(lin.g, 2, e.idx.long()[:, None, :].expand(b, t_w, t_e))  # g_s[x_t]
    return (picked * torch.bmm(lin.a, e.g.transpose(1, 2))).sum((1, 2))


def auto_takes_fused(T: int, d_in: int, d_out: int, device: torch.device) -> bool:
    """Whether ``norm_form="auto"`` takes a linear layer's norms by the fused kernel: on CUDA,
    where the Gram form would be chosen (T² ≤ d_in·d_out) and the kernel's multiply-adds,
    T·d_in·d_out per sample, are at most 4× the Gram form's, T²·(d_in + d_out). There, on an
    H100, one kernel per layer beat the Gram form's several (the transformer's DP-SGD step
    1.22× faster, results/bench/README.md); where the positions are few for the weight's size
    (a conv of 2 M weights over 25 positions) the kernel was 14× slower than the Gram form;
    building stays with cuBLAS."""
    return (
        1 < T
        and T * T <= d_in * d_out <= 4 * T * (d_in + d_out)
        and device.type == "cuda"
        and fused.runs_on(device)
    )


class LinearGrads(LayerGrads):
    """W ∈ R^{out×in} applied at T positions per sample: a (B,T,in), g (B,T,out)."""

    def __init__(
        self,
        module: nn.Module,
        a: torch.Tensor,
        g: torch.Tensor,
        weight_shape,
        flags: EngineFlags = DEFAULT_FLAGS,
    ):
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        self.a, self.g, self.weight_shape, self.flags = a, g, weight_shape, flags
        self.has_bias = module.bias is not None

    @property
    def use_ghost(self) -> bool:
        """The Gram form (~T² per sample) when cheaper than building (d_in·d_out), or as
        ``flags.norm_form`` says."""
        if self.flags.norm_form != "auto":
            return self.flags.norm_form == "ghost"
        return self.a.shape[1] ** 2 <= self.a.shape[2] * self.g.shape[2]

    @property
    def use_fused(self) -> bool:
        """The fused kernel: as ``flags.norm_form`` says, or where :func:`auto_takes_fused`."""
        if self.flags.norm_form != "auto":
            return self.flags.norm_form == "fused"
        return auto_takes_fused(self.a.shape[1], self.a.shape[2], self.g.shape[2], self.a.device)

    def norms_sq(self) -> torch.Tensor:
        a, g = self.a, self.g
        if a.shape[1] == 1:
            w = sq_norms(a) * sq_norms(g)
        elif self.use_fused:
            w = fused.linear_norms_sq(a, g, fused_dot(self.flags)).to(a.dtype)
        elif self.use_ghost:
            w = gram_dot(a, g, self.flags.gram_blocks_from, gemm_dot(self.flags))
        else:
            w = sq_norms(products(torch.bmm, g.transpose(1, 2), a, gemm_dot(self.flags)))
        if self.has_bias:
            w = w + sq_norms(g.sum(1))
        if a.shape[1] == 1:  # ‖a‖²‖g‖²: one term, nothing to cancel
            return w
        return guarded_norms_sq(w, magnitudes(a, g, self.has_bias))

    def masked(self, keep: list[torch.Tensor]) -> LayerGrads:
        """Unbuilt where the fused kernel runs (:attr:`use_fused`: it masks each tile before
        squaring it); materialised otherwise."""
        return MaskedGrads(self, keep) if self.use_fused else super().masked(keep)

    def masked_norms_sq(self, keep: list[torch.Tensor]) -> torch.Tensor:
        """‖M_W ⊙ ∇W_i‖² (+ ‖m_b ⊙ ∇b_i‖²) by the fused kernel."""
        w = fused.linear_norms_sq(
            self.a, self.g, fused_dot(self.flags), keep=self._weight_keep(keep[0])
        ).to(self.a.dtype)
        if self.has_bias:
            w = w + sq_norms(self.g.sum(1) * keep[1].to(self.g.dtype))
        return guarded_norms_sq(w, magnitudes(self.a, self.g, self.has_bias))

    def _weight_keep(self, keep: torch.Tensor) -> torch.Tensor:
        """The weight's mask as (d_out × d_in), the kernel's orientation."""
        return keep

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """Σ_i w_i g_iᵀ a_i as one matmul, the weights applied to the narrower of a and g."""
        a, g, w = self.a, self.g, weights[:, None, None]
        d_in, d_out = a.shape[2], g.shape[2]
        if d_in < d_out:
            a = a * w
        else:
            g = g * w
        dot = gemm_dot(self.flags)
        out = [
            products(torch.mm, g.reshape(-1, d_out).T, a.reshape(-1, d_in), dot).reshape(
                self.weight_shape
            )
        ]
        if self.has_bias:
            out.append(
                (weights @ self.g.reshape(len(weights), -1)).view(-1, d_out).sum(0)
            )  # a matmul, not an einsum (much slower here)
        return out

    def per_sample(self) -> list[torch.Tensor]:
        B = self.a.shape[0]
        built = products(torch.bmm, self.g.transpose(1, 2), self.a, gemm_dot(self.flags))
        out = [built.reshape(B, *self.weight_shape)]
        if self.has_bias:
            out.append(self.g.sum(1))
        return out


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _as_sequence(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _positions(inputs: list[torch.Tensor], grads: list[torch.Tensor]):
    """A linear layer's inputs and output gradients as (B, T, d) sequences; several calls of
    one module in a forward pass (a recurrent cell) become more positions."""
    return _cat([_as_sequence(x) for x in inputs], 1), _cat([_as_sequence(x) for x in grads], 1)


def takes_flags(rule: Callable) -> Callable:
    """Marks a rule that takes the engine's :class:`EngineFlags` as ``flags=`` (a rule
    without the mark is called with the module, inputs and output gradients only)."""
    rule.takes_flags = True
    return rule


@takes_flags
def linear_rule(
    module: nn.Linear,
    inputs: list[torch.Tensor],
    grads: list[torch.Tensor],
    flags: EngineFlags = DEFAULT_FLAGS,
):
    return LinearGrads(module, *_positions(inputs, grads), module.weight.shape, flags)


class TransposedLinearGrads(LinearGrads):
    """A linear layer whose weight is stored transposed, W ∈ R^{in×out}, y = x W + b (Hugging
    Face's ``Conv1D``, the layers of GPT-2): :class:`LinearGrads`' forms (ghost or built
    norms, book-kept sums), with the weight's gradients formed as (in × out)."""

    def _weight_keep(self, keep: torch.Tensor) -> torch.Tensor:
        return keep.T

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """Σ_i w_i a_iᵀ g_i as one matmul, the weights applied to the narrower of a and g."""
        a, g, w = self.a, self.g, weights[:, None, None]
        d_in, d_out = a.shape[2], g.shape[2]
        if d_in < d_out:
            a = a * w
        else:
            g = g * w
        out = [
            products(torch.mm, a.reshape(-1, d_in).T, g.reshape(-1, d_out), gemm_dot(self.flags))
        ]
        if self.has_bias:
            out.append((weights @ self.g.reshape(len(weights), -1)).view(-1, d_out).sum(0))
        return out

    def per_sample(self) -> list[torch.Tensor]:
        out = [products(torch.bmm, self.a.transpose(1, 2), self.g, gemm_dot(self.flags))]
        if self.has_bias:
            out.append(self.g.sum(1))
        return out


@takes_flags
def transposed_linear_rule(
    module: nn.Module,
    inputs: list[torch.Tensor],
    grads: list[torch.Tensor],
    flags: EngineFlags = DEFAULT_FLAGS,
):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (weight (in, out), bias (out,)):
    the linear rule with the weight transposed."""
    return TransposedLinearGrads(
        module, *_positions(inputs, grads), module.weight.shape[::-1], flags
    )


def chunk_bytes(device: torch.device, cpu_bytes: int, flags: EngineFlags = DEFAULT_FLAGS) -> int:
    """The bytes of temporaries one chunk of samples may take: ``cpu_bytes`` (the caller's
    cache-sized budget) off CUDA, ``flags.cuda_chunk_floats`` float32s on CUDA."""
    return 4 * flags.cuda_chunk_floats if device.type == "cuda" else cpu_bytes


def _chunks(batch: int, floats_per_sample: int, device: torch.device, flags: EngineFlags):
    """Slices of the batch whose temporaries stay near ``flags.chunk_floats`` floats
    (cache-sized) off CUDA, ``flags.cuda_chunk_floats`` on CUDA."""
    budget = chunk_bytes(device, 4 * flags.chunk_floats, flags) // 4
    step = max(1, min(batch, budget // max(1, floats_per_sample)))
    return [slice(i, i + step) for i in range(0, batch, step)]


def builds_by_chunk(layer, floats_per_sample: int):
    """(slice, Σ over a layer's calls of ``layer._build(x[slice], g[slice])``) per chunk of
    samples whose temporaries hold about the flags' chunk budget (``floats_per_sample`` each:
    an im2col build's patches are T/C_out times the gradients it makes)."""
    B = layer.inputs[0].shape[0]
    for sl in _chunks(B, floats_per_sample, layer.inputs[0].device, layer.flags):
        yield sl, _total(layer._build(x[sl], g[sl]) for x, g in zip(layer.inputs, layer.grads))


def built_in_chunks(layer, floats_per_sample: int) -> torch.Tensor:
    """The (B, *W.shape) per-sample weight gradients of :func:`builds_by_chunk`, written
    into one tensor."""
    B, out = layer.inputs[0].shape[0], None
    for sl, w in builds_by_chunk(layer, floats_per_sample):
        if sl.start == 0 and sl.stop >= B:
            return w
        if out is None:
            out = w.new_empty(B, *w.shape[1:])
        out[sl] = w
    return out if out is not None else layer._build(layer.inputs[0], layer.grads[0])


def lag_sum(
    block: torch.Tensor,
    out: tuple[int, int, int, int],
    lags: tuple[int, int],
    form: str = "auto",
) -> torch.Tensor:
    """Σ_{u<m_h, v<m_w} block[r+u, c+v, r'+u, c'+v, :] over the (r, c, r', c') of ``out``: a
    cell Gram (rows, cols, rows', cols', b) summed along the kernel's diagonal lags.
    ``form`` (``EngineFlags.lag_sum``): "view", one reduction over a strided view (one
    kernel instead of m_h·m_w − 1 additions, the faster on CUDA); "slices", the sum of the
    lagged slices (the faster on CPU); "auto", by the block's device."""
    if form == "auto":
        form = "view" if block.device.type == "cuda" else "slices"
    return (lag_sum_by_view if form == "view" else lag_sum_by_slices)(block, out, lags)


def lag_sum_by_view(
    block: torch.Tensor, out: tuple[int, int, int, int], lags: tuple[int, int]
) -> torch.Tensor:
    """:func:`lag_sum` as a sum over two lag axes of a view in which element
    (r, c, r', c', u, v) is block[r+u, c+v, r'+u, c'+v]."""
    s_r, s_c, s_r2, s_c2, s_b = block.stride()
    view = block.as_strided(
        (*out, *lags, block.shape[4]),
        (s_r, s_c, s_r2, s_c2, s_r + s_r2, s_c + s_c2, s_b),
        block.storage_offset(),
    )
    return view.sum((4, 5))


def lag_sum_by_slices(
    block: torch.Tensor, out: tuple[int, int, int, int], lags: tuple[int, int]
) -> torch.Tensor:
    """:func:`lag_sum` as the sum of the m_h·m_w lagged slices."""
    th, tw, th2, tw2 = out
    return _total(
        block[u : u + th, v : v + tw, u : u + th2, v : v + tw2]
        for u in range(lags[0])
        for v in range(lags[1])
    )


class ConvGrads(LayerGrads):
    """Conv2d (groups=1): ∇W_i = Σ_t g_{i,t} a_{i,t}ᵀ over output positions t (a: patches).

    Mixed ghost norms (Bu et al. 2023): with T output positions, d = C_in·k_h·k_w and
    p = C_out, the per-sample norm is taken by the Gram ("ghost") form
    ‖∇W_i‖² = Σ_{t,t'} (a_t·a_t')(g_t·g_t') when 2T² < p·d, else by building ∇W_i in one
    convolution call (:meth:`_build`); the Gram form takes the patch products a_t·a_t'
    from the Gram of the input's stride-sized cells where that is cheaper
    (:attr:`gram_by_cells`). Both run over chunks of samples, so no (B × P) tensor is kept,
    except a built one no larger than twice the layer's stored input and output gradient
    (or ``flags.keep_built_floats``), which is reused for the sum (:attr:`keep_built`).
    Otherwise the clipped sum is book-keeping: one ``conv2d_weight`` on the re-weighted
    output gradient, from the stored activations (no second backward pass). ``flags`` may
    force any of these forms.
    """

    def __init__(
        self,
        module: nn.Conv2d,
        inputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        flags: EngineFlags = DEFAULT_FLAGS,
    ):
        self.module, self.flags = module, flags
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        self.inputs, self.grads = inputs, grads
        self._per_sample: list[torch.Tensor] | None = None

    @property
    def positions(self) -> int:
        return sum(g.shape[2] * g.shape[3] for g in self.grads)

    @property
    def use_fused(self) -> bool:
        """The fused kernel (``flags.norm_form`` "fused") for a conv called once per forward
        pass; it squares one call's gradient, so a conv called more often takes "auto"'s form."""
        return self.flags.norm_form == "fused" and len(self.inputs) == 1

    @property
    def use_ghost(self) -> bool:
        """Bu et al.'s rule: the Gram form costs ~2T² per sample against p·d for building
        (unless ``flags.norm_form`` says which)."""
        if self.flags.norm_form in ("ghost", "build"):
            return self.flags.norm_form == "ghost"
        if self.use_fused:
            return False
        m = self.module
        return 2 * self.positions**2 < m.out_channels * m.weight[0].numel()

    @property
    def build_form(self) -> str:
        """How :meth:`_build` forms the per-sample gradients (``flags.conv_build`` unless
        "auto", or "cpu" for the CPU's choice on any device). On CUDA "patches": the patches
        copied in one strided copy (:meth:`_patches`), times the output gradient in one
        batched matmul (no kernel launch per sample, as ``F.unfold`` would take). On CPU,
        with few input channels (an image layer), "correlation": each input channel
        correlated with every sample's output gradient, a convolution with one input channel
        per group; with more, "grouped", the weight gradient of the convolution stacking the
        samples as groups."""
        form = self.flags.conv_build
        if form not in ("auto", "cpu"):
            return form
        if form == "auto" and self.inputs[0].device.type == "cuda":
            return "patches"
        return "correlation" if self.module.in_channels <= 3 else "grouped"

    def _build(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-sample weight gradients (b, *W.shape) of one call,
        ∇W_i[o, c, κ] = Σ_t g_i[o, t] x_i[c, stride·t + dilation·κ] (x zero-padded)."""
        m, b = self.module, x.shape[0]
        if b == 0:
            return x.new_zeros(0, *m.weight.shape)
        form, dot = self.build_form, gemm_dot(self.flags)
        if form == "patches":
            c_in, (kh, kw) = m.in_channels, m.kernel_size
            w = products(torch.bmm, g.flatten(2), self._patches(x), dot)  # (b, C_out, k_h·k_w·C_in)
            return w.view(b, m.out_channels, kh, kw, c_in).permute(0, 1, 4, 2, 3).contiguous()
        if form == "correlation":
            # batch = input channels, groups = samples, kernel = the output gradient; the
            # conv's stride and dilation swap roles; the result's corner is the k_h × k_w window
            kh, kw = m.kernel_size
            w = products(
                lambda x_t, kernel: F.conv2d(
                    x_t, kernel, None, m.dilation, m.padding, m.stride, groups=b
                ),
                x.transpose(0, 1),
                g.reshape(b * m.out_channels, 1, *g.shape[2:]),
                dot,
            )[:, :, :kh, :kw]
            return (
                w.reshape(m.in_channels, b, m.out_channels, kh, kw)
                .permute(1, 2, 0, 3, 4)
                .contiguous()
            )
        # the weight gradient of the grouped convolution that stacks the b samples as groups
        w = products(
            lambda stacked_x, stacked_g: torch.nn.grad.conv2d_weight(
                stacked_x,
                (b * m.out_channels, *m.weight.shape[1:]),
                stacked_g,
                m.stride,
                m.padding,
                m.dilation,
                groups=b,
            ),
            x.reshape(1, b * x.shape[1], *x.shape[2:]),
            g.reshape(1, b * g.shape[1], *g.shape[2:]),
            dot,
        )
        return w.view(b, *m.weight.shape)

    @property
    def _build_floats(self) -> int:
        """The floats of :meth:`_build`'s temporaries per sample: its result and a permuted
        copy (2P), and in the "patches" form the padded input and the T × d patches too."""
        m, P = self.module, self.module.weight.numel()
        if self.build_form != "patches":
            return 2 * P
        (ph, pw), d = m.padding, m.weight[0].numel()
        padded = sum(
            c * (h + 2 * ph) * (w + 2 * pw) for _, c, h, w in (x.shape for x in self.inputs)
        )
        return 2 * P + padded + self.positions * d

    @property
    def keep_built(self) -> bool:
        """Keep the built (B × P) gradients for the sum when they take at most twice the
        memory the layer already holds (its inputs and output gradients) or
        ``flags.keep_built_floats``: the sum is then an einsum over them instead of a second
        weight-gradient convolution. Never with ``flags.keep_built`` False."""
        return _keeps_built(self)

    def settle(self) -> None:
        """Builds the per-sample gradients now when :attr:`keep_built` would keep them, and
        drops the stored inputs and output gradients (often the larger: an image layer's
        B × P is smaller than its activations), so autograd frees them as it goes."""
        if (
            self.inputs[0].shape[0]
            and not self.use_ghost
            and not self.use_fused
            and self.keep_built
        ):
            self.per_sample()
            self.inputs = self.grads = None

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """The input patches a_t as rows (b, T, d), each in (k_h, k_w, C_in) order: a strided
        view of the channels-last padded input, copied in runs of k_w·C_in contiguous floats
        (cheaper than ``F.unfold``'s im2col). Only their inner products are used, so the
        order within a patch is free."""
        m = self.module
        (kh, kw), (sh, sw), (dh, dw), (ph, pw) = m.kernel_size, m.stride, m.dilation, m.padding
        x = x.permute(0, 2, 3, 1)
        x = (F.pad(x, (0, 0, pw, pw, ph, ph)) if ph or pw else x).contiguous()
        b, h, w, c = x.shape
        ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
        s_b, s_h, s_w, s_c = x.stride()
        view = x.as_strided(
            (b, ho, wo, kh, kw, c), (s_b, sh * s_h, sw * s_w, dh * s_h, dw * s_w, s_c)
        )
        return view.reshape(b, ho * wo, kh * kw * c)

    @property
    def cell_grids(self) -> list[tuple[int, int, int, int]] | None:
        """Per call, (cell rows, cell cols, output rows, output cols) when the kernel is a whole
        number m_h × m_w of stride-sized cells (no dilation), else None."""
        m = self.module
        (kh, kw), (sh, sw) = m.kernel_size, m.stride
        if m.dilation != (1, 1) or kh % sh or kw % sw:
            return None
        return [
            (th + kh // sh - 1, tw + kw // sw - 1, th, tw)
            for th, tw in (g.shape[2:] for g in self.grads)
        ]

    @property
    def gram_by_cells(self) -> bool:
        """Whether the Gram form takes its patch products from cells
        (:meth:`_cell_gram_norms_sq`): when the cells' Gram, N² products of s_h·s_w·C_in
        floats over the N cells, plus the m_h·m_w lagged sums of T² entries cost less than
        the patches' Gram, T² products of d = m_h·m_w·s_h·s_w·C_in floats (a 4×4 kernel of
        stride 2 on a 12×12 map: 36 cells of 64 floats against 25 patches of 256), or as
        ``flags.conv_gram`` says. Never where the kernel is not whole cells."""
        if self.cell_grids is None:
            return False
        if self.flags.conv_gram != "auto":
            return self.flags.conv_gram == "cells"
        n, f = self._cell_sizes()
        T, lags = self.positions, self.module.weight[0].numel() // f
        return n * n * f + lags * T * T < T * T * lags * f

    def _cell_sizes(self) -> tuple[int, int]:
        """(N, f): the number of cells over all calls and the floats in one, s_h·s_w·C_in."""
        m = self.module
        return sum(r * c for r, c, _, _ in self.cell_grids), m.stride[0] * m.stride[
            1
        ] * m.in_channels

    def _cells(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The zero-padded input cut into s_h × s_w cells, as rows (b, rows·cols, s_h·s_w·C_in)
        (channels last within a cell): the patch of output position (i, j) is the
        m_h × m_w block of cells from cell (i, j)."""
        m = self.module
        (sh, sw), (ph, pw) = m.stride, m.padding
        x = x.permute(0, 2, 3, 1)
        if ph or pw:
            x = F.pad(x, (0, 0, pw, pw, ph, ph))
        b, c = x.shape[0], x.shape[3]
        x = x[:, : rows * sh, : cols * sw]
        return (
            x.reshape(b, rows, sh, cols, sw, c).transpose(2, 3).reshape(b, rows * cols, sh * sw * c)
        )

    def _cell_gram_norms_sq(self, sl: slice) -> torch.Tensor:
        """Σ_{t,t'} (a_t·a_t')(g_t·g_t') with a_t·a_t' = Σ_κ c_{t+κ}·c_{t'+κ}, κ over the
        kernel's m_h × m_w cells: the cells' Gram is taken once and summed along its m_h·m_w
        diagonal lags, instead of the Gram of patches that repeat each cell m_h·m_w times.
        Over several calls, each pair of calls is one block of both Grams."""
        m, grids = self.module, self.cell_grids
        mh, mw = m.kernel_size[0] // m.stride[0], m.kernel_size[1] // m.stride[1]
        a = _cat(
            [self._cells(x[sl], rows, cols) for x, (rows, cols, _, _) in zip(self.inputs, grids)], 1
        )
        b, n = a.shape[:2]
        # samples last, so that the lagged slices below run over contiguous samples
        dot = gemm_dot(self.flags)
        gram_a = products(torch.bmm, a, a.transpose(1, 2), dot)
        gram_a = gram_a.view(b, n * n).T.contiguous().view(n, n, b)
        g = _cat([g[sl].flatten(2) for g in self.grads], 2)  # (b, p, T)
        T = g.shape[2]
        gram_g = products(torch.bmm, g.transpose(1, 2), g, dot).view(b, T * T).T.view(T, T, b)
        out, u, ci, ti = 0, 0, 0, 0
        for i, (rows_i, cols_i, th_i, tw_i) in enumerate(grids):
            cj, tj = 0, 0
            for j, (rows_j, cols_j, th_j, tw_j) in enumerate(grids):
                block = gram_a[ci : ci + rows_i * cols_i, cj : cj + rows_j * cols_j]
                block = block.unflatten(1, (rows_j, cols_j)).unflatten(0, (rows_i, cols_i))
                lagged = lag_sum(block, (th_i, tw_i, th_j, tw_j), (mh, mw), self.flags.lag_sum)
                lagged = lagged.reshape(th_i * tw_i, th_j * tw_j, b)
                pair = gram_g[ti : ti + th_i * tw_i, tj : tj + th_j * tw_j]
                out = out + (lagged * pair).sum((0, 1))
                if i == j:  # ‖a_t‖², ‖g_t‖² of this call's positions on the diagonals
                    u = u + _diagonal_magnitudes(lagged.permute(2, 0, 1), pair.permute(2, 0, 1))
                cj, tj = cj + rows_j * cols_j, tj + th_j * tw_j
            ci, ti = ci + rows_i * cols_i, ti + th_i * tw_i
        return out, u

    def _weight_norms_sq(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """‖∇W_i‖², and U_i (:meth:`_weight_magnitudes`) where the Gram forms give it for
        free, on their diagonals; else None."""
        B, m, dev = self.inputs[0].shape[0], self.module, self.inputs[0].device
        if self.use_fused:
            return self._fused_norms_sq(), None
        if self.use_ghost and self.gram_by_cells:
            (n, f), T = self._cell_sizes(), self.positions
            chunks = _chunks(B, 2 * n * n + n * f + 2 * T * T + T * m.out_channels, dev, self.flags)
            parts = [self._cell_gram_norms_sq(sl) for sl in chunks]
            return torch.cat([w for w, _ in parts]), torch.cat([u for _, u in parts])
        if self.use_ghost:
            T, d = self.positions, m.weight[0].numel()
            parts = []
            for sl in _chunks(B, 2 * T * T + T * (d + m.out_channels), dev, self.flags):
                a = _cat([self._patches(x[sl]) for x in self.inputs], 1)  # (b, T, d)
                g = _cat([g[sl].flatten(2) for g in self.grads], 2)  # (b, p, T)
                blocks, dot = self.flags.gram_blocks_from, gemm_dot(self.flags)
                parts.append(gram_dot(a, g.transpose(1, 2), blocks, dot, with_magnitudes=True))
            return torch.cat([w for w, _ in parts]), torch.cat([u for _, u in parts])
        if self.keep_built:  # build once, reuse for the sum
            return sq_norms(self.per_sample()[0]), None
        built = builds_by_chunk(self, self._build_floats)
        return torch.cat([sq_norms(w) for _, w in built]), None

    def _fused_norms_sq(self, keep: torch.Tensor | None = None) -> torch.Tensor:
        """‖∇W_i‖² (or ‖keep ⊙ ∇W_i‖²) by the fused kernel (:attr:`use_fused`)."""
        (x,), (g,), m = self.inputs, self.grads, self.module
        w = fused.conv2d_norms_sq(
            x, g, m.kernel_size, m.stride, m.padding, m.dilation, fused_dot(self.flags), keep
        )
        return w.to(x.dtype)

    def masked(self, keep: list[torch.Tensor]) -> LayerGrads:
        """Unbuilt where the fused kernel takes this conv's norms (:attr:`use_fused`, nothing
        built yet): it masks each tile before squaring it; materialised otherwise."""
        if self.use_fused and self._per_sample is None:
            return MaskedGrads(self, keep)
        return super().masked(keep)

    def masked_norms_sq(self, keep: list[torch.Tensor]) -> torch.Tensor:
        w = guarded_norms_sq(self._fused_norms_sq(keep[0]), self._weight_magnitudes())
        if self.module.bias is not None:
            w = w + sq_norms(self._bias_grads() * keep[1].to(w.dtype))
        return w

    def per_sample(self) -> list[torch.Tensor]:
        """The per-sample gradients, materialised (for stages that transform them)."""
        if self._per_sample is None:
            self._per_sample = [built_in_chunks(self, self._build_floats)]
            if self.module.bias is not None:
                self._per_sample.append(self._bias_grads())
        return self._per_sample

    def _bias_grads(self) -> torch.Tensor:
        return _total(g.sum((2, 3)) for g in self.grads)

    def norms_sq(self) -> torch.Tensor:
        if self._per_sample is not None:
            return _total(sq_norms(p) for p in self._per_sample)
        if self.inputs[0].shape[0] == 0:
            return self.inputs[0].new_zeros(0)
        # the bias's per-sample gradients are built (its norm and sum read the same tensor);
        # the weight's norm and its book-kept sum are computed apart, so guarded
        w, u = self._weight_norms_sq()
        if self._per_sample is None:  # not built and kept for the sum just now (keep_built)
            w = guarded_norms_sq(w, self._weight_magnitudes() if u is None else u)
        return w + sq_norms(self._bias_grads()) if self.module.bias is not None else w

    def _weight_magnitudes(self) -> torch.Tensor:
        """U_i = Σ_t ‖a_{i,t}‖·‖g_{i,t}‖ over the output positions of every call (a: the
        patch at t), for :func:`guarded_norms_sq`: the patches' squared norms are the squared
        input summed over each window, a convolution with a kernel of ones."""
        m, u = self.module, 0
        for x, g in zip(self.inputs, self.grads):
            window_sq = products(
                lambda x_sq, ones: F.conv2d(x_sq, ones, None, m.stride, m.padding, m.dilation),
                x.square().sum(1, keepdim=True),
                x.new_ones(1, 1, *m.kernel_size),
                gemm_dot(self.flags),
            )
            g_norms = torch.linalg.vector_norm(g, dim=1)
            u = u + (window_sq[:, 0].clamp(min=0).sqrt() * g_norms).flatten(1).sum(1)
        return u

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        out = [self.weight_sum(weights)]
        if self.module.bias is not None:
            out.append(
                weights
                @ (self._per_sample[1] if self._per_sample is not None else self._bias_grads())
            )
        return out

    def weight_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i ∇W_i by book-keeping: one ``conv2d_weight`` per call on the re-weighted
        output gradient (or an einsum over gradients already built)."""
        if self._per_sample is not None:
            return torch.einsum("b,b...->...", weights, self._per_sample[0])
        m, dot = self.module, gemm_dot(self.flags)

        def weight_grad(x, g):
            return torch.nn.grad.conv2d_weight(
                x, m.weight.shape, g, m.stride, m.padding, m.dilation
            )

        return _total(
            products(weight_grad, x, g * weights[:, None, None, None], dot)
            for x, g in zip(self.inputs, self.grads)
        )


def _keeps_built(layer) -> bool:
    """:attr:`ConvGrads.keep_built` (and :class:`Conv3dGrads`'): the built (B × P) gradients
    take at most ``flags.keep_built_floats`` or twice the floats the layer holds."""
    if not layer.flags.keep_built:
        return False
    held = sum(t.numel() for t in layer.inputs) + sum(t.numel() for t in layer.grads)
    limit = max(layer.flags.keep_built_floats, 2 * held)
    return layer.inputs[0].shape[0] * layer.module.weight.numel() <= limit


@takes_flags
def conv_rule(module: nn.Conv2d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS):
    """Conv2d: :class:`ConvGrads`; grouped, :class:`GroupedConvGrads`; padding by name
    ('same', 'valid') or of another mode (reflect, replicate, circular), the padded inputs
    through a :class:`_ConvView` without padding (:func:`_padding`)."""
    if module.groups != 1:
        return GroupedConvGrads(module, inputs, grads)
    if _plain_conv(module):
        return ConvGrads(module, inputs, grads, flags)
    inputs, padding = _padding(module, inputs)
    view = _ConvView(module.weight.shape, module.stride, padding, module.dilation)
    inner = ConvGrads(view, inputs, list(grads), flags)
    bias = _total(g.sum((2, 3)) for g in grads) if module.bias is not None else None
    return ViewedConvGrads(module, inner, bias)


def _padding(module: nn.Conv1d | nn.Conv2d, inputs) -> tuple[list[torch.Tensor], tuple]:
    """The inputs and the padding the layer's convolution computes with: its own zero padding
    given in numbers, or else the inputs padded here as torch's forward pads them for a
    padding mode other than zeros (``_reversed_padding_repeated_twice``, also set for 'same'
    and 'valid') and no padding."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return list(inputs), tuple(module.padding)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pads = module._reversed_padding_repeated_twice
    return [F.pad(x, pads, mode=mode) for x in inputs], (0,) * (module.weight.dim() - 2)


class GroupedConvGrads(LayerGrads):
    """Conv1d/Conv2d with G > 1 groups (depthwise: MobileNet, EfficientNet, ConvNeXt, Mamba):
    each example's weight gradient in closed form, the B examples stacked as the groups of
    one ``conv2d_weight`` (B·G groups); the clipped sum by book-keeping, one
    ``conv2d_weight`` (G groups) on the re-weighted output gradient; ∇b_i = Σ_t g_{i,t}.
    A Conv1d runs as a Conv2d over (1 × L) maps. Calls of the layer add up."""

    def __init__(self, module: nn.Conv1d | nn.Conv2d, inputs, grads):
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        one_d = module.weight.dim() == 3
        inputs, padding = _padding(module, inputs)
        lift = (lambda t: t.unsqueeze(2)) if one_d else (lambda t: t)
        self.xs, self.gs = [lift(x) for x in inputs], [lift(g) for g in grads]
        self.shape = module.weight.shape
        self.shape2d = (*self.shape[:2], 1, self.shape[2]) if one_d else self.shape
        self.stride, self.padding, self.dilation = (
            ((1, *module.stride), (0, *padding), (1, *module.dilation))
            if one_d
            else (module.stride, padding, module.dilation)
        )
        self.groups, self.has_bias = module.groups, module.bias is not None

    def _weight(self, x: torch.Tensor, g: torch.Tensor, groups: int) -> torch.Tensor:
        """The weight gradient from input ``x`` to output gradient ``g`` in ``groups`` groups
        (as many filters as ``g`` has channels)."""
        size = (g.shape[1], *self.shape2d[1:])
        return torch.nn.grad.conv2d_weight(
            x, size, g, self.stride, self.padding, self.dilation, groups
        )

    def _bias(self) -> torch.Tensor:
        return _total(g.sum((2, 3)) for g in self.gs)

    def norms_sq(self) -> torch.Tensor:
        """The built gradients' norms, at least the weight's magnitude / K
        (:func:`guarded_norms_sq`; its bias is built for the sum too): the book-kept sum is
        another convolution over the same huge terms, and a depthwise Conv1d reading
        ±2³⁴ alternating inputs moved it by 7.5 C."""
        per_sample = self.per_sample()
        w = guarded_norms_sq(sq_norms(per_sample[0]), self._weight_magnitudes())
        return w + sq_norms(per_sample[1]) if self.has_bias else w

    def _weight_magnitudes(self) -> torch.Tensor:
        """√(Σ_groups U_G²), U_G = Σ_t ‖a_{t,G}‖·‖g_{t,G}‖ over output positions t (a_{t,G}:
        the patch of group G's input channels at t, g_{t,G}: its output channels there),
        which bounds the rounding of each group's built gradient and of its book-kept sum."""
        G, (kh, kw), u = self.groups, self.shape2d[2:], 0
        for x, g in zip(self.xs, self.gs):
            x_sq = x.square().unflatten(1, (G, -1)).sum(2)  # (B, G, H, W)
            window_sq = F.conv2d(
                x_sq, x.new_ones(G, 1, kh, kw), None, self.stride, self.padding, self.dilation, G
            )
            g_norms = torch.linalg.vector_norm(g.unflatten(1, (G, -1)), dim=2)  # (B, G, H', W')
            u = u + (window_sq.clamp(min=0).sqrt() * g_norms).flatten(2).sum(2)
        return torch.linalg.vector_norm(u, dim=1) if isinstance(u, torch.Tensor) else u

    def per_sample(self) -> list[torch.Tensor]:
        B = self.xs[0].shape[0]
        weight = _total(
            self._weight(
                x.reshape(1, B * x.shape[1], *x.shape[2:]),
                g.reshape(1, B * g.shape[1], *g.shape[2:]),
                B * self.groups,
            )
            for x, g in zip(self.xs, self.gs)
        )  # (B·C_out, C_in/G, k_h, k_w): example b's filters are rows b·C_out on
        out = [weight.reshape(B, *self.shape)]
        return out + ([self._bias()] if self.has_bias else [])

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        w = weights.to(self.gs[0].dtype)[:, None, None, None]
        weight = _total(self._weight(x, g * w, self.groups) for x, g in zip(self.xs, self.gs))
        out = [weight.reshape(self.shape)]
        return out + ([weights.to(self.gs[0].dtype) @ self._bias()] if self.has_bias else [])


class EmbeddingGrads(LayerGrads):
    """Embedding rows: ∇E_i = Σ_t onehot(x_{i,t}) g_{i,t}ᵀ. Norms by the Gram of an
    example's L positions, Σ_{s,t} [x_s = x_t] g_sᵀg_t (L² terms), unless the table has fewer
    entries (BERT's token types: 2 rows of 768 against 128² pairs of positions): then built."""

    def __init__(self, module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor):
        self.params = [module.weight]
        self.idx = idx.reshape(idx.shape[0], -1)
        self.g = g.reshape(idx.shape[0], -1, g.shape[-1])
        if module.padding_idx is not None:
            self.g = self.g * (self.idx != module.padding_idx).unsqueeze(-1)
        self.num, self.dim = module.weight.shape

    def norms_sq(self) -> torch.Tensor:
        """Built or by the Gram, at least (Σ_t ‖g_t‖ / K)² (:func:`guarded_norms_sq`): one
        token at two positions with huge opposite output gradients (scaled by an input
        (2²⁰(1 + 2⁻¹⁴), −2²⁰)) had a float32 norm far below its true one and moved the
        book-kept sum by 45 C (46,000 C at 2³⁰)."""
        if self.idx.shape[1] ** 2 > self.num * self.dim:
            w = sq_norms(self.per_sample()[0])
        else:
            same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(self.g.dtype)
            w = (same * torch.bmm(self.g, self.g.transpose(1, 2))).sum((1, 2))
        return guarded_norms_sq(w, torch.linalg.vector_norm(self.g, dim=2).sum(1))

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        out = torch.zeros(self.num, self.dim, dtype=self.g.dtype, device=self.g.device)
        out.index_add_(
            0, self.idx.reshape(-1), (self.g * weights[:, None, None]).reshape(-1, self.dim)
        )
        return [out]

    def per_sample(self) -> list[torch.Tensor]:
        B = self.idx.shape[0]
        out = torch.zeros(B * self.num, self.dim, dtype=self.g.dtype, device=self.g.device)
        flat = (self.idx + self.num * torch.arange(B, device=self.idx.device).unsqueeze(1)).reshape(
            -1
        )
        out.index_add_(0, flat, self.g.reshape(-1, self.dim))
        return [out.reshape(B, self.num, self.dim)]


def embedding_rule(module: nn.Embedding, inputs, grads):
    if module.max_norm is not None:
        return None
    return EmbeddingGrads(
        module,
        _cat([i.reshape(i.shape[0], -1) for i in inputs], 1),
        _cat([g.reshape(g.shape[0], -1, g.shape[-1]) for g in grads], 1),
    )


def norm_layer_rule(module: nn.GroupNorm | nn.LayerNorm, inputs, grads):
    """Affine GroupNorm/LayerNorm: ∇γ_i = Σ x̂_i ⊙ g_i, ∇β_i = Σ g_i over non-channel axes."""
    if module.weight is None:
        return None
    ws, bs = 0, 0
    for x, g in zip(inputs, grads):
        if isinstance(module, nn.GroupNorm):
            xhat = F.group_norm(x, module.num_groups, eps=module.eps)
            dims = [d for d in range(x.dim()) if d not in (0, 1)]
        else:
            xhat = F.layer_norm(x, module.normalized_shape, eps=module.eps)
            dims = list(range(1, x.dim() - len(module.normalized_shape)))
        ws = ws + (xhat.mul_(g).sum(dims) if dims else xhat.mul_(g))  # x̂ is a temporary: in place
        bs = bs + (g.sum(dims) if dims else g)
    grads_ = [ws] + ([bs] if module.bias is not None else [])
    return MaterializedGrads(
        [module.weight] + ([module.bias] if module.bias is not None else []), grads_
    )


class _ConvView:
    """What :class:`ConvGrads` reads of a Conv2d (groups=1, zero padding, no bias), for a
    layer whose weight gradient is a Conv2d's: a Conv1d over (1 × L) maps, or a
    ConvTranspose2d, whose weight gradient is that of the Conv2d from its output gradient
    to its input (the transposed convolution is that Conv2d's adjoint, with the same weight
    shape (C_in, C_out, k_h, k_w), stride, padding and dilation)."""

    def __init__(self, weight_shape, stride, padding, dilation):
        self.weight = torch.empty(weight_shape, device="meta")  # only its shape is read
        self.bias = None
        self.out_channels, self.in_channels = weight_shape[0], weight_shape[1]
        self.kernel_size = tuple(weight_shape[2:])
        self.stride, self.padding, self.dilation = tuple(stride), tuple(padding), tuple(dilation)


class ViewedConvGrads(LayerGrads):
    """A layer's weight gradient by :class:`ConvGrads` on a :class:`_ConvView` (every form:
    ghost norms, built gradients, book-kept sums), reshaped to the layer's weight; the bias
    gradient Σ_t g_t is formed at once (B × C_out)."""

    def __init__(self, module: nn.Module, inner: ConvGrads, bias: torch.Tensor | None):
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        self.inner, self.bias, self.shape = inner, bias, module.weight.shape

    def settle(self) -> None:
        self.inner.settle()

    def norms_sq(self) -> torch.Tensor:
        w = self.inner.norms_sq()
        return w + sq_norms(self.bias) if self.bias is not None else w

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        out = [self.inner.weighted_sum(weights)[0].reshape(self.shape)]
        return out + ([weights @ self.bias] if self.bias is not None else [])

    def per_sample(self) -> list[torch.Tensor]:
        w = self.inner.per_sample()[0]
        return [w.reshape(w.shape[0], *self.shape)] + ([self.bias] if self.bias is not None else [])


def _plain_conv(module) -> bool:
    """One group, zero padding given in numbers."""
    return (
        module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


@takes_flags
def conv1d_rule(module: nn.Conv1d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS):
    """Conv1d as a Conv2d over (1 × L) maps: the Conv2d rule's forms, unchanged (grouped:
    :class:`GroupedConvGrads`; padding by name or of another mode: as :func:`conv_rule`)."""
    if module.groups != 1:
        return GroupedConvGrads(module, inputs, grads)
    inputs, padding = _padding(module, inputs)
    o, c, k = module.weight.shape
    view = _ConvView((o, c, 1, k), (1, *module.stride), (0, *padding), (1, *module.dilation))
    inner = ConvGrads(
        view, [x.unsqueeze(2) for x in inputs], [g.unsqueeze(2) for g in grads], flags
    )
    bias = _total(g.sum(2) for g in grads) if module.bias is not None else None
    return ViewedConvGrads(module, inner, bias)


@takes_flags
def conv_transpose2d_rule(
    module: nn.ConvTranspose2d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS
):
    """ConvTranspose2d y = Wᵀ⋆x: ∇W_i is the weight gradient of the Conv2d (same weight,
    stride, padding, dilation) taking the output gradient g_i to the input x_i, so the
    Conv2d rule runs with input and output gradient swapped (output_padding only adds rows
    of g that no weight reaches)."""
    if not _plain_conv(module):
        return None
    view = _ConvView(module.weight.shape, module.stride, module.padding, module.dilation)
    inner = ConvGrads(view, list(grads), list(inputs), flags)
    bias = _total(g.sum((2, 3)) for g in grads) if module.bias is not None else None
    return ViewedConvGrads(module, inner, bias)


@takes_flags
def conv_transpose1d_rule(
    module: nn.ConvTranspose1d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS
):
    """ConvTranspose1d: the ConvTranspose2d rule on (1 × L) maps."""
    if not _plain_conv(module):
        return None
    c_in, c_out, k = module.weight.shape
    view = _ConvView(
        (c_in, c_out, 1, k), (1, *module.stride), (0, *module.padding), (1, *module.dilation)
    )
    inner = ConvGrads(
        view, [g.unsqueeze(2) for g in grads], [x.unsqueeze(2) for x in inputs], flags
    )
    bias = _total(g.sum(2) for g in grads) if module.bias is not None else None
    return ViewedConvGrads(module, inner, bias)


@takes_flags
def conv_transpose3d_rule(
    module: nn.ConvTranspose3d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS
):
    """ConvTranspose3d: the Conv3d rule with input and output gradient swapped (as for
    ConvTranspose2d)."""
    if not _plain_conv(module):
        return None
    view = _ConvView(module.weight.shape, module.stride, module.padding, module.dilation)
    inner = Conv3dGrads(view, list(grads), list(inputs), flags)
    bias = _total(g.sum((2, 3, 4)) for g in grads) if module.bias is not None else None
    return ViewedConvGrads(module, inner, bias)


class Conv3dGrads(LayerGrads):
    """Conv3d (groups=1): per-sample weight gradients built in closed form, the samples
    stacked as the groups of one ``conv3d_weight`` (in chunks of samples for the norms,
    kept when small, as :class:`ConvGrads` keeps them); the clipped sum by book-keeping,
    one ``conv3d_weight`` on the re-weighted output gradient."""

    def __init__(self, module: nn.Conv3d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS):
        self.module, self.inputs, self.grads, self.flags = module, inputs, grads, flags
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        self.bias = _total(g.sum((2, 3, 4)) for g in grads) if module.bias is not None else None
        self._built: torch.Tensor | None = None

    def _build(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        m, b = self.module, x.shape[0]
        if b == 0:
            return x.new_zeros(0, *m.weight.shape)
        w = torch.nn.grad.conv3d_weight(
            x.reshape(1, b * x.shape[1], *x.shape[2:]),
            (b * m.out_channels, *m.weight.shape[1:]),
            g.reshape(1, b * g.shape[1], *g.shape[2:]),
            m.stride,
            m.padding,
            m.dilation,
            groups=b,
        )
        return w.view(b, *m.weight.shape)

    @property
    def keep_built(self) -> bool:
        return _keeps_built(self)

    def _weight(self) -> torch.Tensor:
        if self._built is None:
            self._built = built_in_chunks(self, 2 * self.module.weight.numel())
        return self._built

    def norms_sq(self) -> torch.Tensor:
        if self._built is not None or self.keep_built:
            w = sq_norms(self._weight())
        else:  # the sum will be book-kept, apart from these norms: guarded
            chunks = builds_by_chunk(self, 2 * self.module.weight.numel())
            w = _cat([sq_norms(built) for _, built in chunks], 0)
            w = guarded_norms_sq(w, self._weight_magnitudes())
        return w + sq_norms(self.bias) if self.bias is not None else w

    def _weight_magnitudes(self) -> torch.Tensor:
        """U_i = Σ_t ‖a_{i,t}‖·‖g_{i,t}‖ over output positions (a: the patch at t), as
        :meth:`ConvGrads._weight_magnitudes` takes it, for :func:`guarded_norms_sq`."""
        m, u = self.module, 0
        for x, g in zip(self.inputs, self.grads):
            window_sq = F.conv3d(
                x.square().sum(1, keepdim=True),
                x.new_ones(1, 1, *m.kernel_size),
                None,
                m.stride,
                m.padding,
                m.dilation,
            )
            g_norms = torch.linalg.vector_norm(g, dim=1)
            u = u + (window_sq[:, 0].clamp(min=0).sqrt() * g_norms).flatten(1).sum(1)
        return u

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        m = self.module
        if self._built is not None:
            out = [torch.einsum("b,b...->...", weights, self._built)]
        else:
            out = [
                _total(
                    torch.nn.grad.conv3d_weight(
                        x,
                        m.weight.shape,
                        g * weights[:, None, None, None, None],
                        m.stride,
                        m.padding,
                        m.dilation,
                    )
                    for x, g in zip(self.inputs, self.grads)
                )
            ]
        return out + ([weights @ self.bias] if self.bias is not None else [])

    def per_sample(self) -> list[torch.Tensor]:
        return [self._weight()] + ([self.bias] if self.bias is not None else [])


@takes_flags
def conv3d_rule(module: nn.Conv3d, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS):
    if not _plain_conv(module):
        return None
    return Conv3dGrads(module, inputs, grads, flags)


def _rms_norm_grads(module: nn.Module, normalized_shape, eps, inputs, grads):
    """An RMSNorm's ∇w_i = Σ x̂_i ⊙ g_i over the axes before the normalised ones."""
    ws = 0
    for x, g in zip(inputs, grads):
        xhat = F.rms_norm(x, normalized_shape, eps=eps)
        dims = list(range(1, x.dim() - len(normalized_shape)))
        ws = ws + (xhat.mul_(g).sum(dims) if dims else xhat.mul_(g))
    return MaterializedGrads([module.weight], [ws])


def rms_norm_rule(module: nn.RMSNorm, inputs, grads):
    """Affine RMSNorm: ∇γ_i = Σ x̂_i ⊙ g_i over the axes before the normalised ones."""
    if module.weight is None:
        return None
    return _rms_norm_grads(module, module.normalized_shape, module.eps, inputs, grads)


def hf_rms_norm_rule(module: nn.Module, inputs, grads):
    """Hugging Face's RMSNorms (LLaMA's, Mistral's, Qwen2's, Gemma's, T5's), y = w ⊙ x̂ (Gemma:
    (1 + w) ⊙ x̂), x̂ = x / √(mean(x²) + ε) over the last axis: ∇w_i = Σ x̂_i ⊙ g_i over the
    axes between, with x̂ in the parameters' precision."""
    eps = module.eps if hasattr(module, "eps") else module.variance_epsilon
    return _rms_norm_grads(module, tuple(module.weight.shape), eps, inputs, grads)


def instance_norm_rule(module: nn.modules.instancenorm._InstanceNorm, inputs, grads):
    """Affine InstanceNorm (statistics of each sample's own channels, track_running_stats=False):
    ∇γ_i = Σ x̂_i ⊙ g_i, ∇β_i = Σ g_i over the spatial axes."""
    if module.weight is None or module.track_running_stats:
        return None
    ws, bs = 0, 0
    for x, g in zip(inputs, grads):
        if x.dim() != module._get_no_batch_dim() + 1:
            return None  # an unbatched call: left to the generic rule's checks
        xhat = F.instance_norm(x, eps=module.eps)
        dims = list(range(2, x.dim()))
        ws = ws + xhat.mul_(g).sum(dims)
        bs = bs + g.sum(dims)
    return MaterializedGrads(
        [module.weight] + ([module.bias] if module.bias is not None else []),
        [ws] + ([bs] if module.bias is not None else []),
    )


def prelu_rule(module: nn.PReLU, inputs, grads):
    """PReLU y = max(x, 0) + a·min(x, 0): ∇a_i = Σ g_i ⊙ min(x_i, 0), per channel (axis 1)
    or over everything with one shared slope."""
    ws = 0
    for x, g in zip(inputs, grads):
        t = torch.clamp(x, max=0).mul_(g)
        if module.num_parameters == 1:
            ws = ws + t.reshape(t.shape[0], -1).sum(1, keepdim=True)
        else:
            ws = ws + t.reshape(t.shape[0], t.shape[1], -1).sum(2)
    return MaterializedGrads([module.weight], [ws])


class Call:
    """One recorded call of a layer whose rule needs all of its arguments (a rule marked
    ``takes_call``): the forward's arguments by name (tensors detached). Its ``_version``
    is that of every tensor argument, so the engine's in-place check covers them all."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        import inspect

        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        self.arguments = dict(bound.arguments)

    def detach(self) -> "Call":
        out = Call.__new__(Call)
        out.arguments = {
            k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in self.arguments.items()
        }
        return out

    @property
    def _version(self) -> tuple:
        return tuple(v._version for v in self.arguments.values() if isinstance(v, torch.Tensor))

    def select(self, module: nn.Module, keep: torch.Tensor) -> "Call":
        """The call restricted to the examples of ``keep`` (a boolean mask over the batch): a
        MultiheadAttention's query, key and value on its batch axis, its key padding mask and
        a 3-D attention mask's per-sample heads; an EmbeddingBag's bags (2-D input or offsets)."""
        out = Call.__new__(Call)
        a = out.arguments = dict(self.arguments)
        if folds_rows(module):  # rows of the batch flattened: the rule knows their order
            out.arguments = RULES.get(type(module)).select_rows(module, a, keep)
            return out
        if isinstance(module, nn.MultiheadAttention):
            bd = batch_dim(module)
            for name in ("query", "key", "value"):
                a[name] = a[name][:, keep] if bd else a[name][keep]
            if a["key_padding_mask"] is not None:
                a["key_padding_mask"] = a["key_padding_mask"][keep]
            for name in ("attn_mask", "_dropout_keep"):  # (B·heads, L, S): each sample's heads
                mask = a.get(name)
                if mask is not None and mask.dim() == 3:
                    a[name] = mask.view(len(keep), -1, *mask.shape[1:])[keep].flatten(0, 1)
            return out
        if isinstance(module, nn.EmbeddingBag):
            x, offsets, psw = a["input"], a["offsets"], a["per_sample_weights"]
            if x.dim() == 2:
                a["input"], a["per_sample_weights"] = x[keep], None if psw is None else psw[keep]
                return out
            starts = offsets[:-1] if module.include_last_offset else offsets
            end = offsets[-1:] if module.include_last_offset else offsets.new_tensor([x.numel()])
            lengths = torch.diff(starts, append=end)
            tokens = torch.repeat_interleave(keep, lengths)
            kept = lengths[keep]
            new = torch.cat([kept.new_zeros(1), kept.cumsum(0)])
            a["input"] = x[: tokens.numel()][tokens]
            a["offsets"] = new if module.include_last_offset else new[:-1]
            if psw is not None:
                a["per_sample_weights"] = psw[: tokens.numel()][tokens]
            return out
        if RULES.get(type(module)) is vit_embeddings_rule:
            for name in ("pixel_values", "bool_masked_pos"):
                if a[name] is not None:
                    a[name] = a[name][keep]
            return out
        from privgrad.errors import PrivgradError

        raise PrivgradError(
            f"{type(module).__name__}: examples cannot be dropped from its recorded calls"
        )


class Replay(Call):
    """One recorded call, with several arguments, of a layer the generic rule replays: its
    positional and keyword arguments as given (tensors detached; inside tuples, lists and
    dicts too), as the leaves of one pytree, and ``batched``, the numbers of the leaves that
    carry the batch on their first axis, which the replay takes one example at a time; every
    other leaf is shared by the batch. The engine sets ``batched`` from what make_private's
    check saw."""

    def __init__(self, args: tuple, kwargs: dict, batched: frozenset = frozenset()):
        self.leaves, self.spec = tree_flatten((tuple(args), dict(kwargs)))
        self.batched = batched

    def _map(self, fn) -> "Replay":
        out = Replay.__new__(Replay)
        out.leaves = [fn(i, v) for i, v in enumerate(self.leaves)]
        out.spec, out.batched = self.spec, self.batched
        return out

    @property
    def args(self) -> tuple:
        return tree_unflatten(self.leaves, self.spec)[0]

    @property
    def kwargs(self) -> dict:
        return tree_unflatten(self.leaves, self.spec)[1]

    def detach(self) -> "Replay":
        return self._map(lambda _, v: v.detach() if isinstance(v, torch.Tensor) else v)

    @property
    def _version(self) -> tuple:
        return tuple(v._version for v in self.tensors().values())

    def tensors(self) -> dict[int, torch.Tensor]:
        """The tensor leaves by number."""
        return {i: v for i, v in enumerate(self.leaves) if isinstance(v, torch.Tensor)}

    def select(self, module: nn.Module, keep: torch.Tensor) -> "Replay":
        return self._map(lambda i, v: v[keep] if i in self.batched else v)

    def replay(self, module: nn.Module, params: dict, batched: dict):
        """The module's output on one example: ``batched`` holds that example's rows of the
        batched leaves (without the batch axis), ``params`` its own parameters."""
        leaves = [batched[i].unsqueeze(0) if i in batched else v for i, v in enumerate(self.leaves)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        out = torch.func.functional_call(module, params, args, kwargs)
        return out[0] if isinstance(out, tuple) else out


def takes_call(module: nn.Module) -> bool:
    """Whether the layer's rule takes :class:`Call` records (all its arguments) rather than
    its first input; the engine then checks only the output's batch axis (the rule checks
    its inputs)."""
    return getattr(RULES.get(type(module)), "takes_call", False)


def folds_rows(module: nn.Module) -> bool:
    """Whether the layer's rule takes calls on the batch's rows flattened with positions,
    (B·T, ...), its output gradient viewed as (B, T, ...) (the experts of a mixture of
    experts; the rule knows the rows' order), where make_private's check saw it called so
    (the engine's ``folded``)."""
    return getattr(RULES.get(type(module)), "folds_rows", False)


def batch_dim(module: nn.Module) -> int:
    """The axis of a layer's output that holds the batch by the layer's own type: 1 for a
    MultiheadAttention with batch_first=False (its inputs and outputs are (L, B, E)), else 0
    (see also :func:`seq_first_layers`)."""
    return 1 if isinstance(module, nn.MultiheadAttention) and not module.batch_first else 0


def seq_first_layers(model: nn.Module) -> set[nn.Module]:
    """Modules whose input and output hold the batch on axis 1 (L, B, ...), known from a
    parent rather than guessed from shapes (which cannot tell L = B apart): every layer
    inside a TransformerEncoderLayer/DecoderLayer with batch_first=False, and the final norm
    of a TransformerEncoder/Decoder over such layers. (Their MultiheadAttention layers say
    so themselves: :func:`batch_dim`.)"""
    out: set[nn.Module] = set()
    for m in model.modules():
        if (
            isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
            and not m.self_attn.batch_first
        ):
            out.update(
                s for s in m.modules() if s is not m and not isinstance(s, nn.MultiheadAttention)
            )
        if (
            isinstance(m, (nn.TransformerEncoder, nn.TransformerDecoder))
            and m.norm is not None
            and len(m.layers)
            and not m.layers[0].self_attn.batch_first
        ):
            out.update(m.norm.modules())
    return out


def layer_params(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters a layer's rule covers, in model order: its own, and those of
    the children whose parameters its forward reads directly, so that their own forward (and
    hook) never runs: a MultiheadAttention's ``out_proj`` (``F.multi_head_attention_forward``
    reads out_proj.weight), and the :func:`read_children` of a layer the generic rule replays
    (a Mamba mixer's ``conv1d``)."""
    if isinstance(module, nn.MultiheadAttention):
        return [p for p in module.parameters() if p.requires_grad]
    return [p for _, p in layer_named_params(module)]


def layer_named_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """:func:`layer_params` with their names in ``module`` (``conv1d.weight``). Only the
    layer's own parameters and its read children's are visited (the engine asks this of
    every layer at every step)."""
    children = read_children(module) + table_children(module)
    named = list(module.named_parameters(recurse=False))
    if children:
        named += [
            (f"{c}.{n}", p)
            for c, child in module.named_children()
            if c in children
            for n, p in child.named_parameters(recurse=False)
        ]
    return [(n, p) for n, p in named if p.requires_grad]


# Layers whose forward reads some of its children's parameters directly, as
# ``F.conv1d(x, self.conv1d.weight, ...)``, instead of calling the child: by qualified type
# name, the children's names. Such a layer has no rule of its own; the generic rule replays
# its forward with its own parameters and those children's (make_private's check compares
# the result with autograd). State-space and linear-attention mixers of Hugging Face's
# transformers (Mamba's reads dt_proj too; the parameters the CUDA kernels' fast path reads
# besides are left to that check).
READ_CHILDREN: dict[str, tuple[str, ...]] = {
    f"transformers.models.{name}": children
    for name, children in {
        "mamba.modeling_mamba.MambaMixer": ("conv1d", "dt_proj"),
        "falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": ("conv1d", "dt_proj"),
        "jamba.modeling_jamba.JambaMambaMixer": ("conv1d", "dt_proj"),
        "mamba2.modeling_mamba2.Mamba2Mixer": ("conv1d",),
        "bamba.modeling_bamba.BambaMixer": ("conv1d",),
        "falcon_h1.modeling_falcon_h1.FalconH1Mixer": ("conv1d",),
        "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer": ("conv1d",),
        "nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": ("conv1d",),
        "zamba.modeling_zamba.ZambaMambaMixer": ("conv1d",),
        "zamba2.modeling_zamba2.Zamba2MambaMixer": ("conv1d",),
        "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": ("conv1d",),
        "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": ("conv1d",),
        "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": ("conv1d",),
        "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": ("conv1d",),
        "kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention": ("conv1d",),
        "bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention": ("conv1d",),
        "lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet": ("conv1d",),
    }.items()
}
_READ_CHILDREN_BY_TYPE: dict[type, tuple[str, ...]] = {}


def read_children(module: nn.Module) -> tuple[str, ...]:
    """The children (by name) whose parameters ``module``'s forward reads directly
    (:data:`READ_CHILDREN`, or :func:`register_read_children`); () for most layers."""
    kind = type(module)
    found = _READ_CHILDREN_BY_TYPE.get(kind)
    if found is None:
        found = READ_CHILDREN.get(_qualified_name(kind), ())
    return _present_children(module, found)


def _present_children(module: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that are children of ``module`` (a configuration may drop one)."""
    return tuple(c for c in names if isinstance(getattr(module, c, None), nn.Module))


# Layers that read a child's whole weight as a table the batch shares, never calling the
# child: DeBERTa's encoders take their relative-position Embedding's weight (then a LayerNorm
# in v2 and v3, and each attention layer's projections of it). Followed as the layer's own
# parameters (tables.py): its per-example gradient arrives where the projections meet the
# batch's queries and keys.
TABLE_CHILDREN: dict[str, tuple[str, ...]] = {
    "transformers.models.deberta.modeling_deberta.DebertaEncoder": ("rel_embeddings",),
    "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder": ("rel_embeddings",),
    "transformers.models.sew_d.modeling_sew_d.SEWDTransformerEncoder": ("rel_embeddings",),
}


def table_children(module: nn.Module) -> tuple[str, ...]:
    """The children (by name) whose parameters ``module``'s forward reads as tables the batch
    shares (:data:`TABLE_CHILDREN`); () for most layers."""
    return _present_children(module, TABLE_CHILDREN.get(_qualified_name(type(module)), ()))


def reads_calls(rule: Callable) -> Callable:
    """Marks a rule that takes each recorded call whole, a :class:`Call` (all its arguments,
    by name), instead of its first input (:func:`takes_call`)."""
    rule.takes_call = True
    return rule


@reads_calls
def mha_vmap_rule(module: nn.MultiheadAttention, calls: list[Call], grads: list[torch.Tensor]):
    """MultiheadAttention: per-sample gradients of all its parameters (in_proj or q/k/v
    projections, their bias, bias_k/bias_v, out_proj) by ``torch.func``: vmap over the
    batch axis of the VJP of ``F.multi_head_attention_forward`` on one sample's query, key,
    value and masks (key_padding_mask per sample, a 3-D attn_mask's per-sample heads), as
    ``nn.MultiheadAttention.forward`` calls it. Attention dropout in training cannot be
    replayed per sample, so it is refused."""
    from privgrad.errors import PrivgradError

    if module.training and module.dropout > 0:
        raise PrivgradError(
            f"MultiheadAttention with dropout={module.dropout} in training: its attention "
            "dropout cannot be replayed per sample; set the attention's dropout to 0 (for "
            "nn.TransformerEncoderLayer/DecoderLayer, layer.self_attn.dropout = 0.0 and "
            "layer.multihead_attn.dropout = 0.0 keep the other dropouts)"
        )
    names = [n for n, _ in module.named_parameters()]
    params = {n: p.detach() for n, p in module.named_parameters()}
    bd, H = batch_dim(module), module.num_heads
    separate = not module._qkv_same_embed_dim

    def sample_loss(p, q, k, v, kpm, mask, g, is_causal):
        out, _ = F.multi_head_attention_forward(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            module.embed_dim,
            H,
            p.get("in_proj_weight"),
            p.get("in_proj_bias"),
            p.get("bias_k"),
            p.get("bias_v"),
            module.add_zero_attn,
            0.0,
            p["out_proj.weight"],
            p.get("out_proj.bias"),
            training=False,
            key_padding_mask=None if kpm is None else kpm.unsqueeze(0),
            attn_mask=mask,
            # the explicit softmax path: vmap has no batching rule for CPU's fused SDPA
            need_weights=True,
            use_separate_proj_weight=separate,
            q_proj_weight=p.get("q_proj_weight"),
            k_proj_weight=p.get("k_proj_weight"),
            v_proj_weight=p.get("v_proj_weight"),
            is_causal=is_causal,
        )
        return (out.squeeze(1) * g).sum()

    total = None
    for call, g in zip(calls, grads):
        a = call.arguments
        q, k, v = a["query"], a["key"], a["value"]
        B = g.shape[bd]
        if q.dim() != 3 or any(t.dim() != 3 or t.shape[bd] != B for t in (q, k, v)):
            raise PrivgradError(
                f"MultiheadAttention was called on query/key/value of shapes {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)} for a batch of {B}: per-sample gradients "
                f"need batched inputs with the batch on axis {bd} "
                f"(batch_first={module.batch_first})"
            )
        kpm = F._canonical_mask(
            mask=a["key_padding_mask"],
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(a["attn_mask"]),
            other_name="attn_mask",
            target_type=q.dtype,
        )
        mask = F._canonical_mask(
            mask=a["attn_mask"],
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=q.dtype,
            check_other=False,
        )
        mask_dim = None
        if mask is not None and mask.dim() == 3:  # (B·heads, L, S): each sample's heads
            mask, mask_dim = mask.reshape(B, H, *mask.shape[1:]), 0
        fn = torch.func.vmap(
            torch.func.grad(sample_loss),
            in_dims=(None, bd, bd, bd, None if kpm is None else 0, mask_dim, bd, None),
        )
        per = fn(params, q, k, v, kpm, mask, g, bool(a["is_causal"]))
        total = per if total is None else {n: total[n] + per[n] for n in names}
    return MaterializedGrads([p for _, p in module.named_parameters()], [total[n] for n in names])


def _refuse_attention_dropout(module: nn.MultiheadAttention) -> None:
    from privgrad.errors import PrivgradError

    if module.training and module.dropout > 0:
        raise PrivgradError(
            f"MultiheadAttention with dropout={module.dropout} in training: its attention "
            "dropout cannot be replayed per sample; set the attention's dropout to 0 (for "
            "nn.TransformerEncoderLayer/DecoderLayer, layer.self_attn.dropout = 0.0 and "
            "layer.multihead_attn.dropout = 0.0 keep the other dropouts)"
        )


class _Weight:
    """What :class:`LinearGrads` reads of a module for a weight without bias."""

    def __init__(self, weight):
        self.weight, self.bias = weight, None


class AttentionGrads(LayerGrads):
    """MultiheadAttention's parameters as linear maps applied at positions: the q, k, v
    projections (rows of in_proj_weight, or q/k/v_proj_weight) on the query/key/value with the
    gradients of the projected q, k, v, and out_proj on the attention's output with the
    layer's output gradient, each a :class:`LinearGrads` (ghost norms or built, book-kept
    sums); the biases (B × E) and bias_k/bias_v materialised."""

    def __init__(self, module, linear: dict[str, LinearGrads], small: dict[str, torch.Tensor]):
        self.named = list(module.named_parameters())
        self.params = [p for _, p in self.named]
        self.linear, self.small = linear, small

    def _parts(self, name: str) -> list[str]:
        return ["q", "k", "v"] if name == "in_proj_weight" else [name]

    def norms_sq(self) -> torch.Tensor:
        return _total(
            [part.norms_sq() for part in self.linear.values()]
            + [sq_norms(t) for t in self.small.values()]
        )

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for name, _ in self.named:
            if name in self.small:
                out.append(torch.einsum("b,b...->...", weights, self.small[name]))
            else:
                out.append(
                    _cat([self.linear[k].weighted_sum(weights)[0] for k in self._parts(name)], 0)
                )
        return out

    def per_sample(self) -> list[torch.Tensor]:
        out = []
        for name, _ in self.named:
            if name in self.small:
                out.append(self.small[name])
            else:
                out.append(_cat([self.linear[k].per_sample()[0] for k in self._parts(name)], 1))
        return out


def _mha_projections(module: nn.MultiheadAttention, detach: bool = True):
    """(w_q, w_k, w_v, b_q, b_k, b_v) of a MultiheadAttention, packed or separate."""
    E = module.embed_dim
    d = (lambda t: t.detach()) if detach else (lambda t: t)
    if module._qkv_same_embed_dim:
        w = d(module.in_proj_weight)
        wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
    else:
        wq, wk, wv = d(module.q_proj_weight), d(module.k_proj_weight), d(module.v_proj_weight)
    b = d(module.in_proj_bias) if module.in_proj_bias is not None else None
    return (wq, wk, wv) + ((None, None, None) if b is None else (b[:E], b[E : 2 * E], b[2 * E :]))


def _mha_inputs(module: nn.MultiheadAttention, a: dict, dtype):
    """A recorded call's query, key and value batch first in ``dtype``, its masks in
    ``F.multi_head_attention_forward``'s float form (the causal mask SDPA used when the call
    took that path), and the batch size."""
    from privgrad.errors import PrivgradError

    bd = batch_dim(module)
    q_in, k_in, v_in = a["query"], a["key"], a["value"]
    B = q_in.shape[bd] if q_in.dim() == 3 else -1
    if q_in.dim() != 3 or any(t.dim() != 3 or t.shape[bd] != B for t in (q_in, k_in, v_in)):
        raise PrivgradError(
            f"MultiheadAttention was called on query/key/value of shapes {tuple(q_in.shape)}, "
            f"{tuple(k_in.shape)}, {tuple(v_in.shape)}: per-sample gradients need batched inputs "
            f"with the batch on axis {bd} (batch_first={module.batch_first})"
        )
    if bd:
        q_in, k_in, v_in = (t.transpose(0, 1) for t in (q_in, k_in, v_in))
    # in the parameters' precision (inputs recorded under autocast may be lower)
    q_in, k_in, v_in = (t.to(dtype) for t in (q_in, k_in, v_in))
    kpm, mask = _mha_masks(a, q_in.shape[1], k_in.shape[1], dtype, q_in.device)
    return q_in, k_in, v_in, kpm, mask, B


def _mha_masks(a: dict, L: int, S: int, dtype, device) -> tuple:
    """A call's key padding and attention masks (``a``: its arguments by name, as
    ``nn.MultiheadAttention.forward`` or ``F.multi_head_attention_forward`` take them) in
    ``F.multi_head_attention_forward``'s float form, for L queries and S keys: the causal
    mask SDPA used where the call took that path."""
    kpm = F._canonical_mask(
        mask=a["key_padding_mask"],
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(a["attn_mask"]),
        other_name="attn_mask",
        target_type=dtype,
    )
    mask = F._canonical_mask(
        mask=a["attn_mask"],
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=dtype,
        check_other=False,
    )
    if a["is_causal"] and kpm is None and not a["need_weights"]:
        # the forward took SDPA's own causal mask (the given one is only a hint)
        mask = torch.full((L, S), float("-inf"), dtype=dtype, device=device).triu(1)
    return kpm, mask


def _mha_attend(
    q, k, v, extra_k, extra_v, mask, kpm, H: int, add_zero_attn=False, p=0.0, drop=None
):
    """The attention of projected q (B, L, E), k and v (B, S, E) over ``H`` heads, as
    ``F.multi_head_attention_forward`` computes it (bias_k/bias_v as ``extra_k``/``extra_v``
    (B, 1, E), add_zero_attn, key padding and attention masks), before out_proj: (B, L, E).
    Dropout at rate ``p`` of the attention probabilities: ``drop`` a boolean keep-mask
    (B·heads, L, S') to replay (scaled by 1/(1 − p)), "draw" to draw one, or None for
    ``F.dropout``'s, as torch draws it; returns (output, probabilities (B·heads, L, S') after
    dropout, keep-mask or None)."""
    B, L, E = q.shape
    hd = E // H
    if extra_k is not None:
        k, v = torch.cat([k, extra_k], 1), torch.cat([v, extra_v], 1)
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None

    def heads(t):
        return t.reshape(B, t.shape[1], H, hd).transpose(1, 2).reshape(B * H, t.shape[1], hd)

    qh, kh, vh = heads(q), heads(k), heads(v)
    if add_zero_attn:
        zeros = kh.new_zeros(B * H, 1, hd)
        kh, vh = torch.cat([kh, zeros], 1), torch.cat([vh, zeros], 1)
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
    src = kh.shape[1]
    if mask is not None and mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if kpm is not None:
        kpm = kpm.view(B, 1, 1, src).expand(-1, H, -1, -1).reshape(B * H, 1, src)
        mask = kpm if mask is None else mask + kpm
    scores = torch.bmm(qh * hd**-0.5, kh.transpose(1, 2))
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, -1)
    if isinstance(drop, str):
        drop = torch.rand_like(probs) >= p
    if drop is not None:
        probs = probs * drop / (1 - p)
    elif p > 0:
        probs = F.dropout(probs, p)
    o = torch.bmm(probs, vh)
    return o.reshape(B, H, L, hd).transpose(1, 2).reshape(B, L, E), probs, drop


def _module_attend(module: nn.MultiheadAttention, q, k, v, mask, kpm, drop, leaves: bool):
    """:func:`_mha_attend` with ``module``'s heads, add_zero_attn and bias_k/bias_v (with
    ``leaves``: detached copies that require grad, for the rule's backward); attention
    dropout at the module's rate where ``drop`` is "draw" or a keep-mask to replay, none
    where it is None. Returns (output, keep-mask or None, the bias_k/bias_v tensors)."""
    B, E = q.shape[0], module.embed_dim
    extra = []
    if module.bias_k is not None:
        for b in (module.bias_k, module.bias_v):
            t = (b.detach() if leaves else b).reshape(1, 1, E).expand(B, 1, E)
            extra.append(t.clone().requires_grad_() if leaves else t)
    o, _, keep = _mha_attend(
        q,
        k,
        v,
        *(extra or (None, None)),
        mask,
        kpm,
        module.num_heads,
        module.add_zero_attn,
        0.0 if drop is None else module.dropout,
        drop,
    )
    return o, keep, extra


def replays_dropout(module: nn.Module) -> bool:
    """Whether the engine runs this layer's forward itself while recording: a
    MultiheadAttention in training with attention dropout, whose dropout mask the rule must
    replay (:func:`mha_forward_with_dropout`)."""
    return isinstance(module, nn.MultiheadAttention) and module.training and module.dropout > 0


def mha_forward_with_dropout(module: nn.MultiheadAttention, call: Call) -> torch.Tensor:
    """The output of a MultiheadAttention call with attention dropout in training, computed
    as the module computes it (same parameters, masks and dropout rate) but with a dropout
    mask drawn here and stored in the call (``call.arguments["_dropout_keep"]``) for
    :func:`mha_rule` to replay; the engine's hook returns it in place of the module's own
    output (whose mask no rule could see)."""
    a = call.arguments
    wq, wk, wv, bq, bk, bv = _mha_projections(module, detach=False)
    q_in, k_in, v_in, kpm, mask, _ = _mha_inputs(module, a, wq.dtype)
    q, k, v = F.linear(q_in, wq, bq), F.linear(k_in, wk, bk), F.linear(v_in, wv, bv)
    o, keep, _ = _module_attend(module, q, k, v, mask, kpm, "draw", leaves=False)
    a["_dropout_keep"] = keep
    out = F.linear(o, module.out_proj.weight, module.out_proj.bias)
    return out.transpose(0, 1) if batch_dim(module) else out


@takes_flags
@reads_calls
def mha_rule(
    module: nn.MultiheadAttention,
    calls: list[Call],
    grads: list[torch.Tensor],
    flags: EngineFlags = DEFAULT_FLAGS,
):
    """MultiheadAttention by book-keeping: from the recorded query, key, value and masks the
    attention is recomputed on the batch from its projections q, k, v (made leaves), as
    ``F.multi_head_attention_forward`` computes it (bias_k/bias_v, add_zero_attn, key padding
    and attention masks, causal); one batched backward of the output gradient through
    out_proj's weight gives each sample's gradients of q, k and v (attention never mixes
    samples), and every projection is then a linear layer applied at positions
    (:class:`AttentionGrads`). Attention dropout in training is replayed from the mask the
    engine drew in the forward (:func:`mha_forward_with_dropout`)."""
    if not all("_dropout_keep" in c.arguments for c in calls):
        _refuse_attention_dropout(module)
    E, bd = module.embed_dim, batch_dim(module)
    wq, wk, wv, bq, bk, bv = _mha_projections(module)
    has_in_bias = module.in_proj_bias is not None
    wo = module.out_proj.weight.detach()
    acts: dict[str, list] = {c: [] for c in ("q", "k", "v", "out_proj.weight")}
    small: dict[str, torch.Tensor] = {}

    def add(name, t):
        small[name] = small[name] + t if name in small else t

    for call, g in zip(calls, grads):
        a = call.arguments
        q_in, k_in, v_in, kpm, mask, B = _mha_inputs(module, a, wq.dtype)
        g = (g.transpose(0, 1) if bd else g).to(wq.dtype)
        with torch.enable_grad():
            q = F.linear(q_in, wq, bq).requires_grad_()
            k = F.linear(k_in, wk, bk).requires_grad_()
            v = F.linear(v_in, wv, bv).requires_grad_()
            keep = a.get("_dropout_keep")
            o, _, extra = _module_attend(module, q, k, v, mask, kpm, keep, leaves=True)
            leaves = [q, k, v, *extra]
            grads_qkv = torch.autograd.grad(o, leaves, g @ wo)
        for c, x, gx in zip("qkv", (q_in, k_in, v_in), grads_qkv):
            acts[c].append((x, gx))
        acts["out_proj.weight"].append((o.detach(), g))
        if has_in_bias:
            add("in_proj_bias", torch.cat([gx.sum(1) for gx in grads_qkv[:3]], 1))
        if module.bias_k is not None:
            add("bias_k", grads_qkv[3].reshape(B, 1, 1, E))
            add("bias_v", grads_qkv[4].reshape(B, 1, 1, E))
        if module.out_proj.bias is not None:
            add("out_proj.bias", g.sum(1))
    linear = {}
    for c, w in (("q", wq), ("k", wk), ("v", wv), ("out_proj.weight", wo)):
        name = c if module._qkv_same_embed_dim or c == "out_proj.weight" else f"{c}_proj_weight"
        linear[name] = LinearGrads(
            _Weight(w),
            _cat([x for x, _ in acts[c]], 1),
            _cat([gx for _, gx in acts[c]], 1),
            w.shape,
            flags,
        )
    return AttentionGrads(module, linear, small)


# Layers that call torch's ``F.multi_head_attention_forward`` on their children's weights
# (``use_separate_proj_weight``) instead of calling those children: by qualified type name,
# the Linear children that project the query, key and value, and the output. While the
# engine records, that call is computed by :func:`projected_attention`.
ATTENTION_CHILDREN: dict[str, tuple[str, str, str, str]] = {
    "transformers.models.wavlm.modeling_wavlm.WavLMAttention": (
        "q_proj",
        "k_proj",
        "v_proj",
        "out_proj",
    ),
}


def attention_children(module: nn.Module) -> tuple[nn.Module, ...]:
    """The Linear children whose weights ``module``'s forward passes to
    ``F.multi_head_attention_forward`` (:data:`ATTENTION_CHILDREN`): its query, key, value and
    output projections; () for most layers."""
    names = ATTENTION_CHILDREN.get(_qualified_name(type(module)), ())
    return tuple(getattr(module, n) for n in names)


def projected_attention(name: str, children: tuple, args: tuple, kwargs: dict):
    """``F.multi_head_attention_forward(*args, **kwargs)``, called by layer ``name`` on the
    weights of its ``children`` (:func:`attention_children`), with each projection a call of
    its child on the batch (batch first), so that the engine records it as any Linear's; the
    attention between them is computed on the batch as torch computes it (examples apart, its
    dropout the same draws of ``F.dropout``). Returns (output, weights) as torch does; a call
    that reads anything else of its own (bias_k, static keys, in_proj_bias other than the
    children's biases) is refused."""
    from privgrad.errors import PrivgradError

    import inspect

    bound = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    q_proj, k_proj, v_proj, out_proj = children
    biases = [c.bias for c in (q_proj, k_proj, v_proj)]
    if any(b is None for b in biases):
        bias_ok = a["in_proj_bias"] is None and all(b is None for b in biases)
    else:
        bias_ok = a["in_proj_bias"] is not None and torch.equal(
            a["in_proj_bias"], torch.cat(biases)
        )
    if not (
        a["use_separate_proj_weight"]
        and a["q_proj_weight"] is q_proj.weight
        and a["k_proj_weight"] is k_proj.weight
        and a["v_proj_weight"] is v_proj.weight
        and a["out_proj_weight"] is out_proj.weight
        and a["out_proj_bias"] is out_proj.bias
        and bias_ok
        and a["bias_k"] is None
        and a["bias_v"] is None
        and not a["add_zero_attn"]
        and a["static_k"] is None
        and a["static_v"] is None
        and a["query"].dim() == 3
    ):
        raise PrivgradError(
            f"layer '{name}' calls F.multi_head_attention_forward otherwise than on its "
            "children's projections alone (use_separate_proj_weight, in_proj_bias their "
            "biases, no bias_k/bias_v, add_zero_attn or static keys, batched inputs): no "
            "per-sample rule reads that call"
        )
    q = q_proj(a["query"].transpose(0, 1))
    k = k_proj(a["key"].transpose(0, 1))
    v = v_proj(a["value"].transpose(0, 1))
    kpm, mask = _mha_masks(a, q.shape[1], k.shape[1], a["query"].dtype, q.device)
    H, p = a["num_heads"], a["dropout_p"] if a["training"] else 0.0
    o, probs, _ = _mha_attend(q, k, v, None, None, mask, kpm, H, p=p)
    out = out_proj(o).transpose(0, 1).contiguous()  # (L, B, E) in memory too, as torch's
    if not a["need_weights"]:
        return out, None
    weights = probs.view(q.shape[0], H, *probs.shape[1:])
    return out, weights.mean(1) if a["average_attn_weights"] else weights


@reads_calls
def embedding_bag_rule(module: nn.EmbeddingBag, calls: list[Call], grads: list[torch.Tensor]):
    """EmbeddingBag, mode sum or mean, bags from a 2-D input or from offsets, with
    per_sample_weights (mode sum): sample i's gradient is Σ_{j ∈ bag i} c_j onehot(x_j) g_iᵀ,
    c_j = per_sample_weights_j (sum), 1 (sum) or 1/|bag i| (mean), 0 for padding_idx, so the
    bag's tokens become a padded sequence of the Embedding rule (norms from token matches,
    never materialised; the sum by index_add)."""
    from privgrad.errors import PrivgradError

    if module.mode not in ("sum", "mean"):
        raise PrivgradError(
            f"EmbeddingBag mode='{module.mode}' has no per-sample rule; use mode 'sum' or 'mean'"
        )
    idxs, toks = [], []
    for call, g in zip(calls, grads):
        a = call.arguments
        x, offsets, psw = a["input"], a["offsets"], a["per_sample_weights"]
        B = g.shape[0]
        valid = torch.ones(x.shape, dtype=g.dtype, device=g.device)
        if module.padding_idx is not None:
            valid = valid * (x != module.padding_idx)
        coef = valid if psw is None else valid * psw
        if x.dim() == 2:
            if x.shape[0] != B:
                raise PrivgradError(
                    f"EmbeddingBag was called on an input of shape {tuple(x.shape)} "
                    f"for a batch of {B}"
                )
            idx = x
        else:
            starts = offsets[:-1] if module.include_last_offset else offsets
            if starts.numel() != B:
                raise PrivgradError(
                    f"EmbeddingBag was called with {starts.numel()} bags for a batch of {B}: "
                    "per-sample gradients need one bag per example"
                )
            end = (
                offsets[-1]
                if module.include_last_offset
                else torch.tensor(x.numel(), device=x.device)
            )
            lengths = torch.diff(starts, append=end.reshape(1))
            n = int(end)
            bag = torch.repeat_interleave(torch.arange(B, device=x.device), lengths)
            pos = torch.arange(n, device=x.device) - starts[bag]
            T = int(lengths.max()) if B else 0
            idx = x.new_zeros(B, T)
            idx[bag, pos] = x[:n]
            padded = coef.new_zeros(B, T)
            padded[bag, pos] = coef[:n]
            coef = padded
        if (
            module.mode == "mean"
        ):  # (no per_sample_weights): over the bag's tokens other than padding_idx
            coef = coef / (coef != 0).sum(1, keepdim=True).clamp(min=1)
        idxs.append(idx)
        toks.append(coef.unsqueeze(-1) * g.unsqueeze(1))  # (B, T, D): each token's share
    layer = EmbeddingGrads.__new__(EmbeddingGrads)
    layer.params = [module.weight]
    layer.idx, layer.g = _cat(idxs, 1), _cat(toks, 1)
    layer.num, layer.dim = module.weight.shape
    return layer


@reads_calls
def vit_embeddings_rule(module: nn.Module, calls: list[Call], grads: list[torch.Tensor]):
    """Hugging Face's ``ViTEmbeddings``: the parameters it holds itself, the [CLS] token,
    the position embeddings and the mask token (its patch projection is a Conv2d, a layer of
    its own). Its output is [cls; patches, each masked one replaced by the mask token] +
    positions (then dropout), so sample i's gradients are its output gradient's first row
    (cls), the whole of it (positions) and Σ_t m_{i,t} g_{i,1+t} over its masked patches
    (mask token). Refused where that does not hold: dropout in training (its mask is not
    recorded) and position embeddings interpolated to another image size."""
    from privgrad.errors import PrivgradError

    if module.dropout.training and module.dropout.p > 0:
        raise PrivgradError(
            f"ViTEmbeddings with dropout p={module.dropout.p} in training: its dropout mask is "
            "not recorded, so its per-sample gradients cannot be formed; set the embeddings' "
            "dropout.p to 0 (model.vit.embeddings.dropout.p = 0 keeps the encoder's dropouts, "
            "which train; hidden_dropout_prob=0.0 in the config turns them all off)"
        )
    named = dict(module.named_parameters(recurse=False))
    dtype = module.position_embeddings.dtype
    B, _, D = grads[0].shape
    out = {n: grads[0].new_zeros(B, *p.shape, dtype=dtype) for n, p in named.items()}
    for call, g in zip(calls, grads):
        a, g = call.arguments, g.to(dtype)
        height, width = a["pixel_values"].shape[-2:]
        if a["interpolate_pos_encoding"] and not (
            g.shape[1] == module.position_embeddings.shape[1] and height == width
        ):
            raise PrivgradError(
                "ViTEmbeddings with interpolate_pos_encoding=True on images of another size "
                f"({height}×{width}) than the model's has no per-sample rule"
            )
        out["cls_token"] += g[:, :1].unsqueeze(1)
        out["position_embeddings"] += g.unsqueeze(1)
        masked = a["bool_masked_pos"]
        if "mask_token" in out and masked is not None:
            m = masked.reshape(B, -1).to(dtype)
            out["mask_token"] += torch.einsum("bt,btd->bd", m, g[:, 1:]).view(B, 1, 1, D)
    return MaterializedGrads(list(named.values()), list(out.values()))


@takes_flags
def generic_rule(module: nn.Module, inputs, grads, flags: EngineFlags = DEFAULT_FLAGS):
    """Any layer that treats samples independently: the layer's own VJP on each example, on
    its one input or, for a call with several arguments (a :class:`Replay`), on the arguments
    that carry the batch, the others shared; by vmap or one example at a time
    (``EngineFlags.replay_form``)."""
    named = layer_named_params(module)
    names = [n for n, _ in named]
    params = {n: p.detach() for n, p in named}

    def sample_loss(call, p, batched, g):
        return (call.replay(module, p, batched) * g.unsqueeze(0)).sum()

    form = flags.replay_form
    if form == "auto":
        on_cuda = any(p.is_cuda for p in params.values())
        form = "loop" if read_children(module) and not on_cuda else "vmap"
    if form == "loop":
        per_sample = partial(_looped_grads, sample_loss)
    else:
        per_sample = torch.func.vmap(
            torch.func.grad(sample_loss, argnums=1), in_dims=(None, None, 0, 0)
        )
    per_call = []
    for x, g in zip(inputs, grads):
        call = x if isinstance(x, Replay) else Replay((x,), {}, frozenset({0}))
        batched = {k: v for k, v in call.tensors().items() if k in call.batched}
        try:
            per_call.append(per_sample(call, params, batched, g))
        except Exception as e:  # noqa: BLE001 (the layer's own code, replayed: any failure)
            from privgrad.errors import PrivgradError

            if isinstance(e, PrivgradError):
                raise

            head = (
                f"{type(module).__name__} has parameters of its own and no per-sample rule: "
                "the generic rule replays its forward one example at a time"
            )
            if "randomness" in str(e):
                raise PrivgradError(
                    f"{head}, and its forward draws random numbers in training (dropout), "
                    "which a replay cannot draw alike; set its dropout to 0, or give it a rule "
                    "(privgrad.per_sample.register_rule)"
                ) from e
            raise PrivgradError(
                f"{head}, and the replay failed ({type(e).__name__}: {e}): an argument that "
                "is not a tensor may hold state of the whole batch (a cache: build the model "
                "with use_cache=False), or the layer cannot run on one example; give it a "
                "rule (privgrad.per_sample.register_rule)"
            ) from e
    total = {n: _total(c[n] for c in per_call) for n in names}
    return MaterializedGrads([p for _, p in named], [total[n] for n in names])


class _RandomReplay(RuntimeError):
    """Raised by :func:`_looped_grads` with vmap's word for it ("randomness"), so that the
    generic rule refuses it alike."""


def _looped_grads(sample_loss, call, params: dict, batched: dict, g: torch.Tensor) -> dict:
    """The generic rule's per-example gradients by autograd on each example in turn (what
    ``vmap(grad(sample_loss))`` returns); a forward that drew random numbers is refused, as
    vmap refuses it: its draws could not be those of the recorded forward."""
    leaves = [v for v in (*params.values(), g) if isinstance(v, torch.Tensor)]
    devices = {v.device for v in leaves if v.is_cuda}
    before = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
    out = {n: [] for n in params}
    with torch.enable_grad():
        for i in range(g.shape[0]):
            p = {n: v.detach().requires_grad_() for n, v in params.items()}
            loss = sample_loss(call, p, {k: v[i] for k, v in batched.items()}, g[i])
            got = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
            for (n, v), d in zip(p.items(), got):
                out[n].append(torch.zeros_like(v) if d is None else d)
    after = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
    if not torch.equal(before[0], after[0]) or any(
        not torch.equal(a, b) for a, b in zip(before[1], after[1])
    ):
        raise _RandomReplay("the replay drew random numbers (randomness)")
    return {n: torch.stack(v) for n, v in out.items()}


RULES: dict[type, Callable] = {
    nn.Linear: linear_rule,
    nn.Conv2d: conv_rule,
    nn.Embedding: embedding_rule,
    nn.GroupNorm: norm_layer_rule,
    nn.LayerNorm: norm_layer_rule,
    nn.Conv1d: conv1d_rule,
    nn.Conv3d: conv3d_rule,
    nn.ConvTranspose1d: conv_transpose1d_rule,
    nn.ConvTranspose2d: conv_transpose2d_rule,
    nn.ConvTranspose3d: conv_transpose3d_rule,
    nn.RMSNorm: rms_norm_rule,
    nn.InstanceNorm1d: instance_norm_rule,
    nn.InstanceNorm2d: instance_norm_rule,
    nn.InstanceNorm3d: instance_norm_rule,
    nn.PReLU: prelu_rule,
    nn.MultiheadAttention: mha_rule,
    nn.EmbeddingBag: embedding_bag_rule,
}


# Rules for the layers of optional libraries, by their type's qualified name (module and
# class), so that privgrad never imports those libraries: Hugging Face's transformers.
NAMED_RULES: dict[str, Callable] = {
    "transformers.pytorch_utils.Conv1D": transposed_linear_rule,
    "transformers.models.vit.modeling_vit.ViTEmbeddings": vit_embeddings_rule,
    **{
        f"transformers.models.{name}": hf_rms_norm_rule
        for name in (
            "llama.modeling_llama.LlamaRMSNorm",
            "mistral.modeling_mistral.MistralRMSNorm",
            "qwen2.modeling_qwen2.Qwen2RMSNorm",
            "gemma.modeling_gemma.GemmaRMSNorm",
            "t5.modeling_t5.T5LayerNorm",
        )
    },
}


def _qualified_name(layer_type: type) -> str:
    return f"{layer_type.__module__}.{layer_type.__qualname__}"


class _RuleTable(dict):
    """:data:`RULES`: a layer type's rule, by the type itself or, for a layer of an optional
    library, by its qualified name in :data:`NAMED_RULES` (a type registered with
    :func:`register_rule` comes first)."""

    def __missing__(self, layer_type):
        rule = None
        if isinstance(layer_type, type):
            rule = self._named(layer_type) or self._inherited(layer_type)
        if rule is None:
            raise KeyError(layer_type)
        return rule

    @staticmethod
    def _named(layer_type: type) -> Callable | None:
        """The rule of an optional library's layer type, by its qualified name
        (:data:`NAMED_RULES`, Hugging Face's experts)."""
        from privgrad.per_sample.experts import NAMED_EXPERTS, experts_rule, is_hf_experts

        name = _qualified_name(layer_type)
        rule = NAMED_RULES.get(name) or NAMED_EXPERTS.get(name)
        return experts_rule if rule is None and is_hf_experts(layer_type) else rule

    def _inherited(self, layer_type: type) -> Callable | None:
        """The rule of the layer type ``layer_type`` subclasses, where every class between them
        only configures it (no method but ``__init__``, ``reset_parameters`` or
        ``extra_repr``): its forward is the base's (Hugging Face EfficientNet's depthwise
        ``Conv2d``). A class that defines a forward, or any other method, gets none."""
        for i, base in enumerate(layer_type.__mro__[1:], start=1):
            rule = dict.get(self, base)
            if rule is not None:
                configures = all(configures_only(c) for c in layer_type.__mro__[:i])
                return rule if configures else None
        return None

    def get(self, layer_type, default=None):
        try:
            return self[layer_type]
        except KeyError:
            return default

    def __contains__(self, layer_type) -> bool:
        return self.get(layer_type) is not None


RULES = _RuleTable(RULES)


# the methods a subclass may define and still take its base layer's rule
# (_RuleTable._inherited); any other method, property or descriptor of its own refuses it
_CONFIGURING = {"__init__", "reset_parameters", "extra_repr", "__dict__", "__weakref__"}


def configures_only(cls: type) -> bool:
    """No attribute of ``cls`` but :data:`_CONFIGURING` is a method, a descriptor or any other
    callable: a callable without ``__get__`` (a ``functools.partial``, a callable object) set
    as ``forward`` or ``_conv_forward`` is called as the layer's computation all the same."""
    return all(
        name in _CONFIGURING or not (hasattr(value, "__get__") or callable(value))
        for name, value in vars(cls).items()
    )


def instance_overrides(module: nn.Module) -> list[str]:
    """The names of the callables ``module`` holds as its own attributes in place of its
    class's (``self.forward = ...``, in ``__init__`` or later): they, not the class's code, run
    when it is called, so the rule of its class, or one inherited for it
    (:meth:`_RuleTable._inherited`), does not hold for it. accelerate's device hook (a
    ``forward`` that moves tensors around the class's own, ``_old_forward``) is not one."""
    hooked = hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")
    return [
        name
        for name, value in vars(module).items()
        if callable(value)
        and not isinstance(value, nn.Module)
        and hasattr(type(module), name)
        and not (hooked and name == "forward")
    ]


def row_wise(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module``'s rule treats every axis between the batch and the features as
    positions, so that its input ``x`` may be rows of examples flattened with their positions,
    (B·T, d), the same layer call as (B, T, d): Linear, LayerNorm, RMSNorm (Hugging Face's
    too), Hugging Face's Conv1D, and Embedding on one axis of ids, (B·T,) (not T5's
    (length × length) table of relative positions); by their rules, not subclasses with rules
    of their own. Not
    GroupNorm, whose channels are axis 1: (B, T, C) would normalize T as channels."""
    rule = RULES.get(type(module))
    if rule is embedding_rule:
        return x.dim() == 1
    if isinstance(module, nn.GroupNorm):
        return False
    return rule in (
        linear_rule,
        norm_layer_rule,
        rms_norm_rule,
        hf_rms_norm_rule,
        transposed_linear_rule,
    )


def _owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


# Layers refused by type, checked on every module of a model (trainable or frozen, with or
# without parameters): the first entry whose types match and whose condition holds gives
# the reason. Batch mixers are refused whatever their parameters, because DP-SGD's
# sensitivity assumes every example's gradient depends on that example alone; anything not
# listed here is checked by the probe of privgrad.per_sample.independence.
REFUSED: tuple[tuple[tuple[type, ...], Callable[[nn.Module], bool], str], ...] = (
    # every BatchNorm (1d/2d/3d, Lazy*, SyncBatchNorm), trainable, frozen or affine=False
    (
        (nn.modules.batchnorm._BatchNorm,),
        lambda m: True,
        "BatchNorm mixes the examples of a batch (train mode normalizes by batch statistics, and "
        "its running averages are released unnoised), so one example moves the others' "
        "gradients; use GroupNorm or LayerNorm (privgrad.layers.replace_batch_norm(model) "
        "swaps every BatchNorm for a GroupNorm)",
    ),
    # InstanceNorm (and any other _NormBase) with running statistics
    (
        (nn.modules.batchnorm._NormBase,),
        lambda m: bool(getattr(m, "track_running_stats", False)),
        "track_running_stats=True averages statistics over the batch in train mode and releases "
        "them with the model unnoised; use track_running_stats=False, GroupNorm or LayerNorm",
    ),
    (
        (nn.Embedding, nn.EmbeddingBag),
        lambda m: m.sparse,
        "sparse=True gives sparse gradients, which have no per-sample rule; use sparse=False",
    ),
    (
        (nn.Embedding, nn.EmbeddingBag),
        lambda m: m.max_norm is not None,
        "max_norm renormalizes, in place and without noise, the rows a batch looks up (which "
        "tokens were trained on shows in the weights); use max_norm=None",
    ),
    (
        (nn.RNNBase,),
        _owns_trainable,
        "torch's fused RNN layers have no per-sample gradient rule; use "
        "privgrad.app.models.text.DPLSTM(input_size, hidden_size, bidirectional=False), an LSTM "
        "of linear cells (batch-first; returns the output sequence only)",
    ),
    (
        (nn.Module,),
        lambda m: (
            _qualified_name(type(m))
            == "transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeTop2Router"
        ),
        "NLLB-MoE's router drops the tokens past an expert's capacity, counted over the whole "
        "batch's tokens, so one example decides whether another's tokens reach their experts "
        "(make_private's check sees it only when its few examples fill an expert)",
    ),
    (
        (torch.ao.quantization.FakeQuantizeBase,),
        lambda m: bool(getattr(m, "observer_enabled", torch.ones(1))[0]),
        "quantization-aware training's observers record value ranges in buffers (the "
        "activations' from the batch), released with the model unnoised; disable them "
        "(model.apply(torch.ao.quantization.disable_observer), with ranges from public data) "
        "or quantize after private training",
    ),
    (
        (nn.LSTMCell,),
        _owns_trainable,
        "torch's LSTMCell returns (h, c), and per-sample rules follow a layer's first output "
        "only; write the cell's gates as two nn.Linear layers (input and hidden projections, "
        "as privgrad.app.models.text.LSTMDirection does), or use DPLSTM for a whole sequence",
    ),
    # torch.compile(m) (an OptimizedModule) and m.compile(): untried, as torch failed on the
    # second backward of make_private's check ('donated buffers')
    (
        (nn.Module,),
        lambda m: (
            type(m).__module__.startswith("torch._dynamo")
            or getattr(m, "_compiled_call_impl", None) is not None
        ),
        "torch.compile'd: privgrad records each layer's call with Python hooks, which "
        "torch.compile traces instead of running as written; pass the model uncompiled "
        "(torch.compile(m)'s m is its ._orig_mod)",
    ),
)


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` is refused by type (an entry of :data:`REFUSED`), or None."""
    for types, applies, reason in REFUSED:
        if isinstance(module, types) and applies(module):
            return reason
    return None


def register_read_children(layer_type: type, children: tuple[str, ...]) -> None:
    """Declare that ``layer_type``'s forward reads the parameters of its ``children`` (names of
    its attributes) directly, as ``F.conv1d(x, self.conv1d.weight)``, instead of calling them:
    the generic rule then replays its forward for its own parameters and theirs. Without
    this, make_private's check refuses such a model (the children's gradients are not the
    sum of their per-sample gradients, which their calls would have recorded)."""
    if isinstance(children, str) or not all(isinstance(c, str) for c in children):
        raise TypeError(f"children must be a tuple of attribute names, got {children!r}")
    _READ_CHILDREN_BY_TYPE[layer_type] = tuple(children)


def register_rule(layer_type: type, rule: Callable, *, fast_views: bool = False) -> None:
    """Teach the engine a new layer type (e.g. a block-circulant linear layer): ``rule(module,
    inputs, output_grads)`` returns a :class:`LayerGrads` (or None for the generic rule); a
    rule marked with :func:`takes_flags` also gets the engine's flags as ``flags=``.

    By default only the rule's ``per_sample()`` is used: the norms that clip and the clipped
    sum are both taken from those built tensors (:class:`BuiltViews`), so each example adds
    at most C whatever the rule computes. A rule's own ``norms_sq`` and ``weighted_sum``
    (ghost norms, book-kept sums) are used with ``fast_views=True`` only, under this contract:
    for every input, as computed in float32, ``norms_sq()[i]`` is at least the squared norm
    of what ``weighted_sum(w)`` adds for example i at w_i = 1 (privgrad's own rules keep it
    with :func:`guarded_norms_sq` where terms can cancel). ``make_private``'s probe checks
    it on its examples and refuses a rule whose norms fall short there; it cannot see
    crafted inputs. A rule whose norms left out its bias's part (fast views) let one example
    move the clipped sum by 1,414 C."""
    RULES[layer_type] = rule if fast_views else _built_views(rule)


def _built_views(rule: Callable) -> Callable:
    """``rule`` with its :class:`LayerGrads` wrapped in :class:`BuiltViews` (its marks kept)."""

    @wraps(rule)
    def built(*args, **kwargs):
        layer = rule(*args, **kwargs)
        return None if layer is None else BuiltViews(layer)

    return built


class BuiltViews(LayerGrads):
    """A registered rule's per-sample gradients, with the norms and the weighted sum both
    computed from its built ``per_sample()`` tensors (:class:`LayerGrads`' own forms): the
    clipped sum adds w_i times the very tensor whose norm set w_i, so an example adds at most
    C up to float32 rounding of C, whether or not the rule's own views agree."""

    def __init__(self, inner: LayerGrads):
        self.inner, self.params, self.flags = inner, inner.params, inner.flags
        self._built: list[torch.Tensor] | None = None

    def settle(self) -> None:
        self.inner.settle()

    def per_sample(self) -> list[torch.Tensor]:
        if self._built is None:
            self._built = list(self.inner.per_sample())
        return self._built
