"""Mixture-of-experts layers: Hugging Face's experts modules (Mixtral's, Qwen-MoE's, OLMoE's,
DeepSeek's, GPT-OSS's, ...), the classes its ``use_experts_implementation`` decorator makes.

Such a layer takes the batch's tokens flattened, (B·T, d), with each token's k experts and
routing weights, and gives token t Σ_j w_{t,j} f_{e_{t,j}}(x_t), where expert e is
f_e(x) = W2_e gate(W1_e x + b1_e) + b2_e (``gate`` the module's own ``_apply_gate``, or
its activation where the experts have no gate). Each expert is two linear maps applied at the
tokens routed to it, so an example's gradient of expert e is that of a linear layer over its
own tokens routed to e: the rows of each expert are grouped by example (row r is example
r // T's, read so only where make_private's check saw the layer called so, as for any folded
layer) and padded with zero rows (examples with alike numbers of rows together), so that
every (expert, map) is a :class:`~privgrad.per_sample.rules.LinearGrads` per group for its
norms (ghost or built); its clipped sum is book-kept from the rows as they are, one matmul.

Llama 4's experts (``Llama4TextExperts``, by name) are outside that interface: every token
goes through every expert, scaled by its router score, as (E·B·T, d) rows, expert-major. A
rule that reads flattened rows (``folds_rows``) says how to select examples from its calls
(``select_rows``) and, where its rows are not example-major, from its output gradient
(``select_grad``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.per_sample.flags import DEFAULT_FLAGS, EngineFlags, gemm_dot
from privgrad.per_sample.rules import (
    LayerGrads,
    LinearGrads,
    TransposedLinearGrads,
    products,
    reads_calls,
    takes_flags,
)


@functools.cache  # asked on every lookup of a type without a rule (rules.RULES)
def is_hf_experts(layer_type: type) -> bool:
    """Whether ``layer_type`` is an experts class of Hugging Face's interface: its forward is
    the one that ``transformers.integrations.moe.use_experts_implementation`` puts in place
    (dispatching to eager, batched or grouped matmuls, which compute the same function), on
    transformers' classes or a user's."""
    forward = getattr(layer_type, "forward", None)
    code = getattr(forward, "__code__", None)
    return (
        code is not None
        and Path(code.co_filename).parts[-3:] == ("transformers", "integrations", "moe.py")
        and hasattr(forward, "__wrapped__")
    )


class _Map:
    """What :class:`LinearGrads` reads of a module: one expert's weight and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias


class _Layout:
    """An expert's rows, of examples ``example``, grouped by example: ``order`` sorts them by
    example (stable: the calls of the module one after another); the examples are grouped by
    their number of rows c (⌈log₂ c⌉ alike), each group's rows padded with zero rows to the
    most any of its examples has, so that padding costs at most 2× an example's c (a Gram
    form costs c² per example, and routing can give one example many times another's tokens).
    ``groups``: (the group's examples, its rows in sorted order, where each goes in the padded
    (examples, c, d) tensor, c)."""

    def __init__(self, example: torch.Tensor, batch: int):
        self.order = torch.argsort(example, stable=True)
        example = self.example = example[self.order]
        counts = torch.bincount(example, minlength=batch)
        at = (
            torch.arange(len(example), device=example.device) - (counts.cumsum(0) - counts)[example]
        )
        powers = 2 ** torch.arange(int(counts.max()).bit_length() + 1, device=counts.device)
        level = torch.where(counts > 0, (counts[:, None] > powers).sum(1), -1)  # ⌈log₂ c⌉
        self.groups = []
        for lv in level.unique().tolist():
            if lv < 0:
                continue  # examples without rows here: zero gradients
            members = (level == lv).nonzero().squeeze(1)
            slot = torch.full_like(counts, -1)
            slot[members] = torch.arange(len(members), device=slot.device)
            rows = (slot[example] >= 0).nonzero().squeeze(1)
            where = (slot[example[rows]], at[rows])
            self.groups.append((members, rows, where, int(counts[members].max())))
        self.batch = batch

    def padded(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (n, d), in sorted order, as each group's (examples, c, d)."""
        return [
            t.new_zeros(len(members), c, t.shape[-1]).index_put_(where, t[rows])
            for members, rows, where, c in self.groups
        ]


class _Routed:
    """One expert's linear map over the rows routed to it: inputs ``a`` (n, in) and output
    gradients ``g`` (n, out), laid out by ``layout``. Norms and per-sample gradients from a
    :class:`LinearGrads` per group of examples (their rows padded); the clipped sum from the
    rows as they are, one matmul."""

    def __init__(self, a, g, layout: _Layout, weight, bias, module, flags: EngineFlags):
        a, g = a[layout.order], g[layout.order]
        kind = TransposedLinearGrads if module.is_transposed else LinearGrads
        shape = weight.shape[::-1] if module.is_transposed else weight.shape
        self.groups = [
            (members, kind(_Map(weight, bias), pa, pg, shape, flags))
            for (members, *_), pa, pg in zip(layout.groups, layout.padded(a), layout.padded(g))
        ]
        self.a, self.g, self.example, self.transposed = a, g, layout.example, module.is_transposed
        self.batch, self.flags, self.has_bias = layout.batch, flags, bias is not None

    def norms_sq(self) -> torch.Tensor:
        out = self.a.new_zeros(self.batch)
        for members, linear in self.groups:
            out[members] = linear.norms_sq()
        return out

    def per_sample(self) -> list[torch.Tensor]:
        out = None
        for members, linear in self.groups:
            parts = linear.per_sample()
            if out is None:
                out = [t.new_zeros(self.batch, *t.shape[1:]) for t in parts]
            for o, t in zip(out, parts):
                o[members] = t
        return out

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        g, dot = self.g * weights[self.example, None].to(self.g.dtype), gemm_dot(self.flags)
        w = (
            products(torch.mm, self.a.T, g, dot)
            if self.transposed
            else products(torch.mm, g.T, self.a, dot)
        )
        return [w, g.sum(0)] if self.has_bias else [w]


class ExpertsGrads(LayerGrads):
    """An experts module's parameters, (E, ...) each: expert e's slices are those of the
    linear maps in ``maps[name][e]`` (:class:`_Routed`, or a :class:`LinearGrads`; weight,
    then bias if the experts have biases), zero for the experts no token was routed to."""

    def __init__(self, module: nn.Module, maps: dict[str, dict[int, LayerGrads]], batch: int):
        self.named = list(module.named_parameters(recurse=False))
        self.params = [p for _, p in self.named]
        self.maps, self.batch = maps, batch

    def _part(self, name: str) -> tuple[str, int]:
        """(map, 0 for its weights or 1 for its biases) of parameter ``name``."""
        return (name[: -len("_bias")], 1) if name.endswith("_bias") else (name, 0)

    def norms_sq(self) -> torch.Tensor:
        p = self.params[0]
        out = torch.zeros(self.batch, dtype=p.dtype, device=p.device)
        for experts in self.maps.values():
            for part in experts.values():
                out = out + part.norms_sq()
        return out

    def _by_expert(self, fn, lead: tuple) -> list[torch.Tensor]:
        """Each parameter's (*lead, E, ...) tensor: expert e's slice the entry of ``fn(part)``
        (weight, bias) of its part, zeros for the experts no token was routed to."""
        done = {m: {e: fn(part) for e, part in experts.items()} for m, experts in self.maps.items()}
        out = []
        for name, p in self.named:
            m, k = self._part(name)
            t = p.new_zeros(*lead, *p.shape)
            for e, parts in done[m].items():
                t[(slice(None),) * len(lead) + (e,)] = parts[k]
            out.append(t)
        return out

    def weighted_sum(self, weights: torch.Tensor) -> list[torch.Tensor]:
        return self._by_expert(lambda part: part.weighted_sum(weights), ())

    def per_sample(self) -> list[torch.Tensor]:
        return self._by_expert(lambda part: part.per_sample(), (self.batch,))


def _refuse(module: nn.Module) -> None:
    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise PrivgradError(
            f"{name}: experts with a norm after each expert (has_post_expert_norm) have no "
            "per-sample rule"
        )
    if getattr(module, "_is_expert_parallel", False):
        raise PrivgradError(f"{name}: experts split across processes have no per-sample rule")


@takes_flags
@reads_calls
def experts_rule(module: nn.Module, calls, grads, flags: EngineFlags = DEFAULT_FLAGS):
    """A Hugging Face experts module, called on (B·T, d) tokens with their (B·T, k) experts
    and routing weights, its output gradient read as (B, T, d). For expert e and the pairs
    (token t, slot j) routed to it: z = W1_e x_t + b1_e, h = gate(z), and the output gradient
    of its second map is dy = w_{t,j} g_t; dz is gate's VJP of dh = W2_eᵀ dy (autograd on
    the module's own gate). Then W1_e is a linear map from x to z and W2_e one from h to y."""
    _refuse(module)
    up = "gate_up_proj" if module.has_gate else "up_proj"
    w1, w2 = getattr(module, up).detach(), module.down_proj.detach()
    b1 = getattr(module, f"{up}_bias").detach() if module.has_bias else None
    b2 = module.down_proj_bias.detach() if module.has_bias else None
    n_experts, dtype = w1.shape[0], w1.dtype
    known = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"} if module.has_bias else set())
    other = [n for n, _ in module.named_parameters(recurse=False) if n not in known]
    if other:
        raise PrivgradError(
            f"{type(module).__name__}: its parameter '{other[0]}' is none of an experts "
            f"module's ({', '.join(sorted(known))}); it has no per-sample rule"
        )
    rows: dict[str, dict[int, list]] = {up: {}, "down_proj": {}}
    batch = grads[0].shape[0]
    for call, g in zip(calls, grads):
        x, idx, weights = list(call.arguments.values())[:3]
        tokens = g[..., 0].numel()  # B·T: the engine's (B, T, d) view, or (B, d)
        if x.dim() != 2 or x.shape[0] != tokens or idx.shape[0] != tokens:
            raise PrivgradError(
                f"{type(module).__name__} was called on tokens of shape {tuple(x.shape)} with "
                f"experts of shape {tuple(idx.shape)} for an output gradient of "
                f"{tuple(g.shape)}: its per-sample rule needs the batch's tokens as (B·T, d)"
            )
        token = torch.arange(tokens, device=x.device).repeat_interleave(idx.shape[-1])
        expert, weight = idx.reshape(-1), weights.reshape(-1).to(dtype)
        x, g = x.to(dtype), g.reshape(tokens, -1).to(dtype)
        for e in torch.unique(expert).tolist():
            if e >= n_experts:  # an expert-parallel sentinel: no expert here
                continue
            pair = (expert == e).nonzero().squeeze(1)
            t = token[pair]
            xe, dy = x[t], g[t] * weight[pair, None]
            if module.is_transposed:
                z = xe @ w1[e] + (b1[e] if b1 is not None else 0)
            else:
                z = F.linear(xe, w1[e], None if b1 is None else b1[e])
            with torch.enable_grad():
                z = z.detach().requires_grad_()
                h = module._apply_gate(z) if module.has_gate else module.act_fn(z)
            dh = dy @ (w2[e].T if module.is_transposed else w2[e])
            (dz,) = torch.autograd.grad(h, z, dh)
            example = t // (tokens // batch)
            rows[up].setdefault(e, []).append((xe, dz, example))
            rows["down_proj"].setdefault(e, []).append((h.detach(), dy, example))
    layouts = {
        e: _Layout(torch.cat([ex for *_, ex in calls]), batch) for e, calls in rows[up].items()
    }
    maps = {
        name: {
            e: _Routed(
                torch.cat([a for a, *_ in calls]),
                torch.cat([gz for _, gz, _ in calls]),
                layouts[e],
                w[e],
                None if b is None else b[e],
                module,
                flags,
            )
            for e, calls in by_expert.items()
        }
        for name, by_expert, w, b in (
            (up, rows[up], w1, b1),
            ("down_proj", rows["down_proj"], w2, b2),
        )
    }
    return ExpertsGrads(module, maps, batch)


def _example_major(module: nn.Module, arguments: dict, keep: torch.Tensor) -> dict:
    """A call's (B·T, ...) arguments restricted to the examples of ``keep``: each kept
    example's T rows."""
    return {
        name: v.reshape(len(keep), -1, *v.shape[1:])[keep].flatten(0, 1)
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] % len(keep) == 0
        else v
        for name, v in arguments.items()
    }


