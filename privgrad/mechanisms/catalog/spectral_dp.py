"""Spectral-DP (Feng et al. 2023, Algs. 2–4): FFT → clip/layer → sum → Re, Im ~ N(0, σ²C²)
→ low-pass → Re(iFFT) → crop → ÷B. The stages are in :mod:`privgrad.mechanisms.spectral`."""

from dataclasses import dataclass

from privgrad.mechanisms.registry import Defaults, MechanismSpec, option
from privgrad.validate import Range

PER_LAYER_CLIP_HELP = "'split' (c_l = C/√L, default) or 'literal' (c_l = C)"


@dataclass(frozen=True)
class Options:
    filter_ratio: float = option(
        0.5, "fraction ρ of frequencies removed per axis", range=Range(0, 1, high_open=True)
    )
    filter: str = option("symmetric", "'symmetric' low-pass (default) or 'paper' (zero the last ρ)")
    noise: str = option(
        "sound", "'sound' (default) or 'paper' (CN noise, σ/√2)", flag="--noise-type"
    )
    per_layer_clip: str = option("split", PER_LAYER_CLIP_HELP)


def build(noise_multiplier, max_grad_norm, **options):
    from privgrad.mechanisms.spectral import spectral_dp

    return spectral_dp(noise_multiplier, max_grad_norm, **options)


MECHANISM = MechanismSpec(
    name="spectral-dp",
    build=build,
    options=Options,
    defaults=Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    paper="Feng et al. 2023 (Spectral-DP), Algs. 2-4",
    chain="FFT → clip/layer → sum → Re, Im ~ N(0, σ²C²) → low-pass → Re(iFFT) → crop → ÷B",
)
