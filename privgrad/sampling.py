"""Poisson subsampling, the sampling the accountant assumes.

Each of the N training examples joins a step's batch independently with probability
q = B/N (B the expected batch size), so batch sizes follow Binomial(N, q) and an empty
batch is a valid step. The sampler is also the one place that wraps a step's noise
event in ``PoissonSampledDpEvent``, so the sampling that ran and the sampling that is
accounted cannot drift apart (trust checklist item 1). Its whole state (the RNG and the
number of draws) is in :meth:`PoissonSampler.state_dict`, for exact checkpoint/resume.
"""

from __future__ import annotations

import math

import torch

from privgrad.accounting import poisson_gaussian_event
from privgrad.errors import PrivgradError

RAND_LEVELS = 2**24  # the values of a float32 torch.rand


class PoissonSampler:
    def __init__(self, dataset_size: int, expected_batch_size: float, generator: torch.Generator):
        if dataset_size <= 0:
            raise PrivgradError("the training set is empty")
        if not 0 < expected_batch_size <= dataset_size:
            raise PrivgradError(
                f"the expected batch size must lie in (0, {dataset_size}] "
                f"(the training set size), got {expected_batch_size}"
            )
        self.dataset_size = dataset_size
        self.expected_batch_size = float(expected_batch_size)
        self.sampling_rate = expected_batch_size / dataset_size
        # torch.rand's float32 values are k/2^24 (k = 0 … 2^24 − 1): an example joins when its
        # value is below ⌊q·2^24⌋/2^24, a probability of at most q (compared with q itself,
        # rounded to float32, ⌈q·2^24⌉ values pass: a hair above q)
        self.inclusion_threshold = math.floor(self.sampling_rate * RAND_LEVELS) / RAND_LEVELS
        if self.inclusion_threshold == 0:
            raise PrivgradError(
                f"the sampling rate q = {self.sampling_rate:.3g} is below 2^-24, the finest "
                "rate the sampler draws at: no example would ever join a batch; use a larger "
                "expected batch size"
            )
        self.generator = generator
        self.draws = 0

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1 / self.sampling_rate))

    def sample(self) -> torch.Tensor:
        """Indices of one batch: each example independently with probability q."""
        keep = torch.rand(self.dataset_size, generator=self.generator) < self.inclusion_threshold
        self.draws += 1
        return keep.nonzero().flatten()

    def state_dict(self) -> dict:
        return {
            "dataset_size": self.dataset_size,
            "expected_batch_size": self.expected_batch_size,
            "draws": self.draws,
            "generator": self.generator.get_state(),
        }

    def check_state_dict(self, state: dict) -> None:
        """Refuses a state of another sampler (other N or expected batch size)."""
        for key in ("dataset_size", "expected_batch_size"):
            if state.get(key) != getattr(self, key):
                raise PrivgradError(
                    f"the sampler state is for {key} = {state.get(key)}, "
                    f"this sampler has {getattr(self, key)}"
                )
        saved = state.get("generator")
        if not (
            isinstance(saved, torch.Tensor) and saved.shape == self.generator.get_state().shape
        ):
            raise PrivgradError("the sampler state has no RNG state of this sampler's generator")

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        self.generator.set_state(state["generator"])
        self.draws = state["draws"]

    def event(self, noise_multiplier: float):
        """The dp-accounting event of one step of this sampler with a Gaussian release."""
        return poisson_gaussian_event(self.sampling_rate, noise_multiplier)
