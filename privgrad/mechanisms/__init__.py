"""DP mechanisms as short compositions of shared stages.

=============  ==========================================================  =========
name           chain                                                        optimizer
=============  ==========================================================  =========
non-private    sum → ÷B (no clipping, no noise: ε = ∞)                      sgd
dpsgd          clip → sum → N(0, σ²C²) → ÷B  (Abadi et al. 2016, Alg. 1)     sgd
dp-adam        as dpsgd                                                     adam
dp-signsgd     clip → sum → N(0, σ²C²) → sign  (Ghosh & Das, Alg. 3)        sgd
dp-signadam    clip → sum → N(0, σ²C²) → sign → Adam moments (Alg. 4)       adam
               (variant alg2: … → ÷B → Adam moments → sign)                 sign-adam
spectral-dp    FFT → clip/layer → sum → Re, Im ~ N(0, σ²C²) → low-pass     sgd
               → Re(iFFT) → crop → ÷B  (Feng et al. 2023, Algs. 2–4)
gredp          FFT → clip/layer → sum → CN(0, σ²C²) → Re(iFFT) → crop      sgd
               → ÷B  (Wang et al., Alg. 2; honest σ_eff = σ/√2)
gip            clip → sum → private top-k mask (Mallows, pure ε-DP) →       sgd
               N(0, σ²C²) → ⊙ mask → ÷B  (GIP, Alg. 1–2, Eq. 11)
random-k       as gip with a fresh uniform mask (no privacy cost; Prop. 1)  sgd
=============  ==========================================================  =========
"""

from __future__ import annotations

import inspect
from typing import Callable

from privgrad.errors import PrivgradError
from privgrad.mechanisms.base import Mechanism
from privgrad.mechanisms.stages import (
    ClipFlat,
    ClipPerLayer,
    GaussianNoise,
    GaussianNoiseOnAverage,
    NoClip,
    NoiseRecord,
    ScaleByExpectedBatch,
    Sign,
    Stage,
    StepState,
    Sum,
)
from privgrad.mechanisms.spectral import gredp, spectral_dp
from privgrad.mechanisms.gip import (
    gip as gip_mechanism,
    random_k,
)  # keeps privgrad.mechanisms.gip the module


def non_private(noise_multiplier=0.0, max_grad_norm=1.0):
    return Mechanism("non-private", [NoClip(), Sum(), ScaleByExpectedBatch()], "sgd", "none")


def dpsgd(noise_multiplier, max_grad_norm):
    return Mechanism(
        "dpsgd",
        [ClipFlat(max_grad_norm), Sum(), GaussianNoise(noise_multiplier), ScaleByExpectedBatch()],
    )


def dp_adam(noise_multiplier, max_grad_norm):
    m = dpsgd(noise_multiplier, max_grad_norm)
    m.name, m.optimizer = "dp-adam", "adam"
    return m


def dp_signsgd(noise_multiplier, max_grad_norm, noise_on="sum"):
    """Alg. 3. ``noise_on='average'`` is the literal Alg. 3 (noise σC on the mean), accounted
    at its true multiplier B·σ; the default puts it on the sum, as Eq. 8 and Theorem 5 do."""
    noise = {"sum": GaussianNoise, "average": GaussianNoiseOnAverage}.get(noise_on)
    if noise is None:
        raise PrivgradError(f"--noise-on must be 'sum' or 'average', got '{noise_on}'")
    return Mechanism(
        "dp-signsgd",
        [ClipFlat(max_grad_norm), Sum(), noise(noise_multiplier), Sign()],
        "sgd",
        "Ghosh & Das, Alg. 3",
    )


def dp_signadam(noise_multiplier, max_grad_norm, variant="alg4"):
    """Alg. 4 (sign of the noisy sum, then Adam moments; no final sign) or ``variant='alg2'``
    (DP-Adam moments of the noisy mean, then the sign of the Adam step)."""
    if variant == "alg4":
        return Mechanism(
            "dp-signadam",
            [ClipFlat(max_grad_norm), Sum(), GaussianNoise(noise_multiplier), Sign()],
            "adam",
            "Ghosh & Das, Alg. 4",
        )
    if variant == "alg2":
        return Mechanism(
            "dp-signadam",
            [
                ClipFlat(max_grad_norm),
                Sum(),
                GaussianNoise(noise_multiplier),
                ScaleByExpectedBatch(),
            ],
            "sign-adam",
            "Ghosh & Das, Alg. 2",
        )
    raise PrivgradError(f"--signadam-variant must be 'alg4' or 'alg2', got '{variant}'")


MECHANISMS: dict[str, Callable[..., Mechanism]] = {
    "non-private": non_private,
    "dpsgd": dpsgd,
    "dp-adam": dp_adam,
    "dp-signsgd": dp_signsgd,
    "dp-signadam": dp_signadam,
    "spectral-dp": spectral_dp,
    "gredp": gredp,
    "gip": gip_mechanism,
    "random-k": random_k,
}


# options whose ``privgrad train`` flag is not their parameter name
OPTION_FLAGS = {"k_end": "--keep-ratio", "noise": "--noise-type", "variant": "--signadam-variant"}


def option_flag(name: str) -> str:
    """The command-line flag of mechanism option ``name``."""
    return OPTION_FLAGS.get(name, "--" + name.replace("_", "-"))


def build_mechanism(
    name: str, noise_multiplier: float = 0.0, max_grad_norm: float = 1.0, **options
) -> Mechanism:
    """Builds a mechanism; an option it does not use is an error, never silently ignored."""
    if name not in MECHANISMS:
        raise PrivgradError(f"unknown mechanism '{name}'; choose from: {', '.join(MECHANISMS)}")
    factory = MECHANISMS[name]
    accepted = set(inspect.signature(factory).parameters)
    options = {k: v for k, v in options.items() if v is not None}
    unused = sorted(set(options) - accepted)
    if unused:
        raise PrivgradError(
            f"mechanism '{name}' does not use option(s) {', '.join(option_flag(u) for u in unused)}"
        )
    return factory(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **options)


def register_mechanism(name: str, factory: Callable[..., Mechanism]) -> None:
    MECHANISMS[name] = factory


__all__ = [
    "Mechanism",
    "MECHANISMS",
    "build_mechanism",
    "register_mechanism",
    "Stage",
    "StepState",
    "NoiseRecord",
    "ClipFlat",
    "ClipPerLayer",
    "GaussianNoise",
    "ScaleByExpectedBatch",
    "Sign",
    "Sum",
]
