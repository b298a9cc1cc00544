"""Per-layer costs of DP-SGD's conv rule: what each way of getting per-sample norms and the
clipped sum costs for one Conv2d layer, against the weight gradient the non-private
backward pass computes for it.

For each layer (the convolutions of the models of ``benchmarks/step_time.py``, with their
input sizes, batches and memory format: channels-last for the CNN's, contiguous NCHW for the
others), on random input and output gradients (no bias: it costs the same in every form):

* ``weight-grad``: ``conv2d_weight`` of the batch, the non-private step's cost (baseline);
* ``ghost-patches``: the Gram form Σ_{t,t'} (a_t·a_t')(g_t·g_t') over copied patches;
* ``ghost-cells``: the same from the Gram of stride-sized input cells summed along the
  kernel's lags (only where the kernel is whole cells);
* ``build-correlation`` / ``build-grouped`` / ``build-patches``: the per-sample gradients
  built by a grouped convolution that correlates each input channel with every output
  gradient, by the weight gradient of the samples-as-groups convolution, or by patches and
  one batched matmul; each followed by the squared norms;
* ``fused``: the norms by the fused Triton kernel, never writing the per-sample gradients
  (``EngineFlags(norm_form="fused")``; on CUDA, or with ``--fused`` in Triton's interpreter);
* ``book-keeping-sum``: the clipped sum as one ``conv2d_weight`` on the re-weighted output
  gradient;
* ``rule``: what :class:`privgrad.per_sample.rules.ConvGrads` does for norms and sum.

Contenders of one layer run in interleaved rounds (the order rotated each round), CPU time
(``time.process_time``) at a fixed thread count, or on CUDA (``--device cuda``) wall time with
the device synchronised around each timed block, every contender but ``weight-grad`` under
the engine's float32 guard (``EngineFlags.float32_guard``); reported is the median per call,
its range over rounds (``step_time.interleaved_rounds``), and its ratio to ``weight-grad``. Before
timing, every contender's norms are checked against the rule's. A build whose B × P
gradients exceed ``--max-floats`` is skipped, and so is the Gram form where it costs over 8×
a build (2T² > 8·C_out·k²·C_in: the rule never picks it there).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/conv_rules.py --threads 1
    python benchmarks/conv_rules.py --device cuda --json  # per-layer GPU costs, fused included
    python benchmarks/conv_rules.py --quick --json        # tiny, for CI; JSON as the last line
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch import nn

from privgrad.per_sample import EngineFlags, fused
from privgrad.per_sample.rules import ConvGrads, float32_arithmetic

# this folder (the script's own, or the test's import)
from step_time import interleaved_rounds, synchronize

# name: (batch, C_in, C_out, kernel, stride, padding, input side, channels-last), as in
# step_time.py's models (only the CNN runs channels-last)
LAYERS = {
    "cnn.conv1": (256, 1, 16, 8, 2, 2, 28, True),
    "cnn.conv2": (256, 16, 32, 4, 2, 0, 12, True),
    "cnn-x16.conv2": (256, 256, 512, 4, 2, 0, 12, True),
    "lenet5.conv1": (256, 1, 6, 5, 1, 2, 28, False),
    "lenet5.conv2": (256, 6, 16, 5, 1, 0, 14, False),
    "model3-gn.conv2": (128, 32, 32, 3, 1, 1, 32, False),
    "wrn.conv-8x8": (64, 64, 64, 3, 1, 1, 8, False),
}
# WRN-16-4's three conv shapes at B = 256 (step_time.py's wrn16-4): timed on CUDA only (on
# this CPU they take minutes), where they decide which form its step's layers should take
CUDA_LAYERS = {
    "wrn16-4.conv-32x32": (256, 64, 64, 3, 1, 1, 32, False),
    "wrn16-4.conv-16x16": (256, 128, 128, 3, 1, 1, 16, False),
    "wrn16-4.conv-8x8": (256, 256, 256, 3, 1, 1, 8, False),
}
QUICK = {"tiny.conv1": (8, 2, 8, 3, 2, 1, 8, True), "tiny.conv2": (8, 4, 4, 3, 1, 0, 4, False)}


def contenders(
    layer, max_floats: int, gen: torch.Generator, device: str = "cpu", with_fused: bool = False
):
    """{name: callable} for one layer on ``device`` (the fused kernel's norms too with
    ``with_fused``), and the layer's facts (T, P, the rule's choice)."""
    B, ci, co, k, s, p, side, channels_last = layer
    layout = torch.channels_last if channels_last else torch.contiguous_format
    m = nn.Conv2d(ci, co, k, stride=s, padding=p, bias=False)
    m = m.to(device=device, memory_format=layout)
    out = (side + 2 * p - k) // s + 1
    x = torch.randn(B, ci, side, side, generator=gen).to(device, memory_format=layout)
    g = torch.randn(B, co, out, out, generator=gen).to(device, memory_format=layout)
    w = torch.rand(B, generator=gen).to(device)
    rule = ConvGrads(m, [x], [g])

    def weight_grad():
        return torch.nn.grad.conv2d_weight(x, m.weight.shape, g, m.stride, m.padding)

    def ghost_norms(cells):
        flags = EngineFlags(norm_form="ghost", conv_gram="cells" if cells else "patches")
        return lambda: ConvGrads(m, [x], [g], flags).norms_sq()

    def build(form):
        flags = EngineFlags(conv_build=form)
        return lambda: ConvGrads(m, [x], [g], flags).per_sample()[0].flatten(1).pow(2).sum(1)

    def rule_norms_and_sum():
        fresh = ConvGrads(m, [x], [g])
        fresh.settle()
        return fresh.norms_sq(), fresh.weighted_sum(w)

    fs = {"weight-grad": weight_grad}
    if 2 * out**4 <= 8 * m.weight.numel():
        fs["ghost-patches"] = ghost_norms(False)
        if rule.cell_grids is not None:
            fs["ghost-cells"] = ghost_norms(True)
    if B * m.weight.numel() <= max_floats:
        fs.update({f"build-{form}": build(form) for form in ("correlation", "grouped", "patches")})
    if with_fused:
        fs["fused"] = lambda: ConvGrads(m, [x], [g], EngineFlags(norm_form="fused")).norms_sq()
    fs["book-keeping-sum"] = lambda: rule.weight_sum(w)
    fs["rule"] = rule_norms_and_sum
    if rule.use_ghost:
        choice = "ghost (cells)" if rule.gram_by_cells else "ghost (patches)"
    else:
        choice = ("build, kept" if rule.keep_built else "build") + f" ({rule.build_form})"
    return fs, {
        "positions": out * out,
        "params": m.weight.numel(),
        "rule": choice,
        "channels_last": channels_last,
    }


def check_norms(fs: dict, layer: str) -> None:
    """Every contender that returns norms agrees with the rule's (to float tolerance)."""
    norms = fs["rule"]()[0]
    for n in (
        "ghost-patches",
        "ghost-cells",
        "build-correlation",
        "build-grouped",
        "build-patches",
        "fused",
    ):
        if n in fs and not torch.allclose(
            fs[n](), norms, rtol=1e-3, atol=1e-6 * float(norms.max())
        ):
            raise AssertionError(f"{layer}: {n} gives other per-sample norms than the rule")


