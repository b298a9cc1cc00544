"""A/B of the spectral mechanisms' chunk size in one process: Spectral-DP's and GReDP's steps
with chunks of ``_CHUNK_BYTES`` per intra-op thread (the rule) against chunks of
``_CHUNK_BYTES`` in all (the fixed size it replaced), and the non-private step, in
interleaved rounds (``step_time.interleaved_rounds``), CPU and wall time. At 1 thread the
two are the same code: that run shows the noise floor.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spectral_chunk_ab.py --threads 2 --json
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read when the OpenMP runtime loads: re-exec
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

import privgrad.mechanisms.spectral as spectral  # noqa: E402
from step_time import MODELS, interleaved_rounds, make_contender  # noqa: E402  (this folder)

PER_THREAD = spectral._CHUNK_BYTES


def with_chunk(step, fixed: bool):
    """``step`` with chunks of PER_THREAD bytes in all (``fixed``) or per thread (the rule)."""
    def run():
        spectral._CHUNK_BYTES = max(1, PER_THREAD // torch.get_num_threads()) if fixed else PER_THREAD
        try:
            step()
        finally:
            spectral._CHUNK_BYTES = PER_THREAD
    return run


def measure(model: str, batch: int, rounds: int, per_round: int) -> dict:
    spec = MODELS[model]
    x, y = spec.data(batch, torch.Generator().manual_seed(0))
    calls = {"non-private": make_contender("non-private", spec, x, y, "cpu")}
    for mech in ("gredp", "spectral-dp"):
        step = make_contender(mech, spec, x, y, "cpu")
        calls[f"{mech} fixed"] = with_chunk(step, True)
        calls[f"{mech} per-thread"] = with_chunk(step, False)
    for call in calls.values():
        call()
        call()
    cpu, wall = interleaved_rounds(calls, rounds, per_round)
    base, base_wall = statistics.median(cpu["non-private"]), statistics.median(wall["non-private"])
    return {"model": model, "batch": batch, "rounds": rounds, "steps_per_round": per_round,
            "cpu_ms": {n: statistics.median(v) * 1e3 for n, v in cpu.items()},
            "cpu_ratio": {n: statistics.median(v) / base for n, v in cpu.items()},
            "wall_ratio": {n: statistics.median(v) / base_wall for n, v in wall.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lenet5,lenet5-bc,model1")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = ap.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        for batch in MODELS[model].batches:
            row = measure(model, batch, args.rounds, args.steps_per_round)
            rows.append(row)
            print(f"{model} B={batch}: " + ", ".join(
                f"{n} {row['cpu_ratio'][n]:.2f}× CPU / {row['wall_ratio'][n]:.2f}× wall"
                for n in row["cpu_ratio"] if n != "non-private"), file=sys.stderr)
    if args.json:
        print(json.dumps({"rows": rows, "threads": args.threads, "chunk_bytes_per_thread": PER_THREAD,
                          "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


if __name__ == "__main__":
    main()
