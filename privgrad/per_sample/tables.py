"""Tables the batch shares: a layer whose output has no rows of the batch's, which every example
uses whole. T5's and MPNet's relative-attention bias is an Embedding of a (T × T) grid of
relative-position buckets, embedded to (T, T, heads) and added to every example's attention
scores; BEiT's and Swin's is a layer of its own without a rule that indexes its table of
biases by relative position (its own parameter: below; Swin adds it to attention over
(B · windows) rows, k rows per example).

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

A layer without a rule has its own parameters followed the same way, each parameter read in
the layer's forward as a followed view of itself (BEiT's layer scales and [CLS] token,
DeBERTa's attention biases, Funnel's position kernel met in an einsum, which gets the batch's
subscript, a matrix multiplying the batch's rows, ``F.linear(h, W, b)`` or ``x @ W``, which
then multiplies each example's rows by its own copy): no forward is replayed, so dropout
inside the layer trains. make_private's check tries every such layer so, and leaves one whose
parameters meet the batch otherwise (``torch.mm(x, self.weight)``, a convolution) to the
generic rule (:meth:`SharedTables.follows_params`).

Which ops are meetings is learned by make_private's check (``GradSampler.assume_layouts``) from
shapes, on its probe examples, where the per-sample gradients are then compared with
autograd's; after it, by the op's place in the model's code (file, line, bytecode offset),
not by shapes, which a head count or a length can make look batched when it equals a batch's
size. A use at a
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
from privgrad.per_sample.rules import (
    RULES,
    LayerGrads,
    MaterializedGrads,
    layer_params,
    read_children,
    takes_call,
)

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


def _einsum_parts(args: tuple) -> tuple[list[str], str, tuple] | None:
    """An einsum's inputs' subscripts, its output's and its operands, for an explicit
    equation (``->``) without ellipsis and with an output; else None."""
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    inputs = inputs.split(",")
    if len(inputs) != len(operands) or not output:
        return None
    return inputs, output, operands


def _is_row_product(func, args: tuple, kwargs: dict) -> bool:
    """Whether the op multiplies rows that are not shared by a shared matrix:
    ``F.linear(x, W, b)`` (W or b shared; x (N, ..., in)) or ``x @ W`` (x (N, in), W shared
    (in, out)). Its rows are the batch's, or k per example, example-major, where the op meets
    the batch."""
    if func is F.linear:
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        shared = isinstance(w, _Shared) or isinstance(b, _Shared)
        return shared and not isinstance(x, _Shared) and x.dim() >= 2 and w.dim() == 2
    if func in _MATMUL and func not in (torch.bmm, _T.bmm) and len(args) == 2:
        a, b = args
        return a.dim() == b.dim() == 2 and isinstance(b, _Shared) and not isinstance(a, _Shared)
    return False


_CONV = (F.conv1d, F.conv2d, F.conv3d)
_CONV_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _conv_args(args: tuple, kwargs: dict) -> dict:
    """A convolution's arguments by name, defaults filled in."""
    named = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    return {**named, **dict(zip(_CONV_PARAMS, args)), **kwargs}


def _is_shared_convolution(func, args: tuple, kwargs: dict) -> bool:
    """Whether the op convolves a batch (N, C, ...) that is not shared by a kernel computed
    from a table (weight-normed ``Conv1d``: Wav2Vec2's and HuBERT's positional convolution).
    Where it meets the batch, its output's rows are the examples."""
    if func not in _CONV:
        return False
    a = _conv_args(args, kwargs)
    x, w = a["input"], a["weight"]
    return isinstance(w, _Shared) and not isinstance(x, _Shared) and x.dim() == w.dim()


def _is_masked_fill(func, args: tuple, kwargs: dict) -> bool:
    """Whether the op writes a value computed from a table into the rows of a tensor that
    is not shared that a boolean mask over its leading axes selects, ``h[mask] = v``
    (Wav2Vec2's SpecAugment: its learned embedding written over masked time steps). Where
    it meets the batch, each selected row's value belongs to the example of its row."""
    if func is not _T.__setitem__ or len(args) != 3 or kwargs:
        return False
    target, index, value = args
    return (
        isinstance(value, _Shared)
        and isinstance(index, _T)
        and not isinstance(index, _Shared)
        and not isinstance(target, _Shared)
        and index.dtype == torch.bool
        and 1 <= index.dim() <= target.dim()
        and tuple(index.shape) == tuple(target.shape[: index.dim()])
    )


