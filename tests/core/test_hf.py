"""Hugging Face models (the optional extra ``.[hf]``; the test extra installs it): tiny BERT,
GPT-2 and ViT classifiers built from their configurations (random weights, nothing
downloaded), their per-sample gradients equal to a loop of single-example autograd, trained
under DP-SGD by ``make_private`` and by the own loop.

GPT-2's layers are ``transformers.pytorch_utils.Conv1D`` (a linear layer with its weight
stored (in, out)) and ViT's embeddings hold the [CLS] token, the position embeddings and
the mask token themselves: each has its own rule (privgrad.per_sample.rules), and the
equivalence tests run with the generic vmap rule disabled, so a layer without its rule
fails there instead of passing by the fallback.

Text inputs carry ``position_ids`` of shape (B, T) here; Hugging Face's default, one (1, T)
row broadcast over the batch, is copied to each example only after make_private's check
(test_attribution.py). LLaMA and Gemma causal LMs are called as users call them, with their
own positions (rotary: no position embedding).

Tolerance: every comparison is float32 arithmetic in two summation orders (a batch against
one example, Gram against built norms), relative 1e-4 with an absolute floor of 2e-5 for
gradient entries near zero, as in test_layers.py.
"""

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import privgrad
from privgrad.errors import PrivgradError
from privgrad.inputs import call_model
from privgrad.per_sample import EngineFlags, GradSampler, engine
from privgrad.per_sample.independence import check_gradients
from privgrad.per_sample.tables import ReplayInstead
from privgrad.private import per_sample_cross_entropy
from kernel_guard import skip_unless_fused_runs  # tests/kernel_guard.py
from test_per_sample import assert_checkpointing_keeps_the_gradients  # tests/core

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, LENGTH, CLASSES, B = 40, 8, 3, 5
HIDDEN = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def tiny_bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        max_position_embeddings=16,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **HIDDEN,
    )
    return transformers.BertForSequenceClassification(config)


def tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        num_labels=CLASSES,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return transformers.GPT2ForSequenceClassification(config)


def vit_config(**extra):
    return transformers.ViTConfig(
        image_size=28, patch_size=7, num_channels=1, num_labels=CLASSES, **HIDDEN, **extra
    )


def tiny_vit():
    return transformers.ViTForImageClassification(vit_config())


class MaskedViT(nn.Module):
    """A ViT encoder with its mask token in use (``bool_masked_pos``) and a linear head."""

    def __init__(self):
        super().__init__()
        self.vit = transformers.ViTModel(vit_config(), add_pooling_layer=False, use_mask_token=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, pixel_values, bool_masked_pos):
        h = self.vit(pixel_values, bool_masked_pos=bool_masked_pos).last_hidden_state
        return self.head(h[:, 0])


