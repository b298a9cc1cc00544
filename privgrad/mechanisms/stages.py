"""Shared stages of a DP training step, chained like Optax gradient transformations.

A step flows through::

    per-sample grads -> [transform] -> clip -> sum -> noise -> [post-process] -> update

Each stage is a small callable ``stage(state) -> state`` on a :class:`StepState`. The
clip stage fixes the sensitivity of the sum; the noise stage draws the only randomness
that protects the data and reports, as a :class:`NoiseRecord`, its effective noise
multiplier (noise std per real coordinate ÷ sensitivity) next to the multiplier the
paper's own analysis would claim. Everything after the noise is post-processing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from privgrad.errors import PrivgradError
from privgrad.per_sample import PerSampleGrads


@dataclass(frozen=True)
class NoiseRecord:
    """What one noise draw guarantees: honest and paper-claimed noise multipliers."""

    effective: float
    claimed: float


@dataclass
class StepState:
    per_sample: PerSampleGrads
    expected_batch_size: float
    generator: torch.Generator
    clip_weights: torch.Tensor | list[torch.Tensor] | None = None
    sensitivity: float | None = None  # L2 bound on one example's effect on the sum
    noise_scale: float | None = None  # the C the paper multiplies σ by
    grads: list[torch.Tensor] | None = None
    noise: list[NoiseRecord] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class NonFiniteGradients(Exception):
    """Raised by a clipping stage, before any noise is drawn or sum reduced, when some
    examples' per-sample gradients are not finite (a NaN, inf or overflowing input).
    ``mask`` (B,) marks them; :class:`~privgrad.private.PrivateTrainer` re-runs the step
    without them, so each contributes zero, a function of that example alone (the sum's
    sensitivity stays C)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__(f"{int(mask.sum())} per-sample gradient(s) are not finite")
        self.mask = mask


def raise_if_not_finite(norms_sq: torch.Tensor) -> None:
    """Raises :class:`NonFiniteGradients` for the examples whose squared norm is not finite."""
    bad = ~torch.isfinite(norms_sq)
    if bool(bad.any()):
        raise NonFiniteGradients(bad)


class Stage:
    """Base class: a stage transforms the state; static facts go into ``describe``."""

    # reads the layer rules' stored inputs and output gradients (a spectral transform), so
    # the sampler must not let rules drop them (GradSampler's ``settle``)
    reads_layer_inputs = False

    def __call__(self, state: StepState) -> StepState:
        raise NotImplementedError

    def describe(self, info: dict) -> None:
        """Update static facts (sensitivity, multipliers) without running a step."""

    def plan(self, trainer, steps: int, target_epsilon: float | None = None) -> None:
        """Learn the run's model and length before the first step (e.g. GIP's k(t), ε₂)."""

    def pure_dp_events(self, steps: int) -> list:
        """(event, count) pairs of σ-independent pure-DP costs over ``steps`` steps."""
        return []

    def state_dict(self) -> dict:
        """What changes from step to step (for checkpoints); most stages keep nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`."""


class NoClip(Stage):
    """Weights every example by 1: only for non-private baselines (ε = ∞)."""

    def __call__(self, state):
        state.clip_weights = torch.ones(state.per_sample.batch_size, device=state.generator.device)
        return state


