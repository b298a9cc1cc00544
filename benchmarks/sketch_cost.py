"""What the per-step sketches of trained values cost (issue 42): after each private step,
``PrivateTrainer`` records one int64 per trained parameter tensor, the sum of its bit patterns
(``_TrainedValues.record`` in privgrad/private.py; eager, outside any captured graph: on a GPU
one reduction kernel per tensor), so that a model holding an earlier step's values is refused
at a new run's first step. For each (model, batch), privgrad's DP-SGD step and that record
alone, on the same trained parameters, run in interleaved rounds in one process (the harness
of benchmarks/step_time.py: same models, batches and timing); reported: the median time per
call of each, CPU and wall, and the record's share of the step (its time is part of the step's).

    python benchmarks/sketch_cost.py --device cuda --models cnn:256,wrn16-4:256 --json
    python benchmarks/sketch_cost.py --models cnn:8 --rounds 2   # a quick look on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import step_time  # this folder
from privgrad.private import _TrainedValues
from privgrad.records import git_commit


def measure(model: str, batch: int, rounds: int, device: torch.device) -> dict:
    """The DP-SGD step and the record of its parameters' sketches, interleaved."""
    spec = step_time.MODELS[model]
    x, y = (t.to(device) for t in spec.data(batch, torch.Generator().manual_seed(0)))
    step = step_time.make_contender("dpsgd", spec, x, y, device)
    params = [p for p in step.trainer.model.parameters() if p.requires_grad]
    values = _TrainedValues(params)  # a table of its own: the trainer's keeps its steps
    count = iter(range(1, 1 << 62))
    calls = {"dpsgd": step, "record": lambda: values.record(next(count), params)}
    step_time.run_steps("dpsgd", step, 2)
    cpu, wall = step_time.interleaved_rounds(
        calls, rounds, 3, lambda: step_time.synchronize(device)
    )
    ms = {n: (statistics.median(cpu[n]) * 1e3, statistics.median(wall[n]) * 1e3) for n in calls}
    return {
        "model": model,
        "batch": batch,
        "tensors": len(params),
        "parameters": sum(p.numel() for p in params),
        "step_cpu_ms": ms["dpsgd"][0],
        "step_wall_ms": ms["dpsgd"][1],
        "record_cpu_ms": ms["record"][0],
        "record_wall_ms": ms["record"][1],
        "record_share_wall": ms["record"][1] / ms["dpsgd"][1],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default="cnn:256,wrn16-4:256",
        help="comma-separated MODEL:BATCH, models of benchmarks/step_time.py",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of 3 calls each")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true", help="one JSON object, last line of stdout")
    args = ap.parse_args(argv)
    settings = []
    for item in args.models.split(","):
        model, _, batch = item.partition(":")
        if model not in step_time.MODELS or not batch.isdigit() or int(batch) < 1:
            ap.error(f"--models takes MODEL:BATCH from {', '.join(step_time.MODELS)}, got {item!r}")
        settings.append((model, int(batch)))
    if args.rounds < 1:
        ap.error("--rounds must be ≥ 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is available to torch " + torch.__version__)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for model, batch in settings:
        row = measure(model, batch, args.rounds, device)
        rows.append(row)
        print(
            f"{model} B={batch}: DP-SGD step {row['step_wall_ms']:.2f} ms wall, record of "
            f"{row['tensors']} sketches {row['record_wall_ms']:.3f} ms "
            f"({100 * row['record_share_wall']:.1f} % of the step)",
            file=sys.stderr,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "device": step_time.device_name(device),
                    "git_commit": os.environ.get("PRIVGRAD_COMMIT") or git_commit(),
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
