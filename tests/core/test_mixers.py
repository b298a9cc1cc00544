"""Layers whose forward reads its children's parameters directly (privgrad/per_sample/rules.py,
READ_CHILDREN): Hugging Face's state-space and linear-attention mixers call
``F.conv1d(x, self.conv1d.weight, ...)`` (Mamba's ``self.dt_proj.weight @ t`` too), so those
children's own forward never runs; the generic rule replays the mixer for its own parameters
and theirs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.per_sample import (
    EngineFlags,
    GradSampler,
    register_read_children,
    rules,
)
from privgrad.private import per_sample_cross_entropy
from test_experts import (  # tests/core
    assert_micro_batches_take_whole_steps,
    assert_the_loops,
    checked_sampler,
    private,
    token_data,
)
from test_hf import (  # tests/core
    CLASSES,
    VOCAB,
    assert_collect_is_the_kept_pass,
    assert_the_own_loop_trains,
    close,
    eos_inputs,
    loop_grads,
    next_token_loss,
)

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32,
    num_labels=CLASSES, pad_token_id=0, use_cache=False,
)  # fmt: skip
MIXERS = {
    # Mamba: conv1d and dt_proj read directly, A_log and D its own, a sequential scan
    "mamba": dict(state_size=8),
    # Mamba-2: conv1d read directly, the chunked scan, a gated RMSNorm
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=4),
    # Qwen3.5's gated delta rule (linear attention) beside full attention
    "qwen3_5_text": dict(
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
    ),
}  # fmt: skip
B = 6


LMS = {"mamba", "mamba2"}  # transformers has no classifier for them: their LMs, classified below


def tiny(name: str):
    config = transformers.AutoConfig.for_model(name, **SMALL, **MIXERS[name])
    if name in LMS:
        return transformers.AutoModelForCausalLM.from_config(config)
    return transformers.AutoModelForSequenceClassification.from_config(config)


def last_token_loss(logits, y):
    """A causal LM as a classifier: cross-entropy of the last position's first logits."""
    return per_sample_cross_entropy(logits[:, -1, :CLASSES], y)


def loss_and_labels(name: str, x: dict):
    """An LM's next-token loss on its ids (every position's), a classifier's on classes."""
    if name in LMS:
        return next_token_loss, x["input_ids"]
    return per_sample_cross_entropy, torch.arange(len(x["input_ids"])) % CLASSES


def private_lm(model):
    """make_private on test_experts' 40 token sequences, expected batch 10, ε = 3, a causal
    LM classified by its last position."""
    x, y = token_data()
    return privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=3.0,
        epochs=1, batch_size=10, seed=0, loss_fn=last_token_loss,
    )  # fmt: skip


def mixers_of(model) -> list[nn.Module]:
    return [m for m in model.modules() if rules.read_children(m)]


@pytest.mark.parametrize("form", ["auto", "vmap", "loop"])
@pytest.mark.parametrize("name", list(MIXERS))
def test_mixers_equal_single_example_autograd(name, form, device):
    """Per-sample gradients, norms and clipped sums of every parameter (the mixers' conv1d,
    dt_proj, A_log and D among them) against each example alone through the model, with each
    replay form (EngineFlags.replay_form), on every device present."""
    torch.manual_seed(0)
    model = tiny(name).to(device)
    mixers = mixers_of(model)
    assert mixers
    x = {k: v.to(device) for k, v in eos_inputs(B).items()}
    loss_fn, y = loss_and_labels(name, x)
    y = y.to(device)
    sampler = checked_sampler(model, x, y, loss_fn, EngineFlags(replay_form=form))
    assert set(mixers) <= {m for _, m in sampler.layers}
    fast, _ = sampler.compute(x, y, loss_fn)
    per_sample = assert_the_loops(fast, model, loop_grads(model, x, y, loss_fn))
    # not vacuous: the first mixer's conv1d has a gradient for every example
    conv = per_sample[id(mixers[0].conv1d.weight)]
    assert conv.flatten(1).norm(dim=1).gt(0).all()


def test_mixers_under_bf16_autocast_are_close_to_float32():
    """Under bf16 autocast (the forward's and backward's tensors in bf16, the replay on the
    recorded inputs in float32), the per-sample gradients of Mamba's mixers' replayed
    parameters (conv1d, dt_proj, A_log, D) are float32's to bf16 rounding compounded over the
    forward and backward (10 % of the largest entry; a gradient credited to the wrong
    example is off by its whole size)."""
    torch.manual_seed(0)
    model = tiny("mamba")
    x = eos_inputs(B)
    loss_fn, y = loss_and_labels("mamba", x)
    sampler = checked_sampler(model, x, y, loss_fn)
    replayed = [p for m in mixers_of(model) for p in rules.layer_params(m)]
    grads = {}
    for precision in ("fp32", "bf16"):
        sampler.precision = precision
        fast, _ = sampler.compute(x, y, loss_fn)
        got = dict(zip(map(id, fast.params), (g for u in fast.layers for g in u.per_sample())))
        grads[precision] = [got[id(p)] for p in replayed]
    assert len(replayed) == 2 * 6  # A_log, D, conv1d's and dt_proj's weight and bias
    for a, b in zip(grads["fp32"], grads["bf16"]):
        assert b.dtype == torch.float32 and a.abs().max() > 0 and not torch.equal(a, b)
        torch.testing.assert_close(b, a, rtol=0.1, atol=0.1 * float(a.abs().max()))


