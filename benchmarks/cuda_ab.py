"""A/B of the CUDA choices in one process, on a GPU: privgrad's step as the rules take it
on CUDA (chunks of ``EngineFlags.cuda_chunk_floats``, conv per-sample gradients built from
patches copied in one strided copy and one batched matmul) against the same step with the
CPU's chunk size (``cuda_chunk_floats=chunk_floats``, for the per-sample rules and the
spectral mechanisms alike), against the CPU's builds (``conv_build="cpu"``: input channels
correlated for ≤ 3 input channels, samples as groups otherwise), against the same step with
TF32 left on where PyTorch's defaults allow it (``float32_guard=False``: what the guard
costs), and the non-private step, in interleaved rounds (the driver in ``ab.py``). Each step
waits for the GPU at the end of its timed block: read wall ratios.

    python benchmarks/cuda_ab.py --device cuda --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

from ab import main as ab_main  # noqa: E402  (this folder)
from privgrad.per_sample import EngineFlags  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)

# contender suffix: the flags it runs with ("" is the engine's own choices)
FLAGS = {
    "": EngineFlags(),
    "-cpu-chunks": EngineFlags(cuda_chunk_floats=EngineFlags().chunk_floats),
    "-cpu-builds": EngineFlags(conv_build="cpu"),
    "-tf32": EngineFlags(float32_guard=False),
}


def variants(spec, x, y, device) -> dict:
    return {
        mech + suffix: make_contender(mech, spec, x, y, device, flags)
        for mech in (("spectral-dp", "gredp") if "gredp" in spec.contenders else ("dpsgd",))
        for suffix, flags in FLAGS.items()
    }


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
