"""LoRA adapters from Hugging Face's ``peft`` (the usual way to fine-tune a language model
privately: Yu et al. 2022): a frozen base with trainable low-rank ``lora_A``/``lora_B``
linear layers beside some of its projections. privgrad needs no rule of its own for them:
the adapters are ``nn.Linear`` layers, the frozen base has no per-sample gradients, and
make_private's checks (independence, coverage, attribution) pass on them.

Per-sample gradients of the adapters equal single-example autograd; a private run changes
the adapters only and reaches its target ε. Tolerances as in test_layers.py."""

import math

import pytest
import torch
import torch.nn.functional as F

import privgrad
from privgrad.inputs import call_model
from privgrad.per_sample import GradSampler

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

V, T, B = 31, 7, 5


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def tiny_gpt2(head=None, seed=0, **config):
    """A one-layer GPT-2 of width 16 on V tokens (``config`` adds to its config), its weights
    drawn under ``seed``; ``head`` its class (the language model by default)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2, **config
    )
    return (head or transformers.GPT2LMHeadModel)(config)


NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def lora_model(name: str, dropout: float = 0.0):
    """GPT-2 with adapters on its Conv1D attention projections, or LLaMA on q and v."""
    torch.manual_seed(0)
    if name == "gpt2":
        base, targets = tiny_gpt2(**NO_DROPOUT), ["c_attn", "c_proj"]
    else:
        config = transformers.LlamaConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16,
        )  # fmt: skip
        base, targets = transformers.LlamaForCausalLM(config), ["q_proj", "v_proj"]
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
        fan_in_fan_out=name == "gpt2",  # Conv1D stores its weight (in, out)
        init_lora_weights=False,  # lora_B not zero, set below (a zero B is taken as fresh)
    )  # fmt: skip
    model = peft.get_peft_model(base, lora)
    for layer in model.modules():  # every adapter weight non-zero: each has a gradient path
        if isinstance(layer, torch.nn.Linear) and layer.weight.requires_grad:
            torch.nn.init.normal_(layer.weight, std=0.3)
    return model


def token_ids(n, seed=1):
    return torch.randint(1, V, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_adapter_gradients_equal_single_example_autograd(name):
    model = lora_model(name)
    ids = token_ids(B)
    x = {"input_ids": ids}
    grads, _ = GradSampler(model).compute(x, ids, lm_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert sorted(map(id, grads.params)) == sorted(map(id, params))
    expected = []
    for i in range(B):
        loss = lm_loss(call_model(model, {"input_ids": ids[i : i + 1]}), ids[i : i + 1]).sum()
        expected.append(torch.autograd.grad(loss, params))
    w = torch.rand(B)
    sums = dict(zip(map(id, grads.params), grads.weighted_sum(w)))
    for j, p in enumerate(params):
        want = sum(wi * g[j] for wi, g in zip(w, expected))
        torch.testing.assert_close(sums[id(p)], want, rtol=1e-4, atol=2e-5)
    norms = torch.stack([sum(g.pow(2).sum() for g in gs) for gs in expected])
    torch.testing.assert_close(grads.norms_sq(), norms, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name, dropout", [("gpt2", 0.0), ("llama", 0.1)])
def test_a_private_run_trains_the_adapters_only(name, dropout):
    model = lora_model(name, dropout)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = token_ids(40)
    trainer = privgrad.make_private(
        model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        ({"input_ids": ids}, ids), target_epsilon=3.0, epochs=1, batch_size=10,
        loss_fn=lm_loss,
    )  # fmt: skip
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and 0 < trainer.epsilon() <= 3.0 + 1e-6
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p) != ("lora_" in n), n


@pytest.mark.parametrize("entry", ["make_private", "attach"])
def test_a_language_model_without_loss_fn_is_told_to_pass_one(entry):
    """The default loss_fn is a classifier's cross-entropy; a causal LM's (B, T, V) logits
    against its (B, T) token ids made torch raise "Expected target size [5, 31], got [5, 7]"
    from inside make_private's probe, which named neither loss_fn nor what to pass."""
    model = lora_model("gpt2")
    ids = token_ids(40)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    make = privgrad.make_private if entry == "make_private" else privgrad.attach
    with pytest.raises(privgrad.PrivgradError, match=r"pass a loss_fn .*logits\[:, :-1\]"):
        make(model, optimizer, ({"input_ids": ids}, ids), noise_multiplier=1.0, batch_size=10)


def test_an_optimizer_without_the_trainable_head_names_it():
    """peft trains a classifier's head beside the adapters (modules_to_save); an optimizer
    built from the "lora_" parameters leaves it out, which make_private refuses. The message
    said only "1 of the model's are missing from it"; it names the parameter now."""
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="SEQ_CLS"
    )
    base = tiny_gpt2(transformers.GPT2ForSequenceClassification, pad_token_id=0)
    model = peft.get_peft_model(base, lora)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    ids = token_ids(20)
    with pytest.raises(privgrad.PrivgradError, match=r"missing: \S*score\.modules_to_save"):
        privgrad.make_private(
            model, torch.optim.SGD(adapters, lr=0.1), ({"input_ids": ids}, torch.arange(20) % 2),
            noise_multiplier=1.0, batch_size=5,
        )  # fmt: skip


