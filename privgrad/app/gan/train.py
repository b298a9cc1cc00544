"""``privgrad gan``: RDP-GAN as published (no guarantee), RDP-ANT, and a sound DP-GAN.

Modes (how noise enters the discriminator's training; G is never noised):

* ``non-private``: BCE GAN, no noise.
* ``rdp-gan-a``: the literal Eq. 8, one N(0, σ²) draw added to the *sum* of the
  real-data losses. A constant added to a loss has zero gradient, so the parameters are
  bit-for-bit those of ``non-private`` (a test shows it); only the printed loss is noised.
* ``rdp-gan-b``: Eqs. 9-10, N(0, σ²) added per real sample to the output-layer error
  δ_i^L = ∂ℓ_i/∂z_i = d(x_i) − 1, via a backward hook on the real batch's logits.
* ``rdp-ant``: reading B with σ_t from a schedule (Alg. 2: ANT, Eqs. 17-18; or the
  Time / Exp / Step baselines, Eqs. 19-21), stopped by the paper's budget rule.
* ``dp-gan``: DP-SGD on the discriminator. Each D-step's real-data gradient is the
  clipped, Gaussian-noised sum of per-sample gradients (Poisson batch, rate q = m/N);
  the fake-data gradient touches no private data (post-processing of G's samples) and
  is added unclipped. One Poisson-sampled Gaussian event per D-step goes to the ledger;
  G-steps read D's released weights only, so they are post-processing.

For the three paper modes the record's ``epsilon`` is null (∞) with
``dp_guarantee: false`` and the paper's own figure (Thms 1-4) as ``epsilon_claimed``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from privgrad.accounting import PrivacyLedger, validate_delta, validate_epsilon
from privgrad.accounting.events import step_events
from privgrad.accounting.ledger import check_pld_size
from privgrad.app.console import status
from privgrad.app.defaults import GAN_MODES
from privgrad.seeds import generator, secret_seed, seed_source
from privgrad.distributed import Distributed
from privgrad.errors import PrivgradError
from privgrad.mechanisms import build_mechanism
from privgrad.mechanisms.stages import NonFiniteGradients
from privgrad.per_sample import GradSampler
from privgrad.private import NEIGHBOURING, calibrate
from privgrad.sampling import PoissonSampler
from privgrad.app.store import RunStore, recorded_run
from privgrad.records import provenance
from privgrad.validate import MAX_GAN_SAMPLES, MAX_NOISE_MULTIPLIER
from privgrad.app.gan.claimed import (
    NOT_A_GUARANTEE,
    TABLE_II_MAX_LOSS,
    PaperAccountant,
    table_ii_loss_bound,
)
from privgrad.app.gan.data import GanData, load_gan_data
from privgrad.app.gan.models import Discriminator, Generator, condition
from privgrad.app.gan.schedules import PAPER_DECAY, ClaimedBudget, NoiseSchedule

PAPER_MODES = ("rdp-gan-a", "rdp-gan-b", "rdp-ant")
NOISE_READING = {
    "non-private": None,
    "rdp-gan-a": "loss",
    "rdp-gan-b": "error",
    "rdp-ant": "error",
    "dp-gan": "dpsgd",
}
READING_TEXT = {
    "loss": "N(0, σ²) added once to the sum of the real-data losses (Eq. 8, literal)",
    "error": "N(0, σ²) added per real sample to the output-layer error ∂ℓ_i/∂z_i (Eqs. 9-10)",
    "dpsgd": (
        "per-sample real-data gradients of D clipped to C, Gaussian noise σC on their sum (DP-SGD)"
    ),
}
GUARANTEE = {
    "non-private": "no formal guarantee: no noise is added (ε = ∞)",
    "rdp-gan-a": (
        "no formal guarantee: the N(0, σ²) scalar added to the loss (Eq. 8) has zero gradient, "
        "so the trained G and D are bit-for-bit those of non-private training (ε = ∞); only "
        "the printed loss value is noised"
    ),
    "rdp-gan-b": (
        "no formal guarantee: noise on the output-layer error (Eqs. 9-10) reaches the parameters "
        "only through unclipped, data-dependent Jacobians, so the update is not a Gaussian "
        "mechanism and its privacy loss is unbounded (ε = ∞); the paper's loss bound C is an "
        "empirical maximum that nothing enforces"
    ),
    "rdp-ant": (
        "no formal guarantee: reading B of RDP-GAN (noise on the output-layer error, not a "
        "Gaussian mechanism, ε = ∞) with a noise schedule chosen from evaluation scores that "
        "are not "
        "accounted either"
    ),
    "dp-gan": (
        "(ε, δ)-DP for the released G and D (add/remove one example, Poisson sampling): DP-SGD on "
        "the discriminator's real-data gradients, PLD accountant over all n_g·n_d discriminator "
        "steps; generator steps are post-processing"
    ),
}
OPTIMIZER = "adam (betas 0.5, 0.999), for D and G"
# The hyper-parameters Ma et al. state (§V-A, §V-E): a_d = a_g, n_d, n_g, τ, t*; batch 64 or 128;
# C from Table II and k from Tables IV/V when left unset (None).
PAPER_SETTING = {
    "lr": 5e-5,
    "discriminator_steps": 5,
    "generator_steps": 1000,
    "tau": 0.5,
    "t_star": 100,
    "loss_bound": None,
    "decay": None,
}
PAPER_BATCH_SIZES = (64, 128)


@dataclass
class GanConfig:
    mode: str = "rdp-gan-b"
    dataset: str = "mnist"
    generator_steps: int = 1000  # n_g
    discriminator_steps: int = 5  # n_d
    epsilon: float | None = None  # dp-gan: honest target; paper modes: the paper's ε_total
    noise_multiplier: float | None = None  # σ (σ_0 for rdp-ant) instead of epsilon
    delta: float = 1e-5
    alpha: float = 2.0  # Rényi order in the paper's claimed ε
    loss_bound: float | None = None  # C of ΔS = C/m (default: Table II)
    schedule: str | None = None  # rdp-ant: ant (default), time, exp, step
    decay: float | None = None  # k (default: the paper's Tables IV/V)
    tau: float = 0.5
    t_star: int = 100
    smoothing: bool = True  # Eq. 18 (running mean) in Eq. 17
    batch_size: float = 64  # expected (Poisson) real batch size m; fake batches have m samples
    lr: float = 5e-5
    clip: float = 1.0  # dp-gan: per-sample clipping norm C
    latent_dim: int = 100
    width: int = 64
    eval_every: int | None = None  # default: every G-step for rdp-ant, every 10 otherwise
    eval_samples: int = 500  # generated samples per score during training
    final_samples: int = 10_000  # generated samples for the final evaluation
    seed: int | None = None  # None: a secret seed drawn from the OS (privgrad.seeds)
    limit_train: int | None = None
    data_dir: str | None = None
    image_dir: str | None = None

    @property
    def schedule_kind(self) -> str:
        if self.mode == "rdp-ant":
            return self.schedule or "ant"
        return "constant"

    @property
    def eval_interval(self) -> int:
        return self.eval_every or (1 if self.mode == "rdp-ant" else 10)

    def validate(self) -> None:
        if self.mode not in GAN_MODES:
            raise PrivgradError(
                f"unknown GAN mode '{self.mode}'; choose from: {', '.join(GAN_MODES)}"
            )
        if self.dataset not in ("mnist", "adult"):
            raise PrivgradError(f"unknown GAN dataset '{self.dataset}'; choose from: mnist, adult")
        given = (self.epsilon is not None) + (self.noise_multiplier is not None)
        if self.mode == "non-private":
            if given:
                raise PrivgradError("non-private takes neither --epsilon nor --noise-multiplier")
        elif given != 1:
            raise PrivgradError(
                f"{self.mode} needs exactly one of --epsilon and --noise-multiplier"
            )
        if self.epsilon is not None:
            validate_epsilon(self.epsilon)
        if self.noise_multiplier is not None:
            if not 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER:
                raise PrivgradError(
                    f"the noise multiplier must lie in [0, {MAX_NOISE_MULTIPLIER:g}], "
                    f"got {self.noise_multiplier}"
                )
            if self.mode in ("rdp-ant", "dp-gan") and self.noise_multiplier == 0:
                raise PrivgradError(f"{self.mode} needs a noise multiplier > 0")
        validate_delta(self.delta)
        if self.schedule is not None:
            if self.mode != "rdp-ant":
                raise PrivgradError("--schedule applies to --mode rdp-ant only")
            if self.schedule not in ("ant", "time", "exp", "step"):
                raise PrivgradError(
                    f"--schedule must be ant, time, exp or step, got '{self.schedule}'"
                )
        for name in (
            "generator_steps",
            "discriminator_steps",
            "latent_dim",
            "width",
            "eval_samples",
            "final_samples",
            "t_star",
        ):
            if not getattr(self, name) >= 1:
                raise PrivgradError(
                    f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}"
                )
        for name in ("eval_samples", "final_samples"):
            if getattr(self, name) > MAX_GAN_SAMPLES:
                raise PrivgradError(
                    f"--{name.replace('_', '-')} must be at most {MAX_GAN_SAMPLES} (the samples "
                    f"are generated and held at once), got {getattr(self, name)}"
                )
        for name in ("batch_size", "lr", "clip"):
            if not getattr(self, name) > 0:
                raise PrivgradError(
                    f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        if self.eval_every is not None and self.eval_every < 1:
            raise PrivgradError(f"--eval-every must be ≥ 1, got {self.eval_every}")
        if not self.alpha > 1:
            raise PrivgradError(f"--alpha must be > 1, got {self.alpha}")
        if self.mode in PAPER_MODES and self.loss_bound is None:
            table_ii_loss_bound(self.dataset, self.batch_size)  # fails early without a C


def per_sample_bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, target, reduction="none")


def rdp_discriminator_loss(
    D,
    real: torch.Tensor,
    fake: torch.Tensor,
    reading: str | None,
    sigma: float,
    m: float,
    generator: torch.Generator,
):
    """The discriminator's loss (Σ_real ℓ + Σ_fake ℓ) / m with RDP-GAN's noise.

    Returns (loss to backpropagate, the printed loss value, Σ real ℓ, Σ fake ℓ).

    * reading ``'loss'`` (Eq. 8): one N(0, σ²) draw is added to Σ_i ℓ(x_i). A constant
      added to a loss has zero gradient: the parameters' gradients are unchanged.
    * reading ``'error'`` (Eqs. 9-10): a backward hook on the real batch's logits z_i adds
      σ·η_i (η_i ~ N(0, 1), one per sample) to the output-layer error δ_i = ∂ℓ_i/∂z_i
      = sigmoid(z_i) − 1. The hook sees ∂loss/∂z_i = δ_i/m, so it adds σ·η_i/m; Eq. 10
      (ordinary backprop) then carries δ_i + σ·η_i into every layer's gradient.
    * ``None``: no noise (non-private).
    """
    logits_real = D(real)
    if reading == "error" and sigma > 0:
        logits_real.register_hook(
            lambda g: g + (sigma / m) * torch.randn(g.shape, generator=generator, dtype=g.dtype)
        )
    real_sum = F.binary_cross_entropy_with_logits(
        logits_real, torch.ones_like(logits_real), reduction="sum"
    )
    fake_logits = D(fake)
    fake_sum = F.binary_cross_entropy_with_logits(
        fake_logits, torch.zeros_like(fake_logits), reduction="sum"
    )
    noised_real = real_sum
    if reading == "loss" and sigma > 0:
        noised_real = real_sum + sigma * torch.randn((), generator=generator)
    loss = (noised_real + fake_sum) / m
    return loss, float(loss.detach()), real_sum.detach(), fake_sum.detach()


class GanTrainer:
    """One GAN run: the models, samplers, noise and both ledgers (honest and claimed)."""

    def __init__(self, config: GanConfig, data: GanData, distributed: Distributed | None = None):
        """``distributed``: one rank of a data-parallel dp-gan run; the ranks split the real
        data, all-reduce D's clipped real-data sums and compute the same fake batches and G."""
        config.validate()
        if distributed and config.mode != "dp-gan":
            raise PrivgradError(
                f"data-parallel GAN training supports mode dp-gan only, got '{config.mode}'"
            )
        self.config, self.data, self.distributed = config, data, distributed
        c, K = config, data.num_classes
        self.mode, self.reading = c.mode, NOISE_READING[c.mode]
        seed = c.seed if c.seed is not None else secret_seed(distributed)
        torch.manual_seed(seed)
        self.G = Generator(c.latent_dim, K, data.image_size, c.width, data.output)
        self.D = Discriminator(K, data.image_size, c.width)
        self.g_opt = torch.optim.Adam(self.G.parameters(), lr=c.lr, betas=(0.5, 0.999))
        self.d_opt = torch.optim.Adam(self.D.parameters(), lr=c.lr, betas=(0.5, 0.999))
        # Own generators: real batches, the prior (z and fake labels), the privacy noise.
        self.sampler = (distributed.sampler if distributed else PoissonSampler)(
            len(data), c.batch_size, generator(seed)
        )
        self.prior_gen = generator(seed + 17)
        self.noise_gen = generator(seed + 1_000_003)
        self.m = self.sampler.expected_batch_size  # public divisor (never the drawn batch size)
        self.fake_batch = max(1, int(round(c.batch_size)))
        self.ledger = PrivacyLedger()
        self.paper: PaperAccountant | None = None
        self.budget = ClaimedBudget(None)
        sigma = 0.0
        if c.mode in PAPER_MODES:
            self.paper = PaperAccountant.for_run(
                c.dataset,
                len(data),
                c.batch_size,
                c.discriminator_steps,
                c.alpha,
                c.delta,
                c.loss_bound,
            )
            sigma = (
                c.noise_multiplier
                if c.noise_multiplier is not None
                else self.paper.sigma_for(c.epsilon, c.generator_steps)
            )
            if c.mode == "rdp-ant":
                self.budget = ClaimedBudget(
                    c.epsilon
                    if c.epsilon is not None
                    else c.generator_steps * self.paper.generator_epsilon(sigma)
                )
        kind = c.schedule_kind
        decay = (
            c.decay if c.decay is not None or kind == "constant" else PAPER_DECAY[c.dataset][kind]
        )
        self.schedule = NoiseSchedule(kind, sigma, decay, c.tau, c.t_star, c.smoothing)
        if c.mode == "dp-gan":
            self.mechanism = build_mechanism("dpsgd", 0.0, c.clip)
            self.grad_sampler = GradSampler(self.D, settle=not self.mechanism.reads_layer_inputs)
            steps = c.generator_steps * c.discriminator_steps
            self.mechanism.noise_multiplier = (
                c.noise_multiplier
                if c.noise_multiplier is not None
                else calibrate(
                    self.mechanism,
                    len(self.grad_sampler.units),
                    c.epsilon,
                    c.delta,
                    self.sampler.sampling_rate,
                    steps,
                    "honest",
                    self.m,
                )
            )
            if (
                self.mechanism.noise_multiplier > 0
            ):  # ε of the whole run must be computable, before any step
                check_pld_size([(self.sampler.event(self.mechanism.noise_multiplier), steps)])
        self.d_steps = 0
        self.sigmas: list[float] = []
        self.scores: list[tuple[int, float]] = []
        # the paper modes' printed D loss per D-step (noised in mode A) and their un-noised
        # maxima; dp-gan keeps none of them, being statistics of the private real batch
        self.losses: list[float] = []
        self.max_real_loss_sum = 0.0  # Table II's quantity, Σ_i ℓ(x_i) over a real batch
        self.max_d_loss = 0.0  # max of the (un-noised) mean D loss, real + fake
        self.stopped_by_budget = False

    # ------------------------------------------------------------------ steps
    def _prior(self, n: int):
        z = torch.randn(n, self.config.latent_dim, generator=self.prior_gen)
        K = self.data.num_classes
        y = torch.randint(0, K, (n,), generator=self.prior_gen) if K else None
        return z, y

    def _real_batch(self):
        idx = self.sampler.sample()
        x = self.data.train_x[idx]
        y = self.data.train_y[idx] if self.data.num_classes else None
        return condition(x, y, self.data.num_classes)

    def _fake_batch(self):
        z, y = self._prior(self.fake_batch)
        with torch.no_grad():
            x = self.G(z, y)
        return condition(x, y, self.data.num_classes)

    def d_step(self, sigma: float) -> None:
        if self.reading == "dpsgd":
            self._d_step_dpsgd()
        else:
            self._d_step_rdp(sigma)
        self.d_steps += 1

    def _d_step_rdp(self, sigma: float) -> None:
        """Non-private, reading A (scalar on the loss) or reading B (hook on δ^L)."""
        real, fake = self._real_batch(), self._fake_batch()
        loss, printed, real_sum, fake_sum = rdp_discriminator_loss(
            self.D, real, fake, self.reading, sigma, self.m, self.noise_gen
        )
        self._track(real_sum, fake_sum)
        self.d_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.d_opt.step()
        self.losses.append(printed)

    def _d_step_dpsgd(self) -> None:
        """Clipped, noised real-data gradient (DP-SGD) + the fake-data gradient."""
        real = self._real_batch()
        reduce = self.distributed.all_reduce_sum if self.distributed else None
        per_sample, _ = self.grad_sampler.compute(real, torch.ones(len(real)), per_sample_bce)
        try:
            grads, records, facts = self.mechanism.privatize(
                per_sample, self.m, self.noise_gen, reduce
            )
        except NonFiniteGradients as bad:  # raised before noise or reduction: drop those examples
            real = real[~bad.mask]
            per_sample, _ = self.grad_sampler.compute(real, torch.ones(len(real)), per_sample_bce)
            grads, records, facts = self.mechanism.privatize(
                per_sample, self.m, self.noise_gen, reduce
            )
        fake = self._fake_batch()
        fake_logits = self.D(fake)
        fake_sum = F.binary_cross_entropy_with_logits(
            fake_logits, torch.zeros_like(fake_logits), reduction="sum"
        )
        params = per_sample.params
        fake_grads = torch.autograd.grad(fake_sum / self.m, params)
        self.d_opt.zero_grad(set_to_none=True)
        for p, g, fg in zip(params, grads, fake_grads):
            p.grad = g + fg
        self.d_opt.step()
        honest, _ = step_events(records, self.sampler.event, facts.pure_events)
        self.ledger.record(honest)
        # the real batch's loss is un-noised: kept nowhere (not in losses, the store or the record)

    def _track(self, real_sum: torch.Tensor, fake_sum: torch.Tensor) -> None:
        real_sum, fake_sum = real_sum.detach(), fake_sum.detach()
        self.max_real_loss_sum = max(self.max_real_loss_sum, float(real_sum))
        self.max_d_loss = max(self.max_d_loss, float((real_sum + fake_sum) / self.m))

    def g_step(self) -> None:
        z, y = self._prior(self.fake_batch)
        logits = self.D(condition(self.G(z, y), y, self.data.num_classes))
        loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        self.g_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.g_opt.step()
        self.D.zero_grad(set_to_none=True)  # G's step leaves gradients in D; D never uses them

    # ------------------------------------------------------------------ loop
    def iteration_cost(self, sigma: float) -> float:
        """The paper's ε_g of one G-iteration at σ (0 for the non-paper modes)."""
        return self.paper.generator_epsilon(sigma) if self.paper is not None else 0.0

    def run(self, score_fn=None, on_eval=None, progress=None) -> None:
        """Alg. 1 / Alg. 2: n_g iterations of n_d D-steps and one G-step, or fewer where the
        paper's budget rule stops a schedule. ``score_fn(G)`` gives S_t."""
        c = self.config
        if self.schedule.needs_scores and score_fn is None:
            raise PrivgradError("RDP-ANT needs an evaluation score (score_fn)")
        for t in range(c.generator_steps):
            sigma = (
                self.mechanism.noise_multiplier if self.mode == "dp-gan" else self.schedule.sigma
            )
            cost = self.iteration_cost(sigma)
            if not self.budget.affords(cost):
                self.stopped_by_budget = True
                break
            for _ in range(c.discriminator_steps):
                self.d_step(sigma)
            self.g_step()
            self.budget.spend(cost)
            self.sigmas.append(sigma)
            score = None
            last = t + 1 == c.generator_steps
            if score_fn is not None and (
                self.schedule.needs_scores or (t + 1) % c.eval_interval == 0 or last
            ):
                score = float(score_fn(self.G))
                self.scores.append((t + 1, score))
                if on_eval:
                    on_eval(t + 1, score)
            self.schedule.advance(score)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(
                    sigma=f"{sigma:.3g}", score=f"{score:.3f}" if score is not None else "-"
                )

    @property
    def generator_iterations(self) -> int:
        return len(self.sigmas)

    def epsilon(self, accountant: str = "pld") -> float:
        """Honest ε: finite only for dp-gan; ∞ for every other mode."""
        if self.mode != "dp-gan":
            return math.inf
        return self.ledger.epsilon(self.config.delta, accountant)

    def epsilon_claimed(self) -> float | None:
        if self.paper is not None:
            return self.paper.total_epsilon(self.sigmas) if self.sigmas else 0.0
        if self.mode == "dp-gan":
            return self.epsilon()
        return math.inf

    @property
    def noise_multiplier(self) -> float:
        if self.mode == "dp-gan":
            return self.mechanism.noise_multiplier
        return self.schedule.sigma0


