"""Per-sample gradients: one forward, one backward, per-layer rules."""

from privgrad.per_sample.engine import GradSampler, PerSampleGrads
from privgrad.per_sample.flags import DEFAULT_FLAGS, EngineFlags
from privgrad.per_sample.rules import (
    LayerGrads,
    MaterializedGrads,
    register_read_children,
    register_rule,
)

__all__ = [
    "DEFAULT_FLAGS",
    "EngineFlags",
    "GradSampler",
    "PerSampleGrads",
    "LayerGrads",
    "MaterializedGrads",
    "register_read_children",
    "register_rule",
]
