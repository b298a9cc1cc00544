"""Layers the papers need beyond torch.nn, each with its per-sample gradient rule."""

from privgrad.layers.circulant import BlockCirculantLinear, CirculantGrads, circulant_rule

__all__ = ["BlockCirculantLinear", "CirculantGrads", "circulant_rule"]
