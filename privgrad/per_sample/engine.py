"""Per-sample gradients of any ``nn.Module`` from one forward and one backward pass.

Forward hooks record each layer's input and pass its output through a tap, an identity
whose backward hands the output gradient to the sampler. One backward pass, asked only for
the gradient of a scalar anchor that every tap depends on, carries the summed per-sample
loss's gradient to every tap (the parameters' own batch gradients are never formed). As
soon as all of a layer's output gradients have arrived its rule in
:mod:`privgrad.per_sample.rules` takes them, and may trade them for a smaller form
(:meth:`LayerGrads.settle`, with ``settle=True``), so that no more is kept than the clipped
sum needs.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from ..errors import PrivgradError
from .rules import (RULES, LayerGrads, MaterializedGrads, TrainableSubset, float32_arithmetic,
                    generic_rule, refusal)


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


class _Tap(torch.autograd.Function):
    """Identity on a layer's output; its backward hands the output gradient to ``receive``.
    The output is a new tensor (not a view), so activations may modify it in place: autograd
    then delivers the gradient with respect to the layer's own output."""

    @staticmethod
    def forward(ctx, out, anchor, receive):
        ctx.receive = receive
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        ctx.receive(g)
        return g, None, None


class GradSampler:
    """Hooks a model so that :meth:`compute` returns per-sample gradients.

    Every trainable parameter must belong to a layer with a rule; one without is an
    error (never silently left out of the private update). With ``settle``, each layer's
    rule may trade its stored input and output gradient for a smaller form as soon as its
    gradients are in (:meth:`LayerGrads.settle`); a consumer that reads a rule's stored
    tensors (a spectral transform) needs ``settle=False``.
    """

    def __init__(self, model: nn.Module, settle: bool = False):
        self.model, self.settle = model, settle
        self.layers: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            # every module, frozen or parameter-free too: a batch mixer needs no parameters
            reason = refusal(module)
            if reason is not None:
                raise PrivgradError(f"layer '{name or '(the model)'}' ({type(module).__name__}): {reason}")
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            if any(id(p) in seen for p in own):
                raise PrivgradError(f"layer '{name}' shares a parameter with another layer; "
                                    "tied weights are not supported")
            seen.update(id(p) for p in own)
            self.layers.append((name, module))
        self.names = {m: name for name, m in self.layers}
        self._recording = False
        for _, module in self.layers:
            module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not self._recording:
            return None
        if not isinstance(output, torch.Tensor):
            raise PrivgradError(f"{type(module).__name__} returns {type(output).__name__}; "
                                "layers with parameters must return one tensor")
        a = inputs[0]
        if a.shape[:1] != (self._batch,) or output.shape[:1] != (self._batch,):
            raise PrivgradError(
                f"layer '{self.names[module]}' ({type(module).__name__}) was called on an input of shape "
                f"{tuple(a.shape)} for a batch of {self._batch}: per-sample gradients need the batch as "
                "the first dimension of every layer's input and output (is a batch dimension missing?)")
        calls = self._calls.setdefault(module, [])
        calls.append((a.detach(), a._version, output.shape, output.dtype, output.device))
        self._grads.setdefault(module, []).append(None)
        if not output.requires_grad:
            return None
        return _Tap.apply(output, self._anchor, partial(self._receive, module, len(calls) - 1))

    def _receive(self, module: nn.Module, call: int, g: torch.Tensor) -> None:
        """A tap's backward: store the gradient; a layer whose calls are all in gets its rule."""
        if self._error is not None:
            return
        try:
            grads = self._grads[module]
            grads[call] = g
            if all(x is not None for x in grads):
                self._built[module] = self._build(module)
        except Exception as e:  # noqa: BLE001 (re-raised after the backward pass)
            self._error = e

    def _build(self, module: nn.Module) -> LayerGrads:
        """The layer's rule on its recorded inputs and output gradients (zeros where unused)."""
        calls, grads = self._calls.pop(module), self._grads.pop(module)
        name = self.names[module]
        for a, version, *_ in calls:
            if a._version != version:
                raise PrivgradError(f"the input of layer '{name}' ({type(module).__name__}) was modified "
                                    "in place after the layer used it; use out-of-place operations there")
        ins = [a for a, *_ in calls]
        gs = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
              for g, (_, _, shape, dtype, device) in zip(grads, calls)]
        rule = RULES.get(type(module))
        layer = rule(module, ins, gs) if rule else None
        if layer is None:
            layer = generic_rule(module, ins, gs)
        if not all(p.requires_grad for p in layer.params):
            layer = TrainableSubset(layer)
        own = {id(p) for p in module.parameters(recurse=False) if p.requires_grad}
        if {id(p) for p in layer.params} != own:
            raise PrivgradError(f"layer '{name}': per-sample gradients missing for some parameters")
        if self.settle:
            with float32_arithmetic():
                layer.settle()
        return layer

    def compute(self, x: torch.Tensor, y: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """Returns (per-sample grads, per-sample losses). ``loss_fn`` must not reduce."""
        batch = x.shape[0]
        if batch == 0:
            return self.empty(), torch.zeros(0, device=x.device)
        self._batch, self._calls, self._grads, self._built, self._error = batch, {}, {}, {}, None
        self._anchor = torch.zeros((), device=x.device, requires_grad=True)
        self._recording = True
        try:
            losses = loss_fn(self.model(x), y)
            if losses.shape != (batch,):
                raise PrivgradError(f"the loss must give one value per sample (shape ({batch},)), "
                                    f"got shape {tuple(losses.shape)}; use reduction='none'")
            self._recording = False
            if losses.requires_grad:
                torch.autograd.grad(losses.sum(), self._anchor, allow_unused=True)
            if self._error is not None:
                raise self._error
            layers = []
            for _, module in self.layers:
                if module not in self._built and module in self._calls:   # an unused output
                    self._built[module] = self._build(module)
                layers.append(self._built[module] if module in self._built else self._zeros(module, batch))
        finally:
            self._recording = False
            self._calls, self._grads, self._built, self._error = {}, {}, {}, None
        return PerSampleGrads(layers, batch), losses.detach()

    @staticmethod
    def _zeros(module: nn.Module, batch: int) -> LayerGrads:
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        return MaterializedGrads(params, [p.new_zeros(batch, *p.shape) for p in params])

    def empty(self) -> PerSampleGrads:
        """The per-sample gradients of an empty batch (a valid Poisson draw)."""
        return PerSampleGrads([self._zeros(m, 0) for _, m in self.layers], 0)
