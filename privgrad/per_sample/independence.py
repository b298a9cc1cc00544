"""Example independence, checked by a probe before training.

DP-SGD's sensitivity bound says that adding or removing one example changes the clipped
gradient sum by at most C. That holds only if every example's per-sample gradient is a
function of that example alone. Layers that mix the examples of a batch (batch statistics,
a batch mean, attention across the batch dimension, an order-dependent roll) and losses
that do (a per-sample loss minus the batch mean, a loss normalized by a batch statistic)
break it silently: the training runs and prints an ε that does not hold. Known mixers are
refused by type (:data:`privgrad.per_sample.rules.REFUSED`); everything else is checked
here, by :func:`check_example_independence`, which ``make_private`` calls once on the
first (at most 5) examples of the training data.

How the probe works, and why
----------------------------
The model runs in train mode (the mode training uses: batch-statistics layers mix only
there) on a probe batch of B ≤ 5 real examples, then on altered copies of it. After each
alteration the outputs (every tensor leaf of the model's output whose first dimension is
the batch) and the per-sample losses of the *untouched* examples must be what they were:

1. substitution: example 0 is replaced by another real example of the batch (inputs and
   label: a valid, in-distribution example, so integer inputs such as token ids stay
   valid); catches any dependence on example 0 (batch means and variances, attention
   across the batch, ``x + x.sum(0)``, a roll along dim 0);
2. perturbation: example B−1 is perturbed (float inputs: Gaussian noise of the batch's
   scale, a generic change that moves maxima and medians too; integer inputs: replaced by
   another real example); catches dependence on the last example;
3. removal: example 0 is dropped (exactly the add/remove neighbouring relation of the
   accountant); catches dependence on the batch size (``x / len(x)``) and on position
   (every remaining example moves one place); then each other example in turn (a model
   trimming the padding all rows share depends on the batch's longest, wherever it is);
4. permutation: the batch is reversed, and the outputs must be reversed the same way;
   catches order-dependent mixing and dependence on any other example;
5. gradients: the gradient of Σ_{i≠0} ℓ_i with respect to the trainable parameters must not
   change under (1): catches mixing that happens only in the backward pass (a
   ``x + m - m.detach()`` trick, a custom autograd function whose backward mixes rows);
   for ``loss_fn``, the gradient of Σ_{i≠0} ℓ_i with respect to row 0 of its input must be
   zero (``ℓ − mean(ℓ) + mean(ℓ).detach()`` has the values of ℓ, not its gradients);
6. buffers: a buffer whose value after a train-mode forward depends on the batch (a
   running statistic, updated from the data and released with the model unnoised) is
   refused, and so is one that changes when an example is removed (a count of the examples
   seen, a buffer sized by the batch: the Poisson batches' sizes, which the subsampling
   keeps secret), and a forward pass that changes a parameter in place.

``loss_fn`` is checked on its own as well, on the model's outputs of the probe batch: it
must return shape (B,), and each entry must depend on its own row alone (one row of the
outputs perturbed, a row removed, the rows reversed), so a failure names the loss, not
the model.

Randomness. Every forward runs with the global RNGs (torch's, NumPy's, Python's) forked
and seeded identically, and so are the generators the model's modules hold as attributes
(:mod:`~privgrad.per_sample.held_generators`), so a stochastic layer draws the same random
numbers in each run; with the same batch layout
(checks 1, 2, 5) a per-position random mask is then the same for each untouched example.
Checks 3 and 4 change the layout, so ``nn.Dropout`` layers (``_DropoutNd``) and
``nn.RReLU`` (random per element, never mixing: :data:`ELEMENTWISE_RANDOM`) are put in eval
mode for the whole probe; on a CPU, RReLU draws a slope for each negative element only, so
one example's signs would move the others' draws, which the probe cannot tell from mixing.
Checks 3 and 4 run with another
seed, and a mismatch there counts only if the model is deterministic (the unchanged batch
gives the same outputs under both seeds); a model still stochastic (a functional dropout,
a custom random layer) has checks 3 and 4 run in eval mode, and skipped only where it is
random there too.

Tolerance. Same-shape runs (1, 2, 4, 5) agree to the last bit on an independent model
(a row's result does not depend on the other rows' values). Removal (3) changes the batch
size, which may select another GEMM/convolution kernel with another summation order:
float32 rounding (unit 6e-8) accumulated through a network, under 1e-6 of the output's
largest absolute value on the built-in models (results/bench/engine_notes.md). A difference
counts as mixing above ``TOL`` = 1e-4 times the largest absolute value of that output over
the probe batch: ~100× above that rounding (1e-5 would leave a deeper network, or a GPU's
different convolution algorithms, only ~10×), and ~100× below
what the mixing layers we know do with B ≤ 5 (one example moves a batch mean by about 1/B
of its scale; BatchNorm or a batch-mean centring move the others' outputs by 1e-2 to 1e-1
of their scale). A mixing path weaker than that (``x + 1e-6 · x.sum(0)``) is not seen.
The gradient check (5) allows more where the backward pass is not reproducible: a GPU's
atomic additions (convolution weight gradients, GroupNorm) change the last bits from run to
run, and on a deep GroupNorm network (WRN-16-4 on an H200) that reached the 1e-4 tolerance.
The untouched examples' gradient is taken twice from the same forward; ``REPEAT_MARGIN`` (10)
times the two's largest difference is allowed too, up to ``MIXING`` (1e-2) of the scale,
the least that the mixing layers above move. A reproducible backward (a CPU) repeats to the
bit, and keeps the 1e-4 tolerance.

What it cannot see
------------------
* mixing that happens only at other batch sizes or in other modes (a layer that mixes when
  ``len(x) > 4``, or only in eval mode);
* data-dependent branches the probe examples never take (a layer that mixes only for some
  inputs, labels or values);
* mixing through state that persists across steps (a module that keeps examples of the
  previous batch and uses them in the next; only a buffer that changes within one forward
  is seen; a tensor ``loss_fn`` holds, in its closure or as a global it names, that changes
  between steps, a MoCo-style queue of earlier outputs, is refused at the step by
  ``PrivateTrainer._check_loss_state``, as is a model's plain tensor attribute written
  outside its forwards), and side channels outside the model and loss
  (files, a global the loss does not name). A buffer the
  probe saw no forward write that a later step writes (a running statistic that starts
  after some calls) is refused at that step (``PrivateTrainer._check_buffers``); one the
  probe saw written alike for every batch (a counter) is not watched;
* a backward-only mixer whose effect happens to cancel in Σ_{i≠0} ℓ_i (check 5 looks at
  the sum of the untouched examples' gradients, not at each one);
* mixing smaller than the tolerance; in the backward pass, smaller than ``REPEAT_MARGIN``
  times the backward's own run-to-run change (at most ``MIXING`` of the scale);
* in a model with a custom random layer (not an ``nn.Dropout`` or ``nn.RReLU``): a
  dependence on the batch size or on position alone (checks 3 and 4 are skipped for it;
  dependence on other examples is still seen by 1, 2 and 5);
* examples whose output or loss is not finite: they are left out of the probe (their
  NaNs would poison every batch sum), and if no example is finite nothing is checked.

The probe is cheap (about seven forwards and two backwards of ≤ 5 examples), leaves the
model's buffers, train/eval modes and the RNG states as they were (it changes no
parameter; a model whose own forward does is refused), and runs with the GradSampler's hooks
inactive (they record only inside ``compute``). A model with lazy layers is materialized by
a first forward, with the user's RNG stream as the first training step would use it.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from privgrad.errors import PrivgradError, warn_user
from privgrad.inputs import (
    call_model,
    cat,
    copy_example,
    device_of,
    perturb_example,
    rows,
    same_example,
    take,
    to_device,
)
from privgrad.per_sample import held_generators
from privgrad.per_sample.rules import float32_arithmetic, replays_dropout
from privgrad.per_sample.tables import ReplayInstead

MAX_PROBE = 5  # examples in the probe batch (more costs time, and each example then moves a batch
# statistic less); 5, not a power of two, so that a shared tensor's rows (heads, positions,
# channels) seldom number the probe's examples, which would read them as the batch's
SEED = 0x5EED  # every forward starts from this RNG seed (a second one tests determinism)
TOL = 1e-4  # relative to an output's largest absolute value (see the module docstring)
DRAWN_SEEDS = 8  # a model drawing random numbers: checks 1 and 2 under this many more seeds
REPEAT_MARGIN = 10  # check 5 also allows this many times the backward's own run-to-run change
MIXING = 1e-2  # ... but never more than this relative change, the least known mixers make

ADVICE = (
    "so one example moves the others' gradients and DP-SGD's ε would not hold; use layers "
    "that treat each example alone (GroupNorm or LayerNorm instead of BatchNorm, no batch "
    "statistics)"
)
LOSS_ADVICE = (
    "so one example moves the others' gradients and DP-SGD's ε would not hold; compute each "
    "example's loss from its own output and label alone (reduction='none', no batch statistics)"
)


def check_example_independence(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x,
    y: torch.Tensor,
) -> None:
    """Raises :class:`PrivgradError` if ``model``'s per-example outputs, gradients or
    buffers, or ``loss_fn``'s per-example losses, are not functions of their own example
    alone, as far as a probe on the batch ``(x, y)`` (its first ``MAX_PROBE`` examples) can
    tell; see the module's docstring for the checks and their blind spots. The model's buffers and
    train/eval modes and the RNGs are left as they were; a forward pass that changes
    a parameter in place is refused."""
    x, y = take(x, slice(0, MAX_PROBE)), y[:MAX_PROBE]
    if rows(x) != len(y):
        raise PrivgradError(f"the probe batch has {rows(x)} inputs and {len(y)} labels")
    if len(y) == 0:
        return
    if len(y) == 1:  # one example: a copy of it makes a batch (the perturbations still differ)
        x, y = cat([x, x]), torch.cat([y, y])
    with _ProbeState(model, x) as state:
        _Probe(model, loss_fn, x, y, state).run()


def check_trainer(trainer) -> None:
    """:func:`check_example_independence` and :func:`check_gradients` on a
    ``PrivateTrainer``'s model, loss and per-sample engine, with its first ``MAX_PROBE``
    training examples (loaded as a batch is) on its device; what ``make_private`` calls
    before returning the trainer. They run without autocast, where their tolerances hold;
    a model whose parameters mix dtypes and cannot run so (a bfloat16 base feeding a
    float32 head) runs them under the trainer's precision's autocast (``precision=``)."""
    n = len(trainer.data)
    if n == 0:
        return
    x, y = next(iter(trainer.data.load([torch.arange(min(MAX_PROBE, n))])))
    x, y = to_device(x, trainer.device), y.to(trainer.device)
    recollated = getattr(trainer.data, "recollated", None)
    found = recollated(min(MAX_PROBE, n)) if recollated else None
    if found is not None:  # the probe batch collated with and without an example that pads it
        k, *pairs, made_up = found
        full, without = [(to_device(a, trainer.device), b.to(trainer.device)) for a, b in pairs]

    def check():
        check_example_independence(trainer.model, trainer.loss_fn, x, y)
        check_gradients(trainer.grad_sampler, trainer.loss_fn, x, y)
        if found is not None:
            check_recollated(
                trainer.model, trainer.loss_fn, k, full, without, made_up,
                collated=hasattr(trainer.data, "collate"),
            )  # fmt: skip

    try:
        try:
            check()
        except RuntimeError as err:
            mixed = _mixed_dtypes(trainer.model)
            if not (_DTYPE_MISMATCH.search(str(err)) and mixed):
                raise
            if trainer.grad_sampler.precision == "fp32":
                raise PrivgradError(
                    "the model's forward failed in make_private's checks, which run it without "
                    f"autocast ({str(err).splitlines()[0]}): its parameters mix dtypes "
                    f"({', '.join(mixed)}); declare the autocast its forward runs under, "
                    "make_private(precision='bf16') or attach(precision='bf16') (or 'fp16'), "
                    "and the checks run under it"
                ) from None
            with trainer.grad_sampler._autocast(trainer.device):
                check()
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise PrivgradError(
            "the model uses activation checkpointing with use_reentrant=True, which torch "
            "refuses in the autograd.grad calls privgrad's checks and steps make; enable it "
            "with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}))"
        ) from None
    _warn_uncalled(trainer.grad_sampler)


def _warn_uncalled(sampler) -> None:
    """Warns of trainable layers the check's last forward did not call, and whose weights no
    called layer holds (BART's and T5's shared embedding is its encoder's, tied): a layer the
    model never calls gets no gradient, and each step moves its parameters by noise alone."""
    called = {id(p) for _, m in sampler.layers if m not in sampler.uncalled for p in m.parameters()}
    uncalled = [
        name
        for name, m in sampler.layers
        if m in sampler.uncalled and not any(id(p) in called for p in m.parameters())
    ]
    if uncalled:
        warn_user(
            f"{len(uncalled)} trainable layer{'s' * (len(uncalled) > 1)} the model did not call "
            f"on the first training examples ({', '.join(repr(n) for n in uncalled[:3])}"
            f"{', …' if len(uncalled) > 3 else ''}): a layer the model never calls gets no "
            "gradient, and each private step moves its parameters by noise alone; freeze it "
            "(requires_grad_(False)) unless the model calls it on other examples"
        )


# torch's errors for an operation on tensors of two dtypes (matmul, conv, linear)
_DTYPE_MISMATCH = re.compile(r"same dtype|dtype .* != |Input type \(.*\) and (weight|bias) type")


def _mixed_dtypes(model: nn.Module) -> list[str]:
    """The floating dtypes of ``model``'s parameters, if there are several."""
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return found if len(found) > 1 else []


def check_recollated(
    model: nn.Module,
    loss_fn,
    k: int,
    full: tuple,
    without: tuple,
    made_up: bool = False,
    collated: bool = True,
) -> None:
    """Refuses a model whose outputs or losses for the other examples change when example ``k``
    leaves the probe batch and the rest are collated anew (``full``, ``without``: the two
    collations, each (inputs, labels)). A collate that pads to the batch's longest pads them
    less there, which the probe's removal of a collated row keeps; a model that reads the
    padding (a mean over every position) lets one example's length move the others'
    gradients, as any model does under a collate that crops to the batch's shortest. Outputs
    are compared on the positions both batches have, in eval mode where train mode draws
    random numbers beyond nn.Dropout's (a functional dropout). ``made_up``: example ``k`` is
    one of the dataset's resized (every example has one length), which a model may be unable
    to take (beyond its positions): then nothing is compared. ``collated`` False: rows of
    tensors, the example the one with the most nonzero entries (a model trimming the padding
    every row shares to the batch's longest)."""
    (x, y), (xk, yk) = full, without
    B = len(y)
    with _ProbeState(model, x) as state:
        probe = _Probe(model, loss_fn, x, y, state)
        try:
            base = probe.reproducible(x)
            if base is None:
                model.eval()  # random beyond nn.Dropout (F.dropout): compared without its draws
                base = probe.reproducible(x)
        except Exception:
            if not made_up:
                raise
            return
        if base is None:
            return  # random in eval mode too: two layouts cannot be compared
        out, _ = probe.forward(xk)
        keep = torch.tensor([i for i in range(B) if i != k], device=device_of(x))
        rest = torch.arange(B - 1, device=device_of(x))
        ok, diff, scale = _close_spans(base, out, keep, rest, B, B - 1)
        if ok:
            a, b = probe.losses(base, y).detach(), probe.losses(out, yk).detach()
            ok, diff, scale = _close_tree(a, b, keep, rest, TOL)
    if not ok and not collated:
        raise PrivgradError(
            f"the model's outputs depend on the batch's longest example: when example {k} of a "
            "probe batch (the example with the most nonzero entries, the longest of padded "
            "token ids, among those spread over the data) left it, the other examples' outputs "
            f"or losses changed (by {diff:.2g}, tolerance {TOL * scale:.2g}), so one example's "
            "length moves the others' gradients and DP-SGD's ε would not hold; mask the "
            "padding in the model and loss_fn (a mean over each example's own positions), not "
            "over the padding the batch's rows share"
        )
    if not ok:
        which = (
            "one of the dataset's examples with each sequence in it twice over or cut to half: "
            "a neighbouring dataset may hold an example longer or shorter than all of yours"
            if made_up
            else "its longest or shortest"
        )
        raise PrivgradError(
            f"the model's outputs depend on the batch's padding or cropping: when example {k} of "
            f"a probe batch ({which}) left it and collate_fn collated the rest "
            f"again, the other examples' outputs or losses changed (by "
            f"{diff:.2g}, tolerance {TOL * scale:.2g}), so one example's length moves the "
            "others' gradients and DP-SGD's ε would not hold; mask the padding in the model "
            "and loss_fn (a mean over each example's own positions) or pad or crop every "
            "example to one fixed length in collate_fn"
        )


def _close_spans(a, b, ia, ib, na: int, nb: int) -> tuple[bool, float, float]:
    """:func:`_close_tree` leaf by leaf, on the span both leaves have where their lengths past
    the batch dimension differ (padding to each batch's longest), aligned at its start or at
    its end."""
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(la) != len(lb):
        return False, math.inf, 1.0
    for s, t in zip(la, lb):
        if isinstance(s, torch.Tensor) and isinstance(t, torch.Tensor) and s.dim() == t.dim() > 1:
            span = [min(m, n) for m, n in zip(s.shape[1:], t.shape[1:])]
            found = max(
                (
                    _close_tree(_crop(s, span, e), _crop(t, span, e), ia, ib, TOL, na, nb)
                    for e in (False, True)
                ),
                key=lambda r: r[0],
            )
        else:
            found = _close_tree(s, t, ia, ib, TOL, na, nb)
        if not found[0]:
            return found
    return True, 0.0, 1.0


def _crop(u: torch.Tensor, span: list[int], end: bool) -> torch.Tensor:
    """``u``'s first ``span`` positions past the batch dimension (``end``: its last)."""
    return u[
        (slice(None), *(slice(m - n, m) if end else slice(0, n) for m, n in zip(u.shape[1:], span)))
    ]


# layers random in training that act on each element alone (their draws are i.i.d. whatever
# the data), put in eval mode by the mixing probe
ELEMENTWISE_RANDOM = (nn.modules.dropout._DropoutNd, nn.RReLU)

GRAD_TOL = 1e-3  # relative: float32 sums in two orders differ by ~1e-6, a missed use or a
# misattributed gradient by O(1); parameters in bfloat16 or float16 take 8 units of their
# rounding if that is more
FLOOR = 1e-2  # a gap under FLOOR·tol of all the gradients' norm is rounding: a parameter whose
# gradient is zero but for rounding (a key bias under softmax, a bias before a norm layer)


def check_gradients(sampler, loss_fn, x, y: torch.Tensor) -> None:
    """:func:`_check_gradients` on the batch ``(x, y)`` and, if that fails, once more without
    its last example: a length or head count equal to the probe's size can make a tensor the
    batch shares look batched (T5's decoder table looked up on a (5 × 5) grid of relative
    positions, for 5 examples), which the first check refuses; the layouts the engine keeps
    are those of the check that passed, on its examples. If both fail, the first's error."""
    try:
        _check_gradients(sampler, loss_fn, x, y)
    except PrivgradError as first:
        n = rows(x)
        if n < 3:
            raise
        try:
            _check_gradients(sampler, loss_fn, take(x, slice(0, n - 1)), y[: n - 1])
        except PrivgradError:
            raise first from None


def _check_gradients(sampler, loss_fn, x, y: torch.Tensor) -> None:
    """Raises :class:`PrivgradError` unless, on the batch ``(x, y)``, the engine's per-sample
    gradients are autograd's, to ``GRAD_TOL`` of their norms (and ``FLOOR · GRAD_TOL`` of all
    the gradients' norm):

    1. coverage: their sum is the gradient of the summed loss, for every parameter. A
       parameter used outside the forward of the layer that holds it
       (``F.linear(h, emb.weight)``) is a use no rule sees: the private update would leave it
       out;
    2. attribution: example i's per-sample gradient is autograd's gradient of example i's
       loss ℓ_i (backpropagated alone through the same forward of the batch). A gradient
       credited to another example escapes the clip that bounds each example's influence,
       and ε would not hold. The engine copies one row of embedding ids shared by the batch
       (Hugging Face's default ``position_ids``, shape (1, T)) to every example, for the
       layers seen called so here (``GradSampler.expanded``; other layers' shared rows stay
       refused): right if the model broadcasts that row, wrong if it indexes it
       (``emb(ids)[0]``), which this sees. Likewise it reads a row-wise layer's rows of
       examples flattened with their positions, (B·T, d), as example-major, row r example
       r // T's (``GradSampler.folded``; OPT's decoder layers): right for
       ``(B, T, d).view(-1, d)``, wrong for a (T, B, d) flattened, which this sees.
       And a layer the generic rule replays, called with several arguments, is replayed on
       the tensors that have the batch's rows here (``GradSampler.batched_args``), the others
       shared: wrong if a shared tensor has as many rows as the probe's examples, which this
       sees wherever that changes a gradient (:func:`check_gradients` then checks again on
       one example fewer). And an Embedding whose ids and output lack the
       batch's rows (T5's relative-attention bias) is a table the batch shares, attributed to
       examples where its output meets the batch (``GradSampler.shared``,
       :mod:`privgrad.per_sample.tables`): those places are learned here from shapes, which
       this checks. So are a rule-less layer's own parameters (BEiT's layer scales), tried as
       such tables first; a layer with a use of them that is no meeting is replayed by the
       generic rule instead, and the check runs again.

    Autograd differentiates the same batch as the engine, not each example run alone: in
    float32 a model can be ill-conditioned enough (a GroupNorm channel of near-constant
    values) that another batch size, another kernel, moves an example's gradient by 1 %.
    In eval mode (no dropout), float32, the RNG forked and seeded alike for both forwards (so
    a random layer draws alike); modes, buffers and the RNG are restored. Then the same in
    training mode, where the layouts met only in training are learned, kept where its
    gradients are autograd's (:func:`_check_training_mode`). A check on these examples."""
    model, device = sampler.model, device_of(x)
    precision, sampler.precision = sampler.precision, "fp32"
    sampler.assume_layouts, sampler.expanded, sampler.folded = True, set(), set()
    sampler.batched_args = {}
    sampler.shared.forget_layouts()
    try:
        with _ProbeState(model, x) as state, float32_arithmetic():
            model.eval()
            while True:
                try:
                    with _forked_rng(model, device, SEED):
                        grads, _ = sampler.compute(x, y, loss_fn)
                    break
                except ReplayInstead:  # own parameters that are no tables: those layers replayed
                    state.restore_buffers()
            if not grads.params:
                return
            state.restore_buffers()
            with _forked_rng(model, device, SEED):
                losses = loss_fn(call_model(model, x), y)
            _compare(sampler, grads, losses)
            _check_training_mode(sampler, state, loss_fn, x, y)
    finally:
        sampler.precision, sampler.assume_layouts = precision, False


def _compare(sampler, grads, losses: torch.Tensor) -> None:
    """Refuses per-sample gradients ``grads`` that are not autograd's of ``losses`` (the
    same batch's): their sum, then each example's (:func:`_check_gradients`' 1 and 2). Under
    a declared autocast (a model of mixed dtypes) the rules' norms and sums are computed in
    float32, as at a step, and autograd's gradients, rounded in the autocast's dtype, are
    met to twice its rounding (bf16: 1.6 %)."""
    device = losses.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        _compare_fp32(sampler, grads, losses, 2 * torch.finfo(low).eps if low else 0.0)


def _compare_fp32(sampler, grads, losses: torch.Tensor, rounding: float) -> None:
    model, params = sampler.model, grads.params
    if not losses.requires_grad:
        return
    ones = torch.ones(grads.batch_size, dtype=params[0].dtype, device=losses.device)
    gap = _first_gap(params, grads.weighted_sum(ones), _grads(losses.sum(), params), rounding)
    if gap is not None:
        raise PrivgradError(
            f"parameter '{_name(model, gap[0])}': its gradient is not the sum of its "
            f"layer's per-sample gradients (relative difference {gap[1]:.2g} on "
            f"{grads.batch_size} training examples): the model uses it outside that "
            "layer's forward (e.g. F.linear(h, emb.weight)), a use the private update "
            "would leave out; use it through a layer (a layer whose weight is tied to it "
            f"is supported){_replayed(sampler, gap[0], grads.batch_size)}"
            f"{_read_by_parent(sampler, gap[0])}"
        )
    layer_norms = [layer.norms_sq() for layer in grads.layers]
    for i in range(grads.batch_size):
        one_hot = torch.zeros_like(ones)
        one_hot[i] = 1
        added = grads.weighted_sum(one_hot)
        gap = _first_gap(params, added, _grads(losses[i], params), rounding)
        if gap is not None:
            raise PrivgradError(_misattributed(sampler, gap, i, grads.batch_size))
        _check_norms(model, grads.layers, layer_norms, added, i)


def _check_norms(model: nn.Module, layers, layer_norms, added, i: int) -> None:
    """Refuses a layer whose per-sample norm for example i (what clipping divides by) is
    smaller than the norm of what its weighted sum adds for example i (``added``, every
    parameter's, at w_i = 1), beyond ``GRAD_TOL`` (and ``FLOOR · GRAD_TOL`` of all the
    layers' added norm): such an example would add more than C to the clipped sum. A rule
    registered with ``fast_views=True`` (:func:`~privgrad.per_sample.register_rule`) keeps
    this for every input by contract; this sees a rule that breaks it on the probe. A norm
    whose square is below the smallest normal number of its dtype (a saturated softmax's
    gradient of 1e-22, whose float32 square is 0) is read as that floor's root."""
    sizes, start = [], 0
    for layer, norms in zip(layers, layer_norms):
        part = added[start : start + len(layer.params)]
        start += len(layer.params)
        norm = float(norms[i].clamp(min=0).sqrt())
        if norms.is_floating_point():
            norm = max(norm, math.sqrt(torch.finfo(norms.dtype).tiny))
        sizes.append((layer, norm, _norm(part)))
    total = math.sqrt(sum(a * a for _, _, a in sizes))
    for layer, norm, got in sizes:
        if got > norm * (1 + GRAD_TOL) + FLOOR * GRAD_TOL * total:
            raise PrivgradError(
                f"parameter '{_name(model, layer.params[0])}': its layer's per-sample norm "
                f"({norm:.4g}) is smaller than what its weighted sum adds for the example "
                f"({got:.4g}, training example {i} of make_private's probe): clipping by that "
                "norm would let the example add more than C. A rule registered with "
                "fast_views=True must give norms at least its sum's per-example contribution "
                "(privgrad.per_sample.register_rule); without it, both come from per_sample()"
            )


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _layouts(sampler) -> tuple:
    """What the engine has learned of the model's layouts (copies): the sampler's rows read
    as shared, folded or batched, and its tables' (``SharedTables.layouts``)."""
    return (
        set(sampler.expanded),
        set(sampler.folded),
        dict(sampler.batched_args),
        sampler.shared.layouts(),
    )


def _restore_layouts(sampler, layouts: tuple) -> None:
    sampler.expanded, sampler.folded, sampler.batched_args, shared = layouts
    sampler.shared.restore_layouts(shared)


def _check_training_mode(sampler, state, loss_fn, x, y: torch.Tensor) -> None:
    """The check again in training mode, the global RNGs seeded alike for both forwards (so
    dropout draws alike; attention dropout is off, since the engine computes that attention's
    output with a mask of its own, ``test_attention_dropout_is_replayed``): code met only in
    training (dropout, a forward hook or branch under ``self.training``, gradient
    checkpointing) must not change what the rules see, and a rule that refuses it (dropout
    it cannot replay) refuses it here, not at the first step. Layouts met only there
    (Wav2Vec2's SpecAugment writes its learned embedding over the masked time steps) are
    learned, and kept only if the gradients are then autograd's; else the eval-mode layouts
    stand, and a training step that meets such a place is refused. With the layouts the step
    will use, per-sample gradients that are not autograd's are refused here
    (:func:`_compare`)."""
    model, device = sampler.model, device_of(x)
    learned = _layouts(sampler)
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    for m in model.modules():
        if replays_dropout(m):
            m.eval()

    def gradients():
        state.restore_buffers()
        with _forked_rng(model, device, SEED):
            grads, _ = sampler.compute(x, y, loss_fn)
        state.restore_buffers()
        with _forked_rng(model, device, SEED):
            return grads, loss_fn(call_model(model, x), y)

    try:
        for learning in (True, False):
            try:
                grads, losses = gradients()
            except PrivgradError as e:  # a rule's refusal, which the step would meet
                if learning and _layouts(sampler) == learned:
                    raise PrivgradError(f"{e} (met in training mode)") from None
                _restore_layouts(sampler, learned)
                if not learning:  # a use met only in training: refused where the step meets it
                    return
                sampler.assume_layouts = False
                continue
            except Exception:  # the training step meets it again, and reports it then
                _restore_layouts(sampler, learned)
                return
            try:
                _compare(sampler, grads, losses)
                return
            except PrivgradError as e:
                if _layouts(sampler) == learned:
                    raise PrivgradError(
                        f"{e}; in training mode only (code run only in training, such as a "
                        "forward hook or a branch under `self.training`, changes what the "
                        "layer computes)"
                    ) from None
            _restore_layouts(sampler, learned)  # learned in training mode, and wrong:
            sampler.assume_layouts = False  # now a use met only there is refused
    finally:
        sampler.assume_layouts = True
        state.restore_buffers()
        for m, training in modes:
            m.training = training


def _grads(loss: torch.Tensor, params) -> list[torch.Tensor]:
    """Autograd's gradients of ``loss`` (zeros for parameters it does not use); the graph is
    kept for the next."""
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _first_gap(params, ours, theirs, rounding: float = 0.0) -> tuple[nn.Parameter, float] | None:
    """The first parameter whose two gradients differ beyond rounding (``GRAD_TOL`` of their
    norms, or ``rounding`` where larger, and ``FLOOR`` times that of all of them together),
    with the relative difference; parameters with a non-finite gradient are left out."""
    norms = [(a.norm(), b.norm()) for a, b in zip(ours, theirs)]  # each computed once
    finite = [_finite(a, na) and _finite(b, nb) for a, b, (na, nb) in zip(ours, theirs, norms)]
    whole = sum(na**2 + nb**2 for (na, nb), f in zip(norms, finite) if f) ** 0.5
    for p, a, b, f, (na, nb) in zip(params, ours, theirs, finite, norms):
        gap, scale = (a - b).norm().item(), (na + nb).item()
        tol = max(GRAD_TOL, 8 * torch.finfo(a.dtype).eps, rounding)
        if f and gap > tol * scale and gap > FLOOR * tol * float(whole):
            return p, gap / scale
    return None


def _name(model: nn.Module, p: nn.Parameter) -> str:
    return next((name for name, q in model.named_parameters() if q is p), "?")


def _holders(sampler, layers, p: nn.Parameter) -> str:
    """The names of ``layers`` (quoted, in the model's order) if one of them holds ``p``,
    else ''."""
    if not any(p is q for m in layers for q in m.parameters()):
        return ""
    return ", ".join(f"'{n}'" for n, m in sampler.layers if m in layers)


def _replayed(sampler, p: nn.Parameter, batch: int) -> str:
    """A hint when ``p``'s layer is replayed by the generic rule on several arguments."""
    for module, batched in sampler.batched_args.items():
        if any(p is q for q in module.parameters(recurse=False)):
            return (
                f". Or: layer '{sampler.names[module]}' ({type(module).__name__}) has no "
                "per-sample rule and is replayed one example at a time on its tensor arguments "
                f"that had {batch} rows here (#{', #'.join(map(str, sorted(batched)))}), the "
                "others shared: if one of these is shared by the batch, or one of the others "
                "is per example, give the layer a rule (privgrad.per_sample.register_rule)"
            )
    return ""


def _read_by_parent(sampler, p: nn.Parameter) -> str:
    """A hint when ``p``'s layer was never called but is a child of another module, which
    may read its parameters directly (a Mamba mixer's ``F.conv1d(x, self.conv1d.weight)``)."""
    for name, module in sampler.layers:
        if module in sampler.uncalled and "." in name and any(p is q for q in module.parameters()):
            parent_name, child = name.rsplit(".", 1)
            parent = type(sampler.model.get_submodule(parent_name)).__name__
            return (
                f". Layer '{name}' was never called: if its parent '{parent_name}' ({parent}) "
                "reads its parameters directly, declare it, "
                f"privgrad.per_sample.register_read_children({parent}, ('{child}',)), and the "
                "generic rule replays the parent for them"
            )
    return ""


def _misattributed(sampler, gap, i: int, batch: int) -> str:
    head = (
        f"parameter '{_name(sampler.model, gap[0])}': the per-sample gradient of example {i} "
        f"is not autograd's gradient of its loss (relative difference {gap[1]:.2g}): "
        "part of one example's gradient is credited to another, outside the clip that bounds "
        "each example's influence, so ε would not hold"
    )
    layouts = (
        (
            sampler.expanded,
            "were called on one row of ids for the whole batch (as Hugging Face's default "
            "position_ids), which privgrad copies to each example, but the model does not use "
            "each copy as its example's own (it indexes the row instead of broadcasting it): "
            "pass ids with one row per example (position_ids of shape (B, T))",
        ),
        (
            sampler.folded,
            "were called on a multiple of the batch's rows, which privgrad reads as the "
            "batch's examples flattened with another dimension, example-major (row r is "
            "example r // T's, as (B, T, d).view(-1, d) gives), but the model's rows are in "
            "another order (a (T, B, d) flattened?) or not the examples' at all: keep the "
            "batch dimension there",
        ),
        (
            set(sampler.shared.sites) - sampler.shared.params,
            "are tables the batch shares (their ids carry no batch), which privgrad "
            "attributes to examples where they meet the batch, as shapes showed on the probe "
            "examples (an op broadcasting their output against tensors whose first axis has "
            "the batch's rows), but the model does not give each example its own share of "
            "them there",
        ),
        (
            sampler.shared.params,
            "have no rule (or were called on tensors the batch shares), and their own "
            "parameters are read as tables the batch shares, "
            "which privgrad attributes to examples where they meet the batch, as shapes showed "
            "on the probe examples (an op broadcasting them against, or multiplying them with, "
            "tensors whose first axis has the batch's rows, or k rows per example, "
            "example-major), but the model does not give each example its own share of them "
            "there",
        ),
    )
    for layers, why in layouts:
        names = _holders(sampler, layers, gap[0])
        if names:
            return f"{head}: layer(s) {names} {why}"
    replayed = _replayed(sampler, gap[0], batch)
    if replayed:
        return head + replayed
    return f"{head}; refused (if the model treats each example alone: a privgrad bug, report it)"


class _ProbeState:
    """Train mode (dropout in eval mode) for the probe; on exit every module's mode, every
    buffer and the global RNG are as before. Each forward starts from the saved buffers."""

    def __init__(self, model: nn.Module, x):
        self.model, self.x, self.device = model, x, device_of(x)

    def __enter__(self) -> "_ProbeState":
        self.modes = [(m, m.training) for m in self.model.modules()]
        if _has_lazy(self.model):
            # the first forward materializes lazy layers: with the user's RNG stream, as the
            # first training step would (the RNG itself is restored), and no buffer kept
            saved = [
                (m, name, b, b.detach().clone())
                for m in self.model.modules()
                for name, b in m._buffers.items()
                if b is not None and not nn.parameter.is_lazy(b)
            ]
            with _forked_rng(self.model, self.device), torch.no_grad():
                call_model(self.model, self.x)
                for m, name, b, value in saved:
                    m._buffers[name] = b
                    b.copy_(value)
        self.model.train()
        for m in self.model.modules():
            if isinstance(m, ELEMENTWISE_RANDOM):
                m.eval()
        self.buffers = [
            (f"{prefix}{'.' if prefix else ''}{name}", m, name, b, b.detach().clone())
            for prefix, m in self.model.named_modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        self.params = [(name, p, p._version) for name, p in self.model.named_parameters()]
        self.versions = [b._version for _, _, _, b, _ in self.buffers]
        return self

    def __exit__(self, *exc) -> None:
        # the buffers the probe's forwards wrote (in place or anew), each passed as free of the
        # training data or refused: privgrad refuses a step after which another buffer was
        # written (PrivateTrainer._check_buffers), a write the probe never saw
        written = {
            qualified
            for (qualified, m, name, b, _), version in zip(self.buffers, self.versions)
            if m._buffers.get(name) is not b or b._version != version
        }
        self.model._privgrad_written_buffers = (
            getattr(self.model, "_privgrad_written_buffers", set()) | written
        )
        self.restore_buffers()
        for m, training in self.modes:
            m.training = training

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for _, m, name, b, saved in self.buffers:
                if m._buffers.get(name) is not b or not torch.equal(b, saved):
                    m._buffers[name] = b
                    b.copy_(saved)

    def changed_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a forward changed (their new values), then restores them."""
        changed = {}
        for qualified, m, name, b, saved in self.buffers:
            now = m._buffers.get(name)
            if now is not b or not torch.equal(b, saved):
                changed[qualified] = now.detach().clone() if isinstance(now, torch.Tensor) else now
        self.restore_buffers()
        return changed

    def check_params(self) -> None:
        for name, p, version in self.params:
            if p._version != version:
                # its value now holds the probe examples' data: a later make_private refuses
                # the model until the parameter is written again (rebuilt or reloaded)
                self.model._privgrad_tainted = (name, p, p._version)
                raise PrivgradError(
                    f"the model's forward pass changes parameter '{name}' in place, "
                    "a data-dependent change that no noise covers; refused (its value now "
                    "comes from the check's training examples: rebuild the model or reload its "
                    "weights)"
                )


class _Probe:
    def __init__(self, model, loss_fn, x, y, state: _ProbeState):
        self.model, self.loss_fn, self.x, self.y, self.state = model, loss_fn, x, y, state
        self.B = len(y)
        self.tol = TOL
        self.params = [p for p in model.parameters() if p.requires_grad]

    # -- running the model -------------------------------------------------------------
    def forward(self, x, seed: int = SEED, grad: bool = False, record: list | None = None):
        """(outputs, changed buffers) of one train-mode forward from the saved state."""
        handles = []
        if record is not None:

            def hook(module, inputs, output):
                # a copy: a later in-place write into the output (SpecAugment's
                # h[mask] = embed) would show as a change at the layer that made it
                record.append((module, _map(output, _copy)))

            handles = [m.register_forward_hook(hook) for m in self.model.modules()]
        rng = _forked_rng(self.model, device_of(x), seed)
        try:
            with rng, torch.set_grad_enabled(grad), float32_arithmetic():
                out = call_model(self.model, x)
        finally:
            for h in handles:
                h.remove()
            self.drawn = getattr(rng, "drawn", None)
            self.drew = getattr(rng, "drew", False)
        self.state.check_params()
        return out, self.state.changed_buffers()

    def losses(self, out, y, what: str = "the model's outputs") -> torch.Tensor:
        with _forked_rng(self.model, device_of(self.x), SEED), float32_arithmetic():
            losses = self.loss_fn(out, y)
        if not isinstance(losses, torch.Tensor) or losses.shape != (len(y),):
            shape = (
                tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            )
            raise PrivgradError(
                f"the loss must give one value per sample (shape ({len(y)},)), got "
                f"shape {shape} on {what}; use reduction='none'"
            )
        return losses

    # -- the checks ----------------------------------------------------------------------
    def run(self) -> None:
        B, x, y = self.B, self.x, self.y
        try:
            base, base_buffers = self.forward(x, grad=bool(self.params))
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            if isinstance(e, torch.OutOfMemoryError) or (
                _DTYPE_MISMATCH.search(str(e)) and _mixed_dtypes(self.model)
            ):
                raise  # check_trainer retries under autocast, or says to declare it
            raise PrivgradError(_model_failed(x, e)) from e
        base_drawn, drew = self.drawn, self.drew
        try:
            base_losses = self.losses(base, y)
        except (RuntimeError, IndexError, ValueError, TypeError) as e:
            raise PrivgradError(_loss_failed(base, y, e)) from e
        finite = _finite_rows(base, B) & torch.isfinite(base_losses.detach())
        if not bool(finite.all()):
            # a non-finite example (NaN, inf or an overflow) poisons sums over the batch (its
            # zero-weighted gradient is NaN): probe the finite ones (the engine handles the rest)
            if not bool(finite.any()):
                return
            keep = finite.nonzero().flatten()
            x, y = take(x, keep), y[keep]
            if len(y) == 1:
                x, y = cat([x, x]), torch.cat([y, y])
            self.x, self.y, self.B = x, y, len(y)
            return self.run()
        self.check_loss(_detach(base), y, base_losses.detach())

        # 1 (and 5): example 0 replaced by another real example
        r = self.other(0)
        x1, y1 = copy_example(x, 0, r), copy_example(y, 0, r)
        out1, buffers1 = self.forward(x1, grad=bool(self.params))
        what = "example 0 of the probe batch was replaced by another example"
        perturbed = perturb_example(x, 0, torch.Generator().manual_seed(SEED + 3))
        if not _same_host_state(base_drawn, self.drawn) and perturbed is not None:
            # the forward draws from NumPy's or Python's RNG as much as each example's inputs
            # ask (SpecAugment over padded audio: each example's masks in turn, sized by its
            # attention_mask), so another example moves the others' draws, which this cannot
            # tell from mixing; example 0's floating inputs perturbed instead keep its draws
            x1, y1 = perturbed, y
            out1, buffers1 = self.forward(x1, grad=bool(self.params))
            what = "example 0's floating inputs were perturbed (its draws kept)"
        losses1 = self.losses(out1, y1)
        device = device_of(x)
        rest = torch.arange(1, B, device=device)
        self.compare_outputs(base, out1, rest, rest, what, x, x1)
        self.compare_losses(base_losses, losses1, rest, rest, what)
        self.compare_buffers(base_buffers, buffers1)
        self.compare_gradients(base_losses, losses1, what)

        # 2: the last example perturbed
        j = B - 1
        x2, y2 = perturb_example(x, j, torch.Generator().manual_seed(SEED)), y
        if x2 is None:  # no floating input (token ids): another example instead
            r = self.other(j)
            x2, y2 = copy_example(x, j, r), copy_example(y, j, r)
        out2, _ = self.forward(x2)
        rest = torch.arange(0, B - 1, device=device)
        what = f"example {j} of the probe batch was perturbed"
        self.compare_outputs(base, out2, rest, rest, what, x, x2)
        self.compare_losses(base_losses, self.losses(out2, y2), rest, rest, what)

        if drew:  # a random layer (nn.Dropout is off here) may mix at some draws only
            for seed in range(SEED + 100, SEED + 100 + DRAWN_SEEDS):
                self.same_layout(seed)

        # 3 and 4 change the batch layout, so a random layer's draws move between examples:
        # they run with another seed, and a mismatch counts only if the model is deterministic
        keep = torch.arange(1, B, device=device)
        out3, buffers3 = self.forward(take(x, keep), seed=SEED + 1)
        perm = torch.arange(B - 1, -1, -1, device=device)
        out4, _ = self.forward(take(x, perm), seed=SEED + 1)
        again_buffers = None
        if not (
            _close_tree(base, out3, keep, keep - 1, self.tol, B, B - 1)[0]
            and _close_tree(base, out4, perm, torch.arange(B, device=device), self.tol, B, B)[0]
        ):
            again, again_buffers = self.forward(x, seed=SEED + 1)
            if not _close_tree(base, again, slice(None), slice(None), self.tol, B, B)[0]:
                self.check_removal_buffers(x, base_buffers, buffers3, again_buffers)
                # stochastic beyond nn.Dropout (F.dropout): the layout checks run in eval mode
                self.model.eval()
                base = self.reproducible(x)
                if base is not None:
                    self.compare_layouts(base, keep, perm)
                return  # (random in eval mode too: layout checks cannot tell)
        self.compare_layouts(base, keep, perm, out3, out4)
        self.check_removal_buffers(x, base_buffers, buffers3, again_buffers)

    def same_layout(self, seed: int) -> None:
        """Checks 1 and 2 (outputs and losses) under ``seed``, for a model whose forward draws
        random numbers beyond nn.Dropout's: a MixUp of hidden states (manifold mixup) on 30 %
        of batches drew no mixing at :data:`SEED` and passed, though it moves the clipped sum
        by more than C where it mixes."""
        x, y, B = self.x, self.y, self.B
        device = device_of(x)
        why = f" (under seed {seed}: the model draws random numbers, and may mix at some draws)"
        base, _ = self.forward(x, seed=seed)
        base_drawn, base_losses = self.drawn, self.losses(base, y)
        r = self.other(0)
        x1, y1 = copy_example(x, 0, r), copy_example(y, 0, r)
        out1, _ = self.forward(x1, seed=seed)
        what = "example 0 of the probe batch was replaced by another example" + why
        perturbed = perturb_example(x, 0, torch.Generator().manual_seed(SEED + 3))
        if not _same_host_state(base_drawn, self.drawn) and perturbed is not None:
            x1, y1 = perturbed, y  # (as check 1 does: its draws kept)
            out1, _ = self.forward(x1, seed=seed)
            what = "example 0's floating inputs were perturbed (its draws kept)" + why
        rest = torch.arange(1, B, device=device)
        self.compare_outputs(base, out1, rest, rest, what, x, x1)
        self.compare_losses(base_losses, self.losses(out1, y1), rest, rest, what)
        j = B - 1
        x2, y2 = perturb_example(x, j, torch.Generator().manual_seed(SEED)), y
        if x2 is None:
            r = self.other(j)
            x2, y2 = copy_example(x, j, r), copy_example(y, j, r)
        out2, _ = self.forward(x2, seed=seed)
        rest = torch.arange(0, B - 1, device=device)
        what = f"example {j} of the probe batch was perturbed" + why
        self.compare_outputs(base, out2, rest, rest, what, x, x2)
        self.compare_losses(base_losses, self.losses(out2, y2), rest, rest, what)

    def reproducible(self, x):
        """The outputs of ``x`` in the model's mode now, if another seed gives the same (it
        draws nothing beyond nn.Dropout's, or nothing at all); else None."""
        base, _ = self.forward(x)
        again, _ = self.forward(x, seed=SEED + 1)
        B = rows(x)
        return (
            base if _close_tree(base, again, slice(None), slice(None), self.tol, B, B)[0] else None
        )

    def compare_layouts(self, base, keep, perm, out3=None, out4=None) -> None:
        """Checks 3 and 4: the outputs and losses of the probe batch without example 0
        (``keep``) and reversed (``perm``), ``out3`` and ``out4`` (run here if None), against
        ``base``'s; then without each other example in turn."""
        x, y, B = self.x, self.y, self.B
        if out3 is None:
            out3, _ = self.forward(take(x, keep), seed=SEED + 1)
            out4, _ = self.forward(take(x, perm), seed=SEED + 1)
        base_losses = self.losses(base, y)
        what = "example 0 was removed from the probe batch"
        self.compare_outputs(base, out3, keep, keep - 1, what, x, take(x, keep))
        self.compare_losses(base_losses, self.losses(out3, y[keep]), keep, keep - 1, what)
        what = "the probe batch was reversed"
        order = torch.arange(B, device=device_of(x))
        self.compare_outputs(base, out4, perm, order, what, x, take(x, perm))
        self.compare_losses(base_losses, self.losses(out4, y[perm]), perm, order, what)
        # and each other example removed: the batch's longest (a model trimming the padding
        # all rows share) or largest may be any of them, and replacing one need not move it
        for k in range(1, B):
            rest = torch.tensor([i for i in range(B) if i != k], device=device_of(x))
            out, _ = self.forward(take(x, rest), seed=SEED + 1)
            what = f"example {k} was removed from the probe batch"
            self.compare_outputs(base, out, rest, order[: B - 1], what, x, take(x, rest))
            self.compare_losses(base_losses, self.losses(out, y[rest]), rest, order[: B - 1], what)

    def check_removal_buffers(self, x, base: dict, removed: dict, again: dict | None) -> None:
        """A buffer that follows the number of examples (a count of those seen, one sized by
        the batch) is refused: released with the model, it tells the Poisson batches' sizes,
        which the accountant's subsampling keeps secret. ``removed``: the buffers after a
        forward without example 0, at another seed than ``base``'s; ``again``: the whole
        batch's at that seed (None: not run yet), so a buffer that moves with the seed alone
        (random draws) is not taken for one."""
        if self.same_buffers(base, removed):
            return
        if again is None:
            _, again = self.forward(x, seed=SEED + 1)
        if self.same_buffers(base, again):
            self.compare_buffers(base, removed, "example 0 was removed from the probe batch")

    def other(self, j: int) -> int:
        """Another example than ``j``, one that differs from it where possible."""
        for r in list(range(j + 1, self.B)) + list(range(j)):
            if not same_example(self.x, r, j):
                return r
        return (j + 1) % self.B

    def compare_outputs(self, a, b, ia, ib, what: str, xa, xb) -> None:
        ok, diff, scale = _close_tree(a, b, ia, ib, self.tol, rows(xa), rows(xb))
        if ok:
            return
        where = self.first_mixing_layer(xa, xb, ia, ib)
        raise PrivgradError(
            f"the model mixes the examples of a batch: when {what}, the outputs of the "
            f"other examples changed (by {diff:.2g}, tolerance {self.tol * scale:.2g}){where}, "
            f"{ADVICE}{self.host_draws_hint(xa, xb)}"
        )

    def host_draws_hint(self, xa, xb) -> str:
        """A note when the two forwards, seeded alike, drew different amounts from NumPy's or
        Python's global RNG: then each example's random draws depend on the others' inputs
        (Wav2Vec2's SpecAugment draws each example's masks in turn, as many as its
        attention_mask's length asks), which this check cannot tell from mixing."""
        try:
            self.forward(xa)
            drawn_a = self.drawn
            self.forward(xb)
            drawn_b = self.drawn
        except Exception:  # noqa: BLE001 (a diagnosis only)
            return ""
        if drawn_a is None or drawn_b is None or _same_host_state(drawn_a, drawn_b):
            return ""
        return (
            ". The model's forward drew a different number of values from NumPy's or "
            "Python's global RNG for the two batches (in train mode, seeded alike), so the "
            "other examples' random draws moved with the changed example: a speech model's "
            "SpecAugment does this when the batch carries an attention_mask (each example's "
            "masks are drawn in turn, sized by its length). privgrad perturbs an example's "
            "floating inputs instead where that keeps the draws, and could not here (token "
            "ids only, or draws that follow the values); train it with SpecAugment off "
            "(config.mask_time_prob = config.mask_feature_prob = 0, or "
            "apply_spec_augment=False) or without the attention_mask (models with "
            "feat_extract_norm='group' are used without one)"
        )

    def compare_losses(self, a, b, ia, ib, what: str) -> None:
        ok, diff, scale = _close_tree(a.detach(), b.detach(), ia, ib, self.tol)
        if not ok:
            raise PrivgradError(
                f"the per-sample losses mix the examples of a batch: when {what}, the losses "
                f"of the other examples changed (by {diff:.2g}, tolerance {self.tol * scale:.2g}), "
                f"{LOSS_ADVICE}"
            )

    def _same_buffer(self, ta, tb) -> bool:
        return (
            isinstance(ta, torch.Tensor)
            and isinstance(tb, torch.Tensor)
            and ta.shape == tb.shape
            and _close_tree(
                ta.reshape(1, -1), tb.reshape(1, -1), slice(None), slice(None), self.tol
            )[0]
        )

    def same_buffers(self, a: dict, b: dict) -> bool:
        return all(self._same_buffer(a.get(n), b.get(n)) for n in set(a) | set(b))

    def compare_buffers(self, a: dict, b: dict, removed: str | None = None) -> None:
        for name in sorted(set(a) | set(b)):
            if self._same_buffer(a.get(name), b.get(name)):
                continue
            if removed is not None:
                raise PrivgradError(
                    f"buffer '{name}' changes with the number of examples in the batch in train "
                    f"mode ({removed}): it follows the Poisson batches' sizes (a count of the "
                    "examples seen, a buffer sized by the batch), which the accountant's "
                    "subsampling keeps secret, and would be released with the model without "
                    "noise; count steps, not examples, or keep such state outside the model's "
                    "buffers"
                )
            raise PrivgradError(
                f"buffer '{name}' is updated from the training data in train mode (a running "
                "statistic of the batch) and would be released with the model without noise; "
                "use layers without running statistics (e.g. track_running_stats=False)"
            )

    def compare_gradients(self, losses_a, losses_b, what: str) -> None:
        """The untouched examples' gradient sum must not see example 0 (backward-only mixing)."""
        if not (self.params and losses_a.requires_grad and losses_b.requires_grad):
            return
        w = torch.ones(self.B, device=losses_a.device, dtype=losses_a.dtype)
        w[0] = 0
        rest_a = (losses_a * w).sum()
        ga = torch.autograd.grad(rest_a, self.params, allow_unused=True, retain_graph=True)
        repeat = torch.autograd.grad(rest_a, self.params, allow_unused=True)
        gb = torch.autograd.grad((losses_b * w).sum(), self.params, allow_unused=True)
        used = [i for i in range(len(ga)) if ga[i] is not None or gb[i] is not None]
        if not used:
            return
        flat_a, flat_repeat, flat_b = (_flat(grads, ga, gb, used) for grads in (ga, repeat, gb))
        largest, _ = _finite_max_abs(flat_a)
        scale = max(largest if largest is not None else 0.0, torch.finfo(flat_a.dtype).tiny)
        rerun = float((flat_repeat.double() - flat_a.double()).abs().nan_to_num(0.0).max())
        tol = max(self.tol, min(REPEAT_MARGIN * rerun / scale, MIXING))
        ok, diff, scale = _close_tree(flat_a[None], flat_b[None], slice(None), slice(None), tol)
        if not ok:
            raise PrivgradError(
                f"the model mixes the examples of a batch in its backward pass: when {what}, "
                f"the other examples' outputs stayed but their gradients changed (by {diff:.2g}, "
                f"tolerance {tol * scale:.2g}; the same backward run twice differed by "
                f"{rerun:.2g}; a custom autograd function or a detach trick?), {ADVICE}"
            )

    def check_loss(self, out, y, losses) -> None:
        """``loss_fn`` alone, on the model's outputs: each loss depends on its own row only."""
        B, dev = self.B, y.device
        leaves, _ = tree_flatten(out)
        if not any(_batch_float(t, B) for t in leaves):
            return
        g = torch.Generator().manual_seed(SEED + 2)

        def perturbed(t):
            if not _batch_float(t, B):
                return t
            noise = torch.randn(t[0].shape, generator=g, dtype=t.dtype).to(t.device)
            return _replace(t, 0, t[0] + 3 * (t.abs().max() + 1) * noise)

        y0 = _replace(y, 0, y[self.other_label(0)])
        rest = torch.arange(1, B, device=dev)
        self.compare_losses(
            losses,
            self.losses(_map(out, perturbed), y0, "perturbed outputs"),
            rest,
            rest,
            "loss_fn's input row 0 was perturbed",
        )
        keep = torch.arange(1, B, device=dev)
        self.compare_losses(
            losses,
            self.losses(_map(out, lambda t: _rows(t, keep, B)), y[keep], "a sub-batch"),
            keep,
            keep - 1,
            "a row was removed from loss_fn's input",
        )
        perm = torch.arange(B - 1, -1, -1, device=dev)
        self.compare_losses(
            losses,
            self.losses(_map(out, lambda t: _rows(t, perm, B)), y[perm], "reversed rows"),
            perm,
            torch.arange(B, device=dev),
            "loss_fn's input rows were reversed",
        )
        # backward: the other examples' losses must have no gradient with respect to row 0
        leaves, spec = tree_flatten(out)
        inputs = [k for k, t in enumerate(leaves) if _batch_float(t, B)]
        for k in inputs:
            leaves[k] = leaves[k].detach().requires_grad_()
        with torch.enable_grad():
            again = self.losses(spec.unflatten(leaves), y)
        if not again.requires_grad:
            return
        w = torch.ones(B, device=again.device, dtype=again.dtype)
        w[0] = 0
        grads = torch.autograd.grad(
            (again * w).sum(), [leaves[k] for k in inputs], allow_unused=True
        )
        for grad in grads:
            if grad is None:
                continue
            row0 = float(grad[0].abs().max())
            scale = max(float(grad[1:].abs().max()), torch.finfo(grad.dtype).tiny)
            if not row0 <= self.tol * scale:
                raise PrivgradError(
                    "the per-sample losses mix the examples of a batch: the other examples' "
                    f"losses have a gradient with respect to example 0's output (up to {row0:.2g}, "
                    f"tolerance {self.tol * scale:.2g}; a batch statistic in loss_fn?), "
                    f"{LOSS_ADVICE}"
                )

    def other_label(self, j: int) -> int:
        for r in range(self.B):
            if r != j and not torch.equal(self.y[r], self.y[j]):
                return r
        return j

    def first_mixing_layer(self, xa, xb, ia, ib) -> str:
        """', first at layer NAME (Type)': the first module, in call order, whose output
        rows differ; empty if it cannot be told."""
        try:
            rec_a, rec_b = [], []
            self.forward(xa, record=rec_a)
            self.forward(xb, record=rec_b)
        except Exception:  # noqa: BLE001 (a diagnosis only)
            return ""
        names = {m: n for n, m in self.model.named_modules()}
        for (ma, oa), (mb, ob) in zip(rec_a, rec_b):
            if ma is not mb:
                return ""
            if not _close_tree(oa, ob, ia, ib, self.tol, rows(xa), rows(xb))[0]:
                return f", first at layer '{names.get(ma) or '(the model)'}' ({type(ma).__name__})"
        return ""


# -- helpers -----------------------------------------------------------------------------
def _forked_rng(model: nn.Module, device: torch.device, seed: int | None = None):
    """:class:`~privgrad.per_sample.held_generators.forked` with the generators ``model``
    holds: a model drawing from NumPy (Wav2Vec2's SpecAugment masks) or from a generator of
    its own then draws alike in two forwards, which would otherwise look like examples
    mixed."""
    return held_generators.forked(held_generators.held_generators(model), device, seed)


def _same_host_state(a: tuple, b: tuple) -> bool:
    """Whether two (Python, NumPy) global RNG states are the same."""
    (py_a, np_a), (py_b, np_b) = a, b
    return py_a == py_b and all(
        np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v for u, v in zip(np_a, np_b)
    )


def _has_lazy(model: nn.Module) -> bool:
    return any(nn.parameter.is_lazy(t) for t in list(model.parameters()) + list(model.buffers()))


def _replace(t: torch.Tensor, j: int, row: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[j] = row
    return t


def _described(t) -> str:
    if isinstance(t, torch.Tensor):
        text = f"shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}"
        if t.numel() and not t.is_floating_point() and not t.is_complex():
            text += f", values {int(t.min())}..{int(t.max())}"
        return text
    return type(t).__name__


def _loss_failed(out, y, error: Exception) -> str:
    """What a ``loss_fn`` that raised on the probe's first outputs is told: torch's error
    (``Target 5 is out of bounds``, ``expected target dtype to be Long``) names neither the
    loss privgrad called nor how to pass another one."""
    logits = getattr(out, "logits", out.get("logits") if isinstance(out, dict) else out)
    first = str(error).splitlines()[0].rstrip(".") if str(error) else ""
    return (
        f"loss_fn failed on the model's output ({_described(logits)}) and the labels "
        f"({_described(y)}) of the first training examples (the check before training): "
        f"{type(error).__name__}: {first}. The "
        "default loss_fn is cross-entropy: one logit per class, labels integer class indices "
        "in [0, classes); for another loss (one logit with float binary labels, regression) "
        "pass loss_fn= returning one loss per example (reduction='none')"
    )


def _model_failed(x, error: Exception) -> str:
    """What a model that raised on the probe's first batch is told: torch's error (``mat1 and
    mat2 shapes cannot be multiplied``) comes from inside privgrad's check, and is most often
    inputs of another shape than the model takes (images flattened to the wrong width)."""
    first = str(error).splitlines()[0].rstrip(".") if str(error) else ""
    if isinstance(x, dict):
        inputs = ", ".join(f"{k}: {_described(v)}" for k, v in x.items())
    elif isinstance(x, (tuple, list)):
        inputs = ", ".join(_described(v) for v in x)
    else:
        inputs = _described(x)
    hint = (
        ". Check that the inputs have the shape the model takes (the batch first, then one "
        "example's shape: a Linear's in_features is the width of what reaches it, e.g. 784 "
        "for 1 × 28 × 28 images flattened from dimension 1)"
        if _SHAPE_ERROR.search(first)
        else " (the model's own forward, run on these inputs as a training step runs it)"
    )
    return (
        f"the model failed on the first batch of training examples ({rows(x)} examples, "
        f"inputs {inputs}), in the check make_private and attach run before training: "
        f"{type(error).__name__}: {first}{hint}"
    )


# torch's errors for a tensor of another shape than an operation takes
_SHAPE_ERROR = re.compile(r"shape|size|dimension|cannot be multiplied", re.IGNORECASE)


def _finite_rows(tree, B: int) -> torch.Tensor:
    """(B,) bool: the rows whose every batch-first float output is finite."""
    ok = None
    for t in tree_flatten(tree)[0]:
        if _batch_float(t, B):
            rows = torch.isfinite(t.detach()).reshape(B, -1).all(1)
            ok = rows if ok is None else ok & rows
    return ok if ok is not None else torch.ones(B, dtype=torch.bool)


def _batch_float(t, B: int) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 and len(t) == B


def _rows(t, idx, B):
    return t[idx] if isinstance(t, torch.Tensor) and t.dim() and len(t) == B else t


def _map(tree, fn):
    leaves, spec = tree_flatten(tree)
    return spec.unflatten([fn(t) for t in leaves])


def _copy(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _detach(tree):
    return _map(tree, lambda t: t.detach() if isinstance(t, torch.Tensor) else t)


def _finite_max_abs(t: torch.Tensor) -> tuple[float | None, bool]:
    """The largest absolute finite value of floating ``t`` (as a float, exact; None if it has
    none), and whether every entry is finite: reductions in ``t``'s own dtype where every entry
    is finite (abs and max are exact in any dtype), the masked one in float64 otherwise."""
    if t.numel() == 0:
        return None, True
    size = t.abs()
    if bool(torch.isfinite(size.sum())):  # a NaN or ±inf entry makes the sum NaN or inf
        return float(size.amax()), True
    finite = t.double().abs()
    finite = finite[torch.isfinite(finite)]
    return (float(finite.max()) if finite.numel() else None), False


def _finite(t: torch.Tensor, norm: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite, given its norm: a finite norm says so (a NaN or
    ±inf entry makes the norm NaN or inf), else each entry is looked at (a float32 norm can
    overflow where every entry is finite)."""
    return bool(torch.isfinite(norm)) or bool(torch.isfinite(t).all())


def _flat(grads, ga, gb, used: list[int]) -> torch.Tensor:
    """``grads`` (one of ``ga``, ``gb`` or a rerun of ``ga``) at the parameters ``used`` as one
    vector; a parameter one side left unused counts as zeros of the other's shape."""
    return torch.cat(
        [
            (
                grads[i]
                if grads[i] is not None
                else torch.zeros_like(ga[i] if ga[i] is not None else gb[i])
            ).flatten()
            for i in used
        ]
    )


def _close_tree(
    a, b, ia, ib, tol: float, na: int | None = None, nb: int | None = None
) -> tuple[bool, float, float]:
    """Whether every batch-first tensor leaf of ``a`` at rows ``ia`` equals ``b``'s at rows
    ``ib`` within ``tol`` × the leaf's largest absolute finite value in ``a``; also the
    largest difference and that scale (of the first leaf that differs). With batch sizes
    ``na`` and ``nb``, leaves whose first dimension is not the batch are left out."""
    la, _ = tree_flatten(a)
    lb, _ = tree_flatten(b)
    if len(la) != len(lb):
        return False, float("inf"), 1.0
    for ta, tb in zip(la, lb):
        if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)):
            continue
        if ta.dim() == 0 or tb.dim() == 0:
            continue
        if na is not None and (len(ta) != na or len(tb) != nb):
            continue
        ra, rb = ta.detach()[ia], tb.detach()[ib]
        if ra.shape != rb.shape:
            return False, float("inf"), 1.0
        if not ra.is_floating_point():
            if not torch.equal(ra, rb):
                return False, float("inf"), 1.0
            continue
        largest, all_finite = _finite_max_abs(ta.detach())
        scale = max(largest if largest is not None else 0.0, torch.finfo(ta.dtype).tiny)
        ra, rb = ra.double(), rb.double()
        if all_finite:
            # every entry of ``ta`` (so of ``ra``) finite: where ra == rb, |ra − rb| is 0, and
            # no entry is NaN on both sides, so the masked difference below is |ra − rb|
            diff = (ra - rb).abs_()
        else:
            same = (ra == rb) | (torch.isnan(ra) & torch.isnan(rb))
            diff = torch.where(same, torch.zeros_like(ra), (ra - rb).abs())
        worst = float(diff.max()) if diff.numel() else 0.0
        if not worst <= tol * scale:  # NaN where only one side is NaN: not close
            return False, worst, scale
    return True, 0.0, 1.0


__all__ = [
    "check_example_independence",
    "check_recollated",
    "check_trainer",
    "MAX_PROBE",
    "TOL",
]
