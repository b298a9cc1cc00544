"""The training-step engine and the ``make_private`` entry point.

``make_private`` wires a model, an optimizer and a training set to a mechanism: it
Poisson-samples batches, computes per-sample gradients, runs the mechanism's chain,
hands the private update to the optimizer, and records one privacy event per step.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from torch import nn

from .accounting import (PrivacyLedger, calibrate_noise_multiplier, validate_delta,
                         validate_epsilon)
from .accounting.pure_dp import calibrate_with_pure_dp, composed_epsilon
from .batches import Batch, training_source
from .device import resolve_device
from .distributed import Distributed
from .errors import PrivgradError
from .mechanisms import Mechanism, NoiseRecord, build_mechanism
from .per_sample import GradSampler
from .sampling import PoissonSampler
from .signals import deferred_interrupts

NEIGHBOURING = "add/remove one example (Poisson sampling)"


def per_sample_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


class PrivateTrainer:
    """Runs private steps on the batches its own Poisson sampler draws, and keeps the
    honest and the paper-claimed privacy ledgers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data, mechanism: Mechanism,
                 expected_batch_size: float, delta: float, seed: int = 0,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 device: str | torch.device | None = None, distributed: Distributed | None = None):
        validate_delta(delta)
        self.model, self.optimizer, self.mechanism, self.delta = model, optimizer, mechanism, delta
        self.data = training_source(data)
        if device is None:
            self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        else:
            self.device = resolve_device(device)
            model.to(self.device)
        self.loss_fn = loss_fn or per_sample_cross_entropy
        self.grad_sampler = GradSampler(model, settle=not mechanism.reads_layer_inputs)
        self.distributed = distributed  # data-parallel: this rank's shard, sums all-reduced
        self.sampler = (distributed.sampler if distributed else PoissonSampler)(
            len(self.data), expected_batch_size, torch.Generator().manual_seed(seed))
        self.noise_generator = torch.Generator(self.device).manual_seed(seed + 1_000_003)
        self.ledger, self.claimed_ledger = PrivacyLedger(), PrivacyLedger()
        self.last_extra: dict = {}
        self._issuer = object()           # stamped on this trainer's batches
        self._pending: dict[int, dict] = {}  # drawn, not yet stepped: seq -> sampler state before the draw

    @property
    def n_layers(self) -> int:
        return len(self.grad_sampler.layers)

    @property
    def sampling_rate(self) -> float:
        return self.sampler.sampling_rate

    @property
    def steps(self) -> int:
        return self.ledger.steps

    def batches(self, steps: int | None = None) -> Iterator[Batch]:
        """Poisson batches, by default one epoch's worth (round(1/q) steps), loaded lazily
        and moved to the trainer's device; :meth:`step` takes each one once."""
        issuer, order = self._issuer, collections.deque()

        def index_lists():
            for _ in range(self.sampler.steps_per_epoch if steps is None else steps):
                seq = self.sampler.draws
                self._pending[seq] = self.sampler.state_dict()
                order.append(seq)
                yield self.sampler.sample()

        for x, y in self.data.load(index_lists(), seed=self.sampler.draws):
            yield Batch(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True),
                        order.popleft(), issuer)

    def step(self, batch: Batch) -> float:
        """One private step on a batch drawn by :meth:`batches`; returns its mean loss
        (display only). A batch from anywhere else, or one used before, is refused: the
        ledger records a Poisson-sampled step, which only this trainer's sampler makes true.
        Ctrl-C and SIGTERM wait for the step to finish."""
        if not isinstance(batch, Batch):
            raise PrivgradError(f"step() takes a batch drawn by this trainer's batches(), not a "
                                f"{type(batch).__name__}: a hand-made batch is not Poisson-sampled")
        if batch.issuer is not self._issuer:
            raise PrivgradError("this batch was drawn by another trainer (or before load_state_dict)")
        if batch.seq not in self._pending:
            raise PrivgradError(f"batch {batch.seq} was already used (or a later batch was): "
                                "each drawn batch is used at most once, in order")
        with deferred_interrupts():
            for seq in [s for s in self._pending if s <= batch.seq]:
                del self._pending[seq]
            return self._step(batch.x, batch.y)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.train()
        per_sample, losses = self.grad_sampler.compute(x, y, self.loss_fn)
        grads, records, extra = self.mechanism.privatize(
            per_sample, self.sampler.expected_batch_size, self.noise_generator,
            self.distributed.all_reduce_sum if self.distributed else None)
        for p, g in zip(per_sample.params, grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_extra = extra
        self._account(records, extra)
        if self.distributed:
            self.distributed.after_step(self.model, self.steps)
        return float(losses.mean()) if len(losses) else math.nan

    def state_dict(self) -> dict:
        """All a run needs to continue bit-identically: model, optimizer, sampler and noise
        RNGs, both ledgers, the mechanism's step state. Batches drawn but not yet stepped
        on are drawn again after loading. Tensors are shared with the live objects (as in
        torch): save or deep-copy the result."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "sampler": next(iter(self._pending.values()), None) or self.sampler.state_dict(),
                "noise_generator": self.noise_generator.get_state(),
                "ledger": self.ledger.state_dict(), "claimed_ledger": self.claimed_ledger.state_dict(),
                "steps": self.steps, "mechanism": self.mechanism.state_dict(), "delta": self.delta}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`; every part is checked against this trainer before
        anything changes, so a state of another run is refused, never half-loaded."""
        missing = {"model", "optimizer", "sampler", "noise_generator", "ledger", "claimed_ledger",
                   "steps", "mechanism", "delta"} - set(state)
        if missing:
            raise PrivgradError(f"the trainer state lacks {', '.join(sorted(missing))}")
        if state["delta"] != self.delta:
            raise PrivgradError(f"the trainer state is for δ = {state['delta']}, this trainer has {self.delta}")
        self.mechanism.check_state_dict(state["mechanism"])
        self.sampler.check_state_dict(state["sampler"])
        _check_model_state(self.model, state["model"])
        _check_optimizer_state(self.optimizer, state["optimizer"])
        own = self.noise_generator.get_state()
        if not (isinstance(state["noise_generator"], torch.Tensor) and state["noise_generator"].shape == own.shape):
            raise PrivgradError(f"the saved noise RNG state is not one of a {self.device.type} generator "
                                "(saved on another device?)")
        ledger, claimed = PrivacyLedger(), PrivacyLedger()
        ledger.load_state_dict(state["ledger"])
        claimed.load_state_dict(state["claimed_ledger"])
        if not ledger.steps == claimed.steps == state["steps"]:
            raise PrivgradError(f"the trainer state's ledgers ({ledger.steps} and {claimed.steps} steps) "
                                f"disagree with its step count {state['steps']}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.noise_generator.set_state(state["noise_generator"])
        self.ledger, self.claimed_ledger = ledger, claimed
        self.mechanism.load_state_dict(state["mechanism"])
        self._issuer, self._pending = object(), {}

    def _account(self, records: list[NoiseRecord], extra: dict) -> None:
        honest = [self.sampler.event(r.effective) for r in records] + extra.get("honest_events", [])
        claimed = [self.sampler.event(r.claimed) for r in records] + extra.get("claimed_events", [])
        if not records and not extra.get("honest_events"):
            honest = claimed = [dp_event.NonPrivateDpEvent()]
        self.ledger.record(honest[0] if len(honest) == 1 else dp_event.ComposedDpEvent(honest))
        self.claimed_ledger.record(claimed[0] if len(claimed) == 1 else dp_event.ComposedDpEvent(claimed))

    def epsilon(self, accountant: str = "pld") -> float:
        """Honest ε: the accountant on the effective noise multiplier of every step run
        (pure-DP steps, e.g. GIP's index selection: the smaller of basic and tight composition)."""
        return composed_epsilon(self.ledger.entries, self.delta, accountant, "best")

    def epsilon_claimed(self, accountant: str = "pld") -> float:
        """What the paper's own analysis would print (its nominal σ; pure-DP steps added by
        basic composition); not a guarantee."""
        return composed_epsilon(self.claimed_ledger.entries, self.delta, accountant, "basic")


def _check_model_state(model: nn.Module, saved: dict) -> None:
    own = model.state_dict()
    if set(own) != set(saved):
        diff = sorted(set(own) ^ set(saved))
        raise PrivgradError(f"the saved model does not match this model (differing entries: {', '.join(diff[:5])})")
    for name, t in own.items():
        if not isinstance(saved[name], torch.Tensor) or saved[name].shape != t.shape:
            raise PrivgradError(f"the saved model's '{name}' has another shape than this model's {tuple(t.shape)}")


def _check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if groups is None or [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise PrivgradError("the saved optimizer state does not match this optimizer's parameter groups")


def calibrate(mechanism: Mechanism, n_layers: int, target_epsilon: float, delta: float,
              sampling_rate: float, steps: int, target: str = "honest",
              expected_batch_size: float = 1.0) -> float:
    """Nominal σ that makes the honest (or, with ``target='claimed'``, the paper's) ε hit
    ``target_epsilon`` after ``steps`` steps."""
    validate_epsilon(target_epsilon)
    effective, claimed = mechanism.effective_factor(n_layers, expected_batch_size)
    factor = {"honest": effective, "claimed": claimed}.get(target)
    if factor is None:
        raise PrivgradError(f"--target must be 'honest' or 'claimed', got '{target}'")
    if factor <= 0:
        raise PrivgradError(f"mechanism '{mechanism.name}' gives no DP guarantee; "
                            "no noise level reaches a finite ε")
    # σ-independent pure-DP events the stages will report (e.g. GIP's index selection)
    pure = mechanism.pure_dp_events(steps)
    if pure:
        return calibrate_with_pure_dp(target_epsilon, delta, sampling_rate, steps, pure,
                                      "best" if target == "honest" else "basic") / factor
    return calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps) / factor


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                 mechanism: str | Mechanism = "dpsgd", target_epsilon: float | None = None,
                 noise_multiplier: float | None = None, delta: float = 1e-5, epochs: float = 1,
                 batch_size: float | None = None, max_grad_norm: float | None = None, target: str = "honest",
                 seed: int = 0, loss_fn=None, device: str | torch.device | None = None,
                 distributed: Distributed | None = None, **mechanism_options) -> PrivateTrainer:
    """Make ``model``'s training differentially private, in Opacus' spirit.

    ``dataset`` is a pair of tensors ``(x, y)``, a ``TensorDataset``, a map-style
    ``Dataset`` of (input, label) pairs (loaded lazily, batch by batch) or a ``DataLoader``
    (its dataset, collate_fn and workers are kept, its sampler is replaced; a custom
    sampler is refused). Batches are Poisson-sampled with expected size ``batch_size``
    (default: the DataLoader's batch size, else 256), so q = batch_size / len(dataset).
    ``mechanism`` is a name from
    ``privgrad.mechanisms.MECHANISMS`` (clipping norm ``max_grad_norm``, default 1.0) or a
    built :class:`Mechanism`, which carries its own clipping norm (passing
    ``max_grad_norm`` too is an error, so that no clip norm is silently ignored).
    Give either ``target_epsilon``
    (σ is calibrated for ``epochs`` epochs) or ``noise_multiplier``. ``device`` ('cpu',
    'cuda', 'auto' or a torch.device) moves the model there; batches and noise follow
    (default: where the model is). ``distributed`` (a
    :class:`privgrad.distributed.Distributed`) makes this process one rank of a
    data-parallel run: it samples only its shard and its clipped sums are all-reduced.

    Example::

        private = privgrad.make_private(model, optimizer, loader, target_epsilon=1.0,
                                        epochs=10, max_grad_norm=1.0, device="auto")
        for epoch in range(10):
            for batch in private.batches():
                private.step(batch)
        print(private.epsilon())
    """
    if (target_epsilon is None) == (noise_multiplier is None):
        raise PrivgradError("give exactly one of target_epsilon and noise_multiplier")
    source = training_source(dataset)  # checks a DataLoader's sampling first
    loader_batch = dataset.batch_size if isinstance(dataset, torch.utils.data.DataLoader) else None
    if batch_size is not None and loader_batch is not None and batch_size != loader_batch:
        raise PrivgradError(f"batch_size={batch_size} and the DataLoader's batch_size={loader_batch} "
                            "disagree; give one (it is the expected Poisson batch size)")
    if batch_size is None and isinstance(dataset, torch.utils.data.DataLoader) and loader_batch is None:
        raise PrivgradError("the DataLoader has no batch_size (it has a batch_sampler); give batch_size= "
                            "(the expected Poisson batch size)")
    batch_size = batch_size or loader_batch or 256
    if isinstance(mechanism, Mechanism):
        if mechanism_options or max_grad_norm is not None:
            raise PrivgradError("a built mechanism carries its own options and clipping norm; "
                                "pass them to build_mechanism")
        mech = mechanism
        if noise_multiplier is not None:
            mech.noise_multiplier = noise_multiplier
    else:
        mech = build_mechanism(mechanism, noise_multiplier or 0.0,
                               1.0 if max_grad_norm is None else max_grad_norm, **mechanism_options)
    trainer = PrivateTrainer(model, optimizer, source, mech, batch_size, delta, seed, loss_fn, device,
                             distributed)
    if target_epsilon is None and noise_multiplier < 0:
        raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
    steps = max(1, round(epochs * trainer.sampler.steps_per_epoch))
    mech.plan(trainer, steps, target_epsilon)  # stages that need the run's length (GIP's k(t), ε₂)
    if target_epsilon is not None:
        mech.noise_multiplier = calibrate(mech, trainer.n_layers, target_epsilon, delta,
                                          trainer.sampling_rate, steps, target,
                                          trainer.sampler.expected_batch_size)
    from .per_sample.independence import check_trainer  # refuses a model or loss that mixes examples
    check_trainer(trainer)
    return trainer
