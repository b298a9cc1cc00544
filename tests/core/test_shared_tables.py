"""Tables the batch shares (privgrad.per_sample.tables): T5's and MPNet's relative-attention
bias, an Embedding of a (T × T) grid of relative-position buckets whose output every example
adds to its attention scores. Its per-sample gradients come from where its output meets the
batch, learned by make_private's check from shapes and afterwards by place in the model's code.

Each comparison is against a loop of single-example autograd, with the generic vmap rule
disabled (so no layer passes by the fallback), at batch sizes
that equal the model's head count (2) and length (8), where shapes alone would mistake
another axis for the batch.
Tolerance as in test_hf.py (float32 in two summation orders).
"""

import warnings
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.inputs import call_model
from privgrad.per_sample import EngineFlags, GradSampler, engine
from privgrad.per_sample.independence import check_gradients
from privgrad.per_sample.tables import ReplayInstead
from privgrad.private import per_sample_cross_entropy
from test_hf import (  # tests/core
    CLASSES,
    HIDDEN,
    VOCAB,
    _no_generic,
    assert_collect_is_the_kept_pass,
    assert_sums_and_norms_are_the_loops,
    assert_the_own_loop_trains,
    eos_inputs,
    image_inputs,
    loop_grads,
    tiny_relative,
)
from test_per_sample import SharedPositions  # tests/core

transformers = pytest.importorskip("transformers")
TABLES = {
    "t5": {
        "transformer.encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
        "transformer.decoder.block.0.layer.0.SelfAttention.relative_attention_bias",
    },
    "mpnet": {"mpnet.encoder.relative_attention_bias"},
}


NOT_CAPTURED = (
    "a table the batch shares (T5's relative-attention bias, or the own parameters of a layer "
    "without a rule) is not captured"
)


def checked(model, n: int = 5, seed: int = 0, **change) -> GradSampler:
    """A sampler as make_private's check leaves it, after its pass over ``n`` examples (run
    again, as the check does, where a pass changed a layer's route)."""
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    x = eos_inputs(n, seed)
    for k, v in change.items():
        x[k] = v(x[k])
    learned(sampler, lambda: assert_loop(sampler, x, torch.arange(n) % CLASSES))
    sampler.assume_layouts = False
    return sampler


def learned(sampler, check, passes: int = 3) -> None:
    """``check()`` while the sampler learns its layouts, run again on ReplayInstead."""
    for _ in range(passes - 1):
        try:
            return check()
        except ReplayInstead:
            pass
    check()


def params(model):
    return [p for p in model.parameters() if p.requires_grad]


def assert_loop(sampler, x, y):
    """The loop's norms and clipped sums, and each table's per-sample gradients, to 1e-4 of
    their largest entry (a table's gradients can be far below the absolute floor of
    test_hf's tolerance: Swin's zero-initialised ones are ~1e-6)."""
    device = next(sampler.model.parameters()).device
    x, y = {k: v.to(device) for k, v in x.items()}, y.to(device)
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    ps, want = params(sampler.model), loop_grads(sampler.model, x, y)
    assert_sums_and_norms_are_the_loops(fast, ps, want)
    got = dict(zip(map(id, fast.params), (g for layer in fast.layers for g in layer.per_sample())))
    tables = {id(p) for m in sampler.shared.sites for p in m.parameters()}
    for j, p in enumerate(ps):
        if id(p) in tables:
            w = torch.stack([grads[j] for grads in want])
            # (absolute floor 1e-10: a gradient zero by softmax's shift invariance, as
            # DeBERTa-v2's position-key bias, is rounding in both, ~1e-13 and ~1e-17)
            atol = max(1e-4 * float(w.abs().max()), 1e-10)
            torch.testing.assert_close(got[id(p)], w, rtol=1e-4, atol=atol)


def assert_batch_autograd(sampler, x, y, seed: int):
    """In training, each example's gradients are autograd's of its loss through the same
    forward of the batch: the RNG seeded alike for both forwards, so that dropouts and drop
    paths draw the same masks."""
    model, ps = sampler.model, params(sampler.model)
    torch.manual_seed(seed)
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    torch.manual_seed(seed)
    losses = per_sample_cross_entropy(call_model(model, x), y)
    want = [torch.autograd.grad(losses[i], ps, retain_graph=True) for i in range(len(y))]
    assert_sums_and_norms_are_the_loops(fast, ps, want)