def _row_meeting(func, args: tuple, kwargs: dict) -> str | None:
    """Which meeting that gives the shared operand to each row of the batch's (or k per
    example) the op would be: 'rows' (:func:`_is_row_product`), 'convolution'
    (:func:`_is_shared_convolution`) or 'fill' (:func:`_is_masked_fill`); None for any other
    op. Told once per op (:meth:`SharedTables.op`)."""
    for kind, test in (
        ("rows", _is_row_product),
        ("convolution", _is_shared_convolution),
        ("fill", _is_masked_fill),
    ):
        if test(func, args, kwargs):
            return kind
    return None


def _result_shape(
    func, args: tuple, kwargs: dict, tensors: list, row_meeting: str | None
) -> tuple[int, ...] | None:
    """The shape an op that may broadcast a shared operand against the batch returns
    (elementwise arithmetic, ``where``, batched matmul, ``expand``, SDPA's mask, an einsum
    whose output's first axis is another operand's first, rows times a shared matrix:
    :meth:`SharedTables._meets`),
    ``tensors`` its tensor arguments, ``row_meeting`` :func:`_row_meeting`'s; None for any
    other op, or a form of these that does not broadcast leading axes."""
    if func is torch.einsum:
        parts = _einsum_parts(args)
        if parts is None:
            return None
        inputs, output, operands = parts
        sizes = {c: n for sub, v in zip(inputs, operands) for c, n in zip(sub, v.shape)}
        return tuple(sizes[c] for c in output)
    if func in _ELEMENTWISE:
        return tuple(torch.broadcast_shapes(*(v.shape for v in tensors)))
    if row_meeting == "rows":
        return (*args[0].shape[:-1], args[1].shape[0 if func is F.linear else 1])
    if row_meeting == "fill":
        return tuple(args[0].shape)
    if row_meeting == "convolution":
        # one dtype: under autocast the batch's rows may be bf16 and the kernel float32 (the
        # real call casts them; autocast does not touch tensors on the meta device)
        meta = {
            k: v.to("meta", torch.float32) if isinstance(v, _T) else v
            for k, v in _conv_args(args, kwargs).items()
        }
        return tuple(func(**meta).shape)
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


def _shares(t: torch.Tensor, batch: int) -> bool:
    """Whether a layer's argument ``t`` is one the batch shares: computed from tables alone
    (followed), or without a gradient and with one row for all examples, or with rows that
    are no multiple of the batch's and no axis of its size (flattened (B·T, d) rows, a
    (T, B, d) input carry the batch)."""
    if isinstance(t, _Shared):
        return True
    if t.requires_grad or not t.dim():
        return False
    return t.shape[0] == 1 or (t.shape[0] % batch != 0 and batch not in t.shape)


_MODULE_CALLS = (nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__)


def _call_site(model: nn.Module) -> tuple[str, int, int]:
    """Where the model's code called the op being dispatched: file, line and the call's
    bytecode offset (two ops on one line are two places), torch's own frames, this module's
    and a mode's ``__torch_function__`` (the engine's, active in a layer's forward) skipped.
    Where torch's code runs all the way up to ``model``'s call (a parametrization's weight
    inside an ``nn.Sequential``), the innermost of torch's frames: the next one out is
    whoever called the model, make_private's check or your loop."""
    frame, innermost = sys._getframe(2), None
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_SKIP) or frame.f_code.co_name == "__torch_function__"
    ):
        if innermost is None and frame.f_code.co_filename != __file__:
            innermost = frame
        if frame.f_code in _MODULE_CALLS and frame.f_locals.get("self") is model:
            frame = innermost or frame
            break
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, frame.f_lasti


