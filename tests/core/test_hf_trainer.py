"""privgrad.hf_trainer.DPTrainer: Hugging Face's Trainer on the own loop takes
make_private's steps (same parameters, identical ε) and evaluates as the Trainer does; what
would change the sampling or pass the budget is refused when it is built."""

import json

import pytest
import torch

import privgrad
from privgrad.errors import PrivgradError

transformers = pytest.importorskip("transformers")
from privgrad.hf_trainer import DPTrainer  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB, LENGTH, N, EPOCHS, BATCH = 40, 8, 120, 2, 30


def examples(n=N, seed=0):
    """Hugging Face style examples: input_ids, attention_mask (padding at the end), labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) < torch.randint(3, LENGTH + 1, (n, 1), generator=g)).long()
    labels = (ids * mask == 1).any(1).long()
    return [
        {"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": labels[i]}
        for i in range(n)
    ]


def bert():
    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


PRIVACY = dict(target_epsilon=3.0, epochs=EPOCHS, batch_size=BATCH, seed=3)


def attached(**kw):
    model = bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return privgrad.attach(model, optimizer, examples(), **{**PRIVACY, **kw})


def arguments(tmp_path, **kw):
    return transformers.TrainingArguments(**{
        "output_dir": str(tmp_path), "num_train_epochs": EPOCHS, "report_to": [],
        "use_cpu": True, "save_strategy": "no", "lr_scheduler_type": "constant",
        "logging_steps": 1, **kw,
    })  # fmt: skip


def test_the_trainer_takes_make_privates_steps(tmp_path):
    """The Trainer's loop (its default clipping of the batch's gradient on, a no-op before
    privgrad writes .grad) on examples as dicts with labels; then its evaluation."""
    ref = bert()
    trainer = privgrad.make_private(
        ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), examples(), **PRIVACY
    )
    for _ in range(EPOCHS):
        for batch in trainer.batches():
            trainer.step(batch)
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path), optimizers=(optimizer, None), loader=loader,
        eval_dataset=examples(20, seed=1),
    )  # fmt: skip
    hf.train()
    assert optimizer.steps == trainer.steps == EPOCHS * len(loader)
    assert optimizer.epsilon() == trainer.epsilon()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    logged = [r["loss"] for r in hf.state.log_history if "loss" in r]
    assert len(logged) == optimizer.steps
    assert not any("grad_norm" in r for r in hf.state.log_history)  # it read 0: no .grad yet
    assert 0 < hf.evaluate()["eval_loss"] < 10
    hf.save_model(str(tmp_path / "final"))  # the weights, and the privacy record beside them
    saved = json.loads((tmp_path / "final" / "privacy.json").read_text())
    assert (saved["epsilon"], saved["steps"]) == (optimizer.epsilon(), optimizer.steps)
    assert "nonfinite_examples" in saved["not_covered_by_epsilon"]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_evaluation_predicts_every_example_of_each_batch(tmp_path):
    """compute_metrics gets one prediction per example: the Trainer read a bare logits tensor
    from compute_loss as a (loss, logits) tuple and dropped each batch's first row (297
    predictions for 300 labels)."""
    model, optimizer, loader = attached()
    seen = {}

    def metrics(p):
        seen["shapes"] = (p.predictions.shape, p.label_ids.shape)
        return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}

    evaluation = examples(25, seed=1)
    hf = DPTrainer(
        model=model, args=arguments(tmp_path, per_device_eval_batch_size=10),
        optimizers=(optimizer, None), loader=loader, eval_dataset=evaluation,
        compute_metrics=metrics,
    )  # fmt: skip
    accuracy = hf.evaluate()["eval_accuracy"]
    assert seen["shapes"] == ((25, 2), (25,))
    model.eval()
    with torch.no_grad():
        ids = torch.stack([e["input_ids"] for e in evaluation])
        mask = torch.stack([e["attention_mask"] for e in evaluation])
        logits = model(input_ids=ids, attention_mask=mask).logits
    labels = torch.stack([e["labels"] for e in evaluation])
    assert accuracy == pytest.approx((logits.argmax(-1) == labels).float().mean().item())


def test_fp16_takes_make_privates_fp16_steps_without_the_grad_scaler(tmp_path, monkeypatch):
    """fp16=True: accelerate's GradScaler (made on a GPU; here on the CPU too, as its fp16
    autocast) failed in torch's check at the first step; DPTrainer disables it, and the
    steps are make_private(precision='fp16')'s."""
    init = transformers.Trainer.create_accelerator_and_postprocess

    def gpu_like(self):
        init(self)
        if self.args.fp16:
            self.accelerator.scaler = torch.amp.GradScaler("cpu")
            self.accelerator.native_amp = True

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", gpu_like)
    ref = bert()
    trainer = privgrad.make_private(
        ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), examples(), precision="fp16", **PRIVACY
    )
    for _ in range(EPOCHS):
        for batch in trainer.batches():
            trainer.step(batch)
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path, fp16=True), optimizers=(optimizer, None),
        loader=loader,
    )  # fmt: skip
    assert not hf.accelerator.scaler.is_enabled()
    hf.train()
    assert optimizer.steps == trainer.steps and optimizer.epsilon() == trainer.epsilon()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_what_would_change_the_sampling_the_budget_or_the_loss_is_refused(tmp_path):
    model, optimizer, loader = attached()
    cases = [
        (dict(gradient_accumulation_steps=2), {}, "gradient_accumulation_steps must be 1"),
        (dict(), dict(optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None)),
         "pass optimizers=\\(optimizer, None\\)"),
        (dict(num_train_epochs=EPOCHS + 1), {}, "past the 8 that σ was calibrated for"),
        # the Trainer's loss is replaced by attach's per-example one: it was silently ignored
        (dict(label_smoothing_factor=0.3), {}, "label_smoothing=0.3, reduction='none'"),
        # NEFTune's embedding noise, scaled by the batch's padded length: one example's length
        # moved the mean of 15 others' clipped sum by 1.61 C (tiny BERT, embeddings of std 0.5,
        # α = 5, 3 tokens each and one of 60; 0.43 C between two draws at one length)
        (dict(neftune_noise_alpha=5.0), {}, "neftune_noise_alpha=...\\) adds noise"),
        # the batch's clipping, read as DP's: a no-op before privgrad writes .grad
        (dict(max_grad_norm=0.5), {}, "clips each example's at attach's max_grad_norm"),
        # the Trainer's batch size, silently ignored for attach's
        (dict(per_device_train_batch_size=BATCH + 1), {}, "per_device_train_batch_size=.* ignored"),
    ]  # fmt: skip
    for args, kw, message in cases:
        kw = {"optimizers": (optimizer, None), **kw}
        with pytest.raises(PrivgradError, match=message):
            DPTrainer(model=model, args=arguments(tmp_path, **args), loader=loader, **kw)
    # attach's batch size, said again, is no conflict
    args = arguments(tmp_path, per_device_train_batch_size=BATCH)
    DPTrainer(model=model, args=args, optimizers=(optimizer, None), loader=loader)
    # micro-batches would be counted as the Trainer's steps
    model, optimizer, loader = attached(max_physical_batch_size=4)
    with pytest.raises(PrivgradError, match="micro-batches, which the Trainer would count"):
        DPTrainer(
            model=model, args=arguments(tmp_path), optimizers=(optimizer, None), loader=loader
        )


