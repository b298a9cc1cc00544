"""Gradient-canary audit of one discriminator step of a GAN mode (RDP-GAN's readings A and
B, the sound DP-GAN, the non-private GAN), through :class:`privgrad.app.gan.GanTrainer`'s own
``d_step``.

Setting. D0 is ``background`` real MNIST training images (GAN range [-1, 1], their
labels); D1 adds one canary, a ±1 checkerboard image with label 0 (far from every digit,
so the discriminator's loss on it, and its unclipped gradient, are large). The real batch
is all of the set (q = 1) with the public divisor m = |D1|, as in the trainer. Every trial
restores the same initial G, D and Adam state, draws fresh prior (fake batch) and privacy
noise, runs one D-step, and releases D's parameter change. The score is the release's
projection on a direction the auditor learns first, on separate trials: the mean over
``trials // 4`` pairs of the difference release(D1) − release(D0) with the same fake batch
and noise seed on both sides (pairing cancels the fake batch's variance in the estimate;
the scored trials are independent draws). The threshold is then chosen on held-out
trials, as in :func:`privgrad.app.audit.stats.epsilon_lower_bound`.

ε beside the bound: the paper modes have no honest ε (∞; see ``privgrad.app.gan.train``) and
their claimed ε is Thms 1-4 for this one step (n_g = n_d = 1, q = 1, C = 25 of Table II for
MNIST at batch 64, so ΔS = 25/m); ``--epsilon`` sets that claimed ε. DP-GAN's ε is the
accountant's for one Poisson-sampled Gaussian step.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from privgrad.errors import PrivgradError
from privgrad.sampling import PoissonSampler
from privgrad.app.audit.common import flat
from privgrad.app.audit.stats import epsilon_lower_bound, gaussian_epsilon, gaussian_mu_estimate

GAN_AUDIT_MODES = ("non-private", "rdp-gan-a", "rdp-gan-b", "dp-gan")
MNIST_LOSS_BOUND = 25.0  # Table II, MNIST, batch 64


def is_gan_audit(mechanism: str, model: str | None) -> bool:
    """Whether a canary audit of (mechanism, model) is this GAN-step audit: a GAN mode, or
    the non-private control on the GAN's discriminator (``model='cdcgan'``)."""
    return model == "cdcgan" or (mechanism in GAN_AUDIT_MODES and mechanism != "non-private")


def checkerboard_canary(size: int = 28) -> torch.Tensor:
    i = torch.arange(size)
    return ((i[:, None] + i[None, :]) % 2 * 2.0 - 1.0).reshape(1, 1, size, size)


