"""Optimizers that post-process a private update (no privacy cost)."""

from __future__ import annotations

import torch

from privgrad.errors import PrivgradError


class SignAdam(torch.optim.Optimizer):
    """Ghosh & Das Alg. 2 style: Adam moments of the (noisy) gradient, then a sign step.

    θ ← θ − α·sign(m̂ / (√v̂ + ε)). Every coordinate moves by exactly α (or 0).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["t"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["t"])
                v_hat = state["v"] / (1 - b2 ** state["t"])
                p.add_(torch.sign(m_hat / (v_hat.sqrt() + group["eps"])), alpha=-group["lr"])


OPTIMIZERS = ("sgd", "adam", "sign-adam")


def build_optimizer(name: str, params, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sign-adam":
        return SignAdam(params, lr=lr)
    raise PrivgradError(f"unknown optimizer '{name}'; choose from: {', '.join(OPTIMIZERS)}")