def never_stopped(tmp_path):
    """(model, optimizer, trainer) of the run resumed runs are compared with, trained whole."""
    model, optimizer, loader = attached()
    trainer = DPTrainer(
        model=model,
        args=arguments(tmp_path / "reference"),
        optimizers=(optimizer, None),
        loader=loader,
    )
    trainer.train()
    return model, optimizer, trainer


def test_a_checkpoint_within_an_epoch_resumes_as_the_run_that_never_stopped(tmp_path):
    """The Trainer skips a mid-epoch checkpoint's batches through a DataLoader, which the
    Poisson loader is not: it failed with an AttributeError inside accelerate, then DPTrainer
    refused such checkpoints ("saved at step 3, within an epoch"). The loader hands out the
    epoch's remaining draws from the optimizer's state: the resumed run takes the plan's 8
    steps and ends with the parameters and the logged ε of the run that never stopped."""
    model, optimizer, loader = attached()
    args = arguments(tmp_path, save_strategy="steps", save_steps=3, max_steps=3)
    DPTrainer(model=model, args=args, optimizers=(optimizer, None), loader=loader).train()
    assert 3 % len(loader)  # the checkpoint lies within an epoch
    saved = json.loads((tmp_path / "checkpoint-3" / "privacy.json").read_text())
    assert (saved["steps"], saved["epsilon"]) == (3, optimizer.epsilon())
    model, optimizer, loader = attached()
    resumed = DPTrainer(
        model=model, args=arguments(tmp_path), optimizers=(optimizer, None), loader=loader
    )
    resumed.train(resume_from_checkpoint=True)
    assert not resumed.args.ignore_data_skip  # the user's arguments as they were
    reference, ref_optimizer, ref = never_stopped(tmp_path)
    assert optimizer.steps == ref_optimizer.steps == EPOCHS * len(loader)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    logged = [(e["step"], e["epsilon"]) for e in resumed.state.log_history if "epsilon" in e]
    assert logged == [(e["step"], e["epsilon"]) for e in ref.state.log_history if "epsilon" in e]


