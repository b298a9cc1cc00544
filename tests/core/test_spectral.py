"""Spectral-DP and GReDP: block-circulant layer, spectral transforms, exact privacy of the
real stage chain, Monte-Carlo noise checks (with planted bugs), DP-SGD equivalence."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.layers import BlockCirculantLinear, CirculantGrads
from privgrad.mechanisms import (
    ClipPerLayer,
    GaussianNoise,
    Mechanism,
    ScaleByExpectedBatch,
    StepState,
    Sum,
    build_mechanism,
)
from privgrad.mechanisms.spectral import (
    SpectralConvGrads,
    SpectralLayer,
    SpectralNoise,
    SpectralTransform,
    keep_mask,
    kept_bins,
)
from privgrad.app.models import MODELS, build_model
from privgrad.per_sample import EngineFlags, GradSampler, MaterializedGrads, PerSampleGrads
from privgrad.private import per_sample_cross_entropy
from stats import std_matches


def per_sample_of(model, x, y=None, loss=per_sample_cross_entropy, flags=None):
    return GradSampler(model, flags=flags or EngineFlags()).compute(x, y, loss)[0]


def loop_grads(model, x, y):
    out = []
    for i in range(len(x)):
        model.zero_grad()
        per_sample_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


# ------------------------------------------------------------ block-circulant layer


@pytest.mark.parametrize(
    "n_in,n_out,d,bias",
    [(16, 24, 8, True), (13, 7, 4, True), (20, 10, 10, False), (5, 9, 3, False)],
)
def test_block_circulant_forward_equals_dense_circulant_product(n_in, n_out, d, bias):
    layer = BlockCirculantLinear(n_in, n_out, d, bias=bias)
    x = torch.randn(6, 3, n_in)  # leading dims are positions
    dense = layer.dense_weight()
    # each block is circulant: C[r, s] = w[(r - s) mod d]
    w = layer.weight[0, 0].detach()
    block = dense[: min(d, n_out), : min(d, n_in)].detach()
    for r in range(block.shape[0]):
        for s in range(block.shape[1]):
            assert block[r, s] == w[(r - s) % d]
    expected = x @ dense.T + (layer.bias if bias else 0)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.weight.numel() == math.ceil(n_out / d) * math.ceil(n_in / d) * d


def test_block_circulant_rejects_wrong_width():
    with pytest.raises(PrivgradError, match="input features"):
        BlockCirculantLinear(8, 8, 4)(torch.randn(2, 7))


def test_block_circulant_per_sample_grads_equal_loop():
    torch.manual_seed(1)
    model = nn.Sequential(
        BlockCirculantLinear(13, 12, 4), nn.Tanh(), BlockCirculantLinear(12, 5, 5, bias=False)
    )
    x, y = torch.randn(6, 13), torch.randint(0, 5, (6,))
    x[1] = x[0]
    psg = per_sample_of(model, x, y)
    assert all(isinstance(layer, CirculantGrads) for layer in psg.layers)
    per_sample = [g for layer in psg.layers for g in layer.per_sample()]
    assert per_sample[0].shape == (6, 3, 4, 4) and per_sample[2].shape == (6, 1, 3, 5)
    for i, want in enumerate(loop_grads(model, x, y)):
        for got, w in zip(per_sample, want):
            torch.testing.assert_close(got[i], w, atol=2e-6, rtol=1e-4)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in per_sample)
    torch.testing.assert_close(psg.norms_sq(), norms, rtol=1e-5, atol=1e-7)
    w = torch.rand(6)
    for got, g in zip(psg.weighted_sum(w), per_sample):
        torch.testing.assert_close(got, torch.einsum("b,b...->...", w, g), atol=1e-6, rtol=1e-5)


def test_block_circulant_on_sequences_sums_positions():
    layer = BlockCirculantLinear(8, 8, 4)
    a, g = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    grads = CirculantGrads(layer, a, g)
    want = [torch.zeros(3, 2, 2, 4), g.sum(1)]
    for b in range(3):
        layer.zero_grad()
        (layer(a[b]) * g[b]).sum().backward()
        want[0][b] = layer.weight.grad
    for got, w in zip(grads.per_sample(), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads.norms_sq(), sum(t.flatten(1).pow(2).sum(1) for t in want))


# ------------------------------------------------------------- spectral transforms


def spectral_layers(model, x, y=None, loss=per_sample_cross_entropy, filtered=True, flags=None):
    psg = per_sample_of(model, x, y, loss, flags)
    return SpectralTransform(filtered)(StepState(psg, 1.0, torch.Generator())).per_sample


@pytest.mark.parametrize(
    "conv",
    [
        dict(padding=1),
        dict(padding=2, stride=2),
        dict(padding=0, dilation=2),
        dict(padding=(1, 0), stride=(1, 2)),
    ],
)
def test_conv_spectrum_is_unitary_fft_of_full_correlation_map(conv):
    torch.manual_seed(0)
    layer = nn.Conv2d(2, 3, 3, **conv)
    x = torch.randn(4, 2, 9, 8)
    g = torch.randn_like(layer(x))
    psg = spectral_layers(layer, x, g, lambda out, y: (out * y).flatten(1).sum(1))
    spec = psg.layers[0]
    assert isinstance(spec, SpectralConvGrads)
    Z = spec.per_sample()[0]  # (B, O, I, M_h, M_w)
    # independent reference: full correlation over all lags via conv2d, in lag order
    ph, pw = layer.padding
    xp = F.pad(x, (pw, pw, ph, ph))
    sh, sw = layer.stride
    up = torch.zeros(*g.shape[:2], sh * (g.shape[2] - 1) + 1, sw * (g.shape[3] - 1) + 1)
    up[..., ::sh, ::sw] = g
    lag = torch.stack(
        [
            F.conv2d(
                xp[b][:, None], up[b][:, None], padding=(up.shape[2] - 1, up.shape[3] - 1)
            ).transpose(0, 1)
            for b in range(4)
        ]
    )  # (B, O, I, M_h, M_w)
    M = (xp.shape[2] + up.shape[2] - 1, xp.shape[3] + up.shape[3] - 1)
    assert Z.shape[-2:] == M == lag.shape[-2:] == spec.M
    R = torch.fft.ifft2(Z, norm="ortho")
    assert R.imag.abs().max() < 1e-4
    torch.testing.assert_close(
        R.real.flip(-2, -1), lag, atol=1e-4, rtol=1e-4
    )  # R = flip(lag-order map)
    # clipping norm: ‖Z_b‖ (R^{2N}) = ‖full correlation map‖ (+ bias), from the fast path too
    bias = g.sum((2, 3))
    torch.testing.assert_close(
        spec.norms_sq(), lag.pow(2).flatten(1).sum(1) + bias.pow(2).sum(1), rtol=1e-4, atol=1e-4
    )
    w = torch.rand(4)
    ws = spec.weighted_sum(w)
    torch.testing.assert_close(
        ws[0], torch.einsum("b,b...->...", w.to(Z.dtype), Z), atol=1e-4, rtol=1e-4
    )
    # inverse (iFFT, real part, centre crop, flip back) gives the kernel gradient
    kernel = kernel_grads_by_loop(layer, x, g)
    for b in range(4):
        torch.testing.assert_close(spec.inverse(Z[b]), kernel[b], atol=1e-4, rtol=1e-4)


def kernel_grads_by_loop(layer, x, g):
    out = []
    for b in range(len(x)):
        layer.zero_grad()
        (layer(x[b : b + 1]) * g[b : b + 1]).sum().backward()
        out.append(layer.weight.grad.clone())
    return out


def test_parameter_domain_gradients_are_embedded_in_the_known_geometry():
    """Gradients arriving as plain tensors (empty batch, injected canaries) for a layer whose
    spectral geometry is known are embedded in it, never dropped: σ = 0, ρ = 0 gives their
    clipped sum, and the embedding is a right inverse of the spectral round trip."""
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=2, stride=2, dilation=2),
        nn.Flatten(),
        BlockCirculantLinear(3 * 4 * 4, 6, 4),
    )
    x, y = torch.randn(4, 2, 8, 8), torch.randint(0, 6, (4,))
    mech = build_mechanism("spectral-dp", 0.0, 0.3, filter_ratio=0.0)
    real = per_sample_of(model, x, y)
    mech.privatize(real, 4.0, torch.Generator())  # learns the geometry
    injected = [[torch.randn(5, *p.shape) for p in layer.params] for layer in real.layers]
    psg = PerSampleGrads(
        [MaterializedGrads(layer.params, g) for layer, g in zip(real.layers, injected)], 5
    )
    update, _, _ = mech.privatize(psg, 5.0, torch.Generator())
    ref, _, _ = per_layer_dpsgd(0.3).privatize(psg, 5.0, torch.Generator())
    for u, r in zip(update, ref):
        torch.testing.assert_close(u, r, atol=1e-5, rtol=0)
    spec = SpectralTransform()(StepState(real, 1.0, torch.Generator())).per_sample.layers[0]
    W = torch.randn(3, 2, 3, 3)
    torch.testing.assert_close(spec.inverse(spec.to_spectrum(spec.embed(W))), W, atol=1e-5, rtol=0)


def test_spectral_size_is_n_plus_m_minus_1():
    """ERRATA: 65 per axis for a 32×32 input with a 3×3 'same' convolution."""
    layer = nn.Conv2d(1, 1, 3, padding=1, bias=False)
    x = torch.randn(1, 1, 32, 32)
    spec = spectral_layers(
        layer, x, torch.ones(1, 1, 32, 32), lambda out, y: (out * y).flatten(1).sum(1)
    ).layers[0]
    assert spec.M == (65, 65) and spec.spectrum_shape == (1, 1, 65, 65)


def test_block_circulant_spectrum_is_unitary_fft_of_block_gradients():
    model = nn.Sequential(BlockCirculantLinear(12, 8, 4), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 12), torch.randint(0, 3, (5,))
    plain = per_sample_of(model, x, y)
    spec = SpectralTransform()(StepState(plain, 1.0, torch.Generator())).per_sample
    assert isinstance(spec.layers[0], SpectralLayer) and not isinstance(
        spec.layers[1], SpectralLayer
    )
    dw = plain.layers[0].per_sample()[0]
    Z = spec.layers[0].per_sample()[0]
    torch.testing.assert_close(Z, torch.fft.fft(dw, norm="ortho"), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(spec.norms_sq(), plain.norms_sq(), rtol=1e-5, atol=1e-7)  # Parseval


def test_masks():
    for n in range(1, 20):
        for rho in (0.0, 0.2, 0.25, 0.5, 0.7, 0.75, 0.875):
            K = kept_bins(n, rho)
            sym, paper = keep_mask(n, rho, "symmetric"), keep_mask(n, rho, "paper")
            assert torch.equal(sym, sym[(-torch.arange(n)) % n])  # Hermitian-closed
            assert (
                sym[0] == 1 and sym.sum() <= K and torch.equal(paper, (torch.arange(n) < K).float())
            )
            if rho == 0:
                assert sym.sum() == n
    assert kept_bins(10, 0.7) == 3 and kept_bins(59, 0.5) == 30


# --------------------------------------------- σ = 0, ρ = 0: the same update as DP-SGD


def per_layer_dpsgd(clip, literal=False):
    return Mechanism(
        "ref", [ClipPerLayer(clip, literal), Sum(), GaussianNoise(0.0), ScaleByExpectedBatch()]
    )


@pytest.mark.parametrize("literal", [False, True])
def test_zero_noise_equals_dpsgd_per_layer_clipping_where_norms_agree(literal):
    """Block-circulant and identity-basis layers: the spectral norm is the gradient norm
    (Parseval), so with clipping active the update must equal DP-SGD's per-layer clipping."""
    torch.manual_seed(2)
    model = nn.Sequential(
        BlockCirculantLinear(16, 12, 4),
        nn.Tanh(),
        BlockCirculantLinear(12, 6, 3, bias=False),
        nn.Tanh(),
        nn.Linear(6, 3),
    )
    x, y = torch.randn(9, 16) * 3, torch.randint(0, 3, (9,))
    psg = per_sample_of(model, x, y)
    clip = "literal" if literal else "split"
    ref, _, _ = per_layer_dpsgd(0.05, literal).privatize(psg, 20.0, torch.Generator())
    for mech in (
        build_mechanism("spectral-dp", 0.0, 0.05, filter_ratio=0.0, per_layer_clip=clip),
        build_mechanism(
            "spectral-dp", 0.0, 0.05, filter_ratio=0.0, noise="paper", per_layer_clip=clip
        ),
        build_mechanism("gredp", 0.0, 0.05, per_layer_clip=clip),
    ):
        update, _, _ = mech.privatize(psg, 20.0, torch.Generator())
        assert psg.norms_sq().sqrt().min() > 0.05  # clipping is active for every example
        for u, r in zip(update, ref):
            assert u.dtype == r.dtype and u.shape == r.shape
            torch.testing.assert_close(u, r, atol=1e-5, rtol=0)


