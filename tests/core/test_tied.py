"""Tied weights (one parameter in several layers: a language model's output layer and its
token embedding): per-sample gradients, norms and clipped sums equal a loop of
single-example autograd, and a private run counts a tied group as one layer.

A tied parameter's per-sample gradient is the sum of its layers' contributions, so its norm
has their cross terms (rules.TiedGrads); leaving them out, or one layer's sum, makes the
norms or the sums differ from the loop here. Tolerances as in test_layers.py (float32 in two
summation orders)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.inputs import call_model
from privgrad.mechanisms import MECHANISMS
from privgrad.per_sample import EngineFlags, GradSampler, engine, rules

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, T, B = 23, 7, 5


def lm_loss(logits, ids):
    """Each example's next-token cross-entropy, summed over its positions."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def tiny_gpt2_lm():
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def tiny_bert_mlm():
    """BERT's masked-LM head: its decoder's weight is the token embedding, its bias the
    head's own ``bias`` (a parameter of the head and of its decoder layer)."""
    config = transformers.BertConfig(
        vocab_size=V, max_position_embeddings=16, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    head = model.cls.predictions
    assert head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert head.decoder.bias is head.bias
    return model


class TiedThree(nn.Module):
    """Token embedding E, read out by a linear head with weight E and by a bias-free second
    head with weight E too (three layers, one parameter)."""

    def __init__(self, d=6):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d, padding_idx=0), nn.Embedding(T, d)
        self.mix = nn.Linear(d, d)
        self.head, self.aux = nn.Linear(d, V), nn.Linear(d, V, bias=False)
        self.head.weight = self.aux.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids) + self.pos(positions(ids))))
        return self.head(h) + 0.5 * self.aux(h.flip(1))


