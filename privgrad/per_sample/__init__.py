"""Per-sample gradients: one forward, one backward, per-layer rules."""
from .engine import GradSampler, PerSampleGrads
from .rules import LayerGrads, MaterializedGrads, register_rule

__all__ = ["GradSampler", "PerSampleGrads", "LayerGrads", "MaterializedGrads", "register_rule"]