def text_inputs(n: int, seed: int = 0) -> dict:
    """Token ids padded with 0 after 3..LENGTH tokens, their attention mask and positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    ids[1] = ids[0]  # a repeated example: equal rows in the Gram forms
    mask[1] = mask[0]
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "position_ids": torch.arange(LENGTH).expand(n, LENGTH),
    }


def image_inputs(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(n, 1, 28, 28, generator=g)}


def masked_inputs(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(n, 16, generator=g) < 0.4
    masked[0] = False  # an example with no masked patch: a zero mask-token gradient
    return {**image_inputs(n, seed), "bool_masked_pos": masked}


MODELS = {
    "bert": (tiny_bert, text_inputs),
    "gpt2": (tiny_gpt2, text_inputs),
    "vit": (tiny_vit, image_inputs),
    "vit-mask-token": (MaskedViT, masked_inputs),
}


def model_and_inputs(name: str):
    """(model maker, inputs maker) of a model of MODELS, or of BART, OPT, T5 or MPNet (Hugging
    Face's own positions, an end token per example)."""
    if name in MODELS:
        return MODELS[name]
    if name in ("t5", "mpnet"):
        return lambda: tiny_relative(name), eos_inputs
    return lambda: tiny_bart_or_opt(name), eos_inputs


def _no_generic(module, inputs, grads):
    raise AssertionError(f"{type(module).__name__} fell to the generic vmap rule")


def loop_grads(model, x: dict, y, loss_fn=per_sample_cross_entropy) -> list[list[torch.Tensor]]:
    """Each example's gradients by autograd on that example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(y)):
        one = {k: v[i : i + 1] for k, v in x.items()}
        loss = loss_fn(call_model(model, one), y[i : i + 1]).sum()
        out.append(list(torch.autograd.grad(loss, params)))
    return out


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def assert_sums_and_norms_are_the_loops(fast, params, expected):
    """Clipped sums at random weights and per-sample norms of ``fast`` against ``expected``,
    each example's gradients of ``params`` by the loop (on their device: a CUDA case's
    weights must be there too)."""
    w = torch.rand(len(expected)).to(expected[0][0].device)
    sums = dict(zip(map(id, fast.params), fast.weighted_sum(w)))
    for j, p in enumerate(params):
        close(sums[id(p)], sum(wi * grads[j] for wi, grads in zip(w, expected)))
    close(fast.norms_sq(), torch.stack([sum(g.pow(2).sum() for g in gs) for gs in expected]))


@pytest.mark.parametrize(
    "name, form",
    [(name, "auto") for name in MODELS]
    + [("gpt2", "ghost"), ("gpt2", "build"), ("gpt2", "fused"), ("bert", "fused")],
)
def test_per_sample_gradients_equal_single_example_autograd(
    name, form, device, float32_convolutions, monkeypatch
):
    """Per-sample gradients, norms and clipped sums (book-kept) of every parameter, against
    the loop, on every device present; GPT-2's Conv1D rule in both norm forms (Gram and
    built) too."""
    if form == "fused":
        skip_unless_fused_runs(device)
    make, inputs = MODELS[name]
    model = make().to(device)
    x = {k: v.to(device) for k, v in inputs(B).items()}
    y = torch.randint(0, CLASSES, (B,)).to(device)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(model, settle=True, flags=EngineFlags(norm_form=form))
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sorted(map(id, fast.params)) == sorted(map(id, params))
    norms, w = fast.norms_sq(), torch.rand(B, device=device)
    sums = dict(zip(map(id, fast.params), fast.weighted_sum(w)))
    slow, _ = sampler.compute(x, y, per_sample_cross_entropy)
    per_sample = dict(
        zip(map(id, slow.params), (g for layer in slow.layers for g in layer.per_sample()))
    )
    expected = loop_grads(model, x, y)
    for j, p in enumerate(params):
        close(per_sample[id(p)], torch.stack([grads[j] for grads in expected]))
        close(sums[id(p)], sum(wi * grads[j] for wi, grads in zip(w, expected)))
    close(norms, torch.stack([sum(g.pow(2).sum() for g in grads) for grads in expected]))


def test_gpt2_layers_and_vit_embeddings_take_their_rules():
    from privgrad.per_sample.rules import (
        RULES,
        TransposedLinearGrads,
        transposed_linear_rule,
        vit_embeddings_rule,
    )

    assert RULES.get(transformers.pytorch_utils.Conv1D) is transposed_linear_rule
    assert transformers.pytorch_utils.Conv1D in RULES
    assert RULES.get(transformers.models.vit.modeling_vit.ViTEmbeddings) is vit_embeddings_rule
    model = tiny_gpt2()
    grads, _ = GradSampler(model).compute(
        text_inputs(B), torch.zeros(B, dtype=torch.long), per_sample_cross_entropy
    )
    assert sum(isinstance(layer, TransposedLinearGrads) for layer in grads.layers) == 8


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_hugging_face_gradient_checkpointing_recomputes_and_keeps_the_gradients(name):
    """``gradient_checkpointing_enable()`` (non-reentrant, transformers' default; it acts in
    train mode only) runs each block's forward again in the backward, and the per-sample norms
    and clipped sums are those without it (as test_per_sample's torch checkpoint case)."""

    def make_model(checkpointed: bool, calls: list):
        model = MODELS[name][0]()
        # a block's first layer: a recomputation stops once the saved tensors are back
        first = (
            model.transformer.h[0].attn.c_attn
            if name == "gpt2"
            else model.bert.encoder.layer[0].attention.self.query
        )
        first.register_forward_hook(lambda *_: calls.append(1))
        if checkpointed:
            model.gradient_checkpointing_enable()
        return model.train()

    y = torch.randint(0, CLASSES, (B,))
    assert_checkpointing_keeps_the_gradients(make_model, text_inputs(B), y)


def test_default_position_ids_are_copied_only_when_allowed():
    """Without position_ids, BERT embeds one (1, T) row of positions and broadcasts it over
    the batch. A bare sampler refuses it; once allowed (make_private's attribution check
    sets assume_layouts) each example gets a copy, and the per-sample gradients are
    those of explicit (B, T) position ids."""
    x, y = text_inputs(B), torch.zeros(B, dtype=torch.long)
    shared = {k: v for k, v in x.items() if k != "position_ids"}
    torch.manual_seed(0)
    model = tiny_bert()
    sampler = GradSampler(model)
    with pytest.raises(PrivgradError, match="position_embeddings.*batch dimension missing"):
        sampler.compute(shared, y, per_sample_cross_entropy)
    sampler.assume_layouts = True
    copied, _ = sampler.compute(shared, y, per_sample_cross_entropy)
    explicit, _ = sampler.compute(x, y, per_sample_cross_entropy)
    assert [sampler.names[m] for m in sampler.expanded] == ["bert.embeddings.position_embeddings"]
    w = torch.rand(B)
    torch.testing.assert_close(copied.norms_sq(), explicit.norms_sq())
    for a, b in zip(copied.weighted_sum(w), explicit.weighted_sum(w)):
        torch.testing.assert_close(a, b)


def test_vit_embeddings_dropout_in_training_is_refused():
    model = transformers.ViTForImageClassification(vit_config(hidden_dropout_prob=0.1))
    with pytest.raises(PrivgradError, match="dropout"):
        GradSampler(model).compute(
            image_inputs(B), torch.zeros(B, dtype=torch.long), per_sample_cross_entropy
        )
    model.vit.embeddings.dropout.p = 0.0  # the encoder's dropouts may stay (their layers record)
    GradSampler(model).compute(
        image_inputs(B), torch.zeros(B, dtype=torch.long), per_sample_cross_entropy
    )


def test_a_rules_refusal_of_dropout_comes_at_make_private_not_at_the_first_step():
    """The check's training pass ran with the dropout layers off, so make_private accepted a
    ViT whose embeddings' dropout its rule cannot replay, and the first step refused it. The
    pass now keeps dropout on (drawn alike in both forwards) and refuses it then; with that
    dropout at 0 and the encoder's kept, the model trains."""
    x, y = image_inputs(40), torch.arange(40) % 2

    def private(model):
        return privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
            batch_size=8, epochs=1, seed=0,
        )  # fmt: skip

    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(vit_config(hidden_dropout_prob=0.1))
    with pytest.raises(PrivgradError, match=r"ViTEmbeddings with dropout.*met in training mode"):
        private(model)
    # the refusal named only hidden_dropout_prob=0.0, which turns the encoder's off too
    with pytest.raises(PrivgradError, match=r"embeddings\.dropout\.p = 0 keeps the encoder's"):
        private(model)
    model.vit.embeddings.dropout.p = 0.0
    trainer = private(model)
    for batch in trainer.batches(2):
        trainer.step(batch)


