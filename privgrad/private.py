"""The training-step engine and the ``make_private`` entry point.

``make_private`` wires a model, an optimizer and a training set to a mechanism: it
Poisson-samples batches, computes per-sample gradients, runs the mechanism's chain,
hands the private update to the optimizer, and records one privacy event per step.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from torch import nn

from .accounting import (PrivacyLedger, calibrate_noise_multiplier, validate_delta,
                         validate_epsilon)
from .accounting.pure_dp import calibrate_with_pure_dp, composed_epsilon
from .errors import PrivgradError
from .mechanisms import Mechanism, NoiseRecord, build_mechanism
from .per_sample import GradSampler
from .sampling import PoissonSampler

NEIGHBOURING = "add/remove one example (Poisson sampling)"


def per_sample_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


class PrivateTrainer:
    """Runs private steps and keeps the honest and the paper-claimed privacy ledgers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 train_x: torch.Tensor, train_y: torch.Tensor, mechanism: Mechanism,
                 expected_batch_size: float, delta: float, seed: int = 0,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        validate_delta(delta)
        if len(train_x) != len(train_y):
            raise PrivgradError("inputs and labels differ in length")
        self.model, self.optimizer, self.mechanism, self.delta = model, optimizer, mechanism, delta
        self.train_x, self.train_y = train_x, train_y
        self.loss_fn = loss_fn or per_sample_cross_entropy
        self.grad_sampler = GradSampler(model)
        self.sampler = PoissonSampler(len(train_x), expected_batch_size,
                                      torch.Generator().manual_seed(seed))
        self.noise_generator = torch.Generator().manual_seed(seed + 1_000_003)
        self.ledger, self.claimed_ledger = PrivacyLedger(), PrivacyLedger()
        self.last_extra: dict = {}

    @property
    def n_layers(self) -> int:
        return len(self.grad_sampler.layers)

    @property
    def sampling_rate(self) -> float:
        return self.sampler.sampling_rate

    @property
    def steps(self) -> int:
        return self.ledger.steps

    def batches(self, steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Poisson batches; by default one epoch's worth (round(1/q) steps)."""
        for _ in range(self.sampler.steps_per_epoch if steps is None else steps):
            idx = self.sampler.sample()
            yield self.train_x[idx], self.train_y[idx]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One private step on a Poisson batch; returns the batch's mean loss (display only)."""
        self.model.train()
        per_sample, losses = self.grad_sampler.compute(x, y, self.loss_fn)
        grads, records, extra = self.mechanism.privatize(
            per_sample, self.sampler.expected_batch_size, self.noise_generator)
        for p, g in zip(per_sample.params, grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_extra = extra
        self._account(records, extra)
        return float(losses.mean()) if len(losses) else math.nan

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
                 batch_size: float = 256, max_grad_norm: float | None = None, target: str = "honest",
                 seed: int = 0, loss_fn=None, **mechanism_options) -> PrivateTrainer:
    """Make ``model``'s training differentially private, in Opacus' spirit.

    ``dataset`` is a pair of tensors ``(x, y)`` (or a ``TensorDataset``); batches are
    Poisson-sampled with expected size ``batch_size``. ``mechanism`` is a name from
    ``privgrad.mechanisms.MECHANISMS`` (clipping norm ``max_grad_norm``, default 1.0) or a
    built :class:`Mechanism`, which carries its own clipping norm (passing
    ``max_grad_norm`` too is an error, so that no clip norm is silently ignored).
    Give either ``target_epsilon``
    (σ is calibrated for ``epochs`` epochs) or ``noise_multiplier``.

    Example::

        private = privgrad.make_private(model, optimizer, (x, y), target_epsilon=1.0,
                                        epochs=10, batch_size=256, max_grad_norm=1.0)
        for epoch in range(10):
            for xb, yb in private.batches():
                private.step(xb, yb)
        print(private.epsilon())
    """
    x, y = dataset.tensors if isinstance(dataset, torch.utils.data.TensorDataset) else dataset
    if (target_epsilon is None) == (noise_multiplier is None):
        raise PrivgradError("give exactly one of target_epsilon and noise_multiplier")
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
    trainer = PrivateTrainer(model, optimizer, x, y, mech, batch_size, delta, seed, loss_fn)
    if target_epsilon is None and noise_multiplier < 0:
        raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
    steps = max(1, round(epochs * trainer.sampler.steps_per_epoch))
    mech.plan(trainer, steps, target_epsilon)  # stages that need the run's length (GIP's k(t), ε₂)
    if target_epsilon is not None:
        mech.noise_multiplier = calibrate(mech, trainer.n_layers, target_epsilon, delta,
                                          trainer.sampling_rate, steps, target,
                                          trainer.sampler.expected_batch_size)
    return trainer