class _Shared(torch.Tensor):
    """A tensor computed from a shared table's output alone (no batch yet): its ops go through
    :meth:`SharedTables.op` while the sampler records."""

    _origin: tuple  # (SharedTables, layers, their calls (_TableCall) it is computed from)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is _T.repeat
            and isinstance(args[0], _Shared)
            and not kwargs
            and args[0]._origin[0].sampler._following()
        ):
            # tiling the first axis m times (DeBERTa-v2's position projections, repeated to
            # the batch's B·heads rows) is expanding a new first axis and merging it: the
            # expand may meet the batch (SharedTables.op), the merge then runs on batched rows
            t, reps = (
                args[0],
                args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:],
            )
            if len(reps) == t.dim() > 0 and all(r == 1 for r in reps[1:]) and reps[0] >= 1:
                m = reps[0]
                tiled = t.unsqueeze(0).expand(m, *t.shape).reshape(m * t.shape[0], *t.shape[1:])
                return tiled.contiguous()  # as repeat's: a view of it may follow (WavLM's)
        with torch._C.DisableTorchFunctionSubclass():
            flat, spec = tree_flatten((args, kwargs))
            shared = [v for v in flat if isinstance(v, _Shared)]
            if not shared or not shared[0]._origin[0].sampler._following():
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
    leave out. Zeros are none: a custom autograd Function between (SEW-D's StableDropout)
    hands on zeros where the taps stopped its output's gradient."""

    @staticmethod
    def forward(ctx, out, anchor, leak):
        ctx.set_materialize_grads(False)
        ctx.leak = leak
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        if g is not None and g.any():
            ctx.leak()
        return None, None, None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def kept_as_is() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep a table's side of the graph as it is (small), outside any
    activation checkpoint around it: a checkpoint would recompute its whole block for each
    backward through those ops, inside the batched (vmap) backwards here, where a dropout
    cannot draw."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _ignore(*args) -> None:
    """A replica's tap: receives nothing."""


class ReplayInstead(PrivgradError):
    """A forward of make_private's check found layers whose own parameters are no tables
    (:meth:`SharedTables.replay_failed`): the check runs it again."""


class _TableCall:
    """One call of a table layer in the recorded forward: its output (``raw``, and ``out``
    tapped), the per-example gradients of it that have arrived from its meetings, summed, and
    which meetings have."""

    def __init__(self, raw: torch.Tensor, out: torch.Tensor, replica: bool = False):
        self.raw, self.out, self.replica = raw, out, replica
        self.grad: torch.Tensor | None = None
        self.arrived: list[bool] = []


class SharedTables:
    """The table layers of a :class:`~privgrad.per_sample.engine.GradSampler`: the meetings
    learned by make_private's check (``sites``, per layer: (file, line, offset, op) → whether the op
    meets the batch there; its keys are the layers read so), and the recorded forward's
    calls."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.calls: dict[nn.Module, list[_TableCall]] = {}
        self.forget_layouts()

    def forget_layouts(self) -> None:
        """Forgets what a check learned (make_private's check starts so)."""
        self.sites: dict[nn.Module, dict[tuple, bool]] = {}
        # layers without a rule whose own parameters are followed as tables; those the check
        # found otherwise (replayed by the generic rule), and those found so in this forward
        self.params: set[nn.Module] = set()
        self.replayed: set[nn.Module] = set()
        self.failed: set[nn.Module] = set()
        self.batched: set[nn.Module] = set()  # layers with a rule the check saw on the batch
        self.rerun: set[nn.Module] = set()  # ... and then on shared tensors: followed in all

    _LAYOUTS = ("sites", "params", "replayed", "failed", "batched", "rerun")

    def layouts(self) -> dict:
        """A copy of what a check learned (:meth:`forget_layouts`' fields), for
        :meth:`restore_layouts`."""
        return {
            name: {m: dict(v) for m, v in self.sites.items()} if name == "sites" else set(v)
            for name in self._LAYOUTS
            for v in [getattr(self, name)]
        }

    def restore_layouts(self, layouts: dict) -> None:
        for name, value in layouts.items():
            setattr(self, name, value)

    def follows_params(self, module: nn.Module, args: tuple = ()) -> bool:
        """Whether a layer has its own parameters followed as tables the batch shares in this
        call (``args``), instead of its calls replayed by the generic rule (a layer without a
        rule) or recorded for its rule: each parameter then meets the batch where broadcast
        against it (``x * self.scale``, ``q + self.bias``), the backward's per-example
        gradients there are its own, and no forward is replayed (its dropout needs no
        replay). While the check learns, every layer without a rule is tried so, and one with
        a use that is no meeting (``torch.mm(x, self.weight)``) is dropped from the route
        (:meth:`replay_failed`); so is a layer with a rule (not an Embedding, whose tables
        are its output) called on tensors the batch shares (:func:`_shares`: Swin V2's
        position-bias MLP, on its coordinate table); one also called on the batch (DeBERTa's
        query and key projections with share_att_key) in all its calls, its batch rows then
        multiplied by each example's own copy (a row product), the check's forward run again
        if it recorded a call for the rule first; after the check, the layers it kept. A layer
        that reads its children's parameters (:func:`~privgrad.per_sample.rules.read_children`)
        is replayed."""
        if read_children(module):
            return False
        if not self.sampler.assume_layouts:
            return module in self.params
        if module in self.replayed:
            return False
        if RULES.get(type(module)) is not None and module not in self.params:
            batch = self.sampler._batch
            leaves = [v for v in tree_flatten(args)[0] if isinstance(v, _T)]
            if not (leaves and all(_shares(v, batch) for v in leaves)):
                self.batched.add(module)
                return False
            if module in self.batched:  # called on the batch before: those calls again so
                self.batched.discard(module)
                self.rerun.add(module)
        self.params.add(module)
        return True

    def replay_failed(self) -> None:
        """Raises :class:`ReplayInstead` if some layers' own parameters met no batch in the
        forward just recorded, having moved those layers to the generic rule."""
        failed, self.failed = self.failed, set()
        rerun, self.rerun = self.rerun, set()
        if not failed and rerun:
            names = ", ".join(sorted(f"'{self.sampler.names[m]}'" for m in rerun))
            raise ReplayInstead(
                f"layers {names}: called on the batch and on tensors the batch shares, so their "
                "own parameters are followed as tables in all their calls from now on (each "
                "example's rows times its own copy); run the forward again"
            )
        if not failed:
            return
        for module in failed:
            self.params.discard(module)
            self.sites.pop(module, None)
        self.replayed |= failed
        names = ", ".join(sorted(f"'{self.sampler.names[m]}'" for m in failed))
        raise ReplayInstead(
            f"layers {names}: their own parameters met the batch other than by a broadcast, "
            "so the generic rule replays them from now on; run the forward again (make_private's "
            "check does)"
        )

    def _refused(self, modules, message: str) -> None:
        """Raises ``message``, but where the check tries the layers' own parameters as
        tables (then they are replayed instead: :meth:`replay_failed`)."""
        if self.sampler.assume_layouts and all(m in self.params for m in modules):
            self.failed.update(modules)
        else:
            raise PrivgradError(message)

    def is_table(self, module: nn.Module, inputs: tuple, kwargs: dict | None, out) -> bool:
        """Whether this call's output is a table's: a layer the check read so, always (its
        arguments' shapes may equal a batch's by chance); while the check learns, an Embedding whose
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

    def record(self, module: nn.Module, out: torch.Tensor, replica: bool = False) -> torch.Tensor:
        """The table's output, tapped for leaks and followed (:class:`_Shared`). A
        ``replica`` (a forward that activation checkpointing runs again in the backward) is
        followed alike, so that its ops save the tensors the recorded ones did, and records
        nothing: its taps receive nothing."""
        self.sites.setdefault(module, {})
        sampler = self.sampler
        # the tap takes the output detached: no backward of the model's reaches the layer's
        # own graph, which layer_grads runs later
        leak = _ignore if replica else partial(self._leak, module)
        tapped = _LeakTap.apply(out.detach(), sampler._anchor, leak)
        call = _TableCall(out, tapped, replica)
        if not replica:
            self.calls.setdefault(module, []).append(call)
        shared = tapped.as_subclass(_Shared)
        shared._origin = (self, (module,), (call,))
        return shared

    def _what(self, module: nn.Module) -> str:
        """The layer, named, and what of it is a table."""
        name = f"layer '{self.sampler.names[module]}' ({type(module).__name__})"
        if module in self.params and RULES.get(type(module)) is not None:
            return (
                f"{name}: its own parameters (it is called on tensors the batch shares) are tables"
            )
        if module in self.params:
            return f"{name}: its own parameters (it has no per-sample rule) are tables"
        return f"{name}: its output is a table"

    def _leak(self, module: nn.Module) -> None:
        if self.sampler._error is None:
            try:
                self._refused(
                    (module,),
                    f"{self._what(module)} the batch shares (no batch axis), and a tensor "
                    "computed from it reached the loss without being broadcast against the "
                    "batch (privgrad attributes a shared table's gradient to examples where it "
                    "is added to, multiplied with or expanded to batched tensors): its "
                    "per-sample gradients would miss that use",
                )
            except PrivgradError as e:
                self.sampler._error = e

    def op(self, func, args: tuple, kwargs: dict, flat: list, spec) -> object:
        """An op on tensors computed from a table (subclass dispatch disabled; ``flat`` and
        ``spec`` its arguments flattened): at a meeting the result with the shared operands
        broadcast to the batch through taps, else the result, followed."""
        tensors = [v for v in flat if isinstance(v, _T)]
        shared = [v for v in tensors if isinstance(v, _Shared)]
        if not any(s.requires_grad for s in shared) and not self._inside_function():
            return func(*args, **kwargs)  # a table's value without its gradient: a constant
        # an op on several tables (two of a layer's own parameters, DiffLlama's λ_q · λ_k; a
        # table computed by a chain of layers, Swin V2's position-bias MLP) follows them all
        modules = tuple(dict.fromkeys(m for s in shared for m in s._origin[1]))
        module = modules[0]
        calls = tuple(dict.fromkeys(c for s in shared for c in s._origin[2]))
        recorded = [r for m in modules for r in self.calls.get(m, ())]
        if any(not c.replica and not any(c is r for r in recorded) for c in calls):
            raise PrivgradError(
                f"{self._what(module)}: a tensor computed from it in an earlier forward (kept "
                "by the model, a cache?) is used again: compute it from the table in each "
                "forward"
            )
        what = getattr(func, "__name__", str(func))
        row_meeting = _row_meeting(func, args, kwargs)
        shape = _result_shape(func, args, kwargs, tensors, row_meeting)
        meets = bool(shape) and self._meets(
            func, args, kwargs, tensors, shared, modules, shape, what, row_meeting
        )
        if meets is None:
            return func(*args, **kwargs)
        if not meets:
            mixed = [v for v in tensors if not isinstance(v, _Shared) and v.requires_grad]
            if mixed and torch.is_grad_enabled():
                self._refused(
                    modules,
                    f"{self._what(module)} the batch shares, and {what} combines a tensor "
                    "computed from it with another that has a gradient without broadcasting it "
                    "against the batch: privgrad attributes a shared table's gradient to "
                    "examples only where it is added to, multiplied with, matrix-multiplied "
                    "with or expanded to batched tensors",
                )
                return func(*args, **kwargs)
            with kept_as_is():
                out = func(*args, **kwargs)
            return tree_map(
                partial(self._follow, (self, modules, calls), self._inside_function()), out
            )
        fold = shape[0] // self.sampler._batch
        if row_meeting == "rows":
            return self._multiply_rows(func, args, kwargs)
        if row_meeting == "convolution":
            return self._convolve_rows(func, args, kwargs)
        if row_meeting == "fill":
            return self._fill_rows(func, args)
        if func is torch.einsum:  # the batch's subscript given to the shared operands
            inputs, output, operands = _einsum_parts(args)
            met = [
                (output[0] + sub, self._meet(v._origin[2], v, v.dim() + 1, fold))
                if isinstance(v, _Shared) and v.requires_grad
                else (sub, v)
                for sub, v in zip(inputs, operands)
            ]
            subs, operands = zip(*met)
            return func(f"{','.join(subs)}->{output}", *operands)
        met = [
            self._meet(v._origin[2], v, len(shape), fold)
            if isinstance(v, _Shared) and v.requires_grad
            else v
            for v in flat
        ]
        args, kwargs = tree_unflatten(met, spec)
        return func(*args, **kwargs)

    def _meets(
        self, func, args, kwargs, tensors, shared, modules: tuple, shape, what: str, row_meeting
    ) -> bool | None:
        """Whether the op broadcasts the shared operands against the batch, its result's rows
        the batch's or k per example, example-major (Swin's windows, (B·windows, ...)): SDPA's
        mask always does when the query has the batch's rows (its first axis is the batch by
        SDPA's contract), so a mask made only in some batches (Hugging Face's SDPA path of T5
        adds a padding mask to the bias) needs no check of its own; any other op as
        make_private's check saw it at this place in the model's code (learned there from
        shapes; the check's gradients also check the rows' order). An einsum meets the batch
        where its output's first subscript is the first of an operand with a gradient, and
        of no shared one (``"binh,tnh->bnit"``: the shared operand then gets it, expanded).
        The place is learned and checked for each of ``modules``, the layers whose tables the
        shared operands come from. None where the check drops the layers from the tables
        (:meth:`_refused`)."""
        batch, rows = self.sampler._batch, shape[0]
        grads = [s for s in shared if s.requires_grad]
        if row_meeting is not None:
            fits = batched = True  # the shared matrix multiplies each row, the kernel each example
        elif func is torch.einsum:
            inputs, output, operands = _einsum_parts(args)
            pairs = [(sub, v, isinstance(v, _Shared)) for sub, v in zip(inputs, operands)]
            fits = not any(output[0] in sub for sub, v, s in pairs if s and v.requires_grad)
            batched = any(sub[0] == output[0] and v.requires_grad for sub, v, s in pairs if not s)
        else:
            fits = all(_aligned(s, len(shape))[0] == 1 for s in grads)
            batched = func in _EXPAND or any(
                not isinstance(v, _Shared) and _aligned(v, len(shape))[0] == rows for v in tensors
            )
        fits = fits and rows % batch == 0
        if func is F.scaled_dot_product_attention and args[0].shape[0] == batch == rows:
            return bool(grads) and fits and args[0].requires_grad
        module = modules[0]
        file, line, offset = _call_site(self.sampler.model)
        site = (file, line, offset, what)
        if self.sampler.assume_layouts:
            meets = bool(grads) and fits and batched
            if any(self.sites[m].setdefault(site, meets) != meets for m in modules):
                self._refused(
                    modules,
                    f"{self._what(module)} the batch shares, and its use at {file}:{line} "
                    f"({what}) broadcasts it against the batch in one call and not in another: "
                    "privgrad cannot tell where the examples are",
                )
                return None
            return meets
        unseen = [m for m in modules if site not in self.sites[m]]
        if unseen:
            module = unseen[0]
            raise PrivgradError(
                f"{self._what(module)} the batch shares; make_private's check learned where "
                "it meets the batch on its probe examples, and did not see this use "
                f"({what} at {file}:{line}): the model takes another path here (a mask made "
                "only for some batches? another attention implementation? a branch on "
                "self.training: the check runs in eval mode); if its probe "
                "examples lack what this batch has (padding), pass make_private examples "
                "that have it, or build the model with attn_implementation='eager'"
            )
        meets = self.sites[module][site]
        if meets and not fits:
            raise PrivgradError(
                f"{self._what(module)}: its use at {file}:{line} ({what}) met the batch at "
                f"make_private's check, but here gives shape {shape} for a batch of {batch} "
                "(not a multiple)"
            )
        return meets

    def _multiply_rows(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """A row product that meets the batch: each example's rows, (B, k·…, in), times the
        matrix broadcast to the batch through a tap, (B, in, out) (and the bias, (B, 1, out));
        the result as the op's."""
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        batch = self.sampler._batch

        def met(t, n):
            return self._meet(t._origin[2], t, n, 1) if isinstance(t, _Shared) else t

        w = met(w, 3) if w.requires_grad else w
        if func is F.linear:
            w = w.transpose(-1, -2)
        out = torch.matmul(x.reshape(batch, -1, x.shape[-1]), w)
        if bias is not None:
            out = out + (met(bias, 2).unsqueeze(-2) if bias.requires_grad else bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _convolve_rows(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """A convolution of the batch by a shared kernel that meets it: each row (the
        batch's, or k per example) convolved by its own copy of the kernel, broadcast to the
        rows through a tap (B·k, out, in/groups, *k), as one convolution with B·k times the
        groups (and the bias, shared or not, added per row); the result as the op's."""
        a = _conv_args(args, kwargs)
        x, w, bias = a["input"], a["weight"], a["bias"]
        rows, groups = x.shape[0], a["groups"]

        def met(t, n):
            if isinstance(t, _Shared) and t.requires_grad:
                return self._meet(t._origin[2], t, n, rows // self.sampler._batch)
            return t.as_subclass(_T).expand(rows, *t.shape)

        w = met(w, w.dim() + 1)
        out = func(
            x.reshape(1, -1, *x.shape[2:]),
            w.reshape(-1, *w.shape[2:]),
            None,
            a["stride"],
            a["padding"],
            a["dilation"],
            groups * rows,
        )
        out = out.reshape(rows, -1, *out.shape[2:])
        if bias is not None:
            out = out + met(bias, 2).reshape(rows, -1, *[1] * (out.dim() - 2))
        return out

    def _fill_rows(self, func, args: tuple) -> None:
        """A masked write that meets the batch, ``h[mask] = v``: ``v`` broadcast to the
        selected rows through a tap, each row's gradient going to the example of its row."""
        target, index, value = args
        rows = target.shape[0]
        if value.requires_grad:
            owner = index.reshape(rows, -1).nonzero()[:, 0] // (rows // self.sampler._batch)
            trail = target.dim() - index.dim()
            value = self._meet(value._origin[2], value, 1 + trail, 1, owner)
        return func(target, index, value)

    def _inside_function(self) -> bool:
        """Whether ops run in the recorded forward with gradients off: inside a custom
        autograd Function's forward (SEW-D's StableDropout on its relative-position table),
        whose output gets its gradient as the Function returns it, so that what it computes
        from a table is followed though it has no gradient yet."""
        return self.sampler._recording and not torch.is_grad_enabled()

    @staticmethod
    def _follow(origin: tuple, inside_function: bool, v):
        if (
            isinstance(v, _T)
            and (v.requires_grad or inside_function)
            and not isinstance(v, _Shared)
        ):
            v = v.as_subclass(_Shared)
            v._origin = origin
        return v

    def _meet(
        self, calls: tuple, t: torch.Tensor, n: int, fold: int, owner: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``t`` (computed from the tables of ``calls``) broadcast to the batch's rows,
        ``(1, ...) -> (B·fold, ...)``, or with ``owner`` (each row's example) to its rows,
        through a tap whose gradient adds to the calls' per-example gradients."""
        plain = t.as_subclass(torch.Tensor)
        aligned = _aligned(t, n)
        rows = self.sampler._batch * fold if owner is None else len(owner)
        x = plain.reshape(aligned).expand(rows, *aligned[1:])
        first = calls[0]  # keeps which meetings have had their gradient
        first.arrived.append(False)
        receive = partial(self._receive, calls, plain, len(first.arrived) - 1, fold, owner)
        return Cut.apply(x, self.sampler._anchor, _ignore if first.replica else receive)

    def _receive(
        self,
        calls: tuple,
        t: torch.Tensor,
        meeting: int,
        fold: int,
        owner: torch.Tensor | None,
        g: torch.Tensor,
    ) -> None:
        """A meeting's tap: each example's gradient of ``t`` (the sum over its ``fold`` rows,
        or over the rows ``owner`` gives it),
        mapped back to the tables' outputs through the ops between (still in the graph: the
        backward reaches them after every meeting's tap), batched over examples."""
        sampler = self.sampler
        if sampler._error is not None:
            return
        if calls[0].arrived[meeting] and sampler._deferred:
            sampler._error = PrivgradError(
                "a second backward reached a shared table's use before optimizer.step(): "
                "call loss.backward() once per batch, then optimizer.step()"
            )
            return
        calls[0].arrived[meeting] = True
        if owner is None:
            g = g.reshape(g.shape[0] // fold, fold, *t.shape).sum(1)
        else:
            rows = g.reshape(len(owner), *t.shape)
            g = rows.new_zeros(sampler._batch, *t.shape).index_add_(0, owner, rows)
        outs = [c.out for c in calls]
        got = torch.autograd.grad(
            t, outs, g, retain_graph=True, is_grads_batched=True, allow_unused=True
        )
        for call, g in zip(calls, got):
            if g is not None:
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
