"""Where a private step's GPU time goes (issue 42): for each (model, batch), the non-private
step and privgrad's DP-SGD step, profiled with ``torch.profiler`` over a few steps after
warm-up, give per step: wall time (synchronised), the summed time of the GPU kernels, the
number of kernel launches and of memory copies/sets, and the GPU's busy fraction (kernel time
over wall time: well below 1 means the step waits on the host, i.e. launch- or Python-bound).
The DP step's kernels are grouped by name, the most expensive listed. The ratio of kernel
times (DP over non-private) is what removing every launch gap could reach; the ratio of
launches is what CUDA graphs or fusion would have to remove.

    python benchmarks/gpu_profile.py --models cnn:256,wrn16-4:256 --json > out.json
    python benchmarks/gpu_profile.py --table out.json   # its table (results/bench/README.md's)

Models and contenders are benchmarks/step_time.py's (same builds, same batches).
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import step_time  # this folder
from privgrad.records import git_commit


def profile_contender(step, steps: int, device) -> dict:
    """Per-step wall time (ms, median of ``steps`` synchronised steps, unprofiled), then one
    profiled block of ``steps`` steps: kernel time, launches, copies per step, top kernels."""
    walls = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    kernel_us, launches, copies = 0.0, 0, 0
    by_name = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, us = e.name, e.time_range.elapsed_us()
        if name.startswith("Memcpy") or name.startswith("Memset"):
            copies += 1
            continue
        kernel_us += us
        launches += 1
        by_name[name][0] += 1
        by_name[name][1] += us
    wall_ms = statistics.median(walls) * 1e3
    kernel_ms = kernel_us / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "wall_ms": round(wall_ms, 3),
        "kernel_ms": round(kernel_ms, 3),
        "busy": round(kernel_ms / wall_ms, 3) if wall_ms else None,
        "launches": launches / steps,
        "copies_sets": copies / steps,
        "top_kernels": [
            {"name": n[:120], "calls": c / steps, "ms": round(us / 1e3 / steps, 4)}
            for n, (c, us) in top
        ],
    }


def markdown_table(saved: dict) -> str:
    """The Markdown table of a saved ``--json`` output (results/bench/README.md's): per row the
    wall and kernel times, their ratios to the same setting's non-private step, the busy
    fraction and the launches."""
    lines = [
        "| model | batch | contender | wall ms | kernel ms | × non-private (wall) "
        "| × non-private (kernels) | busy | launches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["model"], r["batch"]): r
        for r in saved["rows"]
        if r["contender"] == "non-private" and "wall_ms" in r
    }
    for r in saved["rows"]:
        if "wall_ms" not in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['contender']} |" + " – |" * 6)
            continue
        b = base[(r["model"], r["batch"])]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['contender']} | {r['wall_ms']:.2f} "
            f"| {r['kernel_ms']:.2f} | {r['wall_ms'] / b['wall_ms']:.2f} "
            f"| {r['kernel_ms'] / b['kernel_ms']:.2f} | {r['busy']:.2f} | {r['launches']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default="cnn:256,cnn-x16:256,model3-gn:256,transformer:64,wrn16-4:256,wrn16-4:1024",
        help="comma-separated MODEL:BATCH (models of benchmarks/step_time.py)",
    )
    ap.add_argument("--contenders", default="non-private,dpsgd,non-private-bf16,dpsgd-bf16")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps (and timed steps)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved --json output")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.loads(f.read().strip().splitlines()[-1])))
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    for item in args.models.split(","):
        model, batch = item.split(":")
        spec = step_time.MODELS[model]
        x, y = (t.to(device) for t in spec.data(int(batch), torch.Generator().manual_seed(0)))
        for name in args.contenders.split(","):
            try:
                step = step_time.make_contender(name, spec, x, y, device)
                for _ in range(args.warmup):
                    step()
                row = profile_contender(step, args.steps, device)
            except Exception as e:  # noqa: BLE001 (a contender that cannot run: noted in its row)
                row = {"skipped": f"{type(e).__name__}: {e}"[:300]}
            row.update(model=model, batch=int(batch), contender=name)
            rows.append(row)
            print(
                f"{model:>12} {batch:>5} {name:<18} "
                + (
                    f"wall {row['wall_ms']:8.2f} ms  kernels {row['kernel_ms']:8.2f} ms  "
                    f"busy {row['busy']:.2f}  launches {row['launches']:7.0f}  "
                    f"copies {row['copies_sets']:5.0f}"
                    if "wall_ms" in row
                    else row["skipped"]
                ),
                file=sys.stderr,
                flush=True,
            )
            del step
            torch.cuda.empty_cache()
    if args.json:
        print(
            json.dumps(
                {
                    "device_name": torch.cuda.get_device_name(device),
                    "torch": torch.__version__,
                    # the device's copy of the tree has no .git: gpu_session.sh passes the commit
                    "git_commit": os.environ.get("PRIVGRAD_COMMIT") or git_commit(),
                    "command": "python benchmarks/gpu_profile.py " + " ".join(argv or sys.argv[1:]),
                    "rows": rows,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
