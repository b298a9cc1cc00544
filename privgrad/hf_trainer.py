"""Hugging Face's ``Trainer`` on privgrad's own loop (:func:`privgrad.attach`).

:class:`DPTrainer` is ``transformers.Trainer`` whose training batches are privgrad's Poisson
batches and whose loss is ``loss_fn``'s, averaged over the batch; the optimizer is the one
``attach`` returned, passed as ``optimizers=(optimizer, None)`` (the Trainer builds its
learning-rate schedule on it). Everything else is the Trainer's: its loop, schedule,
logging, evaluation and saving (with the privacy record so far beside the weights, as
``privacy.json``, and stated in a section of the model card, ``README.md``). Its step is the
private step (``optimizer.step()``), so the parameters and ε are
:func:`privgrad.make_private`'s for one seed::

    model, optimizer, loader = privgrad.attach(model, optimizer, dataset, target_epsilon=3,
                                               epochs=2, batch_size=64)
    args = TrainingArguments("out", num_train_epochs=2, report_to=[])
    DPTrainer(model=model, args=args, optimizers=(optimizer, None), loader=loader).train()

``fp16=True`` trains under the Trainer's fp16 autocast without its ``GradScaler``, as
``make_private(precision='fp16')`` does (``bf16=True``: bf16's steps).

Refused at construction: an optimizer other than ``attach``'s, gradient accumulation
(one step per Poisson batch), a ``per_device_train_batch_size`` other than ``attach``'s
batch size (or its default), NEFTune (``neftune_noise_alpha``: its noise is scaled by the
batch's padded length), and ``max_steps`` or ``num_train_epochs`` past the epochs σ
was calibrated for (unless ``attach(allow_over_budget=True)``). Refused when resuming: a
checkpoint without the optimizer's state (``save_only_model=True``), whose privacy ledger the
resumed run would not have; one saved within an epoch resumes with the rest of that epoch.
Needs ``transformers`` and ``accelerate`` (``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import Trainer

from privgrad.errors import PrivgradError
from privgrad.inputs import call_model
from privgrad.model_file import (
    CARD_FILE,
    CARD_TAGS,
    PRIVACY_FILE,
    fingerprinted,
    read_privacy_record,
    remember_saved,
    write_model_card,
    write_privacy_record,
)
from privgrad.own_loop import DPOptimizer, PoissonLoader


class DPTrainer(Trainer):
    """``transformers.Trainer`` on the Poisson batches of ``loader`` (``attach``'s), stepping
    ``attach``'s optimizer; the clipping is privgrad's, per example (``TrainingArguments``'
    ``max_grad_norm``, the batch's, is refused unless 0 or its default: the Trainer applies it
    before privgrad writes ``.grad``, where it does nothing)."""

    def __init__(self, *args, loader: PoissonLoader, **kwargs):
        super().__init__(*args, **kwargs)
        optimizer = self.optimizer
        if not isinstance(optimizer, DPOptimizer) or optimizer is not loader.optimizer:
            raise PrivgradError(
                "DPTrainer steps the optimizer privgrad.attach returned with this loader: pass "
                "optimizers=(optimizer, None)"
            )
        if self.args.gradient_accumulation_steps != 1:
            raise PrivgradError(
                "DPTrainer takes one step per Poisson batch: gradient_accumulation_steps must "
                "be 1 (accumulating over batches would change the sampling ε assumes)"
            )
        if optimizer.trainer.max_physical_batch_size is not None:
            raise PrivgradError(
                "DPTrainer takes one Trainer step per Poisson batch, and attach("
                "max_physical_batch_size=...) hands a batch out in micro-batches, which the "
                "Trainer would count as steps: leave it out (for memory, lower batch_size or "
                "turn on gradient_checkpointing)"
            )
        clip = optimizer.trainer.mechanism.clip_norm
        if self.args.max_grad_norm not in (0, 1.0):
            raise PrivgradError(
                f"TrainingArguments(max_grad_norm={self.args.max_grad_norm:g}) clips the batch's "
                "gradient, which DPTrainer does not use: privgrad clips each example's at "
                f"attach's max_grad_norm (C = {clip:g}); pass it there and leave max_grad_norm "
                "at 0 or its default"
            )
        default = type(self.args).__dataclass_fields__["per_device_train_batch_size"].default
        batch = optimizer.trainer.sampler.expected_batch_size
        if self.args.per_device_train_batch_size not in (default, round(batch)):
            raise PrivgradError(
                f"TrainingArguments(per_device_train_batch_size="
                f"{self.args.per_device_train_batch_size}) would be ignored: DPTrainer's batches "
                f"are attach's Poisson batches, of expected size {batch:g} (σ and ε were "
                "calibrated for it); set batch_size in attach and leave "
                "per_device_train_batch_size at its default or equal to it"
            )
        if self.args.label_smoothing_factor:
            raise PrivgradError(
                "DPTrainer computes the loss with attach's loss_fn, per example, so the "
                "Trainer's label_smoothing_factor would be ignored: set it to 0 and pass "
                "attach(loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits, y, "
                f"label_smoothing={self.args.label_smoothing_factor:g}, reduction='none'))"
            )
        if self.args.neftune_noise_alpha is not None:
            raise PrivgradError(
                "TrainingArguments(neftune_noise_alpha=...) adds noise to the embeddings scaled "
                "by 1/√(the batch's padded length): one example's length changes the noise on "
                "every other example, and so their gradients, which DP-SGD's ε does not cover; "
                "leave it unset"
            )
        trainer = optimizer.trainer
        steps = self.args.max_steps
        if steps is None or steps <= 0:
            steps = math.ceil(self.args.num_train_epochs * len(loader))
        if not trainer.allow_over_budget and trainer.target_epsilon is not None:
            if trainer.steps + steps > trainer.planned_steps:
                raise PrivgradError(
                    f"the Trainer would take {steps} steps after {trainer.steps}, past the "
                    f"{trainer.planned_steps} that σ was calibrated for: set num_train_epochs "
                    "(or max_steps) to attach's epochs, or pass attach(allow_over_budget=True)"
                )
        if self.accelerator.scaler is not None:  # fp16=True: the autocast stays, the scaling goes
            # privgrad's backward is unscaled; a scale following overflows in un-noised
            # gradients is refused by the step (a disabled scaler: accelerate assumes one)
            self.accelerator.scaler = torch.amp.GradScaler(self.args.device.type, enabled=False)
        self.privgrad_loader, self.privgrad_optimizer = loader, optimizer

    def train(self, resume_from_checkpoint=None, **kwargs):
        """``Trainer.train``. A checkpoint saved within an epoch resumes with the rest of that
        epoch: the Trainer would skip the epoch's first batches through its DataLoader (which
        Poisson batches are not: accelerate failed, and DPTrainer refused such checkpoints),
        while the loader, given the optimizer's state, hands out the epoch's remaining draws
        itself; so the Trainer's skipping is turned off (``ignore_data_skip``) for the call."""
        if not resume_from_checkpoint:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        skip = self.args.ignore_data_skip
        self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self.args.ignore_data_skip = skip

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``Trainer``'s, then a check that the optimizer's privacy ledger is the checkpoint's: the
        Trainer loads the model's weights and its step count from a checkpoint, but leaves the
        optimizer (privgrad's ledger, sampler and noise RNGs) as it is where the checkpoint lacks
        its state (``save_only_model=True``), and the resumed run's ε counted only the steps
        after it."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        where = Path(checkpoint)
        record = where / PRIVACY_FILE
        if record.is_file():
            saved = json.loads(record.read_text())["steps"]
        else:
            from transformers.trainer_callback import TrainerState

            saved = TrainerState.load_from_json(str(where / "trainer_state.json")).global_step
        steps = self.privgrad_optimizer.steps
        if steps != saved:
            raise PrivgradError(
                f"checkpoint {checkpoint} holds a model after {saved} private steps, but the "
                f"optimizer's privacy ledger has {steps}: its state (optimizer.pt, with the ledger "
                "and the sampler's and noise RNGs) was not saved with it (save_only_model=True?) "
                "or not loaded, and the resumed run's ε would leave out the steps before it; "
                "resume from a checkpoint saved with save_only_model=False"
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``, with the honest ε of the private steps taken so far (``epsilon``,
        the optimizer's) in each training log (those with ``loss``, and the last one, with
        ``train_loss``): the Trainer printed and kept only the loss, so its console, its
        ``log_history`` and the TensorBoard or W&B it reports to had no ε to follow, before or
        after a resume (where it continues from the checkpoint's ledger)."""
        if "loss" in logs or "train_loss" in logs:
            logs = {**logs, "epsilon": self.privgrad_optimizer.epsilon()}
        super().log(logs, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (checkpoints too), with the run's privacy record so far beside
        the weights as ``privacy.json`` (:func:`privgrad.model_file.write_privacy_record`) and
        stated in the model card, ``README.md`` (:func:`privgrad.model_file.write_model_card`:
        a card already there, the user's or ``create_model_card``'s, keeps its text, and the
        privacy section is appended or replaces the one an earlier save wrote). Refused, before
        anything is written, where a buffer make_private's check saw no forward write was
        written since (as ``trainer.save_model``): the folder would release it."""
        self.privgrad_optimizer.trainer._check_buffers()
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            where = Path(output_dir if output_dir is not None else self.args.output_dir)
            # the weights' fingerprints, as the model file's: a model reloaded from them
            # (from_pretrained) and attached again is refused until prior= says how they count
            record = fingerprinted(
                self.privgrad_optimizer.privacy_record(), self.model.state_dict()
            )
            write_privacy_record(where / PRIVACY_FILE, record)
            write_model_card(where, record, _trainer_card_note(where, record))
            remember_saved(record["weights_sha256"], where / PRIVACY_FILE, record)

    def create_model_card(self, *args, **kwargs) -> None:
        """``Trainer.create_model_card`` (``push_to_hub`` calls it after ``save_model``), which
        writes ``README.md`` anew: its card, tagged ``differential-privacy`` and ``privgrad``
        too, with the privacy section of the record saved in ``output_dir`` (the run's so far
        where none was saved) appended, with a note that the steps were privgrad's (Poisson
        batches, ``attach``'s optimizer), whatever the card's hyperparameters say. Its table of
        training results says "No log" for the training loss: the logged losses are the Poisson
        batches' own, un-noised, which ε does not cover (at each evaluation the card listed the
        last one)."""
        if len(args) < 3:  # (language, license, tags, ...): tags not given by position
            tags = kwargs.get("tags")
            tags = [tags] if isinstance(tags, str) else list(tags or [])
            kwargs["tags"] = tags + [tag for tag in CARD_TAGS if tag not in tags]
        # the card's "Training results" table takes its "Training Loss" column from the logged
        # losses of the Poisson batches, un-noised: a published card would release them
        history = self.state.log_history
        self.state.log_history = [{k: v for k, v in log.items() if k != "loss"} for log in history]
        try:
            super().create_model_card(*args, **kwargs)
        finally:
            self.state.log_history = history
        if not self.is_world_process_zero():
            return
        where = Path(self.args.output_dir)
        saved = where / PRIVACY_FILE
        record = (
            read_privacy_record(saved)
            if saved.exists()
            else self.privgrad_optimizer.privacy_record()
        )
        write_model_card(where, record, _trainer_card_note(where, record))

    def _get_grad_norm(self, model, grad_norm=None):
        """None: the Trainer asks before the step, when privgrad has written no ``.grad`` yet
        (its logged ``grad_norm`` read 0)."""
        return None

    def get_train_dataloader(self):
        return self.privgrad_loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``loss_fn`` on the model's logits and the labels, averaged over the batch: a
        Poisson batch ``(x, y)``, or the Trainer's own batch (evaluation), a dict whose
        ``labels`` are taken out."""
        if isinstance(inputs, Mapping):
            x = dict(inputs)
            y = x.pop("labels")
        else:
            x, y = inputs
        logits = call_model(model, x)
        loss = self.privgrad_optimizer.trainer.loss_fn(logits, y).mean()
        # the Trainer's prediction_step reads a dict's values as the predictions and a bare
        # tensor as a (loss, logits, ...) tuple, whose [1:] dropped each batch's first row
        return (loss, {"logits": logits}) if return_outputs else loss


def _trainer_card_note(folder: Path, record: dict) -> str | None:
    """Where the card in ``folder`` is the Trainer's (``create_model_card``'s, which lists its
    arguments' ``train_batch_size`` and ``learning_rate``): a note that the steps were
    privgrad's, on its Poisson batches, by ``attach``'s optimizer."""
    try:
        card = (folder / CARD_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "train_batch_size:" not in card:
        return None
    batch = record.get("batch_size")
    return (
        "The training hyperparameters above are the Trainer's arguments: the steps were "
        "privgrad's, on Poisson batches"
        + (f" of expected size {batch:g}" if isinstance(batch, (int, float)) else "")
        + " (not train_batch_size), by the optimizer given to `privgrad.attach` (its learning "
        "rate, under the Trainer's schedule)."
    )
