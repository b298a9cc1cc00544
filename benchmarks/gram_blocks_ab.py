"""A/B of the ghost norm's symmetric blocks in one process: DP-SGD's step with the ghost norm
Σ_{t,t'} (a_t·a_t')(g_t·g_t') from the three distinct blocks of the Grams' 2 × 2 split
(``EngineFlags.gram_blocks_from``, 64 by default) against the same step with both full Grams
(``gram_blocks_from=None``, the form it replaced), and the non-private step, in interleaved
rounds (the driver in ``ab.py``), CPU and wall time. The transformer's linear layers
(T = 128) are the setting it changes.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gram_blocks_ab.py --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

from ab import main as ab_main  # noqa: E402  (this folder)
from privgrad.per_sample import EngineFlags  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)


def variants(spec, x, y, device) -> dict:
    return {
        "dpsgd-blocks": make_contender("dpsgd", spec, x, y, device, EngineFlags()),
        "dpsgd-full": make_contender(
            "dpsgd", spec, x, y, device, EngineFlags(gram_blocks_from=None)
        ),
    }


def summary(row: dict) -> str:
    ratio = row["cpu_ratio"]
    return (
        f"DP-SGD {ratio['dpsgd-blocks']:.3f}× (blocks) / {ratio['dpsgd-full']:.3f}× "
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
