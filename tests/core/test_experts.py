"""Mixture-of-experts layers (privgrad/per_sample/experts.py): Hugging Face's experts modules
take the batch's tokens flattened and routed, and each example's gradient of each expert is
that of two linear maps over its own tokens routed there."""

import pytest
import torch
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.per_sample import DEFAULT_FLAGS, GradSampler, engine
from privgrad.per_sample.rules import RULES
from privgrad.private import per_sample_cross_entropy
from test_hf import (  # tests/core
    CLASSES,
    VOCAB,
    _no_generic,
    assert_collect_is_the_kept_pass,
    assert_sums_and_norms_are_the_loops,
    assert_the_own_loop_trains,
    close,
    eos_inputs,
    loop_grads,
    next_token_loss,
)
from test_shared_tables import assert_batch_autograd  # tests/core

transformers = pytest.importorskip("transformers")
# the experts interface (transformers 5): a machine with an older transformers skips these
use_experts_implementation = pytest.importorskip(
    "transformers.integrations.moe"
).use_experts_implementation

SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=32, num_labels=CLASSES, pad_token_id=0,
)  # fmt: skip
MOE = {
    # 4 experts, 2 per token; Mixtral's gate_up_proj (E, 2I, d), [gate; up] concatenated
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24),
    # weights stored transposed (E, d, 2I), biases, gate and up interleaved, its own gate
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, head_dim=16,
        layer_types=["full_attention", "sliding_attention"],
    ),
    # a shared expert beside the routed ones, and its sigmoid gate
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, intermediate_size=48,
    ),
}  # fmt: skip
B = 6


def tiny_moe(name: str, implementation: str = "eager"):
    config = transformers.AutoConfig.for_model(name, **SMALL, **MOE[name])
    config._experts_implementation = implementation
    return transformers.AutoModelForSequenceClassification.from_config(config)


def experts_of(model) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def checked_sampler(
    model, x, y, loss_fn=per_sample_cross_entropy, flags=DEFAULT_FLAGS
) -> GradSampler:
    """A sampler as make_private's check leaves it: its pass read the layouts it saw (the
    experts' rows as examples', ``folded``; which arguments of a replayed layer carry the
    batch)."""
    sampler = GradSampler(model, flags=flags)
    sampler.assume_layouts = True
    sampler.compute(x, y, loss_fn)
    sampler.assume_layouts = False
    return sampler


def assert_the_loops(fast, model, expected) -> dict:
    """Every parameter's per-sample gradients, clipped sums and norms of ``fast`` against
    ``expected``, each example's gradients by the loop; returns the per-sample gradients by
    parameter id."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_sample = dict(
        zip(map(id, fast.params), (g for layer in fast.layers for g in layer.per_sample()))
    )
    for j, p in enumerate(params):
        close(per_sample[id(p)], torch.stack([grads[j] for grads in expected]))
    assert_sums_and_norms_are_the_loops(fast, params, expected)
    return per_sample


def private(model):
    """make_private on :func:`token_data`'s 40 examples, expected batch 10, ε = 3."""
    x, y = token_data()
    return privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), target_epsilon=3.0,
        epochs=1, batch_size=10, seed=0,
    )  # fmt: skip


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("name", list(MOE))
def test_experts_equal_single_example_autograd(name, implementation, device, monkeypatch):
    """Per-sample gradients, norms and clipped sums of every parameter against each example
    alone through the model, no layer on the generic rule, with each of Hugging Face's
    implementations of the experts (one loop per expert, gathered weights, grouped matmuls),
    on every device present."""
    torch.manual_seed(0)
    model = tiny_moe(name, implementation).to(device)
    assert experts_of(model) and all(RULES.get(type(m)) for m in experts_of(model))
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x = {k: v.to(device) for k, v in eos_inputs(B).items()}
    y = (torch.arange(B) % CLASSES).to(device)
    sampler = checked_sampler(model, x, y)
    assert set(experts_of(model)) <= sampler.folded
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    per_sample = assert_the_loops(fast, model, loop_grads(model, x, y))
    # not vacuous: the first layer's experts (whose tokens all reach the classified one; the
    # last layer's reach it only through its own) have gradients, 3 of the 4 at least
    grads = per_sample[id(next(experts_of(model)[0].parameters()))]
    assert grads.flatten(2).norm(dim=2).gt(0).any(0).sum() >= 3


