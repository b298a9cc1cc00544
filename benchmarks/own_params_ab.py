"""A layer without a rule, two ways, in one process: its own parameters followed as tables the
batch shares (``privgrad/per_sample/tables.py``, the default since make_private's check tries it
first) against its forward replayed one example at a time by the generic vmap rule (the check
told not to try tables). Hugging Face models from configs, dropouts at 0 so that both ways run:
BEiT (layer scales, [CLS] token, relative position tables), DeBERTa (attention biases, its own
LayerNorm class), ConvNeXt (layer scales, its own LayerNorm class). Each contender steps a
copy of the model (same initial weights) on one fixed batch, warmed up twice, then timed in
interleaved rounds (the driver ``ab.fixed_batch_main``); reported: the median CPU ms per step,
the median CPU and wall ratios to the non-private step, and the median per round of the
replayed step's CPU time over the tables' step. Run with a fixed thread count:

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python benchmarks/own_params_ab.py
"""

from __future__ import annotations

import torch

import privgrad
from privgrad.per_sample.independence import check_gradients
from privgrad.private import per_sample_cross_entropy
from ab import fixed_batch_main  # this folder
from step_time import PrivgradStep  # this folder

CLASSES = 10


def build(name: str):
    """(model, inputs of ``batch`` examples) for ``name``, dropouts and drop paths at 0."""
    import transformers

    hidden = dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256
    )
    if name == "beit":
        config = transformers.BeitConfig(
            image_size=32, patch_size=4, num_channels=3, num_labels=CLASSES, drop_path_rate=0.0,
            use_relative_position_bias=True, **hidden,
        )  # fmt: skip
        return transformers.BeitForImageClassification(config), lambda n, g: {
            "pixel_values": torch.randn(n, 3, 32, 32, generator=g)
        }
    if name == "deberta":
        config = transformers.DebertaConfig(
            vocab_size=1000, max_position_embeddings=64, num_labels=CLASSES,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **hidden,
        )  # fmt: skip
        return transformers.DebertaForSequenceClassification(config), lambda n, g: {
            "input_ids": torch.randint(0, 1000, (n, 64), generator=g)
        }
    config = transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[32, 64, 128], depths=[2, 2, 2], num_stages=3,
        num_labels=CLASSES, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.ConvNextForImageClassification(config), lambda n, g: {
        "pixel_values": torch.randn(n, 3, 32, 32, generator=g)
    }


def private(model, x, y, way: str):
    """DP-SGD's step on the fixed batch (the body of PrivateTrainer.step); in the way
    "replayed", the check run again with the layers' own parameters never tried as tables."""
    tables = way == "tables"
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.01), (x, y), noise_multiplier=1.0,
        max_grad_norm=1.0, batch_size=len(y), seed=0,
    )  # fmt: skip
    sampler = trainer.grad_sampler
    if not tables:
        sampler.shared.follows_params = lambda module, args=(): False
        probe = {k: v[:5] for k, v in x.items()}
        check_gradients(sampler, per_sample_cross_entropy, probe, y[:5])
        assert not sampler.shared.params
    else:
        assert sampler.shared.params
    return PrivgradStep(trainer, x, y)


if __name__ == "__main__":
    fixed_batch_main(
        __doc__, "beit,deberta,convnext", 32, 3, ("tables", "replayed"), build, private
    )
