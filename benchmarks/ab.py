"""The drivers shared by the in-process A/B benchmarks (``gram_cells_ab.py``,
``gram_blocks_ab.py``, ``lag_sum_ab.py``, ``spectral_chunk_ab.py``, ``spectral_padding_ab.py``,
``cuda_ab.py``), on the CPU or a GPU: per (model, batch) of ``step_time.py``'s models, the
non-private step and the variants' steps, each variant a privgrad step whose engine runs with
other :class:`~privgrad.per_sample.EngineFlags` (``step_time.make_contender``'s ``flags``), each
on its own copy of the model (same initial weights), warmed up twice, then timed
in interleaved rounds (``step_time.interleaved_rounds``). Reported per setting: the median CPU
ms per step, the median CPU and wall ratios to the non-private step, and, for named pairs of
variants, the median over rounds of the pair's CPU (``key``) and wall (``key_wall``) ratio in
the round."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable

import torch

import torch.nn.functional as F

from privgrad.inputs import call_model
from step_time import (
    MODELS,
    device_name,
    interleaved_rounds,
    make_contender,
    synchronize,
)  # this folder


def measure(
    model: str,
    batch: int,
    rounds: int,
    per_round: int,
    variants: Callable,
    pairs: dict[str, tuple[str, str]],
    device: torch.device = torch.device("cpu"),
) -> dict:
    """One setting: ``variants(spec, x, y, device)`` gives {name: step} beside the non-private
    step; ``pairs`` names {key: (variant, variant)} whose per-round CPU ratio is reported where
    both ran
    (on CUDA, read the wall ratios: each timed block ends by waiting for the GPU)."""
    spec = MODELS[model]
    x, y = (t.to(device) for t in spec.data(batch, torch.Generator().manual_seed(0)))
    calls = {
        "non-private": make_contender("non-private", spec, x, y, device),
        **variants(spec, x, y, device),
    }
    pairs = {key: (a, b) for key, (a, b) in pairs.items() if a in calls and b in calls}
    for call in calls.values():
        call()
        call()
    cpu, wall = interleaved_rounds(calls, rounds, per_round, lambda: synchronize(device))
    base, base_wall = statistics.median(cpu["non-private"]), statistics.median(wall["non-private"])
    return {
        "model": model,
        "batch": batch,
        "rounds": rounds,
        "steps_per_round": per_round,
        "cpu_ms": {n: statistics.median(v) * 1e3 for n, v in cpu.items()},
        "cpu_ratio": {n: statistics.median(v) / base for n, v in cpu.items()},
        "wall_ratio": {n: statistics.median(v) / base_wall for n, v in wall.items()},
        **{
            key: statistics.median(p / q for p, q in zip(cpu[a], cpu[b]))
            for key, (a, b) in pairs.items()
        },
        **{
            key + "_wall": statistics.median(p / q for p, q in zip(wall[a], wall[b]))
            for key, (a, b) in pairs.items()
        },
    }


def main(
    argv,
    doc: str,
    default_models: str,
    variants: Callable,
    pairs: dict[str, tuple[str, str]],
    summary: Callable[[dict], str],
    extra: dict | None = None,
) -> None:
    """The command line of an A/B script: ``summary(row)`` is its line on stderr per setting,
    ``extra`` goes into the JSON object (printed last with ``--json``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--models", default=default_models)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is available to torch " + torch.__version__)
    device = torch.device(args.device)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        for batch in MODELS[model].batches:
            row = measure(model, batch, args.rounds, args.steps_per_round, variants, pairs, device)
            rows.append(row)
            print(f"{model} B={batch}: {summary(row)}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "threads": args.threads,
                    "device": args.device,
                    "device_name": device_name(device),
                    **(extra or {}),
                    "torch": torch.__version__,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                }
            )
        )


def fixed_batch_main(
    doc: str,
    models: str,
    batch_size: int,
    per_round: int,
    ways: tuple[str, str],
    build: Callable,
    private: Callable,
    classes: int = 10,
) -> None:
    """The command line of an A/B of two ways of privgrad's step on models of its own
    (``own_params_ab.py``, ``depthwise_ab.py``): per model name, ``build(name)`` gives
    ``(model, inputs)`` (``inputs(n, generator)``: a batch of n examples, a tensor or the
    model's keyword arguments); the non-private step and ``private(model, x, y, way)`` for
    each of ``ways`` each step a copy of the model (same initial weights) on one fixed batch,
    warmed up twice, then timed in interleaved rounds. Printed: a Markdown table of the median
    CPU ms per step and the median per round of the CPU and wall ratios to the non-private
    step, then the median per round of ``ways[1]``'s CPU time over ``ways[0]``'s."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--models", default=models)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=per_round)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B = {args.batch_size}")
    print("| model | contender | CPU ms/step | × non-private (CPU) | × non-private (wall) |")
    print("|---|---|---|---|---|")
    pairs = {}
    for name in args.models.split(","):
        calls = {}
        for contender in ("non-private", *ways):
            torch.manual_seed(0)
            model, inputs = build(name)
            g = torch.Generator().manual_seed(0)
            x = inputs(args.batch_size, g)
            y = torch.randint(0, classes, (args.batch_size,), generator=g)
            if contender == "non-private":
                calls[contender] = _non_private(model, x, y)
            else:
                calls[contender] = private(model, x, y, contender)
            for _ in range(2):
                calls[contender]()
        cpu, wall = interleaved_rounds(calls, args.rounds, args.per_round)
        for contender in calls:
            ratio = statistics.median(c / n for c, n in zip(cpu[contender], cpu["non-private"]))
            wall_ratio = statistics.median(
                w / n for w, n in zip(wall[contender], wall["non-private"])
            )
            print(
                f"| {name} | {contender} | {1e3 * statistics.median(cpu[contender]):.1f} | "
                f"{ratio:.2f} | {wall_ratio:.2f} |"
            )
        second, first = cpu[ways[1]], cpu[ways[0]]
        pairs[name] = statistics.median(b / a for b, a in zip(second, first))
    print()
    for name, ratio in pairs.items():
        print(f"{name}: {ways[1]} / {ways[0]}, CPU per round (median): {ratio:.2f}")


def _non_private(model, x, y):
    """SGD on the batch's mean cross-entropy (the model called on ``x`` as make_private
    calls it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(call_model(model, x), y).backward()
        opt.step()

    return step
