"""Per-sample rules of issue 39's layers equal a loop of single-example autograd.

Each model runs with the generic (vmap) rule disabled, so a layer without its own rule
fails here instead of passing by the fallback; norms and clipped sums come from a fresh
pass (their fast forms: Gram/ghost norms, chunked builds, book-kept sums), the per-sample
gradients from another."""

import functools

import pytest
import torch
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.per_sample import EngineFlags, GradSampler, engine, rules
from privgrad.private import per_sample_cross_entropy
from test_per_sample import loop_grads
from kernel_guard import skip_unless_fused_runs  # tests/kernel_guard.py

pytestmark = pytest.mark.usefixtures("float32_convolutions")


def _no_generic(module, inputs, grads, **flags):
    raise AssertionError(f"{type(module).__name__} fell to the generic vmap rule")


class Twice(nn.Module):
    """``first`` then ``second`` applied twice (one layer, two calls), to a linear head."""

    def __init__(self, first, second, classes=3):
        super().__init__()
        self.first, self.second, self.head = first, second, nn.LazyLinear(classes)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.head(torch.tanh(self.second(torch.tanh(self.second(h)))).flatten(1))


class Seq(nn.Module):
    """Sequence input (B, T, d) through ``body``, then flattened to a linear head."""

    def __init__(self, *body, classes=3):
        super().__init__()
        self.body, self.head = nn.Sequential(*body), nn.LazyLinear(classes)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


LAYER_CASES = {
    # grouped and depthwise (MobileNet, EfficientNet, ConvNeXt; Mamba's Conv1d), called twice
    "conv-grouped": (
        lambda: Twice(
            nn.Conv2d(4, 6, 3, padding=1, groups=2),
            nn.Conv2d(6, 6, 3, stride=2, padding=2, dilation=2, groups=6, bias=False),
        ),
        lambda: torch.randn(6, 4, 9, 8),
    ),
    # padding by name (an even kernel pads asymmetrically) or of another mode
    "conv-padded": (
        lambda: Seq(
            nn.Conv2d(3, 4, (2, 3), padding="same", dilation=(2, 1)),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=(1, 2), padding_mode="circular", groups=2),
            nn.Tanh(),
            nn.Conv2d(4, 5, 3, padding="valid", stride=2, padding_mode="replicate"),
            nn.Tanh(),
            nn.Conv2d(5, 5, 3, padding="same", groups=5),  # EfficientNet's depthwise
        ),
        lambda: torch.randn(6, 3, 9, 8),
    ),
    "conv1d-padded": (
        lambda: Seq(
            nn.Conv1d(3, 4, 4, padding="same"),
            nn.Tanh(),
            nn.Conv1d(4, 4, 3, padding=2, padding_mode="reflect", groups=4),
        ),
        lambda: torch.randn(6, 3, 11),
    ),
    "conv1d-depthwise": (
        lambda: Seq(
            nn.Conv1d(3, 6, 3, padding=1, groups=3),
            nn.Tanh(),
            nn.Conv1d(6, 6, 4, groups=6, stride=2),
        ),
        lambda: torch.randn(6, 3, 19),
    ),
    "conv1d": (
        lambda: Seq(
            nn.Conv1d(3, 4, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.Conv1d(4, 5, 2, dilation=2, bias=False),
            nn.Tanh(),
            nn.Conv1d(5, 4, 4, stride=2),
        ),
        lambda: torch.randn(6, 3, 19),
    ),
    "conv3d": (
        lambda: Seq(
            nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1),
            nn.Tanh(),
            nn.Conv3d(3, 2, 2, dilation=(1, 1, 2), bias=False),
        ),
        lambda: torch.randn(6, 2, 4, 5, 6),
    ),
    "conv-transpose2d": (
        lambda: Seq(
            nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
            nn.Tanh(),
            nn.ConvTranspose2d(3, 4, (2, 3), dilation=(1, 2), bias=False),
            nn.Tanh(),
            nn.ConvTranspose2d(4, 2, 4, stride=(2, 1), padding=(1, 2)),
        ),
        lambda: torch.randn(6, 2, 4, 5),
    ),
    "conv-transpose1d-3d": (
        lambda: Seq(
            nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1),
            nn.Tanh(),
            nn.Unflatten(2, (2, 2, -1)),
            nn.ConvTranspose3d(2, 3, (2, 1, 3), stride=(1, 2, 1), padding=(0, 0, 1)),
            nn.Tanh(),
            nn.ConvTranspose3d(3, 2, 2, dilation=(2, 1, 1), bias=False),
        ),
        lambda: torch.randn(6, 3, 6),
    ),
    "rmsnorm": (
        lambda: Seq(nn.Linear(5, 8), nn.RMSNorm(8), nn.Tanh(), nn.RMSNorm((7, 8), eps=1e-3)),
        lambda: torch.randn(6, 7, 5),
    ),
    "instancenorm": (
        lambda: Seq(
            nn.Conv1d(2, 4, 3),
            nn.InstanceNorm1d(4, affine=True),
            nn.Tanh(),
            nn.Unflatten(2, (1, 5)),
            nn.InstanceNorm2d(4, affine=True),
            nn.Tanh(),
            nn.Unflatten(3, (1, 5)),
            nn.InstanceNorm3d(4, affine=True, eps=1e-3),
        ),
        lambda: torch.randn(6, 2, 7),
    ),
    "prelu": (
        lambda: Seq(
            nn.Linear(5, 4),
            nn.PReLU(),
            nn.Linear(4, 4),
            nn.PReLU(7, init=0.1),
            nn.Unflatten(2, (2, 2)),
            nn.PReLU(7, init=-0.3),
        ),
        lambda: torch.randn(6, 7, 5),
    ),
}


