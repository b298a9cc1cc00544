"""A/B of how the spectral mechanisms pad their signals, in one process: Spectral-DP's and
GReDP's steps with each chunk's signals written into zero-padded buffers that keep their
zeros (``EngineFlags(spectral_padding="kept-zeros")``, the rule) against the same steps
padding each chunk afresh (``spectral_padding="afresh"``: ``F.pad``, ``flip``, and the FFTs'
own padding, what it replaced), and the non-private step, in interleaved rounds (the driver
in ``ab.py``), CPU and wall time.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spectral_padding_ab.py --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

from ab import main as ab_main  # noqa: E402  (this folder)
from privgrad.per_sample import EngineFlags  # noqa: E402
from step_time import make_contender  # noqa: E402  (this folder)


def variants(spec, x, y, device) -> dict:
    out = {}
    for mech in ("gredp", "spectral-dp"):
        for padding in ("kept-zeros", "afresh"):
            flags = EngineFlags(spectral_padding=padding)
            out[f"{mech}-{padding}"] = make_contender(mech, spec, x, y, device, flags)
    return out


PAIRS = {
    f"{m}_kept_over_afresh": (f"{m}-kept-zeros", f"{m}-afresh") for m in ("gredp", "spectral-dp")
}


def summary(row: dict) -> str:
    return (
        ", ".join(
            f"{m} {row['cpu_ratio'][m + '-kept-zeros']:.2f}× (kept zeros) / "
            f"{row['cpu_ratio'][m + '-afresh']:.2f}× (afresh), "
            f"per round {row[m + '_kept_over_afresh']:.3f}"
            for m in ("gredp", "spectral-dp")
        )
        + " (CPU)"
    )


def main(argv=None):
    ab_main(argv, __doc__, "lenet5,lenet5-bc,model1", variants, PAIRS, summary)


if __name__ == "__main__":
    main()
