"""The stage contract: capabilities declared on each stage's class (read by the sampler, the
trainer and the canary audit instead of ad-hoc attributes), a typed step state and facts,
and a frozen plan context instead of the trainer."""

import copy
import dataclasses

import pytest
import torch

import privgrad
from privgrad.mechanisms import build_mechanism
from privgrad.mechanisms.stages import (
    Capabilities,
    GaussianNoise,
    PlanContext,
    Stage,
    StepFacts,
    capabilities_of,
)

# the canary audit's former hand-kept sets: stages run once for all trials (before the
# noise), stages run on stacked trials (from the noise on), stages injected canaries reach
SHARED = {"ClipFlat", "ClipPerLayer", "Sum", "NoClip", "ScaleByExpectedBatch", "SpectralTransform"}
STACKED = {
    "GaussianNoise",
    "GaussianNoiseOnAverage",
    "ScaleByExpectedBatch",
    "Sign",
    "SpectralNoise",
    "SpectralFilter",
    "InverseSpectral",
}
INJECTED = {
    "ClipFlat",
    "ClipPerLayer",
    "NoClip",
    "Sum",
    "GaussianNoise",
    "GaussianNoiseOnAverage",
    "ScaleByExpectedBatch",
    "Sign",
}
OPTIONS = {
    "dp-signsgd": [{}, {"noise_on": "average"}],
    "dp-signadam": [{}, {"variant": "alg2"}],
    "gip": [{}, {"prune_order": "prune-then-clip"}],
    "random-k": [{}, {"prune_order": "prune-then-clip"}],
}


@pytest.mark.parametrize(
    "name",
    ["non-private", "dpsgd", "dp-adam", "dp-signsgd", "dp-signadam", "spectral-dp", "gredp"]
    + ["gip", "random-k"],
)
def test_declared_capabilities_are_the_former_sets(name):
    for options in OPTIONS.get(name, [{}]):
        for stage in build_mechanism(name, 1.0, 1.0, **options).stages:
            caps, kind = capabilities_of(stage), type(stage).__name__
            assert caps.trial_shared == (kind in SHARED), kind
            assert caps.trial_stacked == (kind in STACKED), kind
            assert caps.injected_canaries == (kind in INJECTED), kind
            assert caps.noise == isinstance(stage, GaussianNoise), kind
            assert caps.reads_layer_inputs == (kind == "SpectralTransform"), kind


def test_a_subclass_with_its_own_step_loses_the_audit_capabilities():
    class Louder(GaussianNoise):
        def __call__(self, state):
            return super().__call__(state)

    class OwnDraw(GaussianNoise):
        def standard_noise(self, like, generator):
            return super().standard_noise(like, generator)

    class Same(GaussianNoise):
        pass

    assert capabilities_of(Same(1.0)) == capabilities_of(GaussianNoise(1.0))
    for stage in (Louder(1.0), OwnDraw(1.0)):
        caps = capabilities_of(stage)
        assert caps.noise and not (caps.trial_stacked or caps.injected_canaries), stage
    with pytest.raises(TypeError):
        type("NoStep", (Stage,), {})()  # a stage must define its step
    assert Capabilities() == capabilities_of(type("Plain", (Stage,), {"__call__": id})())


def test_facts_are_typed():
    psg_x, psg_y = torch.randn(12, 6), torch.randint(0, 2, (12,))
    model = torch.nn.Linear(6, 2)
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (psg_x, psg_y),
        mechanism="gip",
        noise_multiplier=1.0,
        batch_size=6,
        k_schedule="constant",
        k_end=0.5,
        group_size=4,
    )
    for batch in private.batches(1):
        private.step(batch)
    facts = private.last_facts
    assert isinstance(facts, StepFacts) and facts.mask is not None
    assert len(facts.pure_events) == 1 and facts.spectral_layers is None
    assert facts.index_selection["kept"] == sum(int(m.sum()) for m in facts.mask)


