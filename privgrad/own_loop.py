"""Your own training loop: :func:`attach` returns the model, a DP optimizer and a Poisson loader.

::

    model, optimizer, loader = privgrad.attach(model, optimizer, train_data,
                                               target_epsilon=1.0, epochs=3)
    for epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)      # reduction "mean" or "sum"
            loss.backward()
            optimizer.step()
    print(optimizer.epsilon())

It is :func:`privgrad.make_private`'s trainer underneath: the loader hands out the
trainer's Poisson draws, and ``optimizer.step()`` runs the trainer's step (the same
mechanism chain, non-finite handling, budget check and ledger) on per-sample gradients
taken from *your* forward and loss: while the batch the loader last handed out goes
through the model, the per-sample engine's hooks record each layer's input and tap its
output. Your ``loss.backward()`` stops at the model's output (which hands its gradient to
privgrad); ``step()`` checks that gradient (below) and runs the model's backward from
``loss_fn``'s per-sample gradient there, exactly the trainer's backward: it reaches the
taps only, and no batch gradient is formed (so ``p.grad`` is written by ``step()``, and a
step costs what the trainer's costs).

**Reductions.** Your loss is a reduction of per-sample losses; privgrad checks which one.
The gradient your backward sends to the model's output is compared, example by example,
with that of ``loss_fn`` (the per-sample loss, ``reduction='none'``; default cross-entropy,
as in ``make_private``) on the drawn labels: it must be that gradient (a sum) or that
gradient / B (a mean over the B drawn examples). Anything else (another loss, other
labels, a loss scaled or mixed across examples) is an error, as is a reduction other than
the one declared with ``loss_reduction=``. The model's backward then starts from
``loss_fn``'s per-sample gradient itself, so the per-sample gradients are the trainer's,
whatever the reduction.

**Misuse is an error** (:class:`~privgrad.errors.PrivgradError`), never a silent wrong ε:
``step()`` without a forward or without a backward on the handed-out batch, two backwards
(or two forwards) before a step, a backward from a forward on inputs that are not the batch
the loader last handed out (your own tensor, an earlier batch), a forward-and-backward on
a batch whose step was skipped before the next batch is taken, ``step()`` twice per batch,
labels changed in place. A model or loss that mixes examples is refused at ``attach`` (the
independence probe) and at each step (the output-gradient check); so is a loss that
reaches the model other than through its output (a term on an inner activation) and a
nonzero gradient the private update would not replace (a penalty on the weights, a
parameter outside the model), and a ``loss_fn`` that depends on a tensor requiring gradients
other than the model's output (a learnable temperature: your backward would train it without
privacy). Forwards under ``torch.no_grad()`` (evaluation) are not
recorded and are always allowed. The model must receive every tensor of the handed-out
``x`` (a tensor, or a tuple/dict of tensors: ``model(*x)``, ``model(**x)``), each itself or a
view that keeps its rows (``x.flatten(1)``); transform examples in the Dataset. Its output
must be a tensor (the input of your loss).
``step(closure)`` (Lightning's automatic optimization) runs the closure first.

**Micro-batches.** With ``max_physical_batch_size=N`` the loader hands out each Poisson
batch in micro-batches of at most N examples (consecutive rows; a batch of at most N is
handed out whole), and your loop stays as it is: each micro-batch's ``step()`` turns its
forward and backward into per-sample gradients and adds its clipped sum, and the last one
of the batch adds the noise once and steps your optimizer (:attr:`DPOptimizer.stepped`
says which), as ``make_private(max_physical_batch_size=N)``'s trainer does: the same
update and ε. The reduction is over the micro-batch (its mean or sum).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from privgrad.batches import Batch
from privgrad.distributed import Distributed
from privgrad.per_sample import EngineFlags
from privgrad.errors import PrivgradError
from privgrad.inputs import device_of, find_logits, leaves, rows, take, tensors_in
from privgrad.mechanisms.base import ChunkedChain
from privgrad.per_sample.engine import _Tap
from privgrad.per_sample.tables import Cut
from privgrad.private import PrivateTrainer, _check_drawn, make_private
from privgrad.signals import deferred_interrupts

REDUCTIONS = ("mean", "sum")


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    mechanism="dpsgd",
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float = 1,
    batch_size: float | None = None,
    max_grad_norm: float | None = None,
    delta: float = 1e-5,
    seed: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    loss_reduction: str | None = None,
    device: str | torch.device | None = None,
    target: str = "honest",
    strict: bool = False,
    allow_over_budget: bool = False,
    distributed: Distributed | None = None,
    flags: EngineFlags | None = None,
    max_physical_batch_size: int | None = None,
    precision: str = "fp32",
    prior: str | os.PathLike | tuple | None = None,
    **mechanism_options,
) -> tuple[nn.Module, "DPOptimizer", "PoissonLoader"]:
    """Makes your own training loop differentially private; returns ``(model, optimizer,
    loader)``. Every argument but ``loss_reduction`` means what it means for
    :func:`privgrad.make_private` (which this calls). ``loss_fn`` is the per-sample loss
    your criterion reduces (``reduction='none'``; default cross-entropy);
    ``loss_reduction`` declares the reduction ('mean' or 'sum'; None: either, found from
    the gradient at each step). ``loader`` yields one epoch of Poisson batches ``(x, y)``
    per ``iter()``; ``optimizer`` wraps yours: ``step()`` takes the private step,
    ``epsilon()`` and ``privacy_record()`` report the privacy spent.

    ``max_physical_batch_size=N``: the loader hands out each Poisson batch in micro-batches
    of at most N examples, one forward, backward and ``step()`` each; the batch's last
    ``step()`` takes the private step (the module docstring). Mixed precision: run your
    forward under ``torch.autocast`` (bf16 or fp16) yourself; the step computes ``loss_fn``
    on the output in fp32, as the trainer's autocast does, and checks your backward's output
    gradient against it to the output dtype's rounding. ``precision='bf16'`` (or 'fp16')
    declares that autocast: ``attach``'s checks run under it where the model cannot run
    without it (parameters of mixed dtypes: a bfloat16 base feeding a float32 head)."""
    if loss_reduction is not None and loss_reduction not in REDUCTIONS:
        raise PrivgradError(
            f"loss_reduction must be 'mean', 'sum' or None (found at each step), "
            f"got {loss_reduction!r}"
        )
    trainer = make_private(
        model,
        optimizer,
        data,
        mechanism=mechanism,
        target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
        delta=delta,
        epochs=epochs,
        batch_size=batch_size,
        max_grad_norm=max_grad_norm,
        target=target,
        seed=seed,
        loss_fn=loss_fn,
        device=device,
        strict=strict,
        allow_over_budget=allow_over_budget,
        distributed=distributed,
        flags=flags,
        max_physical_batch_size=max_physical_batch_size,
        precision=precision,
        prior=prior,
        **mechanism_options,
    )
    dp_optimizer = DPOptimizer(trainer, loss_reduction)
    return trainer.model, dp_optimizer, PoissonLoader(dp_optimizer)


@dataclass(frozen=True)
class Part:
    """What the loader hands out: a drawn batch, or with ``max_physical_batch_size`` one of
    its micro-batches (``index`` of ``count``)."""

    batch: Batch
    x: object
    y: torch.Tensor
    index: int = 0
    count: int = 1

    def __str__(self) -> str:
        seq = self.batch.seq
        return (
            f"batch {seq}"
            if self.count == 1
            else f"micro-batch {self.index + 1}/{self.count} of batch {seq}"
        )


def parts(batch: Batch, size: int | None) -> list[Part]:
    """``batch`` whole, or in consecutive micro-batches of at most ``size`` examples."""
    n = rows(batch.x)
    if size is None or n <= size:
        return [Part(batch, batch.x, batch.y)]
    starts = range(0, n, size)
    return [
        Part(batch, take(batch.x, slice(a, a + size)), batch.y[a : a + size], i, len(starts))
        for i, a in enumerate(starts)
    ]


class PoissonLoader:
    """The trainer's Poisson batches as ``(x, y)`` pairs, one epoch per ``iter()``
    (round(1/q) batches; their sizes vary, an empty batch included); with
    ``max_physical_batch_size`` each batch in micro-batches of at most that many examples
    (``len()`` still counts batches). An epoch ends where the steps taken reach a multiple
    of ``len()``: after a state saved within an epoch is loaded, ``iter()`` hands out that
    epoch's remaining batches, so a loop resumed there ends at the planned step (a whole
    epoch went past it, refused by the budget check)."""

    def __init__(self, optimizer: "DPOptimizer"):
        self.optimizer = optimizer

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        trainer = self.optimizer.trainer
        per_epoch = trainer.sampler.steps_per_epoch
        for batch in trainer.batches(per_epoch - trainer.steps % per_epoch):
            for part in parts(batch, trainer.max_physical_batch_size):
                self.optimizer._hand_out(part)
                yield part.x, part.y

    def __len__(self) -> int:
        return self.optimizer.trainer.sampler.steps_per_epoch


class DPOptimizer(torch.optim.Optimizer):
    """Your optimizer, stepped privately: ``step()`` turns what your forward and backward on
    the batch last handed out by the loader recorded into per-sample gradients and runs
    the trainer's step with them (the wrapped optimizer is stepped inside). Its
    ``param_groups`` are your optimizer's, so learning-rate schedulers work on it.
    :attr:`stepped`: whether the last ``step()`` took the private step (False after a
    micro-batch that is not its batch's last).

    A ``torch.amp.GradScaler`` is refused at ``scaler.step(optimizer)`` (declaring
    ``_step_supports_amp_scaling`` routes that call here, where torch's own check failed
    first with "No inf checks were recorded"): the step's backward is privgrad's, unscaled,
    and an example whose gradient overflows is dropped; the scaler's skipped steps and its
    scale, saved with checkpoints, would follow overflows in un-noised gradients."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler.step calls step() directly

    def __init__(self, trainer: PrivateTrainer, loss_reduction: str | None = None):
        # torch.optim.Optimizer.__init__ is not called: the state is the wrapped optimizer's
        self.trainer, self.original_optimizer, self.loss_reduction = (
            trainer,
            trainer.optimizer,
            loss_reduction,
        )
        self.sampler = trainer.grad_sampler
        self.last_loss = float("nan")
        self.last_batch_size = 0  # the drawn batch's examples, at its private step
        self._anchor = torch.zeros(
            (), device=trainer.device, requires_grad=True
        )  # for taps of foreign forwards
        self._collecting = False
        self._part: Part | None = None  # what the loader last handed out
        self._chunks: _Chunks | None = None  # the micro-batches of a batch stepped on so far
        self.stepped = False
        self._reset()
        self._handles = [
            # before the engine's hooks on the model (registered first): a model's own
            # parameters are followed as tables only while recording, which this one starts
            trainer.model.register_forward_pre_hook(
                self._before_forward, with_kwargs=True, prepend=True
            ),
            trainer.model.register_forward_hook(self._after_forward),
        ]

    def __getstate__(self) -> dict:
        """All of it (torch's Optimizer keeps only its defaults, state and groups, which are
        the wrapped optimizer's here): the model's hooks hold this optimizer, so a copy of
        the model (``copy.deepcopy``, an EMA or evaluation copy) copies it."""
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # --- torch.optim.Optimizer's face ---------------------------------------------------------

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.original_optimizer.param_groups = groups

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    def state_dict(self) -> dict:
        """The trainer's whole state (:meth:`PrivateTrainer.state_dict`: model, your
        optimizer, sampler and noise RNGs, both privacy ledgers, the mechanism's state), so
        that a checkpoint of the optimizer resumes with the ε already spent, never from zero.
        Tensors are shared with the live objects: save or deep-copy it."""
        return self.trainer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores :meth:`state_dict` (checked as :meth:`PrivateTrainer.load_state_dict`
        checks it); a plain torch optimizer state, which has no ledger, is refused."""
        if not isinstance(state_dict, dict) or "ledger" not in state_dict:
            raise PrivgradError(
                "this optimizer state has no privacy ledger (a plain torch optimizer's?): resuming "
                "from it would count ε from zero; save and load DPOptimizer.state_dict()"
            )
        self.trainer.load_state_dict(state_dict)
        self.sampler.disarm()
        self._part = self._chunks = None
        self._reset()

    def add_param_group(self, param_group) -> None:
        raise PrivgradError(
            "parameters cannot be added to a private optimizer: attach() fixed which "
            "parameters get per-sample gradients"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.trainer.mechanism.name}, {self.original_optimizer!r})"

    # --- privacy --------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def epsilon(self, accountant: str = "pld") -> float:
        """Honest ε of the steps taken (:meth:`PrivateTrainer.epsilon`)."""
        return self.trainer.epsilon(accountant)

    def epsilon_claimed(self, accountant: str = "pld") -> float:
        return self.trainer.epsilon_claimed(accountant)

    def privacy_record(self) -> dict:
        return self.trainer.privacy_record()

    def save_model(self, path, **extra) -> tuple:
        """The model's weights at ``path`` and its privacy record beside them
        (:meth:`PrivateTrainer.save_model`)."""
        return self.trainer.save_model(path, **extra)

    def detach(self) -> None:
        """Removes privgrad's hooks from the model (the optimizer is unusable after)."""
        for handle in self._handles:
            handle.remove()
        self.sampler.disarm()
        self._part = self._chunks = None

    # --- recording ------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._forwarded = False  # the handed-out batch went through the model (grad enabled)
        self._out = None  # its output, detached
        self._pre_out = None  # its output with the model's graph (backward run at the step)
        self._out_grad = None  # the gradient the user's backward sent to that output
        self._backwards = 0
        self._foreign = False  # a backward reached the output of a forward on other inputs
        self._missing: list[str] = []  # the batch's inputs a forward on part of them lacked
        self._recording_here = False

    def _hand_out(self, part: Part) -> None:
        if self._part is not None and (self._forwarded or self._backwards):
            raise PrivgradError(
                f"{self._part} went through the model but optimizer.step() was not "
                "called before the next batch was taken: step once per batch, right after "
                "its loss.backward() (accumulating gradients over batches is not supported; "
                "for a batch too large for memory, attach(max_physical_batch_size=N) hands it "
                "out in micro-batches, each stepped on)"
            )
        chunks = self._chunks
        expected = (part.batch.seq, 0) if chunks is None else (chunks.seq, chunks.next)
        if (part.batch.seq, part.index) != expected:
            done = 0 if chunks is None else chunks.next
            raise PrivgradError(
                f"batch {expected[0]} was stepped on in part ({done} of its micro-batches) "
                f"before {part} was taken: step on every micro-batch the loader hands out, in "
                "order (after an error in a step, resume from a saved optimizer.state_dict())"
            )
        if part.batch.seq not in self.trainer._pending:
            raise PrivgradError(
                f"batch {part.batch.seq} was drawn before a later batch was stepped on (two "
                "iterators over the loader at once?): each drawn batch is used at most once, in "
                "order"
            )
        self._reset()
        self._part = part
        self.sampler.arm(rows(part.x), device_of(part.x))

    def _before_forward(self, module, args, kwargs) -> None:
        self._recording_here = self.sampler._recording = False  # (a forward that raised left it on)
        if self._collecting or not torch.is_grad_enabled():
            return
        part = self._part
        if part is None:
            return
        missing = _missing_inputs((args, kwargs), part.x)
        if missing:
            if len(missing) < len(leaves(part.x)):  # part of the batch: named at step()
                self._missing = missing
            return  # its output is tapped: a backward through it is refused at step()
        if self._forwarded:
            raise PrivgradError(
                f"a second forward on {part} before optimizer.step(): run the "
                "model once per batch (forward, loss.backward(), optimizer.step())"
            )
        self._forwarded = self._recording_here = True
        # an empty batch (a valid Poisson draw) has no calls to record: its step is noise alone
        self.sampler._recording = rows(part.x) > 0

    def _after_forward(self, module, inputs, output):
        if self._collecting or not torch.is_grad_enabled():
            return None
        recording, self._recording_here = self._recording_here, False
        self.sampler._recording = False
        container, output = output, find_logits(output)
        if output is None:
            if recording:
                raise PrivgradError(
                    f"the model returns {type(container).__name__}; the own-loop optimizer needs "
                    "a tensor of logits, a dict with 'logits' or an object with .logits"
                )
            return None
        if recording and container is not output:
            loss = container.get("loss") if isinstance(container, dict) else None
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                raise PrivgradError(
                    "the model computed its own loss (labels passed to it?): in the own loop, "
                    "compute the loss from its logits with your criterion"
                )
        if not output.requires_grad:
            return None
        if recording:  # the user's backward stops at the output: the step runs the model's backward
            self._out, self._pre_out = output.detach(), output
            # the model's output as the user's loss sees it: the step runs the model's backward
            # from the checked per-sample gradient
            cut = Cut.apply(self._out, self._anchor, self._receive_output_grad)
            return _with_logits(container, cut)
        return _with_logits(container, _Tap.apply(output, self._anchor, self._receive_foreign))

    def _receive_output_grad(self, g: torch.Tensor) -> None:
        self._backwards += 1
        if self._out_grad is None:
            self._out_grad = g

    def _receive_foreign(self, g: torch.Tensor) -> None:
        self._foreign = True

    # --- the step -------------------------------------------------------------------------------

    def step(self, closure=None):
        """The private step on the batch last handed out, after its forward and
        ``loss.backward()``; once per batch (per micro-batch: the batch's last takes the
        step, :attr:`stepped`). A ``closure`` (as Lightning passes) runs them first; its loss
        is returned."""
        if "found_inf" in self.__dict__:  # set by GradScaler.step (and kept if step raises)
            del self.__dict__["found_inf"], self.__dict__["grad_scale"]
            raise PrivgradError(
                "torch.amp.GradScaler is not supported (its skipped steps and scale would follow "
                "overflows in un-noised gradients): drop it, keep your autocast and call "
                "loss.backward() and optimizer.step(); privgrad's backward is unscaled and an "
                "example whose fp16 gradient overflows is dropped and counted"
            )
        loss = None
        self.stepped = False
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.autocast(self.trainer.device.type, enabled=False):
            self._private_step()  # in float32, also inside a loop's autocast block
        return loss

    def _private_step(self) -> None:
        part = self._part
        if part is None:
            raise PrivgradError(
                "optimizer.step() without a batch: take a batch from privgrad's loader, run "
                "the model and loss.backward() on it, then step (once per batch)"
            )
        batch = part.batch
        if self._foreign:
            raise PrivgradError(
                "loss.backward() went through a forward on inputs that are not the batch "
                f"privgrad's loader last handed out ({part}"
                + (f"; that forward lacked {', '.join(self._missing[:3])}" if self._missing else "")
                + "): only that batch, as "
                "handed out, may be trained on (ε counts Poisson-sampled batches only); for a "
                "batch too large for memory, pass attach(max_physical_batch_size=...), whose "
                "loader hands it out in micro-batches, and pass the model all of the batch's inputs"
            )
        if not self._forwarded:
            raise PrivgradError(
                f"optimizer.step() without a forward on {part}, the one the loader "
                "last handed out: run the model on it and loss.backward(), then step (the model "
                "attach returned: model(x), not its submodules one by one)"
            )
        if self._out_grad is None:
            raise PrivgradError(
                f"optimizer.step() without loss.backward() on {part}: run the "
                "backward of the loss before the step"
            )
        if self._out is None or self._recording_here:  # the hooks ran in part
            raise PrivgradError(
                f"the model's forward on {part} was not recorded whole by privgrad's hooks (a "
                "torch.compile'd model: torch.compile after attach, TrainingArguments("
                "torch_compile=True)?): run the model attach returned, uncompiled"
            )
        if self._backwards > 1:
            raise PrivgradError(
                f"{self._backwards} backwards on {part} before optimizer.step(): "
                "call loss.backward() once per batch"
            )
        # its labels or inputs changed in place since the loader handed them out?
        _check_drawn(batch, self.trainer._pending[batch.seq])
        if self.sampler._error is not None:
            raise self.sampler._error
        self.trainer._check_no_skip(batch.seq)
        self.trainer._check_model()
        self.trainer._check_loss_state()
        self.trainer._check_budget()
        self._check_learning_rates(part)
        losses, output_grad = self._per_sample_losses()
        self._check_other_paths()
        self._model_backward(output_grad)
        with deferred_interrupts():
            self._part = None
            try:
                if part.count == 1:
                    del self.trainer._pending[batch.seq]
                    self.last_loss = self.trainer._run_step(
                        lambda keep: self._privatize(losses, keep)
                    )
                    self.last_batch_size, self.stepped = len(batch), True
                else:
                    self._step_chunk(part, losses)
            finally:
                self.sampler.disarm()
                self._reset()

    def _learning_rates(self) -> list[float]:
        return [float(group["lr"]) for group in self.param_groups]

    def _check_learning_rates(self, part: Part) -> None:
        """Refuses a learning rate changed between micro-batches of one batch: a scheduler
        stepped after every ``step()``, as in a loop without micro-batches, runs its schedule
        once per micro-batch (several times per private step) without a word, since only the
        batch's last ``step()`` updates the parameters."""
        chunks = self._chunks
        if part.index == 0 or chunks is None or chunks.lrs is None:
            return
        now = self._learning_rates()
        if now != chunks.lrs:
            changed = ", ".join(f"{a:g} → {b:g}" for a, b in zip(chunks.lrs, now) if a != b)
            raise PrivgradError(
                f"the learning rate changed between micro-batches of batch {part.batch.seq} "
                f"({changed}, before {part}): a scheduler stepped after every "
                "optimizer.step()? Only a batch's last micro-batch takes the private step, so "
                "step a per-step scheduler when optimizer.stepped is True (len(loader) steps "
                "per epoch), and set the learning rate between batches, not within one"
            )

    def _step_chunk(self, part: Part, losses: torch.Tensor) -> None:
        """A micro-batch's share of its batch's step: its clipped sum is added
        (:class:`~privgrad.mechanisms.base.ChunkedChain`; examples with non-finite gradients
        dropped as the trainer drops them); after the batch's last, the rest of the chain and
        the trainer's update."""
        trainer = self.trainer
        if part.index == 0:
            chain = ChunkedChain(
                trainer.mechanism, trainer.sampler.expected_batch_size, trainer.noise_generator
            )
            self._chunks = _Chunks(part.batch.seq, chain, lrs=self._learning_rates())
        chunks = self._chunks

        def add(keep: torch.Tensor | None) -> torch.Tensor:
            chunks.chain.add(lambda: self._collect(keep))
            return losses if keep is None else losses[keep]

        kept, dropped = trainer._drop_nonfinite(add)
        chunks.losses.append(kept)
        chunks.dropped += dropped
        if part.index + 1 < part.count:
            chunks.chain.release()  # held through the next micro-batch's forward otherwise
            return
        self._chunks = None
        del trainer._pending[part.batch.seq]
        params, grads, records, facts = chunks.chain.finish(trainer._reduce)
        trainer.nonfinite_examples += chunks.dropped
        self.last_loss = trainer._apply(params, torch.cat(chunks.losses), grads, records, facts)
        self.last_batch_size, self.stepped = len(part.batch), True

    def _check_other_paths(self) -> None:
        """Refuses a loss that reached the model's layers or any parameter other than through
        the model's output (the user's backward stops there): a term on an inner activation
        (its per-sample gradients would be wrong), a penalty on the weights or a parameter
        outside the model (the optimizer would apply a gradient without privacy)."""
        if self.sampler.shared.received() or any(
            g is not None for grads in self.sampler._grads.values() for g in grads
        ):
            raise PrivgradError(
                "loss.backward() reached the model's layers other than through its output (a loss "
                "term on an inner activation?): only loss_fn on the model's output is supported"
            )
        names = {id(p): name for name, p in self.trainer.model.named_parameters()}
        for i, p in enumerate(p for group in self.param_groups for p in group["params"]):
            if p.grad is not None and bool(p.grad.any()):
                raise PrivgradError(
                    f"parameter '{names.get(id(p), f'#{i}')}' has a gradient before "
                    "optimizer.step() (a loss term on the weights, a parameter outside the model, "
                    "or no optimizer.zero_grad() before the forward?): it would be applied "
                    "without privacy; put weight decay in the optimizer"
                )

    def _model_backward(self, output_grad: torch.Tensor) -> None:
        """The model's backward from its output, with ``loss_fn``'s per-sample gradient there
        (what the trainer's backward starts from): it reaches the per-sample taps only (no
        batch gradient is formed)."""
        out, self._pre_out = self._pre_out, None
        if out is None or out.shape[0] == 0:
            return
        try:
            torch.autograd.grad(
                out, self.sampler._anchor, grad_outputs=output_grad, allow_unused=True
            )
        except RuntimeError as e:
            raise PrivgradError(
                "the model's backward failed at optimizer.step() (did loss.backward() go through "
                f"the model's inner activations, or was its output modified in place?): {e}"
            ) from e

    def _privatize(self, losses: torch.Tensor, keep: torch.Tensor | None):
        per_sample = self._collect(keep)
        return self.trainer._privatize_grads(per_sample, losses if keep is None else losses[keep])

    def _collect(self, keep: torch.Tensor | None):
        """The recorded forward's per-sample gradients (of the examples ``keep``; None: all)."""
        self._collecting = True  # a rule that runs a layer again (vmap) is not a user's forward
        try:
            return self.sampler.collect(1.0, keep)
        finally:
            self._collecting = False

    def _per_sample_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``loss_fn``'s per-sample losses on the recorded output and the drawn labels, and
        the gradient of their sum with respect to the output, after checking that the one the
        user's backward sent there is it (a sum) or it / B (a mean); anything else is refused."""
        out, g, y = self._out, self._out_grad, self._part.y
        n = out.shape[0]
        low = out.dtype in (torch.bfloat16, torch.float16)  # a forward under autocast
        with torch.enable_grad():
            # in fp32, as autocast computes a loss (the trainer's step under precision)
            o = (out.float() if low else out).detach().requires_grad_()
            losses = self.trainer.loss_fn(o, y)
            if not isinstance(losses, torch.Tensor) or losses.shape != (n,):
                raise PrivgradError(
                    f"loss_fn must give one loss per example (shape ({n},)), got "
                    f"{tuple(getattr(losses, 'shape', ()))}; give it reduction='none'"
                )
            learned = _leaves_besides(losses, o)
            if learned:
                raise PrivgradError(
                    f"loss_fn depends on {len(learned)} tensor(s) that require gradients "
                    f"besides the model's output (shape {tuple(learned[0].shape)}: a learnable "
                    "temperature or head in the loss?): loss.backward() gives them the batch's "
                    "gradient without clipping or noise, which ε does not cover; make them part "
                    "of the model (its parameters are trained privately) or detach them"
                )
            ref = (
                torch.autograd.grad(losses.sum(), o, allow_unused=True)[0]
                if losses.requires_grad
                else None
            )
        exact = torch.zeros_like(o) if ref is None else ref
        ref = exact.to(out.dtype)
        if g is None:
            g = torch.zeros_like(out)
        if n == 0:
            return losses.detach(), ref
        # the user's gradient reached the output rounded to its dtype
        rtol = 2 * torch.finfo(out.dtype).eps if low else 1e-4
        names = REDUCTIONS if self.loss_reduction is None else (self.loss_reduction,)
        for name in names:
            scale = float(n) if name == "mean" else 1.0
            if _close(g.double() * scale, exact, rtol):
                return losses.detach(), ref
        declared = (
            f"reduction '{self.loss_reduction}'"
            if self.loss_reduction
            else "reduction 'mean' or 'sum'"
        )
        raise PrivgradError(
            "the gradient loss.backward() sent to the model's output is not that of loss_fn with "
            f"{declared} over the {n} drawn examples and labels: use loss_fn's loss on the "
            "model's output and the drawn labels, reduced by mean or sum, unscaled and not mixed "
            "across examples (or declare your "
            "per-sample loss as attach(loss_fn=..., loss_reduction=...))"
            + (
                f"; {self._part} is one of {self._part.count} micro-batches: reduce its loss "
                "over its own examples, not divided by the number of micro-batches as gradient "
                "accumulation does (privgrad adds their clipped sums)"
                if self._part.count > 1
                else ""
            )
        )


@dataclass
class _Chunks:
    """The micro-batches of batch ``seq`` stepped on so far (their losses, one tensor each)."""

    seq: int
    chain: ChunkedChain
    losses: list = field(default_factory=list)
    dropped: int = 0
    lrs: list | None = None  # the learning rates at its first micro-batch's step

    @property
    def next(self) -> int:
        """The index of the micro-batch to step on next."""
        return len(self.losses)


def _missing_inputs(call, drawn) -> list[str]:
    """The input tensors of the drawn batch (by path) that the model's call (its positional
    and keyword arguments) did not receive (each itself, a view with its rows or an equal
    tensor); empty: the call holds the batch."""
    given = tensors_in(call)
    return [path for path, w in leaves(drawn) if not any(_same(g, w) for g in given)]


def _leaves_besides(losses: torch.Tensor, output: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors requiring gradients (a parameter's AccumulateGrad) that ``losses``'
    graph reaches, other than ``output``."""
    found, seen, stack = [], set(), [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and leaf is not output:
            found.append(leaf)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _with_logits(container, logits: torch.Tensor):
    """``container`` (the model's output) with its logits replaced by ``logits``."""
    if isinstance(container, torch.Tensor):
        return logits
    if isinstance(container, dict):  # a Hugging Face ModelOutput keeps item and attribute in step
        container["logits"] = logits
    else:
        container.logits = logits
    return container


def _same(x, drawn: torch.Tensor) -> bool:
    """``x`` is the drawn batch: itself, a view of it with its rows (``x.flatten(1)``), or
    an equal tensor."""
    if x is drawn:
        return True
    if (
        not isinstance(x, torch.Tensor)
        or x.device != drawn.device
        or x.shape[:1] != drawn.shape[:1]
    ):
        return False
    if (
        drawn.numel()
        and x.untyped_storage().data_ptr() == drawn.untyped_storage().data_ptr()
        and x.numel() == drawn.numel()
        and x.storage_offset() == drawn.storage_offset()
        and drawn.is_contiguous()
        and x.stride(0) == drawn.stride(0)
    ):  # row i is drawn row i's memory
        return True
    return x.shape == drawn.shape and x.dtype == drawn.dtype and torch.equal(x, drawn)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    """Example by example, ``a`` is ``b`` up to float rounding (non-finite where ``b`` is)."""
    a, b = a.reshape(len(a), -1).double(), b.reshape(len(b), -1).double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return False
    a, b = torch.where(finite, a, 0.0), torch.where(finite, b, 0.0)
    ref = b.norm(dim=1)
    return bool(((a - b).norm(dim=1) <= rtol * ref + 1e-6 * rtol * ref.max()).all())
