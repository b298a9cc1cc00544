"""Grouped, depthwise and 'same'-padded convolutions, two ways, in one process: their rules
(``rules.GroupedConvGrads``; the conv rules on explicitly padded inputs) against the generic
vmap rule they fell to before (``conv_rule`` answering None for them, as it did). Two models:
``step_time.py``'s MobileNet (3×3 depthwise, numeric padding) and Hugging Face's EfficientNet
from a tiny configuration (depthwise convolutions padded 'same', squeeze-and-excitation;
BatchNorm swapped for GroupNorm by ``privgrad.layers.replace_batch_norm``, dropouts at 0).
The driver is ``ab.fixed_batch_main`` (each contender steps a copy of the model on one fixed
batch, in interleaved rounds); reported beside the table: the median per round of the vmap
step's CPU time over the rules' step. Run with a fixed thread count:

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python benchmarks/depthwise_ab.py
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import privgrad
from privgrad.layers import replace_batch_norm
from privgrad.per_sample import rules
from ab import fixed_batch_main  # this folder
from step_time import MobileNet, PrivgradStep  # this folder

CLASSES = 10


def build(name: str):
    """(model, inputs of ``n`` examples) for ``name``."""
    if name == "mobilenet":
        return MobileNet(CLASSES), lambda n, g: torch.randn(n, 3, 32, 32, generator=g)
    import transformers

    config = transformers.EfficientNetConfig(
        num_channels=3, image_size=32, num_labels=CLASSES, width_coefficient=0.25,
        depth_coefficient=0.5, hidden_dim=320, dropout_rate=0.0, drop_connect_rate=0.0,
    )  # fmt: skip
    model = replace_batch_norm(transformers.EfficientNetForImageClassification(config))
    return model, lambda n, g: {"pixel_values": torch.randn(n, 3, 32, 32, generator=g)}


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


def private(model, x, y, way: str):
    """DP-SGD's step on the fixed batch (the body of PrivateTrainer.step), with the vmap rule
    for those convolutions in the way "vmap"."""
    vmap = way == "vmap"
    with vmap_for_grouped_and_padded() if vmap else contextlib.nullcontext():
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.01), (x, y),
            noise_multiplier=1.0, max_grad_norm=1.0, batch_size=len(y), seed=0,
        )  # fmt: skip
    step = PrivgradStep(trainer, x, y)
    if not vmap:
        return step

    def replayed():
        with vmap_for_grouped_and_padded():
            step()

    return replayed


if __name__ == "__main__":
    fixed_batch_main(__doc__, "mobilenet,efficientnet", 64, 1, ("rules", "vmap"), build, private)