def test_plan_context_is_frozen_and_describes_the_run():
    x, y = torch.randn(20, 6), torch.randint(0, 2, (20,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        mechanism="random-k",
        noise_multiplier=1.0,
        batch_size=5,
        epochs=2,
    )
    ctx = private.plan_context(8, None)
    assert isinstance(ctx, PlanContext)
    assert ctx.param_shapes == ((3, 6), (3,), (2, 3), (2,))
    assert (ctx.steps, ctx.sampling_rate, ctx.delta, ctx.n_layers) == (8, 0.25, 1e-5, 2)
    assert ctx.noise == private.mechanism.noise_record(2, 5.0)
    assert [layer.batch_size for layer in [ctx.probe()]] == [1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.steps = 9
    select = private.mechanism.stages[2]
    select.plan(ctx)
    assert select.total_steps == 8


class _ScaledNoise(Stage):
    """A noise stage written from scratch, not a GaussianNoise."""

    capabilities = Capabilities(coordinatewise=True, noise=True)

    def __call__(self, state):
        return state


class _BoostAfterClip(Stage):
    """Quadruples every clipped example before the sum: the sum moves by 4C, the ε of C was
    printed (3.23 for 0.128 × 8 steps at σ = 1)."""

    capabilities = Capabilities(per_sample=True, per_example=True)

    def __call__(self, state):
        state.clip_weights = state.clip_weights * 4
        return state


class _QuietNoise(GaussianNoise):
    """A GaussianNoise whose own declaration forgets noise=True."""

    capabilities = Capabilities(coordinatewise=True, trial_stacked=True, graph_safe=True)


CHAINS = {  # a plugin author's compositions of shipped stages, and what each would release
    "noise before the sum (noiseless release)": (
        ["ClipFlat", "GaussianNoise", "Sum", "ScaleByExpectedBatch"], "must follow the sum"),
    "a sign of the clean sum (moves by 2√d)": (
        ["ClipFlat", "Sum", "Sign", "GaussianNoise"], "stage Sign runs between the sum"),
    "rescaled before the noise": (
        ["ClipFlat", "Sum", "ScaleByExpectedBatch", "GaussianNoise"], "stage ScaleByExpected"),
    "two noise stages": (
        ["ClipFlat", "Sum", "GaussianNoise", "GaussianNoise"], "has 2 noise stages"),
    "no clipping": (["Sum", "GaussianNoise"], "no clipping stage comes before its sum"),
    "the clipped examples rescaled before the sum": (
        ["ClipFlat", "_BoostAfterClip", "Sum", "GaussianNoise"], "between the clipping stage"),
    "a sum after the noise": (
        ["ClipFlat", "Sum", "GaussianNoise", "Sum"], "must follow the sum"),
    "a clipping stage after the noise": (
        ["ClipFlat", "Sum", "GaussianNoise", "ClipFlat"], "stage ClipFlat acts on per-sample"),
    "a noise stage that is no GaussianNoise": (
        ["ClipFlat", "Sum", "_ScaledNoise"], "does not subclass GaussianNoise"),
    "a GaussianNoise not declared noise (nothing checked or sealed)": (
        ["ClipFlat", "Sum", "_QuietNoise", "ScaleByExpectedBatch"], "not declare noise=True"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHAINS))
def test_chains_whose_noise_would_not_cover_the_release_are_refused(case):
    """Each of these trained and printed the target ε (the first released the clean sum,
    bit-identical under two noise seeds); the order was checked only for micro-batches."""
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms import stages as shipped

    names, says = CHAINS[case]
    make = {
        "_ScaledNoise": _ScaledNoise,
        "_QuietNoise": lambda: _QuietNoise(1.0),
        "_BoostAfterClip": _BoostAfterClip,
    }
    chain = [
        make[n]() if n in make else
        getattr(shipped, n)(*([1.0] if n in ("ClipFlat", "GaussianNoise") else []))
        for n in names
    ]  # fmt: skip
    with pytest.raises(privgrad.errors.PrivgradError, match=says):
        Mechanism("plugin", chain)


class _DoublesTheSum(Stage):
    """Declared keeps_sum (as the chain check's refusal suggests for a stage that only reads
    the sum) but doubles the clean sum before the noise: the release is worth σ/2, and the
    ε of σ was printed (3.23 for 0.128 × 8 steps at σ = 1, where σ/2 gives far more)."""

    capabilities = Capabilities(keeps_sum=True)

    def __init__(self, in_place: bool):
        self.in_place = in_place

    def __call__(self, state):
        if self.in_place:
            for g in state.grads:
                g.mul_(2)
        else:
            state.grads = [2 * g for g in state.grads]
        return state


@pytest.mark.parametrize("in_place", [False, True])
def test_a_stage_declared_keeps_sum_that_changes_the_sum_is_refused(in_place):
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    chain = [ClipFlat(1.0), Sum(), _DoublesTheSum(in_place), GaussianNoise(1.0)]
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
        mechanism=Mechanism("plugin", [*chain, ScaleByExpectedBatch()]),
        noise_multiplier=1.0, epochs=1, batch_size=8,
    )  # fmt: skip
    before = model.weight.detach().clone()
    with pytest.raises(
        privgrad.errors.PrivgradError, match="declared keeps_sum .* changed the sum"
    ):
        p.step(next(p.batches()))
    assert torch.equal(model.weight, before) and p.steps == 0  # nothing applied or counted


class _Doubles(Stage):
    def __call__(self, state):
        state.grads = [2 * g for g in state.grads]
        return state


class _ReseedsBeforeTheNoise(Stage):
    """A mask stage made reproducible by reseeding the noise generator: every step's noise
    was the same draw, and the ε of σ was printed."""

    capabilities = Capabilities(keeps_sum=True)

    def __call__(self, state):
        state.generator.manual_seed(1234)
        return state


class _OwnGeneratorBeforeTheSum(Stage):
    """A per-sample stage that hands the chain a generator of its own, seeded."""

    capabilities = Capabilities(per_sample=True, per_example=True)

    def __call__(self, state):
        state.generator = torch.Generator().manual_seed(1234)
        return state


@pytest.mark.parametrize("stage", [_ReseedsBeforeTheNoise, _OwnGeneratorBeforeTheSum])
def test_a_stage_before_the_noise_that_reseeds_the_noise_generator_is_refused(stage):
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    chain = [ClipFlat(1.0), Sum(), GaussianNoise(1.0), ScaleByExpectedBatch()]
    chain.insert(2 if stage is _ReseedsBeforeTheNoise else 0, stage())
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
        mechanism=Mechanism("plugin", chain), noise_multiplier=1.0, epochs=1, batch_size=8,
    )  # fmt: skip
    before = model.weight.detach().clone()
    with pytest.raises(privgrad.errors.PrivgradError, match="reseeded or replaced the noise gen"):
        p.step(next(p.batches()))
    assert torch.equal(model.weight, before) and p.steps == 0