def check_against_loop(model, x, y, device, monkeypatch, rtol=1e-4, atol=2e-5, flags=None):
    model(x)  # materialise lazy layers
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(model, settle=True, flags=flags or EngineFlags())
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    assert [id(p) for p in fast.params] == [id(p) for p in model.parameters() if p.requires_grad]
    norms = fast.norms_sq()
    w = torch.rand(len(x), device=device)
    sums = fast.weighted_sum(w)
    slow, _ = sampler.compute(x, y, per_sample_cross_entropy)
    per_sample = [g for layer in slow.layers for g in layer.per_sample()]
    expected = loop_grads(model, x, y, per_sample_cross_entropy)
    for i in range(len(x)):
        for got, want in zip(per_sample, expected[i]):
            torch.testing.assert_close(got[i], want, atol=atol, rtol=rtol)
    want_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in expected])
    torch.testing.assert_close(norms, want_norms, rtol=1e-4, atol=1e-6)
    for got, *per_example in zip(sums, *expected):
        torch.testing.assert_close(
            got, sum(wi * g for wi, g in zip(w, per_example)), atol=atol, rtol=rtol
        )


CONV_FORMS = ["ghost", "build-grouped", "build-correlation", "build-patches", "fused"]


@pytest.mark.parametrize(
    "name, form",
    [(name, "default") for name in LAYER_CASES]
    + [(name, form) for name in LAYER_CASES if name.startswith("conv") for form in CONV_FORMS],
)
def test_layer_rule_equals_loop(name, form, device, monkeypatch):
    """Every new rule, and for the conv rules every form of the Conv2d machinery they reuse
    (Gram norms, the three builds, chunked, the fused kernel, with book-kept sums)."""
    flags = EngineFlags()
    if form != "default":
        if form == "fused":
            skip_unless_fused_runs(device)
        flags = EngineFlags(
            norm_form=form.split("-")[0],
            conv_build=form.removeprefix("build-") if form.startswith("build-") else "auto",
            chunk_floats=1,
            cuda_chunk_floats=1,
            keep_built=False,
        )
    make, make_x = LAYER_CASES[name]
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, 3, (6,), device=device)
    x[0] = x[1]
    check_against_loop(model, x, y, device, monkeypatch, flags=flags)