@pytest.mark.parametrize("name, attention", [("t5", "eager"), ("t5", "sdpa"), ("mpnet", "eager")])
def test_relative_attention_tables_equal_single_example_autograd(
    name, attention, device, monkeypatch
):
    """At the check and after it, at batch sizes 1, 2 (the head count) and 8 (the length):
    every parameter's per-sample norms and clipped sums are the loop's, on every device
    present."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = checked(tiny_relative(name, attention).to(device))
    assert {sampler.names[m] for m in sampler.shared.sites} == TABLES[name]
    for n in (1, 2, 8):
        x = {k: v[:n] for k, v in eos_inputs(max(n, 2), seed=n).items()}
        assert_loop(sampler, x, torch.arange(n) % CLASSES)


def tiny_beit():
    """BEiT with a relative position bias per layer (a layer of its own that indexes its
    table by relative position: no rule, no argument of the batch's); no layer scale, so
    every other layer has a rule."""
    config = transformers.BeitConfig(
        image_size=28, patch_size=7, num_channels=1, num_labels=CLASSES, **HIDDEN,
        use_relative_position_bias=True, layer_scale_init_value=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.BeitForImageClassification(config)


def test_a_layer_of_its_own_is_a_table_too(monkeypatch):
    """BEiT's relative position bias and a position table sliced to its input's length (one
    row for the batch), both without a rule: per-sample gradients by autograd from the table's
    output to its parameters, batched over examples; the loop's at the check and after it at a
    batch as large as the head count (2) and the length (5). BEiT's embeddings (its [CLS]
    token expanded to the batch, its position table added) have no rule either: their own
    parameters are tables."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(tiny_beit())
    sampler.assume_layouts = True
    for n in (5, 2):
        assert_loop(sampler, image_inputs(n, seed=n), torch.arange(n) % CLASSES)
        sampler.assume_layouts = False
    assert {sampler.names[m] for m in sampler.shared.sites} == {
        "beit.embeddings",
        *(f"beit.layers.{i}.relative_position_bias" for i in (0, 1)),
    }
    positions = GradSampler(SharedPositions(table=True))
    positions.assume_layouts = True
    for n in (4, 5):
        x = torch.randint(0, 10, (n, 5))
        assert_loop(positions, {"ids": x}, torch.arange(n) % 2)
        positions.assume_layouts = False
    assert [positions.names[m] for m in positions.shared.sites] == ["pos"]


