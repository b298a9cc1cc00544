"""Per-sample gradients: one forward, one backward, per-layer rules."""

from privgrad.per_sample.engine import GradSampler, PerSampleGrads
from privgrad.per_sample.rules import LayerGrads, MaterializedGrads, register_rule

__all__ = ["GradSampler", "PerSampleGrads", "LayerGrads", "MaterializedGrads", "register_rule"]
