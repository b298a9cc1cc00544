"""A/B of the conv Gram form in one process: DP-SGD's step with its Gram norms from
stride-sized input cells (``ConvGrads.gram_by_cells``, the rule's choice) against the same
step with them from patches (the property switched off for that contender's calls), and
the non-private step, in interleaved rounds (``step_time.interleaved_rounds``), CPU time.

Both DP-SGD contenders are one model copy's step, so they differ only in the Gram form.
Reported per setting: the median CPU ms per step, each DP-SGD form's median ratio to the
non-private step, and the median over rounds of the cells / patches ratio of the round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gram_cells_ab.py --models cnn,cnn-x16,model3-gn --json
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

from privgrad.per_sample.rules import ConvGrads  # noqa: E402
from step_time import MODELS, interleaved_rounds, make_contender  # noqa: E402  (this folder)

_CELLS = ConvGrads.gram_by_cells
_PATCHES = property(lambda self: False)


def with_gram_form(step, cells: bool):
    """``step`` with the Gram form switched to cells (the rule's choice) or to patches."""
    def run():
        ConvGrads.gram_by_cells = _CELLS if cells else _PATCHES
        try:
            step()
        finally:
            ConvGrads.gram_by_cells = _CELLS
    return run


def measure(model: str, batch: int, rounds: int, per_round: int) -> dict:
    spec = MODELS[model]
    x, y = spec.data(batch, torch.Generator().manual_seed(0))
    dpsgd = make_contender("dpsgd", spec, x, y, "cpu")
    calls = {"non-private": make_contender("non-private", spec, x, y, "cpu"),
             "dpsgd-cells": with_gram_form(dpsgd, True), "dpsgd-patches": with_gram_form(dpsgd, False)}
    for call in calls.values():
        call()
        call()
    cpu, _ = interleaved_rounds(calls, rounds, per_round)
    base = statistics.median(cpu["non-private"])
    return {"model": model, "batch": batch, "rounds": rounds, "steps_per_round": per_round,
            "cpu_ms": {n: statistics.median(v) * 1e3 for n, v in cpu.items()},
            "cpu_ratio": {n: statistics.median(v) / base for n, v in cpu.items()},
            "cells_over_patches": statistics.median(
                c / p for c, p in zip(cpu["dpsgd-cells"], cpu["dpsgd-patches"]))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="cnn,cnn-x16,model3-gn")
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
            print(f"{model} B={batch}: non-private {row['cpu_ms']['non-private']:.1f} ms, DP-SGD "
                  f"{row['cpu_ratio']['dpsgd-cells']:.3f}× (cells) / {row['cpu_ratio']['dpsgd-patches']:.3f}× "
                  f"(patches), cells/patches {row['cells_over_patches']:.3f}", file=sys.stderr)
    if args.json:
        print(json.dumps({"rows": rows, "threads": args.threads, "torch": torch.__version__,
                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


if __name__ == "__main__":
    main()