def _kept_expert_major(module: nn.Module, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts' (E·B·T, d) rows, expert-major, each expert's block of B·T rows
    example-major (or any view of them), as (E, kept, T, d): the examples of ``keep``."""
    return t.reshape(module.num_experts, len(keep), -1, t.shape[-1])[:, keep]


def _expert_major_grad(module: nn.Module, g: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The engine's (B, E·T, d) view of Llama 4's experts' output gradient restricted to the
    examples of ``keep``, in the same view."""
    return _kept_expert_major(module, g, keep).reshape(int(keep.sum()), -1, g.shape[-1])


def _expert_major(module: nn.Module, arguments: dict, keep: torch.Tensor) -> dict:
    """Llama 4's experts call restricted to the examples of ``keep``."""
    x = arguments["hidden_states"]
    return {**arguments, "hidden_states": _kept_expert_major(module, x, keep).flatten(0, 2)}


@takes_flags
@reads_calls
def llama4_experts_rule(module: nn.Module, calls, grads, flags: EngineFlags = DEFAULT_FLAGS):
    """Llama 4's ``Llama4TextExperts``: every token goes through every expert, its input
    scaled by the router's score for that expert (0 where not routed), as (E·B·T, d) rows,
    expert-major: expert e's block is x_e (B·T, d) → z = x_e W1_e (W1_e stored (d, 2I)),
    h = up ⊙ act(gate), y = h W2_e. The engine's (B, E·T, d) view of the output gradient is
    read back in that order; each expert's two maps are then linear layers over each
    example's T positions (no padding: every example has T rows in every expert)."""
    w1, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
    n_experts, dtype = w1.shape[0], w1.dtype
    batch = grads[0].shape[0]
    maps: dict[str, dict[int, list]] = {"gate_up_proj": {}, "down_proj": {}}
    for call, g in zip(calls, grads):
        x = call.arguments["hidden_states"].to(dtype)
        x = x.reshape(n_experts, batch, -1, x.shape[-1])
        g = g.to(dtype).reshape(x.shape)
        for e in range(n_experts):
            with torch.enable_grad():
                z = (x[e] @ w1[e]).requires_grad_()
                gate, up = z.chunk(2, dim=-1)
                h = up * module.act_fn(gate)
            (dz,) = torch.autograd.grad(h, z, g[e] @ w2[e].T)
            maps["gate_up_proj"].setdefault(e, []).append((x[e], dz))
            maps["down_proj"].setdefault(e, []).append((h.detach(), g[e]))
    return ExpertsGrads(
        module,
        {
            name: {
                e: TransposedLinearGrads(
                    _Map(w[e], None),
                    torch.cat([a for a, _ in parts], 1),
                    torch.cat([gz for _, gz in parts], 1),
                    w.shape[1:][::-1],
                    flags,
                )
                for e, parts in by_expert.items()
            }
            for name, by_expert, w in (
                ("gate_up_proj", maps["gate_up_proj"], w1),
                ("down_proj", maps["down_proj"], w2),
            )
        },
        batch,
    )


# both read the batch's rows flattened (folds_rows), each knowing their order (select_rows)
experts_rule.folds_rows = llama4_experts_rule.folds_rows = True
experts_rule.select_rows, llama4_experts_rule.select_rows = _example_major, _expert_major
llama4_experts_rule.select_grad = _expert_major_grad
# experts classes of transformers outside the decorator's interface, by qualified name
NAMED_EXPERTS = {
    "transformers.models.llama4.modeling_llama4.Llama4TextExperts": llama4_experts_rule
}
