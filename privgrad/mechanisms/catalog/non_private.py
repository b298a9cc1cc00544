"""non-private: sum → ÷B, no clipping, no noise (ε = ∞); the control of every comparison."""

from privgrad.mechanisms.registry import Defaults, MechanismSpec


def build(noise_multiplier=0.0, max_grad_norm=1.0):
    from privgrad.mechanisms.base import Mechanism
    from privgrad.mechanisms.stages import NoClip, ScaleByExpectedBatch, Sum

    return Mechanism("non-private", [NoClip(), Sum(), ScaleByExpectedBatch()], "sgd", "none")


MECHANISM = MechanismSpec(
    name="non-private",
    build=build,
    defaults=Defaults(lr=0.1, optimizer="sgd", momentum=0.9, clip=None, epsilon=None),
    paper="none",
    chain="sum → ÷B (no clipping, no noise: ε = ∞)",
)
