"""A/B of the conv Gram form in one process: DP-SGD's step with its Gram norms from
stride-sized input cells where they cost less (``EngineFlags(conv_gram="auto")``, the rule's
choice) against the same step with them from patches (``conv_gram="patches"``), and the
non-private step, in interleaved rounds (the driver in ``ab.py``), CPU and wall time.

Both DP-SGD contenders start from the same weights on the same batch, so they differ only
in the Gram form. Reported per setting: the median CPU ms per step, each form's median CPU
and wall ratio to the non-private step, and the median over rounds of the cells / patches
ratio of the round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gram_cells_ab.py --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)


from ab import main as ab_main  # noqa: E402  (this folder)
from privgrad.per_sample import EngineFlags  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)

# contender: the Gram form (cells where they cost less, the rule's choice; or patches)
FORMS = {"dpsgd-cells": "auto", "dpsgd-patches": "patches"}


def variants(spec, x, y, device) -> dict:
    return {
        name: make_contender("dpsgd", spec, x, y, device, EngineFlags(conv_gram=form))
        for name, form in FORMS.items()
    }


def summary(row: dict) -> str:
    ratio = row["cpu_ratio"]
    return (
        f"non-private {row['cpu_ms']['non-private']:.1f} ms, DP-SGD "
        f"{ratio['dpsgd-cells']:.3f}× (cells) / {ratio['dpsgd-patches']:.3f}× (patches), "
        f"cells/patches {row['cells_over_patches']:.3f}"
    )


def main(argv=None):
    ab_main(
        argv,
        __doc__,
        "cnn,cnn-x16,model3-gn",
        variants,
        {"cells_over_patches": ("dpsgd-cells", "dpsgd-patches")},
        summary,
    )


if __name__ == "__main__":
    main()