def tiny_swin():
    """Swin with shifted windows (two blocks per stage: the second shifts, with a mask of its
    windows): its attention runs on (batch · windows) rows, where its relative position bias
    meets them."""
    config = transformers.SwinConfig(
        image_size=28, patch_size=2, num_channels=1, embed_dim=8, depths=[2, 2],
        num_heads=[1, 2], window_size=7, num_labels=CLASSES, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.SwinForImageClassification(config)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_swin_windows_folded_with_the_batch_meet_its_tables(
    attention, device, float32_convolutions, monkeypatch
):
    """Swin partitions each image into windows and attends within each, on (batch · windows)
    rows, example-major: its relative position bias meets the batch folded with the windows,
    and each example's share is the sum over its windows. The loop's at the check and after
    it, at batch sizes 1, 2 (a head count) and 4 (the windows of an image in its first stage),
    on every device present."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = tiny_swin().to(device)
    model.config._attn_implementation = attention
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    for n in (5, 1, 2, 4):
        assert_loop(sampler, image_inputs(n, seed=n), torch.arange(n) % CLASSES)
        sampler.assume_layouts = False
    assert len(sampler.shared.sites) == 4


def tiny_swinv2():
    """Swin V2: its relative position bias is computed by a two-layer MLP (Linear, ReLU,
    Linear: layers with rules) from a (1, 13, 13, 2) table of log-spaced coordinates, then
    indexed, squashed and added to each window's attention scores; its attention's logit
    scale is a parameter of a layer without a rule."""
    config = transformers.Swinv2Config(
        image_size=28, patch_size=2, num_channels=1, embed_dim=8, depths=[2, 2],
        num_heads=[1, 2], window_size=7, num_labels=CLASSES, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.Swinv2ForImageClassification(config)


def test_swinv2s_position_bias_mlp_is_followed_as_tables(float32_convolutions, monkeypatch):
    """The MLP's layers are called on the coordinate table, which the batch shares: their own
    parameters are followed as tables through both layers (an op combining two layers'
    tables) to where the bias meets the (batch · windows) scores. The loop's at the check and
    after it at batch sizes 1, 2 and 4."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(tiny_swinv2())
    sampler.assume_layouts = True
    for n in (5, 1, 2, 4):
        assert_loop(sampler, image_inputs(n, seed=n), torch.arange(n) % CLASSES)
        sampler.assume_layouts = False
    mlps = {n for m, n in sampler.names.items() if m in sampler.shared.params}
    assert {f"swinv2.encoder.layers.{i}.blocks.{j}.attention.self.continuous_position_bias_mlp.{k}"
            for i in (0, 1) for j in (0, 1) for k in (0, 2)} <= mlps  # fmt: skip


def tiny_deberta(version: str):
    """DeBERTa with relative attention, as its checkpoints are configured: the encoder reads
    its relative-position Embedding's weight whole (never calling the layer), and each
    attention layer projects it with Linear layers of its own (v1: pos_proj and pos_q_proj;
    v2 without share_att_key: pos_key_proj and pos_query_proj, whose outputs it repeats to
    the batch's B·heads rows; v3, as v2 and v3 checkpoints, with share_att_key: the query and
    key projections of the batch project the table too)."""
    common = dict(
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=CLASSES, **HIDDEN,
        relative_attention=True, pos_att_type=["c2p", "p2c"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    if version == "v1":
        config = transformers.DebertaConfig(max_relative_positions=8, **common)
        return transformers.DebertaForSequenceClassification(config)
    if version == "v2":
        config = transformers.DebertaV2Config(position_buckets=8, share_att_key=False, **common)
    else:  # as DeBERTa-v2/v3 checkpoints: the table normalised, projected by query and key
        config = transformers.DebertaV2Config(
            position_buckets=8, share_att_key=True, norm_rel_ebd="layer_norm", **common
        )
    return transformers.DebertaV2ForSequenceClassification(config)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_debertas_relative_position_embedding_is_followed_as_a_table(version, monkeypatch):
    """It was refused as a layer called without the batch's rows ('is a batch dimension
    missing?'). The loop's at the check and after it at batch sizes 1, 2 (the head count)
    and 8 (the length)."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = checked(tiny_deberta(version))
    assert "deberta.encoder" in {sampler.names[m] for m in sampler.shared.params}
    for n in (1, 2, 8):
        x = {k: v[:n] for k, v in eos_inputs(max(n, 2), seed=n).items()}
        assert_loop(sampler, x, torch.arange(n) % CLASSES)


class SharedMLP(nn.Module):
    """A bias computed by a Linear from a constant, added to each example's features: the
    Linear's calls on the constant make its parameters tables; ``use`` another call of it
    (on the batch, or on the first example's features, which would mix that example into
    every other's)."""

    def __init__(self, use: str = ""):
        super().__init__()
        self.emb, self.mlp, self.out = nn.Embedding(20, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("const", torch.randn(1, 3, 4))
        self.use = use

    def forward(self, ids):
        h = self.emb(ids)  # (B, 3, 4)
        if self.use == "batch":
            h = self.mlp(h)
        bias = self.mlp(self.const.detach()) if self.use != "first" else self.mlp(h[:1].detach())
        return self.out(torch.tanh(h + bias).mean(1))


def test_a_layer_with_a_rule_on_a_constant_is_a_table():
    torch.manual_seed(0)
    sampler = GradSampler(SharedMLP())
    sampler.assume_layouts = True
    for n in (5, 1, 3):
        assert_loop(sampler, {"ids": torch.randint(0, 20, (n, 3))}, torch.arange(n) % 2)
        sampler.assume_layouts = False
    assert [sampler.names[m] for m in sampler.shared.params] == ["mlp"]


def test_a_layer_called_on_the_batch_and_on_a_constant_is_followed_in_all_its_calls():
    """It was refused ('called both on the batch and on tensors the batch shares'); its
    parameters are now tables in both calls, the batch's rows times each example's own copy.
    The check's first pass recorded the batch's call for the rule: it runs again."""
    torch.manual_seed(0)
    sampler = GradSampler(SharedMLP("batch"))
    sampler.assume_layouts = True
    x, y = {"ids": torch.randint(0, 20, (5, 3))}, torch.arange(5) % 2
    with pytest.raises(ReplayInstead, match="'mlp': called on the batch and on tensors"):
        sampler.compute(x, y, per_sample_cross_entropy)
    for n in (5, 1, 3):
        assert_loop(sampler, {"ids": torch.randint(0, 20, (n, 3))}, torch.arange(n) % 2)
        sampler.assume_layouts = False
    assert [sampler.names[m] for m in sampler.shared.params] == ["mlp"]


def test_one_examples_features_shared_with_the_batch_are_refused_by_the_check():
    """The first example's features through the layer, added to every example's: they look
    shared (one row, no gradient), and make_private's check finds that the examples are not
    independent."""
    torch.manual_seed(0)
    model = SharedMLP("first")
    x, y = torch.randint(0, 20, (40, 3)), torch.arange(40) % 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PrivgradError, match="the model mixes the examples of a batch"):
        privgrad.make_private(
            model, optimizer, (x, y), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=8
        )


def test_sdpa_takes_a_mask_made_only_for_some_batches():
    """Hugging Face's SDPA path of T5 combines the bias with a padding mask only when a batch
    has padding, and passes the bias to SDPA itself otherwise: a batch without padding after
    a check on padded examples is attributed at SDPA; the other way round, a use the check
    did not see is refused, never guessed."""
    torch.manual_seed(0)
    model = tiny_relative("t5", "sdpa")
    full = {  # no padding: every token kept, the end token (2) last
        "attention_mask": torch.ones_like,
        "input_ids": lambda ids: torch.cat([ids[:, :-1].clamp(min=3), ids[:, -1:] * 0 + 2], 1),
    }
    x = eos_inputs(4, seed=1)
    padless = {k: f(x[k]) for k, f in full.items()}
    assert_loop(checked(model), padless, torch.arange(4) % CLASSES)
    sampler = checked(model, **full)
    with pytest.raises(PrivgradError, match="did not see this use .where at .*sdpa_attention"):
        sampler.compute(x, torch.arange(4) % CLASSES, per_sample_cross_entropy)


class HeadScaledBias(nn.Module):
    """Attention over embedded ids with a shared relative-position bias, scaled per head by a
    constant ``(heads, 1, 1)``: that product's first axis is the heads, not the batch, and
    equals a batch of ``heads`` examples."""

    def __init__(self, heads: int = 3, length: int = 6):
        super().__init__()
        self.emb, self.q, self.k = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.bias, self.out = nn.Embedding(5, 1), nn.Linear(8, CLASSES)
        self.register_buffer("scale", torch.arange(1.0, heads + 1).view(heads, 1, 1))
        t = torch.arange(length)
        self.register_buffer("buckets", (t[None] - t[:, None]).clamp(-2, 2) + 2)
        self.use = "meet"

    def forward(self, ids):
        b = self.bias(self.buckets).squeeze(-1) * self.scale  # (heads, T, T), shared
        if self.use == "repeat":  # the logits from the table alone: the batch never met
            return b.sum().repeat(ids.shape[0], CLASSES)
        if self.use == "linear":  # the table through a weight: no broadcast against the batch
            b = nn.functional.linear(b, self.q.weight[:6, :6])
        if self.use == "two":  # two layers' tables (``other``) combined before a meeting
            b = b + self.other(self.buckets).squeeze(-1)
        if self.use == "kept":  # the first forward's bias kept for the next (a cache)
            self.kept = b = getattr(self, "kept", b)
        h = self.emb(ids)
        s = (self.q(h) @ self.k(h).transpose(1, 2)).unsqueeze(1) + b  # (B, heads, T, T)
        return self.out((s.softmax(-1).mean(1) @ h).mean(1))


def test_a_head_count_equal_to_the_batch_is_not_taken_for_the_batch():
    """After a check on 5 examples, a batch of 3 examples against 3 heads: the product with the
    per-head constant looks like a meeting by shape, and is not one by place."""
    torch.manual_seed(0)
    model = HeadScaledBias()
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    for n in (5, 3):
        x, y = torch.randint(0, 20, (n, 6)), torch.arange(n) % CLASSES
        assert_loop(sampler, {"ids": x}, y)
        sampler.assume_layouts = False
    (sites,) = sampler.shared.sites.values()
    assert sorted(sites.values()) == [False, True]


@pytest.mark.parametrize(
    "use, message",
    [
        ("repeat", "reached the loss without being broadcast against the batch"),
        ("linear", "linear combines a tensor computed from it with another that has a gradient"),
    ],
)
def test_uses_that_never_meet_the_batch_are_refused(use, message):
    model = HeadScaledBias()
    model.use = use
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    x, y = {"ids": torch.randint(0, 20, (5, 6))}, torch.arange(5) % CLASSES
    with pytest.raises(PrivgradError, match=message):
        sampler.compute(x, y, per_sample_cross_entropy)


def test_two_layers_tables_combined_before_they_meet_the_batch_are_each_attributed():
    """Two Embeddings' tables added together, then met by the batch: each example's gradient
    of the sum reaches both tables."""
    torch.manual_seed(0)
    model = HeadScaledBias()
    model.use, model.other = "two", nn.Embedding(5, 1)
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    for n in (5, 3, 2):
        assert_loop(sampler, {"ids": torch.randint(0, 20, (n, 6))}, torch.arange(n) % CLASSES)
        sampler.assume_layouts = False
    assert {sampler.names[m] for m in sampler.shared.sites} == {"bias", "other"}


def test_a_table_kept_from_an_earlier_forward_is_refused():
    """A tensor computed from a table in one forward and used in the next (a cache): its
    meetings belong to a forward whose step is over, so it is refused, not attributed."""
    model = HeadScaledBias()
    model.use = "kept"
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    x, y = {"ids": torch.randint(0, 20, (5, 6))}, torch.arange(5) % CLASSES
    sampler.compute(x, y, per_sample_cross_entropy)
    with pytest.raises(PrivgradError, match="in an earlier forward .* is used again"):
        sampler.compute(x, y, per_sample_cross_entropy)


def beit_without_dropout():
    model, _ = tiny_with_dropout("beit")
    for m in model.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    return model


@pytest.mark.parametrize("name", ["t5", "beit"])
def test_micro_batches_and_cuda_graphs_on_take_the_steps_of_whole_batches(name):
    """make_private with physical micro-batches of 3, and with cuda_graphs on (a shared table
    is not captured: one warning, then eager steps), takes the same steps (parameters within
    float32 rounding) and the same ε as with whole batches: T5's relative-attention bias, and
    BEiT's own parameters as tables (its drop paths at 0, so that the batches' splits draw
    alike)."""
    inputs = eos_inputs if name == "t5" else image_inputs
    data, labels = inputs(40, seed=2), torch.arange(40) % CLASSES
    results = []
    for chunk, flags in ((None, None), (3, None), (None, EngineFlags(cuda_graphs=True))):
        torch.manual_seed(0)
        model = tiny_relative("t5", "sdpa") if name == "t5" else beit_without_dropout()
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), (data, labels),
            noise_multiplier=1.0, max_grad_norm=0.1, batch_size=10, seed=7,
            max_physical_batch_size=chunk, flags=flags,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for batch in trainer.batches(3):
                trainer.step(batch)
        eager = [str(w.message) for w in seen if "steps run eagerly" in str(w.message)]
        assert eager == (
            [f"cuda_graphs is on but steps run eagerly: {NOT_CAPTURED}"] if flags else []
        )
        results.append(([p.detach().clone() for p in model.parameters()], trainer.epsilon()))
    (whole, eps), *others = results
    for params, other_eps in others:
        assert other_eps == eps
        for a, b in zip(whole, params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def token_losses(logits, labels):
    """Each example's summed next-token losses (a sequence-to-sequence loss, reduction per
    example)."""
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)


def test_t5_seq2seq_with_a_decoder_as_long_as_the_probe_trains():
    """T5ForConditionalGeneration on a per-example sum of token losses, with 5 decoder tokens:
    on the probe's 5 examples the decoder's (5 × 5) table of relative positions looks batched
    and the check fails; its second check, on 4 examples, learns it a table. At a batch of 5
    the per-sample gradients are then the loop's."""
    torch.manual_seed(0)
    model = tiny_relative("t5-seq2seq")
    g = torch.Generator().manual_seed(0)
    x = {
        "input_ids": torch.randint(3, VOCAB, (40, 7), generator=g),
        "attention_mask": (torch.arange(7) < torch.randint(3, 8, (40, 1), generator=g)).long(),
        "decoder_input_ids": torch.randint(3, VOCAB, (40, 5), generator=g),
    }
    y = torch.randint(3, VOCAB, (40, 5), generator=g)
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), loss_fn=token_losses,
        target_epsilon=3.0, epochs=1, batch_size=10,
    )  # fmt: skip
    assert {trainer.grad_sampler.names[m] for m in trainer.grad_sampler.shared.sites} == {
        f"{part}.block.0.layer.0.SelfAttention.relative_attention_bias"
        for part in ("encoder", "decoder")
    }
    x5, y5 = {k: v[:5] for k, v in x.items()}, y[:5]
    fast, _ = trainer.grad_sampler.compute(x5, y5, token_losses)
    assert_sums_and_norms_are_the_loops(
        fast, params(model), loop_grads(model, x5, y5, token_losses)
    )
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and 0 < trainer.epsilon() <= 3.0 + 1e-6


def test_tables_under_bf16_autocast_are_close_to_float32():
    """Under bf16 autocast (the table's output and its meetings' gradients in bf16), each
    table's per-sample gradients, in float32 as every rule's, are float32's to bf16 rounding
    compounded over the forward and backward (10 % of the largest entry; a gradient credited
    to the wrong example, or the batch's sum, is off by its whole size)."""
    torch.manual_seed(0)
    model = tiny_relative("t5", "sdpa")
    sampler = checked(model)
    x, y = eos_inputs(4, seed=3), torch.arange(4) % CLASSES
    grads = {}
    for precision in ("fp32", "bf16"):
        sampler.precision = precision
        fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
        assert torch.isfinite(fast.norms_sq()).all()
        got = dict(
            zip(map(id, fast.params), (g for layer in fast.layers for g in layer.per_sample()))
        )
        grads[precision] = [got[id(p)] for m in sampler.shared.sites for p in m.parameters()]
    for a, b in zip(grads["fp32"], grads["bf16"]):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0.1, atol=0.1 * float(a.abs().max()))