def gan_canary_audit(
    mechanism: str = "rdp-gan-a",
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target: str = "claimed",
    delta: float = 1e-5,
    trials: int = 2000,
    background: int = 63,
    alpha: float = 0.05,
    selection_fraction: float = 0.5,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    data_dir=None,
    mechanism_options: dict | None = None,
    steps: int = 1,
    sampling_rate: float = 1.0,
    model: str = "cdcgan",
) -> dict:
    """Runs the audit (see the module docstring) and returns its record. ``trials`` per
    side are scored; ``trials // 4`` paired trials estimate the direction. ``steps``,
    ``sampling_rate`` and ``model`` exist so that a caller's other values fail loudly."""
    from privgrad.app.gan.data import GanData, load_gan_data
    from privgrad.app.gan.train import GanConfig, GanTrainer, PAPER_MODES

    started = time.time()
    if mechanism not in GAN_AUDIT_MODES:
        raise PrivgradError(
            f"the GAN audit takes --mechanism {', '.join(GAN_AUDIT_MODES)} "
            f"(rdp-ant's schedule needs a whole run), got '{mechanism}'"
        )
    if mechanism_options:
        raise PrivgradError("GAN modes take no --option")
    if steps != 1 or sampling_rate != 1 or model != "cdcgan":
        raise PrivgradError(
            "the GAN audit runs one discriminator step at q = 1 on the cdcgan discriminator "
            f"(got steps {steps}, sampling rate {sampling_rate:g}, model '{model}')"
        )
    if trials < 4 or background < 1:
        raise PrivgradError("need trials ≥ 4 and background ≥ 1")
    if mechanism in PAPER_MODES and target_epsilon is not None and target != "claimed":
        raise PrivgradError(
            f"{mechanism} has no honest ε (no noise reaches a bounded sensitivity); "
            "--epsilon with --claimed sets the paper's ε"
        )
    if mechanism == "non-private":
        target_epsilon = noise_multiplier = None
    elif target_epsilon is None and noise_multiplier is None:
        target_epsilon = 1.0

    real = load_gan_data("mnist", data_dir, limit_train=background)
    canary = checkerboard_canary(real.image_size)
    sides = [
        real,
        GanData(
            "mnist",
            torch.cat([real.train_x, canary]),
            torch.cat([real.train_y, torch.zeros(1, dtype=real.train_y.dtype)]),
            real.num_classes,
            real.image_size,
            real.output,
        ),
    ]
    m = len(sides[1])
    config = GanConfig(
        mode=mechanism,
        dataset="mnist",
        generator_steps=1,
        discriminator_steps=1,
        epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
        delta=delta,
        batch_size=m,
        clip=max_grad_norm,
        loss_bound=MNIST_LOSS_BOUND,
        seed=seed,
    )
    trainer = GanTrainer(config, sides[1])
    sigma = trainer.schedule.sigma
    start = (copy.deepcopy(trainer.D.state_dict()), copy.deepcopy(trainer.d_opt.state_dict()))
    theta0 = flat([p.detach() for p in trainer.D.parameters()]).clone()

    def release(side: int, trial_seed: int) -> torch.Tensor:
        trainer.D.load_state_dict(start[0])
        trainer.d_opt.load_state_dict(start[1])
        trainer.data = sides[side]
        n = len(sides[side])
        trainer.sampler = PoissonSampler(n, n, torch.Generator().manual_seed(trial_seed))  # q = 1
        trainer.prior_gen = torch.Generator().manual_seed(trial_seed + 1)
        trainer.noise_gen = torch.Generator().manual_seed(trial_seed + 2)
        trainer.d_step(sigma)
        return flat([p.detach() for p in trainer.D.parameters()]) - theta0

    release(
        1, seed
    )  # one step on D1: the ledger (DP-GAN) and the claimed cost of exactly this step
    eps = trainer.epsilon()
    eps_claimed = (
        trainer.iteration_cost(sigma) if mechanism in PAPER_MODES else trainer.epsilon_claimed()
    )
    effective = trainer.mechanism.noise_multiplier if mechanism == "dp-gan" else 0.0

    def seeds(side: int, block: int, n: int):
        return [int(s) for s in np.random.SeedSequence([seed, side, block]).generate_state(n)]

    n_dir = max(2, trials // 4)
    direction = torch.stack([release(1, s) - release(0, s) for s in seeds(2, 0, n_dir)]).mean(0)
    norm = float(direction.norm())
    if norm == 0 or not math.isfinite(norm):
        raise PrivgradError(
            "the canary does not move the discriminator's mean update; no test direction"
        )
    direction = direction / norm
    s0, s1 = (
        np.array([float(release(side, s) @ direction) for s in seeds(side, 1, trials)])
        for side in (0, 1)
    )
    bound = epsilon_lower_bound(s0, s1, delta, alpha, selection_fraction)
    mu_hat, mu_se = gaussian_mu_estimate(s0, s1)
    lb = bound.epsilon_lower_bound
    return {
        "method": "canary",
        "mechanism": mechanism,
        "paper_mode": mechanism in PAPER_MODES,
        "epsilon": eps,
        "epsilon_claimed": eps_claimed,
        "epsilon_lower_bound": lb,
        "confidence": bound.confidence,
        "trials": trials,
        "delta": delta,
        "violation": lb > eps,
        "refutes_claimed": lb > eps_claimed,
        "noise_multiplier": sigma if mechanism != "dp-gan" else effective,
        "effective_noise_multiplier": effective,
        "claimed_noise_multiplier": sigma,
        "noise_reading": trainer.reading,
        "sampling_rate": 1.0,
        "steps": 1,
        "background": background,
        "expected_batch_size": m,
        "clip": max_grad_norm if mechanism == "dp-gan" else None,
        "canary": "checkerboard image",
        "statistic": "empirical",
        "direction_trials": n_dir,
        "model": "cdcgan discriminator",
        "n_params": int(theta0.numel()),
        "test": bound.as_dict(),
        "mu_hat": mu_hat,
        "mu_hat_se": mu_se,
        "epsilon_gaussian_estimate": gaussian_epsilon(abs(mu_hat), delta),
        "seed": seed,
        "wall_time_s": round(time.time() - started, 2),
    }


__all__ = ["gan_canary_audit", "is_gan_audit", "GAN_AUDIT_MODES", "checkerboard_canary"]
