"""A mechanism declared outside privgrad, in this one file: DP-SGD whose noisy mean is
shrunk by a public factor (post-processing, so its ε is DP-SGD's at the same σ and q).

Register it with ``privgrad.mechanisms.register_mechanism(MECHANISM)``, or name it in the
environment: ``PRIVGRAD_MECHANISMS=python:toy_mechanism:MECHANISM`` (the module on the path).
"""

from dataclasses import dataclass

import torch

from privgrad.mechanisms import Defaults, MechanismSpec, option
from privgrad.mechanisms.base import Mechanism
from privgrad.mechanisms.stages import (
    Capabilities,
    ClipFlat,
    GaussianNoise,
    ScaleByExpectedBatch,
    Stage,
    Sum,
)
from privgrad.validate import Range


class Shrink(Stage):
    """Multiplies the update by a public constant: post-processing, coordinatewise, so the
    canary audit may run it on stacked trials and gradient canaries may be injected."""

    capabilities = Capabilities(coordinatewise=True, trial_stacked=True, injected_canaries=True)

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, state):
        state.grads = [torch.mul(g, self.factor) for g in state.grads]
        return state


@dataclass(frozen=True)
class Options:
    shrink: float = option(0.5, "factor on the noisy mean", range=Range(0, 1, low_open=True))


def build(noise_multiplier, max_grad_norm, shrink=0.5):
    return Mechanism(
        "toy-shrink",
        [
            ClipFlat(max_grad_norm),
            Sum(),
            GaussianNoise(noise_multiplier),
            ScaleByExpectedBatch(),
            Shrink(shrink),
        ],
        "sgd",
        "a test's toy (DP-SGD, Abadi et al. 2016, Alg. 1, then a shrink)",
    )


MECHANISM = MechanismSpec(
    name="toy-shrink",
    build=build,
    options=Options,
    defaults=Defaults(lr=0.5, optimizer="sgd", momentum=0.0, clip=1.0),
    paper="Abadi et al. 2016, Alg. 1 (then post-processing)",
    chain="clip → sum → N(0, σ²C²) → ÷B → ×shrink",
)
