"""Layers the papers need beyond torch.nn, each with its per-sample gradient rule, and
:func:`replace_batch_norm`, which makes a model with BatchNorm trainable."""

from privgrad.layers.circulant import BlockCirculantLinear, CirculantGrads, circulant_rule
from privgrad.layers.norms import replace_batch_norm

__all__ = ["BlockCirculantLinear", "CirculantGrads", "circulant_rule", "replace_batch_norm"]
