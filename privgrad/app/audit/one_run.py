"""One-run audit (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023), with white-box gradient (Dirac) canaries in one real training run.

The canaries enter the chain as materialised per-sample gradients, so the audit runs only
on chains of the shared stages (clip, sum, Gaussian noise, scale, sign: DP-SGD, DP-Adam,
DP-SignSGD/SignAdam, the non-private control); for layer-aware chains (Spectral-DP,
GReDP) use the canary audit's input canaries or the MIA, whose bound is the same theorem
on real examples (``allow_layer_aware=True`` overrides, at the caller's word).

m canaries; canary i is put into the training set independently with probability ½
(S_i). A canary is a training example whose per-sample gradient is C·e_{j_i} (times
``canary_scale``), a Dirac vector on its own parameter coordinate j_i (distinct for all
canaries, so the canaries are orthogonal): it is Poisson-sampled like every other
example, clipped, summed and noised by the mechanism's own chain inside
``make_private``'s training step. The auditor sees every privatised update (the
white-box / federated threat model) and scores canary i by Σ_t update_t[j_i]
(``observe='final'``: by θ_0[j_i] − θ_T[j_i], the final model only). It guesses "in" for
the r/2 highest scores and "out" for the r/2 lowest, abstaining on the rest, and counts
the v correct guesses. Their Theorem 3 (approximate DP, δ > 0) bounds P[V ≥ v] for any
(ε, δ)-DP training run; :func:`privgrad.app.audit.stats.one_run_epsilon` inverts it into a
(1 − α)-confidence lower bound on ε. The number of guesses r is chosen from a fixed grid
with a Bonferroni correction (α divided by the grid size), so the choice is accounted.

Neighbouring relation: adding/removing one canary, the relation privgrad's accountant
uses. The sampling rate q is fixed (the expected batch size scales with the number of
included canaries), so every S gives the same accounted ε.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from privgrad.errors import PrivgradError
from privgrad.mechanisms import Mechanism
from privgrad.optim import build_optimizer
from privgrad.per_sample import MaterializedGrads, PerSampleGrads
from privgrad.app.audit.canary import generic_chain
from privgrad.app.audit.common import (
    audit_model,
    load_audit_data,
    make_mechanism,
    private_trainer,
    trained_audit_record,
)
from privgrad.app.audit.stats import one_run_bound_from_scores


class CanaryGradSampler:
    """Wraps a trainer's GradSampler: rows whose label is −(i+1) are canary i, whose
    per-sample gradient is the fixed vector ``value``·e_{coord_i}; the other rows get
    their real per-sample gradients. Everything after (clip, sum, noise, …) is the
    mechanism's own chain. Its steps run eagerly (``flags.cuda_graphs`` off): the canaries'
    rows are appended after the real ones, which a captured step's padding does not know."""

    def __init__(self, inner, coords: torch.Tensor, value: float):
        self.inner, self.coords, self.value = inner, coords, value
        self.flags = dataclasses.replace(inner.flags, cuda_graphs=False)
        self.layers, self.units = inner.layers, inner.units
        self.params = [p for layer in inner.empty().layers for p in layer.params]
        self.sizes = [p.numel() for p in self.params]

    def compute(self, x, y, loss_fn):
        is_canary = y < 0
        real, losses = self.inner.compute(x[~is_canary], y[~is_canary], loss_fn)
        ids = (-y[is_canary] - 1).long()
        k = len(ids)
        flat = torch.zeros(k, sum(self.sizes))
        flat[torch.arange(k), self.coords[ids]] = self.value
        canary = iter(flat.split(self.sizes, dim=1))
        layers = []
        for layer in real.layers:
            grads = [
                torch.cat([g.detach(), next(canary).reshape(k, *p.shape)])
                for g, p in zip(layer.per_sample(), layer.params)
            ]
            layers.append(MaterializedGrads(layer.params, grads))
        return PerSampleGrads(layers, real.batch_size + k), losses

    def empty(self):
        return self.inner.empty()


def train_with_canaries(
    mechanism: Mechanism,
    x,
    y,
    model,
    included: np.ndarray,
    coords: torch.Tensor,
    canary_value: float,
    *,
    noise_multiplier,
    target_epsilon,
    target,
    delta,
    epochs,
    sampling_rate,
    lr,
    momentum,
    optimizer,
    seed,
):
    """Trains ``model`` privately on (x, y) plus the included canaries; returns the trainer,
    the per-canary white-box scores and the parameters before and after."""
    idx = np.flatnonzero(included)
    xc = torch.zeros(len(idx), *x.shape[1:], dtype=x.dtype)
    yc = -torch.as_tensor(idx, dtype=torch.long) - 1
    x_all, y_all = torch.cat([x, xc]), torch.cat([y, yc])
    opt = build_optimizer(optimizer or mechanism.optimizer, model.parameters(), lr, momentum)
    private = private_trainer(
        model,
        opt,
        (x_all, y_all),
        mechanism,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        target=target,
        delta=delta,
        epochs=epochs,
        batch_size=sampling_rate * len(x_all),
        seed=seed,
    )
    sampler = CanaryGradSampler(private.grad_sampler, coords, canary_value)
    private.grad_sampler = sampler
    scores = torch.zeros(len(coords), dtype=torch.float64)

    def observe(update, records, facts):  # the white-box auditor's view of each release
        scores.add_(torch.cat([g.detach().flatten() for g in update])[coords].double())

    theta0 = torch.cat([p.detach().flatten() for p in sampler.params]).clone()
    remove = private.add_step_observer(observe)
    try:
        total = max(1, round(epochs * private.sampler.steps_per_epoch))
        for batch in private.batches(total):
            private.step(batch)
    finally:
        remove()
    theta1 = torch.cat([p.detach().flatten() for p in sampler.params])
    return private, scores, theta0, theta1


