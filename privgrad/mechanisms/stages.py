"""Shared stages of a DP training step, chained like Optax gradient transformations.

A step flows through::

    per-sample grads -> [transform] -> clip -> sum -> noise -> [post-process] -> update

Each stage is a small callable ``stage(state) -> state`` on a :class:`StepState`. The
clip stage fixes the sensitivity of the sum; the noise stage draws the only randomness
that protects the data and reports, as a :class:`NoiseRecord`, its effective noise
multiplier (noise std per real coordinate ÷ sensitivity) next to the multiplier the
paper's own analysis would claim. Everything after the noise is post-processing. The chain
splits at the sum (``Capabilities.sums``): the stages before it act on each example, those
after it run once per step, on the sum (all-reduced across data-parallel ranks, added up
over physical micro-batches).

The contract: a stage subclasses :class:`Stage` (its step is abstract), declares what it
does in a class attribute ``capabilities`` (:class:`Capabilities`, read through
:func:`capabilities_of`), reads and writes the typed fields of :class:`StepState`, and
learns the run before its first step from a frozen :class:`PlanContext`. The noise stage
and the stages after it see no per-example data (:func:`run_stages` seals it).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from privgrad.errors import PrivgradError
from privgrad.per_sample import PerSampleGrads


@dataclass(frozen=True)
class NoiseRecord:
    """What one noise draw guarantees: honest and paper-claimed noise multipliers."""

    effective: float
    claimed: float


@dataclass
class StepState:
    """What flows through the chain in one step. The built-in stages' facts are typed
    fields; ``extra`` is free-form, for stages defined outside privgrad."""

    per_sample: PerSampleGrads
    expected_batch_size: float
    generator: torch.Generator
    clip_weights: torch.Tensor | list[torch.Tensor] | None = None
    sensitivity: float | None = None  # L2 bound on one example's effect on the sum
    noise_scale: float | None = None  # the C the paper multiplies σ by
    grads: list[torch.Tensor] | None = None
    noise: list[NoiseRecord] = field(default_factory=list)
    # σ-independent pure-DP events of this step (GIP's index selection), honest and claimed
    pure_events: list = field(default_factory=list)
    claimed_pure_events: list = field(default_factory=list)
    mask: list[torch.Tensor] | None = None  # coordinates kept (GIP, random-k); None: all
    index_selection: dict | None = None  # what GIP's / random-k's selection did this step
    spectral_layers: int | None = None  # layers a spectral transform turned into spectra
    extra: dict = field(default_factory=dict)
    # False: a clipping stage records its non-finite examples in ``nonfinite`` for the caller
    # to read after the chain, instead of raising (the captured step: no host read in it)
    raise_nonfinite: bool = True
    nonfinite: torch.Tensor | None = None

    def check_finite(self, norms_sq: torch.Tensor) -> None:
        """Raises :class:`NonFiniteGradients` for the examples whose squared norm is not
        finite; with ``raise_nonfinite=False`` marks them in :attr:`nonfinite` instead."""
        bad = ~torch.isfinite(norms_sq)
        if self.raise_nonfinite:
            if bool(bad.any()):
                raise NonFiniteGradients(bad)
            return
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad

    def facts(self) -> StepFacts:
        return StepFacts(
            list(self.pure_events),
            list(self.claimed_pure_events),
            self.mask,
            self.index_selection,
            self.spectral_layers,
            dict(self.extra),
        )


@dataclass(frozen=True)
class StepFacts:
    """What a step reported besides its update and noise records (third item of
    :meth:`~privgrad.mechanisms.base.Mechanism.privatize`): the :class:`StepState` fields
    of the same names, frozen at the end of the step."""

    pure_events: list = field(default_factory=list)
    claimed_pure_events: list = field(default_factory=list)
    mask: list[torch.Tensor] | None = None
    index_selection: dict | None = None
    spectral_layers: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a stage declares about itself (class attribute ``capabilities``), read by the
    trainer, the sampler and the audits instead of probing its attributes.

    per_sample: acts on the per-sample gradients (before the sum); else on the sum.
    sums: forms the sum over the batch's examples (:class:`Sum`), where the chain splits:
        stages before it act per sample, those after it run once on the sum (data-parallel
        sums are all-reduced right after it; physical micro-batches are added up there).
    per_example: a per-sample stage whose result for an example depends on that example
        alone (and on public facts), so the stages before the sum may run on a chunk of
        the batch at a time (physical micro-batches, :meth:`Mechanism.chunk_split
        <privgrad.mechanisms.base.Mechanism.chunk_split>`).
    reads_layer_inputs: reads the layer rules' stored inputs and output gradients (a
        spectral transform), so the sampler must keep them.
    coordinatewise: acts on each coordinate of the update on its own (post-processing).
    noise: draws the Gaussian noise a :class:`NoiseRecord` describes (has a σ).
    clips: bounds each example's contribution at ``max_grad_norm`` (the C of the run).
    trial_shared: deterministic and data-independent in its randomness: the canary audit
        runs it once for all trials (stages before the first noise stage).
    trial_stacked: acts on each row of a leading trial dimension on its own: the canary
        audit runs it on a stack of trials (stages from the first noise stage on).
    injected_canaries: sees per-sample gradients only through the LayerGrads interface,
        so gradient canaries injected as materialised gradients take its real path.
    keeps_sum: reads the sum without changing it (GIP's and Random-k's index selection), so
        it may run between the sum and the noise; any other stage there would change what
        one example can move (a sign of the clean sum), while the accountant assumes the
        clipping stage's sensitivity (:meth:`Mechanism.check_chain
        <privgrad.mechanisms.base.Mechanism.check_chain>`). :func:`run_stages` refuses a step
        where such a stage replaced the sum's tensors or changed one in place.
    graph_safe: launches the same device work at every step, reads nothing back to the
        host (its finite check goes through :meth:`StepState.check_finite`), keeps no state
        between steps and reports the same noise records and facts at every step, so one
        CUDA graph of it replays it (:mod:`privgrad.graphed`).
    """

    per_sample: bool = False
    sums: bool = False
    per_example: bool = False
    reads_layer_inputs: bool = False
    coordinatewise: bool = False
    noise: bool = False
    clips: bool = False
    trial_shared: bool = False
    trial_stacked: bool = False
    injected_canaries: bool = False
    keeps_sum: bool = False
    graph_safe: bool = False


