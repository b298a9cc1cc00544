"""Peak live tensor memory of one training step, on the CPU, with what holds it at the peak.

A dispatch mode sees every tensor an op makes during the step (forward, backward, privgrad's
rules and chain, the optimizer), keeps a weak reference to its storage, and after each op sums
the storages still alive: the peak of that sum is the step's peak extra memory, the quantity
``step_time.py`` reads on CUDA from the caching allocator (``max_memory_allocated`` over the
bytes allocated before the step), here measured without a GPU. Storages alive before the step
(parameters, the batch, and the state a first, unmeasured step made: optimizer moments, kept
workspaces) are not counted; ``step_time.py``'s CUDA probe counts the first step's lazy state.
At the peak, the live storages are listed by the op and the privgrad or model line that made
them.

Unless ``--cpu-forms`` is given, privgrad's engine takes the forms it takes on CUDA (conv
gradients built from patches, chunks of ``cuda_chunk_floats``, lag sums over a strided view):
the peak is then the one a GPU run would see, up to what CUDA adds outside tensors (cuDNN
workspaces) and the fused kernels that auto takes for some linear layers on CUDA only.

    python benchmarks/live_memory.py --models wrn16-4 --batch-size 256
    python benchmarks/live_memory.py --models cnn --batch-size 64 --contenders dpsgd --top 5
    # add the rows to a saved file (one code version per file), then tabulate two such files
    # beside a GPU run's allocator peaks (the table of results/bench/README.md):
    python benchmarks/live_memory.py --models cnn --batch-size 256 --out results/bench/x.json
    python benchmarks/live_memory.py --table BEFORE.json AFTER.json \
        --gpu results/bench/step_time_gpu_a5efe05.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import traceback
import warnings
from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import step_time  # this folder
from privgrad.per_sample import EngineFlags
from privgrad.records import git_commit

MB = 2**20


def cpu_storage(t) -> torch.UntypedStorage | None:
    """A CPU tensor's storage; None for another device or layout, or a tensor with no
    storage to read (a lazy module's parameter, a fake or functional tensor)."""
    try:
        if t.device.type != "cpu" or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        storage.data_ptr()  # a functional tensor's storage has one, whose pointer raises
        return storage
    except (RuntimeError, NotImplementedError, ValueError):
        return None


def made_where() -> str:
    """The innermost privgrad, model or benchmark lines on the stack, innermost first."""
    frames = [
        f
        for f in traceback.extract_stack()[:-3]
        if "/privgrad/" in f.filename or "/benchmarks/" in f.filename
    ]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:][::-1])


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the storages that ops make while the mode is on and are still
    alive after each op; ``peak`` is their most, ``at_peak`` (bytes, label) per storage then."""

    def __init__(self, label=made_where):
        super().__init__()
        self.label = label
        self.before = {}  # data pointer -> weak reference, storages alive at the start
        with warnings.catch_warnings():  # isinstance on a deprecated module attribute warns
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for s in (cpu_storage(t) for t in tensors):
            if s is not None:
                self.before[s.data_ptr()] = StorageWeakRef(s)
        self.live = {}  # data pointer -> (weak reference, bytes, label)
        self.peak, self.at_peak = 0, []

    def _existed(self, ptr: int) -> bool:
        ref = self.before.get(ptr)
        return ref is not None and not ref.expired()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            s = cpu_storage(t) if isinstance(t, torch.Tensor) else None
            if s is None:
                continue
            ptr, size = s.data_ptr(), s.nbytes()
            known = self.live.get(ptr)
            if size and not self._existed(ptr) and (known is None or known[0].expired()):
                self.live[ptr] = (StorageWeakRef(s), size, f"{func.__name__} @ {self.label()}")
        for ptr in [p for p, r in self.live.items() if r[0].expired()]:
            del self.live[ptr]
        now = sum(r[1] for r in self.live.values())
        if now > self.peak:
            self.peak, self.at_peak = now, [(r[1], r[2]) for r in self.live.values()]
        return out


def peak_of(step) -> LiveBytes:
    """One call of ``step`` under :class:`LiveBytes`."""
    gc.collect()
    with LiveBytes() as live:
        step()
    return live


def largest_holders(live: LiveBytes, top: int) -> list[dict]:
    """The ``top`` labels holding the most bytes at the peak."""
    held, count = collections.Counter(), collections.Counter()
    for size, label in live.at_peak:
        held[label] += size
        count[label] += 1
    return [{"mb": b / MB, "tensors": count[k], "made_by": k} for k, b in held.most_common(top)]


def cuda_forms(flags: EngineFlags) -> EngineFlags:
    """``flags`` with the forms the engine's "auto" takes on CUDA, forced on the CPU."""
    return replace(
        flags, conv_build="patches", chunk_floats=flags.cuda_chunk_floats, lag_sum="view"
    )