@pytest.mark.parametrize("name", ["gpt2", "vit-mask-token", "bart", "opt", "t5", "mpnet"])
def test_collect_drops_examples_from_the_recorded_calls(name):
    """The own loop's collect(keep=...) (examples with non-finite gradients dropped) gives
    the kept examples' gradients of a pass over them alone, ViT's embeddings (a rule that
    reads the whole call: the masked patches), BART's copied row of positions, OPT's
    flattened rows and T5's and MPNet's shared tables (layouts read as make_private's check
    leaves the samplers) included."""
    make, inputs = model_and_inputs(name)
    model = make()
    x, y = inputs(6), torch.randint(0, CLASSES, (6,))
    keep = torch.tensor([True, False, True, True, False, True])
    sampler, alone = GradSampler(model), GradSampler(model)
    sampler.assume_layouts = alone.assume_layouts = name in ("bart", "opt", "t5", "mpnet")
    assert_collect_is_the_kept_pass(sampler, alone, x, y, keep, close)


def assert_collect_is_the_kept_pass(
    sampler, alone, x: dict, y, keep, close, loss_fn=per_sample_cross_entropy
) -> None:
    """The own loop's collect(keep=...) after a recorded forward and backward of the batch
    ``x`` on ``sampler`` gives, by ``close``, the per-sample gradients ``alone`` computes on
    the kept examples only."""
    model = sampler.model
    sampler.arm(len(y), torch.device("cpu"))
    with sampler.recording():
        losses = loss_fn(call_model(model, x), y)
    losses.sum().backward()
    got = sampler.collect(1.0, keep)
    sampler.disarm()
    want, _ = alone.compute({k: v[keep] for k, v in x.items()}, y[keep], loss_fn)
    assert got.batch_size == int(keep.sum())
    for a, b in zip(
        [g for layer in got.layers for g in layer.per_sample()],
        [g for layer in want.layers for g in layer.per_sample()],
    ):
        close(a, b)


class Examples(Dataset):
    """Hugging Face style examples: a dict of inputs with the label under ``labels``."""

    def __init__(self, inputs: dict, n: int, seed: int = 0):
        self.x = inputs(n, seed)
        self.y = torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {**{k: v[i] for k, v in self.x.items()}, "labels": self.y[i]}


