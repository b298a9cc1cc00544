"""One example's effect on the clipped sum stays C in float32, for inputs crafted to cancel.

A per-sample gradient Σ_t g_t a_tᵀ of a layer applied at several positions (a linear layer on
a sequence, a convolution's patches) is computed by different float32 sums for its norm
(the Gram form Σ_{t,t'} (a_t·a_t')(g_t·g_t'), or a build) and for the clipped sum it enters
(book-keeping over the batch). An example whose positions hold huge opposite inputs, here
a_1 = (M, s) and a_2 = (−M, 0), has a moderate true gradient (∝ s) whose Gram norm rounds
to zero: unguarded, it went unclipped and moved the released sum by 70 C (M = 2²⁰) to
700 C (M = 2³⁰), with ε accounted for C. Add/remove neighbours, σ = 0, every example in
the batch (q = 1): the released sums must differ by at most C.
"""

import warnings

import pytest
import torch
from torch import nn

import privgrad
from privgrad.layers.circulant import BlockCirculantLinear
from privgrad.per_sample import EngineFlags


class _Pooled(nn.Module):
    """One layer over 2 positions of 2 features, averaged into 10 logits."""

    def __init__(self, kind: str, bias: bool):
        super().__init__()
        self.kind = kind
        self.layer = (
            nn.Linear(2, 10, bias=bias) if kind == "linear" else nn.Conv2d(2, 10, 1, bias=bias)
        )

    def forward(self, x):  # x: (B, positions, features)
        if self.kind == "linear":
            return self.layer(x).mean(1)
        return self.layer(x.transpose(1, 2).unsqueeze(-1)).mean((2, 3))


def _moved(make_model, crafted, others, trained=lambda model: model, **options) -> float:
    """How far (in C) adding the ``crafted`` (x, y) to ``others`` moves the released sum:
    ``make_model()``'s ``trained(model)`` parameters after one DP-SGD step at σ = 0 with every
    example in the batch (q = 1), times B; ``options`` go to ``make_private``."""

    def released_sum(x, y):
        torch.manual_seed(0)
        model = make_model()
        params = list(trained(model).parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # σ = 0: ε = ∞, said in a warning
            trainer = privgrad.make_private(
                model,
                torch.optim.SGD(params, lr=1.0),
                (x, y),
                noise_multiplier=0.0,
                batch_size=len(y),
                seed=0,
                **options,
            )
        before = [p.detach().clone() for p in params]
        (batch,) = trainer.batches(1)
        assert len(batch) == len(y)  # q = 1: every example is in the batch
        trainer.step(batch)
        return [(p.detach() - b) * len(y) for p, b in zip(params, before)]  # ×B: the sum

    def joined(a, b):
        return tuple(map(joined, a, b)) if isinstance(a, tuple) else torch.cat([a, b])

    with_it = released_sum(*joined(others, crafted))
    without = released_sum(*others)
    return float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(with_it, without))))


