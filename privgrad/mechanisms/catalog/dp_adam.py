"""DP-Adam: the DP-SGD chain (Abadi et al. 2016, Alg. 1) with Adam as post-processing."""

from privgrad.mechanisms.registry import Defaults, MechanismSpec


def build(noise_multiplier, max_grad_norm):
    from privgrad.mechanisms.catalog.dpsgd import build as dpsgd

    m = dpsgd(noise_multiplier, max_grad_norm)
    m.name, m.optimizer = "dp-adam", "adam"
    return m


MECHANISM = MechanismSpec(
    name="dp-adam",
    build=build,
    defaults=Defaults(lr=0.008, optimizer="adam", momentum=0.9, clip=0.1),
    paper="Abadi et al. 2016",
    chain="as dpsgd, then Adam",
)