# ---------------------------------------------------------------------- runs
def _scorer(config: GanConfig, data: GanData):
    from privgrad.app.gan.evaluate import AdultScorer, MnistScorer

    return MnistScorer(data) if data.name == "mnist" else AdultScorer(data)


def _public_seed(config: GanConfig) -> int:
    """The seed of the evaluation's latents (post-processing of the generator: no secret)."""
    return 0 if config.seed is None else config.seed


def _score_fn(scorer, config: GanConfig, data: GanData):
    from privgrad.app.gan.evaluate import generate

    gen_seed = _public_seed(config) + 99

    def score(G):
        gen = torch.Generator().manual_seed(gen_seed)  # the same latents at every evaluation
        x, y = generate(G, config.eval_samples, config.latent_dim, data.num_classes, gen)
        return scorer.score(x, y)

    return score


def final_evaluation(trainer: GanTrainer, scorer, image_dir: Path) -> tuple[float, dict, list[str]]:
    from privgrad.app.gan.evaluate import (
        REAL_REFERENCE,
        evaluate_adult,
        generate,
        save_grid,
        save_pmf_plot,
    )

    c, data = trainer.config, trainer.data
    gen = torch.Generator().manual_seed(_public_seed(c) + 7)
    x, y = generate(trainer.G, c.final_samples, c.latent_dim, data.num_classes, gen)
    title = f"{c.mode} {c.dataset}"
    if data.name == "mnist":
        per_digit = scorer.per_class(x, y)
        score = scorer.score(x, y)
        order = torch.cat([torch.nonzero(y == d).flatten()[:10] for d in range(10)])
        images = [save_grid(x[order], image_dir / "samples.png", nrow=10)]
        metrics = {
            "score": score,
            "score_per_digit": per_digit,
            "real_reference": REAL_REFERENCE["mnist"],
            "samples": len(x),
        }
        return score, metrics, images
    metrics = evaluate_adult(data, x, scorer)
    metrics["real_reference"] = REAL_REFERENCE["adult"]
    metrics["samples"] = len(x)
    images = [
        save_grid(x[:64], image_dir / "samples.png", nrow=8, value_range=(0.0, 1.0)),
        save_pmf_plot(metrics, image_dir / "pmf.png", title),
    ]
    return metrics["income_trained_real_tested_synthetic"], metrics, images


