"""Pieces shared by the audits: small models, synthetic data, mechanism set-up, ε."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from privgrad.accounting import PrivacyLedger, events, validate_delta
from privgrad.accounting.pure_dp import composed_epsilon
from privgrad.errors import PrivgradError
from privgrad.mechanisms import Mechanism, NoiseRecord, build_mechanism
from privgrad.mechanisms.stages import StepFacts
from privgrad.private import PrivateTrainer, calibrate, make_private


def small_model(
    input_shape: tuple[int, ...] = (1, 16, 16),
    num_classes: int = 10,
    channels: int = 4,
    kernel: int = 5,
    stride: int = 2,
    hidden: int = 16,
) -> nn.Module:
    """A small conv + linear model (an MLP for vector inputs): cheap enough for thousands
    of audited steps, and it has the layer types the spectral mechanisms transform."""
    if len(input_shape) == 3:
        c, h, w = input_shape
        k = min(kernel, h, w)
        oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
        return nn.Sequential(
            nn.Conv2d(c, channels, k, stride=stride),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(channels * oh * ow, num_classes),
        )
    if len(input_shape) == 1:
        return nn.Sequential(
            nn.Linear(input_shape[0], hidden), nn.Tanh(), nn.Linear(hidden, num_classes)
        )
    raise PrivgradError(
        f"the small audit model takes (C, H, W) or (d,) inputs, got shape {input_shape}"
    )


def full_conv_model(
    input_shape: tuple[int, ...] = (1, 16, 16), num_classes: int = 10, channels: int = 4
) -> nn.Module:
    """A conv layer whose kernel covers the whole input (one output position), then a linear
    layer. Its full correlation map *is* the kernel gradient, so a spectral transform
    (Spectral-DP, GReDP) loses nothing to the crop: the model on which a canary sees a
    spectral mechanism's noise at full strength."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, channels, (h, w)), nn.Tanh(), nn.Flatten(), nn.Linear(channels, num_classes)
    )


AUDIT_MODELS = ("small", "fullconv")


def audit_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, num_tokens: int | None = None
) -> nn.Module:
    """'small' (the default of the audits), 'fullconv', or any model of
    :mod:`privgrad.app.models`."""
    if name == "small":
        return small_model(input_shape, num_classes)
    if name == "fullconv":
        if len(input_shape) != 3:
            raise PrivgradError(f"model 'fullconv' takes (C, H, W) inputs, got shape {input_shape}")
        return full_conv_model(input_shape, num_classes)
    from privgrad.app.models import build_model

    return build_model(name, input_shape, num_classes, num_tokens=num_tokens)


def synthetic_dataset(
    n: int,
    input_shape: tuple[int, ...] = (1, 16, 16),
    num_classes: int = 10,
    labels: str = "teacher",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs; labels from a random linear teacher (learnable) or uniformly random
    (``labels='random'``: learnable only by memorising, the easiest case for MIA)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *input_shape, generator=g)
    if labels == "random":
        y = torch.randint(0, num_classes, (n,), generator=g)
    elif labels == "teacher":
        w = torch.randn(x[0].numel(), num_classes, generator=g)
        y = (x.flatten(1) @ w).argmax(1)
    else:
        raise PrivgradError(f"labels must be 'teacher' or 'random', got '{labels}'")
    return x, y


def load_audit_data(
    dataset: str,
    n: int,
    data_dir=None,
    seed: int = 0,
    input_shape=(1, 16, 16),
    num_classes: int = 10,
    labels: str = "teacher",
):
    """(x, y, num_classes, num_tokens): the first n training examples of a dataset, or
    ``dataset='synthetic'``."""
    if dataset == "synthetic":
        x, y = synthetic_dataset(n, input_shape, num_classes, labels, seed)
        return x, y, num_classes, None
    from privgrad.app.data import load_dataset

    data = load_dataset(dataset, data_dir, n)
    if len(data.train_y) < n:
        raise PrivgradError(
            f"{dataset} has only {len(data.train_y)} training examples; {n} are needed"
        )
    return data.train_x[:n], data.train_y[:n], data.num_classes, data.num_tokens


def make_mechanism(mechanism: str | Mechanism, max_grad_norm: float = 1.0, **options) -> Mechanism:
    if isinstance(mechanism, Mechanism):
        if options:
            raise PrivgradError("a built mechanism carries its own options")
        return mechanism
    return build_mechanism(mechanism, 0.0, max_grad_norm, **options)