def _trained(model, inputs, steps: int):
    """make_private on ``model`` (SGD, σ = 1, B = 10 of 60 ``inputs`` examples), then
    ``steps`` private steps."""
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Examples(inputs, 60),
        noise_multiplier=1.0,
        batch_size=10,
        max_grad_norm=1.0,
    )
    for batch in trainer.batches(steps):
        trainer.step(batch)
    return trainer


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_make_private_trains_them(name):
    make, inputs = MODELS[name]
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trained(model, inputs, steps=3)
    assert trainer.steps == 3 and math.isfinite(trainer.epsilon()) and trainer.epsilon() > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_save_model_writes_a_hugging_face_model_as_save_pretrained_does(tmp_path):
    """trainer.save_model(PATH) of a Hugging Face model writes PATH (its state_dict) and
    PATH.hf/, which from_pretrained reads back into the trained model, with the privacy
    record inside as privacy.json (as DPTrainer saves) and named by the sidecar."""
    make, inputs = MODELS["bert"]
    model = make()
    trainer = _trained(model, inputs, steps=2)
    weights, sidecar = trainer.save_model(tmp_path / "bert.pt", note="tiny")
    record = json.loads(sidecar.read_text())
    assert record["hugging_face_folder"] == "bert.hf" and record["note"] == "tiny"
    assert json.loads((tmp_path / "bert.hf" / "privacy.json").read_text()) == record
    assert record["epsilon"] == trainer.epsilon()
    card = (tmp_path / "bert.hf" / "README.md").read_text()  # the model card, from the record
    assert f"**(ε, δ) = ({record['epsilon']:.4g}, {record['delta']:g})**" in card
    assert "`nonfinite_examples`" in card and "- differential-privacy" in card
    home = type(model).from_pretrained(tmp_path / "bert.hf")
    torch.testing.assert_close(home.state_dict(), model.state_dict())
    torch.testing.assert_close(torch.load(weights, weights_only=True), model.state_dict())


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "bart", "opt", "t5", "mpnet"])
def test_the_own_loop_trains_them(name):
    """The model as Hugging Face builds it: the own loop takes the output's ``.logits``
    (BART, OPT, T5 and MPNet with their own positions, their layouts read after attach's
    check)."""
    make, inputs = model_and_inputs(name)
    assert_the_own_loop_trains(make(), inputs)


def assert_the_own_loop_trains(model, inputs, n: int = 60, batch_size: int = 10, steps: int = 3):
    """privgrad.attach on ``n`` examples of ``inputs``, then the user's loop: a mean-reduced
    cross-entropy of the output's ``.logits`` on ``steps`` Poisson batches, each step moving
    every parameter. Returns the attached model."""
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, loader = privgrad.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(Examples(inputs, n), batch_size=batch_size),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    criterion = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        criterion(model(**x).logits, y).backward()
        optimizer.step()
        if step == steps - 1:
            break
    assert optimizer.steps == steps and math.isfinite(optimizer.epsilon())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return model


def test_the_own_loop_refuses_a_loss_the_model_computed_itself():
    """Labels passed to a Hugging Face model make it compute its loss inside the forward, past
    the per-sample taps' cut: one clear error, not a step without privacy."""
    make, inputs = MODELS["bert"]
    model = make()
    model, optimizer, loader = privgrad.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(Examples(inputs, 60), batch_size=10),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    x, y = next(iter(loader))
    with pytest.raises(PrivgradError, match="the model computed its own loss"):
        model(**x, labels=y)


def _masked_lm_loss(logits, labels):  # each example's masked positions (-100: not scored)
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)


@pytest.mark.parametrize("attention_mask", [True, False])
def test_masked_language_modelling_with_hugging_faces_collator(attention_mask):
    """BERT's masked-LM on token ids of 3 to 11 tokens, batched by Hugging Face's
    DataCollatorForLanguageModeling (padding to the batch's longest, masking 15 % of the
    positions at random): privgrad's padding check refused it whatever the model, the masks
    drawn anew for another padded shape (test_integrity.py). It is accepted with the
    attention mask the collator pads in, and refused with it dropped (the padding then moves
    the other examples' outputs)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    vocab.update({f"w{i}": len(vocab) + i for i in range(VOCAB - len(vocab))})
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (40,), generator=g).tolist()
    texts = [
        " ".join(f"w{int(i)}" for i in torch.randint(0, 35, (n,), generator=g)) for n in lengths
    ]
    examples = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    masking = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    dropped = [] if attention_mask else ["attention_mask"]  # (the collator pads it in)

    def collator(batch):
        return {k: v for k, v in masking(batch).items() if k not in dropped}

    model = transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=16, **HIDDEN)
    )
    loader = DataLoader(examples, batch_size=8, collate_fn=collator)
    make = lambda: privgrad.make_private(  # noqa: E731
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
        max_grad_norm=1.0, loss_fn=_masked_lm_loss,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="collate_fn draws random numbers"):
        if attention_mask:
            make()
        else:
            with pytest.raises(PrivgradError, match="outputs depend on the batch's padding"):
                make()


def tiny_causal_lm(name: str):
    """LLaMA's and Gemma's decoder-only LMs (their RMSNorms' rule, rotary positions,
    grouped-query attention; Gemma's head tied to its scaled embedding)."""
    small = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**small, head_dim=8))


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
    ).sum(1)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_llama_family_lms_equal_single_example_autograd_and_train(name, monkeypatch):
    """Called as users call them (input ids and attention mask, Hugging Face's own
    positions): per-sample norms and clipped sums against the loop, no layer on the generic
    rule, then make_private."""
    torch.manual_seed(0)
    model = tiny_causal_lm(name)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x = {k: v for k, v in text_inputs(B).items() if k != "position_ids"}
    ids = x["input_ids"]
    fast, _ = GradSampler(model).compute(x, ids, next_token_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = []
    for i in range(B):
        one = {k: v[i : i + 1] for k, v in x.items()}
        loss = next_token_loss(call_model(model, one), ids[i : i + 1]).sum()
        expected.append(list(torch.autograd.grad(loss, params)))
    assert_sums_and_norms_are_the_loops(fast, params, expected)
    data = {k: v for k, v in text_inputs(40, seed=1).items() if k != "position_ids"}
    trainer = privgrad.make_private(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), (data, data["input_ids"]),
        target_epsilon=3.0, epochs=1, batch_size=10, loss_fn=next_token_loss,
    )  # fmt: skip
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and 0 < trainer.epsilon() <= 3.0 + 1e-6