class Encoder(nn.Module):
    """Embedding, two TransformerEncoderLayers (norm first and last) with a padding mask."""

    def __init__(self, batch_first, dropout=0.0):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=batch_first),
            1,
            norm=nn.LayerNorm(8),
            enable_nested_tensor=False,
        )
        self.layer2 = nn.TransformerEncoderLayer(
            8, 2, 12, dropout=dropout, batch_first=batch_first, norm_first=True, activation="gelu"
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        pad = x == 0
        h = self.emb(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.layer2(self.layers(h, src_key_padding_mask=pad), src_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


class Decoder(nn.Module):
    """A TransformerDecoderLayer with a causal mask, a target padding mask and a memory
    padding mask, its memory from a TransformerEncoderLayer."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(20, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.dec = nn.TransformerDecoderLayer(8, 4, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        pad = x == 0
        h = self.emb(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        mem = self.enc(h, src_key_padding_mask=pad)
        causal = torch.triu(
            torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1
        )
        h = self.dec(
            h,
            mem,
            tgt_mask=causal,
            tgt_is_causal=True,
            tgt_key_padding_mask=pad,
            memory_key_padding_mask=pad,
        )
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h[:, -1] + h.mean(1))


class CrossAttention(nn.Module):
    """MultiheadAttention called directly: key/value widths differing from the query's
    (q/k/v_proj_weight), bias_k/bias_v, add_zero_attn, a per-sample 3-D attn_mask (one per
    head), the attention weights returned (unused) and keyword arguments."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.attn = nn.MultiheadAttention(
            6, 2, kdim=5, vdim=4, add_bias_kv=True, add_zero_attn=True, batch_first=batch_first
        )
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        q, k, v = x[:, :3, :6], torch.tanh(x[:, :, 1:6]), x[:, :, 2:6]
        mask = (q[..., :1] > k[..., :1].transpose(1, 2)).repeat_interleave(2, 0)  # (B·heads, 3, 7)
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out, weights = self.attn(query=q, key=k, value=v, attn_mask=mask)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out.sum(1))


class FullTransformer(nn.Module):
    """nn.Transformer (encoder and decoder stacks with their final LayerNorms), causal target
    mask, padding masks on source, target and memory."""

    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(20, 8)
        self.model = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        pad, T = x == 0, x.shape[1]
        src, tgt = self.emb(x), self.emb(x.flip(1))
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        h = self.model(
            src,
            tgt,
            tgt_mask=self.model.generate_square_subsequent_mask(T, device=x.device),
            tgt_is_causal=True,
            src_key_padding_mask=pad,
            memory_key_padding_mask=pad,
        )
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


def tokens(B=6, T=7):
    x = torch.randint(1, 20, (B, T))
    x[0, 4:] = 0  # padding (the first example's last three tokens)
    x[2, 6] = 0
    return x


ATTENTION_CASES = {
    "encoder": (Encoder, tokens),
    "decoder": (Decoder, tokens),
    "transformer": (FullTransformer, tokens),
    "cross-attention": (CrossAttention, lambda: torch.randn(6, 7, 6)),
}


@pytest.mark.filterwarnings("ignore:.*batching rule", "ignore:enable_nested_tensor is True")
@pytest.mark.parametrize(
    "form", ["book-kept", "book-kept-ghost", "book-kept-built", "book-kept-fused", "vmap"]
)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_rule_equals_loop(name, batch_first, form, device, monkeypatch):
    """MultiheadAttention (in TransformerEncoderLayer / DecoderLayer, with padding and causal
    masks, or called directly with every option), batch first or second, dropout off; by
    the book-kept rule (its projections' norms by Gram or built gradients) and by vmap."""
    flags = EngineFlags()
    if form == "vmap":
        monkeypatch.setitem(rules.RULES, nn.MultiheadAttention, rules.mha_vmap_rule)
    elif form == "book-kept-fused":
        skip_unless_fused_runs(device)
        flags = EngineFlags(norm_form="fused")
    elif form != "book-kept":
        flags = EngineFlags(norm_form="ghost" if form.endswith("ghost") else "build")
    make, make_x = ATTENTION_CASES[name]
    model = make(batch_first).to(device)
    x, y = make_x().to(device), torch.randint(0, 3, (6,), device=device)
    check_against_loop(model, x, y, device, monkeypatch, flags=flags)


def test_attention_dropout_without_its_mask_is_refused():
    """The vmap rule (and the book-kept one, given a call whose dropout mask was not kept)
    cannot replay attention dropout: an error naming the fix, not a wrong gradient."""
    from privgrad.errors import PrivgradError

    model = Encoder(True, dropout=0.1)
    for rule in (rules.mha_vmap_rule, rules.mha_rule):
        with pytest.raises(PrivgradError, match=r"self_attn.dropout = 0.0"):
            rule(
                model.layer2.self_attn,
                [rules.Call(model.layer2.self_attn, (torch.zeros(2, 3, 8),) * 3, {})],
                [torch.zeros(2, 3, 8)],
            )


@pytest.mark.parametrize("name", ["encoder", "encoder-seq-first", "cross-attention"])
def test_attention_dropout_is_replayed(name, monkeypatch):
    """Attention dropout in training: the engine computes the attention's output itself with
    a dropout mask it keeps, and the rule replays that mask. Each example's gradient equals
    the gradient of its own loss through the very forward pass that ran (examples never
    interact, so that is its single-example gradient with the masks drawn)."""
    torch.manual_seed(0)
    if name.startswith("encoder"):
        model, x = Encoder(name == "encoder", dropout=0.0), tokens()
        for layer in (model.layers.layers[0], model.layer2):
            layer.self_attn.dropout = 0.5
    else:
        model, x = CrossAttention(True), torch.randn(6, 7, 6)
        model.attn.dropout = 0.5
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    y = torch.randint(0, 3, (6,))
    sampler = GradSampler(model)
    sampler.arm(6, x.device)
    with sampler.recording():
        losses = per_sample_cross_entropy(model(x), y)
    params = list(model.parameters())
    expected = []
    for i in range(6):
        sampler.forget_gradients()
        expected.append(torch.autograd.grad(losses[i], params, retain_graph=True))
    sampler.forget_gradients()
    losses.sum().backward()
    got = sampler.collect()
    sampler.disarm()
    per_sample = [g for layer in got.layers for g in layer.per_sample()]
    assert len(per_sample) == len(params)
    for i in range(6):
        for g, want in zip(per_sample, expected[i]):
            torch.testing.assert_close(g[i], want, atol=2e-5, rtol=1e-4)
    # the masks did drop: without them the gradients differ
    model.eval()
    plain = loop_grads(model, x, y, per_sample_cross_entropy)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(expected[0], plain[0]))


