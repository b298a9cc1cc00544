"""Making a model with BatchNorm trainable under DP: BatchNorm mixes a batch's examples (it is
refused, :data:`privgrad.per_sample.rules.REFUSED`); GroupNorm normalizes each example alone."""

from __future__ import annotations

import math

from torch import nn

from privgrad.errors import PrivgradError


def replace_batch_norm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replaces every BatchNorm of ``model`` (1d, 2d, 3d, SyncBatchNorm), in place, with a
    ``GroupNorm`` over the same channels: gcd(``groups``, channels) groups, as Opacus'
    ``ModuleValidator.fix`` does, except for ``BatchNorm1d``: one group (a LayerNorm of the
    features), since on (B, C) inputs a group of one feature normalizes it to 0 whatever the
    input. The BatchNorm's ``eps`` and ``affine``, device and dtype are kept; the GroupNorm's
    scale and shift start at 1 and 0 (a BatchNorm's were fitted to batch statistics).
    Returns ``model`` (a BatchNorm itself: its replacement). Call it before building the
    optimizer, which must hold the new parameters."""
    if not isinstance(groups, int) or groups < 1:
        raise PrivgradError(f"groups must be an integer ≥ 1, got {groups!r}")
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _group_norm(model, groups)
    for name, child in list(model.named_children()):
        setattr(model, name, replace_batch_norm(child, groups))
    return model


def _group_norm(norm: nn.modules.batchnorm._BatchNorm, groups: int) -> nn.GroupNorm:
    if isinstance(norm, nn.modules.lazy.LazyModuleMixin) and norm.has_uninitialized_params():
        raise PrivgradError(
            f"{type(norm).__name__} does not know its channels before its first forward: run "
            "the model once, or build it with BatchNorm of known size, before replacing it"
        )
    channels = norm.num_features
    like = next(iter([*norm.parameters(), *norm.buffers()]), None)
    factory = {} if like is None else {"device": like.device}
    if like is not None and like.is_floating_point():
        factory["dtype"] = like.dtype
    count = 1 if isinstance(norm, nn.BatchNorm1d) else math.gcd(groups, channels)
    return nn.GroupNorm(count, channels, eps=norm.eps, affine=norm.affine, **factory)