def trained_audit_record(
    method: str, private, target: str, lower_bound: float, alpha: float, trials: int, delta: float
) -> dict:
    """The fields every audit of a trained model reports: honest and claimed ε from the
    run's ledgers beside the empirical lower bound."""
    mech = private.mechanism
    eps, eps_claimed = private.epsilon(), private.epsilon_claimed()
    return {
        "method": method,
        "mechanism": mech.name,
        "paper_mode": target == "claimed",
        "epsilon": eps,
        "epsilon_claimed": eps_claimed,
        "epsilon_lower_bound": lower_bound,
        "confidence": 1 - alpha,
        "trials": trials,
        "delta": delta,
        "violation": lower_bound > eps,
        "refutes_claimed": lower_bound > eps_claimed,
        "noise_multiplier": mech.noise_multiplier,
        "effective_noise_multiplier": mech.noise_record(
            private.n_layers, private.sampler.expected_batch_size
        ).effective,
        "sampling_rate": private.sampling_rate,
        "steps": private.steps,
    }


def has_noise(mech: Mechanism) -> bool:
    return bool(mech.noise_stages)


def set_noise(
    mech: Mechanism,
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    target: str,
    delta: float,
    n_layers: int,
    sampling_rate: float,
    steps: int,
    expected_batch_size: float,
) -> None:
    """Fix σ, or calibrate it so that the honest (or, ``target='claimed'``, the paper's) ε
    of ``steps`` steps at rate ``sampling_rate`` equals ``target_epsilon``."""
    validate_delta(delta)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise PrivgradError("give exactly one of the noise multiplier and the target ε")
    if not has_noise(mech):
        return  # non-private: nothing to set, ε = ∞
    if noise_multiplier is not None:
        if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
            raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
        mech.noise_multiplier = noise_multiplier
    else:
        mech.noise_multiplier = calibrate(
            mech, n_layers, target_epsilon, delta, sampling_rate, steps, target, expected_batch_size
        )


@contextmanager
def noise_off(mech: Mechanism):
    """Every noise stage's ``noise_multiplier`` set to 0 (restored afterwards): the same
    chain, same code, without its noise. Used only to find the canary's direction."""
    saved = [(s, s.noise_multiplier) for s in mech.noise_stages]
    try:
        for s, _ in saved:
            s.noise_multiplier = 0.0
        yield mech
    finally:
        for s, v in saved:
            s.noise_multiplier = v


def step_events(records: list[NoiseRecord], facts: StepFacts, sampling_rate: float):
    """(honest, claimed) dp-accounting events of one step, by the function PrivateTrainer
    uses (:func:`privgrad.accounting.events.step_events`)."""
    return events.step_events(
        records,
        events.sampled_gaussian(sampling_rate),
        facts.pure_events,
        facts.claimed_pure_events,
    )


def epsilons(steps: list[tuple[list[NoiseRecord], StepFacts]], sampling_rate: float, delta: float):
    """(honest, claimed) ε of the steps' (records, facts), composed as PrivateTrainer does
    (two ledgers; pure-DP steps: best of basic and tight composition; claimed: basic)."""
    honest, claimed = PrivacyLedger(), PrivacyLedger()
    for r, e in steps:
        h, c = step_events(r, e, sampling_rate)
        honest.record(h)
        claimed.record(c)
    eps = composed_epsilon(honest.entries, delta, "pld", "best")
    if claimed.entries == honest.entries:
        return eps, eps
    return eps, composed_epsilon(claimed.entries, delta, "pld", "basic")


def flat(tensors: list[torch.Tensor], trial_dims: int = 0) -> torch.Tensor:
    """Concatenate a release (list of parameter-shaped tensors) into one vector per trial."""
    return torch.cat([t.reshape(*t.shape[:trial_dims], -1) for t in tensors], dim=trial_dims)


def finite_or_none(x: float):
    return None if x is None or not math.isfinite(x) else x


def private_trainer(
    model,
    optimizer,
    data,
    mech: Mechanism,
    *,
    noise_multiplier,
    target_epsilon,
    target,
    delta,
    epochs,
    batch_size,
    seed,
    loss_fn=None,
) -> PrivateTrainer:
    """``make_private`` with a built mechanism; a chain without noise (the non-private
    control) gets a trainer directly, as there is no σ to set or calibrate."""
    if not has_noise(mech):
        return PrivateTrainer(model, optimizer, data, mech, batch_size, delta, seed, loss_fn)
    return make_private(
        model,
        optimizer,
        data,
        mechanism=mech,
        target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier if target_epsilon is None else None,
        delta=delta,
        epochs=epochs,
        batch_size=batch_size,
        target=target,
        seed=seed,
        loss_fn=loss_fn,
    )