def selection(c: GanConfig) -> dict:
    """The record's ``selection``: ``paper`` when every hyper-parameter the paper states was run
    at its value, else ``command line`` with the ones that differ (nothing is searched here)."""
    differs = {k: getattr(c, k) for k, v in PAPER_SETTING.items() if getattr(c, k) != v}
    if c.batch_size not in PAPER_BATCH_SIZES:
        differs["batch_size"] = c.batch_size
    return {"on": "command line", "differs_from_paper": differs} if differs else {"on": "paper"}


def gan_record(
    trainer: GanTrainer,
    score: float,
    metrics: dict,
    images: list[str],
    wall_time: float,
    command: str | None,
) -> dict:
    c = trainer.config
    eps = trainer.epsilon()
    honest = math.isfinite(eps)
    scores = [s for _, s in trainer.scores]
    record = {
        "mechanism": c.mode,
        "mode": c.mode,
        "dataset": c.dataset,
        "model": "cdcgan" if trainer.data.num_classes else "dcgan",
        "test_accuracy": score,
        "score": (
            "fraction of generated digits the MNIST-test-split MLP classifies as their intended "
            "label"
            if c.dataset == "mnist"
            else "income classifier trained on real (adult.test), accuracy on synthetic rows"
        ),
        "epsilon": eps if honest else None,
        "epsilon_claimed": trainer.epsilon_claimed(),
        "epsilon_rdp": trainer.epsilon("rdp") if honest else None,
        "dp_guarantee": honest,
        "guarantee": GUARANTEE[c.mode],
        "delta": c.delta,
        "accountant": "pld" if honest else None,
        "neighbouring": NEIGHBOURING if honest else None,
        "noise_reading": READING_TEXT.get(trainer.reading),
        "noise_multiplier": trainer.noise_multiplier,
        "effective_noise_multiplier": (
            trainer.mechanism.noise_multiplier
            if honest
            else 0.0
            if c.mode in ("non-private", "rdp-gan-a")
            else None
        ),
        "sampling_rate": trainer.sampler.sampling_rate,
        "steps": trainer.d_steps,
        "generator_steps": trainer.generator_iterations,
        "generator_steps_planned": c.generator_steps,
        "discriminator_steps": c.discriminator_steps,
        "world_size": trainer.distributed.world_size if trainer.distributed else 1,
        "backend": trainer.distributed.backend if trainer.distributed else None,
        "score_history": [list(p) for p in trainer.scores],
        "score_mean": sum(scores) / len(scores) if scores else None,
        "evaluation": metrics,
        "images": images,
        # Table II's quantity (the paper's empirical C); un-noised statistics of the private
        # data, so dp-gan (the one mode with a guarantee) does not keep them
        "max_real_loss_sum": None if c.mode == "dp-gan" else trainer.max_real_loss_sum,
        "max_d_loss": None if c.mode == "dp-gan" else trainer.max_d_loss,
        "seed": c.seed,
        "seed_source": seed_source(c.seed is not None),
        "wall_time_s": round(wall_time, 2),
        "batch_size": c.batch_size,
        "clip": c.clip if c.mode == "dp-gan" else None,
        "lr": c.lr,
        "optimizer": OPTIMIZER,
        "latent_dim": c.latent_dim,
        "width": c.width,
        "train_size": len(trainer.data),
        "config": dataclasses.asdict(c),
        "selection": selection(c),
        **provenance(),
        "command": command,
    }
    if trainer.paper is not None:
        p = trainer.paper
        sig = trainer.sigmas
        record["epsilon_claimed_note"] = NOT_A_GUARANTEE
        record["paper_accounting"] = {
            **p.describe(),
            "loss_bound": p.sensitivity * c.batch_size,
            "loss_bound_source": "--loss-bound" if c.loss_bound is not None else "Table II",
            "table_ii_max_loss": TABLE_II_MAX_LOSS.get((c.dataset, int(c.batch_size))),
            "epsilon_g_first": p.generator_epsilon(sig[0]) if sig else None,
            "theorem2_condition_holds": all(p.theorem2_condition_holds(s) for s in set(sig))
            if sig
            else None,
            "budget": trainer.budget.total,
            "spent": trainer.budget.spent,
            "stopped_by_budget": trainer.stopped_by_budget,
        }
        s = trainer.schedule
        record["schedule"] = {
            "kind": s.kind,
            "decay": s.decay,
            "tau": s.tau if s.kind == "ant" else None,
            "t_star": s.t_star if s.kind == "step" else None,
            "smoothing": s.smoothing if s.kind == "ant" else None,
            "sigma_first": sig[0] if sig else None,
            "sigma_last": sig[-1] if sig else None,
            "sigma_min": min(sig) if sig else None,
            "decays": sum(s.decisions) if s.kind == "ant" else None,
            "sigma_per_iteration": sig if s.kind != "constant" else None,
        }
    else:
        record["epsilon_claimed_note"] = None if honest else "no claim"
    return record