def conv_model():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    )


def test_zero_noise_conv_equals_dpsgd_when_clipping_is_inactive():
    torch.manual_seed(3)
    model, x, y = conv_model(), torch.randn(7, 2, 8, 8), torch.randint(0, 3, (7,))
    psg = per_sample_of(model, x, y)
    ref, _, _ = per_layer_dpsgd(1e6).privatize(psg, 7.0, torch.Generator())
    for mech in (
        build_mechanism("spectral-dp", 0.0, 1e6, filter_ratio=0.0),
        build_mechanism("gredp", 0.0, 1e6),
    ):
        update, _, _ = mech.privatize(psg, 7.0, torch.Generator())
        for u, r in zip(update, ref):
            torch.testing.assert_close(u, r, atol=1e-5, rtol=0)


class Reused(nn.Module):
    """One conv applied twice (same input size): its per-sample gradient sums both calls."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 2, 3, padding=1), nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).flatten(1))


# spectra kept between clip and sum (the default), or too large to keep (1 byte): recomputed
KEEP = {"kept": EngineFlags(), "recomputed": EngineFlags(spectral_keep_bytes=1)}


@pytest.mark.parametrize("keep", KEEP)
def test_zero_noise_conv_reused_module_and_recomputed_spectra(keep):
    torch.manual_seed(7)
    for model, x in ((Reused(), torch.randn(5, 2, 5, 5)), (conv_model(), torch.randn(5, 2, 8, 8))):
        psg = per_sample_of(model, x, torch.randint(0, 3, (5,)), flags=KEEP[keep])
        ref, _, _ = per_layer_dpsgd(1e6).privatize(psg, 5.0, torch.Generator())
        update, _, _ = build_mechanism("gredp", 0.0, 1e6).privatize(psg, 5.0, torch.Generator())
        for u, r in zip(update, ref):
            torch.testing.assert_close(u, r, atol=1e-5, rtol=0)
        spec = SpectralTransform()(StepState(psg, 1.0, torch.Generator())).per_sample
        norms = sum(t.abs().pow(2).flatten(1).sum(1) for t in spec.layers[0].per_sample())
        torch.testing.assert_close(spec.layers[0].norms_sq(), norms, rtol=1e-4, atol=1e-6)


def mixed_channel_convs():
    """Conv layers that take every path of the clipped-sum contraction: C_in > C_out ≤ 4,
    C_in < C_out ≤ 4 (elementwise) and min(C_in, C_out) > 4 (the batched matmul)."""
    return nn.Sequential(
        nn.Conv2d(6, 2, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(2, 7, 3, stride=2),
        nn.Tanh(),
        nn.Conv2d(7, 9, 2),
        nn.Flatten(),
        nn.Linear(9 * 3 * 3, 3),
    )


def spectral_models():
    return ["mixed", "lenet5", "lenet5-bc", "model1", "model2", "model3"]


pytestmark = pytest.mark.usefixtures("float32_convolutions")


def spectral_model_batch(name, batch=5, device="cpu"):
    shape = (
        (6, 9, 9)
        if name == "mixed"
        else (3, 32, 32)
        if name in ("model2", "model3")
        else (1, 28, 28)
    )
    model = mixed_channel_convs() if name == "mixed" else build_model(name, shape, 10)
    x, y = torch.randn(batch, *shape), torch.randint(0, 3, (batch,))
    return model.to(device), x.to(device), y.to(device)


@pytest.mark.parametrize("filtered", [True, False])
@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("name", spectral_models())
def test_fast_spectral_norms_and_clipped_sum_equal_the_materialised_spectra(
    name, keep, filtered, device
):
    """For every spectral model: the norms and weighted sum taken without per-sample spectra
    (Parseval; contraction over samples per bin, or, with no filter after the sum, the
    book-kept kernel sum) equal those of the explicit per-sample spectra. The kernel sum is
    a different spectrum with the same kernel lags, so it is compared after the inverse."""
    torch.manual_seed(11)
    model, x, y = spectral_model_batch(name, device=device)
    w = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], device=device)
    checked = 0
    for layer in spectral_layers(model, x, y, filtered=filtered, flags=KEEP[keep]).layers:
        if not isinstance(layer, SpectralLayer):
            continue
        if isinstance(layer, SpectralConvGrads):
            assert layer._spectra_fit() == (keep == "kept")
        per = layer.per_sample()  # explicit per-sample spectra (and biases)
        want = sum(
            torch.view_as_real(t).pow(2).flatten(1).sum(1)
            if t.is_complex()
            else t.pow(2).flatten(1).sum(1)
            for t in per
        )
        torch.testing.assert_close(layer.norms_sq(), want, rtol=2e-4, atol=1e-7 * want.max().item())
        for got, t, spectral_part in zip(layer.weighted_sum(w), per, layer.spectral):
            ref = torch.einsum("b,b...->...", w.to(t.dtype), t)
            if spectral_part and getattr(layer, "kernel_sum", False):
                got, ref = layer.inverse(got), layer.inverse(ref)
            torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-5 * ref.abs().max().item())
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("padding", ["kept-zeros", "afresh"])
@pytest.mark.parametrize("name", ["mixed", "lenet5"])
def test_padded_signal_buffers_keep_their_zeros_across_batches_and_chunks(name, padding):
    """A conv layer's signals are written into zero-padded buffers kept from chunk to chunk
    and step to step: batches of other sizes (a last chunk shorter than the others, then a
    larger batch that reallocates) still give the materialised spectra's norms, as padding
    each chunk afresh does."""
    flags = EngineFlags(spectral_chunk_bytes=1, spectral_padding=padding)  # the smallest chunks
    torch.manual_seed(14)
    model, _, _ = spectral_model_batch(name)
    transform = SpectralTransform(filtered=True)
    for batch in (5, 3, 8):
        _, x, y = spectral_model_batch(name, batch)
        layers = transform(
            StepState(per_sample_of(model, x, y, flags=flags), 1.0, torch.Generator())
        ).per_sample.layers
        convs = [layer for layer in layers if isinstance(layer, SpectralConvGrads)]
        assert convs and all(layer.workspace is not None for layer in convs)
        for layer in convs:
            want = torch.view_as_real(layer._weight_per_sample()).pow(2).flatten(1).sum(1)
            torch.testing.assert_close(
                layer._weight_norms_sq(), want, rtol=2e-4, atol=1e-7 * want.max().item()
            )


def test_chunk_spectra_padded_afresh_equal_the_kept_zeros_ones():
    """The two paddings of ``EngineFlags.spectral_padding`` give the same chunk spectra."""
    from privgrad.mechanisms.spectral import fast_len

    torch.manual_seed(0)
    model, x, y = spectral_model_batch("lenet5", 4)
    layer = next(
        la for la in spectral_layers(model, x, y).layers if isinstance(la, SpectralConvGrads)
    )
    L = (fast_len(layer.M[0]), fast_len(layer.M[1]))
    x0, g0 = layer.base.inputs[0], layer.base.grads[0]
    for got, want in zip(
        layer._chunk_spectra(0, x0, g0, L, [None, None]),
        layer._chunk_spectra_afresh(0, x0, g0, L, [None, None]),
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_kept_spectra_overwritten_by_a_later_batch_are_recomputed():
    """The kept spectra of a conv layer live in memory reused from batch to batch: a layer
    view whose spectra a later view of the same layer overwrote must still sum its own."""
    torch.manual_seed(13)
    model, x, y = spectral_model_batch("lenet5")
    transform = SpectralTransform(filtered=True)
    first, second = (
        transform(StepState(per_sample_of(model, xb, y), 1.0, torch.Generator())).per_sample
        for xb in (x, torch.randn_like(x))
    )
    w = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7])
    convs = [
        (a, b) for a, b in zip(first.layers, second.layers) if isinstance(a, SpectralConvGrads)
    ]
    assert len(convs) == 2
    for a, b in convs:
        a.norms_sq()  # keeps a's spectra
        b.norms_sq()  # writes b's spectra over them
        assert a.workspace is b.workspace is not None and a.workspace.owner is b
        want = torch.einsum("b,b...->...", w.to(torch.complex64), a.per_sample()[0])
        got = a.weighted_sum(w)[0]
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", spectral_models())
@pytest.mark.parametrize(
    "mechanism,options", [("gredp", {}), ("spectral-dp", {"filter_ratio": 0.0})]
)
def test_kernel_sum_fast_path_releases_what_the_full_correlation_sum_releases(
    name, mechanism, options, device
):
    """Without a filter the book-kept kernel sum replaces the full correlation sum: with
    clipping active and the same generator, the released update is the same (same noise
    draws on the same M×M spectra, same signal at the kernel lags), for every spectral model."""
    torch.manual_seed(12)
    model, x, y = spectral_model_batch(name, batch=6, device=device)
    x = x * 3
    psg = per_sample_of(model, x, y)
    clip = psg.norms_sq().sqrt().median().item() / 4
    fast = build_mechanism(mechanism, 0.7, clip, **options)
    full = build_mechanism(mechanism, 0.7, clip, **options)
    transform = full.stages[0]
    assert isinstance(transform, SpectralTransform) and not transform.filtered
    transform.filtered = True  # the materialised-style full sum
    got, rec_fast, _ = fast.privatize(psg, 6.0, torch.Generator(device).manual_seed(5))
    want, rec_full, _ = full.privatize(psg, 6.0, torch.Generator(device).manual_seed(5))
    assert [r.effective for r in rec_fast] == [r.effective for r in rec_full]
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())
    assert (
        any(
            isinstance(layer, SpectralConvGrads) and layer.kernel_sum
            for layer in fast.stages[0](
                StepState(psg, 6.0, torch.Generator(device))
            ).per_sample.layers
        )
        or name == "model1"
    )  # model1 has no conv layer


def test_zero_noise_conv_with_active_clipping_clips_the_full_correlation_map():
    """Clipping the conv spectrum clips ‖full correlation map‖ (+ bias), not the kernel
    gradient: the update is Σ_b min(1, c/‖(R_b, bias_b)‖)·∇W_b / B, with the norms
    computed independently (conv2d over all lags)."""
    torch.manual_seed(4)
    layer = nn.Conv2d(2, 3, 3, padding=1)
    x, g = (
        torch.randn(6, 2, 7, 7),
        torch.randn(6, 3, 7, 7) * torch.logspace(-1, 1, 6)[:, None, None, None],
    )
    loss = lambda out, y: (out * y).flatten(1).sum(1)  # noqa: E731
    psg = per_sample_of(layer, x, g, loss)
    xp = F.pad(x, (1, 1, 1, 1))
    full = torch.stack(
        [F.conv2d(xp[b][:, None], g[b][:, None], padding=6).pow(2).sum() for b in range(6)]
    )
    norms = (full + g.sum((2, 3)).pow(2).sum(1)).sqrt()
    clip = norms.median().item()
    w = (clip / norms).clamp(max=1)
    assert (w < 1).any() and (w == 1).any()
    kernel, bias = psg.layers[0].per_sample()
    for mech in (
        build_mechanism("spectral-dp", 0.0, clip, filter_ratio=0.0),
        build_mechanism("gredp", 0.0, clip),
    ):
        update, _, _ = mech.privatize(psg, 10.0, torch.Generator())
        torch.testing.assert_close(
            update[0], torch.einsum("b,b...->...", w, kernel) / 10, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            update[1], torch.einsum("b,b...->...", w, bias) / 10, atol=1e-5, rtol=0
        )


# ------------------------------------------- exact privacy of the real stage chain


class BasisNoise(SpectralNoise):
    """The real noise stage (its per-coordinate std, its record) with its unit draw replaced
    by one basis vector; the unit draw itself (Re and Im each N(0, 1)) is what the
    Monte-Carlo tests below check."""

    def __init__(self, stage: SpectralNoise, which=None, real_only=False):
        super().__init__(stage.noise_multiplier, stage.part_factor)
        self.which, self.real_only = which, real_only  # (tensor index, flat index, part)

    def standard_noise(self, like, generator):
        out = [torch.zeros_like(t) for t in like]
        if self.which is not None:
            tensor, index, part = self.which
            out[tensor].view(-1)[index] = 1j if part == 1 else 1
        return out


def release_matrices(mech, psg, real_only=False):
    """(data→release per layer, noise→release, thresholds) of the chain after the clipped sum,
    built by feeding basis vectors through the real stages (float64)."""
    k = next(i for i, s in enumerate(mech.stages) if isinstance(s, SpectralNoise))
    state = StepState(psg, 1.0, torch.Generator())
    for stage in mech.stages[:k]:
        state = stage(state)
    layers, grads = (
        state.per_sample.layers,
        [g.to(torch.complex128 if g.is_complex() else torch.float64) for g in state.grads],
    )
    clip = next(s for s in mech.stages if isinstance(s, ClipPerLayer)).thresholds(len(layers))

    def release(noise_stage, values):
        st = StepState(state.per_sample, 1.0, torch.Generator())
        st.grads, st.noise_scale, st.sensitivity = values, state.noise_scale, state.sensitivity
        for stage in [noise_stage] + mech.stages[k + 1 :]:
            st = stage(st)
        return torch.cat([g.flatten() for g in st.grads]).double()

    zeros = [torch.zeros_like(g) for g in grads]
    cols = []
    for t, g in enumerate(grads):
        for j in range(g.numel()):
            for part in (0, 1) if g.is_complex() and not real_only else (0,):
                cols.append(
                    release(BasisNoise(mech.stages[k], (t, j, part)), [z.clone() for z in zeros])
                )
    noise = torch.stack(cols, 1).numpy()
    data, t = [], 0
    for layer in layers:  # data: any real object of the layer (its real signal), norm ≤ c_l
        dcols = []
        for i in range(len(layer.params)):
            spectral = isinstance(layer, SpectralLayer) and layer.spectral[i]
            shape = grads[t + i].shape
            for j in range(math.prod(shape)):
                e = torch.zeros(math.prod(shape), dtype=torch.float64)
                e[j] = 1
                e = e.view(shape)
                values = [z.clone() for z in zeros]
                values[t + i] = layer.to_spectrum(e) if spectral else e
                dcols.append(release(BasisNoise(mech.stages[k]), values))
        data.append(torch.stack(dcols, 1).numpy())
        t += len(layer.params)
    return data, noise, clip


def exact_sigma_eff(data, noise, clip):
    """Exact effective multiplier (checks/mech.py's analyze): the release is a Gaussian
    mechanism with covariance S = N Nᵀ; each layer's data moves it by L_l x_l, ‖x_l‖ ≤ c_l.
    Returns 0 if the data can move a direction no noise reaches (ε = ∞)."""
    S = noise @ noise.T
    U, s, _ = np.linalg.svd(S)
    r = int((s > 1e-10 * s.max()).sum())
    P = U[:, :r] @ U[:, :r].T
    L = np.concatenate(data, 1)
    if np.linalg.norm(L - P @ L) > 1e-8 * np.linalg.norm(L):
        return 0.0
    Sp = U[:, :r] @ np.diag(1 / s[:r]) @ U[:, :r].T
    A = L.T @ Sp @ L
    sizes = np.cumsum([0] + [d.shape[1] for d in data])
    mu2 = 0.0
    for k, c in enumerate(clip):
        block = A[sizes[k] : sizes[k + 1], sizes[k] : sizes[k + 1]]
        mu2 += c * c * np.linalg.eigvalsh(block).max()
        off = A[sizes[k] : sizes[k + 1], :].copy()
        off[:, sizes[k] : sizes[k + 1]] = 0
        assert np.abs(off).max() < 1e-8 * max(np.abs(A).max(), 1e-30)  # layers are independent
    return 1 / math.sqrt(mu2)


def tiny_psg(kind):
    torch.manual_seed(5)
    if kind == "conv":  # n = 6, m = 4: M = 9
        model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, bias=False))
        x = torch.randn(2, 1, 4, 4)
    elif kind == "circulant":
        model = nn.Sequential(BlockCirculantLinear(8, 8, 8, bias=False))
        x = torch.randn(2, 8)
    else:  # conv + bias, block-circulant with bias, dense layer
        model = nn.Sequential(
            nn.Conv2d(1, 1, 2, padding=0),
            nn.Flatten(),
            BlockCirculantLinear(4, 4, 4),
            nn.Linear(4, 2),
        )
        x = torch.randn(2, 1, 3, 3)
    y = torch.randn_like(model(x))
    return per_sample_of(model, x, y, lambda out, t: (out * t).flatten(1).sum(1))


SIGMA, C = 1.3, 0.7
EXACT = [  # (kind, mechanism, options, σ_eff/σ: exact value, or ('>=', value) for filtered crops)
    ("circulant", "spectral-dp", dict(filter_ratio=0.0), 1.0),
    ("circulant", "spectral-dp", dict(filter_ratio=0.5), 1.0),
    ("circulant", "spectral-dp", dict(filter_ratio=0.0, noise="paper"), 1 / math.sqrt(2)),
    (
        "circulant",
        "spectral-dp",
        dict(filter_ratio=0.5, filter="paper", noise="paper"),
        (">=", 1 / math.sqrt(2)),
    ),
    ("circulant", "gredp", dict(), 1 / math.sqrt(2)),
    ("conv", "spectral-dp", dict(filter_ratio=0.0), 1.0),
    ("conv", "spectral-dp", dict(filter_ratio=0.5), (">=", 1.0)),
    ("conv", "spectral-dp", dict(filter_ratio=0.0, noise="paper"), 1 / math.sqrt(2)),
    ("conv", "gredp", dict(), 1 / math.sqrt(2)),
    ("mixed", "spectral-dp", dict(filter_ratio=0.0), 1.0),
    ("mixed", "gredp", dict(), 1 / math.sqrt(2)),
    ("mixed", "gredp", dict(per_layer_clip="literal"), 1 / math.sqrt(2 * 3)),
]


@pytest.mark.parametrize("kind,name,options,factor", EXACT)
def test_exact_effective_multiplier_of_the_real_code_path(kind, name, options, factor):
    psg = tiny_psg(kind)
    mech = build_mechanism(name, SIGMA, C, **options)
    data, noise, clip = release_matrices(mech, psg)
    exact = exact_sigma_eff(data, noise, clip)
    record = mech.noise_record(len(psg.layers))
    _, runtime, _ = mech.privatize(psg, 1.0, torch.Generator())
    assert runtime == [record]  # describe() = what ran
    assert record.claimed == pytest.approx(SIGMA)
    assert exact >= record.effective * (1 - 1e-9)  # the record is never optimistic
    if isinstance(factor, tuple):
        assert exact >= factor[1] * SIGMA * (1 - 1e-9)
    else:
        assert exact == pytest.approx(factor * SIGMA, rel=1e-9)
        assert record.effective == pytest.approx(factor * SIGMA, rel=1e-12)


@pytest.mark.parametrize("kind", ["circulant", "conv"])
def test_real_valued_spectral_noise_leaves_a_direction_unnoised(kind):
    psg = tiny_psg(kind)
    for name, options in (("spectral-dp", dict(filter_ratio=0.0)), ("gredp", {})):
        data, noise, clip = release_matrices(
            build_mechanism(name, SIGMA, C, **options), psg, real_only=True
        )
        assert exact_sigma_eff(data, noise, clip) == 0.0  # ε = ∞
    with pytest.raises(PrivgradError, match="odd"):
        build_mechanism("spectral-dp", SIGMA, C, noise="real")
    with pytest.raises(PrivgradError, match="odd"):
        build_mechanism("gredp", SIGMA, C, noise="real")


def test_options_are_validated():
    with pytest.raises(PrivgradError, match="filter_ratio"):
        build_mechanism("spectral-dp", 1.0, 1.0, filter_ratio=1.0)
    with pytest.raises(PrivgradError, match="filter must"):
        build_mechanism("spectral-dp", 1.0, 1.0, filter="gaussian")
    with pytest.raises(PrivgradError, match="per_layer_clip"):
        build_mechanism("gredp", 1.0, 1.0, per_layer_clip="global")
    with pytest.raises(PrivgradError, match="does not use"):
        build_mechanism("gredp", 1.0, 1.0, filter_ratio=0.5)


@pytest.mark.parametrize(
    "name,options,n_layers,factor",
    [
        ("spectral-dp", {}, 4, 1.0),
        ("spectral-dp", dict(noise="paper"), 4, 2**-0.5),
        ("spectral-dp", dict(per_layer_clip="literal"), 4, 0.5),
        ("gredp", {}, 5, 2**-0.5),
        ("gredp", dict(per_layer_clip="literal"), 5, (2 * 5) ** -0.5),
    ],
)
def test_noise_record_and_calibration(name, options, n_layers, factor):
    mech = build_mechanism(name, 2.0, 0.3, **options)
    assert mech.noise_record(n_layers).effective == pytest.approx(2.0 * factor)
    assert mech.effective_factor(n_layers) == pytest.approx((factor, 1.0))
    assert mech.noise_multiplier == 2.0


# -------------------------------------------------- Monte-Carlo on the real code path


def noise_projections(mech, draws=60):
    """Noise of the released update along a DC and an odd (sine) direction of each block
    of a zero-gradient block-circulant layer (256 blocks of length 16)."""
    layer = BlockCirculantLinear(256, 256, 16, bias=False)
    psg = PerSampleGrads([CirculantGrads(layer, torch.zeros(4, 1, 256), torch.zeros(4, 1, 256))], 4)
    t = torch.arange(16)
    dc = torch.ones(16) / 4
    odd = torch.sin(2 * math.pi * 3 * t / 16)
    odd = odd / odd.norm()
    gen = torch.Generator().manual_seed(0)
    out_dc, out_odd = [], []
    for _ in range(draws):
        update, records, _ = mech.privatize(psg, 4.0, gen)
        blocks = update[0].reshape(-1, 16) * 4.0
        out_dc.append(blocks @ dc)
        out_odd.append(blocks @ odd)
    return torch.cat(out_dc).numpy(), torch.cat(out_odd).numpy(), records[0]


@pytest.mark.parametrize(
    "name,options",
    [
        ("spectral-dp", dict(filter_ratio=0.0)),
        ("spectral-dp", dict(noise="paper", filter_ratio=0.0)),
        ("gredp", {}),
    ],
)
def test_monte_carlo_noise_std_matches_the_record(name, options):
    mech = build_mechanism(name, 1.3, 0.7, **options)
    dc, odd, record = noise_projections(mech)
    expected = record.effective * 0.7  # one layer: sensitivity C
    assert std_matches(dc, expected) and std_matches(odd, expected)


def test_monte_carlo_catches_planted_sqrt2_and_real_noise_bugs():
    class HalfNoise(SpectralNoise):  # the paper's CN noise, still claiming σ
        def standard_noise(self, like, generator):
            return [z / math.sqrt(2) for z in super().standard_noise(like, generator)]

    class RealNoise(SpectralNoise):  # noise='real', had it not been refused
        def standard_noise(self, like, generator):
            zs = super().standard_noise(like, generator)
            return [z.real.to(t.dtype) if t.is_complex() else z for z, t in zip(zs, like)]

    mech = build_mechanism("spectral-dp", 1.3, 0.7, filter_ratio=0.0)
    mech.stages[3] = HalfNoise(1.3, 1.0)
    dc, odd, record = noise_projections(mech)
    assert record.effective == pytest.approx(1.3)
    assert not std_matches(dc, 1.3 * 0.7) and not std_matches(odd, 1.3 * 0.7)
    mech.stages[3] = RealNoise(1.3, 1.0)
    dc, odd, _ = noise_projections(mech)
    assert std_matches(dc, 1.3 * 0.7)  # the even part looks fine...
    assert odd.std() < 1e-5  # ...the odd part is released without noise


def test_monte_carlo_conv_kernel_noise():
    layer = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    x = torch.zeros(2, 8, 5, 5)
    psg = per_sample_of(
        layer, x, torch.zeros(2, 8, 5, 5), lambda out, y: (out * y).flatten(1).sum(1)
    )
    gen = torch.Generator().manual_seed(1)
    for name, options, factor in (
        ("spectral-dp", dict(filter_ratio=0.0), 1.0),
        ("gredp", {}, 2**-0.5),
    ):
        mech = build_mechanism(name, 1.1, 0.9, **options)
        samples = torch.cat([mech.privatize(psg, 2.0, gen)[0][0].flatten() * 2 for _ in range(30)])
        assert std_matches(samples.numpy(), factor * 1.1 * 0.9)


# ------------------------------------------------------------- training, empty batches


def tiny_trainer(mechanism, n=60, batch=10, **options):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        BlockCirculantLinear(2 * 6 * 6, 8, 4),
        nn.Tanh(),
        nn.Linear(8, 3),
    )
    x, y = torch.randn(n, 1, 6, 6), torch.randint(0, 3, (n,))
    return privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        mechanism=mechanism,
        noise_multiplier=1.0,
        batch_size=batch,
        max_grad_norm=1.0,
        **options,
    )


def test_training_steps_and_honest_epsilon():
    trainers = {name: tiny_trainer(name) for name in ("dpsgd", "spectral-dp", "gredp")}
    for trainer in trainers.values():
        for batch in trainer.batches(3):
            assert math.isfinite(trainer.step(batch))
    ledgers = {name: t.ledger.entries for name, t in trainers.items()}
    assert ledgers["spectral-dp"] == ledgers["dpsgd"]  # accounted as DP-SGD at σ
    assert trainers["gredp"].claimed_ledger.entries == ledgers["dpsgd"]  # the paper's claim: σ
    assert ledgers["gredp"] == [
        [trainers["dpsgd"].sampler.event(1.0 / math.sqrt(2)), 3]
    ]  # honest: σ/√2


def test_empty_batch_uses_the_last_geometry_and_still_filters(empty_batch):
    trainer = tiny_trainer("spectral-dp", filter_ratio=0.5)
    batch = next(trainer.batches(1))
    trainer.step(batch)
    params = list(trainer.model.parameters())
    before = [p.detach().clone() for p in params]
    trainer.optimizer = torch.optim.SGD(params, lr=1.0)
    trainer.step(empty_batch(trainer))
    assert trainer.steps == 2 and trainer.last_facts.spectral_layers == 2
    step = before[2] - params[2].detach()  # block-circulant weight: filtered noise only
    spectrum = torch.fft.fft(step, norm="ortho")
    assert (
        spectrum[..., 1:].abs().max() < 1e-5 and spectrum[..., 0].abs().min() > 0
    )  # d = 4, ρ = ½: keeps DC only


def test_plan_learns_the_geometry_before_a_first_empty_batch(empty_batch):
    trainer = tiny_trainer("spectral-dp", filter_ratio=0.5)
    trainer.mechanism.stages[0].plan(trainer.plan_context(1))  # make_private does this
    trainer.step(empty_batch(trainer))
    assert trainer.steps == 1 and trainer.last_facts.spectral_layers == 2


def test_first_empty_batch_without_geometry_is_refused_with_a_filter():
    model = tiny_trainer("dpsgd").model
    empty = GradSampler(model).empty()
    with pytest.raises(PrivgradError, match="empty"):
        build_mechanism("spectral-dp", 1.0, 1.0).privatize(empty, 10.0, torch.Generator())
    for mech in (
        build_mechanism("gredp", 1.0, 1.0),
        build_mechanism("spectral-dp", 1.0, 1.0, filter_ratio=0.0),
    ):
        update, _, _ = mech.privatize(
            empty, 10.0, torch.Generator()
        )  # no filter: same distribution
        assert [u.shape for u in update] == [p.shape for p in model.parameters()]


# -------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    "name,shape",
    [
        ("lenet5-bc", (1, 28, 28)),
        ("model1", (1, 28, 28)),
        ("model2", (3, 32, 32)),
        ("model3", (3, 32, 32)),
    ],
)
def test_paper_models_build_and_run(name, shape):
    assert name in MODELS
    model = build_model(name, shape, 10)
    assert model(torch.randn(2, *shape)).shape == (2, 10)
    wrong = (shape[0], 30, 30)
    if name != "model2":
        with pytest.raises(PrivgradError, match="takes"):
            build_model(name, wrong, 10)


def test_model1_layout():
    model = build_model("model1", (1, 28, 28), 10, act="relu")
    bc = [m for m in model if isinstance(m, BlockCirculantLinear)]
    assert [(m.in_features, m.out_features, m.block_size) for m in bc] == [
        (784, 2048, 8),
        (2048, 1024, 8),
        (1024, 160, 8),
        (160, 10, 10),
    ]
    assert any(isinstance(m, nn.ReLU) for m in model)


def test_lenet5_bc_per_sample_spectral_step():
    model = build_model("lenet5-bc", (1, 28, 28), 10)
    x, y = torch.randn(3, 1, 28, 28), torch.randint(0, 10, (3,))
    psg = per_sample_of(model, x, y)
    update, records, facts = build_mechanism("spectral-dp", 1.0, 0.1).privatize(
        psg, 3.0, torch.Generator()
    )
    assert facts.spectral_layers == 5 and len(records) == 1
    assert [u.shape for u in update] == [p.shape for p in model.parameters()]