class TiedAutoencoder(nn.Module):
    """Three linear layers sharing their weight (layer pairs without the embedding's fast
    cross term: it is taken from built gradients, each layer's built once)."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec, self.out = nn.Linear(V, V), nn.Linear(V, V), nn.Linear(V, V)
        self.dec.weight = self.out.weight = self.enc.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.dec(torch.tanh(self.enc(F.one_hot(ids, V).float())))))


def token_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    ids[1] = ids[0]  # a repeated example
    ids[2, 4:] = 0  # padding (the embedding's padding_idx)
    return ids


def positions(ids):
    """Position ids of the batch's shape (Hugging Face's default is one row for the batch)."""
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)


MODELS = {
    "gpt2-lm": (tiny_gpt2_lm, lambda ids: {"input_ids": ids, "position_ids": positions(ids)}),
    # Hugging Face's default position ids, one (1, T) row the engine copies to each example
    "gpt2-lm-shared-positions": (tiny_gpt2_lm, lambda ids: {"input_ids": ids}),
    "bert-mlm": (tiny_bert_mlm, lambda ids: {"input_ids": ids, "position_ids": positions(ids)}),
    "three-tied": (TiedThree, lambda ids: ids),
    "autoencoder": (TiedAutoencoder, lambda ids: ids),
}


def loop_grads(model, x, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(B):
        one = {k: v[i : i + 1] for k, v in x.items()} if isinstance(x, dict) else x[i : i + 1]
        loss = lm_loss(call_model(model, one), ids[i : i + 1]).sum()
        out.append(list(torch.autograd.grad(loss, params)))
    return params, out


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("form", ["ghost", "build"])
@pytest.mark.parametrize("name", MODELS)
def test_tied_gradients_equal_single_example_autograd(name, form, device, monkeypatch):
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    model, ids = make().to(device), token_ids().to(device)
    x = inputs(ids)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    fast_dots = []
    dot = rules._embedding_linear_dot
    monkeypatch.setattr(rules, "_embedding_linear_dot", lambda *a: fast_dots.append(1) or dot(*a))
    sampler = GradSampler(model, settle=True, flags=EngineFlags(norm_form=form))
    sampler.assume_layouts = True  # as make_private's check leaves it
    fast, _ = sampler.compute(x, ids, lm_loss)
    params, expected = loop_grads(model, x, ids)
    assert sorted(map(id, fast.params)) == sorted(map(id, params))  # the tied one once
    assert len(fast.layers) == len(sampler.units) < len(sampler.layers)
    builds = []
    for member in (m for unit in fast.layers for m in getattr(unit, "members", [])):
        member.per_sample = lambda m=member: builds.append(m) or type(m).per_sample(m)
    norms, w = fast.norms_sq(), torch.rand(B, device=device)
    # the members without a fast cross term, each built once: TiedThree's two heads, the
    # autoencoder's three layers (once per pair, 6, before)
    assert (
        len(builds) == len(set(map(id, builds))) == {"three-tied": 2, "autoencoder": 3}.get(name, 0)
    )
    sums = dict(zip(map(id, fast.params), fast.weighted_sum(w)))
    slow, _ = sampler.compute(x, ids, lm_loss)
    per_sample = dict(
        zip(map(id, slow.params), (g for layer in slow.layers for g in layer.per_sample()))
    )
    for j, p in enumerate(params):
        close(per_sample[id(p)], torch.stack([grads[j] for grads in expected]))
        close(sums[id(p)], sum(wi * grads[j] for wi, grads in zip(w, expected)))
    close(norms, torch.stack([sum(g.pow(2).sum() for g in grads) for grads in expected]))
    # embedding–linear cross terms without built gradients: GPT-2's pair, TiedThree's two
    # (its head–head pair, and the autoencoder's, from built gradients)
    assert len(fast_dots) == {"three-tied": 2, "autoencoder": 0}.get(name, 1)
    assert len(sampler.expanded) == (name == "gpt2-lm-shared-positions")


def _no_generic(module, inputs, grads):
    raise AssertionError(f"{type(module).__name__} fell to the generic vmap rule")


def test_position_ids_shared_by_the_batch_are_refused_by_a_bare_sampler():
    """Hugging Face's default position ids, one (1, T) row broadcast over the batch, are
    copied to each example only after make_private's check (test_attribution.py): a
    GradSampler used directly refuses them and says what to pass."""
    ids = token_ids()
    with pytest.raises(PrivgradError, match=r"wpe.*pass position_ids of shape \(B, T\)"):
        GradSampler(tiny_gpt2_lm()).compute({"input_ids": ids}, ids, lm_loss)


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_a_private_run_counts_a_tied_group_as_one_layer(mechanism):
    """make_private on a tied model, every mechanism: the layer count (per-layer clipping,
    Spectral-DP's and GReDP's noise) and GIP's masks (one per parameter) see the tied
    parameter once; the run steps, the tie holds and ε is the target."""
    ids = torch.randint(1, V, (48, T), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = TiedThree()
    before = model.head.weight.detach().clone()
    privacy = {"noise_multiplier": 0.0} if mechanism == "non-private" else {"target_epsilon": 2.0}
    private = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), (ids, ids), mechanism=mechanism,
        epochs=1, batch_size=12, loss_fn=lm_loss, **privacy,
    )  # fmt: skip
    assert len(private.grad_sampler.layers) == 5 and private.n_layers == 3
    for batch in private.batches():
        private.step(batch)
    assert private.steps > 0 and not torch.equal(before, model.head.weight)
    assert model.head.weight is model.aux.weight is model.emb.weight
    if mechanism != "non-private":
        assert 0 < private.epsilon() <= 2.0 + 1e-6


def test_a_tied_language_model_trains_privately():
    """GPT2LMHeadModel (tied) under make_private with a language-model
    loss: its steps run and its ε is the target."""
    torch.manual_seed(0)
    model = tiny_gpt2_lm()
    ids = torch.randint(0, V, (40, T))
    x = {"input_ids": ids, "position_ids": positions(ids)}
    private = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, ids),
        target_epsilon=4.0, delta=1e-5, epochs=1, batch_size=10, max_grad_norm=1.0,
        loss_fn=lm_loss,
    )  # fmt: skip
    assert private.n_layers == len(private.grad_sampler.layers) - 1
    before = model.lm_head.weight.detach().clone()
    for batch in private.batches():
        private.step(batch)
    assert private.steps > 0 and not torch.equal(before, model.lm_head.weight)
    assert 0 < private.epsilon() <= 4.0 + 1e-6


def test_own_loop_on_a_tied_model_is_the_trainer():
    """privgrad.attach on a tied model: the user's forward,
    sum of the per-example losses and backward give make_private's parameters and ε."""
    ids = torch.randint(1, V, (48, T), generator=torch.Generator().manual_seed(1))
    kw = dict(target_epsilon=2.0, epochs=1, batch_size=12, seed=3, loss_fn=lm_loss)

    def model_and_optimizer():
        torch.manual_seed(0)
        model = TiedThree()
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    ref, opt = model_and_optimizer()
    trainer = privgrad.make_private(ref, opt, (ids, ids), **kw)
    for batch in trainer.batches():
        trainer.step(batch)
    own, opt = model_and_optimizer()
    own, optimizer, loader = privgrad.attach(own, opt, (ids, ids), **kw)
    for x, y in loader:
        optimizer.zero_grad()
        lm_loss(own(x), y).sum().backward()
        optimizer.step()
    assert optimizer.steps == trainer.steps > 0
    for p, q in zip(ref.parameters(), own.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert optimizer.epsilon() == trainer.epsilon()
    assert own.head.weight is own.emb.weight and not torch.equal(
        own.head.weight, model_and_optimizer()[0].head.weight
    )


class BiasTwice(nn.Module):
    """A head holding a bias tied to its decoder's, and adding it once more itself: a use
    outside any layer's forward (the decoder layer owns the shared bias)."""

    def __init__(self, d=6):
        super().__init__()
        self.emb, self.decoder = nn.Embedding(V, d), nn.Linear(d, V)
        self.bias = self.decoder.bias

    def forward(self, ids):
        return self.decoder(torch.tanh(self.emb(ids))) + self.bias


def test_a_parameter_a_layer_shares_with_a_parent_is_the_layers():
    """BERT's masked-LM head holds the decoder's bias: the decoder's rule covers it, and the
    head is no layer of its own (its generic rule would count the decoder's use again); a
    parent that also uses the bias itself is refused by make_private's check."""
    sampler = GradSampler(tiny_bert_mlm())
    names = [name for name, _ in sampler.layers]
    assert "cls.predictions.decoder" in names and "cls.predictions" not in names
    with pytest.raises(PrivgradError, match=r"'bias'.*outside that layer's forward"):
        model = BiasTwice()
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (token_ids(), token_ids()),
            target_epsilon=2.0, epochs=1, batch_size=2, loss_fn=lm_loss,
        )  # fmt: skip


