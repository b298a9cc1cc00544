"""A/B of the spectral mechanisms' chunk size in one process: Spectral-DP's and GReDP's steps
with chunks of ``_CHUNK_BYTES`` per intra-op thread (the rule) against chunks of
``_CHUNK_BYTES`` in all (the fixed size it replaced), and the non-private step, in
interleaved rounds (the driver in ``ab.py``), CPU and wall time. At 1 thread the
two are the same code: that run shows the noise floor.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spectral_chunk_ab.py --threads 2 --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

import torch  # noqa: E402

import privgrad.mechanisms.spectral as spectral  # noqa: E402
from ab import main as ab_main, with_attribute  # noqa: E402  (this folder)
from step_time import make_contender  # noqa: E402  (this folder)

PER_THREAD = spectral._CHUNK_BYTES


def with_chunk(step, fixed: bool):
    """``step`` with chunks of PER_THREAD bytes in all (``fixed``) or per thread (the rule)."""
    return with_attribute(
        step,
        spectral,
        "_CHUNK_BYTES",
        max(1, PER_THREAD // torch.get_num_threads()) if fixed else PER_THREAD,
    )


def variants(spec, x, y, device) -> dict:
    out = {}
    for mech in ("gredp", "spectral-dp"):
        step = make_contender(mech, spec, x, y, device)
        out[f"{mech} fixed"], out[f"{mech} per-thread"] = (
            with_chunk(step, True),
            with_chunk(step, False),
        )
    return out


def summary(row: dict) -> str:
    return ", ".join(
        f"{n} {row['cpu_ratio'][n]:.2f}× CPU / {row['wall_ratio'][n]:.2f}× wall"
        for n in row["cpu_ratio"]
        if n != "non-private"
    )


def main(argv=None):
    ab_main(
        argv,
        __doc__,
        "lenet5,lenet5-bc,model1",
        variants,
        {},
        summary,
        {"chunk_bytes_per_thread": PER_THREAD},
    )


if __name__ == "__main__":
    main()