@pytest.mark.parametrize("physical", [None, 4])
def test_a_chain_changed_after_it_was_built_is_checked_at_its_step(physical):
    """dpsgd built (its chain checked), then a stage doubling the clean sum inserted between
    the sum and the noise: it trained and printed the ε of σ for a release worth σ/2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    mech = build_mechanism("dpsgd", 1.0, 1.0)
    mech.stages.insert(2, _Doubles())
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), mechanism=mech,
        noise_multiplier=1.0, epochs=1, batch_size=8, max_physical_batch_size=physical,
    )  # fmt: skip
    before = model.weight.detach().clone()
    with pytest.raises(privgrad.errors.PrivgradError, match="stage _Doubles runs between the sum"):
        p.step(next(p.batches()))
    assert torch.equal(model.weight, before) and p.steps == 0


class _ClipDeclaredOnTheInstance(Stage):
    """Declares its capabilities in __init__: they were ignored, and the chain refused for
    having no clipping stage, which named no cause."""

    def __init__(self):
        self.capabilities = Capabilities(per_sample=True, per_example=True, clips=True)
        self.max_grad_norm = 1.0

    def __call__(self, state):
        return state


def test_capabilities_set_on_the_instance_are_refused_with_their_cause():
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import Sum

    with pytest.raises(privgrad.errors.PrivgradError, match="declare them on its class"):
        Mechanism("plugin", [_ClipDeclaredOnTheInstance(), Sum(), GaussianNoise(1.0)])


def test_every_shipped_mechanism_passes_the_chain_check():
    from privgrad.mechanisms.registry import mechanism_specs

    for name in mechanism_specs():
        build_mechanism(name, 1.0, 0.1).check_chain()  # built once already: checked there too


class _OverReporting(GaussianNoise):
    """Draws σC/2 and reports σ: ε printed 0.33 for noise worth ε 1.0."""

    def std(self, noise_scale):
        return self.noise_multiplier * noise_scale / 2

    def __call__(self, state):
        state = super().__call__(state)
        state.noise[-1] = self.record(2 * self.std(state.noise_scale), state.sensitivity)
        return state


class _Scheduled(GaussianNoise):
    """σ_t = 2σ/(1 + t): calibration and the budget guard read the static σ (a target of
    ε = 1 ended at 12.2)."""

    def __init__(self, noise_multiplier):
        super().__init__(noise_multiplier)
        self.t = 0

    def __call__(self, state):
        base, self.noise_multiplier = (
            self.noise_multiplier,
            self.noise_multiplier * 2 / (1 + self.t),
        )
        try:
            return super().__call__(state)
        finally:
            self.noise_multiplier, self.t = base, self.t + 1


@pytest.mark.parametrize("noise", [_OverReporting, _Scheduled])
def test_a_step_whose_records_differ_from_the_described_ones_is_refused(noise):
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    mech = Mechanism("plugin", [ClipFlat(1.0), Sum(), noise(1.0), ScaleByExpectedBatch()])
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), mechanism=mech,
        target_epsilon=1.0, epochs=1, batch_size=8,
    )  # fmt: skip
    before = model.weight.detach().clone()
    with pytest.raises(privgrad.errors.PrivgradError, match="not the .* its stages describe"):
        p.step(next(p.batches()))
    assert torch.equal(model.weight, before) and p.steps == 0  # nothing applied or counted


class _Floored(GaussianNoise):
    """Noise of std √(σ² + τ²)·C (a fixed floor τ = 0.5): σ_eff is not proportional to σ, as
    calibration assumed; a target of ε = 0.5 ended at 0.566, no step refused."""

    def std(self, noise_scale):
        return (self.noise_multiplier**2 + 0.25) ** 0.5 * noise_scale


def test_calibration_reaches_the_target_when_the_record_is_not_proportional_to_sigma():
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(1000, 4), torch.randint(0, 2, (1000,))
    mech = Mechanism("plugin", [ClipFlat(1.0), Sum(), _Floored(1.0), ScaleByExpectedBatch()])
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), mechanism=mech,
        target_epsilon=0.5, epochs=3, batch_size=100,
    )  # fmt: skip
    assert p.epsilon_after(p.planned_steps) == pytest.approx(0.5, abs=1e-3)


class _ScheduledAndDescribed(GaussianNoise):
    """σ_t = 2σ/(1 + t), its describe() following the counter, which moves before the draw:
    each step's record matched describe() after the step, so a target of ε = 1 ended at 14.1
    with no step refused."""

    def __init__(self, noise_multiplier):
        super().__init__(noise_multiplier)
        self.t = 0

    def std(self, noise_scale):
        return self.noise_multiplier * noise_scale * 2 / (2 + self.t)

    def __call__(self, state):
        self.t += 1
        return super().__call__(state)


def test_a_described_record_that_changes_from_step_to_step_is_refused():
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    mech = Mechanism(
        "plugin", [ClipFlat(1.0), Sum(), _ScheduledAndDescribed(1.0), ScaleByExpectedBatch()]
    )
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), mechanism=mech,
        target_epsilon=1.0, epochs=1, batch_size=8,
    )  # fmt: skip
    before = model.weight.detach().clone()
    with pytest.raises(privgrad.errors.PrivgradError, match="must not change from step to step"):
        p.step(next(p.batches()))
    assert torch.equal(model.weight, before) and p.steps == 0  # nothing applied or counted


# What a post-processing stage (after the noise) might read of the batch's examples; each
# trained and printed the noise's ε before the state was sealed there
POST_NOISE_READS = {
    "the clipped norms": (lambda st: st.per_sample.norms_sq(), "state.per_sample.norms_sq"),
    "the drawn batch's size": (lambda st: st.per_sample.batch_size, "state.per_sample.batch_size"),
    "a layer's per-sample gradients": (
        lambda st: st.per_sample.layers[0].per_sample(), "a layer's per_sample"),
    "the clip weights": (lambda st: st.clip_weights.sum(), "state.clip_weights"),
    "the clip weights in a torch op": (
        lambda st: torch.ones(1) * st.clip_weights, "state.clip_weights"),
    "the clip weights as a number": (lambda st: 2.0 * st.clip_weights, "state.clip_weights"),
    "the clip weights in a list": (
        lambda st: torch.stack([st.clip_weights]), "state.clip_weights"),
    # not the examples, but as bad: every later step's noise the same draw
    "the noise generator reseeded": (
        lambda st: st.generator.manual_seed(0), "the noise generator's manual_seed"),
    "the noise generator's state": (
        lambda st: st.generator.get_state(), "the noise generator's get_state"),
}  # fmt: skip


def _post_noise_step(read, physical=None):
    """One make_private step of DP-SGD with a post-processing stage that applies ``read``."""
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, ScaleByExpectedBatch, Sum

    class Reads(Stage):
        capabilities = Capabilities(coordinatewise=True)

        def __call__(self, state):
            read(state)
            return state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    chain = [ClipFlat(1.0), Sum(), GaussianNoise(1.0), Reads(), ScaleByExpectedBatch()]
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
        mechanism=Mechanism("plugin", chain), noise_multiplier=1.0, epochs=1, batch_size=16,
        max_physical_batch_size=physical,
    )  # fmt: skip
    p.step(next(p.batches()))
    return p


@pytest.mark.parametrize("physical", [None, 4], ids=["whole batch", "micro-batches"])
@pytest.mark.parametrize("case", sorted(POST_NOISE_READS))
def test_a_stage_after_the_noise_cannot_read_the_examples(case, physical):
    read, says = POST_NOISE_READS[case]
    with pytest.raises(
        privgrad.errors.PrivgradError, match=f"stage Reads runs after the noise and used {says}"
    ):
        _post_noise_step(read, physical)


def test_a_stage_after_the_noise_reads_the_release_and_the_model():
    """Post-processing keeps what it may read: the noised update, the noise records, the
    parameters and the layers' public structure; the caller gets the state back whole."""
    from privgrad.private import per_sample_cross_entropy
    from privgrad.mechanisms.stages import ReleasedPerSample, StepState, run_stages
    from privgrad.per_sample import GradSampler

    seen = {}

    def read(state):
        seen["shapes"] = [g.shape for g in state.grads]
        seen["params"] = [p.shape for p in state.per_sample.params]
        seen["layers"] = [isinstance(layer, type(layer)) for layer in state.per_sample.layers]
        seen["noise"] = list(state.noise)
        seen["device"] = state.generator.device
        seen["per_sample"] = state.per_sample
        seen["copies"] = [copy.copy(state.per_sample), copy.copy(state.per_sample.layers[0])]

    p = _post_noise_step(read)
    assert seen["shapes"] == seen["params"] == [(3, 4), (3,), (2, 3), (2,)]
    assert seen["layers"] == [True, True] and len(seen["noise"]) == 1
    assert seen["device"] == torch.device("cpu")
    assert isinstance(seen["per_sample"], ReleasedPerSample) and p.steps == 1
    for sealed, what in zip(seen["copies"], ["batch_size", "norms_sq"]):  # copies stay sealed
        with pytest.raises(privgrad.errors.PrivgradError, match="stage Reads runs after"):
            getattr(sealed, what)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    psg = GradSampler(model).compute(x, y, per_sample_cross_entropy)[0]
    mech = build_mechanism("dpsgd", 1.0, 1.0)
    state = run_stages(mech.stages, StepState(psg, 5.0, torch.Generator().manual_seed(0)))
    assert state.per_sample is psg and isinstance(state.clip_weights, torch.Tensor)