class FunctionalTie(nn.Module):
    """Reads the embedding's weight out with ``F.linear`` outside any layer: a use no
    per-sample rule sees."""

    def __init__(self, d=6):
        super().__init__()
        self.emb, self.mix = nn.Embedding(V, d), nn.Linear(d, d)

    def forward(self, ids):
        return F.linear(torch.tanh(self.mix(self.emb(ids))), self.emb.weight)


def test_a_parameter_used_outside_its_layer_is_refused():
    """make_private compares, on its probe examples, the per-sample gradients' sum with
    autograd's gradient: the embedding's functional read-out would be left out of the
    private update, so it is refused with the fix (TiedThree, the same read-out through a
    tied layer, passes above)."""
    model = FunctionalTie()
    ids = token_ids()
    with pytest.raises(PrivgradError, match=r"'emb.weight'.*outside that layer's forward"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, ids), target_epsilon=2.0,
            epochs=1, batch_size=2, loss_fn=lm_loss,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64])
def test_the_coverage_check_passes_models_in_other_dtypes(dtype):
    """The check's sums are taken in the parameters' dtype, its tolerance at least 8 units of
    their rounding: a model held in float64 passes it and trains (bf16 and fp16 weights are
    refused: tests/core/test_precision.py)."""
    torch.manual_seed(0)
    model = TiedThree().to(dtype)
    ids = torch.randint(1, V, (24, T), generator=torch.Generator().manual_seed(1))
    private = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), (ids, ids), target_epsilon=2.0,
        epochs=1, batch_size=8, loss_fn=lm_loss,
    )  # fmt: skip
    for batch in private.batches():
        private.step(batch)
    assert private.steps > 0 and model.head.weight.dtype == dtype