def tiny_with_dropout(name: str):
    """DeBERTa (its attention's own query and value biases, its LayerNorms' weights), Funnel
    (its attention's biases, and its position kernel and token-type table, met in einsums)
    and BEiT (its layers' layer scales, its embeddings' [CLS] token and positions): layers
    without a rule, with their defaults' dropouts (attention probabilities, hidden states)
    and drop paths (BEiT's), which a replay of such a layer could not draw alike."""
    if name == "funnel":
        config = transformers.FunnelConfig(
            vocab_size=VOCAB, block_sizes=[1, 1], d_model=32, n_head=2, d_head=16, d_inner=64,
            num_labels=CLASSES,
        )  # fmt: skip
        return transformers.FunnelForSequenceClassification(config), eos_inputs
    if name == "deberta":
        config = transformers.DebertaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=CLASSES, **HIDDEN
        )
        return transformers.DebertaForSequenceClassification(config), eos_inputs
    config = transformers.BeitConfig(
        image_size=28, patch_size=7, num_channels=1, num_labels=CLASSES, **HIDDEN,
        use_relative_position_bias=True, drop_path_rate=0.2,
    )  # fmt: skip
    return transformers.BeitForImageClassification(config), image_inputs


OWN_TABLES = {
    "deberta": {
        "deberta.embeddings.LayerNorm",
        *(
            f"deberta.encoder.layer.{i}.{layer}"
            for i in (0, 1)
            for layer in ("attention.self", "attention.output.LayerNorm", "output.LayerNorm")
        ),
    },
    "funnel": {f"funnel.encoder.blocks.{i}.0.attention" for i in (0, 1)},
    "beit": {
        "beit.embeddings",
        *(f"beit.layers.{i}{part}" for i in (0, 1) for part in ("", ".relative_position_bias")),
    },
}


