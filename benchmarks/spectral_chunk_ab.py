"""A/B of the spectral mechanisms' chunk size in one process: Spectral-DP's and GReDP's steps
with chunks of ``EngineFlags.spectral_chunk_bytes`` per intra-op thread (the rule) against
chunks of that size in all (``spectral_chunk_per_thread=False``, the fixed size it
replaced), and the non-private step, in interleaved rounds (the driver in ``ab.py``), CPU
and wall time. At 1 thread the two are the same code: that run shows the noise floor.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spectral_chunk_ab.py --threads 2 --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

from ab import main as ab_main  # noqa: E402  (this folder)
from privgrad.per_sample import EngineFlags  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)

PER_THREAD = EngineFlags().spectral_chunk_bytes


def variants(spec, x, y, device) -> dict:
    out = {}
    for mech in ("gredp", "spectral-dp"):
        for name, per_thread in (("fixed", False), ("per-thread", True)):
            flags = EngineFlags(spectral_chunk_per_thread=per_thread)
            out[f"{mech} {name}"] = make_contender(mech, spec, x, y, device, flags)
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
