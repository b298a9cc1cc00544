"""A/B of the ghost norm's symmetric blocks in one process: DP-SGD's step with the ghost norm
Σ_{t,t'} (a_t·a_t')(g_t·g_t') from the three distinct blocks of the Grams' 2 × 2 split
(``rules._gram_dot``, from T = 64 on) against the same step with both full Grams (the form
it replaced), and the non-private step, in interleaved rounds (the driver in ``ab.py``),
CPU and wall time. The transformer's linear layers (T = 128) are the setting it changes.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gram_blocks_ab.py --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

import torch  # noqa: E402

from ab import main as ab_main, with_attribute  # noqa: E402  (this folder)
from privgrad.per_sample import rules  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)


def full_grams(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The ghost norm from both full T × T Grams (what ``_gram_dot`` replaced)."""
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def variants(spec, x, y, device) -> dict:
    dpsgd = make_contender("dpsgd", spec, x, y, device)
    return {
        "dpsgd-blocks": dpsgd,
        "dpsgd-full": with_attribute(dpsgd, rules, "_gram_dot", full_grams),
    }


def summary(row: dict) -> str:
    return (
        f"DP-SGD {row['cpu_ratio']['dpsgd-blocks']:.3f}× (blocks) / {row['cpu_ratio']['dpsgd-full']:.3f}× "
        f"(full Grams), blocks/full {row['blocks_over_full']:.3f}"
    )


def main(argv=None):
    ab_main(
        argv,
        __doc__,
        "transformer",
        variants,
        {"blocks_over_full": ("dpsgd-blocks", "dpsgd-full")},
        summary,
    )


if __name__ == "__main__":
    main()
