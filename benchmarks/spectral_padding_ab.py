"""A/B of how the spectral mechanisms pad their signals, in one process: Spectral-DP's and
GReDP's steps with each chunk's signals written into zero-padded buffers that keep their
zeros (``SpectralConvGrads._chunk_spectra``, the rule) against the same steps padding each
chunk afresh (``F.pad``, ``flip``, and the FFTs' own padding: what it replaced), and the
non-private step, in interleaved rounds (the driver in ``ab.py``), CPU and wall time.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spectral_padding_ab.py --json
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch is imported
    from passive_omp import reexec_with_passive_omp  # this folder

    reexec_with_passive_omp(__file__)

import torch  # noqa: E402

import privgrad.mechanisms.spectral as spectral  # noqa: E402
from ab import main as ab_main, with_attribute  # noqa: E402  (this folder)
from step_time import make_contender  # noqa: E402  (this folder)


def padded_afresh(self, call, x, g, L, outs):
    """Each chunk padded afresh (what ``_chunk_spectra`` replaced): ``F.pad`` and ``flip`` of
    the input (``_signals``), then the FFTs' own padding to L, rows first."""
    return tuple(
        torch.fft.fft(torch.fft.rfft(t, n=L[1]).transpose(-1, -2), n=L[0], out=o)
        for t, o in zip(self._signals(x, g), outs)
    )


def variants(spec, x, y, device) -> dict:
    out = {}
    for mech in ("gredp", "spectral-dp"):
        step = make_contender(mech, spec, x, y, device)
        out[f"{mech}-kept-zeros"] = step
        out[f"{mech}-afresh"] = with_attribute(
            step, spectral.SpectralConvGrads, "_chunk_spectra", padded_afresh
        )
    return out


PAIRS = {
    f"{m}_kept_over_afresh": (f"{m}-kept-zeros", f"{m}-afresh") for m in ("gredp", "spectral-dp")
}


def summary(row: dict) -> str:
    return (
        ", ".join(
            f"{m} {row['cpu_ratio'][m + '-kept-zeros']:.2f}× (kept zeros) / "
            f"{row['cpu_ratio'][m + '-afresh']:.2f}× (afresh), per round {row[m + '_kept_over_afresh']:.3f}"
            for m in ("gredp", "spectral-dp")
        )
        + " (CPU)"
    )


def main(argv=None):
    ab_main(argv, __doc__, "lenet5,lenet5-bc,model1", variants, PAIRS, summary)


if __name__ == "__main__":
    main()
