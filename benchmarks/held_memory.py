"""What privgrad's book-kept DP-SGD step must hold at its peak, against the non-private step's
measured extra memory (issue 42's memory target, ≤ 1.3×).

The clip factor of a sample needs its norm over every layer, and the book-kept clipped sum of
a layer needs that layer's input and output gradient: so when the last layer's norms are in,
every layer's input (which the non-private backward frees as it goes) and output gradient
(which it never keeps) are held at once. This script sums those tensors' sizes for the models
and batches of benchmarks/step_time.py, shapes only (the models run on the ``meta`` device),
and divides by the non-private step's peak extra memory in a saved step_time JSON: the
quotient is a floor under DP-SGD's ratio before any workspace (chunks, Grams, kept builds).

    python benchmarks/held_memory.py results/bench/step_time_gpu_5bdb6c7.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import step_time  # this folder


# the layers whose rules keep input and output gradient for the book-kept sum (a norm
# layer's or an embedding's per-sample gradients are small: built at once, nothing kept)
BOOK_KEPT = (nn.Linear, nn.Conv1d, nn.Conv2d)


def held_mb(model_name: str, batch: int) -> tuple[float, float]:
    """(inputs MB, output gradients MB) of every book-kept layer, float32, for one forward
    pass at ``batch``."""
    spec = step_time.MODELS[model_name]
    x, _ = spec.data(batch, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = spec.build()
    sizes = [0, 0]

    def record(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        sizes[0] += inputs[0].numel() * 4
        sizes[1] += out.numel() * 4

    for module in model.modules():
        if isinstance(module, BOOK_KEPT):
            module.register_forward_hook(record)
    model(x.to("meta"))
    return sizes[0] / 2**20, sizes[1] / 2**20


def rows(saved: dict) -> list[dict]:
    """One row per (model, batch) of ``saved`` whose non-private and DP-SGD steps have a peak."""
    peak = {(r["model"], r["batch"], r["contender"]): r["peak_extra_mb"] for r in saved["rows"]}
    out = []
    for (model, batch, contender), base in peak.items():
        dpsgd = peak.get((model, batch, "dpsgd"))
        if contender != "non-private" or not base or not dpsgd:
            continue
        ins, grads = held_mb(model, batch)
        out.append(
            {
                "model": model,
                "batch": batch,
                "inputs_mb": ins,
                "output_grads_mb": grads,
                "non_private_mb": base,
                "floor": (ins + grads) / base,
                "dpsgd": dpsgd / base,
            }
        )
    return out


def markdown_table(table: list[dict]) -> str:
    lines = [
        "| model | batch | layer inputs MB | output gradients MB | non-private extra MB "
        "| held ÷ non-private | DP-SGD measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['inputs_mb']:.0f} | {r['output_grads_mb']:.0f} "
            f"| {r['non_private_mb']:.0f} | {r['floor']:.2f} | {r['dpsgd']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("saved", help="a step_time.py --json output with peak memory")
    args = ap.parse_args(argv)
    with open(args.saved) as f:
        saved = json.load(f)
    print(markdown_table(rows(saved)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
