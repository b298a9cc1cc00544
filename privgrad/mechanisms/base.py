"""A mechanism is a named chain of stages plus the optimizer that post-processes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.per_sample import PerSampleGrads
from privgrad.per_sample.rules import float32_arithmetic
from privgrad.mechanisms.stages import (
    GaussianNoise,
    NoiseRecord,
    NonFiniteGradients,
    PlanContext,
    Stage,
    StepFacts,
    StepState,
    capabilities_of,
    run_stages,
)


@dataclass
class Mechanism:
    name: str
    stages: list[Stage]
    optimizer: str = "sgd"  # default optimizer (post-processing of the noisy update)
    paper: str = "Abadi et al. 2016"

    def __post_init__(self):
        self.check_chain()

    def check_chain(self) -> None:
        """Refuses (one line) a chain whose noise would not cover what it releases: more than one
        noise stage, or one that is not a :class:`GaussianNoise` (calibration sets its σ and the
        accountant reads its record as a Gaussian's), or a :class:`GaussianNoise` not declared
        ``noise`` (calibration and the accountant would find it, these checks and the sealing of
        :func:`~privgrad.mechanisms.stages.run_stages` would not); noise before the last summing
        stage (it would be drawn on no sum: the release is noiseless); no clipping stage before that
        sum (nothing bounds one example); or, between the sum and the noise, a stage not declared
        ``keeps_sum`` (a sign of the clean sum moves by up to 2√d, not by the clip's C); or a stage
        declared ``per_sample`` or ``clips`` after the noise (at run time, every stage there sees
        the per-example data sealed: :func:`~privgrad.mechanisms.stages.run_stages`). The order of
        stages is the contract of :mod:`privgrad.mechanisms.stages`: per-sample stages, the sum, the
        noise, then post-processing."""
        caps = [capabilities_of(stage) for stage in self.stages]
        name = lambda i: type(self.stages[i]).__name__  # noqa: E731
        where = f"mechanism '{self.name}'"
        quiet = [
            i
            for i, s in enumerate(self.stages)
            if isinstance(s, GaussianNoise) and not caps[i].noise
        ]
        if quiet:
            raise PrivgradError(
                f"{where}: its stage {name(quiet[0])} is a GaussianNoise but its capabilities do "
                "not declare noise=True, so the chain's order would go unchecked and the stages "
                "after it would see the examples: declare Capabilities(noise=True, ...)"
            )
        noise = [i for i, c in enumerate(caps) if c.noise]
        if not noise:
            return
        if len(noise) > 1:
            raise PrivgradError(
                f"{where} has {len(noise)} noise stages ({', '.join(map(name, noise))}); "
                "privgrad calibrates and accounts one per chain"
            )
        (at,) = noise
        if not isinstance(self.stages[at], GaussianNoise):
            raise PrivgradError(
                f"{where}: its noise stage {name(at)} does not subclass GaussianNoise, whose σ "
                "calibration sets and whose record the accountant reads as a Gaussian's"
            )
        sums = [i for i, c in enumerate(caps) if c.sums and i < at]
        if not sums or any(c.sums for c in caps[at:]):
            raise PrivgradError(
                f"{where}: its noise stage {name(at)} must follow the sum over the batch "
                "(a summing stage such as Sum) and precede every other one: noise drawn "
                "before the sum never reaches the released update"
            )
        if not any(c.clips for c in caps[: sums[-1]]):
            raise PrivgradError(
                f"{where}: no clipping stage comes before its sum ({name(sums[-1])}), so "
                "nothing bounds one example's effect on it"
            )
        clip = max(i for i in range(sums[-1]) if caps[i].clips)
        if clip + 1 < sums[-1]:
            raise PrivgradError(
                f"{where}: its stage {name(clip + 1)} runs between the clipping stage "
                f"{name(clip)} and the sum ({name(sums[-1])}), where a change to the clipped "
                "examples (a rescaling of state.clip_weights) alters the bound the clipping "
                "stage reports, which the accountant assumes; put it before the clipping stage"
            )
        late = [i for i in range(at + 1, len(caps)) if caps[i].per_sample or caps[i].clips]
        if late:
            raise PrivgradError(
                f"{where}: its stage {name(late[0])} acts on per-sample gradients but comes "
                f"after the noise stage {name(at)}, which protects only the sum: put it before "
                "the sum"
            )
        between = [i for i in range(sums[-1] + 1, at) if not caps[i].keeps_sum]
        if between:
            raise PrivgradError(
                f"{where}: its stage {name(between[0])} runs between the sum and the noise, "
                "where a change to the sum (a sign, a rescaling) alters how far one example "
                "moves it, while the accountant assumes the clipping stage's bound; put it "
                "after the noise (post-processing), or declare Capabilities(keeps_sum=True) "
                "if it only reads the sum"
            )

    @property
    def reads_layer_inputs(self) -> bool:
        return any(capabilities_of(stage).reads_layer_inputs for stage in self.stages)

    @property
    def graph_safe(self) -> bool:
        """Whether every stage is declared ``graph_safe``: one CUDA graph replays the chain."""
        return all(capabilities_of(stage).graph_safe for stage in self.stages)

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
        all processes; it runs right after every summing stage (:class:`Sum`,
        ``Capabilities.sums``), so the stages after it see the global sum. The chain's
        arithmetic is float32 on CUDA whatever the TF32 settings
        (:func:`~privgrad.per_sample.rules.float32_arithmetic`)."""
        state = self.run(StepState(per_sample, expected_batch_size, generator), reduce)
        return state.grads, state.noise, state.facts()

    def run(
        self,
        state: StepState,
        reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> StepState:
        """The chain on ``state``, as :meth:`privatize` runs it; returns the final state
        (the captured step reads its ``nonfinite`` too). The chain is checked again first
        (:meth:`check_chain`): its list of stages may have changed since it was built."""
        self.check_chain()
        with float32_arithmetic(state.per_sample.flags.float32_guard):
            return run_stages(self.stages, state, reduce)

    def chunk_split(self) -> int:
        """Where the chain splits for physical micro-batches: the number of stages run on each
        chunk of the batch, the summing stage included (the rest run once, on the sum).
        Refuses (one line) a chain whose stages before the sum are not all declared
        ``per_example`` or that acts on per-sample gradients after it: those need the whole
        batch at once (e.g. GIP's prune-then-clip masks every example by the batch's sum)."""
        caps = [capabilities_of(stage) for stage in self.stages]
        split = next((i + 1 for i, c in enumerate(caps) if c.sums), None)
        why = None
        if split is None:
            why = "it has no summing stage"
        else:
            before = [s for s, c in zip(self.stages[: split - 1], caps) if not c.per_example]
            after = [s for s, c in zip(self.stages[split:], caps[split:]) if c.per_sample]
            if before:
                why = (
                    f"its stage {type(before[0]).__name__} runs before the sum and is not "
                    "declared per-example (it may need the whole batch)"
                )
            elif after:
                why = (
                    f"its stage {type(after[0]).__name__} works on each example's gradient after "
                    f"the batch is first summed ({type(self.stages[split - 1]).__name__}), so "
                    "it needs the whole batch at once"
                )
        if why:
            raise PrivgradError(
                f"mechanism '{self.name}' cannot step on a batch in physical micro-batches: "
                f"{why}; leave max_physical_batch_size (--physical-batch-size) unset"
            )
        return split

    def privatize_chunks(
        self,
        chunks: Iterable[Callable[[], PerSampleGrads]],
        expected_batch_size: float,
        generator: torch.Generator,
        reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> tuple[list[nn.Parameter], list[torch.Tensor], list[NoiseRecord], StepFacts]:
        """:meth:`privatize` on a batch given in chunks (physical micro-batches): each of
        ``chunks`` computes one chunk's per-sample gradients when called
        (:class:`ChunkedChain`). Non-finite per-sample gradients: every chunk is still looked
        at, then :class:`NonFiniteGradients` is raised with the mask over the whole batch,
        before any noise is drawn."""
        chain, masks = ChunkedChain(self, expected_batch_size, generator), []
        for compute in chunks:
            try:
                masks.append(chain.add(compute))
            except NonFiniteGradients as err:
                masks.append(err.mask)
        if any(isinstance(m, torch.Tensor) for m in masks):
            device = next(m.device for m in masks if isinstance(m, torch.Tensor))
            raise NonFiniteGradients(
                torch.cat(
                    [
                        m
                        if isinstance(m, torch.Tensor)
                        else torch.zeros(m, dtype=torch.bool, device=device)
                        for m in masks
                    ]
                )
            )
        return chain.finish(reduce)

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


class ChunkedChain:
    """A mechanism's chain on a batch given chunk by chunk (physical micro-batches, the
    trainer's or the own loop's): the stages up to the sum (:meth:`Mechanism.chunk_split`)
    run on each chunk as it comes and the chunks' sums are added; :meth:`finish` runs the
    rest (noise, post-processing, ``reduce``) once, so the step's noise and privacy events
    are those of the whole batch. A chunk's per-sample gradients are let go before the next
    is computed."""

    def __init__(self, mechanism: Mechanism, expected_batch_size: float, generator):
        mechanism.check_chain()  # its stages may have changed since it was built
        split = mechanism.chunk_split()
        self.head, self.tail = mechanism.stages[:split], mechanism.stages[split:]
        self.expected_batch_size, self.generator = expected_batch_size, generator
        self.total: list[torch.Tensor] | None = None
        self.state: StepState | None = None  # the last chunk's, for the stages after the sum

    def add(self, compute: Callable[[], PerSampleGrads]) -> int:
        """Computes a chunk's per-sample gradients (``compute()``), runs the stages up to the
        sum on them and adds the chunk's sum; returns its number of examples. Raises
        :class:`NonFiniteGradients` (the chunk's mask) for a chunk with a non-finite
        per-sample gradient, adding nothing."""
        self.release()  # the previous chunk's per-sample gradients go before the next comes
        per_sample = compute()
        state = StepState(per_sample, self.expected_batch_size, self.generator)
        del per_sample
        with float32_arithmetic(state.per_sample.flags.float32_guard):
            state = run_stages(self.head, state)
        self.total = (
            [g.clone() for g in state.grads]  # a copy: a stage's sum may live in a buffer
            if self.total is None
            else [a.add_(b) for a, b in zip(self.total, state.grads)]
        )
        state.grads, self.state = None, state
        return state.per_sample.batch_size

    def release(self) -> None:
        """Lets the last chunk's per-sample gradients go: :meth:`finish` reads those of the
        chunk added last (the stages after the sum may read its layers: spectra), so a caller
        that runs other work between a chunk that is not the last and the next (the own
        loop's forward and backward) releases them first."""
        self.state = None

    def finish(
        self, reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    ) -> tuple[list[nn.Parameter], list[torch.Tensor], list[NoiseRecord], StepFacts]:
        """The stages after the sum, once, on the chunks' sum (``reduce`` first: data-parallel
        training); returns the parameters, the update, the noise records and the facts (those
        the per-sample stages reported: the last chunk's)."""
        state = self.state
        if state is None:
            raise PrivgradError("a chunked step needs at least one chunk")
        state.grads = self.total
        with float32_arithmetic(state.per_sample.flags.float32_guard):
            if reduce is not None:
                state.grads = reduce(state.grads)
            state = run_stages(self.tail, state)  # no summing stage there (chunk_split)
        return state.per_sample.params, state.grads, state.noise, state.facts()