def test_a_state_kept_by_a_stage_after_the_noise_stays_sealed():
    """A post-processing stage that keeps the state it was handed (for its next step) read
    the last step's examples through it at the next step: the sealing lasted the call only."""
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, StepState, Sum, run_stages
    from privgrad.per_sample import GradSampler
    from privgrad.private import per_sample_cross_entropy

    class KeepsState(Stage):
        capabilities = Capabilities(coordinatewise=True)
        kept = None

        def __call__(self, state):
            self.kept = state
            return state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    psg = GradSampler(model).compute(x, y, per_sample_cross_entropy)[0]
    keeps = KeepsState()
    mech = Mechanism("plugin", [ClipFlat(1.0), Sum(), GaussianNoise(1.0), keeps])
    state = run_stages(mech.stages, StepState(psg, 5.0, torch.Generator().manual_seed(0)))
    assert state.per_sample is psg and isinstance(state.clip_weights, torch.Tensor)
    for read in (lambda st: st.per_sample.batch_size, lambda st: st.clip_weights.sum()):
        with pytest.raises(privgrad.errors.PrivgradError, match="stage KeepsState runs after"):
            read(keeps.kept)


def test_the_noise_stage_cannot_read_the_examples():
    """A GaussianNoise subclass that divided its noised sum by the drawn batch's size (a
    plugin's 'mean') trained and printed the noise's ε: the size went out unprotected."""
    from privgrad.mechanisms import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, Sum

    class NoiseThenMean(GaussianNoise):
        def __call__(self, state):
            state = super().__call__(state)
            state.grads = [g / max(1, state.per_sample.batch_size) for g in state.grads]
            return state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
        mechanism=Mechanism("plugin", [ClipFlat(1.0), Sum(), NoiseThenMean(1.0)]),
        noise_multiplier=1.0, epochs=1, batch_size=16,
    )  # fmt: skip
    with pytest.raises(
        privgrad.errors.PrivgradError,
        match="stage NoiseThenMean draws the noise and used state.per_sample.batch_size",
    ):
        p.step(next(p.batches()))
    assert p.steps == 0
