"""GReDP (Wang et al., Alg. 2; Thm 1): FFT → clip/layer → sum → CN(0, σ²C²) → Re(iFFT) →
crop → ÷B, honest σ_eff = σ/√2. The stages are in :mod:`privgrad.mechanisms.spectral`."""

from dataclasses import dataclass

from privgrad.mechanisms.catalog.spectral_dp import PER_LAYER_CLIP_HELP
from privgrad.mechanisms.registry import Defaults, MechanismSpec, option


@dataclass(frozen=True)
class Options:
    noise: str = option("complex", "'complex' ('real' is refused)", flag="--noise-type")
    per_layer_clip: str = option("split", PER_LAYER_CLIP_HELP)


def build(noise_multiplier, max_grad_norm, **options):
    from privgrad.mechanisms.spectral import gredp

    return gredp(noise_multiplier, max_grad_norm, **options)


MECHANISM = MechanismSpec(
    name="gredp",
    build=build,
    options=Options,
    defaults=Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="Wang et al. (GReDP), Alg. 2 and Thm 1",
    chain="FFT → clip/layer → sum → CN(0, σ²C²) → Re(iFFT) → crop → ÷B",
)
