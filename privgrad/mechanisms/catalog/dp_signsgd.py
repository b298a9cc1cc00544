"""DP-SignSGD (Ghosh & Das, Alg. 3): clip → sum → N(0, σ²C²) → sign."""

from dataclasses import dataclass

from privgrad.mechanisms.registry import Defaults, MechanismSpec, option


@dataclass(frozen=True)
class Options:
    noise_on: str = option("sum", "'sum' (default) or 'average' (literal Alg. 3)")


def build(noise_multiplier, max_grad_norm, noise_on="sum"):
    """``noise_on='average'`` is the literal Alg. 3 (noise σC on the mean), accounted at its
    true multiplier B·σ; the default puts it on the sum, as Eq. 8 and Theorem 5 do."""
    from privgrad.errors import PrivgradError
    from privgrad.mechanisms.base import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, GaussianNoise, GaussianNoiseOnAverage, Sign
    from privgrad.mechanisms.stages import Sum

    noise = {"sum": GaussianNoise, "average": GaussianNoiseOnAverage}.get(noise_on)
    if noise is None:
        raise PrivgradError(f"--noise-on must be 'sum' or 'average', got '{noise_on}'")
    return Mechanism(
        "dp-signsgd",
        [ClipFlat(max_grad_norm), Sum(), noise(noise_multiplier), Sign()],
        "sgd",
        "Ghosh & Das, Alg. 3",
    )


MECHANISM = MechanismSpec(
    name="dp-signsgd",
    build=build,
    options=Options,
    defaults=Defaults(lr=0.001, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="Ghosh & Das, Alg. 3",
    chain="clip → sum → N(0, σ²C²) → sign",
)