def save(path: str, result: dict) -> None:
    """Adds ``result``'s rows to the file at ``path`` (a row of the same model, batch and
    contender is replaced), refusing a file of another code version."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        saved = {k: result[k] for k in ("git_commit", "forms")} | {"commands": [], "rows": []}
    for key in ("git_commit", "forms"):
        if saved[key] != result[key]:
            raise SystemExit(f"{path} holds {key} {saved[key]!r}, this run {result[key]!r}")
    new = {(r["model"], r["batch"], r["contender"]) for r in result["rows"]}
    saved["rows"] = [
        r for r in saved["rows"] if (r["model"], r["batch"], r["contender"]) not in new
    ] + result["rows"]
    saved["commands"].append(result["command"])
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)


def markdown_table(before: dict, after: dict, gpu: dict) -> str:
    """Per (model, batch, private contender) of ``after``: the GPU run's allocator peak
    extra MB, this tracker's peak at ``before``'s and ``after``'s code, and ``after``'s peak
    over the GPU run's non-private peak."""
    peaks = {
        name: {(r["model"], r["batch"], r["contender"]): r["peak_extra_mb"] for r in d["rows"]}
        for name, d in (("before", before), ("after", after), ("gpu", gpu))
    }
    short = {k: d["git_commit"][:7] for k, d in (("before", before), ("after", after))}
    lines = [
        f"| model | batch | contender | GPU MB ({gpu['git_commit'][:7]}) "
        f"| tracker MB, {short['before']} | tracker MB, {short['after']} "
        f"| {short['after']} ÷ GPU non-private |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, batch, name in peaks["after"]:
        gpu_base = peaks["gpu"].get((model, batch, "non-private"))
        cells = [peaks[k].get((model, batch, name)) for k in ("gpu", "before", "after")]
        ratio = f"{cells[2] / gpu_base:.2f}" if gpu_base and name != "non-private" else "–"
        shown = ["–" if c is None else f"{c:.0f}" for c in cells]
        lines.append(f"| {model} | {batch} | {name} | {' | '.join(shown)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="wrn16-4", help="comma-separated step_time.py models")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--contenders", default="non-private,dpsgd,dpsgd-bookkept")
    ap.add_argument(
        "--cpu-forms", action="store_true", help="the engine's CPU forms, not its CUDA ones"
    )
    ap.add_argument("--top", type=int, default=8, help="holders listed per contender")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", help="add the rows to this JSON file (see save())")
    ap.add_argument(
        "--table", nargs=2, metavar=("BEFORE", "AFTER"), help="tabulate two saved files"
    )
    ap.add_argument("--gpu", help="with --table: a step_time.py --device cuda JSON")
    args = ap.parse_args(argv)
    if args.table:
        if not args.gpu:
            ap.error("--table needs --gpu")
        loaded = []
        for path in (*args.table, args.gpu):
            with open(path) as f:
                loaded.append(json.load(f))
        print(markdown_table(*loaded))
        return 0
    torch.set_num_threads(args.threads)
    flags = EngineFlags() if args.cpu_forms else cuda_forms(EngineFlags())
    contenders = args.contenders.split(",")
    if "non-private" not in contenders:
        contenders.insert(0, "non-private")
    rows = []
    for model in args.models.split(","):
        spec = step_time.MODELS[model]
        x, y = spec.data(args.batch_size, torch.Generator().manual_seed(0))
        base = None
        for name in contenders:
            step = step_time.make_contender(name, spec, x, y, torch.device("cpu"), flags)
            step()  # the first step's lazy state (optimizer moments) is not the step's peak
            live = peak_of(step)
            base = base or live.peak
            row = {
                "model": model,
                "batch": args.batch_size,
                "contender": name,
                "peak_extra_mb": live.peak / MB,
                "x_non_private": live.peak / base,
                "held_at_peak": largest_holders(live, args.top),
            }
            rows.append(row)
            if not args.json:
                print(
                    f"{model} B={args.batch_size} {name}: peak {row['peak_extra_mb']:.0f} MB, "
                    f"{row['x_non_private']:.2f}× non-private"
                )
                for h in row["held_at_peak"]:
                    print(f"  {h['mb']:8.1f} MB in {h['tensors']:3d}  {h['made_by']}")
    result = {
        "git_commit": git_commit(),
        "forms": "CPU" if args.cpu_forms else "CUDA's, forced on the CPU",
        "command": " ".join(["python benchmarks/live_memory.py", *(argv or sys.argv[1:])]),
        "rows": rows,
    }
    if args.out:
        save(args.out, result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