@pytest.mark.parametrize("name", ["deberta", "funnel", "beit"])
def test_own_parameters_meet_the_batch_as_tables_so_dropout_needs_no_replay(
    name, device, monkeypatch
):
    """make_private's check learns these layers' own parameters as tables (each meets the batch
    only by broadcasts: ``q + q_bias``, ``lambda_1 * h``, the [CLS] token expanded, Funnel's
    ``einsum("binh,tnh->bnit", q + v, r_head)``); in
    training, at 6 examples and at 2 (the head count), each example's gradients are autograd's
    of its loss through the same forward of the batch (the same dropout masks and drop paths:
    the RNG seeded alike), with the generic vmap rule disabled, on every device present."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model, inputs = tiny_with_dropout(name)
    model = model.to(device)
    sampler = GradSampler(model)
    x = {k: v.to(device) for k, v in inputs(5, 0).items()}
    check_gradients(sampler, per_sample_cross_entropy, x, torch.arange(5, device=device) % CLASSES)
    assert {sampler.names[m] for m in sampler.shared.params} == OWN_TABLES[name]
    assert not sampler.shared.replayed
    model.train()
    for n in (6, 2):
        x = {k: v.to(device) for k, v in inputs(n, n).items()}
        assert_batch_autograd(sampler, x, torch.arange(n, device=device) % CLASSES, seed=n)


class TwoOnOneLine(nn.Module):
    """A gain that meets the batch and a shift scaled by a number first (no meeting), two
    multiplications on one line of code: told apart by their places in the line."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, CLASSES)
        self.gain, self.shift = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

    def forward(self, ids):
        return self.head(self.scale(self.emb(ids).mean(1)))

    def scale(self, h):
        return h * self.gain + self.shift * 2.0


