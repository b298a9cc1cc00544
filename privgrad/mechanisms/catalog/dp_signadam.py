"""DP-SignAdam (Ghosh & Das): Alg. 4 (sign of the noisy sum, then Adam moments) or Alg. 2
(Adam moments of the noisy mean, then the sign of the Adam step)."""

from dataclasses import dataclass

from privgrad.mechanisms.registry import Defaults, MechanismSpec, option


@dataclass(frozen=True)
class Options:
    variant: str = option("alg4", "'alg4' (default) or 'alg2'", flag="--signadam-variant")


def build(noise_multiplier, max_grad_norm, variant="alg4"):
    from privgrad.errors import PrivgradError
    from privgrad.mechanisms.base import Mechanism
    from privgrad.mechanisms.stages import ClipFlat, GaussianNoise, ScaleByExpectedBatch, Sign
    from privgrad.mechanisms.stages import Sum

    if variant == "alg4":
        return Mechanism(
            "dp-signadam",
            [ClipFlat(max_grad_norm), Sum(), GaussianNoise(noise_multiplier), Sign()],
            "adam",
            "Ghosh & Das, Alg. 4",
        )
    if variant == "alg2":
        return Mechanism(
            "dp-signadam",
            [
                ClipFlat(max_grad_norm),
                Sum(),
                GaussianNoise(noise_multiplier),
                ScaleByExpectedBatch(),
            ],
            "sign-adam",
            "Ghosh & Das, Alg. 2",
        )
    raise PrivgradError(f"--signadam-variant must be 'alg4' or 'alg2', got '{variant}'")


MECHANISM = MechanismSpec(
    name="dp-signadam",
    build=build,
    options=Options,
    defaults=Defaults(lr=0.008, optimizer="adam", momentum=0.9, clip=0.1),
    paper="Ghosh & Das, Algs. 2 and 4",
    chain="clip → sum → N(0, σ²C²) → sign → Adam moments (alg2: … → ÷B → Adam → sign)",
)