def tiny_bart_or_opt(name: str):
    """BART (scaled word embeddings) and OPT sequence classifiers."""
    small = dict(vocab_size=VOCAB, max_position_embeddings=16, num_labels=CLASSES, pad_token_id=0)
    if name == "bart":
        config = transformers.BartConfig(
            **small, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
            attention_dropout=0.0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
            scale_embedding=True,
        )  # fmt: skip
        return transformers.BartForSequenceClassification(config)
    config = transformers.OPTConfig(
        **small, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        dropout=0.0, word_embed_proj_dim=16,
    )  # fmt: skip
    return transformers.OPTForSequenceClassification(config)


def tiny_relative(name: str, attention: str | None = None):
    """T5 and MPNet sequence classifiers, and T5 for generation ("t5-seq2seq"): their
    relative-attention bias is a table the batch shares (test_shared_tables.py);
    ``attention`` the implementation (T5: "eager" or "sdpa", its default; MPNet has eager
    only)."""
    if name.startswith("t5"):
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, num_labels=CLASSES, dropout_rate=0.0,
            pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
        )  # fmt: skip
        model = (
            transformers.T5ForSequenceClassification
            if name == "t5"
            else transformers.T5ForConditionalGeneration
        )
    else:
        config = transformers.MPNetConfig(
            vocab_size=VOCAB, max_position_embeddings=20, num_labels=CLASSES,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **HIDDEN,
        )  # fmt: skip
        model = transformers.MPNetForSequenceClassification
    if attention is not None:
        config._attn_implementation = attention
    return model(config)


def eos_inputs(n: int, seed: int = 0) -> dict:
    """text_inputs with Hugging Face's own positions and one end token (2) per example, at
    its last token (BART classifies from it)."""
    x = {k: v.clone() for k, v in text_inputs(n, seed).items() if k != "position_ids"}
    ids, mask = x["input_ids"], x["attention_mask"]
    ids[ids == 2] = 3
    ids[torch.arange(n), mask.sum(1) - 1] = 2
    return x


@pytest.mark.parametrize("name", ["bart", "opt"])
def test_bart_and_opt_equal_single_example_autograd_and_train(name, monkeypatch):
    """BART's learned positions (an nn.Embedding subclass that embeds one row of positions for
    the batch; the lookup inside it is the layer recorded) and scaled word embeddings, and
    OPT's decoder layers (they flatten the batch's tokens to (B·T, d) before their
    feed-forward layers): as make_private's check leaves the sampler, the per-sample norms and
    clipped sums are the loop's, no layer on the generic rule; then make_private trains them."""
    torch.manual_seed(0)
    model = tiny_bart_or_opt(name)
    x, y = eos_inputs(B), torch.arange(B) % CLASSES
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    layouts = {sampler.names[m] for m in sampler.expanded | sampler.folded}
    if name == "bart":
        assert layouts == {"model.decoder.embed_positions"}
    else:
        assert layouts == {
            f"model.decoder.layers.0.{n}" for n in ("final_layer_norm", "fc1", "fc2")
        }
    params = [p for p in model.parameters() if p.requires_grad]
    assert_sums_and_norms_are_the_loops(fast, params, loop_grads(model, x, y))
    data = eos_inputs(40, seed=1)
    trainer = privgrad.make_private(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), (data, torch.arange(40) % CLASSES),
        target_epsilon=3.0, epochs=1, batch_size=10,
    )  # fmt: skip
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and 0 < trainer.epsilon() <= 3.0 + 1e-6


def test_the_own_loop_names_the_batch_input_a_forward_lacked():
    """An HF model called without the batch's attention mask was refused as 'a forward on
    inputs that are not the batch', without naming the missing input."""
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=2,
    )  # fmt: skip
    ids = torch.randint(1, 50, (40, 8))
    data = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 2, (40,)))
    model = transformers.BertForSequenceClassification(config)
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
        batch_size=8,
    )  # fmt: skip
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(input_ids=x["input_ids"]).logits, y).backward()
    with pytest.raises(PrivgradError, match=r"that forward lacked inputs\['attention_mask'\]"):
        optimizer.step()