class Scaled(nn.Module):
    def __init__(self, inner=None):
        super().__init__()
        self.inner = TwoOnOneLine() if inner is None else inner

    def forward(self, ids):
        return self.inner(ids)


class ProductOfOwn(TwoOnOneLine):
    """Two of its own parameters combined before they meet the batch (as DiffLlama's
    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2))."""

    def scale(self, h):
        return h * torch.exp(self.gain * self.shift)


@pytest.mark.parametrize("inner", [TwoOnOneLine, ProductOfOwn])
def test_two_uses_of_own_parameters_on_one_line_are_two_places(inner, monkeypatch):
    """Meetings are learned by place, and a line can hold a meeting and an op that is none:
    the check learns both, and after it the layer trains as the loop at other batch sizes;
    so does a layer whose two parameters are combined before they meet the batch (each
    example's gradient at the meeting is mapped back to both)."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = Scaled(inner())
    sampler = GradSampler(model)
    x = torch.randint(0, 20, (5, 6))
    check_gradients(sampler, per_sample_cross_entropy, x, torch.arange(5) % CLASSES)
    assert [sampler.names[m] for m in sampler.shared.params] == ["inner"]
    for n in (2, 7):
        assert_loop(sampler, {"ids": torch.randint(0, 20, (n, 6))}, torch.arange(n) % CLASSES)


@pytest.mark.parametrize(
    "name, checkpointed",
    [("deberta", False), ("funnel", False), ("beit", False), ("deberta", True), ("beit", True)],
)
def test_the_own_loop_trains_them_with_their_dropouts(name, checkpointed):
    """attach's check learns the own parameters as tables; the user's loop then trains in
    training mode (dropouts and drop paths drawn), with Hugging Face's activation
    checkpointing or not (the model's backward, run at the step, recomputes each layer), with
    steps that move every parameter."""
    torch.manual_seed(0)
    model, inputs = tiny_with_dropout(name)
    if checkpointed:
        model.gradient_checkpointing_enable()
    model = assert_the_own_loop_trains(model, inputs, n=40, batch_size=8, steps=2)
    assert model.training


class CheckpointedTable(nn.Module):
    """A block run under torch's checkpoint: a position table (an Embedding of positions, the
    batch's shared output) multiplied into the hidden states, a dropout, then a layer without
    a rule whose own gain is a table; ``calls`` counts the block's runs."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.emb, self.pos = nn.Embedding(20, 8), nn.Embedding(6, 8)
        self.fc, self.scale, self.head = nn.Linear(8, 8), Gain(), nn.Linear(8, CLASSES)
        self.drop = nn.Dropout(0.3)
        self.checkpointed, self.calls = checkpointed, 0

    def block(self, h):
        self.calls += 1
        h = torch.tanh(self.fc(h) * self.pos(torch.arange(h.shape[1])))
        return self.scale(self.drop(h))

    def forward(self, ids):
        h = self.emb(ids)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.head(h.mean(1))


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(8))

    def forward(self, h):
        return torch.tanh(h * self.gain)


def checkpointed_model(name: str, checkpointed: bool):
    """(model, inputs of 6 examples) with ``name``'s checkpointing on or off: torch's
    checkpoint around a block (its layers' hooks run again), or Hugging Face's on each layer
    of T5, BEiT or DeBERTa (their forward checkpointed inside their hooks), with their
    dropouts and drop paths."""
    if name == "torch":
        return CheckpointedTable(checkpointed), torch.randint(0, 20, (6, 6))
    if name == "t5":
        model = tiny_relative("t5", "eager")
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.1
    else:
        model = tiny_with_dropout(name)[0]
    if checkpointed:
        model.gradient_checkpointing_enable()
    inputs = image_inputs if name == "beit" else eos_inputs
    return model, inputs(6, 1)