def _assert_within_c(moved: float) -> None:
    assert moved <= 1.0 + 1e-3, f"one example moved the clipped sum by {moved:.3f} C"


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
@pytest.mark.parametrize("form", ["ghost", "build"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("big", [2.0**30])  # 2²⁰ fails the ghost form too (70 C), not the build
def test_an_example_of_cancelling_huge_inputs_moves_the_clipped_sum_by_at_most_c(
    kind, form, bias, big
):
    torch.manual_seed(1)
    others_x, others_y = torch.randn(7, 2, 2) * 0.1, torch.randint(0, 10, (7,))
    crafted = torch.tensor([[[big, 100.0], [-big, 0.0]]])
    torch.manual_seed(0)
    with torch.no_grad():  # a label the model gets wrong: its gradient is not ~0
        label = _Pooled(kind, bias)(torch.tensor([[[0.0, 100.0], [0.0, 0.0]]])).argmin(1)
    moved = _moved(
        lambda: _Pooled(kind, bias),
        (crafted, label),
        (others_x, others_y),
        max_grad_norm=1.0,
        flags=EngineFlags(norm_form=form),
    )
    _assert_within_c(moved)


@pytest.mark.parametrize("conv_gram", ["cells", "patches"])
def test_both_gram_forms_of_a_conv_move_the_clipped_sum_by_at_most_c(conv_gram):
    """The conv's Gram form by cells and by patches, each taking the guard's magnitudes off
    its Grams' diagonals (the crafted example of the test above, 2³⁰)."""
    torch.manual_seed(1)
    others_x, others_y = torch.randn(7, 2, 2) * 0.1, torch.randint(0, 10, (7,))
    crafted = torch.tensor([[[2.0**30, 100.0], [-(2.0**30), 0.0]]])
    torch.manual_seed(0)
    with torch.no_grad():
        label = _Pooled("conv2d", True)(torch.tensor([[[0.0, 100.0], [0.0, 0.0]]])).argmin(1)
    moved = _moved(
        lambda: _Pooled("conv2d", True),
        (crafted, label),
        (others_x, others_y),
        max_grad_norm=1.0,
        flags=EngineFlags(norm_form="ghost", conv_gram=conv_gram),
    )
    _assert_within_c(moved)


@pytest.mark.parametrize("conv_gram", ["cells", "patches"])
@pytest.mark.parametrize(
    "kernel, stride, padding, calls",
    [(3, 1, 1, 1), (4, 2, 0, 1), (2, 2, 1, 1), (4, 2, 1, 2), ((2, 4), (1, 2), (0, 1), 1)],
)
def test_the_gram_forms_magnitudes_are_the_convolutions(conv_gram, kernel, stride, padding, calls):
    """U = Σ_t ‖a_t‖·‖g_t‖ as the Gram forms read it off their diagonals equals U by the
    convolution of the squared input with a kernel of ones (ConvGrads._weight_magnitudes),
    per sample, over every call of the layer."""
    from privgrad.per_sample.rules import ConvGrads

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, kernel, stride, padding)
    xs = [torch.randn(4, 3, 9, 8) * (1 + 3 * i) for i in range(calls)]
    gs = [torch.randn_like(conv(x)) for x in xs]
    flags = EngineFlags(norm_form="ghost", conv_gram=conv_gram, gram_blocks_from=4)
    layer = ConvGrads(conv, xs, gs, flags)
    assert layer.use_ghost and layer.gram_by_cells == (conv_gram == "cells")
    norms_sq, u = layer._weight_norms_sq()
    torch.testing.assert_close(u, layer._weight_magnitudes(), rtol=1e-5, atol=0)

    def grad(x, g):  # one example's weight gradient of one call
        return torch.func.grad(lambda w: (conv._conv_forward(x, w, None) * g).sum())(conv.weight)

    built = [sum(grad(x[i : i + 1], g[i : i + 1]) for x, g in zip(xs, gs)) for i in range(4)]
    built = torch.stack([b.square().sum() for b in built])  # the norms, against autograd's
    torch.testing.assert_close(norms_sq, built, rtol=1e-4, atol=0)


class _Tied(nn.Module):
    """Two linear layers sharing one weight (tied), each reading one position."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 10, bias=False), nn.Linear(2, 10, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.first(x[:, 0]) + self.second(x[:, 1])


@pytest.mark.parametrize("big", [2.0**20, 2.0**30])
def test_tied_layers_whose_gradients_cancel_move_the_clipped_sum_by_at_most_c(big):
    """The tied weight's norm ‖g¹ + g²‖² = ‖g¹‖² + ‖g²‖² + 2⟨g¹, g²⟩ with g¹ = g(M, s)ᵀ and
    g² = g(−M, 0)ᵀ: float32 gave 0 or less (141 C moved at M = 2²⁰, NaN parameters at 2³⁰)."""
    torch.manual_seed(1)
    others_x, others_y = torch.randn(7, 2, 2) * 0.1, torch.randint(0, 10, (7,))
    crafted = torch.tensor([[[big, 100.0], [-big, 0.0]]])
    torch.manual_seed(0)
    with torch.no_grad():
        label = _Tied()(torch.tensor([[[0.0, 100.0], [0.0, 0.0]]])).argmin(1)

    _assert_within_c(_moved(_Tied, (crafted, label), (others_x, others_y)))


class _ScaledEmbedding(nn.Module):
    """Token embeddings scaled by a per-position input, averaged into 10 logits."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 10)

    def forward(self, tokens, scale):
        return (self.embedding(tokens) * scale[..., None]).mean(1)


@pytest.mark.parametrize("big", [2.0**20, 2.0**30])
def test_one_token_with_cancelling_gradients_moves_the_clipped_sum_by_at_most_c(big):
    """Token 1 at both positions, scaled by (M(1 + 2⁻¹⁴), −M): its row's gradient is
    2⁻¹⁴M·h, whose token-match Gram norm rounded away (45 C moved at M = 2²⁰, 46,000 C at
    2³⁰)."""
    torch.manual_seed(1)
    others = torch.randint(0, 5, (7, 2)), torch.randn(7, 2)
    others_y = torch.randint(0, 10, (7,))
    tokens, scale = torch.tensor([[1, 1]]), torch.tensor([[big * (1 + 2.0**-14), -big]])
    torch.manual_seed(0)
    with torch.no_grad():
        label = _ScaledEmbedding()(tokens, torch.tensor([[1.0, 0.0]])).argmin(1)

    _assert_within_c(_moved(_ScaledEmbedding, ((tokens, scale), label), (others, others_y)))


class _Depthwise(nn.Module):
    """A depthwise Conv1d (4 groups), averaged over positions, under a frozen head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, groups=4, bias=False)
        self.head = nn.Linear(4, 10).requires_grad_(False)

    def forward(self, x):
        return self.head(self.conv(x).mean(2))


def test_a_depthwise_conv_of_alternating_huge_inputs_moves_the_clipped_sum_by_at_most_c():
    """Inputs ±2³⁴ alternating along 34 positions (plus N(0, 1)): the built gradients'
    norms and the book-kept sum, two convolutions over the same huge terms, disagreed, and
    the example moved the sum of 100 identical others by 7.5 C."""
    torch.manual_seed(1)
    others_x, others_y = torch.randn(1, 4, 34).repeat(100, 1, 1), torch.zeros(100, dtype=torch.long)
    torch.manual_seed(0)
    alternating = torch.tensor([1.0, -1.0]).repeat(17)
    crafted = (2.0**34 * alternating * torch.randn(4, 1).sign() + torch.randn(4, 34))[None]

    crafted_y = torch.tensor([1])
    _assert_within_c(
        _moved(_Depthwise, (crafted, crafted_y), (others_x, others_y), lambda m: m.conv)
    )


class _Conv3d(nn.Module):
    """A Conv3d along 34 positions of 4 channels, averaged, under a frozen head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(4, 4, (1, 1, 3), bias=False)
        self.head = nn.Linear(4, 10).requires_grad_(False)

    def forward(self, x):  # x: (B, 4, 34)
        return self.head(self.conv(x[:, :, None, None, :]).mean((2, 3, 4)))


def test_a_conv3d_whose_sum_is_book_kept_moves_the_clipped_sum_by_at_most_c():
    """Conv3d's norms from built gradients, its sum by another conv3d_weight (when the built
    ones are not kept): on inputs ±2³⁴ alternating along 34 positions the two disagreed and
    the example moved the sum of 100 identical others by 12.5 C."""
    torch.manual_seed(1)
    others_x, others_y = torch.randn(1, 4, 34).repeat(100, 1, 1), torch.zeros(100, dtype=torch.long)
    torch.manual_seed(0)
    alternating = torch.tensor([1.0, -1.0]).repeat(17)
    crafted = (2.0**34 * alternating * torch.randn(4, 1).sign() + torch.randn(4, 34))[None]

    moved = _moved(
        _Conv3d,
        (crafted, torch.tensor([1])),
        (others_x, others_y),
        lambda m: m.conv,
        flags=EngineFlags(keep_built=False),
    )
    _assert_within_c(moved)


class _Circulant(nn.Module):
    """Spectral-DP's block-circulant layer on 34 positions, averaged, under a frozen head."""

    def __init__(self, bias: bool):
        super().__init__()
        self.layer = BlockCirculantLinear(4, 4, 4, bias=bias)
        self.head = nn.Linear(4, 10).requires_grad_(False)

    def forward(self, x):  # x: (B, 34, 4)
        return self.head(self.layer(x).mean(1))


@pytest.mark.parametrize("mechanism", ["dpsgd", "spectral-dp"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_block_circulant_layer_on_positions_moves_the_clipped_sum_by_at_most_c(bias, mechanism):
    """At T > 1 positions its norms come from built gradients and its sum adds the positions'
    spectral products in another order: ±2³⁴ alternating inputs moved the sum by 5 C."""
    torch.manual_seed(1)
    others_x, others_y = torch.randn(1, 34, 4).repeat(100, 1, 1), torch.zeros(100, dtype=torch.long)
    torch.manual_seed(0)
    alternating = torch.tensor([1.0, -1.0]).repeat(17)[:, None]
    crafted = (2.0**34 * alternating * torch.randn(1, 4).sign() + torch.randn(34, 4))[None]

    moved = _moved(
        lambda: _Circulant(bias),
        (crafted, torch.tensor([1])),
        (others_x, others_y),
        lambda m: m.layer,
        mechanism=mechanism,
    )
    _assert_within_c(moved)


class _ConvTwice(nn.Module):
    """One Conv2d called on two inputs (its per-sample spectra add up), under a frozen head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.head = nn.Linear(4, 10).requires_grad_(False)

    def forward(self, x):  # x: (B, 2 calls, 2, 6, 6)
        return self.head((self.conv(x[:, 0]) + self.conv(x[:, 1])).mean((2, 3)))


@pytest.mark.parametrize(
    "mechanism, options",
    [("gredp", {}), ("spectral-dp", {"filter_ratio": 0.0}), ("spectral-dp", {})],
)
def test_a_conv_called_twice_in_a_spectral_chain_moves_the_clipped_sum_by_at_most_c(
    mechanism, options
):
    """A conv called on x and on −x + small noise, x of 2³⁴: its norm, from the calls' summed
    spectra, and its clipped sum, the calls' terms added in another order, disagreed, and
    the example moved the sum of 100 identical others by 67 C (GReDP, Spectral-DP at ρ = 0)."""
    torch.manual_seed(1)
    others_x = torch.randn(1, 2, 2, 6, 6).repeat(100, 1, 1, 1, 1)
    others_y = torch.zeros(100, dtype=torch.long)
    torch.manual_seed(0)
    u = torch.randn(2, 6, 6)
    crafted = torch.stack([2.0**34 * u + torch.randn(2, 6, 6), -(2.0**34) * u])[None]

    moved = _moved(
        _ConvTwice,
        (crafted, torch.tensor([1])),
        (others_x, others_y),
        lambda m: m.conv,
        mechanism=mechanism,
        **options,
    )
    _assert_within_c(moved)


class _UserLinear(nn.Linear):
    """A linear layer with a forward of its own: it takes a user's registered rule."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class _NormsWithoutBias(privgrad.per_sample.LayerGrads):
    """A user's rule with a bug: its norms leave out the bias's part, its sum adds it."""

    def __init__(self, module, a, g):
        self.params, self.a, self.g = [module.weight, module.bias], a, g

    def per_sample(self):
        return [torch.einsum("bo,bi->boi", self.g, self.a), self.g.clone()]

    def norms_sq(self):
        return self.a.square().sum(1) * self.g.square().sum(1)

    def weighted_sum(self, w):
        return [torch.einsum("b,bo,bi->oi", w, self.g, self.a), torch.einsum("b,bo->o", w, self.g)]


class _Scaled(nn.Module):
    """A user-ruled layer whose outputs are scaled by 1000, so its bias's gradient is large."""

    def __init__(self, layer_type):
        super().__init__()
        self.layer = layer_type(4, 3)
        with torch.no_grad():
            self.layer.bias.copy_(torch.tensor([0.05, 0.0, -0.05]))

    def forward(self, x):
        return 1000.0 * self.layer(x)


@pytest.mark.parametrize("fast_views", [False, True])
def test_a_user_rule_whose_norms_understate_its_sum_is_clipped_or_refused(fast_views):
    """A rule registered by a user (register_rule) is trusted with the per-sample gradients
    it builds, not with norms computed apart from its sum: by default both come from its
    per_sample(), so the crafted example (tiny inputs, a large bias gradient its buggy norm
    leaves out) adds at most C; it moved the clipped sum by 1,414 C when the rule's own
    norms_sq clipped its weighted_sum. With fast_views=True its own views are used, and
    make_private's probe refuses norms that fall short of the sum's contribution."""
    layer_type = type("_BuggyLinear", (_UserLinear,), {})
    privgrad.per_sample.register_rule(
        layer_type,
        lambda m, inputs, grads: _NormsWithoutBias(m, inputs[0], grads[0]),
        fast_views=fast_views,
    )
    try:
        torch.manual_seed(0)
        others = (torch.randn(20, 4), torch.randint(0, 3, (20,)))
        crafted = (torch.full((1, 4), 1e-6), torch.tensor([2]))
        if fast_views:
            with pytest.raises(privgrad.PrivgradError, match="per-sample norm .* is smaller"):
                _moved(lambda: _Scaled(layer_type), crafted, others)
        else:
            _assert_within_c(_moved(lambda: _Scaled(layer_type), crafted, others))
    finally:
        del privgrad.per_sample.rules.RULES[layer_type]


def test_a_saturated_classifiers_underflowing_norm_is_not_taken_for_a_short_one():
    """Raw integer features (1 to 99) into a Linear classifier: an example whose softmax is
    saturated has a gradient of about 7e-22, whose float32 square underflows to 0, and the
    probe refused its per-sample norm (0) as smaller than what its sum adds (7.2e-22). A norm
    below the root of float32's smallest normal number is read as that root now (the example
    adds far less than C); a rule whose norm falls short by more is refused (test above)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 100, (300, 10), generator=g).float()
    y = torch.randint(0, 3, (300,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=10,
    )  # fmt: skip
    trainer.step(next(trainer.batches(1)))
    assert trainer.steps == 1


def test_a_user_rule_with_sound_fast_views_trains_as_its_built_gradients():
    """A rule whose norms are right (fast_views=True) is accepted, and its step equals the
    one from its built gradients (the default) to float rounding."""

    class Sound(_NormsWithoutBias):
        def norms_sq(self):
            return super().norms_sq() + self.g.square().sum(1)

    steps = []
    for fast_views in (False, True):
        layer_type = type("_SoundLinear", (_UserLinear,), {})
        privgrad.per_sample.register_rule(
            layer_type,
            lambda m, inputs, grads: Sound(m, inputs[0], grads[0]),
            fast_views=fast_views,
        )
        try:
            torch.manual_seed(0)
            x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
            torch.manual_seed(1)
            model = _Scaled(layer_type)
            trainer = privgrad.make_private(
                model,
                torch.optim.SGD(model.parameters(), lr=1.0),
                (x, y),
                noise_multiplier=1.0,
                batch_size=10,
                seed=0,
            )
            for batch in trainer.batches(3):
                trainer.step(batch)
            steps.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        finally:
            del privgrad.per_sample.rules.RULES[layer_type]
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-5, atol=1e-6)