def test_make_private_trains_with_attention_dropout():
    import math
    import privgrad

    torch.manual_seed(0)
    model = TinyTransformer()
    model.enc.self_attn.dropout = 0.1
    x, y = torch.randint(1, 20, (100, 9)), torch.randint(0, 2, (100,))
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        batch_size=20,
    )
    for batch in trainer.batches(2):
        trainer.step(batch)
    assert math.isfinite(trainer.epsilon())


class ChildProjections(nn.Module):
    """Attention as WavLM's: torch's ``F.multi_head_attention_forward`` on its query, key,
    value and output Linear children's weights (``use_separate_proj_weight``), never calling
    them, with a key padding mask and a per-example attention mask (B·heads, T, T) gated by
    a layer of the input, as WavLM's position bias; ``bias_k``: a key and value bias of its
    own too, which no rule reads. :func:`child_projections` declares its children."""

    def __init__(self, p: float = 0.0, bias_k: bool = False):
        super().__init__()
        self.emb, self.gate, self.head = nn.Embedding(20, 8), nn.Linear(8, 2), nn.Linear(8, 3)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(8, 8) for _ in "qkvo")
        self.bias_k = nn.Parameter(torch.randn(1, 1, 8)) if bias_k else None
        self.p = p

    def forward(self, ids):
        h = self.emb(ids)
        (B, T), x = ids.shape, h.transpose(0, 1)
        mask = self.gate(h).transpose(1, 2).reshape(B * 2, T, 1).expand(-1, -1, T)
        padding = torch.zeros(B, T).masked_fill(ids == 0, float("-inf"))
        biases = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        out, _ = nn.functional.multi_head_attention_forward(
            x, x, x, 8, 2, torch.empty([0]), biases, self.bias_k, self.bias_k, False, self.p,
            self.out_proj.weight, self.out_proj.bias, self.training, key_padding_mask=padding,
            attn_mask=mask, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight,
        )  # fmt: skip
        return self.head(out.transpose(0, 1).mean(1))