def test_router_jitter_in_training_is_part_of_the_recorded_forward():
    """Mixtral's router jitter (a random factor on each token in training): nothing is
    replayed, so each example's gradients are autograd's of its loss through the same
    forward of the batch (the RNG seeded alike for both)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "mixtral", **SMALL, **MOE["mixtral"], router_jitter_noise=0.1
    )
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    x, y = eos_inputs(B), torch.arange(B) % CLASSES
    sampler = checked_sampler(model, x, y)
    model.train()
    assert_batch_autograd(sampler, x, y, seed=5)


def test_experts_under_bf16_autocast_are_close_to_float32():
    """Under bf16 autocast (tokens and output gradients in bf16, the router's weights in
    float32), the experts' per-sample gradients, in float32 as every rule's, are float32's
    to bf16 rounding compounded over the forward and backward (10 % of the largest entry; a
    gradient credited to the wrong example is off by its whole size)."""
    torch.manual_seed(0)
    model = tiny_moe("mixtral")
    x, y = eos_inputs(B), torch.arange(B) % CLASSES
    sampler = checked_sampler(model, x, y)
    grads = {}
    for precision in ("fp32", "bf16"):
        sampler.precision = precision
        fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
        got = dict(
            zip(map(id, fast.params), (g for layer in fast.layers for g in layer.per_sample()))
        )
        grads[precision] = [got[id(p)] for m in experts_of(model) for p in m.parameters()]
    for a, b in zip(grads["fp32"], grads["bf16"]):
        assert b.dtype == torch.float32 and a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=0.1, atol=0.1 * float(a.abs().max()))


def test_micro_batches_take_the_steps_of_whole_batches():
    """make_private with physical micro-batches of 3 takes the same steps (parameters within
    float32 rounding) and the same ε as with whole batches: each chunk's experts read its own
    examples' rows."""
    assert_micro_batches_take_whole_steps(lambda: tiny_moe("mixtral"))


def assert_micro_batches_take_whole_steps(make) -> None:
    """make_private on a fresh ``make()`` classifier, 40 examples, with whole batches and
    with physical micro-batches of 3: the same parameters after 3 steps (within float32
    rounding) and the same ε."""
    data, labels = eos_inputs(40, seed=2), torch.arange(40) % CLASSES
    results = []
    for chunk in (None, 3):
        torch.manual_seed(0)
        model = make()
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), (data, labels),
            noise_multiplier=1.0, max_grad_norm=0.1, batch_size=10, seed=7,
            max_physical_batch_size=chunk,
        )  # fmt: skip
        for batch in trainer.batches(3):
            trainer.step(batch)
        results.append(([p.detach().clone() for p in model.parameters()], trainer.epsilon()))
    (whole, eps), (chunked, chunked_eps) = results
    assert chunked_eps == eps
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def tiny_llama4():
    """Llama 4's text model: every token through every expert, scaled by its router score
    (Llama4TextExperts, expert-major rows), beside a shared expert."""
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        intermediate_size=24, intermediate_size_mlp=48, max_position_embeddings=32,
        interleave_moe_layer_step=1, no_rope_layers=[1, 1], pad_token_id=0,
    )  # fmt: skip
    return transformers.Llama4ForCausalLM(config)


def test_llama4_experts_equal_single_example_autograd(device, monkeypatch):
    """Llama 4's experts (their rows expert-major, E·B·T): per-sample gradients, norms and
    clipped sums against each example alone through the model, no layer on the generic
    rule, and collect(keep) takes each kept example's rows in every expert's block."""
    torch.manual_seed(0)
    model = tiny_llama4().to(device)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x = {k: v.to(device) for k, v in eos_inputs(B).items()}
    ids = x["input_ids"]
    sampler = checked_sampler(model, x, ids, next_token_loss)
    assert set(experts_of(model)) <= sampler.folded
    fast, _ = sampler.compute(x, ids, next_token_loss)
    assert_the_loops(fast, model, loop_grads(model, x, ids, next_token_loss))
    if device == "cpu":  # (the helper records on the CPU)
        keep = torch.tensor([True, False, True, True, False, True])
        alone = checked_sampler(
            model, {k: v[keep] for k, v in x.items()}, ids[keep], next_token_loss
        )
        assert_collect_is_the_kept_pass(sampler, alone, x, ids, keep, close, next_token_loss)


def test_collect_drops_examples_from_the_experts_calls():
    """The own loop's collect(keep=...): each kept example's T rows of the experts' tokens,
    expert ids and routing weights."""
    torch.manual_seed(0)
    model = tiny_moe("mixtral")
    x, y = eos_inputs(B), torch.arange(B) % CLASSES
    sampler = checked_sampler(model, x, y)
    keep = torch.tensor([True, False, True, True, False, True])
    alone = checked_sampler(model, {k: v[keep] for k, v in x.items()}, y[keep])
    assert_collect_is_the_kept_pass(sampler, alone, x, y, keep, close)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_the_own_loop_trains_them(name):
    """The user's loop on Poisson batches of varying size, a mean-reduced loss of the
    output's ``.logits``: every parameter moves, the experts' too."""
    torch.manual_seed(0)
    assert_the_own_loop_trains(tiny_moe(name), eos_inputs)


