"""Grouped, depthwise and 'same'-padded convolutions, two ways, in one process: their rules
(``rules.GroupedConvGrads``; the conv rules on explicitly padded inputs) against the generic
vmap rule they fell to before (``conv_rule`` answering None for them, as it did). Two models:
``step_time.py``'s MobileNet (3×3 depthwise, numeric padding) and Hugging Face's EfficientNet
from a tiny configuration (depthwise convolutions padded 'same', squeeze-and-excitation;
BatchNorm swapped for GroupNorm by ``privgrad.layers.replace_batch_norm``, dropouts at 0).
Each contender steps a copy of the model (same initial weights) on one fixed batch, warmed
up twice, then timed in interleaved rounds (``step_time.interleaved_rounds``); reported: the
median CPU ms per step, the median per round of the CPU and wall ratios to the non-private
step, and of the vmap step's CPU time over the rules' step. Run with a fixed thread count:

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python benchmarks/depthwise_ab.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import privgrad
from privgrad.layers import replace_batch_norm
from privgrad.per_sample import rules
from step_time import MobileNet, PrivgradStep, interleaved_rounds  # this folder

CLASSES = 10


def build(name: str):
    """(model, call, inputs of ``n`` examples) for ``name``."""
    if name == "mobilenet":
        return (
            MobileNet(CLASSES),
            lambda m, x: m(x),
            lambda n, g: torch.randn(n, 3, 32, 32, generator=g),
        )
    import transformers

    config = transformers.EfficientNetConfig(
        num_channels=3, image_size=32, num_labels=CLASSES, width_coefficient=0.25,
        depth_coefficient=0.5, hidden_dim=320, dropout_rate=0.0, drop_connect_rate=0.0,
    )  # fmt: skip
    model = replace_batch_norm(transformers.EfficientNetForImageClassification(config))
    return (
        model,
        lambda m, x: m(pixel_values=x).logits,
        lambda n, g: torch.randn(n, 3, 32, 32, generator=g),
    )


@contextlib.contextmanager
def vmap_for_grouped_and_padded():
    """``conv_rule`` answering None, as before, for a grouped convolution or one padded by
    name or in another mode: the generic vmap rule replays those layers."""
    conv = dict.get(rules.RULES, nn.Conv2d)

    def old(module, inputs, grads, flags=rules.DEFAULT_FLAGS):
        if not rules._plain_conv(module):
            return None
        return conv(module, inputs, grads, flags=flags)

    old.takes_flags = True
    dict.__setitem__(rules.RULES, nn.Conv2d, old)
    try:
        yield
    finally:
        dict.__setitem__(rules.RULES, nn.Conv2d, conv)


def non_private(model, call, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(call(model, x), y).backward()
        opt.step()

    return step


def private(model, x, y, vmap: bool):
    """DP-SGD's step on the fixed batch (the body of PrivateTrainer.step), with the vmap rule
    for those convolutions if ``vmap``."""
    inputs = {"pixel_values": x} if not isinstance(model, MobileNet) else x
    with vmap_for_grouped_and_padded() if vmap else contextlib.nullcontext():
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.01), (inputs, y),
            noise_multiplier=1.0, max_grad_norm=1.0, batch_size=len(y),
        )  # fmt: skip
    step = PrivgradStep(trainer, inputs, y)
    if not vmap:
        return step

    def replayed():
        with vmap_for_grouped_and_padded():
            step()

    return replayed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mobilenet,efficientnet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=1)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B = {args.batch_size}")
    print("| model | contender | CPU ms/step | × non-private (CPU) | × non-private (wall) |")
    print("|---|---|---|---|---|")
    pairs = {}
    for name in args.models.split(","):
        calls = {}
        for contender in ("non-private", "rules", "vmap"):
            torch.manual_seed(0)
            model, call, inputs = build(name)
            g = torch.Generator().manual_seed(0)
            x = inputs(args.batch_size, g)
            y = torch.randint(0, CLASSES, (args.batch_size,), generator=g)
            if contender == "non-private":
                calls[contender] = non_private(model, call, x, y)
            else:
                calls[contender] = private(model, x, y, contender == "vmap")
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
        pairs[name] = statistics.median(v / r for v, r in zip(cpu["vmap"], cpu["rules"]))
    print()
    for name, ratio in pairs.items():
        print(f"{name}: vmap / rules, CPU per round (median): {ratio:.2f}")


if __name__ == "__main__":
    main()