def child_projections(monkeypatch, **kw) -> ChildProjections:
    monkeypatch.setitem(
        rules.ATTENTION_CHILDREN,
        f"{__name__}.ChildProjections",
        ("q_proj", "k_proj", "v_proj", "out_proj"),
    )
    return ChildProjections(**kw)


def test_attention_on_its_childrens_weights_equals_loop(device, monkeypatch):
    """The sampler computes such a call with each projection a call of its child (recorded
    as any Linear's), the attention between them on the batch: per-sample gradients, norms
    and clipped sums are the loop's, the gate's through the mask too."""
    torch.manual_seed(0)
    model = child_projections(monkeypatch).to(device)
    x, y = tokens().to(device), torch.randint(0, 3, (6,), device=device)
    check_against_loop(model, x, y, device, monkeypatch)


def test_attention_on_its_childrens_weights_drops_out_as_torch_does(monkeypatch):
    """In training its dropout draws as torch's own call does (the same F.dropout on the
    same probabilities), so the output is torch's under the same seed and make_private's
    check compares it in training; each example's gradient is that of its own loss through
    the very forward that ran."""
    torch.manual_seed(0)
    model, x, y = child_projections(monkeypatch, p=0.5), tokens(), torch.randint(0, 3, (6,))
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(model)
    sampler.arm(6, x.device)
    torch.manual_seed(1)
    with sampler.recording():
        out = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(out, model(x))
    losses = per_sample_cross_entropy(out, y)
    params = list(model.parameters())
    expected = []
    for i in range(6):
        sampler.forget_gradients()
        expected.append(torch.autograd.grad(losses[i], params, retain_graph=True))
    sampler.forget_gradients()
    losses.sum().backward()
    got = sampler.collect()
    sampler.disarm()
    per_sample = [g for layer in got.layers for g in layer.per_sample()]
    by_param = dict(zip(map(id, got.params), per_sample))
    assert len(by_param) == len(params)
    for i in range(6):
        for p, want in zip(params, expected[i]):
            torch.testing.assert_close(by_param[id(p)][i], want, atol=2e-5, rtol=1e-4)


def test_attention_on_its_childrens_weights_reading_more_is_refused(monkeypatch):
    """A call that reads a parameter of the layer's own beside its children's (bias_k) has
    no rule: refused in one line, naming the layer."""
    model = child_projections(monkeypatch, bias_k=True)
    with pytest.raises(
        PrivgradError, match=r"layer '\(the model\)' calls F.multi_head_attention_forward"
    ):
        GradSampler(model).compute(
            tokens(), torch.zeros(6, dtype=torch.long), per_sample_cross_entropy
        )


class UsesWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return self.head(out.mean(1)) + weights.sum((1, 2))[:, None]


def test_loss_through_attention_weights_is_refused():
    """The rule covers the attention's output only: a loss reaching its weights is an error."""
    from privgrad.errors import PrivgradError

    with pytest.raises(PrivgradError, match="other than its first"):
        GradSampler(UsesWeights()).compute(
            torch.randn(3, 5, 4), torch.zeros(3, dtype=torch.long), per_sample_cross_entropy
        )


