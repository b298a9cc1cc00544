"""Per-sample gradients of any ``nn.Module`` from one forward and one backward pass.

Forward hooks record each layer's input and pass its output through a tap, an identity
whose backward hands the output gradient to the sampler. One backward pass, asked only for
the gradient of a scalar anchor that every tap depends on, carries the summed per-sample
loss's gradient to every tap (the parameters' own batch gradients are never formed). As
soon as all of a layer's output gradients have arrived its rule in
:mod:`privgrad.per_sample.rules` takes them, and may trade them for a smaller form
(:meth:`LayerGrads.settle`, with ``settle=True``), so that no more is kept than the clipped
sum needs. The sampler's :class:`~privgrad.per_sample.flags.EngineFlags` choose the rules'
forms (speed and memory only); they travel with the :class:`PerSampleGrads` it returns.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from itertools import islice
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from privgrad.errors import PrivgradError
from privgrad.inputs import call_model, device_of, rows
from privgrad.per_sample.flags import DEFAULT_FLAGS, EngineFlags
from privgrad.per_sample.rules import (
    RULES,
    Call,
    LayerGrads,
    MaterializedGrads,
    Replay,
    TiedGrads,
    TrainableSubset,
    attention_children,
    batch_dim,
    embedding_rule,
    float32_arithmetic,
    folds_rows,
    generic_rule,
    layer_named_params,
    instance_overrides,
    layer_params,
    read_children,
    table_children,
    mha_forward_with_dropout,
    projected_attention,
    refusal,
    replays_dropout,
    row_wise,
    seq_first_layers,
    takes_call,
)
from privgrad.per_sample.tables import SharedTables, kept_as_is
from privgrad.validate import validate_precision


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast
_LOW = (torch.bfloat16, torch.float16)


def _in_precision(t, dtype: torch.dtype):
    """``t`` (a recorded input or output gradient) in ``dtype`` if autocast made it a
    lower-precision float; anything else (ids, a recorded call, fp32) as it is."""
    if isinstance(t, torch.Tensor) and t.dtype in _LOW and dtype not in _LOW:
        return t.to(dtype)
    if isinstance(t, Replay):
        return t._map(lambda _, v: _in_precision(v, dtype))
    return t


class PerSampleGrads:
    """Per-sample gradients of all trainable parameters, grouped by layer; ``flags`` are the
    engine flags they were computed with (the mechanisms read their own from them)."""

    def __init__(
        self, layers: list[LayerGrads], batch_size: int, flags: EngineFlags = DEFAULT_FLAGS
    ):
        self.layers, self.batch_size, self.flags = layers, batch_size, flags

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
        return PerSampleGrads([fn(layer) for layer in self.layers], self.batch_size, self.flags)


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


def looks_up(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass without a rule of its own (BART's learned positions and
    scaled word embeddings): its forward computes its own ids (positions from the input's
    shape) or transforms the rows it looks up (a scale), so the layer recorded is its lookup
    ``F.embedding(ids, weight)`` inside the forward (:class:`_Lookups`), not the forward's
    arguments and result; autograd carries the rest."""
    return (
        isinstance(module, nn.Embedding)
        and type(module) is not nn.Embedding
        and type(module) not in RULES
    )


class _Lookups(TorchFunctionMode):
    """Active during the forward of a :func:`looks_up` layer while the sampler records (and
    recomputes: :meth:`GradSampler._enter_mode`): each ``F.embedding`` on the layer's weight
    goes through the sampler's hook with the ids it was given and the rows it returned, and
    returns the tapped rows."""

    def __init__(self, sampler: "GradSampler", module: nn.Embedding):
        super().__init__()
        self.sampler, self.module = sampler, module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.embedding:
            named = dict(zip(("input", "weight"), args), **(kwargs or {}))
            if named["weight"] is self.module.weight:
                tapped = self.sampler._hook(self.module, (named["input"],), out)
                return out if tapped is None else tapped
        return out