def time_layer(fs: dict, rounds: int, calls: int, device: str = "cpu") -> dict:
    """{contender: (median, min, max) seconds per call over the interleaved rounds}: CPU
    time, or on CUDA wall time between synchronisations."""
    for f in fs.values():
        f()
    cpu, wall = interleaved_rounds(fs, rounds, calls, lambda: synchronize(torch.device(device)))
    times = wall if device == "cuda" else cpu
    return {n: (statistics.median(v), min(v), max(v)) for n, v in times.items()}


def markdown(result: dict) -> str:
    clock = result.get("clock", "cpu")
    lines = [
        f"| layer | B | T | P | rule | contender | {clock.upper()} ms (range over rounds) "
        "| × weight-grad |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lo, hi = row[f"{clock}_ms_range"]
        lines.append(
            f"| {row['layer']} | {row['batch']} | {row['positions']} | {row['params']} | "
            f"{row['rule']} | "
            f"{row['contender']} | {row[f'{clock}_ms']:.2f} ({lo:.2f}–{hi:.2f}) | "
            f"{row['ratio']:.2f} |"
        )
    return "\n".join(lines)


def guarded(form):
    """``form`` under the float32 guard, as the engine runs every rule (on CUDA, cuDNN's
    default TF32 convolutions would round the norms ~1e-3 apart from the rule's); the
    weight-grad baseline stays as the non-private step runs it."""

    def call():
        with float32_arithmetic():
            return form()

    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="calls per contender per round")
    ap.add_argument("--layers", help="comma-separated names (default: all)")
    ap.add_argument(
        "--max-floats", type=int, default=1 << 26, help="skip builds of more B × P floats"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="time the fused kernel's norms too (always on CUDA; on CPU only in Triton's "
        "interpreter, TRITON_INTERPRET=1)",
    )
    ap.add_argument("--quick", action="store_true", help="two tiny layers, 2 rounds (for CI)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here")
    with_fused = args.fused or args.device == "cuda"
    if with_fused and not fused.runs_on(torch.device(args.device)):
        ap.error("the fused kernel needs Triton, and on CPU its interpreter (TRITON_INTERPRET=1)")
    clock = "wall" if args.device == "cuda" else "cpu"
    torch.set_num_threads(args.threads)
    layers = QUICK if args.quick else LAYERS | (CUDA_LAYERS if args.device == "cuda" else {})
    if args.layers:
        unknown = set(args.layers.split(",")) - set(layers)
        if unknown:
            ap.error(f"unknown layer(s) {', '.join(sorted(unknown))}; known: {', '.join(layers)}")
        layers = {n: layers[n] for n in args.layers.split(",")}
    rounds = 2 if args.quick else args.rounds
    rows = []
    for name, layer in layers.items():
        gen = torch.Generator().manual_seed(0)
        fs, facts = contenders(layer, args.max_floats, gen, args.device, with_fused)
        fs = {n: f if n == "weight-grad" else guarded(f) for n, f in fs.items()}
        check_norms(fs, name)
        times = time_layer(fs, rounds, args.calls, args.device)
        for n, (t, lo, hi) in times.items():
            rows.append(
                {
                    "layer": name,
                    "batch": layer[0],
                    **facts,
                    "contender": n,
                    f"{clock}_ms": t * 1e3,
                    f"{clock}_ms_range": [lo * 1e3, hi * 1e3],
                    "ratio": t / times["weight-grad"][0],
                }
            )
        print(
            f"{name}: " + ", ".join(f"{n} {t[0] * 1e3:.2f} ms" for n, t in times.items()),
            file=sys.stderr,
        )
    result = {
        "rows": rows,
        "clock": clock,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": args.threads,
        "torch": torch.__version__,
    }
    print(markdown(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