def train_gan(
    config: GanConfig,
    store: RunStore | None = None,
    progress: bool = True,
    command: str | None = None,
    data: GanData | None = None,
    distributed: Distributed | None = None,
) -> dict | None:
    """Runs ``config`` and returns its run record (the object ``--json`` prints).

    With ``distributed`` (mode dp-gan) only rank 0 scores, writes ``store`` and returns
    the record (other ranks: None)."""
    config.validate()
    main = distributed is None or distributed.is_main
    if not main:
        store, progress = None, False

    def say(message: str) -> None:
        if progress:
            status(message)

    if data is None:
        say(f"loading {config.dataset} …")
        data = load_gan_data(config.dataset, config.data_dir, config.limit_train)
    store_config = {
        **dataclasses.asdict(config),
        "mechanism": config.mode,
        "model": "cdcgan" if data.num_classes else "dcgan",
    }
    started = time.time()
    with recorded_run(store, store_config, "gan") as run_id:
        say("training the evaluation classifier (once per run) …")
        scorer = _scorer(config, data) if main else None
        calibrates = config.mode == "dp-gan" and config.noise_multiplier is None
        say("calibrating σ …" if calibrates else "building the models …")
        trainer = GanTrainer(config, data, distributed)
        bar = tqdm(
            total=config.generator_steps,
            disable=not progress,
            unit="G-step",
            dynamic_ncols=True,
            desc=f"{config.mode} {config.dataset}",
        )

        def on_eval(t, score):
            if store:
                store.log_epoch(
                    run_id,
                    t,
                    {
                        "score": score,
                        "sigma": trainer.sigmas[-1],
                        "d_steps": trainer.d_steps,
                        "loss": trainer.losses[-1] if trainer.losses else None,
                    },
                )

        trainer.run(_score_fn(scorer, config, data) if main else None, on_eval, bar)
        bar.close()
        if not main:
            return None
        say(f"final evaluation on {config.final_samples} samples …")
        if config.image_dir:
            image_dir = Path(config.image_dir)
        else:
            root = store.path.parent if store else Path("runs")
            name = f"{config.mode}-{config.dataset}" + (
                f"-seed{config.seed}" if config.seed is not None else ""
            )
            image_dir = root / "gan" / (f"run{run_id}-{name}" if run_id else name)
        score, metrics, images = final_evaluation(trainer, scorer, image_dir)
        record = gan_record(trainer, score, metrics, images, time.time() - started, command)
        if store:
            store.finish(run_id, record)
            record["run_id"] = run_id
        return record
