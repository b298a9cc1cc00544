"""Steps per second of data-parallel private training: 1 process against N gloo processes.

Every contender trains the same model on the same synthetic MNIST-shaped data with the
same global expected batch size; N processes each handle their shard of every Poisson
batch and all-reduce the clipped sum (privgrad.distributed). The timed steps follow a
few warm-up steps; rank 0 reports steps/s over the slowest rank's time.

    python benchmarks/distributed.py                               # cnn, B=256, dpsgd
    python benchmarks/distributed.py --procs 1 2 --threads 1 2 --out results/bench/distributed.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import socket
import sys
import time

import torch


def _trainer(args, group):
    from privgrad import make_private
    from privgrad.app.models import build_model

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.n, 1, 28, 28, generator=g), torch.randint(0, 10, (args.n,), generator=g)
    torch.manual_seed(0)
    model = build_model(args.model, (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return make_private(
        model,
        opt,
        (x, y),
        mechanism=args.mechanism,
        noise_multiplier=1.0,
        batch_size=args.batch_size,
        max_grad_norm=1.0,
        distributed=group,
    )


def _time_steps(private, args, barrier) -> float:
    batches = private.batches(args.warmup + args.steps)
    for _ in range(args.warmup):
        private.step(next(batches))
    barrier()
    start = time.perf_counter()
    for batch in batches:
        private.step(batch)
    barrier()
    return time.perf_counter() - start


def _rank(rank, world, port, threads, args, out):
    from privgrad.distributed import process_group

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    with process_group() as group:
        seconds = _time_steps(_trainer(args, group), args, torch.distributed.barrier)
    if rank == 0:
        out.put(seconds)


def run(procs: int, threads: int, args) -> float:
    """Seconds for ``args.steps`` steps with ``procs`` processes of ``threads`` threads."""
    if procs == 1:  # the plain single-process path, no process group
        torch.set_num_threads(threads)
        return _time_steps(_trainer(args, None), args, lambda: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ps = [
        ctx.Process(target=_rank, args=(r, procs, port, threads, args, out)) for r in range(procs)
    ]
    for p in ps:
        p.start()
    seconds = out.get()
    for p in ps:
        p.join()
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--mechanism", default="dpsgd")
    parser.add_argument("--batch-size", type=float, default=256, help="global expected batch size")
    parser.add_argument("--n", type=int, default=10_000, help="training examples (q = B/n)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1], help="torch threads per process"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds, interleaved; the median is reported"
    )
    parser.add_argument(
        "--out", default=None, help="also write the results as a Markdown table here"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    combos = [(p, t) for p in args.procs for t in args.threads]
    times = {c: [] for c in combos}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every contender
        for c in combos:
            times[c].append(run(*c, args))
    rows = []
    for (p, t), secs in times.items():
        med = sorted(secs)[len(secs) // 2]
        rows.append(
            {
                "processes": p,
                "threads_per_process": t,
                "steps_per_s": args.steps / med,
                "seconds": secs,
            }
        )
        print(
            f"{p} process(es) x {t} thread(s): {args.steps / med:6.2f} steps/s "
            f"(median of {', '.join(f'{s:.2f}' for s in secs)} s for {args.steps} steps)"
        )
    if args.out:
        load_after = os.getloadavg()
        lines = [
            "# Data-parallel scaling: steps/s, 1 process against N gloo processes",
            "",
            f"Made by `python benchmarks/distributed.py {' '.join(sys.argv[1:])}`"
            f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
            "",
            f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}, "
            f"{platform.platform()}), "
            f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
            f"torch {torch.__version__}, backend gloo. "
            f"Load average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in load_before)}; "
            f"after: {', '.join(f'{v:.2f}' for v in load_after)}.",
            "",
            f"Model `{args.model}`, mechanism `{args.mechanism}`, global expected batch size "
            f"{args.batch_size:g}, n = {args.n} synthetic MNIST-shaped examples, "
            f"{args.steps} timed steps after {args.warmup} warm-up steps, median of "
            f"{args.repeats} interleaved rounds.",
            "",
            "| processes | threads per process | steps/s | seconds per round |",
            "|---|---|---|---|",
        ] + [
            f"| {r['processes']} | {r['threads_per_process']} | {r['steps_per_s']:.2f} | "
            f"{', '.join(f'{s:.2f}' for s in r['seconds'])} |"
            for r in rows
        ]
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
