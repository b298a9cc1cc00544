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

Each is declared in one file of :mod:`privgrad.mechanisms.catalog` and found through
:mod:`privgrad.mechanisms.registry` (which imports no torch); the stages and
:class:`Mechanism` are imported on first use, so that the command line's help stays light.
"""

from __future__ import annotations

import importlib

from privgrad.mechanisms.registry import (
    MECHANISMS,
    Defaults,
    MechanismSpec,
    build_mechanism,
    mechanism_spec,
    mechanism_specs,
    option,
    option_flag,
    register_mechanism,
)

# name -> (module, attribute): imported on first use (they import torch)
_LAZY = {
    "Mechanism": ("privgrad.mechanisms.base", "Mechanism"),
    "Stage": ("privgrad.mechanisms.stages", "Stage"),
    "StepState": ("privgrad.mechanisms.stages", "StepState"),
    "NoiseRecord": ("privgrad.mechanisms.stages", "NoiseRecord"),
    "ClipFlat": ("privgrad.mechanisms.stages", "ClipFlat"),
    "ClipPerLayer": ("privgrad.mechanisms.stages", "ClipPerLayer"),
    "GaussianNoise": ("privgrad.mechanisms.stages", "GaussianNoise"),
    "ScaleByExpectedBatch": ("privgrad.mechanisms.stages", "ScaleByExpectedBatch"),
    "Sign": ("privgrad.mechanisms.stages", "Sign"),
    "Sum": ("privgrad.mechanisms.stages", "Sum"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'privgrad.mechanisms' has no attribute {name!r}")


__all__ = [
    "Mechanism",
    "MechanismSpec",
    "Defaults",
    "option",
    "MECHANISMS",
    "build_mechanism",
    "mechanism_spec",
    "mechanism_specs",
    "option_flag",
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