class _Projections(TorchFunctionMode):
    """Active during the forward of a layer that passes its children's weights to
    ``F.multi_head_attention_forward`` (:func:`~privgrad.per_sample.rules.attention_children`:
    WavLM's attention) while the sampler records (and recomputes: :meth:`GradSampler._enter_mode`):
    that call is computed by :func:`~privgrad.per_sample.rules.projected_attention`, its
    projections calls of those children, recorded by their own hooks."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        self.name, self.children = name, attention_children(module)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.multi_head_attention_forward:
            return projected_attention(self.name, self.children, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _root(tied_to: list[int], index: int) -> int:
    while tied_to[index] != index:
        index = tied_to[index]
    return index


class GradSampler:
    """Hooks a model so that :meth:`compute` returns per-sample gradients.

    Every trainable parameter must belong to a layer with a rule; one without is an
    error (never silently left out of the private update). With ``settle``, each layer's
    rule may trade its stored input and output gradient for a smaller form as soon as its
    gradients are in (:meth:`LayerGrads.settle`); a consumer that reads a rule's stored
    tensors (a spectral transform) needs ``settle=False``. ``flags`` (an
    :class:`EngineFlags`, by default the engine's own choices) pick the rules' forms; the
    attribute may be replaced between steps.

    Layers that share a parameter (tied weights) form one of :attr:`units`, the layers of the
    :class:`PerSampleGrads` it returns (:class:`~privgrad.per_sample.rules.TiedGrads`: the
    shared parameter's per-sample gradient is the sum of theirs).

    ``precision`` ("fp32", "bf16" or "fp16") is the forward's and backward's: :meth:`compute`
    runs them under ``torch.autocast`` at that precision, and every rule gets its recorded
    inputs and output gradients in the parameters' precision, so that per-sample norms,
    clipping, sums, noise and the update are all computed in fp32, on fp32 master weights.
    That keeps the mechanism exact: the clip bound C holds for the fp32 gradient the noise is
    added to, whatever rounding the low-precision forward did (it changes which gradient is
    clipped, as any model change does, not the sensitivity). fp16 runs with no loss scaling:
    the per-sample losses are summed, not averaged, so output gradients are not shrunk by
    1/B, and a dynamic scale, which adapts to overflows in earlier batches, would make each
    step depend on other examples' data outside what the accountant sees; an example whose
    gradient overflows is dropped like any non-finite one (counted).
    """

    def __init__(
        self,
        model: nn.Module,
        settle: bool = False,
        flags: EngineFlags = DEFAULT_FLAGS,
        precision: str = "fp32",
    ):
        if not isinstance(flags, EngineFlags):
            raise PrivgradError(f"flags must be an EngineFlags, got {type(flags).__name__}")
        self.model, self.settle, self.flags = model, settle, flags
        self.precision = precision
        self.layers: list[tuple[str, nn.Module]] = []
        holder: dict[int, int] = {}  # a parameter's first layer (index in self.layers)
        tied_to: list[int] = []  # union-find: a layer tied to a later one points to it, else itself
        covered: set[int] = set()  # parameters of submodules a parent layer's rule covers
        for name, module in model.named_modules():
            # every module, frozen or parameter-free too: a batch mixer needs no parameters
            reason = refusal(module)
            if reason is not None:
                raise PrivgradError(
                    f"layer '{name or '(the model)'}' ({type(module).__name__}): {reason}"
                )
            # a parameter a descendant layer holds too is that layer's (BERT's masked-LM head
            # holds its bias, tied to its decoder's): the module's forward reaches it only
            # through that layer, or through a use of its own no rule sees, which make_private's
            # check refuses (independence.check_gradients)
            direct = {id(p) for p in module.parameters(recurse=False)}
            below = direct and {
                id(p) for sub in islice(module.modules(), 1, None) for p in sub.parameters(False)
            }
            own = [p for p in layer_params(module) if not (id(p) in direct and id(p) in below)]
            if own and all(id(p) in covered for p in own):  # MultiheadAttention's out_proj
                module.register_forward_hook(partial(self._covered_called, name))
                continue
            if not own:
                continue
            covered.update(id(p) for p in own if id(p) not in direct)
            index = len(self.layers)
            roots = {_root(tied_to, holder[id(p)]) for p in own if id(p) in holder}
            tied_to.append(index)
            for root in roots:  # tied weights: one unit with every layer sharing a parameter
                tied_to[root] = index
            holder.update((id(p), index) for p in own if id(p) not in holder)
            self.layers.append((name, module))
        units: dict[int, list[int]] = {}
        for index in range(len(self.layers)):
            units.setdefault(_root(tied_to, index), []).append(index)
        self.units = sorted(units.values())
        self.names = {m: name for name, m in self.layers}
        self._axis1 = seq_first_layers(
            model
        )  # layers of batch_first=False transformer layers: (L, B, ...)
        # two batch layouts read on trust (see _hook): one row of embedding ids for the whole
        # batch, copied to each example (`expanded`), and a row-wise layer's rows of examples
        # flattened with positions, read example-major (`folded`). While assume_layouts
        # (independence.check_gradients' pass, which checks the result) any layer's are, and
        # the layer joins its set; after it, only the layers in the sets
        self.assume_layouts = False
        self.expanded: set[nn.Module] = set()
        self.folded: set[nn.Module] = set()
        # a layer the generic rule replays, called with several arguments: which of them carry
        # the batch (the numbers of its tensor leaves), as check_gradients' pass saw them
        self.batched_args: dict[nn.Module, frozenset] = {}
        # layers whose output the batch shares (an Embedding of T5's relative positions, BEiT's
        # bias table): where that output meets the batch, as the check saw (tables.py)
        self.shared = SharedTables(self)
        self.uncalled: set[nn.Module] = set()  # layers the last compute saw no call of
        self._recording = False
        self._backward = False  # a backward of this sampler's recorded forward may run
        self._building = False  # a rule runs (_build)
        self._deferred = False  # own-loop mode (arm/collect): the user's backward feeds the taps
        for _, module in self.layers:
            if isinstance(module, nn.Embedding):  # a table's lookup saves outside checkpoints
                module.register_forward_pre_hook(self._enter_table)
                module.register_forward_hook(self._exit_table, always_call=True)
            if takes_call(module):  # its rule reads every argument (MultiheadAttention's masks)
                module.register_forward_hook(self._call_hook, with_kwargs=True)
            elif looks_up(module):
                module.register_forward_pre_hook(partial(self._enter_mode, partial(_Lookups, self)))
                module.register_forward_hook(self._exit_mode, always_call=True)
            elif (ruled := RULES.get(type(module)) is not None) and isinstance(
                module, nn.Embedding
            ):  # an Embedding's tables are its output (SharedTables.is_table)
                module.register_forward_hook(self._hook)
            else:
                # its own parameters followed as tables the batch shares (a layer with a rule:
                # where called on tensors the batch shares), else its rule or the generic
                # rule, which replays the call; which one is known here, not at each call
                module.register_forward_pre_hook(self._follow_params)
                module.register_forward_hook(
                    partial(self._unfollow_params, ruled), with_kwargs=True, always_call=True
                )
        for name, module in model.named_modules():  # its attention's projections: its children's
            if attention_children(module):
                module.register_forward_pre_hook(
                    partial(self._enter_mode, partial(_Projections, name or "(the model)"))
                )
                module.register_forward_hook(self._exit_mode, always_call=True)
        # a layer that reads its children's parameters (rules.read_children): its other inner
        # layers, each of which must be called whenever it is (_inner_calls)
        members = {m for _, m in self.layers}
        self._inner = {
            m: [s for s in islice(m.modules(), 1, None) if s in members]
            for m in members
            if read_children(m)
        }
        self._inner_counts: dict[nn.Module, list[list[int]]] = {}
        self._modes: dict[nn.Module, list[TorchFunctionMode]] = {}  # _Lookups, _Projections
        self._followed: dict[nn.Module, list[bool]] = {}  # per call: its parameters followed
        self._shadowed: dict[nn.Module, set[str]] = {}
        self._kept: dict[nn.Module, list] = {}

    def _enter_table(self, module, inputs):
        """An Embedding make_private's check learned to be a table: its lookup's tensors are
        saved as they are (:func:`tables.kept_as_is`), in the recorded forward and alike in a
        recomputation of it."""
        kept = None
        if module in self.shared.sites and not self.assume_layouts and self._following():
            kept = kept_as_is()
            kept.__enter__()
        self._kept.setdefault(module, []).append(kept)

    def _exit_table(self, module, inputs, output):
        kept = self._kept[module].pop()
        if kept is not None:
            kept.__exit__(None, None, None)

    def _enter_mode(self, make: Callable, module, inputs):
        """Enters ``make(module)``, a mode active during the layer's forward while recording,
        and alike in a recomputation of it (activation checkpointing: the same ops, so the
        same saved tensors)."""
        if self._following():
            mode = make(module)
            mode.__enter__()
            self._modes.setdefault(module, []).append(mode)

    def _exit_mode(self, module, inputs, output):
        modes = self._modes.get(module)
        if modes:  # always_call: also when the forward raised
            modes.pop().__exit__(None, None, None)

    def _call_hook(self, module, args, kwargs, output):
        return self._hook(module, args, output, kwargs)

    def _recomputing(self) -> bool:
        """Whether a forward runs inside a backward of this sampler's recorded forward:
        activation checkpointing runs a block's forward again there, whose tables are then
        followed as replicas (:meth:`SharedTables.record`)."""
        return (
            (self._backward or self._deferred)
            and not self._building
            and torch._C._current_graph_task_id() != -1
        )

    def _following(self) -> bool:
        """Whether ops on tables are followed: while recording, or recomputing."""
        return self._recording or self._recomputing()

    def _follow_params(self, module, args):
        """A layer without a rule, or one with a rule called on tensors the batch shares,
        while recording: where its own parameters are followed as tables the batch shares
        (:meth:`SharedTables.follows_params`), each is shadowed by a
        followed view of it, made for this call (an instance attribute, which attribute lookup
        finds before ``_parameters``), until the backward of the recorded forward is over
        (:meth:`_unshadow`): activation checkpointing may run the layer's forward again in it,
        without its hooks (Hugging Face checkpoints the forward inside them)."""
        follows = (
            self._recording and torch.is_grad_enabled() and self.shared.follows_params(module, args)
        )
        self._followed.setdefault(module, []).append(follows)
        if self._recording and module in self._inner:
            counts = [len(self._calls.get(m, ())) for m in self._inner[module]]
            self._inner_counts.setdefault(module, []).append(counts)
        if follows:
            holders = [module] + [getattr(module, c) for c in table_children(module)]
            for holder in holders:  # its own parameters, and those it reads as tables
                names = self._shadowed.setdefault(holder, set())
                for name, p in holder._parameters.items():
                    if p is not None and p.requires_grad:
                        holder.__dict__[name] = self._table_call(module, p.view_as(p))
                        names.add(name)

    def _unfollow_params(self, ruled: bool, module, args, kwargs, output):
        """A call whose parameters were not followed is recorded for the layer's rule
        (``ruled``) or the generic rule (not when the forward raised: ``output`` None)."""
        if self._recording and module in self._inner:
            self._inner_calls(module, self._inner_counts[module].pop(), output is not None)
        if not self._followed[module].pop() and output is not None:
            if ruled:
                return self._hook(module, args, output)
            return self._replay_hook(module, args, kwargs, output)
        return None

    def _inner_calls(self, module: nn.Module, before: list[int], finished: bool) -> None:
        """A layer that reads its children's parameters is replayed for those only; its other
        inner layers must each have been called in its forward, or their gradients, read
        directly too (a fused kernel's path: transformers' Mamba in training where mamba_ssm
        is installed), would be missed."""
        for inner, count in zip(self._inner[module], before):
            if finished and len(self._calls.get(inner, ())) == count:
                raise PrivgradError(
                    f"layer '{self.names[inner]}' ({type(inner).__name__}) was not called in "
                    f"this forward of '{self.names[module]}' ({type(module).__name__}), which "
                    "reads some of its children's parameters directly and is replayed for "
                    "those only: it read this layer's directly too (a fused kernel's path, as "
                    "transformers' Mamba takes in training where mamba_ssm is installed), so "
                    "its per-sample gradients would be missed; refused (run the model on "
                    "transformers' PyTorch path, or declare that child too: "
                    "privgrad.per_sample.register_read_children)"
                )

    def _unshadow(self) -> None:
        """Ends :meth:`_follow_params`' shadowing."""
        for module, names in self._shadowed.items():
            for name in names:
                module.__dict__.pop(name, None)
        self._shadowed = {}

    def _replay_hook(self, module, args, kwargs, output):
        """A layer the generic rule replays: a call on one tensor is recorded as any layer's
        (its input, the batch on axis 0), any other (several arguments, a container) as a
        :class:`Replay`."""
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
            return self._hook(module, args, output)
        return self._hook(module, args, output, kwargs)

    def _replay(self, module: nn.Module, args: tuple, kwargs: dict) -> Replay:
        """The call as a :class:`Replay` whose batched arguments are those make_private's
        check saw carry the batch on their first axis, for this layer: the tensors (inside
        containers too) with as many rows as the batch then (while ``assume_layouts``); any
        other is shared by the batch whatever its shape, so that a shared table whose rows
        happen to number a later batch's examples is not split between them."""
        call = Replay(args, kwargs)
        name, batch, tensors = self.names[module], self._batch, call.tensors()
        if self.assume_layouts and module not in self.batched_args:
            self.batched_args[module] = frozenset(
                k for k, v in tensors.items() if v.dim() and v.shape[0] == batch
            )
        known = self.batched_args.get(module)
        if known is None:
            raise PrivgradError(
                f"layer '{name}' ({type(module).__name__}) has parameters of its own, no "
                "per-sample rule, and was called with several arguments: the generic rule "
                "replays such a call one example at a time on the arguments that carry the "
                "batch, which make_private's check learns on its probe examples, and it did "
                "not see this layer called so (a bare GradSampler: set assume_layouts = True "
                "and check the gradients yourself)"
            )
        for k in known:
            if k not in tensors or tensors[k].shape[:1] != (batch,):
                shape = tuple(tensors[k].shape) if k in tensors else None
                raise PrivgradError(
                    f"layer '{name}' ({type(module).__name__}): its tensor argument #{k} (in "
                    "the order of its arguments, inside tuples, lists and dicts too) carried "
                    f"the batch at make_private's check but is {shape} for a batch of {batch} "
                    "here"
                )
        call.batched = known
        return call

    def _table_call(self, module: nn.Module, output: torch.Tensor):
        """Records a call of a table the batch shares (a layer's output, or one of its own
        parameters), which every example uses whole: no rows to record (an empty one per
        example); its per-example gradients come from where it meets the batch (tables.py).
        Returns it followed (None without a gradient)."""
        batch = self._batch
        none = output.new_empty(batch, 0)
        calls = self._calls.setdefault(module, [])
        calls.append((none, none._version, (batch, *output.shape), output.dtype, output.device))
        self._grads.setdefault(module, []).append(None)
        return self.shared.record(module, output) if output.requires_grad else None

    def _covered_called(self, name, module, inputs, output):
        if self._recording:
            raise PrivgradError(
                f"layer '{name}' ({type(module).__name__}) is part of its parent layer's rule "
                "(MultiheadAttention's out_proj, a Mamba mixer's conv1d: the parent reads its "
                "parameters directly); called on its own, its gradient would be missed"
            )

    def _second_output_used(self, module: nn.Module, g: torch.Tensor) -> None:
        if self._error is None:
            self._error = PrivgradError(
                f"the loss depends on an output of layer '{self.names[module]}' "
                f"({type(module).__name__}) other than its first (e.g. MultiheadAttention's "
                "attention weights): per-sample rules cover the first only; "
                "use need_weights=False or detach the others"
            )

    def _hook(self, module, inputs, output, kwargs=None):
        """Records a call and taps its output. A layer returning a tuple (MultiheadAttention:
        output, attention weights) is tapped on its first element; a gradient reaching any
        other element is an error. With ``kwargs`` (a rule that ``takes_call``, or the generic
        rule's call with several arguments) the whole call is recorded, and only the output's
        batch axis (:func:`rules.batch_dim`) is checked here: the rule checks its inputs."""
        if not self._recording:
            if (
                self._recomputing()
                and module in self.shared.sites
                and module not in self.shared.params
                and isinstance(output, torch.Tensor)
                and output.requires_grad
            ):
                return self.shared.record(module, output, replica=True)
            return None
        rest = None
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            output, rest = output[0], output[1:]
        if not isinstance(output, torch.Tensor):
            raise PrivgradError(
                f"{type(module).__name__} returns {type(output).__name__}; "
                "layers with parameters must return a tensor or a tuple whose first is one"
            )
        if rest is None and self.shared.is_table(module, inputs, kwargs, output):
            return self._table_call(module, output)
        whole, bd = kwargs is not None, 1 if module in self._axis1 else batch_dim(module)
        if not whole:
            a = inputs[0]
        elif takes_call(module):
            a = Call(module, inputs, kwargs)
        else:
            a = self._replay(module, inputs, kwargs)
        if whole and replays_dropout(module):
            # attention dropout: the output is computed again with a dropout mask kept for the rule
            output = mha_forward_with_dropout(module, a)
        # a rule that reads the batch's rows flattened with positions (experts): as `folds` below
        folded_call = (
            whole
            and folds_rows(module)
            and output.dim() > 0
            and output.shape[0] > self._batch
            and output.shape[0] % self._batch == 0
        )
        if folded_call and (self.assume_layouts or module in self.folded):
            self.folded.add(module)
        elif whole and output.shape[bd : bd + 1] != (self._batch,):
            hint = (
                f" {output.shape[0]} rows are {output.shape[0] // self._batch} per example: "
                f"make_private reads row r as example r // {output.shape[0] // self._batch}'s "
                "only for the layers its check saw called so, on its probe examples"
                if folded_call
                else ""
            )
            raise PrivgradError(
                f"layer '{self.names[module]}' ({type(module).__name__}) returned an output of "
                f"shape {tuple(output.shape)} for a batch of {self._batch}: per-sample gradients "
                f"need the batch on its axis {bd} (is a batch dimension missing?{hint})"
            )
        if (
            not whole
            and bd
            and (a.shape[1:2] != (self._batch,) or output.shape[1:2] != (self._batch,))
        ):
            raise PrivgradError(
                f"layer '{self.names[module]}' ({type(module).__name__}) of a "
                "batch_first=False transformer layer was called on an input of shape "
                f"{tuple(a.shape)} for a batch of {self._batch}: the batch must be its second axis"
            )
        if (
            not whole
            and isinstance(module, nn.modules.conv._ConvNd)
            and a.dim() < module.weight.dim()
        ):
            # unbatched (C, H, W): its first axis passes for the batch when C is the batch size
            raise PrivgradError(
                f"layer '{self.names[module]}' ({type(module).__name__}) was called on an "
                f"unbatched input of shape {tuple(a.shape)}: per-sample gradients need the batch "
                "as its first axis; call it on the batch, not on one example at a time"
            )
        rows, batch = a.shape[0] if not whole and a.dim() else 0, self._batch
        shared_ids = (
            not whole
            # a subclass's forward arguments need not be ids; its lookups' ids are
            and (type(module) is nn.Embedding or looks_up(module))
            and a.shape[:1] == output.shape[:1] == (1,)
            and batch > 1
        )
        folds = (
            not whole
            and not bd
            and rows > batch
            and rows % batch == 0
            and rows == (output.shape[0] if output.dim() else 0)
            and row_wise(module, a)
        )
        out_shape = output.shape
        if folded_call:
            out_shape = torch.Size((batch, output.shape[0] // batch, *output.shape[1:]))
        if shared_ids and (self.assume_layouts or module in self.expanded):
            # one row of ids for the whole batch (Hugging Face's default position_ids): each
            # example gets a copy, its own if the model broadcasts the row (checked on examples
            # by independence.check_gradients, for the layers it saw called so)
            a = a.expand(batch, *a.shape[1:])
            output = output.expand(batch, *output.shape[1:]).contiguous()
            self.expanded.add(module)
            out_shape = output.shape
        elif folds and (self.assume_layouts or module in self.folded):
            # the batch's examples flattened with their positions, (B, T, d).view(-1, d), as
            # OPT's decoder layers do: row r is example r // T's (checked by
            # independence.check_gradients, for the layers it saw called so)
            a = a.reshape(batch, rows // batch, *a.shape[1:])
            out_shape = torch.Size((batch, output.shape[0] // batch, *output.shape[1:]))
            self.folded.add(module)
        elif not whole and not bd and (rows != batch or output.shape[:1] != (batch,)):
            if shared_ids:
                hint = (
                    " One row of ids for the whole batch, as Hugging Face's default "
                    "position_ids: pass position_ids of shape (B, T) with the inputs. "
                    "make_private copies such a row to each example only for the layers its "
                    "check saw called so, on its probe examples"
                )
            elif folds:
                hint = (
                    f" {rows} rows are {rows // batch} per example: the model seems to flatten "
                    "the batch with another dimension (x.view(-1, d), as OPT's decoder layers "
                    f"do). make_private reads row r as example r // {rows // batch}'s only for "
                    "the row-wise layers its check saw called so, on its probe examples"
                )
            elif rows > batch and rows % batch == 0:
                hint = (
                    f" {rows} rows are {rows // batch} per example: if the model flattens the "
                    "batch with another dimension (x.view(-1, d)) before this layer, no row's "
                    "example is known there (only Linear, LayerNorm, RMSNorm and Conv1D on "
                    "(B·T, d) and Embedding on (B·T,) ids are read so); keep the batch "
                    "dimension: (B, T, d)"
                )
            elif rows % batch and rows > 1 and a.dim() == 2:
                hint = (
                    f" {rows} rows for {batch} examples: rows gathered from across the batch, "
                    "as a mixture of experts routes tokens to an expert's own layers (Switch "
                    "Transformers'), belong to no example privgrad can read. MoE "
                    "layers of Hugging Face's experts interface (Mixtral, Qwen-MoE, OLMoE, "
                    "DeepSeek, ...) train"
                )
            elif (type(module) is nn.Embedding or looks_up(module)) and batch in a.shape[1:]:
                hint = (
                    f" Its ids carry the batch on axis {a.shape.index(batch, 1)}, not the first "
                    "(a sequence-first model, as XLNet's (length, batch) ids): per-sample "
                    "gradients need batch-first layers"
                )
            elif type(module) is nn.Embedding or looks_up(module):
                hint = (
                    " Its ids do not carry the batch: if every example uses the whole output "
                    "(a table the batch shares, as T5's relative-attention bias), make_private "
                    "attributes it to examples where it meets the batch, only for the layers "
                    "its check saw called so, on its probe examples"
                )
            elif rows == batch and output.dim() and output.shape[0] == 1:
                hint = (
                    " Its input has the batch but its output one row for all examples: the "
                    "layer computes from something shared by the batch (a position embedding "
                    "that embeds positions made from its input's shape, not its input), a "
                    "table make_private attributes to examples where it meets the batch, only "
                    "for the layers its check saw called so, on its probe examples"
                )
            else:
                hint = ""
            raise PrivgradError(
                f"layer '{self.names[module]}' ({type(module).__name__}) was called on an input "
                f"of shape {tuple(a.shape)} and returned an output of shape "
                f"{tuple(output.shape)} for a batch of {batch}: per-sample gradients need the "
                "batch as the first dimension of every layer's input and output (is a batch "
                f"dimension missing?{hint})"
            )
        calls = self._calls.setdefault(module, [])
        calls.append((a.detach(), a._version, out_shape, output.dtype, output.device))
        self._grads.setdefault(module, []).append(None)
        if not output.requires_grad:
            return None
        receive = self._receive_deferred if self._deferred else self._receive
        tapped = _Tap.apply(output, self._anchor, partial(receive, module, len(calls) - 1))
        if rest is None:
            return tapped
        return (
            tapped,
            *(
                _Tap.apply(t, self._anchor, partial(self._second_output_used, module))
                if isinstance(t, torch.Tensor) and t.requires_grad
                else t
                for t in rest
            ),
        )

    def _receive(self, module: nn.Module, call: int, g: torch.Tensor) -> None:
        """A tap's backward: store the gradient; a layer whose calls are all in gets its rule."""
        if self._error is not None:
            return
        try:
            grads = self._grads[module]
            grads[call] = self._as_recorded(module, call, g)
            if all(x is not None for x in grads):
                self._built[module] = self._build(module)
        except Exception as e:  # noqa: BLE001 (re-raised after the backward pass)
            self._error = e

    def _build(self, module: nn.Module) -> LayerGrads:
        """The layer's rule on its recorded inputs and output gradients (zeros where unused).
        A rule that runs a layer's forward (the generic rule's replay; it may run inside a
        backward) is not a recomputation (:meth:`_recomputing`)."""
        self._building = True
        try:
            return self._build_layer(module)
        finally:
            self._building = False

    def _build_layer(self, module: nn.Module) -> LayerGrads:
        calls, grads = self._calls.pop(module), self._grads.pop(module)
        name = self.names[module]
        for a, version, *_ in calls:
            if a._version != version:
                raise PrivgradError(
                    f"the input of layer '{name}' ({type(module).__name__}) was modified "
                    "in place after the layer used it; use out-of-place operations there"
                )
        full = layer_params(module)[0].dtype  # recorded under autocast: back to fp32
        ins = [_in_precision(a, full) for a, *_ in calls]
        gs = [
            _in_precision(g, full)
            if g is not None
            else torch.zeros(shape, dtype=full if dtype in _LOW else dtype, device=device)
            for g, (_, _, shape, dtype, device) in zip(grads, calls)
        ]
        if module in self._axis1:  # (L, B, ...) -> (B, L, ...)
            ins, gs = [a.transpose(0, 1) for a in ins], [g.transpose(0, 1) for g in gs]
        rule = embedding_rule if looks_up(module) else RULES.get(type(module))
        if rule is not None and instance_overrides(module):
            rule = None  # its instance computes otherwise than the class its rule is for: replayed
        if module in self.shared.calls:
            layer = self.shared.layer_grads(module, gs)
        elif rule is None:
            layer = None
        elif getattr(rule, "takes_flags", False):
            layer = rule(module, ins, gs, flags=self.flags)
        else:
            layer = rule(module, ins, gs)
        if layer is None:
            try:
                layer = generic_rule(module, ins, gs, flags=self.flags)
            except PrivgradError as e:
                raise PrivgradError(f"layer '{name}': {e}") from e
        if not all(p.requires_grad for p in layer.params):
            layer = TrainableSubset(layer)
        own = {id(p) for p in layer_params(module)}
        if {id(p) for p in layer.params} != own:
            got = {id(p) for p in layer.params}
            missing = [n for n, p in layer_named_params(module) if id(p) not in got]
            raise PrivgradError(
                f"layer '{name}' ({type(module).__name__}): its rule gave no per-sample "
                f"gradients for {', '.join(missing) or 'some parameters'} (does the layer "
                "compute the weight its rule reads from those, as the legacy "
                "torch.nn.utils.weight_norm does from weight_g and weight_v? use "
                "torch.nn.utils.parametrizations.weight_norm)"
            )
        if self.settle:
            with float32_arithmetic(self.flags.float32_guard):
                layer.settle()
        return layer

    def compute(
        self,
        x,
        y: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        """Returns (per-sample grads, per-sample losses) of the batch ``x`` (a tensor or a
        tuple/list/dict of tensors, :mod:`privgrad.inputs`). ``loss_fn`` must not reduce."""
        batch, device = rows(x), device_of(x)
        if batch == 0:
            return self.empty(), torch.zeros(0, device=device)
        self._batch, self._calls, self._grads, self._built, self._error = batch, {}, {}, {}, None
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.shared.clear()
        self._recording = True
        try:
            with self._autocast(device):
                try:
                    out = call_model(self.model, x)
                except RuntimeError as e:  # the check's inputs ran unrecorded: the copies broke it
                    if not (self.assume_layouts and self.expanded):
                        raise
                    raise PrivgradError(self._copies_failed(e)) from e
                losses = loss_fn(out, y)
            if losses.shape != (batch,):
                raise PrivgradError(
                    f"the loss must give one value per sample (shape ({batch},)), "
                    f"got shape {tuple(losses.shape)}; use reduction='none'"
                )
            self._recording, self._backward = False, True
            if losses.requires_grad:
                torch.autograd.grad(losses.sum(), self._anchor, allow_unused=True)
            self._backward = False
            if self._error is not None:
                raise self._error
            self.shared.replay_failed()
            for module in self.shared.calls:
                self._grads[module] = self.shared.output_grads(module)
            layers, self.uncalled = [], set()
            for _, module in self.layers:
                if module not in self._built and module in self._calls:  # an unused output
                    self._built[module] = self._build(module)
                if module not in self._built:
                    self.uncalled.add(module)
                layers.append(
                    self._built[module] if module in self._built else self._zeros(module, batch)
                )
        finally:
            self._recording = self._backward = False
            self._calls, self._grads, self._built, self._error = {}, {}, {}, None
            self.shared.clear()
            self._unshadow()
        return self._grouped(layers, batch), losses.detach()

    def _grouped(self, layers: list[LayerGrads], batch: int) -> PerSampleGrads:
        """The layers' gradients (one per entry of :attr:`layers`) as :attr:`units`."""
        units = [
            TiedGrads([layers[i] for i in u]) if len(u) > 1 else layers[u[0]] for u in self.units
        ]
        return PerSampleGrads(units, batch, self.flags)

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        validate_precision(value)
        self._precision = value

    def _copies_failed(self, error: RuntimeError) -> str:
        """What a model that failed once the outputs of its lookups of one row of ids for the
        whole batch were copied to each example (:attr:`expanded`) is told."""
        names = ", ".join(f"'{self.names[m]}'" for m in self.expanded)
        first = str(error).splitlines()[0].rstrip(".")
        return (
            f"the model failed in make_private's check once the output of {names}, called with "
            "one row of ids for the whole batch, was copied to each example (as privgrad does "
            f"for Hugging Face's default position_ids): {type(error).__name__}: {first}. A "
            "model that repeats such an output for the batch itself gets batch × batch rows "
            "(peft's prompt tuning repeats its prompt embeddings: not supported; LoRA is); "
            "pass ids of shape (batch, length) to that layer"
        )

    def _autocast(self, device: torch.device):
        dtype = AUTOCAST_DTYPES.get(self._precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    # Own-loop mode (privgrad.own_loop): the user runs the forward and the backward of their
    # loss; the taps store what arrives, and collect() builds the rules at the step.

    def arm(self, batch: int, device: torch.device) -> None:
        """Prepares for one forward of a batch of ``batch`` examples run by the user (the
        caller switches ``_recording`` on around it) and for the user's own backward, whose
        output gradients are stored as they come; :meth:`collect` builds the layers."""
        self._batch, self._calls, self._grads, self._built, self._error = batch, {}, {}, {}, None
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.shared.clear()
        self._unshadow()
        self._deferred = True

    @contextmanager
    def recording(self):
        """Records the layers' calls of the forward the caller runs inside (after
        :meth:`arm`)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def forget_gradients(self) -> None:
        """Drops the output gradients stored since :meth:`arm`, keeping the recorded calls:
        another backward through the recorded forward may then feed the taps."""
        self._grads = {m: [None] * len(c) for m, c in self._calls.items()}
        self.shared.forget_gradients()

    def disarm(self) -> None:
        self._recording = self._deferred = False
        self._calls, self._grads, self._built, self._error = {}, {}, {}, None
        self.shared.clear()
        self._unshadow()

    def _receive_deferred(self, module: nn.Module, call: int, g: torch.Tensor) -> None:
        if self._error is not None:
            return
        grads = self._grads[module]
        if grads[call] is not None:
            self._error = PrivgradError(
                f"a second backward reached layer '{self.names[module]}' before optimizer.step(): "
                "call loss.backward() once per batch, then optimizer.step()"
            )
            return
        grads[call] = self._as_recorded(module, call, g)

    def _as_recorded(self, module: nn.Module, call: int, g: torch.Tensor) -> torch.Tensor:
        """An output gradient in the output's recorded shape (a folded layer's (B, T, ...))."""
        shape = self._calls[module][call][2]
        return g if g.shape == shape else g.reshape(shape)

    def collect(self, scale: float = 1.0, keep: torch.Tensor | None = None) -> PerSampleGrads:
        """The per-sample gradients of the armed batch's recorded forward and backward, the
        output gradients multiplied by ``scale`` (a mean-reduced loss's 1/B undone); with
        ``keep`` (a mask of the batch's examples) those of the kept examples only."""
        if self._error is not None:
            raise self._error
        batch = self._batch if keep is None else int(keep.sum())
        if batch == 0:
            return self.empty()
        layers = []
        for _, module in self.layers:
            calls, grads = self._calls.get(module), self._grads.get(module)
            if calls is None:
                layers.append(self._zeros(module, batch))
                continue
            if module in self.shared.calls and all(g is None for g in grads):
                grads = self._grads[module] = self.shared.output_grads(module)
            if keep is not None:
                if not all(isinstance(a, (torch.Tensor, Call)) for a, *_ in calls):
                    raise PrivgradError(
                        f"layer '{self.names[module]}' ({type(module).__name__}): examples with "
                        "non-finite gradients cannot be dropped from its recorded calls here"
                    )
                if isinstance(
                    calls[0][0], Call
                ):  # a rule reading the whole call; output batch on axis bd
                    bd = batch_dim(module)
                    calls = [
                        (c, c._version, (*shape[:bd], batch, *shape[bd + 1 :]), dtype, device)
                        for a, _, shape, dtype, device in calls
                        for c in [a.select(module, keep)]
                    ]
                    # a rule whose flattened rows are in another order selects their gradients
                    pick = getattr(RULES.get(type(module)), "select_grad", None) or (
                        lambda module, g, keep: g[:, keep] if bd else g[keep]
                    )
                    grads = [g if g is None else pick(module, g, keep) for g in grads]
                elif module in self._axis1:  # (L, B, ...): the batch is the second axis
                    calls = [
                        (
                            a[:, keep],
                            a[:, keep]._version,
                            (shape[0], batch, *shape[2:]),
                            dtype,
                            device,
                        )
                        for a, _, shape, dtype, device in calls
                    ]
                    grads = [g if g is None else g[:, keep] for g in grads]
                else:
                    calls = [
                        (a[keep], a[keep]._version, (batch, *shape[1:]), dtype, device)
                        for a, _, shape, dtype, device in calls
                    ]
                    grads = [g if g is None else g[keep] for g in grads]
            if scale != 1.0:  # in the parameters' precision (fp16 could overflow)
                full = layer_params(module)[0].dtype
                grads = [g if g is None else _in_precision(g, full) * scale for g in grads]
            saved = self._calls[module], self._grads[module]
            self._calls[module], self._grads[module] = calls, grads
            try:
                layers.append(self._build(module))
            finally:  # _build pops them; kept for a second collect (examples dropped)
                self._calls[module], self._grads[module] = saved
        return self._grouped(layers, batch)

    @staticmethod
    def _zeros(module: nn.Module, batch: int) -> LayerGrads:
        params = layer_params(module)
        return MaterializedGrads(params, [p.new_zeros(batch, *p.shape) for p in params])

    def empty(self) -> PerSampleGrads:
        """The per-sample gradients of an empty batch (a valid Poisson draw)."""
        return self._grouped([self._zeros(m, 0) for _, m in self.layers], 0)