class OutProjAlone(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0].mean(1)[:, :2] + self.attn.out_proj(x.mean(1))[:, :2]


def test_out_proj_called_on_its_own_is_refused():
    from privgrad.errors import PrivgradError

    with pytest.raises(PrivgradError, match="out_proj"):
        GradSampler(OutProjAlone()).compute(
            torch.randn(3, 5, 4), torch.zeros(3, dtype=torch.long), per_sample_cross_entropy
        )


class TinyTransformer(nn.Module):
    """A text classifier from nn.TransformerEncoderLayer (batch_first=True), attention
    dropout off (the other dropouts on)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.enc = nn.TransformerEncoderLayer(16, 4, 32, dropout=dropout, batch_first=True)
        self.enc.self_attn.dropout = 0.0
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.enc(self.emb(x), src_key_padding_mask=x == 0).mean(1))


def test_make_private_trains_a_transformer_encoder_layer():
    """DP-SGD for two steps of a model built from nn.TransformerEncoderLayer, ε reported."""
    import math
    import privgrad

    torch.manual_seed(0)
    model = TinyTransformer()
    x, y = torch.randint(1, 20, (200, 9)), torch.randint(0, 2, (200,))
    x[::3, 6:] = 0
    before = [p.detach().clone() for p in model.parameters()]
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        batch_size=20,
        max_grad_norm=1.0,
    )
    for batch in trainer.batches(2):
        trainer.step(batch)
    assert trainer.steps == 2
    eps = trainer.epsilon()
    assert math.isfinite(eps) and 0 < eps < 10
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "name",
    ["encoder-frozen-attention", "encoder", "encoder-batch-first", "cross-attention", "bags"],
)
def test_collect_drops_examples_on_the_batch_axis(name):
    """The own-loop path's collect(keep=...) (examples with non-finite gradients dropped)
    gives the kept examples' per-sample gradients of a pass over them alone: on axis 1 for
    the layers inside a batch_first=False transformer layer, from the recorded calls of
    MultiheadAttention (masks, a 3-D attn_mask's heads) and EmbeddingBag (offsets)."""
    torch.manual_seed(0)
    x = tokens()
    if name.startswith("encoder"):
        model = Encoder(name == "encoder-batch-first")
        if name == "encoder-frozen-attention":
            for layer in (model.layers.layers[0], model.layer2):
                layer.self_attn.requires_grad_(False)
    elif name == "cross-attention":
        model, x = CrossAttention(False), torch.randn(6, 7, 6)
    else:
        model = Bags()
        x[3] = 0
    y = torch.randint(0, 3, (6,))
    keep = torch.tensor([True, False, True, True, False, True])
    sampler = GradSampler(model)
    sampler.arm(6, x.device)
    with sampler.recording():
        losses = per_sample_cross_entropy(model(x), y)
    losses.sum().backward()
    got = sampler.collect(1.0, keep)
    sampler.disarm()
    want, _ = GradSampler(model).compute(x[keep], y[keep], per_sample_cross_entropy)
    assert got.batch_size == 4 and len(got.params) == len(want.params)
    for a, b in zip(
        [g for layer in got.layers for g in layer.per_sample()],
        [g for layer in want.layers for g in layer.per_sample()],
    ):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


class Bags(nn.Module):
    """EmbeddingBags: 2-D input (mean, padding_idx), offsets (sum, per_sample_weights) and
    offsets with include_last_offset (mean), an empty bag included."""

    def __init__(self):
        super().__init__()
        self.mean2d = nn.EmbeddingBag(20, 5, mode="mean", padding_idx=0)
        self.sum_off = nn.EmbeddingBag(20, 5, mode="sum")
        self.mean_last = nn.EmbeddingBag(20, 5, mode="mean", include_last_offset=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        B, T = x.shape
        flat = x[x != 0]  # each example's non-padding tokens
        lengths = (x != 0).sum(1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        weights = torch.tanh(flat.float())  # data-dependent per-token weights
        h = self.mean2d(x) + self.sum_off(flat, offsets, per_sample_weights=weights)
        h = h + self.mean_last(flat, torch.cat([offsets, lengths.sum().reshape(1)]))
        return self.head(torch.tanh(h))


def test_embedding_bag_rule_equals_loop(device, monkeypatch):
    model = Bags().to(device)
    x = tokens().to(device)
    x[3] = 0  # an empty bag
    x[5, 2] = x[5, 3] = 7  # a repeated token
    check_against_loop(model, x, torch.randint(0, 3, (6,), device=device), device, monkeypatch)


def test_own_loop_trains_a_transformer_as_the_trainer_does():
    """privgrad.attach (the user's forward, loss.backward(), optimizer.step()) on a
    TransformerEncoderLayer model: the same parameters and the identical ε as make_private's
    trainer for one seed."""
    import torch.nn.functional as F
    import privgrad

    x, y = (
        torch.randint(1, 20, (64, 9), generator=torch.Generator().manual_seed(0)),
        torch.arange(64) % 2,
    )
    x[::3, 6:] = 0
    opts = dict(noise_multiplier=1.0, batch_size=16, max_grad_norm=1.0, seed=3, epochs=1)
    torch.manual_seed(1)
    ref = TinyTransformer(dropout=0.0)
    trainer = privgrad.make_private(ref, torch.optim.SGD(ref.parameters(), lr=0.1), (x, y), **opts)
    for batch in trainer.batches():
        trainer.step(batch)
    torch.manual_seed(1)
    own = TinyTransformer(dropout=0.0)
    model, optimizer, loader = privgrad.attach(
        own, torch.optim.SGD(own.parameters(), lr=0.1), (x, y), **opts
    )
    for bx, by in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(bx), by).backward()
        optimizer.step()
    assert optimizer.steps == trainer.steps == 4
    for p, q in zip(ref.parameters(), own.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert optimizer.epsilon() == trainer.epsilon()


def test_gip_plans_the_layout_of_the_parameters_it_steps_on():
    """GIP's group layout, planned by make_private from the sampler's layers, counts a
    MultiheadAttention layer's out_proj (its rule covers it): the planned layout is the one
    each step uses, so the calibrated index privacy is that of the released masks."""
    import privgrad
    from privgrad.mechanisms.gip import RandomKMask

    model = TinyTransformer()
    x, y = torch.randint(1, 20, (100, 7)), torch.randint(0, 2, (100,))
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        mechanism="gip",
        noise_multiplier=1.0,
        batch_size=20,
    )
    (select,) = [s for s in trainer.mechanism.stages if isinstance(s, RandomKMask)]
    assert (
        select.layout.numels
        == [p.numel() for p in trainer.grad_sampler.empty().params]
        == [p.numel() for p in model.parameters()]
    )


def test_guide_table_names_every_layer_with_a_rule():
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    text = guide.split("### Supported layers")[1].split("\n## ")[0]
    for t in rules.RULES:
        if t.__module__.startswith("torch."):
            assert f"`{re.sub(r'[123]d$', '', t.__name__)}" in text, t.__name__


class DepthwiseConv(nn.Conv2d):
    """A subclass that only configures its base, as Hugging Face EfficientNet's depthwise
    Conv2d does: it takes Conv2d's rule (it fell to the generic vmap rule)."""

    def __init__(self, channels):
        super().__init__(channels, channels, 3, padding=1, groups=channels)


class Doubled(nn.Conv2d):
    def forward(self, x):  # a forward of its own: the generic rule, never Conv2d's
        return 2 * super().forward(x)


def test_a_subclass_that_only_configures_a_layer_takes_its_rule(device, monkeypatch):
    assert rules.RULES.get(DepthwiseConv) is rules.conv_rule
    assert rules.RULES.get(Doubled) is None and nn.ReLU not in rules.RULES
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), DepthwiseConv(4), nn.Flatten(), nn.LazyLinear(3)).to(
        device
    )
    x, y = torch.randn(5, 2, 8, 8, device=device), torch.randint(0, 3, (5,), device=device)
    check_against_loop(model, x, y, device, monkeypatch)