class ClipFlat(Stage):
    """Eq. (2) of Abadi et al.: g_i / max(1, ‖g_i‖₂ / C) over all parameters at once."""

    def __init__(self, max_grad_norm: float):
        if not max_grad_norm > 0:
            raise PrivgradError(f"the clipping norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm

    def __call__(self, state):
        norms_sq = state.per_sample.norms_sq()
        raise_if_not_finite(norms_sq)
        norms = norms_sq.sqrt()
        state.clip_weights = (self.max_grad_norm / (norms + 1e-12)).clamp(max=1.0)
        state.sensitivity = state.noise_scale = self.max_grad_norm
        return state

    def describe(self, info):
        info["sensitivity"] = info["noise_scale"] = self.max_grad_norm


class ClipPerLayer(Stage):
    """Clip layer l of each sample to c_l. Sensitivity of the sum is √(Σ c_l²).

    ``thresholds=None`` splits a total C as c_l = C/√L (sensitivity C, as in the
    Spectral-DP code); ``literal=True`` clips every layer at C (the papers' text), whose
    sensitivity is C√L while the papers scale the noise by C alone.
    """

    def __init__(self, max_grad_norm: float, literal: bool = False):
        if not max_grad_norm > 0:
            raise PrivgradError(f"the clipping norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm, self.literal = max_grad_norm, literal

    def thresholds(self, n_layers: int) -> list[float]:
        c = self.max_grad_norm if self.literal else self.max_grad_norm / math.sqrt(n_layers)
        return [c] * n_layers

    def __call__(self, state):
        cs = self.thresholds(len(state.per_sample.layers))
        layer_norms_sq = state.per_sample.layer_norms_sq()
        if layer_norms_sq:
            raise_if_not_finite(torch.stack(layer_norms_sq).sum(0))
        state.clip_weights = [
            (c / (n.sqrt() + 1e-12)).clamp(max=1.0) for c, n in zip(cs, layer_norms_sq)
        ]
        state.sensitivity = math.sqrt(sum(c * c for c in cs))
        state.noise_scale = self.max_grad_norm
        return state

    def describe(self, info):
        cs = self.thresholds(info["n_layers"])
        info["sensitivity"] = math.sqrt(sum(c * c for c in cs))
        info["noise_scale"] = self.max_grad_norm


class Sum(Stage):
    """Σ_i w_i g_i: the clipped sum over the (Poisson) batch."""

    def __call__(self, state):
        state.grads = state.per_sample.weighted_sum(state.clip_weights)
        return state


class GaussianNoise(Stage):
    """Adds N(0, σ²C²) to every coordinate of the sum, one draw per step (Abadi et al. Alg. 1)."""

    def __init__(self, noise_multiplier: float):
        if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
            raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
        self.noise_multiplier = noise_multiplier

    def std(self, noise_scale: float) -> float:
        return self.noise_multiplier * noise_scale

    def __call__(self, state):
        std = self.std(state.noise_scale)
        state.grads = [
            g
            + std * torch.randn(g.shape, generator=state.generator, dtype=g.dtype, device=g.device)
            for g in state.grads
        ]
        state.noise.append(self.record(std, state.sensitivity))
        return state

    def record(self, std: float, sensitivity: float) -> NoiseRecord:
        return NoiseRecord(effective=std / sensitivity, claimed=self.noise_multiplier)

    def describe(self, info):
        info["noise"] = self.record(self.std(info["noise_scale"]), info["sensitivity"])


class GaussianNoiseOnAverage(GaussianNoise):
    """Literal Ghosh & Das Alg. 3: N(0, σ²C²) on the *average* (1/B)Σ ḡ_i.

    The average has sensitivity C/B, so the effective multiplier is B·σ (over-private);
    the paper's analysis credits σ.
    """

    def __call__(self, state):
        state.grads = [g / state.expected_batch_size for g in state.grads]
        std = self.std(state.noise_scale)
        state.grads = [
            g
            + std * torch.randn(g.shape, generator=state.generator, dtype=g.dtype, device=g.device)
            for g in state.grads
        ]
        state.noise.append(self.record(std, state.sensitivity / state.expected_batch_size))
        return state

    def describe(self, info):
        info["noise"] = self.record(
            self.std(info["noise_scale"]), info["sensitivity"] / info["expected_batch_size"]
        )


class ScaleByExpectedBatch(Stage):
    """Divides by the expected batch size qN, a public constant (never the actual size)."""

    def __call__(self, state):
        state.grads = [g / state.expected_batch_size for g in state.grads]
        return state


class Sign(Stage):
    """Keeps only the sign of each noisy coordinate (post-processing)."""

    def __call__(self, state):
        state.grads = [torch.sign(g) for g in state.grads]
        return state
