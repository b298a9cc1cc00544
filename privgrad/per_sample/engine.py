"""Per-sample gradients of any ``nn.Module`` from one forward and one backward pass.

Forward hooks record each layer's input and output; one ``autograd.grad`` call gives the
gradient of the summed per-sample loss with respect to every recorded output (the
parameters' own batch gradients are never formed); the per-layer rules in
:mod:`privgrad.per_sample.rules` turn these into per-sample gradients.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import PrivgradError
from .rules import (REFUSED, RULES, LayerGrads, MaterializedGrads, TrainableSubset,
                    generic_rule)


class PerSampleGrads:
    """Per-sample gradients of all trainable parameters, grouped by layer."""

    def __init__(self, layers: list[LayerGrads], batch_size: int):
        self.layers, self.batch_size = layers, batch_size

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.params]

    def layer_norms_sq(self) -> list[torch.Tensor]:
        return [layer.norms_sq() for layer in self.layers]

    def norms_sq(self) -> torch.Tensor:
        return torch.stack(self.layer_norms_sq()).sum(0)

    def weighted_sum(self, weights: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        """Σ_i w_i g_i per parameter; ``weights`` is one (B,) tensor or one per layer."""
        if isinstance(weights, torch.Tensor):
            weights = [weights] * len(self.layers)
        return [s for layer, w in zip(self.layers, weights) for s in layer.weighted_sum(w)]

    def map_layers(self, fn: Callable[[LayerGrads], LayerGrads]) -> "PerSampleGrads":
        return PerSampleGrads([fn(layer) for layer in self.layers], self.batch_size)


class GradSampler:
    """Hooks a model so that :meth:`compute` returns per-sample gradients.

    Every trainable parameter must belong to a layer with a rule; one without is an
    error (never silently left out of the private update).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for types, reason in REFUSED.items():
                if isinstance(module, types):
                    raise PrivgradError(f"layer '{name}' ({type(module).__name__}): {reason}")
            if any(id(p) in seen for p in own):
                raise PrivgradError(f"layer '{name}' shares a parameter with another layer; "
                                    "tied weights are not supported")
            seen.update(id(p) for p in own)
            self.layers.append((name, module))
        self._records: dict[nn.Module, list] = {}
        self._recording = False
        for _, module in self.layers:
            module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not self._recording:
            return
        if not isinstance(output, torch.Tensor):
            raise PrivgradError(f"{type(module).__name__} returns {type(output).__name__}; "
                                "layers with parameters must return one tensor")
        self._records.setdefault(module, []).append((inputs[0].detach(), output, output._version))

    def compute(self, x: torch.Tensor, y: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """Returns (per-sample grads, per-sample losses). ``loss_fn`` must not reduce."""
        batch = x.shape[0]
        if batch == 0:
            return self.empty(), torch.zeros(0)
        self._records = {}
        self._recording = True
        try:
            losses = loss_fn(self.model(x), y)
        finally:
            self._recording = False
        if losses.shape != (batch,):
            raise PrivgradError(f"the loss must give one value per sample (shape ({batch},)), "
                                f"got shape {tuple(losses.shape)}; use reduction='none'")
        records = [(m, r) for m, recs in self._records.items() for r in recs]
        for m, (_, out, version) in records:
            if out._version != version:
                raise PrivgradError(f"the output of {type(m).__name__} was modified in place; "
                                    "use inplace=False activations")
        outs = [out for _, (_, out, _) in records]
        grads = torch.autograd.grad(losses.sum(), outs, allow_unused=True)
        per_module: dict[nn.Module, tuple[list, list]] = {}
        names = {m: name for name, m in self.layers}
        for (m, (a, out, _)), g in zip(records, grads):
            if a.shape[:1] != (batch,) or out.shape[:1] != (batch,):
                raise PrivgradError(
                    f"layer '{names[m]}' ({type(m).__name__}) was called on an input of shape "
                    f"{tuple(a.shape)} for a batch of {batch}: per-sample gradients need the batch as "
                    "the first dimension of every layer's input and output (is a batch dimension missing?)")
            ins, gs = per_module.setdefault(m, ([], []))
            ins.append(a)
            gs.append(torch.zeros_like(out) if g is None else g.detach())
        layers = []
        for name, module in self.layers:
            if module not in per_module:
                layers.append(self._zeros(module, batch))
                continue
            ins, gs = per_module[module]
            rule = RULES.get(type(module))
            layer = rule(module, ins, gs) if rule else None
            if layer is None:
                layer = generic_rule(module, ins, gs)
            if not all(p.requires_grad for p in layer.params):
                layer = TrainableSubset(layer)
            own = {id(p) for p in module.parameters(recurse=False) if p.requires_grad}
            if {id(p) for p in layer.params} != own:
                raise PrivgradError(f"layer '{name}': per-sample gradients missing for some parameters")
            layers.append(layer)
        self._records = {}
        return PerSampleGrads(layers, batch), losses.detach()

    @staticmethod
    def _zeros(module: nn.Module, batch: int) -> LayerGrads:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        return MaterializedGrads(params, [torch.zeros(batch, *p.shape) for p in params])

    def empty(self) -> PerSampleGrads:
        """The per-sample gradients of an empty batch (a valid Poisson draw)."""
        return PerSampleGrads([self._zeros(m, 0) for _, m in self.layers], 0)