class ScaledInTraining(nn.Linear):
    """Defines ``__init__`` alone, but sets its own forward there (a DropConnect-like change
    of the weight, in training only): nn.Linear's rule does not hold for it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.forward = lambda x: nn.functional.linear(
            x, self.weight * (3.0 if self.training else 1.0), self.bias
        )


class PartialConvForward(nn.Conv2d):
    # a class attribute without __get__ (no method), called as the convolution all the same
    _conv_forward = functools.partial(lambda x, w, b: nn.functional.conv2d(x, 3.0 * w, b))


def test_a_subclass_whose_computation_is_its_own_takes_no_inherited_rule(device):
    """A callable set on the class without ``__get__``, or on the instance in ``__init__``
    (``self.forward = ...``), is the layer's computation: it took the base's closed-form rule
    (the subclass 'only configured' it), whose per-sample gradients were wrong by 2/3 in
    training mode, which make_private's gradient check (in eval mode) did not see. So did an
    nn.Linear itself whose forward is replaced on the instance. Now the generic rule replays
    them."""
    assert rules.RULES.get(PartialConvForward) is None
    torch.manual_seed(0)
    exact = nn.Linear(12, 12)  # a torch layer itself, its forward replaced on the instance
    exact.forward = lambda x: nn.functional.linear(
        x, exact.weight * (3.0 if exact.training else 1.0), exact.bias
    )
    model = (
        nn.Sequential(
            ScaledInTraining(6, 8),
            nn.Tanh(),
            nn.Unflatten(1, (2, 2, 2)),
            PartialConvForward(2, 3, 1),
            nn.Flatten(),
            exact,
            nn.Linear(12, 3),
        )
        .to(device)
        .train()
    )
    x, y = torch.randn(5, 6, device=device), torch.randint(0, 3, (5,), device=device)
    grads, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
    per_sample = [g for layer in grads.layers for g in layer.per_sample()]
    for i, want in enumerate(loop_grads(model, x, y, per_sample_cross_entropy)):
        for got, w in zip(per_sample, want):
            torch.testing.assert_close(got[i], w, atol=2e-5, rtol=1e-4)
    assert rules.instance_overrides(exact) == ["forward"]


def test_accelerates_device_hook_keeps_the_layers_rule():
    """accelerate (device_map, offloading) sets ``forward`` on the instance to move tensors
    around the class's own forward: not a computation of its own."""
    hooks = pytest.importorskip("accelerate.hooks")
    layer = nn.Linear(3, 3)
    hooks.add_hook_to_module(layer, hooks.ModelHook())
    assert "forward" in vars(layer) and rules.instance_overrides(layer) == []


class PerExampleConv(nn.Module):
    """Calls its convolution on one example at a time, unbatched (C, H, W), as torch allows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(4, 4, 3), nn.Linear(4 * 16, 3)

    def forward(self, x):
        h = torch.stack([self.conv(example) for example in x])
        return self.head(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("batch", [4, 5])
def test_a_convolution_called_on_unbatched_examples_is_refused_in_one_line(batch):
    """With as many channels as examples, its input's first axis passed for the batch and
    the rule failed inside torch (a RuntimeError, or an IndexError in make_private)."""
    x, y = torch.randn(batch, 4, 6, 6), torch.randint(0, 3, (batch,))
    with pytest.raises(PrivgradError, match=r"unbatched input of shape \(4, 6, 6\)"):
        GradSampler(PerExampleConv()).compute(x, y, per_sample_cross_entropy)
    model = PerExampleConv()
    with pytest.raises(PrivgradError, match="unbatched input"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
            batch_size=batch,
        )  # fmt: skip