@pytest.mark.parametrize("name", ["torch", "t5", "beit", "deberta"])
def test_activation_checkpointing_runs_the_tables_again_alike(name, monkeypatch):
    """Activation checkpointing runs a block's forward again in the backward, whose saved
    tensors must match the recorded forward's: a table's output inside the block is followed
    again (a replica, whose taps receive nothing), a layer's own parameters stay shadowed by
    their followed views until the backward is over, and a table's side of the graph is saved
    outside the checkpoint (its batched backwards would otherwise recompute the block inside
    a vmap, where a dropout cannot draw). In training, the RNG seeded alike (a checkpoint
    recomputes with the forward's RNG state), norms and clipped sums are those without
    checkpointing; the generic rule never runs."""
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    w, results = torch.rand(6), []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model, x = checkpointed_model(name, checkpointed)
        y = torch.arange(6) % CLASSES
        sampler = GradSampler(model)
        probe = x[:5] if name == "torch" else {k: v[:5] for k, v in x.items()}
        check_gradients(sampler, per_sample_cross_entropy, probe, y[:5])
        assert sampler.shared.sites
        model.train()
        calls = getattr(model, "calls", 0)
        torch.manual_seed(1)
        grads, _ = sampler.compute(x, y, per_sample_cross_entropy)
        if name == "torch":
            runs = model.calls - calls  # checkpointed: once more per backward through it
            assert runs > 1 if checkpointed else runs == 1
        results.append((grads.norms_sq(), grads.weighted_sum(w)))
    (norms, sums), (norms_ckpt, sums_ckpt) = results
    torch.testing.assert_close(norms_ckpt, norms)
    for a, b in zip(sums_ckpt, sums):
        torch.testing.assert_close(a, b)


def test_collect_drops_examples_from_own_parameter_tables():
    """The own loop's collect(keep=...) (examples with non-finite gradients dropped) gives
    the kept examples' gradients of a pass over them alone, BEiT's own parameters followed as
    tables (layouts as make_private's check leaves the samplers; drop paths at 0, so that the
    two passes draw nothing)."""
    torch.manual_seed(0)
    model = beit_without_dropout()
    x, y = image_inputs(6, 3), torch.arange(6) % CLASSES
    keep = torch.tensor([True, False, True, True, False, True])
    sampler, alone = GradSampler(model), GradSampler(model)
    for s in (sampler, alone):
        check_gradients(s, per_sample_cross_entropy, {k: v[:5] for k, v in x.items()}, y[:5])
        assert s.shared.params
    model.train()
    assert_collect_is_the_kept_pass(
        sampler, alone, x, y, keep, partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)
    )


class OwnAttention(nn.Module):
    """Attention with matrices of its own and no rule: ``F.linear`` with its own weight and
    bias on (B, T, d) rows, attention dropout, and its own output matrix on the rows
    flattened, ``(B·T, d) @ W``."""

    def __init__(self, d: int = 8, p: float = 0.3):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3 * d, d) / d**0.5)
        self.qkv_bias = nn.Parameter(torch.randn(3 * d) / 10)
        self.proj = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.p = p

    def forward(self, h):
        q, k, v = nn.functional.linear(h, self.qkv, self.qkv_bias).chunk(3, -1)
        a = nn.functional.dropout((q @ k.transpose(1, 2)).softmax(-1), self.p, self.training)
        o = a @ v
        return (o.reshape(-1, o.shape[-1]) @ self.proj).reshape(o.shape)


class WithOwnAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(20, 8), OwnAttention(), nn.Linear(8, CLASSES)

    def forward(self, ids):
        return self.head(self.attn(self.emb(ids)).mean(1))