def test_micro_batches_take_the_steps_of_whole_batches():
    """make_private with physical micro-batches of 3 takes the same steps and ε as with whole
    batches on a Qwen3.5 classifier: each chunk's replay of the gated delta net reads its
    own examples' hidden states and mask."""
    assert_micro_batches_take_whole_steps(lambda: tiny("qwen3_5_text"))


def test_collect_drops_examples_from_a_mixers_calls():
    """The own loop's collect(keep=...) takes the kept examples' rows of the mixer's recorded
    calls (hidden states and attention mask)."""
    torch.manual_seed(0)
    model = tiny("mamba")
    x = eos_inputs(6)
    loss_fn, y = loss_and_labels("mamba", x)
    keep = torch.tensor([True, False, True, True, False, True])
    sampler, alone = (checked_sampler(model, x, y, loss_fn) for _ in "ab")
    assert_collect_is_the_kept_pass(sampler, alone, x, y, keep, close, loss_fn=loss_fn)


def test_make_private_and_the_own_loop_train_them():
    """make_private's check passes and DP-SGD steps (Mamba); the own loop trains a Qwen3.5
    classifier."""
    torch.manual_seed(0)
    trainer = private_lm(tiny("mamba"))
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and 0 < trainer.epsilon() <= 3.0 + 1e-6
    assert_the_own_loop_trains(tiny("qwen3_5_text"), eos_inputs)


def test_a_mixer_not_declared_is_refused(monkeypatch):
    """Without its entry, Mamba's conv1d is a layer never called, whose gradient autograd has
    and the per-sample gradients lack: make_private's check refuses it, naming the
    declaration."""
    monkeypatch.delitem(rules.READ_CHILDREN, "transformers.models.mamba.modeling_mamba.MambaMixer")
    with pytest.raises(PrivgradError, match=r"conv1d.weight': its gradient is not the sum") as e:
        private_lm(tiny("mamba"))
    assert "register_read_children(MambaMixer, ('conv1d',))" in str(e.value)


class ShortConv(nn.Module):
    """A user's mixer: a causal depthwise convolution by its child's weight, read directly,
    and a gate of its own."""

    def __init__(self, width: int = 8, call_the_child: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, groups=width)
        self.gate = nn.Parameter(torch.ones(width))
        self.call_the_child = call_the_child

    def forward(self, h):  # (B, T, d)
        x = F.pad(h.transpose(1, 2), (2, 0))
        c = self.conv
        z = c(x) if self.call_the_child else F.conv1d(x, c.weight, c.bias, groups=c.groups)
        return h + torch.sigmoid(self.gate) * z.transpose(1, 2)


class Tagger(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.embed, self.mixer, self.head = nn.Embedding(VOCAB, 8), mixer, nn.Linear(8, CLASSES)

    def forward(self, ids):
        return self.head(self.mixer(self.embed(ids)).mean(1))


def test_a_users_mixer_trains_once_declared(monkeypatch):
    """Refused until declared (the check's hint names the call to make), then its per-sample
    gradients are the loop's and it trains; a declared child called on its own is refused
    (its gradient would be missed)."""
    monkeypatch.setattr(rules, "_READ_CHILDREN_BY_TYPE", {})
    torch.manual_seed(0)
    with pytest.raises(PrivgradError, match=r"register_read_children\(ShortConv, \('conv',\)\)"):
        private(Tagger(ShortConv()))
    with pytest.raises(TypeError, match="tuple of attribute names"):
        register_read_children(ShortConv, "conv")
    register_read_children(ShortConv, ("conv",))
    model = Tagger(ShortConv())
    x, y = torch.randint(1, VOCAB, (B, 5)), torch.arange(B) % CLASSES
    fast, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
    expected = loop_grads(model, {"ids": x}, y)
    assert_the_loops(fast, model, expected)
    trainer = private(model)
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0
    with pytest.raises(PrivgradError, match="part of its parent layer's rule"):
        private(Tagger(ShortConv(call_the_child=True)))


class FusedInTraining(ShortConv):
    """A mixer that, like transformers' Mamba where mamba_ssm is installed, takes another path
    in training: there it reads its projection's weight directly too, where in eval mode (the
    check's) it calls the projection."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        z = super().forward(h)
        if self.training:
            return F.linear(z, self.proj.weight, self.proj.bias)
        return self.proj(z)


def test_an_inner_layer_a_mixer_skips_in_training_is_refused(monkeypatch):
    """make_private's check passes in eval mode; its pass in training mode finds the
    projection not called in the mixer's forward (its gradient would have been missed) and
    refuses it (until f980466, the first step did)."""
    monkeypatch.setattr(rules, "_READ_CHILDREN_BY_TYPE", {})
    register_read_children(FusedInTraining, ("conv",))
    torch.manual_seed(0)
    with pytest.raises(
        PrivgradError, match=r"'mixer.proj' \(Linear\) was not called in this.*met in training"
    ):
        private(Tagger(FusedInTraining()))