@pytest.mark.parametrize("save_only_model", [False, True])
def test_resuming_needs_the_checkpoints_optimizer_state(tmp_path, save_only_model):
    """A checkpoint at an epoch's end resumes with the ε of the uninterrupted run; one saved
    with save_only_model=True has the model's weights and step count but no optimizer state
    (the privacy ledger): the Trainer loaded the weights, left the fresh ledger, and the
    resumed run printed ε of its own 4 steps for a model that took 8 (2.28 for 3.0)."""
    model, optimizer, loader = attached()
    args = arguments(
        tmp_path, save_strategy="epoch", max_steps=len(loader), save_only_model=save_only_model
    )
    DPTrainer(model=model, args=args, optimizers=(optimizer, None), loader=loader).train()
    model, optimizer, loader = attached()  # a fresh process
    resumed = DPTrainer(
        model=model,
        args=arguments(tmp_path, save_only_model=save_only_model),
        optimizers=(optimizer, None),
        loader=loader,
    )
    if save_only_model:
        with pytest.raises(PrivgradError, match="optimizer's privacy ledger has 0"):
            resumed.train(resume_from_checkpoint=True)
        assert optimizer.steps == 0
        return
    resumed.train(resume_from_checkpoint=True)
    reference, ref_optimizer, ref = never_stopped(tmp_path)
    assert optimizer.steps == ref_optimizer.steps == EPOCHS * len(loader)
    assert optimizer.epsilon() == ref_optimizer.epsilon()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name  # the same batches and noise: nothing drawn twice
    # the logged ε (none was logged before) continues from the checkpoint's: that of the run
    # that never stopped at every step, the last one its optimizer's
    logged = [(e["step"], e["epsilon"]) for e in resumed.state.log_history if "epsilon" in e]
    reference = [(e["step"], e["epsilon"]) for e in ref.state.log_history if "epsilon" in e]
    assert logged == reference and logged[-1] == (ref_optimizer.steps, ref_optimizer.epsilon())
    assert [step for step, _ in logged[:5]] == [1, 2, 3, 4, 5]


def test_a_saved_model_reloaded_with_from_pretrained_counts_its_earlier_run(tmp_path):
    """Weights DPTrainer saved, reloaded with from_pretrained and attached again: refused until
    prior= says how the earlier run counts (its ε counted from zero before); prior=its
    privacy.json composes that run's events (ε before any new step is that run's)."""
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path), optimizers=(optimizer, None), loader=loader
    )
    hf.train()
    hf.save_model(str(tmp_path / "final"))
    again = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "final"))
    plan = dict(noise_multiplier=1.0, epochs=EPOCHS, batch_size=BATCH)
    with pytest.raises(PrivgradError, match="trained privately already"):
        privgrad.attach(again, torch.optim.AdamW(again.parameters(), lr=1e-2), examples(), **plan)
    record = str(tmp_path / "final" / "privacy.json")
    _, continued, _ = privgrad.attach(
        again, torch.optim.AdamW(again.parameters(), lr=1e-2), examples(), prior=record, **plan
    )
    assert continued.epsilon() == optimizer.epsilon() > 0


