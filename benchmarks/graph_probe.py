"""Can a private step be captured in a CUDA graph, and what would replaying it save (issue 42,
item 2)? For each (model, batch) of benchmarks/step_time.py, each part below is captured with
``torch.cuda.graph`` in a fresh process (a failed capture can leave the device unusable), and
either the first operation that refuses capture is reported (its error and the privgrad line
that ran it) or the captured part is replayed and timed against running it eagerly:

- ``non-private``: forward, backward and SGD update of the non-private step;
- ``per-sample``: privgrad's forward and backward with the per-sample norm rules
  (``GradSampler.compute``);
- ``norms``: the per-sample squared norms of those gradients (every layer's rule), without
  the chain's check that they are finite;
- ``chain``: DP-SGD's chain on those per-sample gradients (clip, sum, noise:
  ``Mechanism.privatize``), its noise generator registered with the graph;
- ``stage-K``: the chain's stage K alone (0: clip, 1: sum, 2: noise, 3: scale), on the state
  the stages before it left, so that one refusing stage does not hide the others;
- ``update``: the optimizer's step on the chain's result;
- ``step``: the whole private step (``PrivateTrainer._step``).

    python benchmarks/gpu_profile.py ...   # where the time goes
    python benchmarks/graph_probe.py --models cnn:256,wrn16-4:256 > probe.jsonl
    python benchmarks/graph_probe.py --table probe.jsonl   # its table (results/bench/README.md's)

One JSON line per (model, batch, part) on stdout; a summary on stderr. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from dataclasses import replace

import torch
import torch.nn.functional as F

import step_time  # this folder
from privgrad.mechanisms.stages import StepState
from privgrad.per_sample.rules import float32_arithmetic

PARTS = (
    "non-private",
    "per-sample",
    "norms",
    "chain",
    "stage-1",
    "stage-2",
    "stage-3",
    "update",
    "step",
)


def _where(e: BaseException) -> str:
    """The innermost privgrad frame of ``e``'s traceback (file:line function)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "privgrad" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"


def _time(call, n: int) -> float:
    """Mean wall ms per call over ``n`` synchronised calls."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _part(part: str, model_name: str, batch: int, device):
    """(eager callable, generators to register) for one part."""
    spec = step_time.MODELS[model_name]
    x, y = (t.to(device) for t in spec.data(batch, torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    model = spec.build().to(device)
    if part == "non-private":
        opt = torch.optim.SGD(model.parameters(), lr=step_time.LR)

        def call():
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return call, []
    trainer = step_time.privgrad_step("dpsgd", model, x, y).trainer
    gens = [trainer.noise_generator] if trainer.noise_generator.device.type == "cuda" else []
    if part == "per-sample":
        return lambda: trainer.grad_sampler.compute(x, y, trainer.loss_fn), []
    if part == "step":
        return lambda: trainer._step(x, y), gens
    per_sample, _ = trainer.grad_sampler.compute(x, y, trainer.loss_fn)
    guard = per_sample.flags.float32_guard

    def chain():
        return trainer.mechanism.privatize(
            per_sample, trainer.sampler.expected_batch_size, trainer.noise_generator
        )

    if part == "norms":

        def norms():
            with float32_arithmetic(guard):
                return per_sample.norms_sq()

        return norms, []
    if part == "chain":
        return chain, gens
    if part.startswith("stage-"):
        return _stage(trainer, per_sample, int(part.removeprefix("stage-"))), gens
    if part == "update":
        grads, _, _ = chain()

        def update():  # as PrivateTrainer's step: the update aligned with per_sample.params
            for p, g in zip(per_sample.params, grads):
                p.grad = g
            trainer.optimizer.step()

        return update, []
    raise ValueError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")


def _stage(trainer, per_sample, k: int):
    """Stage ``k`` of DP-SGD's chain alone, on the state the stages before it left (run
    eagerly once); each call starts from a shallow copy of that state."""
    stages, guard = trainer.mechanism.stages, per_sample.flags.float32_guard
    state = StepState(per_sample, trainer.sampler.expected_batch_size, trainer.noise_generator)
    with float32_arithmetic(guard):
        for stage in stages[:k]:
            state = stage(state)

    def call():
        with float32_arithmetic(guard):
            return stages[k](replace(state, noise=[]))

    return call


def probe(part: str, model_name: str, batch: int, steps: int) -> dict:
    device = torch.device("cuda")
    row = {"model": model_name, "batch": batch, "part": part}
    call, gens = _part(part, model_name, batch, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    row["eager_ms"] = round(_time(call, steps), 4)
    graph = torch.cuda.CUDAGraph()
    for g in gens:
        graph.register_generator_state(g)
    try:
        with torch.cuda.graph(graph):
            call()
    except Exception as e:  # noqa: BLE001 (the refusal is the finding)
        first = e
        while first.__context__ is not None:  # ending a broken capture raises anew
            first = first.__context__
        row.update(captured=False, error=f"{type(first).__name__}: {first}"[:400])
        row["where"] = _where(first)
        return row
    row.update(captured=True, replay_ms=round(_time(graph.replay, steps), 4))
    return row


def markdown_table(rows: list[dict]) -> str:
    """results/bench/README.md's table of saved rows: per part its eager time and either its
    replay time (and the ratio) or the privgrad line that refused capture."""
    lines = [
        "| model | batch | part | eager ms | replayed ms | eager / replayed | refused at |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("captured"):
            cells = [f"{r['replay_ms']:.2f}", f"{r['eager_ms'] / r['replay_ms']:.1f}", ""]
        else:
            cells = ["–", "–", f"`{r.get('where') or r.get('crashed', '')}`"]
        eager = f"{r['eager_ms']:.2f}" if "eager_ms" in r else "–"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['part']} | {eager} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn:256,wrn16-4:256,transformer:64")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one", metavar="MODEL:BATCH:PART", help=argparse.SUPPRESS)
    ap.add_argument("--table", metavar="JSONL", help="print the table of saved output")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_table([json.loads(line) for line in f if line.strip()]))
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    if args.one:  # the child process: one probe, one JSON line
        model, batch, part = args.one.split(":")
        print(json.dumps(probe(part, model, int(batch), args.steps)), flush=True)
        return 0
    for item in args.models.split(","):
        for part in args.parts.split(","):
            one = f"{item}:{part}"
            done = subprocess.run(
                [sys.executable, __file__, "--one", one, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode or not lines:
                model, batch = item.split(":")
                tail = done.stderr.strip().splitlines()[-1:] or [""]
                row = {"model": model, "batch": int(batch), "part": part, "crashed": tail[0]}
            else:
                row = json.loads(lines[-1])
            row["device_name"] = torch.cuda.get_device_name()
            row["git_commit"] = os.environ.get("PRIVGRAD_COMMIT", "")
            print(json.dumps(row), flush=True)
            print(
                f"{one:>24}: eager {row.get('eager_ms', '-')} ms, "
                + (
                    f"replay {row['replay_ms']} ms"
                    if row.get("captured")
                    else f"refused: {row.get('error') or row.get('crashed')} at {row.get('where')}"
                ),
                file=sys.stderr,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
