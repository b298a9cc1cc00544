"""A/B of the cell Gram's lag sum in one process: DP-SGD's step with the kernel's lags summed
as one reduction over a strided view (``EngineFlags(lag_sum="view")``, the rule's form on
CUDA) against the same step with them summed as lagged slices (``lag_sum="slices"``, on CPU),
and the non-private step, in interleaved rounds (the driver in ``ab.py``), CPU and wall time (on
CUDA read the wall ratios). The models are those whose conv layers take the Gram form from
cells: the CNN's second conv, the ×16 CNN's, model3-GN's 8×8 convs, WRN-16-4's 16×16 and
8×8 stages.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/lag_sum_ab.py --json
    python benchmarks/lag_sum_ab.py --device cuda --models wrn16-4,model3-gn,cnn-x16,cnn --json
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
        f"dpsgd-{form}": make_contender("dpsgd", spec, x, y, device, EngineFlags(lag_sum=form))
        for form in ("view", "slices")
    }


def summary(row: dict) -> str:
    ratio = row["cpu_ratio"]
    return (
        f"DP-SGD {ratio['dpsgd-view']:.3f}× (view) / {ratio['dpsgd-slices']:.3f}× (slices) CPU; "
        f"view/slices CPU {row['view_over_slices']:.3f}, wall {row['view_over_slices_wall']:.3f}"
    )


def main(argv=None):
    ab_main(
        argv,
        __doc__,
        "cnn,cnn-x16,model3-gn",
        variants,
        {"view_over_slices": ("dpsgd-view", "dpsgd-slices")},
        summary,
    )


if __name__ == "__main__":
    main()