def test_a_written_buffer_is_not_saved_by_the_trainer(tmp_path):
    """DPTrainer.save_model wrote the Hugging Face folder and a privacy.json stating ε while
    a buffer make_private watched (written by no forward) had been written since, e.g. from
    training examples: trainer.save_model refused that, DPTrainer's did not. Now it does,
    before writing anything."""
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path), optimizers=(optimizer, None), loader=loader
    )
    hf.train()
    watched = [q for q, *_ in optimizer.trainer._watched]
    name = next(q for q in watched if q.endswith("token_type_ids"))
    model.get_buffer(name).fill_(1)  # a value the forward never writes
    with pytest.raises(PrivgradError, match="was written during training"):
        hf.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final" / "privacy.json").exists()


def test_save_model_states_the_privacy_record_in_the_model_card_keeping_the_users_text(
    tmp_path,
):
    """DPTrainer.save_model wrote privacy.json but no model card, where privgrad's own save of
    a Hugging Face folder writes one (README.md): writing it whole would have overwritten a
    card already there (the user's, or the one create_model_card writes for push_to_hub).
    The card's privacy section is now appended to a card there, or replaces the one an
    earlier save wrote, and create_model_card (which rewrites README.md) puts it back."""
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path / "out"), optimizers=(optimizer, None),
        loader=loader,
    )  # fmt: skip
    hf.train()
    eps = f"**(ε, δ) = ({optimizer.epsilon():.4g}, 1e-05)**"
    hf.save_model(str(tmp_path / "fresh"))  # no card there: privgrad's, tagged
    card = (tmp_path / "fresh" / "README.md").read_text()
    assert card.startswith("---\ntags:\n- differential-privacy\n- privgrad\n---\n") and eps in card
    from privgrad.model_file import CARD_BEGIN

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("---\nlicense: mit\n---\n# My model\n\nMy notes.\n")
    hf.save_model(str(mine))
    hf.save_model(str(mine))  # saved again: the section replaced, not added twice
    card = (mine / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n---\n# My model\n\nMy notes.\n\n")
    assert card.count(CARD_BEGIN) == 1 and card.count(eps) == 1
    assert "## Differential privacy (privgrad)" in card
    hf.save_model()  # into output_dir, then the Trainer's card there, as push_to_hub does
    hf.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "tiny" in card and "- differential-privacy" in card and "- privgrad" in card
    assert card.count(CARD_BEGIN) == 1 and eps in card
    # the Trainer's card lists its arguments (train_batch_size: 8): the steps were privgrad's
    note = f"Poisson batches of expected size {BATCH} (not train_batch_size)"
    assert "train_batch_size: 8" in card and note in card
    assert f"(Poisson batches of expected size {BATCH})" in card
    hf.save_model()  # saved there again: the section rewritten, the note kept
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.count(CARD_BEGIN) == 1 and note in card
    assert note not in (mine / "README.md").read_text()  # not under a card of one's own


def test_the_trainers_model_card_leaves_out_the_unnoised_training_loss(tmp_path):
    """create_model_card (which push_to_hub calls) wrote the Trainer's "Training results"
    table: at each evaluation, the training loss last logged, the un-noised mean loss of
    Poisson batches of training rows, beside the privacy section that stated ε for each
    training example and named only nonfinite_examples as not covered. Its column now says
    "No log", as the Trainer's card does where no loss was logged; the Trainer's own
    log_history (for its checkpoints) keeps the losses."""
    model, optimizer, loader = attached()
    hf = DPTrainer(
        model=model, args=arguments(tmp_path / "out", eval_strategy="epoch"),
        optimizers=(optimizer, None), loader=loader, eval_dataset=examples(40, seed=5),
    )  # fmt: skip
    hf.train()
    losses = [log["loss"] for log in hf.state.log_history if "loss" in log]
    assert len(losses) == 8
    hf.save_model()
    hf.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    rows = [line for line in card.splitlines() if line.startswith("| ") and "Epoch" not in line]
    assert len(rows) == EPOCHS and all(row.startswith("| No log") for row in rows), rows
    assert not any(f"{loss:.4f}" in card for loss in losses)
    assert [log["loss"] for log in hf.state.log_history if "loss" in log] == losses