def test_own_matrices_meet_the_batch_in_row_products(monkeypatch):
    """A layer's own matrices met by rows of the batch (``F.linear(h, W, b)``, and
    ``(B·T, d) @ W`` on rows k per example, example-major) are tables too, so its attention
    dropout trains: in training, at 6 examples and at 2, each example's gradients are
    autograd's of its loss through the same forward of the batch (the RNG seeded alike),
    with the generic rule disabled."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = WithOwnAttention()
    sampler = GradSampler(model)
    x = torch.randint(0, 20, (5, 7))
    check_gradients(sampler, per_sample_cross_entropy, x, torch.arange(5) % CLASSES)
    assert [sampler.names[m] for m in sampler.shared.params] == ["attn"]
    model.train()
    for n in (6, 2):
        assert_batch_autograd(sampler, torch.randint(0, 20, (n, 7)), torch.arange(n) % CLASSES, n)


class WeightNormedConvs(nn.Module):
    """Convolutions whose kernels are computed from their parameters
    (``parametrizations.weight_norm``), each met by the batch's rows: Wav2Vec2's and HuBERT's
    positional convolution (grouped, padded, a bias), a strided, dilated Conv2d, and a
    Conv1d over rows k per example (the examples' channels folded into the batch axis)."""

    def __init__(self, form: str):
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.form = form
        if form == "wav2vec2":
            self.conv = wn(nn.Conv1d(4, 4, 5, padding=2, groups=2), name="weight", dim=2)
        elif form == "conv2d":
            self.conv = wn(nn.Conv2d(4, 3, 3, stride=2, dilation=2, padding=1))
        else:  # folded rows
            self.conv = wn(nn.Conv1d(2, 3, 3, bias=False))
        self.head = nn.LazyLinear(CLASSES)

    def forward(self, x):
        n = len(x)
        shape = {"wav2vec2": (n, 4, 9), "conv2d": (n, 4, 3, 3), "folded": (2 * n, 2, 9)}
        return self.head(torch.tanh(self.conv(x.reshape(shape[self.form]))).reshape(n, -1))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("form", ["wav2vec2", "conv2d", "folded"])
def test_a_weight_normed_convolution_meets_the_batch_as_a_table(
    form, device, float32_convolutions, monkeypatch
):
    """A convolution by a kernel computed from a table (the weight norm's) was refused: each
    example is now convolved by its own copy of the kernel, and its parameters' per-sample
    gradients are autograd's of its loss alone, at batch sizes equal to the channels and
    groups, with the generic rule disabled (on CUDA too, where a GPU is lent)."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = WeightNormedConvs(form)
    model(torch.randn(2, 36))  # the lazy head's shape
    model.to(device)
    sampler = GradSampler(model)
    y = torch.arange(5, device=device) % CLASSES
    x = torch.randn(5, 36, device=device)
    learned(sampler, lambda: check_gradients(sampler, per_sample_cross_entropy, x, y))
    assert "conv.parametrizations.weight" in {sampler.names[m] for m in sampler.shared.sites}
    for n in (4, 2, 3):
        labels = torch.arange(n, device=device) % CLASSES
        assert_batch_autograd(sampler, torch.randn(n, 36, device=device), labels, n)


class SpecAugmentLike(nn.Module):
    """Wav2Vec2's SpecAugment in small: in training only, a learned embedding is written over
    time steps a NumPy draw masks, ``h[mask] = embed`` (a table met by the batch's rows in
    a masked write, at a place eval mode never reaches). ``transposed``: the same write on
    a (T, B, d) layout, T = 5, where shapes alone would take the time axis for the batch."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        self.transposed = transposed
        self.proj, self.embed = nn.Linear(3, 4), nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):  # x (B, 5, 3)
        h = self.proj(x)
        if self.training:
            h = h.transpose(0, 1).clone() if self.transposed else h
            mask = torch.from_numpy(np.random.rand(*h.shape[:2]) < 0.4).to(h.device)
            h[mask] = self.embed
            h = h.transpose(0, 1) if self.transposed else h
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_table_met_only_in_training_is_learned_by_the_check(device, monkeypatch):
    """A layer's own parameter written into the batch's masked rows in training only was
    refused at the first step ('did not see this use': the check runs in eval mode), and its
    NumPy mask made the check's training-mode probe see the examples mixed. The check now
    learns it in a pass in training mode, the global RNGs (NumPy's too) seeded alike, kept
    because its per-sample gradients are autograd's; each step's gradients are autograd's of
    each example's loss through the same forward, the RNGs seeded alike."""
    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = SpecAugmentLike().to(device)
    x, y = torch.randn(40, 5, 3), torch.arange(40) % CLASSES
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=8, epochs=1, device=device,
    )  # fmt: skip
    assert [p.grad_sampler.names[m] for m in p.grad_sampler.shared.params] == [""]
    x, y = x.to(device), y.to(device)
    for batch in p.batches():
        p.step(batch)
    model.train()
    for n, seed in ((6, 1), (2, 2)):
        np.random.seed(seed)
        torch.manual_seed(seed)
        fast, _ = p.grad_sampler.compute(x[:n], y[:n], per_sample_cross_entropy)
        np.random.seed(seed)
        torch.manual_seed(seed)
        losses = per_sample_cross_entropy(model(x[:n]), y[:n])
        ps = params(model)
        want = [torch.autograd.grad(losses[i], ps, retain_graph=True) for i in range(n)]
        assert_sums_and_norms_are_the_loops(fast, ps, want)


def test_a_training_only_use_the_check_cannot_confirm_is_refused_at_the_step():
    """The training-mode pass keeps only what its gradients confirm: a masked write on a
    (T, B, d) layout with T equal to the probe's 5 examples looks batched by its shape, and
    is wrong; the check drops it, and a step's per-sample gradients that reach it are
    refused, on a batch of 5 too, where a layout learned by shape alone would have trained
    on misattributed gradients."""
    torch.manual_seed(0)
    model = SpecAugmentLike(transposed=True)
    x, y = torch.randn(40, 5, 3), torch.arange(40) % CLASSES
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=8, epochs=1,
    )  # fmt: skip
    model.train()
    with pytest.raises(PrivgradError, match="did not see this use"):  # what a step computes
        p.grad_sampler.compute(x[:5], y[:5], per_sample_cross_entropy)