def test_reentrant_gradient_checkpointing_is_refused_in_one_line():
    """torch refuses autograd.grad through it; the user saw that RuntimeError from inside
    make_private's check, with no word on the fix (use_reentrant=False)."""
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=2,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    x, y = torch.randint(1, 50, (40, 8)), torch.randint(0, 2, (40,))
    with pytest.raises(PrivgradError, match="use_reentrant=True.*use_reentrant.: False"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
            batch_size=8,
        )  # fmt: skip


def test_switch_transformers_routed_tokens_are_refused_with_the_reason():
    """Its experts' layers take the tokens routed to them, gathered from the whole batch:
    the refusal said only 'is a batch dimension missing?'."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        num_experts=4, encoder_sparse_step=1, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = transformers.SwitchTransformersEncoderModel(config)

        def forward(self, ids):
            return self.encoder(input_ids=ids).last_hidden_state.mean(1)

    model = Classifier()
    ids = torch.randint(3, 40, (8, 7))
    with pytest.raises(PrivgradError, match="gathered from across the batch"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, torch.zeros(8).long()),
            noise_multiplier=1.0, batch_size=4,
        )  # fmt: skip


def test_nllb_moe_capacity_routing_is_refused_by_type():
    """Its router's capacity counts the whole batch's tokens: with the default capacity (64)
    the check's 5 short examples never fill an expert, and the model trained."""
    config = transformers.NllbMoeConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1,
        max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    model = transformers.NllbMoeForConditionalGeneration(config)
    assert config.expert_capacity == 64
    ids = torch.randint(3, 40, (8, 6))
    x = {"input_ids": ids, "decoder_input_ids": ids}
    with pytest.raises(PrivgradError, match="capacity, counted over the whole batch"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, ids),
            noise_multiplier=1.0, batch_size=4,
            loss_fn=lambda out, y: nn.functional.cross_entropy(
                out.transpose(1, 2), y, reduction="none"
            ).sum(1),
        )  # fmt: skip


def tiny_speech(name: str):
    """A Wav2Vec2 or HuBERT audio classifier: a convolutional feature encoder over the raw
    waveform, a weight-normed grouped positional convolution and, in training, SpecAugment
    (its learned embedding written over NumPy-drawn masked time steps), layer drop and
    dropout all on."""
    config = getattr(transformers, f"{name}Config")(
        **HIDDEN, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, num_labels=CLASSES,
        mask_time_prob=0.3, mask_time_length=2,
    )  # fmt: skip
    return getattr(transformers, f"{name}ForSequenceClassification")(config)


@pytest.mark.parametrize("name", ["Wav2Vec2", "Hubert", "WavLM", "SEWD"])
def test_speech_classifiers_train_with_spec_augment(name, monkeypatch):
    """Refused before: the positional convolution's kernel is a table (weight norm) met by a
    convolution, SpecAugment's embedding is met in a masked write in training only, and its
    NumPy masks made the check see the examples mixed; WavLM's attention, dropout on, reads
    its projections' weights in torch's F.multi_head_attention_forward. make_private now
    trains them, and in training each example's per-sample gradients are autograd's of its
    loss through the same forward (the RNGs seeded alike), with the generic rule disabled."""
    import numpy as np

    torch.manual_seed(0)
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    model = tiny_speech(name)
    x, y = torch.randn(24, 400), torch.arange(24) % CLASSES
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=8, epochs=1,
    )  # fmt: skip
    for batch in p.batches():
        p.step(batch)
    assert p.steps == 3 and 0 < p.epsilon() < math.inf
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    for seed in (1, 2):
        np.random.seed(seed)
        torch.manual_seed(seed)
        fast, _ = p.grad_sampler.compute(x[:6], y[:6], per_sample_cross_entropy)
        np.random.seed(seed)
        torch.manual_seed(seed)
        losses = per_sample_cross_entropy(model(x[:6]).logits, y[:6])
        want = [  # a layer layer drop skipped: zero gradients
            [
                torch.zeros_like(q) if g is None else g
                for q, g in zip(params, torch.autograd.grad(
                    losses[i], params, retain_graph=True, allow_unused=True
                ))
            ]
            for i in range(6)
        ]  # fmt: skip
        assert_sums_and_norms_are_the_loops(fast, params, want)