def test_adapters_merged_into_the_base_are_refused_at_attach_and_at_the_step():
    """After peft's merge_adapter() (for a quick evaluation) a LoRA layer's forward runs its
    merged base weights alone: the adapters got no gradient, make_private and attach trained
    them by noise alone without a word (and unmerge_adapter() would then take other weights
    out of the base than it put in). Refused, at attach and at a step after a merge."""
    model = lora_model("gpt2")
    ids = token_ids(40)
    data = ({"input_ids": ids}, ids)
    kw = dict(noise_multiplier=1.0, batch_size=10, loss_fn=lm_loss)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.merge_adapter()
    with pytest.raises(privgrad.PrivgradError, match=r"adapters merged .*unmerge_adapter\(\)"):
        privgrad.attach(model, optimizer, data, **kw)
    model.unmerge_adapter()
    trainer = privgrad.make_private(model, optimizer, data, **kw)
    model.merge_adapter()  # merged to evaluate, not unmerged before training on
    batch = next(iter(trainer.batches()))
    with pytest.raises(privgrad.PrivgradError, match=r"layer '\S+c_attn' \(Linear\) has its"):
        trainer.step(batch)
    model.unmerge_adapter()
    trainer.step(batch)
    assert trainer.steps == 1


def _triples_in_training(module, inputs, out):
    return out * 3 if module.training else out


def test_adapters_on_a_bf16_base_train_under_the_declared_autocast():
    """A GPT-2 classifier with a frozen bfloat16 base and float32 adapters and head, attached
    with precision='bf16': the check under that autocast computed the rules' norms in bf16
    too (lora_B's per-sample norm 0.06833 < its sum's 0.06853: refused as a rule breaking
    its contract) and met autograd's bf16-rounded gradients to float32's 1e-3 (the head's
    differed by 0.0014: refused as a misattribution), so such a model could not train. The
    norms are float32 now, as at a step, and autograd is met to twice bf16's rounding; a
    gradient a third of autograd's (a hook tripling an adapter's output in training) is
    still refused."""
    V, L = 200, 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (256, L), generator=g)
    data = ({"input_ids": ids}, (ids[:, 0] > V // 2).long())

    def model(hooked=False):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=V, n_positions=L, n_embd=32, n_layer=2, n_head=2, pad_token_id=0
        )
        base = transformers.GPT2ForSequenceClassification(config).to(torch.bfloat16)
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
            task_type="SEQ_CLS",
        )  # fmt: skip
        model = peft.get_peft_model(base, lora)
        for name, layer in model.named_modules():
            if name.endswith("modules_to_save.default"):
                layer.float()
            if hooked and name.endswith("h.0.attn.c_attn.lora_B.default"):
                layer.register_forward_hook(_triples_in_training)
        return model

    kw = dict(target_epsilon=2.0, epochs=1, batch_size=64, precision="bf16", seed=0)
    m = model()
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    trainer = privgrad.make_private(m, torch.optim.AdamW(trainable, lr=1e-2), data, **kw)
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps > 0 and trainer.epsilon() <= 2.0 + 1e-6
    m = model(hooked=True)
    trainable = [p for p in m.parameters() if p.requires_grad]
    with pytest.raises(privgrad.PrivgradError, match=r"h\.0\.attn\.c_attn\.lora_B.*training mode"):
        privgrad.make_private(m, torch.optim.AdamW(trainable, lr=1e-2), data, **kw)


