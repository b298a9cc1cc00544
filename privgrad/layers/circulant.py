"""Block-circulant linear layer (CirCNN; Spectral-DP §3.3, Eqs. 6–8; GReDP Eqs. 17–20).

The weight matrix W ∈ R^{m×n} is a p×q grid of circulant d×d blocks, p = ⌈m/d⌉,
q = ⌈n/d⌉. Block (i, j) is defined by one length-d vector w_ij, its *first column*
(the convention of the Spectral-DP code): C_ij[r, s] = w_ij[(r − s) mod d], so that
C_ij x_j = w_ij ⊛ x_j (circular convolution) and, with unnormalised DFTs,

    Eq. 6:  y_i = Σ_j IDFT(DFT(w_ij) ⊙ DFT(x_j)).

The paper's text defines blocks by their first row; that is the same family of matrices
with w reversed, so only the parametrisation differs.

Sizes not divisible by d are zero-padded: the input is padded with zeros to q·d and the
output cropped to its first m entries. The dense equivalent is therefore the top-left
m×n corner of the (p·d)×(q·d) block matrix (:meth:`BlockCirculantLinear.dense_weight`).

Gradient (Eqs. 7–8): ∂L/∂w_ij is the circular *correlation* of ∂L/∂y_i and x_j,
DFT(∂L/∂w_ij) = DFT(∂L/∂y_i) ⊙ conj(DFT(x_j)) (the papers omit the conjugate). The
per-sample rule below uses exactly this, summed over positions for sequence inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.per_sample.rules import LayerGrads, guarded_norms_sq, register_rule, sq_norms


def _half_weights(d: int, device=None) -> torch.Tensor:
    """Weights that turn a sum over the rfft half-spectrum into one over all d bins."""
    w = torch.full((d // 2 + 1,), 2.0, device=device)
    w[0] = 1.0
    if d % 2 == 0:
        w[-1] = 1.0
    return w


def _power(z: torch.Tensor) -> torch.Tensor:
    """Σ_c |z_c|² over dim 1 of a complex (B, C, ...) tensor: the squares of its real view
    summed over c first, then Re² + Im² (no complex temporary of |z_c|²)."""
    r = torch.view_as_real(z).square().sum(1)
    return r[..., 0] + r[..., 1]


def _rfft(t: torch.Tensor) -> torch.Tensor:
    """rfft along the last axis; an empty batch (a valid Poisson draw) gives an empty result."""
    if t.numel() == 0:
        return torch.zeros(
            *t.shape[:-1],
            t.shape[-1] // 2 + 1,
            device=t.device,
            dtype=torch.complex128 if t.dtype == torch.float64 else torch.complex64,
        )
    return torch.fft.rfft(t, dim=-1)


class BlockCirculantLinear(nn.Module):
    """y = W x + b with W block-circulant: ``weight`` has shape (p, q, d), p·q·d parameters.

    Forward by rfft along the block axis (exact autograd backward through torch.fft).
    Initialisation U(±1/√n), the variance of ``nn.Linear`` of the same shape (the
    Spectral-DP code uses U(±1/√q), d× larger variance). The papers' layers have no bias;
    ``bias=True`` adds an ordinary one.
    """

    def __init__(self, in_features: int, out_features: int, block_size: int, bias: bool = True):
        super().__init__()
        if min(in_features, out_features, block_size) < 1:
            raise PrivgradError(
                "BlockCirculantLinear needs positive in_features, out_features and block_size"
            )
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.p, self.q = math.ceil(out_features / block_size), math.ceil(in_features / block_size)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(self.p, self.q, block_size).uniform_(-bound, bound))
        self.bias = (
            nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias else None
        )

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) → (..., q, d), zero-padded."""
        pad = self.q * self.block_size - self.in_features
        x = F.pad(x, (0, pad)) if pad else x
        return x.reshape(*x.shape[:-1], self.q, self.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise PrivgradError(
                f"BlockCirculantLinear expects {self.in_features} input features, got {x.shape[-1]}"
            )
        d, lead = self.block_size, x.shape[:-1]
        xf = torch.fft.rfft(self.blocks(x).reshape(-1, self.q, d), dim=-1)  # (N, q, h)
        wf = torch.fft.rfft(self.weight, dim=-1)  # (p, q, h)
        yf = torch.bmm(xf.permute(2, 0, 1), wf.permute(2, 1, 0)).permute(1, 2, 0)  # (N, p, h)
        y = torch.fft.irfft(yf, n=d, dim=-1).reshape(*lead, self.p * d)[..., : self.out_features]
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The equivalent dense (out_features × in_features) matrix (for tests and inspection)."""
        d = self.block_size
        r = torch.arange(d)
        idx = (r[:, None] - r[None, :]) % d  # C[r,s] = w[(r-s) mod d]
        blocks = self.weight[:, :, idx]  # (p, q, d, d)
        full = blocks.permute(0, 2, 1, 3).reshape(self.p * d, self.q * d)
        return full[: self.out_features, : self.in_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block_size={self.block_size}, bias={self.bias is not None}"
        )


class CirculantGrads(LayerGrads):
    """Per-sample gradients of a :class:`BlockCirculantLinear`: a (B,T,n), g (B,T,m).

    ``per_sample()`` gives the block vectors' gradients (B, p, q, d) (and the bias's
    (B, m)). Norms use Parseval per bin when T = 1:
    ‖∇w‖² = (1/d) Σ_k (Σ_i |G_i(k)|²)(Σ_j |A_j(k)|²), never forming (B, p, q, d).
    """

    def __init__(self, module: BlockCirculantLinear, a: torch.Tensor, g: torch.Tensor):
        self.module = module
        self.params = [module.weight] + ([module.bias] if module.bias is not None else [])
        self.a, self.g = a, g
        self._spectra: tuple[torch.Tensor, torch.Tensor] | None = None

    def spectra(self) -> tuple[torch.Tensor, torch.Tensor]:
        """rfft of the padded input blocks (B,T,q,h) and output-gradient blocks (B,T,p,h),
        computed once (the norms and the clipped sum both use them)."""
        if self._spectra is None:
            m, d = self.module, self.module.block_size
            pad = m.p * d - m.out_features
            g = F.pad(self.g, (0, pad)) if pad else self.g
            self._spectra = _rfft(m.blocks(self.a)), _rfft(g.reshape(*g.shape[:-1], m.p, d))
        return self._spectra

    def weight_norms_sq(self) -> torch.Tensor:
        """‖∂L/∂w‖² per sample (all blocks), from the spectra when T = 1."""
        if self.a.shape[1] != 1:
            return sq_norms(self.per_sample()[0])
        A, G = self.spectra()
        d = self.module.block_size
        per_bin = _power(A[:, 0]) * _power(G[:, 0])  # (B, h)
        return (per_bin * _half_weights(d, per_bin.device)).sum(1) / d

    def norms_sq(self) -> torch.Tensor:
        """At one position, from the spectra the sum is formed from; at T > 1 from the built
        gradients, while the sum adds the positions' spectral products (and the bias's rows)
        in another order, so at least :meth:`magnitudes` / K (:func:`guarded_norms_sq`):
        ±2³⁴ alternating inputs along 34 positions moved the clipped sum by 5 C."""
        w = self.weight_norms_sq()
        if self.module.bias is not None:
            w = w + sq_norms(self.g.sum(1))
        return w if self.a.shape[1] == 1 else guarded_norms_sq(w, self.magnitudes())

    def magnitudes(self) -> torch.Tensor:
        """Σ_t ‖∇w_{i,t}‖, each position's own gradient norm by Parseval per bin (as
        :meth:`weight_norms_sq` at T = 1), with a bias √(that² + (Σ_t ‖g_{i,t}‖)²): the scale
        of the rounding of the positions' sum (U/‖∇‖ ≈ √T for unrelated positions)."""
        A, G = self.spectra()
        B, T, d = A.shape[0], A.shape[1], self.module.block_size
        per_bin = _power(A.flatten(0, 1)) * _power(G.flatten(0, 1))  # (B·T, h)
        per_t = (per_bin * _half_weights(d, per_bin.device)).sum(1) / d
        u = per_t.clamp(min=0).sqrt().view(B, T).sum(1)
        if self.module.bias is not None:
            u = torch.sqrt(u.square() + torch.linalg.vector_norm(self.g, dim=2).sum(1).square())
        return u

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        A, G = self.spectra()
        d, h = self.module.block_size, A.shape[-1]
        Gw = G * weights.to(G.real.dtype)[:, None, None, None]
        # Σ_{b,t} G[b,t,i,k] conj(A[b,t,j,k]) for each bin k: one batched matmul over bins
        s = torch.bmm(
            Gw.reshape(-1, G.shape[2], h).permute(2, 1, 0),
            A.conj().reshape(-1, A.shape[2], h).permute(2, 0, 1),
        )  # (h, p, q)
        out = [torch.fft.irfft(s.permute(1, 2, 0), n=d, dim=-1)]
        if self.module.bias is not None:
            out.append((self.g * weights[:, None, None]).sum((0, 1)))
        return out

    def per_sample(self) -> list[torch.Tensor]:
        A, G = self.spectra()
        d = self.module.block_size
        s = torch.einsum("btik,btjk->bijk", G, A.conj())
        out = [torch.fft.irfft(s, n=d, dim=-1)]
        if self.module.bias is not None:
            out.append(self.g.sum(1))
        return out


def _as_sequence(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def circulant_rule(module: BlockCirculantLinear, inputs, grads):
    """Per-sample rule; several calls of the module in one forward become more positions."""
    a = torch.cat([_as_sequence(x) for x in inputs], 1)
    g = torch.cat([_as_sequence(x) for x in grads], 1)
    return CirculantGrads(module, a, g)


register_rule(BlockCirculantLinear, circulant_rule, fast_views=True)  # guarded norms