def assert_per_sample_on_their_scale(fast, model, expected, names) -> None:
    """Each example's gradient of each parameter ``names`` accepts (a predicate on its name)
    against the loop's ``expected``, on its own scale: the tolerance's floor (2e-5) would
    pass a gradient of 1e-6 whatever it was."""
    per_sample = dict(
        zip(map(id, fast.params), (g for layer in fast.layers for g in layer.per_sample()))
    )
    at = {id(p): j for j, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    for name, p in model.named_parameters():
        if names(name):
            want = torch.stack([grads[at[id(p)]] for grads in expected])
            assert want.abs().max() > 0, name
            torch.testing.assert_close(
                per_sample[id(p)], want, rtol=1e-4, atol=1e-5 * want.abs().max()
            )


def test_wavlm_attention_equals_single_example_autograd(monkeypatch):
    """WavLM's attention passes its q/k/v/out projections' weights to torch's
    F.multi_head_attention_forward, never calling those Linear layers (refused before: "its
    gradient is not the sum of its layer's per-sample gradients"); the sampler computes that
    call with the projections as their layers' calls. Its attention mask is a relative
    position bias: an Embedding of the (T × T) grid's buckets (a table the batch shares, made
    in the first layer and passed on), scaled per example by a gate computed from the hidden
    states (gru_rel_pos_linear) and the layer's own gru_rel_pos_const. As make_private's check
    leaves the sampler, in eval mode, per-sample gradients, norms and clipped sums are the
    loop's, no layer on the generic rule; the table and gate are scaled up so that their
    gradients count (training, attention dropout on:
    test_speech_classifiers_train_with_spec_augment)."""
    torch.manual_seed(0)
    model = tiny_speech("WavLM").eval()
    for layer in model.wavlm.encoder.layers:
        nn.init.normal_(layer.attention.gru_rel_pos_linear.weight, std=1.0)
        nn.init.uniform_(layer.attention.gru_rel_pos_const, 0.5, 1.5)
    nn.init.normal_(model.wavlm.encoder.layers[0].attention.rel_attn_embed.weight, std=3.0)
    model.wavlm.masked_spec_embed.requires_grad_(False)  # SpecAugment's: unused in eval mode
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x, y = {"input_values": torch.randn(B, 400)}, torch.arange(B) % CLASSES
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = loop_grads(model, x, y)
    assert_sums_and_norms_are_the_loops(fast, params, expected)
    assert_per_sample_on_their_scale(  # k_proj's bias has no gradient (softmax's shift)
        fast, model, expected, lambda name: "attention" in name and "k_proj.bias" not in name
    )


def test_wavlm_attention_is_computed_alike_when_checkpointing_recomputes_it(monkeypatch):
    """Activation checkpointing runs each WavLM layer's forward again in the backward, where
    its attention is computed from its projections' calls again (torch's own call there
    saved other tensors, and the checkpoint refused the recomputation). Norms and clipped
    sums are those without checkpointing, dropout on (the RNG seeded alike), no layer on the
    generic rule. SpecAugment off: its masked write is met in training only, learned by the
    check's training pass, whose batched backwards through a table inside a checkpointed
    layer recompute the layer inside a vmap, where its dropout cannot draw (the model is then
    refused at its first step)."""
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x, y = torch.randn(6, 400), torch.arange(6) % CLASSES
    w, results = torch.rand(6), []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = tiny_speech("WavLM")
        model.config.mask_time_prob = 0.0
        if checkpointed:
            model.gradient_checkpointing_enable()
        sampler = GradSampler(model)
        check_gradients(sampler, per_sample_cross_entropy, x[:5], y[:5])
        model.train()
        torch.manual_seed(1)
        grads, _ = sampler.compute(x, y, per_sample_cross_entropy)
        results.append((grads.norms_sq(), grads.weighted_sum(w)))
    (norms, sums), (norms_ckpt, sums_ckpt) = results
    torch.testing.assert_close(norms_ckpt, norms)
    for a, b in zip(sums_ckpt, sums):
        torch.testing.assert_close(a, b)


def test_sew_d_relative_position_table_equals_single_example_autograd(monkeypatch):
    """SEW-D's encoder is DeBERTa-v2's: it reads its relative-position Embedding's weight
    whole, normalised by a LayerNorm (refused before: that LayerNorm "was called on an input
    of shape (512, 32) ... for a batch of 5"), which each attention layer projects by its
    query and key projections (share_att_key), also called on the batch, and in training
    drops out by a custom autograd Function (StableDropout). It is followed as a table the
    batch shares, as DeBERTa's (rules.TABLE_CHILDREN): as make_private's check leaves the
    sampler, in eval mode, per-sample gradients, norms and clipped sums are the loop's, no
    layer on the generic rule (training, dropout on:
    test_speech_classifiers_train_with_spec_augment)."""
    torch.manual_seed(0)
    model = tiny_speech("SEWD").eval()
    model.sew_d.masked_spec_embed.requires_grad_(False)  # SpecAugment's: unused in eval mode
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    x, y = {"input_values": torch.randn(B, 400)}, torch.arange(B) % CLASSES
    sampler = GradSampler(model)
    sampler.assume_layouts = True
    with pytest.raises(ReplayInstead, match="called on the batch and on tensors the batch"):
        sampler.compute(x, y, per_sample_cross_entropy)  # the check runs its pass again
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = loop_grads(model, x, y)
    assert_sums_and_norms_are_the_loops(fast, params, expected)
    assert_per_sample_on_their_scale(
        fast,
        model,
        expected,
        lambda name: (
            "encoder.encoder.rel_embeddings" in name
            or "encoder.encoder.LayerNorm" in name
            or "attention.self" in name
        ),
    )


def ctc_loss(log_probs_of, labels: torch.Tensor) -> torch.Tensor:
    """Each example's CTC loss, its label row packed as the guide says: [frames, target
    length, target tokens padded]."""
    log_probs = log_probs_of.log_softmax(-1).transpose(0, 1)  # (T, B, V), as ctc_loss takes
    return nn.functional.ctc_loss(
        log_probs, labels[:, 2:], labels[:, 0], labels[:, 1], reduction="none",
        zero_infinity=True,
    )  # fmt: skip


def test_a_speech_recogniser_trains_with_a_per_example_ctc_loss():
    """Wav2Vec2ForCTC (SpecAugment, layer drop and dropout on) under make_private, with the
    CTC loss per example: its frame count and target length travel in the label row, since
    loss_fn sees only the output and the labels (make_private's check compares each
    example's gradient with autograd's, in training mode too)."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        **HIDDEN, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=6,
        mask_time_prob=0.3, mask_time_length=2,
    )  # fmt: skip
    model = transformers.Wav2Vec2ForCTC(config)
    n, samples, longest = 24, 400, 4
    frames = int(model._get_feat_extract_output_lengths(torch.tensor(samples)))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (n,), generator=g)
    tokens = torch.randint(1, 6, (n, longest), generator=g) * (
        torch.arange(longest) < lengths[:, None]
    )
    labels = torch.cat([torch.full((n, 1), frames), lengths[:, None], tokens], 1)
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(n, samples), labels),
        noise_multiplier=1.0, batch_size=8, epochs=1, loss_fn=ctc_loss, seed=0,
    )  # fmt: skip
    for batch in p.batches():
        p.step(batch)
    assert p.steps == 3 and 0 < p.epsilon() < math.inf


def test_speech_classifier_trains_under_bf16_autocast():
    """The positional convolution's weight-normed kernel met by the batch: under bf16
    autocast its rows are bf16 and the kernel float32, and the result's shape (worked out on
    the meta device, which autocast does not cast) failed with "Input type (c10::BFloat16)
    and bias type (float) should be the same". It trains, and each example's per-sample
    norm is autograd's under the same autocast to bf16's rounding."""
    torch.manual_seed(0)
    model = tiny_speech("Wav2Vec2")
    model.config.mask_time_prob = 0.0
    x, y = torch.randn(16, 400), torch.arange(16) % CLASSES
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=8, epochs=1, precision="bf16",
    )  # fmt: skip
    for batch in p.batches():
        p.step(batch)
    assert p.steps == 2
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    torch.manual_seed(1)
    fast, _ = p.grad_sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x[:4]).logits
    losses = per_sample_cross_entropy(logits.float(), y[:4])
    want = torch.stack([
        sum(g.float().pow(2).sum() for g in torch.autograd.grad(
            losses[i], params, retain_graph=True, allow_unused=True
        ) if g is not None)
        for i in range(4)
    ])  # fmt: skip
    torch.testing.assert_close(fast.norms_sq(), want, rtol=2e-2, atol=0)


def test_spec_augment_on_padded_audio_trains():
    """Padded audio with its attention_mask and SpecAugment on (wav2vec2-large's usage):
    each example's masks are drawn from NumPy's global RNG in turn, as many as its length
    asks, so the check's example 0 replaced by one of another length moved every later
    example's masks, and make_private refused the model as mixing examples (naming
    'wav2vec2.feature_projection.projection', before whose recorded output the masked write
    landed). The check now perturbs example 0's waveform instead, which keeps its draws; the
    model trains, and in training each example's per-sample gradients are autograd's of its
    loss through the same forward, on a padding pattern the check did not see."""
    import numpy as np

    torch.manual_seed(0)
    model = tiny_speech("Wav2Vec2")
    x, lengths = torch.randn(16, 400), torch.tensor([400, 150, 300, 220, 360] * 4)[:16]
    mask = (torch.arange(400)[None] < lengths[:, None]).long()
    data = ({"input_values": x * mask, "attention_mask": mask}, torch.arange(16) % CLASSES)
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
        batch_size=8,
    )  # fmt: skip
    for batch in p.batches():
        p.step(batch)
    assert p.steps == 2
    model.train()
    idx = torch.tensor([3, 1, 15, 8])
    xs, ys = {k: v[idx] for k, v in data[0].items()}, data[1][idx]
    params = [q for q in model.parameters() if q.requires_grad]
    np.random.seed(3)
    torch.manual_seed(3)
    fast, _ = p.grad_sampler.compute(xs, ys, per_sample_cross_entropy)
    np.random.seed(3)
    torch.manual_seed(3)
    losses = per_sample_cross_entropy(model(**xs).logits, ys)
    want = [
        [
            torch.zeros_like(q) if g is None else g
            for q, g in zip(params, torch.autograd.grad(
                losses[i], params, retain_graph=True, allow_unused=True
            ))
        ]
        for i in range(len(ys))
    ]  # fmt: skip
    assert_sums_and_norms_are_the_loops(fast, params, want)