def test_prompt_tuning_is_refused_saying_why():
    """peft's prompt tuning looks its virtual tokens up with one row of ids, (1, n), and
    repeats the output for the batch; privgrad copies such a lookup's output to each example
    (as for Hugging Face's default position_ids), so the repeat gave batch × batch rows and
    make_private failed in torch's 'Sizes of tensors must match' from inside its check. It
    is refused in one line naming the layer."""
    prompt = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)
    base = tiny_gpt2(transformers.GPT2ForSequenceClassification, pad_token_id=0)
    model = peft.get_peft_model(base, prompt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = token_ids(20)
    with pytest.raises(privgrad.PrivgradError, match=r"'prompt_encoder\S*embedding'.*prompt tun"):
        privgrad.make_private(
            model, torch.optim.SGD(trainable, lr=0.1), ({"input_ids": ids}, torch.arange(20) % 2),
            noise_multiplier=1.0, batch_size=5,
        )  # fmt: skip


def test_adapters_read_back_by_from_pretrained_in_a_new_process_are_not_fresh(
    tmp_path, monkeypatch
):
    """LoRA adapters trained privately, saved (trainer.save_model: peft's save_pretrained
    folder with privacy.json inside) and read back by PeftModel.from_pretrained in a new
    process carry no mark privgrad can see: a run on them counted ε from zero (4 more steps at
    σ = 1 printed ε = 4.21, where the 8 steps give 5.46). A trained lora_B (non-zero, peft's
    default starts it at zero) is refused at the first step until prior= says how the earlier
    run counts; prior= the folder's privacy.json gives the ε of the 8 steps, also where the
    base they are read onto is not the one saved with them (refused before: "fingerprints
    differ"), as the record's trained_sha256 holds the adapters'."""
    import weakref

    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    from privgrad import model_file, private

    def gpt2(seed=0):
        return tiny_gpt2(seed=seed, **NO_DROPOUT)

    ids = token_ids(40)

    def run(model, seed, state=None, steps=None, **kw):
        trainable = [p for p in model.parameters() if p.requires_grad]
        trainer = privgrad.make_private(
            model, torch.optim.Adam(trainable, lr=1e-2), ({"input_ids": ids}, ids),
            noise_multiplier=1.0, batch_size=10, loss_fn=lm_loss, seed=seed, **kw,
        )  # fmt: skip
        if state is not None:
            trainer.load_state_dict(state)
        for batch in trainer.batches(steps):
            trainer.step(batch)
        return trainer

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    first = run(peft.get_peft_model(gpt2(), lora), seed=1)  # fresh adapters: not refused
    first.save_model(tmp_path / "adapters.pt")
    state = torch.load(_saved(first.state_dict(), tmp_path / "state.pt"))  # as a new process
    monkeypatch.setattr(model_file, "_SAVED", {})  # another process: nothing saved,
    monkeypatch.setattr(private, "_TRAINED_MODELS", weakref.WeakSet())  # nothing trained,
    monkeypatch.setattr(private, "_TRAINED_VALUES", [])  # no trained value seen
    folder = tmp_path / "adapters.hf"
    # onto another copy of the base (another revision or dtype): the adapters are the record's
    again = peft.PeftModel.from_pretrained(gpt2(seed=5), folder, is_trainable=True)
    with pytest.raises(privgrad.PrivgradError, match=r"lora_B\.default' is not zero.*prior="):
        run(again, seed=2)
    second = run(again, seed=2, prior=folder / "privacy.json")
    event = dp_event.PoissonSampledDpEvent(10 / 40, dp_event.GaussianDpEvent(1.0))
    steps = first.steps + second.steps
    pld = PLDAccountant(value_discretization_interval=1e-4).compose(event, steps)
    assert steps == 8 and math.isclose(second.epsilon(), pld.get_epsilon(1e-5), rel_tol=1e-6)
    # new data sharing no example with the first run's: ε counts this run's steps alone, and its
    # record keeps the first run's events for a later run on data overlapping them (with
    # prior='disjoint' alone, privgrad finding no record for adapters, they were lost)
    apart = peft.PeftModel.from_pretrained(gpt2(), folder, is_trainable=True)
    apart = run(apart, seed=3, steps=0, prior=("disjoint", folder / "privacy.json"))
    kept = apart.privacy_record()
    assert kept["disjoint_prior_events"] == first.privacy_record()["privacy_events"]
    assert apart.epsilon() == 0 and kept["prior"]["how"].startswith("not composed")
    # resuming the first run from its state (the adapters it loads are trained) is not refused
    resumed = run(peft.PeftModel.from_pretrained(gpt2(), folder, is_trainable=True), 1, state)
    assert resumed.steps == 8 and math.isclose(resumed.epsilon(), second.epsilon(), rel_tol=1e-9)


def _saved(state, path):
    torch.save(state, path)
    return path


def test_fresh_adapters_of_any_initialisation_are_not_taken_for_trained_ones():
    """The trained-adapter check looks at the weights peft starts at zero: lora_B, but an
    embedding's lora_embedding_A (its B starts random: taken for trained, every fresh
    embedding adapter would have been refused); AdaLoRA's B and LoRA's other initialisations
    start random and are not looked at."""
    from privgrad.private import _trained_adapter

    def fresh(adapters):
        return peft.get_peft_model(tiny_gpt2(), adapters)

    targets = dict(target_modules=["wte", "c_attn"], fan_in_fan_out=True)
    lora = fresh(peft.LoraConfig(r=4, **targets))
    assert _trained_adapter(lora) is None
    with torch.no_grad():
        lora.base_model.model.transformer.wte.lora_embedding_A["default"].add_(1.0)
    assert _trained_adapter(lora).endswith("wte.lora_embedding_A.default")
    for config in (
        peft.LoraConfig(r=4, init_lora_weights=False, **targets),
        peft.AdaLoraConfig(r=4, total_step=10, target_modules=["c_attn"], fan_in_fan_out=True),
    ):
        assert _trained_adapter(fresh(config)) is None
