"""Time one training step: non-private, privgrad's mechanisms, and Opacus if installed.

All steps run in the same process on the same model, data and thread count, in
interleaved rounds (so drift in machine speed hits every contender alike); the median
step time of each is reported with its ratio to the non-private step.

    python benchmarks/step_time.py                      # CNN, batch 256, DP-SGD (+ Opacus)
    python benchmarks/step_time.py --model lenet5 --mechanisms dpsgd
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from privgrad.mechanisms import build_mechanism
from privgrad.models import build_model
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy


def non_private_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def privgrad_step(model, x, y, mechanism: str):
    sampler = GradSampler(model)
    mech = build_mechanism(mechanism, noise_multiplier=1.0, max_grad_norm=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)

    def step():
        per_sample, _ = sampler.compute(x, y, per_sample_cross_entropy)
        grads, _, _ = mech.privatize(per_sample, len(x), gen)
        for p, g in zip(per_sample.params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def opacus_step(model, x, y):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    gsm = GradSampleModule(model)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.01), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=len(x))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--mechanisms", default="dpsgd", help="comma-separated privgrad mechanisms")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--no-opacus", action="store_true")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    shape = (1, 28, 28)
    x = torch.randn(args.batch_size, *shape)
    y = torch.randint(0, 10, (args.batch_size,))
    fresh = lambda: build_model(args.model, shape, 10)  # noqa: E731
    contenders = {"non-private": non_private_step(fresh(), x, y)}
    for name in args.mechanisms.split(","):
        contenders[f"privgrad {name}"] = privgrad_step(fresh(), x, y, name)
    if not args.no_opacus:
        try:
            contenders["opacus dpsgd"] = opacus_step(fresh(), x, y)
        except ImportError:
            print("(opacus not installed: pip install -e '.[bench]' to compare)")
    times = {name: [] for name in contenders}
    for step in contenders.values():  # warm-up
        for _ in range(3):
            step()
    for _ in range(args.rounds):
        for name, step in contenders.items():
            t = time.perf_counter()
            for _ in range(args.steps_per_round):
                step()
            times[name].append((time.perf_counter() - t) / args.steps_per_round)
    base = statistics.median(times["non-private"])
    print(f"model {args.model}, batch {args.batch_size}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds × {args.steps_per_round} steps")
    print(f"{'step':<24} {'ms':>8} {'× non-private':>14}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<24} {med * 1e3:8.2f} {med / base:14.2f}")


if __name__ == "__main__":
    main()