def one_run_audit(
    mechanism: str | Mechanism = "dpsgd",
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target: str = "honest",
    delta: float = 1e-5,
    canaries: int = 1000,
    dataset: str = "synthetic",
    n_train: int = 500,
    data_dir=None,
    model: str = "small",
    input_shape=(1, 16, 16),
    num_classes: int = 10,
    epochs: float = 2.0,
    batch_size: float = 100,
    lr: float = 0.1,
    momentum: float = 0.0,
    optimizer: str | None = None,
    max_grad_norm: float = 1.0,
    canary_scale: float | None = None,
    observe: str = "white-box",
    alpha: float = 0.05,
    guess_counts: list[int] | None = None,
    seed: int = 0,
    mechanism_options: dict | None = None,
    allow_layer_aware: bool = False,
) -> dict:
    """Trains one model with ``canaries`` Dirac gradient canaries and returns the audit
    record. ``batch_size`` is the expected batch size over the ``n_train`` real examples;
    its rate q = batch_size/n_train is kept when the canaries join. A canary's gradient has
    norm ``canary_scale``·C (default: C for a chain that clips, so it is never clipped
    away; 100·C for a chain that does not clip, the non-private control, where the real
    gradients are unbounded)."""
    started = time.time()
    if observe not in ("white-box", "final"):
        raise PrivgradError(f"observe must be 'white-box' or 'final', got '{observe}'")
    if canaries < 2:
        raise PrivgradError("the one-run audit needs at least 2 canaries")
    if target_epsilon is None and noise_multiplier is None:
        target_epsilon = 1.0
    torch.manual_seed(seed)
    x, y, num_classes, num_tokens = load_audit_data(
        dataset, n_train, data_dir, seed, input_shape, num_classes
    )
    net = audit_model(model, tuple(x.shape[1:]), num_classes, num_tokens)
    n_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if canaries > n_params:
        raise PrivgradError(
            f"{canaries} Dirac canaries need {canaries} distinct coordinates; "
            f"the model has {n_params} parameters"
        )
    if not 0 < batch_size <= n_train:
        raise PrivgradError(f"the batch size must lie in (0, {n_train}], got {batch_size}")
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    coords = torch.as_tensor(rng.choice(n_params, canaries, replace=False), dtype=torch.long)
    mech = make_mechanism(mechanism, max_grad_norm, **(mechanism_options or {}))
    if not (generic_chain(mech) or allow_layer_aware):
        raise PrivgradError(
            "the one-run audit hands the chain materialised per-sample gradients (the real ones "
            f"plus the Dirac canaries); '{mech.name}' has stages that may treat layer types "
            "differently (e.g. spectral transforms), so this would not be its real code path. Use "
            "--method canary (input canaries) or --method mia (its bound is the one-run theorem "
            "on real examples)"
        )
    clips = mech.clip_norm is not None
    C = mech.clip_norm if clips else max_grad_norm
    if canary_scale is None:  # norm C (clipped chains); a chain that never clips gets 100·C
        canary_scale = 1.0 if clips else 100.0
    q = batch_size / n_train
    private, white_box, theta0, theta1 = train_with_canaries(
        mech,
        x,
        y,
        net,
        included,
        coords,
        canary_scale * C,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        target=target,
        delta=delta,
        epochs=epochs,
        sampling_rate=q,
        lr=lr,
        momentum=momentum,
        optimizer=optimizer,
        seed=seed,
    )
    scores = white_box if observe == "white-box" else (theta0 - theta1)[coords].double()
    if not torch.isfinite(scores).all():
        raise PrivgradError("training diverged (non-finite canary scores); lower the learning rate")
    result = one_run_bound_from_scores(scores.numpy(), included, delta, alpha, guess_counts)
    return {
        **trained_audit_record(
            "one-run", private, target, result["epsilon_lower_bound"], alpha, canaries, delta
        ),
        "epochs": epochs,
        "dataset": dataset,
        "n_train": n_train,
        "model": model,
        "n_params": n_params,
        "canaries": canaries,
        "canaries_included": int(included.sum()),
        "canary_norm": canary_scale * C,
        "observe": observe,
        "guesses": result["guesses"],
        "correct": result["correct"],
        "bonferroni_over": result["bonferroni_over"],
        "lr": lr,
        "clip": C,
        "seed": seed,
        "wall_time_s": round(time.time() - started, 2),
    }


__all__ = ["one_run_audit", "CanaryGradSampler", "train_with_canaries"]
