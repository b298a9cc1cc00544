"""Making a model with BatchNorm trainable under DP: BatchNorm mixes a batch's examples (it is
refused, :data:`privgrad.per_sample.rules.REFUSED`); GroupNorm normalizes each example alone."""

from __future__ import annotations

import math

from torch import nn

from privgrad.errors import PrivgradError
from privgrad.per_sample.rules import configures_only, instance_overrides


def replace_batch_norm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replaces every BatchNorm of ``model`` (1d, 2d, 3d, SyncBatchNorm), in place, with a
    ``GroupNorm`` over the same channels: gcd(``groups``, channels) groups, as Opacus'
    ``ModuleValidator.fix`` does, except for ``BatchNorm1d``: one group (a LayerNorm of the
    features), since on (B, C) inputs a group of one feature normalizes it to 0 whatever the
    input. The BatchNorm's ``eps`` and ``affine``, device and dtype are kept; the GroupNorm's
    scale and shift start at 1 and 0 (a BatchNorm's were fitted to batch statistics).
    Returns ``model`` (a BatchNorm itself: its replacement). Call it before building the
    optimizer, which must hold the new parameters. A BatchNorm used in several places becomes
    one GroupNorm, shared as it was. A BatchNorm that computes more than the normalization (a
    subclass with a forward of its own, as timm's ``BatchNormAct2d`` with its activation, or
    one holding layers) is refused before anything is replaced: a GroupNorm would drop that."""
    if not isinstance(groups, int) or groups < 1:
        raise PrivgradError(f"groups must be an integer ≥ 1, got {groups!r}")
    for name, module in model.named_modules(remove_duplicate=False):  # all refusals first:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # no model left half-replaced
            _check_plain(module, name)
    return _replace(model, groups, {})


def _replace(model: nn.Module, groups: int, done: dict) -> nn.Module:
    # done: a BatchNorm used in several places (shared) becomes one GroupNorm, still shared
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        if id(model) not in done:
            done[id(model)] = _group_norm(model, groups)
        return done[id(model)]
    # every place a child is held, not named_children(), which yields a shared child once
    for child_name, child in list(model._modules.items()):
        if child is None:
            continue
        setattr(model, child_name, _replace(child, groups, done))
    return model


def _check_plain(norm: nn.modules.batchnorm._BatchNorm, name: str) -> None:
    """A subclass of torch's BatchNorm whose forward computes more than the normalization
    (timm's ``BatchNormAct2d`` applies its activation and dropout in its forward), or that holds
    layers of its own, would lose that computation in a plain GroupNorm: refused, not replaced."""
    own = [
        cls.__name__
        for cls in type(norm).__mro__
        if issubclass(cls, nn.modules.batchnorm._BatchNorm)
        and not cls.__module__.startswith("torch.")
        and not configures_only(cls)
    ]
    children = [n for n, _ in norm.named_children()]
    overrides = instance_overrides(norm)
    if own or children or overrides:
        what = (
            f"its class {own[0]} computes more than the normalization (a forward or method "
            "of its own)"
            if own
            else f"it holds layers ({', '.join(children)})"
            if children
            else f"it sets {', '.join(overrides)} on the instance"
        )
        raise PrivgradError(
            f"replace_batch_norm: layer '{name or '(the model)'}' ({type(norm).__name__}) is "
            f"more than a BatchNorm: {what}; a plain GroupNorm in its place would silently "
            "drop that (timm's BatchNormAct2d: its activation). Replace it yourself, e.g. with "
            "nn.Sequential(nn.GroupNorm(...), <its activation>)"
        )


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
