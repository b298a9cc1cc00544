"""A mechanism is a named chain of stages plus the optimizer that post-processes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from privgrad.errors import PrivgradError
from privgrad.per_sample import PerSampleGrads
from privgrad.per_sample.rules import float32_arithmetic
from privgrad.mechanisms.stages import (
    GaussianNoise,
    NoiseRecord,
    PlanContext,
    Stage,
    StepFacts,
    StepState,
    Sum,
    capabilities_of,
)


@dataclass
class Mechanism:
    name: str
    stages: list[Stage]
    optimizer: str = "sgd"  # default optimizer (post-processing of the noisy update)
    paper: str = "Abadi et al. 2016"

    @property
    def reads_layer_inputs(self) -> bool:
        return any(capabilities_of(stage).reads_layer_inputs for stage in self.stages)

    @property
    def noise_stages(self) -> list[Stage]:
        """The stages that draw noise (declared ``Capabilities(noise=True)``)."""
        return [s for s in self.stages if capabilities_of(s).noise]

    @property
    def clip_norm(self) -> float | None:
        """C of the first clipping stage (declared ``Capabilities(clips=True)``), or None."""
        clips = [s for s in self.stages if capabilities_of(s).clips]
        return float(clips[0].max_grad_norm) if clips else None

    @property
    def noise_stage(self) -> GaussianNoise | None:
        found = [s for s in self.stages if isinstance(s, GaussianNoise)]
        return found[0] if found else None

    @property
    def noise_multiplier(self) -> float:
        return self.noise_stage.noise_multiplier if self.noise_stage else 0.0

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        if self.noise_stage is None:
            if value:
                raise PrivgradError(
                    f"mechanism '{self.name}' adds no noise; its noise multiplier is 0"
                )
            return
        self.noise_stage.noise_multiplier = value

    def privatize(
        self,
        per_sample: PerSampleGrads,
        expected_batch_size: float,
        generator: torch.Generator,
        reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> tuple[list[torch.Tensor], list[NoiseRecord], StepFacts]:
        """Runs the chain; returns the update (aligned with ``per_sample.params``),
        the noise records of this step and the other facts the stages reported
        (:class:`~privgrad.mechanisms.stages.StepFacts`: pure-DP events, mask, …).

        ``reduce`` (data-parallel training) maps this process's batch sum to the sum over
        all processes; it runs right after every :class:`Sum` stage, so the stages after
        it see the global sum. The chain's arithmetic is float32 on CUDA whatever the TF32
        settings (:func:`~privgrad.per_sample.rules.float32_arithmetic`)."""
        state = StepState(per_sample, expected_batch_size, generator)
        with float32_arithmetic(per_sample.flags.float32_guard):
            for stage in self.stages:
                state = stage(state)
                if reduce is not None and isinstance(stage, Sum):
                    state.grads = reduce(state.grads)
        return state.grads, state.noise, state.facts()

    def state_dict(self) -> dict:
        """Name, σ and the stages' step state (e.g. GIP's step counter), for checkpoints."""
        return {
            "name": self.name,
            "noise_multiplier": self.noise_multiplier,
            "stages": [stage.state_dict() for stage in self.stages],
        }

    def check_state_dict(self, state: dict) -> None:
        if (state.get("name"), state.get("noise_multiplier")) != (
            self.name,
            self.noise_multiplier,
        ) or len(state.get("stages", ())) != len(self.stages):
            raise PrivgradError(
                f"the saved mechanism ({state.get('name')}, σ = {state.get('noise_multiplier')}) "
                f"is not this one ({self.name}, σ = {self.noise_multiplier})"
            )

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        for stage, saved in zip(self.stages, state["stages"]):
            stage.load_state_dict(saved)

    def plan(self, context: PlanContext) -> None:
        """Lets every stage learn the run (:class:`~privgrad.mechanisms.stages.PlanContext`)
        before the first step."""
        for stage in self.stages:
            stage.plan(context)

    def pure_dp_events(self, steps: int) -> list:
        return [e for stage in self.stages for e in stage.pure_dp_events(steps)]

    def describe(self, n_layers: int, expected_batch_size: float = 1.0) -> dict:
        """Static facts of one step: sensitivity and the noise record, without data."""
        info = {"n_layers": n_layers, "expected_batch_size": expected_batch_size}
        for stage in self.stages:
            stage.describe(info)
        return info

    def noise_record(self, n_layers: int, expected_batch_size: float = 1.0) -> NoiseRecord:
        return self.describe(n_layers, expected_batch_size).get("noise", NoiseRecord(0.0, 0.0))

    def effective_factor(
        self, n_layers: int, expected_batch_size: float = 1.0
    ) -> tuple[float, float]:
        """(σ_eff/σ, σ_claimed/σ): both are linear in the nominal σ."""
        saved = self.noise_multiplier
        self.noise_multiplier = 1.0
        rec = self.noise_record(n_layers, expected_batch_size)
        self.noise_multiplier = saved
        return rec.effective, rec.claimed