# claims about what a stage's step does, not kept by a subclass with its own step
_ONLY_IF_OWN_CALL = (
    "trial_shared",
    "trial_stacked",
    "injected_canaries",
    "per_example",
    "keeps_sum",
    "graph_safe",
)


def capabilities_of(stage) -> Capabilities:
    """The capabilities ``stage``'s class declares. A subclass that declares none inherits
    its base's, except the audit ones and ``per_example`` when it overrides ``__call__`` or a
    noise stage's ``standard_noise`` (its step differs). Capabilities set on the instance are
    refused (they would be ignored)."""
    cls = type(stage)
    if "capabilities" in getattr(stage, "__dict__", {}):
        raise PrivgradError(
            f"stage {cls.__name__} sets capabilities on the instance (self.capabilities), which "
            "privgrad does not read: declare them on its class, "
            "capabilities = Capabilities(...)"
        )
    for i, klass in enumerate(cls.__mro__):
        caps = klass.__dict__.get("capabilities")
        if caps is None:
            continue
        if any(m in c.__dict__ for c in cls.__mro__[:i] for m in ("__call__", "standard_noise")):
            caps = dataclasses.replace(caps, **dict.fromkeys(_ONLY_IF_OWN_CALL, False))
        return caps
    return Capabilities()


def run_stages(
    stages,
    state: StepState,
    reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> StepState:
    """Runs ``stages`` on ``state`` in order, ``reduce`` right after each summing stage
    (data-parallel training). The noise stage and every stage after it (post-processing) see
    the state sealed: ``per_sample`` as a :class:`ReleasedPerSample` and the per-example
    fields (:data:`PER_EXAMPLE_FIELDS`) refusing any use, since the noise protects only the
    sum it is added to (a noise stage that went on to divide by the drawn batch's size
    released that size unprotected). The state comes back whole."""
    released = False
    generator = state.generator
    # a CUDA generator's seed cannot be read while a graph is captured: the captured step's
    # eager warm-up runs the same stages and checks it (privgrad.graphed)
    capturing = generator.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    seed = None if capturing else generator.initial_seed()
    for stage in stages:
        caps = capabilities_of(stage)
        name = type(stage).__name__
        if released:
            state = _sealed_call(stage, state, f"stage {name} runs after the noise", True)
        else:
            if caps.noise:
                state = _sealed_call(stage, state, f"stage {name} draws the noise")
            elif caps.keeps_sum:
                state = _sum_keeping_call(stage, state, name)
            else:
                state = stage(state)
            if state.generator is not generator or (
                seed is not None and generator.initial_seed() != seed
            ):
                raise PrivgradError(
                    f"stage {name} reseeded or replaced the noise generator (state.generator): "
                    "every step's noise would then be the same draw, or one its seed predicts, "
                    "and the noise protects nothing; a stage that needs randomness of its own "
                    "(a reproducible mask) draws from a torch.Generator of its own"
                )
        if reduce is not None and caps.sums:
            state.grads = reduce(state.grads)
        released = released or caps.noise
    return state


def _sum_keeping_call(stage, state: StepState, name: str) -> StepState:
    """``stage`` (declared ``keeps_sum``), refused when it changed the sum: other tensors in
    ``state.grads`` or one of them changed in place (its version counter moved). Between the
    sum and the noise, a changed sum moves by another bound than the clipping stage's, which
    the accountant assumes (:meth:`Mechanism.check_chain
    <privgrad.mechanisms.base.Mechanism.check_chain>` lets only such stages run there)."""
    grads = state.grads
    before = [(g, g._version) for g in grads] if grads is not None else None
    out = stage(state)
    after = getattr(out, "grads", None)
    if before is None:
        changed = after is not None
    else:
        changed = (
            after is None
            or len(after) != len(before)
            or any(a is not g or a._version != v for a, (g, v) in zip(after, before))
        )
    if changed:
        raise PrivgradError(
            f"stage {name} is declared keeps_sum (it reads the sum before the noise without "
            "changing it) but changed the sum (state.grads): the accountant assumes the clipping "
            "stage's bound on how far one example moves the sum; put a stage that changes it "
            "after the noise (post-processing), and declare keeps_sum only on one that reads it"
        )
    return out


# StepState fields that hold one value per example of the batch
PER_EXAMPLE_FIELDS = ("clip_weights", "nonfinite")


def _sealed_call(stage, state: StepState, name: str, after_noise: bool = False) -> StepState:
    """``stage`` on a sealed copy of ``state`` (a copy, so that a state the stage keeps stays
    sealed after the step: the next step's call would otherwise read this one's examples);
    what it returns, with the per-example fields put back. ``name``: who refuses. After the
    noise, the noise generator too offers only its device (:class:`_NoiseGenerator`)."""
    kept = {f: getattr(state, f) for f in ("per_sample", "generator", *PER_EXAMPLE_FIELDS)}
    sealed = dataclasses.replace(
        state,
        per_sample=ReleasedPerSample(kept["per_sample"], name),
        generator=_NoiseGenerator(state.generator, name) if after_noise else state.generator,
        **{f: _SealedField(name, f"state.{f}") for f in PER_EXAMPLE_FIELDS},
    )
    out = stage(sealed)
    if not isinstance(out, StepState):
        raise PrivgradError(f"{name} and returned {type(out).__name__}, not the StepState")
    return dataclasses.replace(out, **kept)


def _refuse(stage: str, what: str):
    raise PrivgradError(
        f"{stage} and used {what}, which is computed from the batch's examples without the "
        "noise; from the noise stage on, a stage may read the sum it noises (state.grads), "
        "the noise records and the step's public facts (state.expected_batch_size, not the "
        "drawn size); do that work before the noise stage"
    )


def _stage_of(sealed, name: str) -> str:
    """The stage a sealed view was made for; AttributeError while it has none (a copy being
    built, as copy.copy does, asks for __setstate__ before it has its fields)."""
    stage = vars(sealed).get("_stage")
    if stage is None:
        raise AttributeError(name)
    return stage


# what a stage after the noise may read of a layer: its parameters, engine flags and, for
# a spectral layer, the geometry its noised spectrum is filtered and mapped back by
RELEASED_LAYER_ATTRIBUTES = frozenset(
    ("params", "flags", "spectral", "keep", "freq_dims", "spectrum_shape", "inverse")
)


class ReleasedPerSample:
    """``state.per_sample`` as a stage after the noise sees it (:func:`run_stages`): the
    trainable parameters, the engine flags and each layer's public structure
    (:data:`RELEASED_LAYER_ATTRIBUTES`). Anything computed from the examples (norms, sums,
    per-sample gradients, the batch's size, which Poisson sampling keeps secret) refuses in
    one line naming the stage."""

    def __init__(self, per_sample: PerSampleGrads, stage: str):
        self._per_sample, self._stage = per_sample, stage

    @property
    def params(self):
        return self._per_sample.params

    @property
    def flags(self):
        return self._per_sample.flags

    @property
    def layers(self) -> list:
        return [_ReleasedLayer(layer, self._stage) for layer in self._per_sample.layers]

    def __getattr__(self, name):
        _refuse(_stage_of(self, name), f"state.per_sample.{name}")


class _ReleasedLayer:
    """One layer of a :class:`ReleasedPerSample`; ``isinstance`` sees the layer's type."""

    def __init__(self, layer, stage: str):
        self._layer, self._stage = layer, stage

    @property
    def __class__(self):
        return type(self._layer)

    def __getattr__(self, name):
        stage = _stage_of(self, name)
        if name in RELEASED_LAYER_ATTRIBUTES:
            return getattr(self._layer, name)
        _refuse(stage, f"a layer's {name} (state.per_sample.layers)")


class _SealedField:
    """A per-example field of the state while a stage after the noise runs: any use refuses."""

    def __init__(self, stage: str, what: str):
        self._stage, self._what = stage, what

    def __getattr__(self, name):
        _refuse(_stage_of(self, name), self._what)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # in a list too: torch.stack([w, ...])
        sealed = next(v for v in tree_flatten((args, kwargs or {}))[0] if isinstance(v, cls))
        _refuse(sealed._stage, sealed._what)

    def _use(self, *args):
        _refuse(self._stage, self._what)

    __bool__ = __len__ = __iter__ = __getitem__ = __float__ = __neg__ = _use
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _use
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = _use


class _NoiseGenerator:
    """The noise generator as a stage after the noise sees it: its device only. Reseeding it
    (``manual_seed``, ``set_state``) would make every step's noise the same draw, and its
    state would let the next step's noise be replayed; such a stage draws from a generator
    of its own."""

    def __init__(self, generator: torch.Generator, stage: str):
        self.device, self._stage = generator.device, stage

    def __getattr__(self, name):
        raise PrivgradError(
            f"{_stage_of(self, name)} and used the noise generator's {name}: a stage after the "
            "noise may read its device only (reseeding it repeats the noise at every step); "
            "draw from a torch.Generator of your own"
        )


@dataclass(frozen=True)
class PlanContext:
    """What a stage may learn about the run before its first step (frozen; built by
    :meth:`privgrad.private.PrivateTrainer.plan_context`).

    param_shapes: the trainable parameters' shapes, one per parameter, in the order the
        per-sample gradients list them (a layer's parameters one after another). n_layers:
        layers with per-sample rules. steps: the planned number of steps. sampling_rate,
        expected_batch_size: q and qN. delta: the run's δ. target_epsilon: the ε σ will be
        calibrated for (None with a fixed σ). noise: the mechanism's static noise record at
        its current σ. noise_event: σ -> the event of one step's Gaussian release under the
        run's sampling. probe: per-sample gradients of one all-zero example of the data's
        shape (public), or None.
    """

    param_shapes: tuple[tuple[int, ...], ...]
    n_layers: int
    steps: int
    sampling_rate: float
    expected_batch_size: float
    delta: float
    target_epsilon: float | None = None
    noise: NoiseRecord = NoiseRecord(0.0, 0.0)
    noise_event: Callable[[float], Any] | None = None
    probe: Callable[[], PerSampleGrads] | None = None


class NonFiniteGradients(Exception):
    """Raised by a clipping stage, before any noise is drawn or sum reduced, when some
    examples' per-sample gradients are not finite (a NaN, inf or overflowing input).
    ``mask`` (B,) marks them; :class:`~privgrad.private.PrivateTrainer` re-runs the step
    without them, so each contributes zero, a function of that example alone (the sum's
    sensitivity stays C)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__(f"{int(mask.sum())} per-sample gradient(s) are not finite")
        self.mask = mask


class Stage(abc.ABC):
    """A step of the chain: ``stage(state) -> state`` on a :class:`StepState`, its static
    facts in :meth:`describe` and its :class:`Capabilities` declared on its class."""

    capabilities: ClassVar[Capabilities] = Capabilities()

    @abc.abstractmethod
    def __call__(self, state: StepState) -> StepState: ...

    def describe(self, info: dict) -> None:
        """Update static facts (sensitivity, multipliers) without running a step."""

    def plan(self, context: PlanContext) -> None:
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

    capabilities = Capabilities(
        per_sample=True,
        per_example=True,
        trial_shared=True,
        injected_canaries=True,
        graph_safe=True,
    )

    def __call__(self, state):
        state.clip_weights = torch.ones(state.per_sample.batch_size, device=state.generator.device)
        return state


class ClipFlat(Stage):
    """Eq. (2) of Abadi et al.: g_i / max(1, ‖g_i‖₂ / C) over all parameters at once."""

    capabilities = Capabilities(
        per_sample=True,
        per_example=True,
        clips=True,
        trial_shared=True,
        injected_canaries=True,
        graph_safe=True,
    )

    def __init__(self, max_grad_norm: float):
        if not max_grad_norm > 0:
            raise PrivgradError(f"the clipping norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm

    def __call__(self, state):
        norms_sq = state.per_sample.norms_sq()
        state.check_finite(norms_sq)
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

    capabilities = Capabilities(
        per_sample=True,
        per_example=True,
        clips=True,
        trial_shared=True,
        injected_canaries=True,
        graph_safe=True,
    )

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
            state.check_finite(torch.stack(layer_norms_sq).sum(0))
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

    capabilities = Capabilities(
        per_sample=True, sums=True, trial_shared=True, injected_canaries=True, graph_safe=True
    )

    def __call__(self, state):
        state.grads = state.per_sample.weighted_sum(state.clip_weights)
        return state


def standard_gaussian(like: list[torch.Tensor], generator) -> list[torch.Tensor]:
    """z ~ N(0, I) shaped as each tensor of ``like``: every real coordinate N(0, 1), the real
    and the imaginary part of a complex one each, drawn in one call for all of them (one
    kernel instead of one per tensor; the entries are as independent as separate draws)."""
    if not like:
        return []
    reals = [torch.view_as_real(t.resolve_conj()) if t.is_complex() else t for t in like]
    first = reals[0]
    if any(r.dtype != first.dtype or r.device != first.device for r in reals):
        noise = [
            torch.randn(r.shape, generator=generator, dtype=r.dtype, device=r.device) for r in reals
        ]
    else:
        offsets, end = [], 0
        for t, r in zip(like, reals):
            end += end % 2 if t.is_complex() else 0  # a complex view starts at an even offset
            offsets.append(end)
            end += r.numel()
        z = torch.randn(end, generator=generator, dtype=first.dtype, device=first.device)
        noise = [z[o : o + r.numel()].view(r.shape) for o, r in zip(offsets, reals)]
    return [torch.view_as_complex(n) if t.is_complex() else n for n, t in zip(noise, like)]


def add_scaled(grads: list[torch.Tensor], noise: list[torch.Tensor], std: float):
    """``g + std·z`` for every pair, in one foreach call."""
    return list(torch._foreach_add(grads, noise, alpha=std)) if grads else grads


def divided(grads: list[torch.Tensor], by: float) -> list[torch.Tensor]:
    """Every tensor divided by ``by``, in one foreach call."""
    return list(torch._foreach_div(grads, by)) if grads else grads


class GaussianNoise(Stage):
    """Adds N(0, σ²C²) to every coordinate of the sum, one draw per step (Abadi et al. Alg. 1)."""

    capabilities = Capabilities(
        coordinatewise=True,
        noise=True,
        trial_stacked=True,
        injected_canaries=True,
        graph_safe=True,
    )

    def __init__(self, noise_multiplier: float):
        if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
            raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
        self.noise_multiplier = noise_multiplier

    def std(self, noise_scale: float) -> float:
        return self.noise_multiplier * noise_scale

    def standard_noise(self, like: list[torch.Tensor], generator) -> list[torch.Tensor]:
        """The step's unit draw, scaled by :meth:`std` (the tests replace it to plant bugs
        and to feed basis vectors through the real stage)."""
        return standard_gaussian(like, generator)

    def __call__(self, state):
        std = self.std(state.noise_scale)
        noise = self.standard_noise(state.grads, state.generator)
        state.grads = add_scaled(state.grads, noise, std)
        state.noise.append(self.record(state.noise_scale, state.sensitivity))
        return state

    def record(self, noise_scale: float, sensitivity: float) -> NoiseRecord:
        """The noise's multiplier in units of the sum's sensitivity (effective) and as the
        paper states it (claimed). std is linear in the noise scale, so σ_eff = std(1) ·
        (noise scale / sensitivity): exactly σ where the scale is the sensitivity (DP-SGD's C),
        which std(C) / C is not always, in the last bit."""
        return NoiseRecord(
            effective=self.std(1.0) * (noise_scale / sensitivity), claimed=self.noise_multiplier
        )

    def describe(self, info):
        info["noise"] = self.record(info["noise_scale"], info["sensitivity"])


class GaussianNoiseOnAverage(GaussianNoise):
    """Literal Ghosh & Das Alg. 3: N(0, σ²C²) on the *average* (1/B)Σ ḡ_i.

    The average has sensitivity C/B, so the effective multiplier is B·σ (over-private);
    the paper's analysis credits σ.
    """

    capabilities = Capabilities(
        coordinatewise=True,
        noise=True,
        trial_stacked=True,
        injected_canaries=True,
        graph_safe=True,
    )

    def __call__(self, state):
        state.grads = divided(state.grads, state.expected_batch_size)
        std = self.std(state.noise_scale)
        noise = self.standard_noise(state.grads, state.generator)
        state.grads = add_scaled(state.grads, noise, std)
        state.noise.append(
            self.record(state.noise_scale, state.sensitivity / state.expected_batch_size)
        )
        return state

    def describe(self, info):
        info["noise"] = self.record(
            info["noise_scale"], info["sensitivity"] / info["expected_batch_size"]
        )


class ScaleByExpectedBatch(Stage):
    """Divides by the expected batch size qN, a public constant (never the actual size)."""

    capabilities = Capabilities(
        coordinatewise=True,
        trial_shared=True,
        trial_stacked=True,
        injected_canaries=True,
        graph_safe=True,
    )

    def __call__(self, state):
        state.grads = divided(state.grads, state.expected_batch_size)
        return state


class Sign(Stage):
    """Keeps only the sign of each noisy coordinate (post-processing)."""

    capabilities = Capabilities(
        coordinatewise=True, trial_stacked=True, injected_canaries=True, graph_safe=True
    )

    def __call__(self, state):
        state.grads = [torch.sign(g) for g in state.grads]
        return state
