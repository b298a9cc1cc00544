"""DP-SGD (Abadi et al. 2016, Alg. 1): clip → sum → N(0, σ²C²) → ÷B."""

from privgrad.mechanisms.registry import Defaults, MechanismSpec


def build(noise_multiplier, max_grad_norm):
    from privgrad.mechanisms.base import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, GaussianNoise, ScaleByExpectedBatch, Sum

    return Mechanism(
        "dpsgd",
        [ClipFlat(max_grad_norm), Sum(), GaussianNoise(noise_multiplier), ScaleByExpectedBatch()],
    )


MECHANISM = MechanismSpec(
    name="dpsgd",
    build=build,
    defaults=Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="Abadi et al. 2016, Alg. 1",
    chain="clip → sum → N(0, σ²C²) → ÷B",
)
