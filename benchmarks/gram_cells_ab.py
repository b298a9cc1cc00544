"""A/B of the conv Gram form in one process: DP-SGD's step with its Gram norms from
stride-sized input cells (``ConvGrads.gram_by_cells``, the rule's choice) against the same
step with them from patches (the property switched off for that contender's calls), and
the non-private step, in interleaved rounds (the driver in ``ab.py``), CPU and wall time.

Both DP-SGD contenders are one model copy's step, so they differ only in the Gram form.
Reported per setting: the median CPU ms per step, each form's median CPU and wall ratio to
the non-private step, and the median over rounds of the cells / patches ratio of the round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gram_cells_ab.py --models cnn,cnn-x16,model3-gn --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)


from ab import main as ab_main, with_attribute  # noqa: E402  (this folder)
from privgrad.per_sample.rules import ConvGrads  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)

_CELLS = ConvGrads.gram_by_cells
_PATCHES = property(lambda self: False)


def with_gram_form(step, cells: bool):
    """``step`` with the Gram form switched to cells (the rule's choice) or to patches."""
    return with_attribute(step, ConvGrads, "gram_by_cells", _CELLS if cells else _PATCHES)


def variants(spec, x, y, device) -> dict:
    dpsgd = make_contender("dpsgd", spec, x, y, device)
    return {
        "dpsgd-cells": with_gram_form(dpsgd, True),
        "dpsgd-patches": with_gram_form(dpsgd, False),
    }


def summary(row: dict) -> str:
    return (
        f"non-private {row['cpu_ms']['non-private']:.1f} ms, DP-SGD {row['cpu_ratio']['dpsgd-cells']:.3f}× "
        f"(cells) / {row['cpu_ratio']['dpsgd-patches']:.3f}× (patches), cells/patches "
        f"{row['cells_over_patches']:.3f}"
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
