"""A/B of the CUDA choices in one process, on a GPU: privgrad's step as the rules take it
on CUDA (chunks of ``CUDA_CHUNK_FLOATS``, conv per-sample gradients built from patches
copied in one strided copy and one batched matmul) against the same step with the CPU's chunk size (``_CHUNK_FLOATS`` for the
per-sample rules, 4 MB for the spectral mechanisms: 2 MB per thread at 2 threads) and
against the CPU's builds (input channels correlated for ≤ 3 input channels, samples as
groups otherwise), against the same step with TF32 left on where PyTorch's defaults allow
it (``float32_arithmetic`` made a no-op: what the float32 guard costs), and the
non-private step, in interleaved rounds (the driver in ``ab.py``). Each step waits for the
GPU at the end of its timed block: read wall ratios.

    python benchmarks/cuda_ab.py --device cuda --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

import contextlib  # noqa: E402

import privgrad.mechanisms.base as mechanism_base  # noqa: E402
from ab import main as ab_main, with_attribute  # noqa: E402  (this folder)
from privgrad.per_sample import engine, rules  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)

CPU_BUILDS = property(lambda self: "correlation" if self.module.in_channels <= 3 else "grouped")


def with_cpu_chunks(step):
    """``step`` with the CUDA chunk budget set to the CPU's (``rules.chunk_bytes``: the rules
    and the spectral mechanisms)."""
    return with_attribute(step, rules, "CUDA_CHUNK_FLOATS", rules._CHUNK_FLOATS)


def with_cpu_builds(step):
    """``step`` with conv per-sample gradients built the CPU's way."""
    return with_attribute(step, rules.ConvGrads, "build_form", CPU_BUILDS)


def with_tf32(step):
    """``step`` without the float32 guard: TF32 wherever PyTorch's settings allow it."""
    for owner in (rules, engine, mechanism_base):
        step = with_attribute(step, owner, "float32_arithmetic", contextlib.nullcontext)
    return step


def variants(spec, x, y, device) -> dict:
    out = {}
    for mech in ("spectral-dp", "gredp") if "gredp" in spec.contenders else ("dpsgd",):
        step = make_contender(mech, spec, x, y, device)
        out.update(
            {
                mech: step,
                f"{mech}-cpu-chunks": with_cpu_chunks(step),
                f"{mech}-cpu-builds": with_cpu_builds(step),
                f"{mech}-tf32": with_tf32(step),
            }
        )
    return out


PAIRS = {
    f"{m}_over_{m}-{what}": (m, f"{m}-{what}")
    for m in ("dpsgd", "spectral-dp", "gredp")
    for what in ("cpu-chunks", "cpu-builds", "tf32")
}


def summary(row: dict) -> str:
    return (
        ", ".join(
            f"{key.split('_over_')[0]} / {key.split('_over_')[1]} {row[key + '_wall']:.3f}"
            for key in PAIRS
            if key in row
        )
        + " (wall, median per round)"
    )


def main(argv=None):
    ab_main(
        argv,
        __doc__,
        "cnn,cnn-x16,model3-gn,transformer,lenet5,model1,lenet5-bc",
        variants,
        PAIRS,
        summary,
    )


if __name__ == "__main__":
    main()
