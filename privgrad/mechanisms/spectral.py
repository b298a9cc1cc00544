"""Spectral-DP (Feng et al., S&P 2023) and GReDP (Wang et al.): per-sample gradients in
the frequency domain.

Chains (one noise draw per step, on the sum)::

    spectral-dp : SpectralTransform → ClipPerLayer → Sum → SpectralNoise → SpectralFilter
                  → InverseSpectral → ÷B            (Spectral-DP Algs. 2–4)
    gredp       : SpectralTransform → ClipPerLayer → Sum → SpectralNoise(CN)
                  → InverseSpectral → ÷B            (GReDP Alg. 2, Eqs. 10–13)

**Spectral objects.** All transforms are unitary (``norm="ortho"``; Spectral-DP Alg. 1,
GReDP Eqs. 9/12), so by Parseval the norm of a spectrum is the norm of its real signal.

* Conv2d (Spectral-DP Eq. 5, GReDP Eqs. 15–16): the spectrum of the *full linear
  correlation* between the zero-padded input (n per axis) and the output gradient
  (m per axis; with stride s, zero-upsampled to m' = s(m−1)+1), of size
  M = n + m' − 1 per axis (ERRATA; 65 for a 32×32 input and a 3×3 'same' conv). As in the
  Spectral-DP code the object is R = flip(x_pad) * δ (linear convolution), whose unitary
  spectrum is Z = F_ortho[flip(x_pad)] ⊙ F[δ]; the kernel gradient is
  ∇W[a] = R[n − 1 − dilation·a] ("centre crop, then flip back"). R holds every
  correlation lag, so its norm is *larger* than the kernel gradient's: clipping it is
  harsher than DP-SGD's (a utility matter, spectral-dp.md §3a).
* BlockCirculantLinear (Spectral-DP Eqs. 7–8, GReDP Eqs. 19–20): the length-d unitary
  spectrum of each block vector's gradient, no padding, no crop.
* Any other parameter (biases, nn.Linear, norms, convs the conv rule does not cover) is
  kept in the identity basis. A layer's bias is clipped *together with* its weight
  spectrum (one object per layer, so L is the number of layers, as in describe()).
* A conv layer's spectral space depends on its input size. Gradients that arrive in the
  parameter domain for a layer whose geometry is known (an empty Poisson batch, injected
  canaries) are embedded in that space (a correlation map supported on the kernel lags),
  so a step's noise distribution never depends on whether it held data.

**Norm and noise.** A spectrum is a full complex array (not an rfft half) read as a vector
of R^{2N} (Re, Im). Its Euclidean norm there equals the complex L2 norm, which is what
is clipped; the noise is i.i.d. on those same 2N real coordinates and on every real
identity-basis coordinate, with one std per mechanism (the same for both kinds, so the
record does not depend on a model's mix of layers):

* ``noise='sound'`` (Spectral-DP default): Re and Im each N(0, σ²C²). The release is
  then a Gaussian mechanism at σ·C/sensitivity; after Re(iFFT) the output noise is
  N(0, σ²C²) per real coordinate, exactly DP-SGD's (spectral-dp.md §3c).
* ``noise='paper'`` (Spectral-DP as published and coded) and GReDP (Thm 1): CN(0, σ²C²),
  i.e. Re, Im each N(0, σ²C²/2): effective multiplier σ/√2 (the output noise is
  N(0, σ²C²/2) per coordinate: DP-SGD at σ/√2, gredp.md §3a).
* ``noise='real'``: refused. Real-only noise on a Hermitian spectrum leaves the odd
  (sine) half of the gradient un-noised, ε = ∞ (gredp.md §3b).

The :class:`~privgrad.mechanisms.stages.NoiseRecord` reports effective =
(noise std per real coordinate)/(sensitivity of the clipped sum, √Σc_l²) and claimed = σ.

**Filter** (Spectral-DP Alg. 1/2/3 Stage II; post-processing): ρ = fraction removed
per axis, K = ⌈(1−ρ)N⌉ bins kept per axis by the paper. ``filter='symmetric'``
(default) keeps the Hermitian-closed low band |f| ≤ ⌊(K−1)/2⌋ (all bins when K = N), a
real low-pass that keeps at most K bins. ``filter='paper'`` keeps raw indices i < K ("zero
the last ρ of rows and columns"), which is not Hermitian (half-gain low frequencies, and
not a low-pass for ρ < ½; spectral-dp.md §3d). Noise is added to every bin before the
filter, so the bound above holds for any filter. The inverse is Re(iFFT) in all modes.

Differences from the papers' code, on purpose: one noise draw on the sum (not noise/B
per sample), every bin noised (the code leaves frequency −1 un-noised), full iFFT + real
part (the code's ``irfftn`` drops half of the last axis).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from privgrad.errors import PrivgradError
from privgrad.layers.circulant import CirculantGrads, _power
from privgrad.per_sample import PerSampleGrads
from privgrad.per_sample.rules import (
    ConvGrads,
    LayerGrads,
    TrainableSubset,
    _total,
    chunk_bytes,
    guarded_norms_sq,
    sq_norms,
)
from privgrad.mechanisms.base import Mechanism
from privgrad.mechanisms.stages import (
    Capabilities,
    ClipPerLayer,
    GaussianNoise,
    PlanContext,
    ScaleByExpectedBatch,
    Stage,
    StepState,
    Sum,
)

REAL_NOISE_REFUSED = (
    "real-valued noise on a spectrum is refused: the spectrum of a real gradient is Hermitian, "
    "so Re(iFFT) of real noise is even; the odd (sine) half of the gradient would be released "
    "with no noise at all (ε = ∞; gredp.md §3b)"
)


# --------------------------------------------------------------------------- masks


def fast_len(n: int) -> int:
    """A fast FFT length ≥ n: the next power of two if within 20% of the smallest
    2^a 3^b 5^c ≥ n, else that 5-smooth length (pocketfft is fastest on powers of two)."""
    pow2 = 1 << max(n - 1, 0).bit_length()
    best = pow2
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return pow2 if pow2 <= 1.2 * best else best


def kept_bins(n: int, ratio: float) -> int:
    """K = ⌈(1−ρ)N⌉ (the Spectral-DP code's n_k), at least 1."""
    return max(1, math.ceil((1.0 - ratio) * n - 1e-9))


def keep_mask(n: int, ratio: float, kind: str = "symmetric") -> torch.Tensor:
    """0/1 mask over raw FFT index order for one axis of length n."""
    k = torch.arange(n)
    K = kept_bins(n, ratio)
    if kind == "paper":
        return (k < K).float()
    if K >= n:
        return torch.ones(n)
    return (torch.minimum(k, n - k) <= (K - 1) // 2).float()


# ----------------------------------------------------------- spectral layer views


def _complex(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


class SpectraWorkspace:
    """Memory that one conv layer's kept per-sample spectra (and its padded signals,
    :meth:`padded`) reuse from step to step.

    Kept spectra are large (tens of MB a step for LeNet-5's first layer). Allocated afresh
    each step, their pages are often handed back to the system when freed and faulted in
    again by the next step; reusing them avoids that (results/bench/engine_notes.md). The
    memory stays allocated between steps. Only the layer view that wrote last
    (:attr:`owner`) may read what it wrote; an older view recomputes its spectra."""

    def __init__(self):
        self.owner = None
        self._buffers: dict = {}
        self._padded: dict = {}

    def take(
        self, owner, key, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` for ``owner``."""
        self.owner = owner
        n, buf = math.prod(shape), self._buffers.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            # room for larger Poisson batches
            buf = self._buffers[key] = torch.empty(n + n // 4, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def padded(
        self, key, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero-initialised buffer of ``shape`` (first dimension: samples) that keeps what
        was written into it: writers use the same entries every time, so the rest stays zero
        and is never filled again (:meth:`SpectralConvGrads._chunk_spectra`)."""
        buf = self._padded.get(key)
        if (
            buf is None
            or buf.shape[0] < shape[0]
            or buf.shape[1:] != shape[1:]
            or buf.dtype != dtype
            or buf.device != device
        ):
            buf = self._padded[key] = torch.zeros(shape, dtype=dtype, device=device)
        return buf[: shape[0]]


def _contract_batch(G: torch.Tensor, X: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """S[o, i, k] = Σ_b w_b G[b, o, k] X[b, i, k] for complex G (B, O, *k), X (B, I, *k):
    elementwise when min(O, I) ≤ 4, else one real batched matmul over the bins k,
    [Gr; Gi]·[Xr, Xi]."""
    B, O, I, ks = G.shape[0], G.shape[1], X.shape[1], G.shape[2:]  # noqa: E741 (the shapes' names)
    w = weights.to(G.real.dtype).view(B, 1, *[1] * len(ks))
    if min(O, I) <= 4:
        if I <= O:
            return torch.stack([(G * (X[:, i : i + 1] * w)).sum(0) for i in range(I)], 1)
        return torch.stack([(X * (G[:, o : o + 1] * w)).sum(0) for o in range(O)], 0)
    K = math.prod(ks)
    Gv = torch.view_as_real(G).reshape(B, O, K, 2).permute(2, 3, 1, 0).reshape(K, 2 * O, B)
    Xv = torch.view_as_real(X * w).reshape(B, I, K, 2).permute(2, 0, 3, 1).reshape(K, B, 2 * I)
    P = torch.bmm(Gv, Xv)  # (K, 2O, 2I)
    return (
        torch.complex(P[:, :O, :I] - P[:, O:, I:], P[:, :O, I:] + P[:, O:, :I])
        .permute(1, 2, 0)
        .reshape(O, I, *ks)
    )


class SpectralLayer(LayerGrads):
    """Per-sample gradients of one layer with its weight in a unitary spectral basis.

    Views, as for every :class:`LayerGrads`: ``norms_sq()`` (R^{2N} norm of the spectrum
    plus the bias's), ``weighted_sum(w)`` (complex summed spectrum, real bias sum) and
    ``per_sample()`` (explicit per-sample spectra, for tests). ``spectral[i]`` says
    which parameter's entry is a spectrum; :meth:`inverse` maps it back.
    """

    freq_dims: int = 1

    def __init__(self, base: LayerGrads, keep: list[int] | None = None):
        self.base = base
        full = list(base.params)
        self.keep = list(range(len(full))) if keep is None else keep
        self.params = [full[i] for i in self.keep]
        self.spectral = [i == 0 for i in self.keep]

    # parts to implement: weight spectrum (index 0) and bias (index 1)
    def _weight_norms_sq(self) -> torch.Tensor:
        raise NotImplementedError

    def _weight_sum(self, weights) -> torch.Tensor:
        raise NotImplementedError

    def _weight_per_sample(self) -> torch.Tensor:
        raise NotImplementedError

    def _bias_grads(self) -> torch.Tensor:
        raise NotImplementedError

    def to_spectrum(self, real: torch.Tensor) -> torch.Tensor:
        """The layer's unitary transform of a real object (in the inverse's input layout)."""
        raise NotImplementedError

    def inverse(self, spectrum: torch.Tensor) -> torch.Tensor:
        """Re(iFFT), crop and flip back to the weight's shape."""
        raise NotImplementedError

    def embed(self, weight_grad: torch.Tensor) -> torch.Tensor:
        """A weight-shaped gradient as a real object of the spectral space (right inverse of
        :meth:`inverse`∘:meth:`to_spectrum`; conv: a correlation map supported on the kernel
        lags)."""
        raise NotImplementedError

    def geometry(self) -> "SpectralLayer":
        """This layer's transform without its data (kept between steps)."""
        geo = copy.copy(self)
        geo.base, geo._cache = None, None
        return geo

    @property
    def spectrum_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def norms_sq(self) -> torch.Tensor:
        parts = []
        if 0 in self.keep:
            parts.append(self._weight_norms_sq())
        if 1 in self.keep:
            parts.append(sq_norms(self._bias_grads()))
        return _total(parts)

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        out = []
        if 0 in self.keep:
            out.append(self._weight_sum(weights))
        if 1 in self.keep:
            out.append(torch.einsum("b,bo->o", weights, self._bias_grads()))
        return out

    def per_sample(self) -> list[torch.Tensor]:
        out = []
        if 0 in self.keep:
            out.append(self._weight_per_sample())
        if 1 in self.keep:
            out.append(self._bias_grads())
        return out


class SpectralCirculantGrads(SpectralLayer):
    """Block-circulant layer: Z_ij = F_ortho[∂L/∂w_ij] = DFT(g_i) ⊙ conj(DFT(x_j)) / √d."""

    freq_dims = 1

    def __init__(self, base: CirculantGrads, keep=None):
        super().__init__(base, keep)
        self.module = base.module

    @property
    def spectrum_shape(self):
        return tuple(self.module.weight.shape)

    def _weight_norms_sq(self):
        w = self.base.weight_norms_sq()  # Parseval, per frequency bin (T = 1), or built
        if self.base.a.shape[1] == 1:
            return w
        return guarded_norms_sq(w, self.base.magnitudes())  # as CirculantGrads.norms_sq

    def _weight_sum(self, weights):
        return torch.fft.fft(self.base.weighted_sum(weights)[0], norm="ortho")  # linearity

    def _weight_per_sample(self):
        m, d = self.module, self.module.block_size
        a = m.blocks(self.base.a)
        pad = m.p * d - m.out_features
        g = F.pad(self.base.g, (0, pad)) if pad else self.base.g
        if a.shape[0] == 0:
            return torch.zeros(0, *m.weight.shape, dtype=_complex(a.dtype), device=a.device)
        A = torch.fft.fft(a, dim=-1)
        G = torch.fft.fft(g.reshape(*g.shape[:-1], m.p, d), dim=-1)
        return torch.einsum("btik,btjk->bijk", G, A.conj()) / math.sqrt(d)

    def _bias_grads(self):
        return self.base.g.sum(1)

    def to_spectrum(self, real):
        return torch.fft.fft(real, norm="ortho")

    def inverse(self, spectrum):
        return torch.fft.ifft(spectrum, norm="ortho").real

    def embed(self, weight_grad):
        return weight_grad


class SpectralConvGrads(SpectralLayer):
    """Conv2d (groups 1, zero padding; any stride and dilation): the unitary M_h×M_w
    spectrum of the full correlation map R = flip(x_pad) * δ_up per (out, in) channel pair.

    Norms and the clipped sum never form (B, C_out, C_in, M, M): ‖Z_b‖² =
    Σ_k (Σ_i |X̂_bi(k)|²)(Σ_o |Δ̂_bo(k)|²) is computed at a fast FFT length ≥ M (exact: R
    has support M, so no wrap-around); for a 1×1 output gradient R_b = δ_b ⊗ flip(x_pad,b)
    and ‖Z_b‖² = ‖x_pad,b‖²‖δ_b‖². The sum:

    * ``kernel_sum`` (no filter follows: GReDP, Spectral-DP with ρ = 0): only the kernel
      lags of Σ_b w_b R_b reach the release (:meth:`inverse` crops them), and they are
      Σ_b w_b ∇W_b, so the sum is DP-SGD's book-keeping ``conv2d_weight``, embedded:
      Z_sum = F_ortho,M[embed(Σ_b w_b ∇W_b)]. Same release as the full sum (the noise is
      drawn on the same M×M spectrum), with no per-sample spectra kept.
    * otherwise (a filter reads every bin): Σ_b w_b R_b by contracting the kept per-sample
      spectra over samples per bin, then Z_sum = F_ortho,M[R_sum].
    """

    freq_dims = 2

    def __init__(
        self, base: ConvGrads, workspace: SpectraWorkspace, keep=None, kernel_sum: bool = False
    ):
        super().__init__(base, keep)
        self.kernel_sum, self.workspace = kernel_sum, workspace
        m = self.module = base.module
        x, g = base.inputs[0], base.grads[0]
        if any(xi.shape[2:] != x.shape[2:] for xi in base.inputs):
            raise PrivgradError(
                f"{type(m).__name__} is called on inputs of different sizes in one "
                "forward pass; its correlation spectra would differ in size"
            )
        (ph, pw), (sh, sw) = m.padding, m.stride
        self.n = (x.shape[2] + 2 * ph, x.shape[3] + 2 * pw)
        self.m_up = (sh * (g.shape[2] - 1) + 1, sw * (g.shape[3] - 1) + 1)
        self.M = (self.n[0] + self.m_up[0] - 1, self.n[1] + self.m_up[1] - 1)
        self._cache = None

    @property
    def spectrum_shape(self):
        w = self.module.weight.shape
        return (w[0], w[1], *self.M)

    def _signals(self, x, g):
        """flip(x_pad) and the stride-upsampled output gradient δ_up."""
        m = self.module
        (ph, pw), (sh, sw) = m.padding, m.stride
        xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
        if (sh, sw) != (1, 1):
            up = g.new_zeros(*g.shape[:2], *self.m_up)
            up[..., ::sh, ::sw] = g
            g = up
        return xp.flip(-2, -1), g

    def _chunk_spectra(self, call: int, x, g, L, outs):
        """rfft2 of flip(x_pad) and δ_up zero-padded to L, laid out (..., L_w//2+1, L_h), for a
        chunk of samples, into ``outs`` where given. The row transforms skip the zero rows of
        the padded signal, which ``rfft2(s=L)`` would transform. Each signal is written into a
        zero-padded workspace buffer that keeps its zeros, and the row transforms' output into
        the zero-padded input of the column transforms, so no padding is filled or copied per
        chunk (``EngineFlags.spectral_padding`` pads afresh instead; the measurements are in
        results/bench/engine_notes.md)."""
        m = self.module
        (ph, pw), (sh, sw) = m.padding, m.stride
        spectra = []
        for part, t, rows, o in (("x", x, self.n[0], outs[0]), ("g", g, self.m_up[0], outs[1])):
            b, ch = t.shape[:2]
            signal = self.workspace.padded((call, part), (b, ch, rows, L[1]), t.dtype, t.device)
            if part == "x":  # flip(pad(x)) is flip(x) at the padding's offset (symmetric padding)
                signal[..., ph : ph + t.shape[2], pw : pw + t.shape[3]] = t.flip(-2, -1)
            else:  # δ_up: δ at every stride-th entry
                signal[..., :rows:sh, : self.m_up[1] : sw] = t
            by_rows = self.workspace.padded(
                (call, part, "rows"), (b, ch, L[1] // 2 + 1, L[0]), _complex(t.dtype), t.device
            )
            torch.fft.rfft(signal, out=by_rows[..., :rows].transpose(-1, -2))
            spectra.append(torch.fft.fft(by_rows, out=o))
        return spectra

    def _chunk_spectra_afresh(self, call: int, x, g, L, outs):
        """:meth:`_chunk_spectra` with each chunk padded afresh (``EngineFlags.spectral_padding
        = "afresh"``): ``F.pad`` and ``flip`` of the input (:meth:`_signals`), then the FFTs'
        own padding to L, rows first."""
        return tuple(
            torch.fft.fft(torch.fft.rfft(t, n=L[1]).transpose(-1, -2), n=L[0], out=o)
            for t, o in zip(self._signals(x, g), outs)
        )

    def _spectra(self, keep: bool = True):
        """rfft2 (at a fast length L ≥ M, transposed layout) of flip(x_pad) and δ_up, in
        chunks of samples; each chunk's norms are taken while it is in cache. Chunks hold
        at least ~2·C_out·C_in/(C_out+C_in) samples, so that accumulating the contraction
        per chunk costs less than reading the chunk. Returns ([[(X, G)] per call] (empty
        lists unless ``keep``), norms, L)."""
        m, base = self.module, self.base
        L = (fast_len(self.M[0]), fast_len(self.M[1]))
        K, O, I = (L[1] // 2 + 1) * L[0], m.out_channels, m.in_channels  # noqa: E741
        h = torch.full((L[1] // 2 + 1, 1), 2.0, device=m.weight.device)
        h[0] = 1.0
        if L[1] % 2 == 0:
            h[-1] = 1.0
        B, flags = base.inputs[0].shape[0], base.flags
        threads = torch.get_num_threads() if flags.spectral_chunk_per_thread else 1
        budget = chunk_bytes(h.device, flags.spectral_chunk_bytes * threads, flags)
        afresh = flags.spectral_padding == "afresh"
        chunk_spectra = self._chunk_spectra_afresh if afresh else self._chunk_spectra
        step = max(1, budget // ((O + I) * K * 8), math.ceil(2 * O * I / (O + I)))
        calls, norms = [], []
        for c, (x, g) in enumerate(zip(base.inputs, base.grads)):
            chunks, out = [], (None, None)
            if keep and B:
                out = [
                    self.workspace.take(
                        self, (c, part), (B, n, L[1] // 2 + 1, L[0]), _complex(x.dtype), x.device
                    )
                    for part, n in (("x", I), ("g", O))
                ]
            for i in range(0, B, step):  # an empty batch has no chunks
                X, G = chunk_spectra(
                    c,
                    x[i : i + step],
                    g[i : i + step],
                    L,
                    [o if o is None else o[i : i + step] for o in out],
                )
                if keep:
                    chunks.append((X, G))
                if not calls:  # ‖Z_b‖² = Σ_k (Σ_i |X̂_bi(k)|²)(Σ_o |Ĝ_bo(k)|²) / (L_h L_w)
                    norms.append((_power(X) * _power(G) * h).sum((1, 2)) / (L[0] * L[1]))
            calls.append(chunks)
        return calls, (torch.cat(norms) if norms else base.inputs[0].new_zeros(0)), L

    def _spectra_fit(self) -> bool:
        L = (fast_len(self.M[0]), fast_len(self.M[1]))
        m = self.module
        per_sample = (
            (L[1] // 2 + 1) * L[0] * 8 * (m.in_channels + m.out_channels) * len(self.base.inputs)
        )
        return per_sample * self.base.inputs[0].shape[0] <= self.base.flags.spectral_keep_bytes

    def _weight_norms_sq(self):
        if len(self.base.inputs) > 1:
            # the R^{2N} norm of the calls' summed spectra, at least Σ_calls ‖Z_call‖ / K
            # (guarded_norms_sq): the sum adds the calls' terms in another order (by
            # conv2d_weight, or per call), and a conv called on x and on −x + small, x of
            # 2³⁴, moved the clipped sum by 67 C in spectral-dp and gredp
            w = sq_norms(torch.view_as_real(self._weight_per_sample()))
            return guarded_norms_sq(w, _total(self._call_norms()))
        if self.m_up == (1, 1):
            xp, g = self._signals(self.base.inputs[0], self.base.grads[0])
            return sq_norms(xp) * sq_norms(g)
        if self._cache is None:
            keep = not self.kernel_sum and self._spectra_fit()
            calls, norms, L = self._spectra(keep)
            self._cache = (calls if keep else None, norms, L)
        return self._cache[1]

    def _weight_sum(self, weights):
        m = self.module
        if self.kernel_sum and self.base.inputs[0].shape[0]:
            self._cache = None
            return self.to_spectrum(self.embed(self.base.weight_sum(weights)))
        calls = self._cache[0] if self._cache is not None else None
        if calls is not None and self.workspace.owner is not self:
            calls = None  # a later view of this layer reused the memory
        if calls is None:
            calls, _, L = self._spectra()  # too large to keep, or overwritten: recompute
        else:
            L = self._cache[2]
        self._cache = None  # free the spectra once the sum is formed
        total = None
        for chunks in calls:
            i = 0
            for X, G in chunks:
                s = _contract_batch(G, X, weights[i : i + X.shape[0]])  # (C_out, C_in, Lw//2+1, Lh)
                total = s if total is None else total + s
                i += X.shape[0]
        if total is None:  # empty batch
            return torch.zeros(
                *m.weight.shape[:2], *self.M, dtype=_complex(m.weight.dtype), device=m.weight.device
            )
        R = torch.fft.irfft2(total.transpose(-1, -2), s=L)[..., : self.M[0], : self.M[1]]
        return torch.fft.fft2(R, norm="ortho")

    def _weight_per_sample(self):
        if self.base.inputs[0].shape[0] == 0:
            x = self.base.inputs[0]
            return torch.zeros(0, *self.spectrum_shape, dtype=_complex(x.dtype), device=x.device)
        return _total(self._call_spectra())

    def _call_spectra(self):
        """Each call's per-sample spectrum (B, C_out, C_in, M_h, M_w), one at a time."""
        for x, g in zip(self.base.inputs, self.base.grads):
            xf, gf = self._signals(x, g)
            yield (
                torch.fft.fft2(xf, s=self.M, norm="ortho")[:, None]
                * torch.fft.fft2(gf, s=self.M)[:, :, None]
            )  # code's formula

    def _call_norms(self) -> list[torch.Tensor]:
        """‖Z_call,b‖ for every call: by Parseval ‖Z‖² = Σ_k |X̂(k)|²|Δ̂(k)|², a sum of
        non-negative terms per bin, over the output and input channels."""
        return [
            (_power(xs) * _power(gs)).sum((1, 2)).sqrt()
            for xs, gs in (
                (
                    torch.fft.fft2(xf, s=self.M, norm="ortho"),
                    torch.fft.fft2(gf, s=self.M),
                )
                for xf, gf in (
                    self._signals(x, g) for x, g in zip(self.base.inputs, self.base.grads)
                )
            )
        ]

    def _bias_grads(self):
        return _total(g.sum((2, 3)) for g in self.base.grads)

    def to_spectrum(self, real):
        return torch.fft.fft2(real, norm="ortho")

    def inverse(self, spectrum):
        m = self.module
        (kh, kw), (dh, dw) = m.kernel_size, m.dilation
        R = torch.fft.ifft2(spectrum, norm="ortho").real.flip(-2, -1)  # R_flip[j] = lag j − (m'−1)
        r0, c0 = self.m_up[0] - 1, self.m_up[1] - 1
        return R[
            ..., r0 : r0 + dh * (kh - 1) + 1 : dh, c0 : c0 + dw * (kw - 1) + 1 : dw
        ].contiguous()

    def embed(self, weight_grad):
        m = self.module
        (kh, kw), (dh, dw) = m.kernel_size, m.dilation
        r0, c0 = self.m_up[0] - 1, self.m_up[1] - 1
        R = weight_grad.new_zeros(*weight_grad.shape[:-2], *self.M)
        R[..., r0 : r0 + dh * (kh - 1) + 1 : dh, c0 : c0 + dw * (kw - 1) + 1 : dw] = weight_grad
        return R.flip(-2, -1)


class EmbeddedSpectral(SpectralLayer):
    """Per-sample gradients given in the parameter domain (a layer that did not run, e.g.
    an empty Poisson batch, or injected gradients) for a layer whose spectral geometry is
    known from an earlier step: embedded into the same spectral space, so the step's
    noise, filter and inverse are exactly those of a step with data. Norms are those of
    the embedded objects (= the given gradients' norms, by Parseval)."""

    def __init__(self, geometry: SpectralLayer, base: LayerGrads):
        self.geo, self.base = geometry, base
        self.params, self.keep, self.spectral = list(base.params), geometry.keep, geometry.spectral
        self.freq_dims = geometry.freq_dims
        self._grads = None

    @property
    def spectrum_shape(self):
        return self.geo.spectrum_shape

    def _parts(self):
        if self._grads is None:
            self._grads = dict(zip(self.keep, self.base.per_sample()))
        return self._grads

    def _weight_norms_sq(self):
        return sq_norms(self._parts()[0])

    def _weight_sum(self, weights):
        return self.to_spectrum(self.embed(torch.einsum("b,b...->...", weights, self._parts()[0])))

    def _weight_per_sample(self):
        return self.to_spectrum(self.embed(self._parts()[0]))

    def _bias_grads(self):
        return self._parts()[1]

    def to_spectrum(self, real):
        return self.geo.to_spectrum(real)

    def inverse(self, spectrum):
        return self.geo.inverse(spectrum)

    def embed(self, weight_grad):
        return self.geo.embed(weight_grad)


# ------------------------------------------------------------------------ stages


def _spectral_of(
    layer: LayerGrads, kernel_sum: bool, workspaces: dict[int, SpectraWorkspace]
) -> SpectralLayer | None:
    """The layer in its spectral basis (None: identity basis). A conv layer takes its
    workspace (kept spectra, padded signals) from ``workspaces`` (by module), creating it on
    first use."""
    if isinstance(layer, SpectralLayer):
        return layer
    inner, keep = layer, None
    if isinstance(layer, TrainableSubset):
        inner, keep = layer.inner, layer.keep
    if keep is not None and 0 not in keep:
        return None  # frozen weight: only the bias is trained, identity basis
    if isinstance(inner, ConvGrads):
        workspace = workspaces.setdefault(id(inner.module), SpectraWorkspace())
        return SpectralConvGrads(inner, workspace, keep, kernel_sum)
    if isinstance(inner, CirculantGrads):
        return SpectralCirculantGrads(inner, keep)
    return None


class SpectralTransform(Stage):
    """Per sample and per layer: weight gradient → unitary spectrum (Spectral-DP Alg. 2
    line "G^F = F[∂J/∂A] ⊙ F[X]", Alg. 3 Eq. 8; GReDP Eq. 8). Other layers pass unchanged.

    A conv layer's spectral space depends on its input size, known only from data. The
    last geometry of each layer is kept, and gradients that arrive in the parameter domain
    for such a layer (a layer that did not run, e.g. an empty Poisson batch, or injected
    gradients) are embedded into it (:class:`EmbeddedSpectral`), so the noise distribution
    of a step never depends on whether it held data. :meth:`plan` (called by
    ``make_private`` before the first step) learns the geometries from a zero input; if
    none is known, the batch is empty and a filter would reshape the noise, the step is
    refused rather than released with a different noise distribution.

    ``filtered``: a filter follows the sum (Spectral-DP Stage II with ρ > 0) and reads every
    bin of it (the default: the full sum is right whatever follows). With ``False`` only a
    conv's kernel lags reach the release, and its clipped sum is book-kept in the parameter
    domain (:class:`SpectralConvGrads` ``kernel_sum``).
    """

    # a deterministic per-sample map; a conv's spectrum is computed from its input and
    # output gradient (see privgrad.app.audit.canary for trial_shared)
    capabilities = Capabilities(
        per_sample=True, per_example=True, reads_layer_inputs=True, trial_shared=True
    )

    def __init__(self, filtered: bool = True):
        self.filtered = filtered
        self._seen: dict[int, SpectralLayer] = {}
        self._workspaces: dict[
            int, SpectraWorkspace
        ] = {}  # conv layers' kept spectra and padded signals

    def convert(self, layer: LayerGrads) -> LayerGrads:
        spec = _spectral_of(layer, kernel_sum=not self.filtered, workspaces=self._workspaces)
        if spec is not None:
            if not isinstance(spec, EmbeddedSpectral):
                self._seen[id(spec.params[0])] = spec.geometry()
            return spec
        known = self._seen.get(id(layer.params[0])) if layer.params else None
        if known is not None and [id(p) for p in known.params] == [id(p) for p in layer.params]:
            return EmbeddedSpectral(known, layer)
        return layer

    def plan(self, context: PlanContext) -> None:
        """Learn every layer's geometry before the first step from one all-zero input of the
        training data's shape (public, ``context.probe``), so that even a first empty batch
        is filtered."""
        if context.probe is None:
            return
        for layer in context.probe().layers:
            self.convert(layer)

    def __call__(self, state):
        psg = state.per_sample
        converted = PerSampleGrads(
            [self.convert(layer) for layer in psg.layers], psg.batch_size, psg.flags
        )
        if (
            self.filtered
            and psg.batch_size == 0
            and not self._seen
            and any(p.dim() in (3, 4) for p in psg.params)
        ):
            raise PrivgradError(
                "the first Poisson batch is empty, so the spectral geometry (input sizes) of the "
                "layers is not known yet and the filtered noise cannot be drawn; use another seed "
                "or filter_ratio=0"
            )
        state.per_sample = converted
        state.spectral_layers = sum(isinstance(layer, SpectralLayer) for layer in converted.layers)
        return state

    def describe(self, info):
        info["transform"] = "unitary FFT (conv: full correlation map; block-circulant: blocks)"


def _by_layer(state: StepState):
    """(layer, index of each of its parameters in state.grads)."""
    i = 0
    for layer in state.per_sample.layers:
        n = len(layer.params)
        yield layer, list(range(i, i + n))
        i += n


class SpectralNoise(GaussianNoise):
    """One draw per step on the clipped sum: every real coordinate (Re and Im of each
    spectral bin, each identity-basis coordinate) gets N(0, (f·σC)²), f = 1 (sound) or
    1/√2 (CN(0, σ²C²): Spectral-DP's code, GReDP Thm 1). Effective multiplier f·σC/sensitivity.
    """

    # fresh noise per leading trial row; not injected_canaries: its chain is layer-aware
    capabilities = Capabilities(coordinatewise=True, noise=True, trial_stacked=True)

    def __init__(self, noise_multiplier: float, part_factor: float = 1.0):
        super().__init__(noise_multiplier)
        self.part_factor = part_factor

    def std(self, noise_scale: float) -> float:
        """Noise std per real coordinate."""
        return self.noise_multiplier * noise_scale * self.part_factor


class SpectralFilter(Stage):
    """Stage II low-pass per spectral axis (post-processing); see the module docstring."""

    capabilities = Capabilities(trial_stacked=True)  # the mask acts on the trailing axes

    def __init__(self, ratio: float, kind: str = "symmetric"):
        if not 0.0 <= ratio < 1.0:
            raise PrivgradError(
                f"filter_ratio is the fraction of bins removed per axis, in [0, 1); got {ratio}"
            )
        if kind not in ("symmetric", "paper"):
            raise PrivgradError(f"filter must be 'symmetric' or 'paper', got '{kind}'")
        self.ratio, self.kind = ratio, kind

    def mask(self, layer: SpectralLayer) -> torch.Tensor:
        sizes = layer.spectrum_shape[-layer.freq_dims :]
        mask = keep_mask(sizes[0], self.ratio, self.kind)
        for n in sizes[1:]:
            mask = mask[..., None] * keep_mask(n, self.ratio, self.kind)
        return mask

    def __call__(self, state):
        if self.ratio == 0.0:
            return state
        for layer, idx in _by_layer(state):
            if isinstance(layer, SpectralLayer):
                for i, spectral in zip(idx, layer.spectral):
                    if spectral:
                        state.grads[i] = state.grads[i] * self.mask(layer).to(state.grads[i].device)
        return state

    def describe(self, info):
        info["filter"] = (self.kind, self.ratio)


class InverseSpectral(Stage):
    """Re(iFFT), crop and flip back to each weight's shape (Spectral-DP Stage II; GReDP
    Eqs. 12–13)."""

    capabilities = Capabilities(trial_stacked=True)  # acts on the trailing axes

    def __call__(self, state):
        for layer, idx in _by_layer(state):
            if isinstance(layer, SpectralLayer):
                for i, spectral in zip(idx, layer.spectral):
                    if spectral:
                        state.grads[i] = layer.inverse(state.grads[i])
        return state


# --------------------------------------------------------------------- factories


def _clip(max_grad_norm: float, per_layer_clip: str) -> ClipPerLayer:
    if per_layer_clip not in ("split", "literal"):
        raise PrivgradError(
            f"per_layer_clip must be 'split' (c_l = C/√L) or 'literal' (c_l = C), "
            f"got '{per_layer_clip}'"
        )
    return ClipPerLayer(max_grad_norm, literal=per_layer_clip == "literal")


def spectral_dp(
    noise_multiplier,
    max_grad_norm,
    filter_ratio: float = 0.5,
    filter: str = "symmetric",
    noise: str = "sound",
    per_layer_clip: str = "split",
) -> Mechanism:
    """Spectral-DP (Feng et al. 2023, Algs. 2–4).

    ``filter_ratio`` ρ: fraction of bins removed per axis (default 0.5, the paper's
    starting guideline for conv layers; 0 disables the filter). ``filter``: 'symmetric'
    (Hermitian low band) or 'paper' (raw order, keep i < ⌈(1−ρ)N⌉). ``noise``: 'sound'
    (Re, Im each N(0, σ²C²): effective σ), 'paper' (CN(0, σ²C²): effective σ/√2) or
    'real' (refused). ``per_layer_clip``: 'split' (c_l = C/√L, the code) or 'literal'
    (c_l = C; sensitivity C√L).
    """
    if noise == "real":
        raise PrivgradError(REAL_NOISE_REFUSED)
    if noise not in ("sound", "paper"):
        raise PrivgradError(
            f"spectral-dp noise must be 'sound' (Re, Im each N(0, σ²C²)) or 'paper' "
            f"(CN(0, σ²C²), effective σ/√2), got '{noise}'"
        )
    filt = SpectralFilter(float(filter_ratio), filter)
    return Mechanism(
        "spectral-dp",
        [
            SpectralTransform(filtered=filt.ratio > 0),
            _clip(max_grad_norm, per_layer_clip),
            Sum(),
            SpectralNoise(noise_multiplier, 1.0 if noise == "sound" else 1 / math.sqrt(2)),
            filt,
            InverseSpectral(),
            ScaleByExpectedBatch(),
        ],
        "sgd",
        "Feng et al. 2023 (Spectral-DP), Algs. 2-4",
    )


def gredp(
    noise_multiplier, max_grad_norm, noise: str = "complex", per_layer_clip: str = "split"
) -> Mechanism:
    """GReDP (Wang et al., Alg. 2; Eqs. 10–13; Thm 1): CN(0, σ²C²) on the clipped spectra,
    Re(iFFT), crop. Honest multiplier σ/√2 (÷√L more with ``per_layer_clip='literal'``).
    ``noise='real'`` (a literal reading of Eq. 11) is refused."""
    if noise == "real":
        raise PrivgradError(REAL_NOISE_REFUSED)
    if noise != "complex":
        raise PrivgradError(f"gredp noise must be 'complex' (CN(0, σ²C²), Thm 1), got '{noise}'")
    return Mechanism(
        "gredp",
        [
            SpectralTransform(filtered=False),
            _clip(max_grad_norm, per_layer_clip),
            Sum(),
            SpectralNoise(noise_multiplier, 1 / math.sqrt(2)),
            InverseSpectral(),
            ScaleByExpectedBatch(),
        ],
        "sgd",
        "Wang et al. (GReDP), Alg. 2 and Thm 1",
    )


__all__ = [
    "SpectralTransform",
    "SpectralNoise",
    "SpectralFilter",
    "InverseSpectral",
    "SpectralLayer",
    "SpectralConvGrads",
    "SpectralCirculantGrads",
    "spectral_dp",
    "gredp",
    "keep_mask",
    "kept_bins",
    "fast_len",
    "REAL_NOISE_REFUSED",
]