def test_the_own_loop_refuses_the_load_balancing_loss():
    """Mixtral's auxiliary load-balancing loss (output_router_logits) is computed from the
    router logits of the whole batch, so each example's term depends on the others': added to
    the loss, it reaches the layers other than through the output, which the own loop refuses."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **{k: v for k, v in SMALL.items() if k != "num_labels"}, **MOE["mixtral"],
        output_router_logits=True, router_aux_loss_coef=0.1,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    data = eos_inputs(40)
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (data, data["input_ids"]),
        noise_multiplier=1.0, max_grad_norm=1.0, loss_fn=next_token_loss, batch_size=10,
    )  # fmt: skip
    x, ids = next(iter(loader))
    out = model(**x)
    assert out.aux_loss.requires_grad
    (next_token_loss(out.logits, ids).mean() + out.aux_loss).backward()
    with pytest.raises(PrivgradError, match="other than through its output"):
        optimizer.step()


class Block(nn.Module):
    """Embedding, a mixture of experts (a router on (B, T, d), then ``experts`` on the tokens
    flattened ``order``-major), mean over positions, a linear head."""

    def __init__(self, experts: nn.Module, order: str = "example"):
        super().__init__()
        d, n = experts.hidden_dim, experts.num_experts
        self.embed, self.router = nn.Embedding(VOCAB, d), nn.Linear(d, n, bias=False)
        self.experts, self.order, self.head = experts, order, nn.Linear(d, CLASSES)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        weights, idx = self.router(h).softmax(-1).topk(2, dim=-1)
        if self.order == "position":
            h, weights, idx = h.transpose(0, 1), weights.transpose(0, 1), idx.transpose(0, 1)
        flat = [t.reshape(-1, t.shape[-1]) for t in (h, idx, weights)]
        out = self.experts(*flat).view(h.shape)
        out = out if self.order == "example" else out.transpose(0, 1)
        return self.head(out.mean(1))


@use_experts_implementation(has_gate=False)
class ReluExperts(nn.Module):
    """A user's experts without a gate: W2_e relu(W1_e x), through Hugging Face's decorator."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.hidden_dim = 3, config.hidden_size
        self.up_proj = nn.Parameter(torch.randn(3, 20, config.hidden_size) / 4)
        self.down_proj = nn.Parameter(torch.randn(3, config.hidden_size, 20) / 4)
        self.act_fn = nn.ReLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = self.act_fn(hidden_states[token] @ self.up_proj[e].T) @ self.down_proj[e].T
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


def relu_experts(**change):
    config = transformers.MixtralConfig(hidden_size=16)
    config._experts_implementation = "eager"
    return ReluExperts(config)


def token_data(n: int = 40):
    g = torch.Generator().manual_seed(3)
    return torch.randint(1, VOCAB, (n, 5), generator=g), torch.arange(n) % CLASSES


def test_a_users_experts_without_a_gate_train(monkeypatch):
    """A class of the user's own, made an experts module by Hugging Face's decorator
    (has_gate=False: ``up_proj`` and an activation), passes make_private's check and trains."""
    torch.manual_seed(0)
    model = Block(relu_experts())
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    trainer = private(model)
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and model.experts in trainer.grad_sampler.folded


def test_experts_on_tokens_flattened_position_major_are_refused():
    """The rows read as example-major, row r example r // T's: a model that flattens (T, B, d)
    gives each expert rows of other examples there, which make_private's check sees."""
    torch.manual_seed(0)
    with pytest.raises(PrivgradError, match="flattened with another dimension, example-major"):
        private(Block(relu_experts(), order="position"))


def test_experts_with_a_norm_after_each_expert_are_refused():
    experts = relu_experts()
    experts.has_post_expert_norm = True
    with pytest.raises(PrivgradError, match="a norm after each expert"):
        private(Block(experts))


def test_rows_are_read_as_examples_only_where_the_check_saw_them():
    """A bare sampler that no check has run on refuses the experts' (B·T, d) rows, naming
    them, as it refuses any layer's flattened rows."""
    x, y = token_data(10)
    with pytest.raises(PrivgradError, match=r"\(ReluExperts\).* rows are 5 per example: make_"):
        GradSampler(Block(relu_experts())).compute(x, y, per_sample_cross_entropy)
