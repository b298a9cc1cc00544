"""Tables the batch shares: a layer whose output has no rows of the batch's, which every example
uses whole. T5's and MPNet's relative-attention bias is an Embedding of a (T × T) grid of
relative-position buckets, embedded to (T, T, heads) and added to every example's attention
scores; BEiT's and Swin's is a layer of its own that indexes its table of biases by relative
position (Swin adds it to attention over (B · windows) rows, k rows per example).

Such an output has no per-example rows to tap: its gradient is the batch's sum. Example i's
share exists only past the ops where the table *meets the batch*, a broadcast against batched
tensors (``scores + bias``, ``bias.expand(B, ...)``, a mask, SDPA's ``attn_mask``). So the
table's output ``E`` goes on as a tensor subclass (:class:`_Shared`) that follows every tensor
computed from it; at a meeting the shared operand ``t`` is replaced by ``t`` broadcast to the
batch's rows, ``(1, ...) -> (B·k, ...)``, through a tap (the op's result is unchanged). That
tap's gradient, summed over each example's k rows, is each example's gradient of ``t``; as it
arrives it is mapped back to ``E`` by autograd on the ops from ``E`` to ``t`` (one backward,
batched over examples: ``autograd.grad`` with ``is_grads_batched``), and at the step from
``E`` to the layer's parameters the same way (:meth:`SharedTables.layer_grads`): each
example's parameter gradients, built (a table is small).

Which ops are meetings is learned by make_private's check (``GradSampler.assume_layouts``) from
shapes, on its probe examples, where the per-sample gradients are then compared with
autograd's; after it, by the op's place in the model's code (file and line), not by shapes,
which a head count or a length can make look batched when it equals a batch's size. A use at a
place the check did not see, and any other op that mixes the table with a tensor carrying a
gradient, are refused; a path from the table to the loss that meets no batch is caught in the
backward.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from privgrad.errors import PrivgradError
from privgrad.per_sample.rules import RULES, LayerGrads, MaterializedGrads, layer_params, takes_call

_T = torch.Tensor
_ELEMENTWISE = {
    torch.add, _T.add, _T.add_, _T.__add__, _T.__radd__, _T.__iadd__,
    torch.sub, _T.sub, _T.sub_, _T.__sub__, _T.__rsub__, _T.__isub__,
    torch.mul, _T.mul, _T.mul_, _T.__mul__, _T.__rmul__, _T.__imul__,
    torch.div, _T.div, _T.div_, _T.__truediv__, _T.__rtruediv__, _T.__itruediv__,
    torch.where, _T.where,
}  # fmt: skip
_MATMUL = {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.bmm, _T.bmm}
_EXPAND = {_T.expand, _T.expand_as, torch.broadcast_to, _T.broadcast_to}
_SKIP = (os.path.dirname(torch.__file__) + os.sep, __file__)


def _result_shape(func, args: tuple, kwargs: dict, tensors: list) -> tuple[int, ...] | None:
    """The shape an op that may broadcast a shared operand against the batch returns
    (elementwise arithmetic, ``where``, batched matmul, ``expand``, SDPA's mask), ``tensors``
    its tensor arguments; None for any other op, or a form of these that does not broadcast
    leading axes."""
    if func in _ELEMENTWISE:
        return tuple(torch.broadcast_shapes(*(v.shape for v in tensors)))
    if func in _MATMUL:
        a, b = args[:2]
        if a.dim() < 3 and b.dim() < 3 or min(a.dim(), b.dim()) < 2:
            return None  # a product without batch axes: its rows are not examples
        return (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    if func in _EXPAND:
        self = args[0]
        if func is _T.expand_as:
            return tuple(args[1].shape)
        sizes = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
        sizes = kwargs.get("size", sizes)
        dims = (1,) * (len(sizes) - self.dim()) + tuple(self.shape)
        return tuple(d if s == -1 else s for s, d in zip(sizes, dims))
    if func is F.scaled_dot_product_attention:
        q, k, v = args[:3]
        if any(type(t) is not _T for t in (q, k, v)):
            return None  # only its mask may be shared
        return (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], v.shape[-1])
    return None


def _aligned(t: torch.Tensor, n: int) -> tuple[int, ...]:
    """``t``'s shape right-aligned to ``n`` axes (leading ones added), as broadcasting reads it."""
    return (1,) * (n - t.dim()) + tuple(t.shape)


def _call_site() -> tuple[str, int]:
    """Where the model's code called the op being dispatched (file, line), torch's own frames
    and this module's skipped."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


class _Shared(torch.Tensor):
    """A tensor computed from a shared table's output alone (no batch yet): its ops go through
    :meth:`SharedTables.op` while the sampler records."""

    _origin: tuple  # (SharedTables, layer, _TableCall)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            flat, spec = tree_flatten((args, kwargs))
            shared = [v for v in flat if isinstance(v, _Shared)]
            if not shared or not shared[0]._origin[0].sampler._recording:
                return func(*args, **kwargs)
            return shared[0]._origin[0].op(func, args, kwargs, flat, spec)


class Cut(torch.autograd.Function):
    """Identity whose backward hands the gradient to ``receive`` and stops there (the output
    depends on ``anchor`` only): at a meeting, on a shared operand broadcast to the batch (the
    table's summed gradient is never formed); in the own loop, on the model's output (the step
    runs the model's backward)."""

    @staticmethod
    def forward(ctx, x, anchor, receive):
        ctx.receive = receive
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        ctx.receive(g)
        return None, None, None


class _LeakTap(torch.autograd.Function):
    """Identity on a shared table's output (detached): a gradient reaching it came by a path
    that met no batch (the meetings' taps stop theirs), which the per-sample gradients would
    leave out."""

    @staticmethod
    def forward(ctx, out, anchor, leak):
        ctx.set_materialize_grads(False)
        ctx.leak = leak
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        if g is not None:
            ctx.leak()
        return None, None, None


class _TableCall:
    """One call of a table layer in the recorded forward: its output (``raw``, and ``out``
    tapped), the per-example gradients of it that have arrived from its meetings, summed, and
    which meetings have."""

    def __init__(self, raw: torch.Tensor, out: torch.Tensor):
        self.raw, self.out = raw, out
        self.grad: torch.Tensor | None = None
        self.arrived: list[bool] = []


class SharedTables:
    """The table layers of a :class:`~privgrad.per_sample.engine.GradSampler`: the meetings
    learned by make_private's check (``sites``, per layer: (file, line, op) → whether the op
    meets the batch there; its keys are the layers read so), and the recorded forward's
    calls."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.sites: dict[nn.Module, dict[tuple, bool]] = {}
        self.calls: dict[nn.Module, list[_TableCall]] = {}

    def is_table(self, module: nn.Module, inputs: tuple, kwargs: dict | None, out) -> bool:
        """Whether this call is a table's: a layer the check read so, always (its arguments'
        shapes may equal a batch's by chance); while the check learns, an Embedding whose
        output lacks the batch's rows and none of whose ids' axes has the batch's size
        (XLNet's (T, B) ids carry the batch; flattened (B·T,) ids are the engine's ``folded``
        and one row of ids, (1, T), its ``expanded``), or a layer without a rule whose output
        lacks the batch's rows and either has one row (a position table sliced to its input's
        length) or whose call has no tensor argument (BEiT's relative position bias)."""
        if module in self.sites:
            return True
        batch = self.sampler._batch
        if not self.sampler.assume_layouts or not isinstance(out, torch.Tensor):
            return False
        if out.shape[:1] == (batch,):
            return False
        if isinstance(module, nn.Embedding) and (
            type(module) is nn.Embedding or type(module) not in RULES
        ):
            ids = inputs[0]
            flattened = ids.dim() == 1 and ids.shape[0] % batch == 0  # (B·T,): ``folded``
            return ids.shape[:1] != (1,) and batch not in ids.shape and not flattened
        if type(module) in RULES or takes_call(module):
            return False
        leaves = tree_flatten((inputs, kwargs or {}))[0]
        return out.shape[:1] == (1,) or not any(isinstance(v, _T) for v in leaves)

    def record(self, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """The table's output, tapped for leaks and followed (:class:`_Shared`)."""
        self.sites.setdefault(module, {})
        calls = self.calls.setdefault(module, [])
        sampler = self.sampler
        # the tap takes the output detached: no backward of the model's reaches the layer's
        # own graph, which layer_grads runs later
        tapped = _LeakTap.apply(out.detach(), sampler._anchor, partial(self._leak, module))
        calls.append(_TableCall(out, tapped))
        shared = tapped.as_subclass(_Shared)
        shared._origin = (self, module, calls[-1])
        return shared

    def _leak(self, module: nn.Module) -> None:
        if self.sampler._error is None:
            self.sampler._error = PrivgradError(
                f"layer '{self.sampler.names[module]}' ({type(module).__name__}) is a table the "
                "batch shares (its output has no batch axis), and a tensor computed from it "
                "reached the loss without being broadcast against the batch (privgrad "
                "attributes a shared table's gradient to examples where it is added to, "
                "multiplied with or expanded to batched tensors): its per-sample gradients "
                "would miss that use"
            )

    def op(self, func, args: tuple, kwargs: dict, flat: list, spec) -> object:
        """An op on tensors computed from a table (subclass dispatch disabled; ``flat`` and
        ``spec`` its arguments flattened): at a meeting the result with the shared operands
        broadcast to the batch through taps, else the result, followed."""
        tensors = [v for v in flat if isinstance(v, _T)]
        shared = [v for v in tensors if isinstance(v, _Shared)]
        _, module, call = shared[0]._origin
        name = f"layer '{self.sampler.names[module]}' ({type(module).__name__})"
        if any(s._origin[2] is not call for s in shared):
            raise PrivgradError(f"{name}: an op mixes the outputs of two shared-table calls")
        if not any(c is call for c in self.calls.get(module, ())):
            raise PrivgradError(
                f"{name}: a tensor computed from its output in an earlier forward (kept by the "
                "model, a cache?) is used again: compute it from the table in each forward"
            )
        batch, what = self.sampler._batch, getattr(func, "__name__", str(func))
        shape = _result_shape(func, args, kwargs, tensors)
        meets = bool(shape) and self._meets(func, args, tensors, shared, shape, name, what)
        if not meets:
            mixed = [v for v in tensors if not isinstance(v, _Shared) and v.requires_grad]
            if mixed and torch.is_grad_enabled():
                raise PrivgradError(
                    f"{name}: its output is a table the batch shares, and {what} combines a "
                    "tensor computed from it with another that has a gradient without "
                    "broadcasting it against the batch: privgrad attributes a shared table's "
                    "gradient to examples only where it is added to, multiplied with, "
                    "matrix-multiplied with or expanded to batched tensors"
                )
            return tree_map(partial(self._follow, shared[0]._origin), func(*args, **kwargs))
        met = [
            self._meet(call, v, len(shape), shape[0] // batch)
            if isinstance(v, _Shared) and v.requires_grad
            else v
            for v in flat
        ]
        args, kwargs = tree_unflatten(met, spec)
        return func(*args, **kwargs)

    def _meets(self, func, args, tensors, shared, shape, name: str, what: str) -> bool:
        """Whether the op broadcasts the shared operands against the batch, its result's rows
        the batch's or k per example, example-major (Swin's windows, (B·windows, ...)): SDPA's
        mask always does when the query has the batch's rows (its first axis is the batch by
        SDPA's contract), so a mask made only in some batches (Hugging Face's SDPA path of T5
        adds a padding mask to the bias) needs no check of its own; any other op as
        make_private's check saw it at this place in the model's code (learned there from
        shapes; the check's gradients also check the rows' order)."""
        batch, rows = self.sampler._batch, shape[0]
        grads = [s for s in shared if s.requires_grad]
        fits = rows % batch == 0 and all(_aligned(s, len(shape))[0] == 1 for s in grads)
        if func is F.scaled_dot_product_attention and args[0].shape[0] == batch == rows:
            return bool(grads) and fits and args[0].requires_grad
        module = shared[0]._origin[1]
        file, line = _call_site()
        site = (file, line, what)
        if self.sampler.assume_layouts:
            batched = func in _EXPAND or any(
                not isinstance(v, _Shared) and _aligned(v, len(shape))[0] == rows for v in tensors
            )
            meets = bool(grads) and fits and batched
            if self.sites[module].setdefault(site, meets) != meets:
                raise PrivgradError(
                    f"{name}: its output is a table the batch shares, and its use at "
                    f"{file}:{line} ({what}) broadcasts it against the batch in one call and "
                    "not in another: privgrad cannot tell where the examples are"
                )
            return meets
        if site not in self.sites[module]:
            raise PrivgradError(
                f"{name}: its output is a table the batch shares; make_private's check learned "
                "where it meets the batch on its probe examples, and did not see this use "
                f"({what} at {file}:{line}): the model takes another path here (a mask made "
                "only for some batches? another attention implementation?); if its probe "
                "examples lack what this batch has (padding), pass make_private examples "
                "that have it, or build the model with attn_implementation='eager'"
            )
        meets = self.sites[module][site]
        if meets and not fits:
            raise PrivgradError(
                f"{name}: its use at {file}:{line} ({what}) met the batch at make_private's "
                f"check, but here gives shape {shape} for a batch of {batch} (not a multiple)"
            )
        return meets

    @staticmethod
    def _follow(origin: tuple, v):
        if isinstance(v, _T) and v.requires_grad and not isinstance(v, _Shared):
            v = v.as_subclass(_Shared)
            v._origin = origin
        return v

    def _meet(self, call: _TableCall, t: torch.Tensor, n: int, fold: int) -> torch.Tensor:
        """``t`` broadcast to the batch's rows, ``(1, ...) -> (B·fold, ...)``, through a tap
        whose gradient adds to ``t``'s per-example gradients."""
        plain = t.as_subclass(torch.Tensor)
        aligned = _aligned(t, n)
        x = plain.reshape(aligned).expand(self.sampler._batch * fold, *aligned[1:])
        call.arrived.append(False)
        receive = partial(self._receive, call, plain, len(call.arrived) - 1, fold)
        return Cut.apply(x, self.sampler._anchor, receive)

    def _receive(
        self, call: _TableCall, t: torch.Tensor, meeting: int, fold: int, g: torch.Tensor
    ) -> None:
        """A meeting's tap: each example's gradient of ``t`` (the sum over its ``fold`` rows),
        mapped back to the table's output through the ops between (still in the graph: the
        backward reaches them after every meeting's tap), batched over examples."""
        sampler = self.sampler
        if sampler._error is not None:
            return
        if call.arrived[meeting] and sampler._deferred:
            sampler._error = PrivgradError(
                "a second backward reached a shared table's use before optimizer.step(): "
                "call loss.backward() once per batch, then optimizer.step()"
            )
            return
        call.arrived[meeting] = True
        g = g.reshape(g.shape[0] // fold, fold, *t.shape).sum(1)
        (g,) = torch.autograd.grad(t, call.out, g, retain_graph=True, is_grads_batched=True)
        call.grad = g if call.grad is None else call.grad + g

    def received(self) -> bool:
        """Whether any meeting's gradient has arrived since the forward."""
        return any(any(c.arrived) for calls in self.calls.values() for c in calls)

    def output_grads(self, module: nn.Module) -> list[torch.Tensor | None]:
        """Each call's per-example gradients of the table's output, (B, *output shape) (None
        for a call none of whose meetings got a gradient)."""
        return [call.grad for call in self.calls.get(module, [])]

    def layer_grads(self, module: nn.Module, grads: list[torch.Tensor]) -> LayerGrads:
        """The layer's per-sample parameter gradients from each call's per-example output
        gradients ``grads`` (as the engine hands them to a rule: examples dropped, scaled):
        autograd from the call's output to the parameters, batched over examples."""
        params = layer_params(module)
        total = [0] * len(params)
        for call, g in zip(self.calls[module], grads):
            got = torch.autograd.grad(
                call.raw,
                params,
                g.to(call.raw.dtype),
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
            total = [t if x is None else t + x for t, x in zip(total, got)]
        batch = grads[0].shape[0]
        return MaterializedGrads(
            params,
            [
                p.new_zeros(batch, *p.shape) if isinstance(t, int) else t.to(p.dtype)
                for p, t in zip(params, total)
            ],
        )

    def forget_gradients(self) -> None:
        for calls in self.calls.values():
            for call in calls:
                call.grad, call.arrived = None, [False] * len(call.arrived)

    def clear(self) -> None:
        self.calls = {}
