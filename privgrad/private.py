"""The training-step engine and the ``make_private`` entry point.

``make_private`` wires a model, an optimizer and a training set to a mechanism: it
Poisson-samples batches, computes per-sample gradients, runs the mechanism's chain,
hands the private update to the optimizer, and records one privacy event per step.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from torch import nn

from privgrad.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    validate_delta,
    validate_epsilon,
)
from privgrad.accounting.events import step_events
from privgrad.accounting.ledger import (
    check_pld_size,
    decode_entries,
    encode_entries,
    encode_event,
)
from privgrad.accounting.pure_dp import calibrate_with_pure_dp, composed_epsilon
from privgrad.batches import Batch, DatasetSource, training_source
from privgrad.data_checks import check_copies, check_items, check_standardised
from privgrad.device import resolve_device
from privgrad.distributed import Distributed
from privgrad.errors import DataError, PrivgradError, warn_user
from privgrad.graphed import GraphedSteps, why_not_graphed
from privgrad.held_state import loss_holders, plain_tensors, tensor_change, tensor_state
from privgrad.inputs import rows, take, tensors_in, to_device
from privgrad.mechanisms import Mechanism, NoiseRecord, build_mechanism
from privgrad.mechanisms.stages import NonFiniteGradients, PlanContext, StepFacts
from privgrad.per_sample import EngineFlags, GradSampler
from privgrad.per_sample.independence import check_trainer
from privgrad.sampling import PoissonSampler
from privgrad.seeds import generator, secret_seed, seed_source, validate_seed
from privgrad.signals import deferred_interrupts
from privgrad.validate import MAX_STEPS

NEIGHBOURING = "add/remove one example (Poisson sampling)"
DISJOINT = "disjoint"  # make_private(prior="disjoint"): the new data shares no example


@dataclass(frozen=True)
class Prior:
    """The privgrad run a model's weights came from, and how it counts in this run's ε
    (``make_private``'s ``prior=``): ``composed``, its events (``entries``, ``claimed_entries``)
    are composed with this run's, the weights' ε on data the runs may share; else the user
    stated that this run's data shares no example with that run's, whose ε stays in its own
    record (``source``'s)."""

    source: str | None = None  # that run's weights file
    composed: bool = False
    entries: tuple = ()
    claimed_entries: tuple = ()
    epsilon: float | None = None  # as that run's record gives it
    # the model held exactly the weights of ``source``'s record when make_private checked it
    # (their fingerprint): the private steps they took under an earlier trainer of this
    # process are that record's, so a new trainer on the same model is not refused for them
    weights_recorded: bool = False
    # not composed ("disjoint"): that run's events (and those of the runs before it), kept in
    # this run's record so that a later run composing it (prior=PATH, on data that may share
    # examples with any of them) counts them too
    disjoint_entries: tuple = ()
    disjoint_claimed_entries: tuple = ()

    def record(self) -> dict:
        if self.source is None:
            return {}
        how = (
            "composed: this record's ε counts that run's steps"
            if self.composed
            else "not composed: the user stated this run's training data shares no example "
            "with that run's, whose ε is in its own record"
        )
        return {"prior": {"weights": self.source, "epsilon": self.epsilon, "how": how}}

    def state(self) -> dict | None:
        if self.source is None:
            return None
        state = {
            "source": self.source,
            "epsilon": self.epsilon,
            "composed": self.composed,
            "entries": encode_entries(self.entries),
            "claimed_entries": encode_entries(self.claimed_entries),
        }
        if self.disjoint_entries or self.disjoint_claimed_entries:
            state["disjoint_entries"] = encode_entries(self.disjoint_entries)
            state["disjoint_claimed_entries"] = encode_entries(self.disjoint_claimed_entries)
        return state

    @classmethod
    def from_state(cls, state: dict) -> "Prior":
        """Inverse of :meth:`state`."""

        def dec(key):
            return decode_entries(state.get(key, []))

        return cls(
            source=state["source"],
            epsilon=state.get("epsilon"),
            composed=bool(state["composed"]),
            entries=dec("entries"),
            claimed_entries=dec("claimed_entries"),
            disjoint_entries=dec("disjoint_entries"),
            disjoint_claimed_entries=dec("disjoint_claimed_entries"),
        )

    def disjoint_record(self) -> dict:
        """The events of earlier runs on data this run's shares no example with (as the
        privacy record keeps them): composed by a later run's ``prior=PATH``."""
        if not (self.disjoint_entries or self.disjoint_claimed_entries):
            return {}
        return {
            "disjoint_prior_events": encode_entries(self.disjoint_entries),
            "claimed_disjoint_prior_events": encode_entries(self.disjoint_claimed_entries),
        }


def trained_parameters(model: nn.Module) -> list[str]:
    """The names (``state_dict``'s) of ``model``'s parameters that require gradients: those
    private steps change, which a privacy record lists, so that a layer copied from weights
    :func:`privgrad.model_file.load_model` read is known for trained (and a frozen public
    base, such as a LoRA model's, is not)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def events_record(prior: "Prior", entries, claimed_entries) -> dict:
    """The entries of a privacy record that say which privacy events its weights carry: the
    events its ε counts (a composed prior run's, then this run's ``entries``; honest and
    claimed), that prior run and how it counts, and the events of earlier runs on data stated
    to share no example with this run's (:meth:`Prior.disjoint_record`), which a later run
    composing these weights counts too. Every writer of a privacy record (the trainer's
    ``save_model``, ``privgrad train --save-model``, ``privgrad export``) uses it, so a record
    of weights continued with ``prior=`` never forgets the earlier run."""
    return {
        "privacy_events": encode_entries([*prior.entries, *entries]),
        "claimed_privacy_events": encode_entries([*prior.claimed_entries, *claimed_entries]),
        **prior.record(),
        **prior.disjoint_record(),
    }


def _same_prior(saved: dict | None, own: dict | None) -> bool:
    """Whether a trainer state's prior (:meth:`Prior.state`) is this trainer's: the same events,
    composed or not; the path it was named by (relative or absolute, the weights or their
    ``.privacy.json``) does not count."""
    if saved is None or own is None:
        return saved is own
    if not isinstance(saved, dict):
        return False
    told = ("source", "epsilon")  # what the user was told, not what ε counts
    return {k: v for k, v in saved.items() if k not in told} == {
        k: v for k, v in own.items() if k not in told
    }


NO_PRIOR = Prior()


# the models of this process's trainers (a model's trainer notes its steps on it): a new model
# holding one's trained weights, copied into it, is one that model's ε must count
_TRAINED_MODELS: weakref.WeakSet = weakref.WeakSet()


def _copy_of_trained(model: nn.Module) -> int | None:
    """The private steps of another live model of this process's trainers whose weights (every
    state_dict entry) ``model`` holds now, or None: a copy's new run would count from zero."""
    state = None
    for other in list(_TRAINED_MODELS):
        ledger = getattr(other, "_privgrad_ledger", None)
        if other is model or not isinstance(ledger, PrivacyLedger) or ledger.steps == 0:
            continue
        state = model.state_dict() if state is None else state
        theirs = other.state_dict()
        if theirs.keys() == state.keys() and all(
            isinstance(t, torch.Tensor)
            and t.shape == state[k].shape
            and t.dtype == state[k].dtype
            and torch.equal(t.detach().cpu(), state[k].detach().cpu())
            for k, t in theirs.items()
        ):
            return ledger.steps
    return None


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_SKETCH_CHUNK = 256  # steps whose sketches stay on the device before moving to the CPU


def _sketches(tensors) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns (wrapping), the same for
    equal tensors on any device and in any layout, and for unequal ones a coincidence."""
    out = []
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        out.append(t.view(_BITS[t.element_size()]).sum(dtype=torch.int64))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([o.to(out[0].device) for o in out])  # a model split across devices too


class _TrainedValues:
    """The values a trainer's trainable parameters held after each of its private steps, as
    :func:`_sketches`: a model that holds one of them when a new run starts (a ``state_dict``
    snapshot of an earlier step loaded into a fresh model, one layer's weights copied) carries
    that many steps, which the new run's ε would not count. ``trained_from``: the values the
    parameters start from carry steps too (a resumed run's, weights given with ``prior=``,
    weights :func:`privgrad.model_file.load_model` read), named so; else they are left out,
    as a fresh model's initial values."""

    def __init__(self, params, trained_from: str | None = None):
        self.shapes = [(tuple(p.shape), p.dtype) for p in params]
        self._device: list[tuple[int, torch.Tensor]] = []  # (step, sketches) not yet moved
        self._steps: list[int] = []
        self._host: list[torch.Tensor] = []
        self.trained_from = trained_from
        if trained_from is None:
            self.initial = _sketches(params).cpu()  # untrained values carry no step
        else:
            self.initial = torch.zeros(len(self.shapes), dtype=torch.int64)
            self.record(0, params)

    def record(self, step: int, params) -> None:
        self._device.append((step, _sketches(params)))
        if len(self._device) >= _SKETCH_CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._device:
            self._steps += [s for s, _ in self._device]
            self._host.append(torch.stack([v for _, v in self._device]).cpu())
            self._device = []

    def held(self, shape, sketch: int) -> str | None:
        """Where a parameter of ``shape`` (and dtype) held a value of ``sketch`` that carries
        private steps (after a step, or trained before it started), or None."""
        self._flush()
        if not self._host:
            return None
        table = torch.cat(self._host)
        self._host = [table]
        for i, (held, initial) in enumerate(zip(self.shapes, self.initial.tolist())):
            if held != shape or (self.trained_from is None and sketch == initial):
                continue
            rows = (table[:, i] == sketch).nonzero()
            if len(rows):
                step = self._steps[int(rows[-1])]
                if step == 0:
                    return self.trained_from
                return f"another model of this process held after its private step {step}"
        return None


# every trainer's _TrainedValues, kept after it is gone (a snapshot outlives its trainer)
_TRAINED_VALUES: list[_TrainedValues] = []


def note_loaded_values(tensors: list, source: str) -> None:
    """Notes the trained tensors of weights read from ``source``
    (:func:`privgrad.model_file.load_model`) that took private steps: a model given any of
    them (a backbone copied into a new model) is refused at its first step as one holding
    trained values."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if tensors:
        _TRAINED_VALUES.append(_TrainedValues(tensors, f"the weights read from {source} held"))


def _trained_adapter(model: nn.Module) -> str | None:
    """The name of a trainable peft LoRA weight of ``model`` that peft's initialisation starts
    at zero (``lora_B``; an embedding's ``lora_embedding_A``, whose B starts random) and that
    is not zero, or None: adapters read back by ``PeftModel.from_pretrained`` in a new process
    carry no mark privgrad can see, and a run on them counted ε from zero (4 steps at σ = 1
    printed ε = 4.21, where composing the run that trained them gives 5.46). Only LoRA adapters
    whose ``init_lora_weights`` is True (the default) or 'gaussian' are looked at: the others
    (PiSSA, OLoRA, LoftQ, EVA, False) and other peft methods (AdaLoRA's B starts random) may
    start non-zero."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    for name, module in model.named_modules():
        for attr in ("lora_B", "lora_embedding_A"):
            held = getattr(module, attr, None)
            if not isinstance(held, (nn.ModuleDict, nn.ParameterDict)):
                continue
            for adapter, part in held.items():
                weight = part.weight if isinstance(part, nn.Module) else part
                config = configs.get(adapter)
                init = getattr(config, "init_lora_weights", None)
                kind = getattr(config, "peft_type", None)
                if getattr(kind, "value", kind) != "LORA":
                    continue
                if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
                    continue
                if not (init is True or init == "gaussian"):  # inits that start it at zero
                    continue
                if bool(weight.detach().ne(0).any()):
                    return f"{name}.{attr}.{adapter}"
    return None


def _holds_trained_values(model: nn.Module, own) -> tuple[str, str] | None:
    """A parameter of ``model`` (trainable or not) holding a value that carries another
    run's private steps (a parameter of another trainer of this process, not ``own``, after
    one of its steps, or weights privgrad read from a privacy record), and where it was held;
    or None."""
    if not any(h is not own and h._steps + h._device for h in _TRAINED_VALUES):
        return None
    named = []
    for name, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedTensorMixin) or p.is_meta or not p.numel():
            continue
        try:  # a frozen tensor of a kind whose bits cannot be viewed (quantized) is left out
            named.append((name, p, int(_sketches([p])[0])))
        except (RuntimeError, KeyError, TypeError):
            continue
    for name, p, sketch in named:
        for held in _TRAINED_VALUES:
            if held is own:
                continue
            where = held.held((tuple(p.shape), p.dtype), sketch)
            if where is not None:
                return name, where
    return None


def _resolve_prior(model: nn.Module, prior, delta: float) -> Prior:
    """What ``make_private(prior=...)`` makes of the run ``model``'s weights came from. A model
    holding a privgrad run's saved weights (:func:`privgrad.model_file.load_model`, or saved by
    this process) without ``prior=`` is refused: its new ε would count from zero though the
    weights already carry that run's; ``prior=PATH`` (those weights, or their
    ``.privacy.json``) composes that run's events, checked to be the model's weights';
    ``prior="disjoint"`` states the new data shares no example with that run's."""
    from privgrad.model_file import module_fingerprints, read_privacy_record, saved_run_of

    fingerprint_of = module_fingerprints()  # each module hashed once in this call
    found = saved_run_of(model, fingerprint_of)
    if prior is None:
        if found is not None:
            raise PrivgradError(
                f"the model holds the weights privgrad saved to {found}, trained privately "
                "already: a new run's ε would count from zero, while the model carries that "
                f"run's too. Pass prior='{found}' (privgrad train --prior {found}) to compose "
                "that run's privacy events into this run's ε (training on the same or "
                "overlapping data), or prior='disjoint' if this run's training data shares no "
                "example with that run's (resuming that "
                "run from its state_dict: pass prior= the same, or make the trainer before "
                "loading the weights; load_state_dict loads them)"
            )
        return NO_PRIOR
    # ("disjoint", PATH): new data sharing no example with that of the weights whose record
    # PATH is, named where privgrad cannot find it (peft adapters), so that their events stay
    # in this run's record for a later run on data overlapping theirs
    stated = isinstance(prior, (tuple, list)) and len(prior) == 2 and prior[0] == DISJOINT
    if stated:
        found = prior = prior[1]
    if prior == DISJOINT or stated:
        source = str(found) if found is not None else "unknown (stated by the user)"
        if found is None:
            return Prior(source=source, composed=False)
        record = read_privacy_record(found)
        if stated:
            _check_record_is_the_models(record, found, model, fingerprint_of)
        entries, claimed = _record_events(record, found, delta, required=False)
        return Prior(
            source=source,
            composed=False,
            epsilon=record.get("epsilon"),
            disjoint_entries=entries,
            disjoint_claimed_entries=claimed,
            weights_recorded=True,
        )
    if not isinstance(prior, (str, os.PathLike)):
        raise PrivgradError(
            f"prior must be the path of a privgrad model file (or its .privacy.json), "
            f"'disjoint' or ('disjoint', path), got {prior!r}"
        )
    record = read_privacy_record(prior)
    _check_record_is_the_models(record, prior, model, fingerprint_of)
    entries, claimed = _record_events(record, prior, delta, required=True)
    return Prior(
        source=str(prior),
        composed=True,
        entries=entries,
        claimed_entries=claimed,
        epsilon=record.get("epsilon"),
        weights_recorded=True,
    )


def _check_record_is_the_models(record: dict, prior, model: nn.Module, fingerprint_of) -> None:
    """Refuses a privacy record (``prior=``'s) that is not of ``model``'s weights (nor of its
    trained parameters), or whose neighbouring relation is not this run's."""
    from privgrad.model_file import trained_fingerprint

    # the model's weights, or those of the Hugging Face model a wrapper holds (the command
    # line's hf: classifier), whose folder's privacy.json fingerprints them
    held = [
        m for m in (model, getattr(model, "wrapped_pretrained", None)) if isinstance(m, nn.Module)
    ]
    trained, names = record.get("trained_sha256"), record.get("trained_parameters")
    if record.get("weights_sha256") not in {fingerprint_of(m) for m in held} and not (
        # or its trained parameters are the record's (adapters on another copy of their base),
        # hashed only where the whole model's fingerprint differs
        trained is not None
        and any(trained_fingerprint(m.state_dict(), names) == trained for m in held)
    ):
        raise PrivgradError(
            f"the model's weights are not the ones whose privacy record is {prior} "
            + (
                "(their fingerprints differ, and those of the parameters it trained too): load "
                "them first (privgrad.model_file.load_model; adapters: PeftModel.from_pretrained "
                "of the record's folder)"
                if record.get("weights_sha256")
                else "(the record names no weights fingerprint: written by an older privgrad)"
            )
        )
    if record.get("neighbouring", NEIGHBOURING) != NEIGHBOURING:
        raise PrivgradError(
            f"the record {prior} is for neighbours '{record.get('neighbouring')}', this run's "
            f"are '{NEIGHBOURING}': their ε do not compose"
        )


def _record_events(record: dict, where, delta: float, required: bool) -> tuple[tuple, tuple]:
    """The events (honest, claimed) a privacy record's weights carry: its run's
    (``privacy_events``, checked to give the ε it states) and those of earlier runs on data it
    was stated to share no example with (``disjoint_prior_events``: a run composing these
    weights, whose data may share examples with theirs, counts them too; 2.37 where examples
    of the first run had taken 10 steps at σ = 1, ε 2.85). A record without events is refused
    if ``required``, else gives none."""
    if "privacy_events" not in record or "claimed_privacy_events" not in record:
        if not required:
            return (), ()
        raise PrivgradError(
            f"the privacy record {where} holds no privacy events (written by an older privgrad "
            "or from a run record without them), so its ε cannot be composed"
        )
    keys = (
        "privacy_events",
        "claimed_privacy_events",
        "disjoint_prior_events",
        "claimed_disjoint_prior_events",
    )
    try:
        run, run_claimed, disjoint, disjoint_claimed = [
            decode_entries(record.get(key, [])) for key in keys
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise PrivgradError(f"the privacy events in {where} are malformed ({err})") from None
    recorded = record.get("epsilon")
    composed = composed_epsilon(run, record.get("delta", delta), "pld", "best")
    if isinstance(recorded, (int, float)) and not math.isclose(composed, recorded, rel_tol=1e-6):
        raise PrivgradError(
            f"the privacy events in {where} give ε = {composed:.6g}, not the ε = {recorded} its "
            "record states: it was edited, and is not composed"
        )
    entries, claimed = run + disjoint, run_claimed + disjoint_claimed
    return entries, claimed


LM_LOSS_HINT = (
    "loss_fn=lambda logits, ids: F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], "
    "reduction='none').sum(1)"
)


def per_sample_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The default ``loss_fn``: cross-entropy of (B, classes) logits against (B,) labels (or
    (B, classes) class probabilities), one loss per example. Logits of another shape (a
    language model's (B, T, vocabulary)) are refused in one line that says what to pass:
    torch's own error (``Expected target size ...``) names neither ``loss_fn`` nor the fix."""
    if logits.dim() != 2 or not (target.dim() == 1 or target.shape == logits.shape):
        raise PrivgradError(
            f"the default loss_fn is the cross-entropy of (batch, classes) logits against "
            f"(batch,) labels, one loss per example; the model gave logits of shape "
            f"{tuple(logits.shape)} for labels of shape {tuple(target.shape)}: pass a loss_fn "
            "that returns one loss per example (shape (batch,)), e.g. for a language model "
            f"whose labels are its token ids: {LM_LOSS_HINT}"
        )
    return F.cross_entropy(logits, target, reduction="none")


@dataclass
class _Draw:
    """What the trainer remembers of a batch it drew and has not stepped on yet."""

    sampler_state: dict  # the sampler before the draw (state_dict draws it again)
    rows: int  # how many examples the draw picked
    y: torch.Tensor | None = None  # the labels as loaded
    y_version: int = 0  # their version counter then
    x: list | None = None  # the input tensors as loaded, each with its version counter


class PrivateTrainer:
    """Runs private steps on the batches its own Poisson sampler draws, and keeps the
    honest and the paper-claimed privacy ledgers.

    A per-sample gradient that is not finite (a NaN, inf or overflowing input) contributes
    zero: the step is run again without that example, before any noise is drawn. Whether
    an example is dropped depends on it alone, so the sum's sensitivity stays C. Dropped
    examples are counted in :attr:`nonfinite_examples`; ``strict=True`` makes them an error.

    With :attr:`max_physical_batch_size` a drawn batch larger than it is processed in chunks
    of at most that many examples (physical micro-batches): per-sample gradients and the
    stages up to the sum run chunk by chunk, the noise and everything after it once (the
    same step, noise and ε; the clipped sum up to float rounding), so memory is bounded by
    the chunk. A mechanism whose per-sample stages need the whole batch is refused.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data,
        mechanism: Mechanism,
        expected_batch_size: float,
        delta: float,
        seed: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        device: str | torch.device | None = None,
        distributed: Distributed | None = None,
        strict: bool = False,
        flags: EngineFlags | None = None,
        max_physical_batch_size: int | None = None,
        precision: str = "fp32",
        prior: Prior = NO_PRIOR,
    ):
        validate_delta(delta)
        _refuse_earlier_private_steps(model, prior)
        self.model, self.optimizer, self.mechanism, self.delta = model, optimizer, mechanism, delta
        self.data = training_source(data)
        if device is None:
            self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        else:
            self.device = resolve_device(device)
            model.to(self.device)
        _check_optimizer_params(model, optimizer)
        self._trainable = _trainable(model)  # the parameters its per-sample rules follow
        self._mergeable = [(n, m) for n, m in model.named_modules() if hasattr(m, "merged")]
        _refuse_merged_adapters(self._mergeable)
        self.loss_fn = loss_fn or per_sample_cross_entropy
        self.grad_sampler = GradSampler(
            model,
            settle=not mechanism.reads_layer_inputs,
            flags=flags or EngineFlags(),
            precision=precision,
        )
        self.distributed = distributed  # data-parallel: this rank's shard, sums all-reduced
        if distributed is not None:
            distributed.check_same_start(model)  # one model, not one per rank
        self.seed_given = seed is not None  # else a secret one (privgrad.seeds)
        seed = validate_seed(seed) if self.seed_given else secret_seed(distributed)
        self.sampler = (distributed.sampler if distributed else PoissonSampler)(
            len(self.data), expected_batch_size, generator(seed)
        )
        self.seed, self.strict = seed, strict
        self.noise_generator = generator(seed + 1_000_003, self.device)
        self.ledger, self.claimed_ledger = PrivacyLedger(), PrivacyLedger()
        self.prior = prior  # the run the model's weights come from (make_private's prior=)
        self._watched: list | None = None  # buffers no forward may write (make_private sets)
        self._buffer_digests: dict = {}  # their values when first watched
        self._strict_buffers = False  # within step(): a watched buffer written is refused
        self._buffer_fault: str | None = None  # a watched buffer was written: refused
        self._loss_state: dict | None = None  # loss_fn's tensors when make_private checked it
        self._copy_checked = False  # the first step's check for a copy of trained weights
        self._trained_values: _TrainedValues | None = None  # its parameters after each step
        model._privgrad_ledger = self.ledger  # a later trainer on this model sees these steps
        _TRAINED_MODELS.add(model)  # a copy of its weights into another model is seen
        self._layers = tuple(model.modules())  # what make_private's checks covered
        self.last_facts = StepFacts()  # what the last step's stages reported (mask, events, …)
        self.nonfinite_examples = 0  # examples whose per-sample gradient was not finite
        # the run σ was calibrated for (make_private sets them): past it, step() refuses
        self.target_epsilon: float | None = None
        self.planned_steps: int | None = None
        self.planned_sigma: float | None = None
        # (σ, the noise record describe() gave at it): it must not change while σ does not
        self._described: tuple[float, NoiseRecord] | None = None
        self.allow_over_budget = False
        self._issuer = object()  # stamped on this trainer's batches
        self._pending: dict[int, _Draw] = {}  # drawn, not yet stepped, by seq
        self._observers: list[Callable] = []  # add_step_observer
        self._graphed: GraphedSteps | None = None  # flags.cuda_graphs: the captured steps
        self._graph_refusal: str | None = None  # why they are not used (warned once)
        self.max_physical_batch_size = max_physical_batch_size

    @property
    def max_physical_batch_size(self) -> int | None:
        """The most examples whose per-sample gradients a step computes at once (None: the
        whole batch); setting it checks that the mechanism can run in chunks."""
        return self._max_physical_batch_size

    @max_physical_batch_size.setter
    def max_physical_batch_size(self, value: int | None) -> None:
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PrivgradError(
                    f"max_physical_batch_size must be an integer ≥ 1 or None, got {value!r}"
                )
            self.mechanism.chunk_split()  # refuses a chain that needs the whole batch
        self._max_physical_batch_size = value

    @property
    def n_layers(self) -> int:
        return len(self.grad_sampler.units)

    @property
    def sampling_rate(self) -> float:
        return self.sampler.sampling_rate

    @property
    def steps(self) -> int:
        return self.ledger.steps

    def batches(self, steps: int | None = None) -> Iterator[Batch]:
        """Poisson batches, by default one epoch's worth (round(1/q) steps), loaded lazily
        and moved to the trainer's device; :meth:`step` takes each one once."""
        issuer, order = self._issuer, collections.deque()

        def index_lists():
            for _ in range(self.sampler.steps_per_epoch if steps is None else steps):
                # a draw and its record are one: a SIGTERM between them left the sampler a
                # draw ahead of what state_dict saves, and the checkpoint would not load
                with deferred_interrupts():
                    seq, before = self.sampler.draws, self.sampler.state_dict()
                    idx = self.sampler.sample()
                    self._pending[seq] = _Draw(before, len(idx))
                    order.append(seq)
                yield idx

        for x, y in self.data.load(index_lists(), seed=self.sampler.draws):
            seq, y = order.popleft(), y.to(self.device, non_blocking=True)
            x = to_device(x, self.device, non_blocking=True)
            if seq in self._pending:
                draw = self._pending[seq]
                draw.y, draw.y_version = y, y._version
                draw.x = [(t, t._version) for t in tensors_in(x)]
            yield Batch(x, y, seq, issuer)

    def step(self, batch: Batch) -> float:
        """One private step on a batch drawn by :meth:`batches`; returns its mean loss
        (display only). A batch from anywhere else, one used before, or one whose examples
        are not the drawn ones (other rows or labels, e.g. ``dataclasses.replace(batch,
        x=all_x, y=all_y)``) is refused: the ledger records a Poisson-sampled step, which
        only this trainer's sampler makes true. So is a batch whose inputs were changed:
        transform each example where the dataset loads it. Ctrl-C and SIGTERM wait for the
        step to finish."""
        if not isinstance(batch, Batch):
            raise PrivgradError(
                f"step() takes a batch drawn by this trainer's batches(), not a "
                f"{type(batch).__name__}: a hand-made batch is not Poisson-sampled"
            )
        if batch.issuer is not self._issuer:
            raise PrivgradError(
                "this batch was drawn by another trainer (or before load_state_dict)"
            )
        if batch.seq not in self._pending:
            raise PrivgradError(
                f"batch {batch.seq} was already used (or a later batch was): "
                "each drawn batch is used at most once, in order"
            )
        _check_drawn(batch, self._pending[batch.seq])
        self._check_no_skip(batch.seq)
        self._check_model()
        self._check_loss_state()
        self._check_budget()
        self._check_buffers()  # before the forward: a buffer rewritten with its own value is fine
        self._watch_buffers()
        self._strict_buffers = True  # from here to the update, any write to a watched buffer is
        with deferred_interrupts():  # the step's forward's (written and put back: refused too)
            del self._pending[batch.seq]
            return self._step(batch.x, batch.y)

    def _check_no_skip(self, seq: int) -> None:
        """Refuses a step on draw ``seq`` while an earlier draw was not stepped on: skipping a
        drawn batch (say, an empty one) makes which steps run depend on the data, which the
        accountant does not model. Stopping early is fine: an unstepped last draw is drawn
        again after load_state_dict."""
        skipped = [s for s in self._pending if s < seq]
        if skipped:
            raise PrivgradError(
                f"batch {skipped[0]} was drawn but not stepped on before batch {seq}: every drawn "
                "batch must be stepped on, in order (an empty batch is a valid step); skipping "
                "one, e.g. because it is empty, makes the steps depend on the data"
            )

    def _note_loss_state(self) -> None:
        """Notes the tensors and arrays ``loss_fn`` holds (:func:`held_state.loss_holders`),
        for :meth:`_check_loss_state`."""
        self._loss_skip = {id(t) for t in (*self.model.parameters(), *self.model.buffers())}
        self._loss_weights = {
            name: tuple(t.shape)
            for name, t in (*self.model.named_parameters(), *self.model.named_buffers())
        }
        self._loss_state = self._loss_tensors()
        self._watch_plain_tensors()

    def _loss_tensors(self) -> dict:
        """:func:`held_state.tensor_state` of what ``loss_fn`` holds, the model's parameters
        and buffers and copies of its ``state_dict`` left out."""
        return tensor_state(
            loss_holders(self.loss_fn, self.model), self._loss_skip, True, self._loss_weights
        )

    def _plain_tensors(self) -> dict:
        """:func:`held_state.tensor_state` of the model's plain tensor attributes."""
        return tensor_state([plain_tensors(self._named_layers)], set(), True)

    def _watch_plain_tensors(self) -> None:
        """Notes the tensors the model's modules hold as plain attributes
        (:func:`held_state.plain_tensors`) after each of its forwards, and compares them
        before the next forward and each step: one written in between, outside any forward
        (a memory bank of earlier outputs the loop sets, ``model.bank = ...``), refuses the
        next step (:meth:`_check_loss_state`); what a forward writes (an activation kept for
        a plot) is not compared, nor what a module holding such tensors writes in its forward
        called alone (an evaluation of ``model.encoder`` between steps, whose attention layer
        keeps its weights): the hooks are on the model and on those modules (hooks on each of
        1,600 modules slowed a forward by 5 ms)."""
        self._named_layers = list(self.model.named_modules())  # (a change is refused first)
        self._plain = self._plain_tensors()
        self._plain_fault: str | None = None
        self._plain_depth = 0  # forwards of the model's modules now running, one in another
        before, after = _PlainWatch(self, before=True), _PlainWatch(self, before=False)
        self._plain_hooks = [
            hook
            for name, m in self._named_layers
            if m is self.model or plain_tensors([(name, m)])
            for hook in (
                m.register_forward_pre_hook(before),
                m.register_forward_hook(after, always_call=True),
            )
        ]

    def _compare_plain(self) -> None:
        if self._plain_fault is not None:
            return
        changed = tensor_change(self._plain, self._plain_tensors())
        if changed is None:
            return
        self._plain_fault = (
            f"the model holds a tensor besides its parameters and buffers that was changed "
            f"between its forwards, outside them: its attribute {changed}. A model that "
            "carries what it saw from one batch to the next (a memory bank of earlier batches' "
            "outputs that its forward reads, set by the loop) lets one example move the clipped "
            "sums of the later steps it stays in, drawn or not, while ε counts at most C in the "
            "steps that draw it (up to 1.26 C at steps that did not draw it); compute each "
            "example's output from its own input, the parameters and constants fixed before "
            "training. The trainer stays refused: rebuild the model and train again"
        )

    def _check_loss_state(self) -> None:
        """Refuses a step once a tensor or array ``loss_fn`` holds (an attribute, a closure's
        cell, a global its code names) changed since make_private: a loss carrying what it saw
        from one batch to the next (a MoCo-style queue or memory bank of earlier batches'
        outputs as negatives) lets one example move every later step's clipped sum while it
        stays there, drawn or not, which ε (at most C, in the steps that draw it) does not
        count. So does a model's plain tensor attribute written outside its forwards
        (:meth:`_watch_plain_tensors`)."""
        if self._loss_state is None:
            return
        self._compare_plain()  # written since the last forward: by the loop
        if self._plain_fault is not None:
            raise PrivgradError(self._plain_fault)
        changed = tensor_change(self._loss_state, self._loss_tensors())
        if changed is None:
            return
        raise PrivgradError(
            f"loss_fn holds state that changed between steps: its {changed} is not what it was "
            "when make_private/attach checked the loss. A loss that carries what it saw from one "
            "batch to the next (a MoCo-style queue or memory bank of earlier batches' outputs "
            "used as negatives) lets one example move the clipped sums of the later steps it "
            "stays in, drawn or not, while ε counts at most C in the steps that draw it (a bank "
            "of 64 raw outputs moved 8 steps that did not draw the example by 4.9 to 8.7 C "
            "each); compute each example's loss from its own output and label and constants "
            "fixed before training (negatives from public data). A value kept only for logging "
            "is fine as a number (loss.mean().item()), which is not compared"
        )

    def _check_model(self) -> None:
        """Refuses a step once the model's layers changed after make_private (a BatchNorm
        inserted, a parametrization registered): its refusals by type, its probe and the
        per-sample rules covered the layers it had; and once its trainable parameters did
        (:meth:`_check_trainable`)."""
        now = tuple(self.model.modules())
        if now == self._layers:
            self._check_trainable()
            _refuse_merged_adapters(self._mergeable)
            return
        known, current = {id(m) for m in self._layers}, {id(m) for m in now}
        added = [name or "(root)" for name, m in self.model.named_modules() if id(m) not in known]
        removed = len(known - current)
        raise PrivgradError(
            "the model's layers changed after make_private ("
            + (f"added: {', '.join(added[:3])}" if added else f"{removed} removed")
            + "): its checks covered the layers it had; build the whole model before "
            "make_private or attach"
        )

    def _check_trainable(self) -> None:
        """Refuses a step once parameters were frozen or unfrozen after make_private: a layer
        unfrozen later would get no gradient and be left out of the clipping norm, one frozen
        later broke its layer's rule."""
        now = _trainable(self.model)
        if now == self._trainable:
            return
        names = {id(p): name for name, p in self.model.named_parameters()}
        before, after = set(self._trainable), set(now)
        unfrozen = [names[i] for i in after - before if i in names]
        frozen = [names[i] for i in before - after if i in names]
        raise PrivgradError(
            "the trainable parameters changed after make_private or attach ("
            + "; ".join(
                f"{what}: {', '.join(sorted(found)[:3])}"
                for what, found in (("unfrozen", unfrozen), ("frozen", frozen))
                if found
            )
            + "): its per-sample rules and clipping norm cover the parameters it was given, "
            "and changing them mid-run is not supported; set requires_grad before make_private "
            "or attach"
        )

    def _check_budget(self) -> None:
        """Refuses a step past the steps σ was calibrated for (ε would pass its target),
        unless ``allow_over_budget``; the error says how far ε would go."""
        if self.target_epsilon is None or self.allow_over_budget:
            return
        if self.mechanism.noise_multiplier < self.planned_sigma:
            raise PrivgradError(
                f"the noise multiplier was lowered after calibration (σ = "
                f"{self.mechanism.noise_multiplier:g}, calibrated {self.planned_sigma:g} for "
                f"ε = {self.target_epsilon:g} over {self.planned_steps} steps): ε would pass its "
                "target before the plan ends; pass allow_over_budget=True to run so"
            )
        if self.steps < self.planned_steps:
            return
        one, epoch = self.epsilon_after(1), self.epsilon_after(self.sampler.steps_per_epoch)
        raise PrivgradError(
            f"step {self.steps + 1} goes past the {self.planned_steps} steps σ was calibrated for "
            f"(target ε = {self.target_epsilon:g}): ε would be {one:.4g} after it and "
            f"{epoch:.4g} after another epoch; pass allow_over_budget=True to make_private or "
            "attach (or set trainer.allow_over_budget) to go on"
        )

    def epsilon_after(self, steps: int, accountant: str = "pld") -> float:
        """Honest ε if ``steps`` more steps like the last one ran (a forecast: the ledger is
        unchanged)."""
        if not self.ledger.entries:
            honest, _ = self.expected_events(steps)
            entries = [[_decode_key(key), n] for key, n in honest.items()]
        else:
            entries = [list(e) for e in self.ledger.entries]
            entries[-1][1] += steps
        return composed_epsilon([*self.prior.entries, *entries], self.delta, accountant, "best")

    def plan_context(self, steps: int, target_epsilon: float | None = None) -> PlanContext:
        """What the mechanism's stages may learn about this run before its first step
        (:class:`~privgrad.mechanisms.stages.PlanContext`): parameter shapes, steps, q, δ,
        the target ε, the noise record at the current σ and a zero-input probe."""

        def probe():
            x0, y0 = self.data.empty()
            x = x0.new_zeros((1, *x0.shape[1:]), device=self.device)
            y = y0.new_zeros((1, *y0.shape[1:]), device=self.device)
            return self.grad_sampler.compute(x, y, self.loss_fn)[0]

        B = self.sampler.expected_batch_size
        return PlanContext(
            param_shapes=tuple(tuple(p.shape) for p in self.grad_sampler.empty().params),
            n_layers=self.n_layers,
            steps=steps,
            sampling_rate=self.sampling_rate,
            expected_batch_size=B,
            delta=self.delta,
            target_epsilon=target_epsilon,
            noise=self.mechanism.noise_record(self.n_layers, B),
            noise_event=self.sampler.event,
            probe=probe,
        )

    @property
    def _reduce(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        """The all-reduce of a batch sum over the data-parallel ranks (None: one process)."""
        return self.distributed.all_reduce_sum if self.distributed else None

    def _privatize(self, x, y: torch.Tensor):
        n, chunk = rows(x), self.max_physical_batch_size
        if chunk is None or n <= chunk:
            return self._privatize_grads(*self.grad_sampler.compute(x, y, self.loss_fn))
        losses = []

        def compute(start: int):
            def per_sample():
                part = slice(start, start + chunk)
                grads, loss = self.grad_sampler.compute(take(x, part), y[part], self.loss_fn)
                losses.append(loss)
                return grads

            return per_sample

        params, grads, records, facts = self.mechanism.privatize_chunks(
            (compute(start) for start in range(0, n, chunk)),
            self.sampler.expected_batch_size,
            self.noise_generator,
            self._reduce,
        )
        return params, torch.cat(losses), grads, records, facts

    def _privatize_grads(self, per_sample, losses: torch.Tensor):
        """The mechanism's chain on per-sample gradients, however they were computed (here, or
        from the user's own backward in :mod:`privgrad.own_loop`)."""
        grads, records, facts = self.mechanism.privatize(
            per_sample,
            self.sampler.expected_batch_size,
            self.noise_generator,
            self._reduce,
        )
        return per_sample.params, losses, grads, records, facts

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.train()
        graphed = self._graphed_step(x, y) if self.grad_sampler.flags.cuda_graphs else None
        if graphed is not None:
            return self._apply(*graphed)
        return self._run_step(
            lambda keep: (
                self._privatize(x, y) if keep is None else self._privatize(take(x, keep), y[keep])
            )
        )

    def _graphed_step(self, x, y: torch.Tensor):
        """The step's (parameters, losses, grads, records, facts) from its captured graph
        (:mod:`privgrad.graphed`), or None where the eager step must run: the chain is not
        capturable (warned once), the batch is empty or split into micro-batches, or some
        per-sample gradient is not finite (the noise generator is then restored)."""
        reason = why_not_graphed(self)
        if reason is not None:
            if reason != self._graph_refusal:
                self._graph_refusal = reason
                warnings.warn(f"cuda_graphs is on but steps run eagerly: {reason}", stacklevel=4)
            return None
        n, chunk = rows(x), self.max_physical_batch_size
        if n == 0 or (chunk is not None and n > chunk):
            return None
        if self._graphed is None:
            self._graphed = GraphedSteps(self)
        noise_rng = self.noise_generator.get_state()
        out = self._graphed.run(x, y)
        if out is None:
            self.noise_generator.set_state(noise_rng)
        elif self._observers:  # the graph's output buffers are overwritten by the next step
            params, losses, grads, records, facts = out
            out = params, losses, [g.clone() for g in grads], records, facts
        return out

    def _run_step(self, privatize: Callable) -> float:
        """One private step: ``privatize(keep)`` gives (parameters, losses, grads, noise
        records, facts) for the batch's examples (:meth:`_drop_nonfinite`); the update goes to
        the optimizer and the step to the ledgers."""
        (params, losses, grads, records, facts), dropped = self._drop_nonfinite(privatize)
        self.nonfinite_examples += dropped
        return self._apply(params, losses, grads, records, facts)

    def _drop_nonfinite(self, privatize: Callable) -> tuple[object, int]:
        """``privatize(None)`` (all examples), or, where some example's per-sample gradient
        is not finite, ``privatize(keep)`` (a mask of the others) with the noise generator
        and mechanism state as they were before (or refused, ``strict``); returns its result
        and the number of examples dropped."""
        noise_rng, mechanism_state = self.noise_generator.get_state(), self.mechanism.state_dict()
        try:
            return privatize(None), 0
        except NonFiniteGradients as bad:  # raised before any noise is drawn or sum reduced
            dropped = int(bad.mask.sum())
            if self.strict:
                raise PrivgradError(
                    f"step {self.steps + 1}: {dropped} example(s) have a per-sample "
                    "gradient that is not finite (NaN, inf or overflow in the input?)"
                ) from None
            self.noise_generator.set_state(noise_rng)
            self.mechanism.load_state_dict(mechanism_state)
            keep = ~bad.mask
        try:
            return privatize(keep), dropped
        except NonFiniteGradients:
            raise PrivgradError(
                f"step {self.steps + 1}: per-sample gradients stayed non-finite after the "
                f"{dropped} example(s) with non-finite gradients were removed and the rest "
                "computed again: the gradients overflow (a norm layer over near-constant "
                "inputs, a learning rate too high?) and a random layer (dropout, drop path) "
                "moved the overflow to other examples, or the model mixes examples"
            ) from None

    def _apply(self, params, losses, grads, records, facts) -> float:
        """The step's update to the optimizer (after the observers), the step to the ledgers;
        returns the mean loss."""
        strict, self._strict_buffers = self._strict_buffers, False
        self._check_buffers(strict)
        self._check_not_a_copy()
        self._check_records(records)
        for observe in list(self._observers):
            observe(grads, records, facts)
        trained = self._trained_values
        if trained is None or trained.shapes != [(tuple(p.shape), p.dtype) for p in params]:
            # weights that start trained (a resumed run's, prior='s) carry steps from the start
            start = (
                f"the weights a run of this process resumed at its step {self.steps} held"
                if self.steps
                else f"the weights of {self.prior.source} held"
                if self.prior is not NO_PRIOR
                else None
            )
            trained = self._trained_values = _TrainedValues(params, start)
            _TRAINED_VALUES.append(trained)
        for p, g in zip(params, grads):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_facts = facts
        self._account(records, facts)
        trained.record(self.steps, params)
        self._watch_buffers()
        if self.distributed:
            self.distributed.after_step(self.model, self.steps)
        return float(losses.mean()) if len(losses) else math.nan

    def _check_not_a_copy(self) -> None:
        """Refuses the first step of a run (not resumed, no ``prior=``) whose model holds the
        weights of another live model of this process that took private steps (copied into
        it by ``load_state_dict``): its ε would count from zero (12 more steps printed 6.45
        where the weights had taken 24, 8.79). Checked at the first step, not at
        make_private, so a resume that loads the weights before its state is not refused."""
        if self._copy_checked:
            return
        if self.steps == 0 and self.prior is NO_PRIOR:
            steps = _copy_of_trained(self.model)
            if steps is not None:
                raise PrivgradError(
                    f"the model holds the weights of another model of this process that took "
                    f"{steps} private steps (copied by load_state_dict?): this run's ε would "
                    "count from zero, while these weights carry that run's too. Continue with "
                    "that model's trainer, or save it (trainer.save_model(path)) and pass "
                    "prior=path to make_private to compose its privacy events into this run's "
                    "ε, or prior='disjoint' if this run's training data shares no example with "
                    "that run's"
                )
            found = _holds_trained_values(self.model, self._trained_values)
            if found is not None:
                raise PrivgradError(
                    f"the model's parameter '{found[0]}' holds a value that {found[1]} (a "
                    "state_dict snapshot of an earlier step, or one layer's weights, copied into "
                    "this model?): this run's ε would count from zero, while those weights "
                    "carry that run's steps too. Pass prior= the privacy record of those "
                    "weights (trainer.save_model(path) saves one) to make_private to compose "
                    "its events, or prior='disjoint' if this run's training data shares no "
                    "example with that run's"
                )
            adapter = _trained_adapter(self.model)
            if adapter is not None:
                raise PrivgradError(
                    f"the peft LoRA weight '{adapter}' is not zero, though its initialisation "
                    "starts it at zero: these adapters were trained already (read back by "
                    "PeftModel.from_pretrained?), and this run's ε would count from zero while "
                    "they carry that run's steps too. Pass prior= the privacy record of those "
                    "adapters (the privacy.json in the folder trainer.save_model(path) writes, "
                    "path's .hf, or in DPTrainer's output; peft's own save_pretrained writes "
                    "none) to make_private to compose its events into this run's ε (same or "
                    "overlapping data), or prior=('disjoint', that privacy.json) if this run's "
                    "training data shares no example with theirs (their events stay in this "
                    "run's record), or prior='disjoint' where there is no record (trained on "
                    "other data without privgrad, or never trained: you set them yourself)"
                )
        self._copy_checked = True

    def _watch_buffers(self) -> None:
        """Notes each buffer make_private's check saw no forward write (its tensor and version
        counter), for :meth:`_check_buffers`."""
        written = getattr(self.model, "_privgrad_written_buffers", set())
        first = self._watched is None
        self._watched = [
            (qualified, m, name, b, None if b is None else b._version)
            for qualified, m, name, b in _named_buffers(self.model)
            if qualified not in written
        ]
        if first:  # their values, once: a buffer written again with the same is not refused
            self._buffer_digests = {q: _buffer_digest(b) for q, _, _, b, _ in self._watched}

    def _check_buffers(self, strict: bool = False) -> None:
        """Refuses a step after which a buffer make_private's check saw no forward write was
        written (in place, or replaced) since the last step: the probe found it free of the
        training data only because it was not written then (a layer that starts tracking a
        running statistic after some calls), and the model file would release its value, a
        function of training examples, without noise (one example of 1000s among 100 moved
        such a buffer by 8.6). The trainer stays refused: the model now holds that value.
        Outside a step's forward (``strict`` False) a buffer written with the value it held when
        first watched is not refused: a snapshot restored by ``load_state_dict`` (evaluating
        with other weights, then continuing) was refused though it released nothing."""
        if self._buffer_fault is None:
            for qualified, m, name, b, version in self._watched or ():
                now = m._buffers.get(name)
                if now is b and (b is None or b._version == version):
                    continue
                if not strict and _buffer_digest(now) == self._buffer_digests.get(qualified, ""):
                    # written with the value it held (load_state_dict of a snapshot, a move)
                    continue
                self._buffer_fault = (
                    f"buffer '{qualified}' was written during training, after make_private's "
                    "check saw the model's forward leave it alone: it may hold values computed "
                    "from training examples, which no noise covers and the saved model would "
                    "release; make the layer stop writing it in train mode (or keep such "
                    "state outside the model's buffers), rebuild the model and train again"
                )
                break
        if self._buffer_fault is not None:
            raise PrivgradError(self._buffer_fault)

    def state_dict(self) -> dict:
        """All a run needs to continue bit-identically: model, optimizer, sampler and noise
        RNGs, both ledgers, the mechanism's step state; but not torch's global RNG, which a
        model's dropout draws from: save and restore ``torch.get_rng_state()`` beside it.
        Batches drawn but not yet stepped on are drawn again after loading. Tensors are
        shared with the live objects (as in torch): save or deep-copy the result."""
        self._check_buffers()  # a buffer written since the last step is not checkpointed
        first_pending = next(iter(self._pending.values()), None)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": first_pending.sampler_state if first_pending else self.sampler.state_dict(),
            "noise_generator": self.noise_generator.get_state(),
            "ledger": self.ledger.state_dict(),
            "claimed_ledger": self.claimed_ledger.state_dict(),
            "steps": self.steps,
            "mechanism": self.mechanism.state_dict(),
            "delta": self.delta,
            "nonfinite_examples": self.nonfinite_examples,
            "seed": self.seed,
            "prior": self.prior.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`; every part is checked against this trainer before
        anything changes, so a state of another run is refused, never half-loaded. The
        ledgers are not taken on trust: they must hold exactly the events this trainer's
        mechanism, σ and q give for the state's step count, and the step count must be the
        number of draws that leads the sampler's RNG to its saved state (re-drawn from the
        seed), so an edited ledger, σ or step count is refused."""
        missing = {
            "model",
            "optimizer",
            "sampler",
            "noise_generator",
            "ledger",
            "claimed_ledger",
            "steps",
            "mechanism",
            "delta",
        } - set(state)
        if missing:
            raise PrivgradError(f"the trainer state lacks {', '.join(sorted(missing))}")
        if state["delta"] != self.delta:
            raise PrivgradError(
                f"the trainer state is for δ = {state['delta']}, this trainer has {self.delta}"
            )
        self.mechanism.check_state_dict(state["mechanism"])
        self.sampler.check_state_dict(state["sampler"])
        _check_model_state(self.model, state["model"])
        _check_optimizer_state(self.optimizer, state["optimizer"])
        own = self.noise_generator.get_state()
        if not (
            isinstance(state["noise_generator"], torch.Tensor)
            and state["noise_generator"].shape == own.shape
        ):
            raise PrivgradError(
                f"the saved noise RNG state is not one of a {self.device.type} generator "
                "(saved on another device?)"
            )
        ledger, claimed = PrivacyLedger(), PrivacyLedger()
        ledger.load_state_dict(state["ledger"])
        claimed.load_state_dict(state["claimed_ledger"])
        if not ledger.steps == claimed.steps == state["steps"]:
            raise PrivgradError(
                f"the trainer state's ledgers ({ledger.steps} and {claimed.steps} steps) "
                f"disagree with its step count {state['steps']}"
            )
        self._check_ledgers(ledger, claimed, state["steps"])
        prior = self.prior
        if not _same_prior(state.get("prior"), self.prior.state()):
            prior = self._prior_of_resumed(state.get("prior"), ledger, claimed)
        if prior is None:
            raise PrivgradError(
                "the trainer state is of a run whose prior= (the earlier run its model's weights "
                "came from, and how it counts) is not this trainer's: make the trainer with the "
                "same prior= as that run"
            )
        seed = self._state_seed(state)
        self._check_draws(state["sampler"], state["steps"], seed)
        nonfinite = state.get("nonfinite_examples", 0)
        if isinstance(nonfinite, bool) or not isinstance(nonfinite, int) or nonfinite < 0:
            raise PrivgradError(
                f"the trainer state's count of non-finite examples is not a count: {nonfinite!r}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.noise_generator.set_state(state["noise_generator"])
        self.ledger, self.claimed_ledger = ledger, claimed
        self.prior = prior
        self.model._privgrad_ledger = ledger  # the marker a later trainer on the model reads
        self.mechanism.load_state_dict(state["mechanism"])
        self.nonfinite_examples = nonfinite
        self.seed = seed
        self._issuer, self._pending = object(), {}
        if self._watched is not None:
            self._watched = None  # loaded by load_state_dict, not by a forward: watched anew
            self._watch_buffers()

    def _prior_of_resumed(self, saved, ledger, claimed) -> Prior | None:
        """The state's prior, where this trainer's ``prior=PATH`` is the record of the very
        weights the state holds: that run's events are the state's prior's and its ledger's
        (the record was saved with it, as a checkpoint's weights: loaded before the state,
        make_private asked for prior=, which load_state_dict then refused); else None."""
        if not (self.prior.composed and self.steps == 0):
            return None
        try:
            before = Prior() if saved is None else Prior.from_state(saved)
        except (KeyError, TypeError, ValueError):
            return None
        # the record's events: its prior's (composed) and its run's, then those it keeps of
        # disjoint earlier runs (_record_events)
        honest = [*before.entries, *ledger.entries, *before.disjoint_entries]
        said = [*before.claimed_entries, *claimed.entries, *before.disjoint_claimed_entries]
        enc = encode_entries
        if enc(self.prior.entries) != enc(honest) or enc(self.prior.claimed_entries) != enc(said):
            return None
        return NO_PRIOR if saved is None else before

    def _state_seed(self, state: dict) -> int:
        """The seed of the run that saved ``state``: a trainer made without a seed (a secret
        one) takes it; one made with a seed must have the state's. A state saved before
        states held their seed is of this trainer's seed, if it was given."""
        saved = state.get("seed")
        if saved is None:
            if not self.seed_given:
                raise PrivgradError(
                    "the trainer state names no seed (saved by an earlier privgrad, whose "
                    "default seed was 0): make the trainer with its run's seed (seed=0 unless "
                    "another was given)"
                )
            return self.seed
        saved = validate_seed(saved)
        if self.seed_given and saved != self.seed:
            raise PrivgradError(
                "the trainer state is of a run with another seed than the one this trainer was "
                "given; make it without a seed (the state's, secret, is taken) or with that "
                "run's"
            )
        return saved

    def expected_events(self, steps: int) -> tuple[collections.Counter, collections.Counter]:
        """How often each privacy event enters the honest and the claimed ledger in ``steps``
        steps of this trainer, from its mechanism, σ and q alone (no data)."""
        pure = self.mechanism.pure_dp_events(steps)
        if self.mechanism.noise_stage is None and not pure:
            nonprivate = collections.Counter({_event_key(dp_event.NonPrivateDpEvent()): steps})
            return nonprivate, nonprivate.copy()
        record = self.mechanism.noise_record(self.n_layers, self.sampler.expected_batch_size)
        honest, claimed = collections.Counter(), collections.Counter()
        for counter, multiplier in ((honest, record.effective), (claimed, record.claimed)):
            counter[_event_key(self.sampler.event(multiplier))] += steps
            for event, n in pure:
                counter[_event_key(event)] += n
        return honest, claimed

    def _check_ledgers(self, ledger: PrivacyLedger, claimed: PrivacyLedger, steps: int) -> None:
        expected_honest, expected_claimed = self.expected_events(steps)
        for name, saved, expected in (
            ("honest", ledger, expected_honest),
            ("claimed", claimed, expected_claimed),
        ):
            if _ledger_events(saved) != expected:
                raise PrivgradError(
                    f"the trainer state's {name} privacy ledger is not the one {steps} steps of "
                    f"this run record (mechanism {self.mechanism.name}, σ = "
                    f"{self.mechanism.noise_multiplier:.6g}, q = {self.sampling_rate:.6g}); "
                    "it was edited or belongs to another run, and is not loaded"
                )

    def _check_draws(self, saved: dict, steps: int, seed: int) -> None:
        """The sampler state must be the one ``steps`` draws from the seed lead to. Re-drawing
        costs what sampling those steps cost in training, a small part of a step."""
        if saved.get("draws") != steps:
            raise PrivgradError(
                f"the trainer state's sampler made {saved.get('draws')} draws for "
                f"{steps} steps; it is not loaded"
            )
        replay = copy.copy(self.sampler)
        replay.generator, replay.draws = generator(seed), 0
        for _ in range(steps):
            replay.sample()
        if not torch.equal(replay.generator.get_state(), saved["generator"]):
            raise PrivgradError(
                f"the trainer state's sampler RNG is not where {steps} draws from its run's "
                "seed lead; the step count or the RNG was edited, and it is not loaded"
            )

    def _check_records(self, records: list[NoiseRecord]) -> None:
        """Refuses a step whose noise records are not the mechanism's static one (its stages'
        ``describe``), before its update is applied: calibration, the budget guard, the
        printed σ_eff and resume all read that one (a plugin stage reporting another, or a
        σ schedule, would spend another ε than planned)."""
        expected = [self._described_record()] if self.mechanism.noise_stage is not None else []
        if len(records) == len(expected) and all(
            math.isclose(r.effective, e.effective, rel_tol=1e-9)
            and math.isclose(r.claimed, e.claimed, rel_tol=1e-9)
            for r, e in zip(records, expected)
        ):
            return
        several = (
            "; a step reports one record: noise of several multipliers in one step (one per "
            "layer) is one Gaussian at (Σ σ_i⁻²)^(-1/2), the record to report and describe"
            if len(records) > 1
            else ""
        )
        raise PrivgradError(
            f"mechanism '{self.mechanism.name}' reported the noise records {records} at a step, "
            f"not the {expected} its stages describe: privgrad calibrates, guards the budget "
            "and resumes from the described one, so a stage must report at every step what its "
            "describe() says (a noise multiplier that varies by step is not supported)" + several
        )

    def _described_record(self) -> NoiseRecord:
        """The mechanism's static noise record (its stages' ``describe``), refused when it
        changed while σ did not: a describe() that follows a step counter (a σ schedule) would
        match each step's record while calibration and the budget guard planned the first one,
        and ε would pass its target unrefused."""
        sigma = self.mechanism.noise_multiplier
        record = self.mechanism.noise_record(self.n_layers, self.sampler.expected_batch_size)
        if self._described is not None and self._described[0] == sigma:
            before = self._described[1]
            if not (
                math.isclose(record.effective, before.effective, rel_tol=1e-9)
                and math.isclose(record.claimed, before.claimed, rel_tol=1e-9)
            ):
                raise PrivgradError(
                    f"mechanism '{self.mechanism.name}' now describes the noise record {record}, "
                    f"not the {before} its stages described before at the same σ = {sigma:g}: "
                    "privgrad calibrates, guards the budget and resumes from one described "
                    "record, so a stage's describe() must not change from step to step (a noise "
                    "multiplier that varies by step is not supported)"
                )
        self._described = (sigma, record)
        return record

    def _account(self, records: list[NoiseRecord], facts: StepFacts) -> None:
        """The step's events (:func:`privgrad.accounting.events.step_events`) to the ledgers."""
        honest, claimed = step_events(
            records, self.sampler.event, facts.pure_events, facts.claimed_pure_events
        )
        self.ledger.record(honest)
        self.claimed_ledger.record(claimed)

    def add_step_observer(self, observer: Callable) -> Callable[[], None]:
        """Calls ``observer(update, records, facts)`` after every private step's chain, before
        the optimizer takes the update (the white-box auditor's view of each release; the
        one-run audit scores its canaries this way). Returns a function that removes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    def epsilon(self, accountant: str = "pld") -> float:
        """Honest ε: the accountant on the effective noise multiplier of every step run
        (pure-DP steps, e.g. GIP's index selection: the smaller of basic and tight composition)."""
        return composed_epsilon(self.all_entries(), self.delta, accountant, "best")

    def all_entries(self, claimed: bool = False) -> list:
        """The events ε counts: a prior run's composed (``make_private(prior=PATH)``), then
        this run's ledger (honest, or with ``claimed`` the paper-claimed one)."""
        if claimed:
            return [*self.prior.claimed_entries, *self.claimed_ledger.entries]
        return [*self.prior.entries, *self.ledger.entries]

    def privacy_record(self) -> dict:
        """The privacy facts of the steps run so far: honest ε (PLD, and RDP), claimed ε (PLD,
        and RDP), δ, σ (nominal and effective), q, steps, accountant, neighbouring relation,
        mechanism, clip norm C, expected batch size and training-set size (the same names as
        ``privgrad train``'s record and sidecar)."""
        from privgrad.records import provenance

        noise = self.mechanism.noise_record(self.n_layers, self.sampler.expected_batch_size)
        eps = self.epsilon()
        return {
            "epsilon": eps,
            "epsilon_rdp": self.epsilon("rdp"),
            "epsilon_claimed": self.epsilon_claimed(),
            "epsilon_claimed_rdp": self.epsilon_claimed("rdp"),
            "dp_guarantee": math.isfinite(eps),
            "delta": self.delta,
            "accountant": "pld",
            "neighbouring": NEIGHBOURING,
            "noise_multiplier": self.mechanism.noise_multiplier,
            "effective_noise_multiplier": noise.effective,
            "sampling_rate": self.sampling_rate,
            "steps": self.steps,
            "mechanism": self.mechanism.name,
            "seed_source": seed_source(self.seed_given),
            "clip": self.mechanism.clip_norm,
            "batch_size": self.sampler.expected_batch_size,
            "train_size": self.sampler.dataset_size,
            "nonfinite_examples": self.nonfinite_examples,
            # the events ε counts, so that a run continuing from these weights composes them
            **events_record(self.prior, self.ledger.entries, self.claimed_ledger.entries),
            "trained_parameters": trained_parameters(self.model),
            **provenance(),
        }

    def save_model(self, path, **extra) -> tuple:
        """Writes the model's weights to ``path`` (``torch.load(path, weights_only=True)``
        reads them) and :meth:`privacy_record` (with ``extra``) beside it, as
        ``<stem>.privacy.json`` (:mod:`privgrad.model_file`); returns both paths."""
        from privgrad.model_file import save_model

        self._check_buffers()
        record = self.privacy_record()
        # what the record says of the weights is privgrad's alone: a keyword must not replace it
        # (save_model(path, epsilon=0.1) wrote ε = 0.1 beside weights whose 10 steps give 2.85)
        taken = sorted(set(extra) & {*record, "weights_sha256", "not_covered_by_epsilon"})
        if taken:
            raise PrivgradError(
                f"save_model's keywords {', '.join(taken)} would replace the privacy record's own "
                "entries (computed by privgrad from the steps taken): pass other names"
            )
        return save_model(self.model, path, {**record, **extra})

    def epsilon_claimed(self, accountant: str = "pld") -> float:
        """The paper's claim for this run: its noise at the multiplier the paper credits
        (the nominal σ; pure-DP steps added by basic composition), composed by
        ``accountant`` (PLD, as the honest ε; the papers composed with RDP, which gives more:
        :mod:`privgrad.lab.report.privacy`); not a guarantee."""
        return composed_epsilon(self.all_entries(claimed=True), self.delta, accountant, "basic")


def _event_key(event) -> str:
    return json.dumps(encode_event(event), sort_keys=True)


def _decode_key(key: str):
    from privgrad.accounting.ledger import decode_event

    return decode_event(json.loads(key))


def _ledger_events(ledger: PrivacyLedger) -> collections.Counter:
    """The ledger's events, a composed step split into its parts, with their counts."""
    counts = collections.Counter()
    for event, n in ledger.entries:
        for part in event.events if isinstance(event, dp_event.ComposedDpEvent) else [event]:
            counts[_event_key(part)] += n
    return counts


def _rows(t) -> int | None:
    try:
        return rows(t)
    except DataError:
        return None


class _PlainWatch:
    """A forward hook of the trainer's model for :meth:`PrivateTrainer._watch_plain_tensors`:
    before a forward, compares the model's plain tensors; after it, notes them. It holds its
    trainer weakly, and a copy or a pickle of it (of the model) does nothing."""

    def __init__(self, trainer: "PrivateTrainer", before: bool):
        self.trainer, self.before = weakref.ref(trainer), before

    def __getstate__(self) -> dict:
        return {"before": self.before}

    def __setstate__(self, state: dict) -> None:
        self.trainer, self.before = (lambda: None), state["before"]

    def __call__(self, module, args, output=None):
        _watch_plain(self.trainer(), module, self.before)


@torch.compiler.disable  # (run as Python under torch.compile, which refuses the step later)
def _watch_plain(own, module, before: bool) -> None:
    """Compares the plain tensors before the outermost forward of the model or of one of its
    modules (called alone), and notes them after it."""
    if own is None:
        return
    if own.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # a captured step's forward (graphed.py): its comparison would sync in capture
    own._plain_depth += 1 if before else -1
    if own._plain_depth != (1 if before else 0):
        own._plain_depth = max(own._plain_depth, 0)
        return  # a module's forward within another's
    if before:
        own._compare_plain()
    elif own._plain_fault is None:
        own._plain = own._plain_tensors()


def _named_buffers(model: nn.Module):
    """(qualified name, module, name, tensor) of every buffer slot, as the mixing probe names
    them (a slot holding None included)."""
    for prefix, m in model.named_modules():
        for name, b in m._buffers.items():
            yield f"{prefix}{'.' if prefix else ''}{name}", m, name, b


def _buffer_digest(b) -> str | object | None:
    """SHA-256 of a buffer's dtype, shape and bytes (None for an empty slot); a buffer whose
    bytes cannot be read so (sparse, a tensor subclass) gives a token equal to nothing, so
    that any write to it is refused, as before values were compared."""
    if b is None:
        return None
    from privgrad.model_file import weights_fingerprint

    try:
        return weights_fingerprint({"": b})
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return object()


def _refuse_earlier_private_steps(model: nn.Module, prior: Prior = NO_PRIOR) -> None:
    """Refuses a model that already took private steps under another trainer (its ledger is
    marked on the model, and on a deep copy of it): a new trainer's ε would count only its
    own steps, while the model carries both trainers' (attaching again for "one more epoch"),
    unless its weights are those of a saved privacy record ``prior=`` names (``prior``'s
    ``weights_recorded``: that record holds those steps); and one whose parameter an earlier
    check's forward set from training examples."""
    tainted = getattr(model, "_privgrad_tainted", None)
    if tainted is not None and tainted[1]._version == tainted[2]:
        raise PrivgradError(
            f"parameter '{tainted[0]}' holds the value an earlier make_private check's forward "
            "computed from training examples (the model changes it in place), which no noise "
            "covers: rebuild the model or reload its weights"
        )
    earlier = getattr(model, "_privgrad_ledger", None)
    if isinstance(earlier, PrivacyLedger) and earlier.steps > 0 and not prior.weights_recorded:
        raise PrivgradError(
            f"this model already took {earlier.steps} private step"
            f"{'s' * (earlier.steps != 1)} under another privgrad trainer, whose ε a new "
            "trainer would not count: continue with that trainer (make_private or attach once, "
            "with epochs covering all the training; allow_over_budget=True steps past its "
            "plan), or resume it from its state_dict, or save the model with that trainer "
            "(save_model(path)) and pass prior=path (same or overlapping data: its steps are "
            "composed into the new ε) or prior='disjoint' (new data sharing no example with "
            "that run's)"
        )


LOW_PRECISION = (torch.bfloat16, torch.float16)  # refused for trainable parameters


def _refuse_low_precision_parameters(model: nn.Module) -> None:
    """Refuses trainable parameters in bf16 or fp16: their per-sample gradients, clipped sum
    and noise would be rounded apart from the norms that clipped them (one example's released
    gradient reached 1.01 C in bf16), while the accountant assumes C."""
    low = [
        (name, p.dtype)
        for name, p in model.named_parameters()
        if p.requires_grad and p.dtype in LOW_PRECISION
    ]
    if low:
        raise PrivgradError(
            f"trainable parameter '{low[0][0]}' is {str(low[0][1]).removeprefix('torch.')}"
            + (f" (and {len(low) - 1} more)" if len(low) > 1 else "")
            + ": privgrad clips and noises in float32, on float32 weights; make the trainable "
            "parameters float32 (e.g. module.float(); a peft modules_to_save copy too) and run "
            "the forward in low precision with make_private(precision='bf16') or "
            "torch.autocast in your own loop (declared as attach(precision='bf16')); frozen "
            "parameters may stay bf16/fp16"
        )


def _refuse_merged_adapters(layers: list[tuple[str, nn.Module]]) -> None:
    """Refuses a peft layer whose adapters are merged into its frozen base weights
    (``merge_adapter()``): its forward leaves the trainable adapters out, so each step would
    move them by noise alone, and ``unmerge_adapter()`` would then take other weights out of
    the base than it put in."""
    for name, layer in layers:
        if layer.merged is True and any(p.requires_grad for p in layer.parameters()):
            raise PrivgradError(
                f"layer '{name}' ({type(layer).__name__}) has its adapters merged into its base "
                "weights (peft's merge_adapter()): its forward does not use the trainable "
                "adapters, so each private step would move them by noise alone; call "
                "model.unmerge_adapter() before training (and merge for inference after it)"
            )


def _trainable(model: nn.Module) -> tuple[int, ...]:
    """The ids of ``model``'s parameters that require gradients, in order; refuses one in
    16 bits (:func:`_refuse_low_precision_parameters`)."""
    found = tuple(p for p in model.parameters() if p.requires_grad)
    if any(p.dtype in LOW_PRECISION for p in found):
        _refuse_low_precision_parameters(model)
    return tuple(map(id, found))


def _check_drawn(batch: Batch, draw: _Draw) -> None:
    """Refuses a batch whose examples are not the ones its draw picked (other row count or
    labels) or whose labels or inputs were changed after the draw (in place or replaced by
    other values): a transform of the batch may mix its examples (standardising by the batch's
    mean), which no check of the model sees; a transform of each example belongs where the
    dataset loads it."""
    rows = {"inputs": _rows(batch.x), "labels": _rows(batch.y)}
    for what, n in rows.items():
        if n != draw.rows:
            raise PrivgradError(
                f"batch {batch.seq} has {n} rows of {what}, its Poisson draw picked "
                f"{draw.rows} examples: a step takes the drawn examples, as drawn (do not "
                "add, remove or replace examples)"
            )
    if (
        draw.y is not None
        and batch.y is not draw.y
        and not (
            batch.y.shape == draw.y.shape
            and batch.y.device == draw.y.device
            and torch.equal(batch.y, draw.y)
        )
    ):
        raise PrivgradError(
            f"batch {batch.seq}'s labels are not the drawn ones: a step takes the drawn "
            "examples (transform each example's input where the dataset loads it, not its label)"
        )
    if draw.y is not None and draw.y._version != draw.y_version:
        raise PrivgradError(
            f"batch {batch.seq}'s labels were modified in place: a step takes the drawn "
            "examples (transform each example's input where it is loaded, not its label)"
        )
    if draw.x is not None and not _same_inputs(tensors_in(batch.x), draw.x):
        raise PrivgradError(
            f"batch {batch.seq}'s inputs are not the drawn ones (changed in place or replaced): "
            "a transform of the batch can mix its examples (standardising by the batch's mean "
            "moves every example's gradient with the others'), which DP-SGD's sensitivity does "
            "not allow; transform each example where it is loaded (a Dataset's __getitem__)"
        )


def _same_inputs(given: list[torch.Tensor], drawn: list[tuple[torch.Tensor, int]]) -> bool:
    """The drawn input tensors, unchanged since the draw: themselves, or equal copies."""
    return len(given) == len(drawn) and all(
        t._version == version
        and (
            g is t
            or (
                g.shape == t.shape
                and g.dtype == t.dtype
                and g.device == t.device
                and torch.equal(g, t)
            )
        )
        for g, (t, version) in zip(given, drawn)
    )


def _check_model_state(model: nn.Module, saved: dict) -> None:
    own = model.state_dict()
    if set(own) != set(saved):
        diff = sorted(set(own) ^ set(saved))
        raise PrivgradError(
            f"the saved model does not match this model (differing entries: {', '.join(diff[:5])})"
        )
    for name, t in own.items():
        if not isinstance(saved[name], torch.Tensor) or saved[name].shape != t.shape:
            raise PrivgradError(
                f"the saved model's '{name}' has another shape than this model's {tuple(t.shape)}"
            )


# keywords of Opacus, of privgrad's command line or plain slips, which make_private and attach
# would otherwise pass on to the mechanism as options: what to write instead
_KEYWORD_HINTS = {
    "clip": "the clipping norm is max_grad_norm=",
    "clipping_norm": "the clipping norm is max_grad_norm=",
    "clip_norm": "the clipping norm is max_grad_norm=",
    "l2_norm_clip": "the clipping norm is max_grad_norm=",
    "epsilon": "the target is target_epsilon=",
    "sigma": "σ is noise_multiplier=",
    "noise": "σ is noise_multiplier=",
    "physical_batch_size": "micro-batches are max_physical_batch_size=",
    "max_physical_batch": "micro-batches are max_physical_batch_size=",
    "microbatch_size": "micro-batches are max_physical_batch_size=",
    "clipping": "each example's whole gradient is clipped to max_grad_norm (flat); per-layer "
    "clipping is spectral-dp's and gredp's per_layer_clip=",
    "poisson_sampling": "batches are always Poisson-sampled (the accountant assumes it)",
    "accountant": "epsilon() is PLD's; epsilon('rdp') gives RDP's",
    "secure_mode": "without seed=, a secret seed is drawn from the OS",
    "grad_sample_mode": "the engine's forms are flags=privgrad.per_sample.EngineFlags(...)",
    "batch_first": "per-sample gradients need the batch on the first axis (docs/guide.md)",
    "loss_reduction": "attach() takes it; make_private's loss_fn gives one loss per example",
    "lr": "the learning rate is the optimizer's",
}


def _check_mechanism_keywords(name: str, options: dict) -> None:
    """Refuses keywords that mechanism ``name`` does not take, in the Python API's words:
    :meth:`MechanismSpec.make`'s refusal names command-line flags ("does not use option(s)
    --clip"), which a ``make_private(..., clip=0.5)`` does not have."""
    from privgrad.mechanisms import mechanism_spec

    spec = mechanism_spec(name)
    accepted = [o.name for o in spec.option_infos()]
    unknown = sorted(k for k, v in options.items() if k not in accepted and v is not None)
    if not unknown:
        return
    said = "; ".join(
        k + (f" ({_KEYWORD_HINTS[k]})" if k in _KEYWORD_HINTS else "") for k in unknown
    )
    takes = ", ".join(accepted) if accepted else "none"
    raise PrivgradError(
        f"make_private/attach got keyword(s) that neither they nor mechanism '{spec.name}' "
        f"take: {said}. Mechanism '{spec.name}' takes these options: {takes}"
    )


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must hold the model's trainable parameters, and no others that train: a
    model parameter it lacks would get its noisy gradient and never move, and one outside
    the model would never get a gradient (both silent)."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    missing, foreign = len(trainable - held), len(held - trainable)
    if missing or foreign:
        # named, since which one is often not obvious: a LoRA model's trainable head (peft's
        # modules_to_save) is left out of an optimizer built from the "lora_" parameters
        names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise PrivgradError(
            "the optimizer must hold the model's trainable parameters: "
            + (f"{missing} of the model's are missing from it" if missing else "")
            + (" and " if missing and foreign else "")
            + (f"{foreign} of its parameters are not the model's" if foreign else "")
            + (f" (missing: {shown})" if names else "")
            + " (build it from [p for p in model.parameters() if p.requires_grad]; set "
            "requires_grad=False on those you freeze)"
        )


def _check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if groups is None or [len(g["params"]) for g in groups] != [
        len(g["params"]) for g in optimizer.param_groups
    ]:
        raise PrivgradError(
            "the saved optimizer state does not match this optimizer's parameter groups"
        )


def calibrate(
    mechanism: Mechanism,
    n_layers: int,
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    target: str = "honest",
    expected_batch_size: float = 1.0,
) -> float:
    """Nominal σ that makes the honest (or, with ``target='claimed'``, the paper's) ε hit
    ``target_epsilon`` after ``steps`` steps."""
    validate_epsilon(target_epsilon)
    effective, claimed = mechanism.effective_factor(n_layers, expected_batch_size)
    factor = {"honest": effective, "claimed": claimed}.get(target)
    if factor is None:
        raise PrivgradError(f"--target must be 'honest' or 'claimed', got '{target}'")
    if factor <= 0:
        raise PrivgradError(
            f"mechanism '{mechanism.name}' gives no DP guarantee; no noise level reaches a finite ε"
        )
    # σ-independent pure-DP events the stages will report (e.g. GIP's index selection)
    pure = mechanism.pure_dp_events(steps)
    if pure:
        wanted = calibrate_with_pure_dp(
            target_epsilon,
            delta,
            sampling_rate,
            steps,
            pure,
            "best" if target == "honest" else "basic",
        )
    else:
        wanted = calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps)
    return _nominal_sigma(mechanism, n_layers, expected_batch_size, wanted, factor, target)


def _nominal_sigma(
    mechanism: Mechanism,
    n_layers: int,
    expected_batch_size: float,
    wanted: float,
    factor: float,
    target: str,
) -> float:
    """The nominal σ whose described multiplier (effective, or claimed) reaches ``wanted``:
    ``wanted / factor`` where the record is proportional to σ (every shipped mechanism), else
    the smallest σ found by bisection whose record reaches it (a plugin's noise √(σ² + τ²)
    would otherwise fall short, and ε pass its target with no step refused)."""
    saved = mechanism.noise_multiplier

    def reached(sigma: float) -> bool:
        mechanism.noise_multiplier = sigma
        record = mechanism.noise_record(n_layers, expected_batch_size)
        got = record.effective if target == "honest" else record.claimed
        return got >= wanted * (1 - 1e-12)  # σ·(σ_eff/σ) rounds a last bit below

    try:
        lo = hi = wanted / factor
        if reached(hi):
            return hi
        for _ in range(64):
            lo, hi = hi, 2 * hi
            if reached(hi):
                break
        else:
            raise PrivgradError(
                f"mechanism '{mechanism.name}': no noise multiplier up to {hi:.3g} gives the "
                f"noise multiplier {wanted:.6g} its target ε needs"
            )
        for _ in range(100):
            mid = (lo + hi) / 2
            if not lo < mid < hi:
                break
            lo, hi = (lo, mid) if reached(mid) else (mid, hi)
        return hi
    finally:
        mechanism.noise_multiplier = saved


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
    *,
    mechanism: str | Mechanism = "dpsgd",
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float = 1e-5,
    epochs: float = 1,
    batch_size: float | None = None,
    max_grad_norm: float | None = None,
    target: str = "honest",
    seed: int | None = None,
    loss_fn=None,
    device: str | torch.device | None = None,
    distributed: Distributed | None = None,
    strict: bool = False,
    allow_over_budget: bool = False,
    flags: EngineFlags | None = None,
    max_physical_batch_size: int | None = None,
    precision: str = "fp32",
    prior: str | os.PathLike | tuple | None = None,
    **mechanism_options,
) -> PrivateTrainer:
    """Make ``model``'s training differentially private, in Opacus' spirit.

    ``dataset`` is a pair of tensors ``(x, y)``, a ``TensorDataset``, a map-style
    ``Dataset`` of (input, label) pairs (loaded lazily, batch by batch) or a ``DataLoader``
    (its dataset, collate_fn and workers are kept, its sampler is replaced; a custom
    sampler is refused). Batches are Poisson-sampled with expected size ``batch_size``
    (default: the DataLoader's batch size, else 256), so q = batch_size / len(dataset).
    ``mechanism`` is a name from
    ``privgrad.mechanisms.MECHANISMS`` (clipping norm ``max_grad_norm``, default 1.0) or a
    built :class:`Mechanism`, which carries its own clipping norm (passing
    ``max_grad_norm`` too is an error, so that no clip norm is silently ignored).
    Give either ``target_epsilon``
    (σ is calibrated for ``epochs`` epochs) or ``noise_multiplier``. ``device`` ('cpu',
    'cuda', 'auto' or a torch.device) moves the model there; batches and noise follow
    (default: where the model is). ``distributed`` (a
    :class:`privgrad.distributed.Distributed`) makes this process one rank of a
    data-parallel run: it samples only its shard and its clipped sums are all-reduced.
    An example whose per-sample gradient is not finite contributes zero and is counted
    (``trainer.nonfinite_examples``); ``strict=True`` makes it an error instead. With
    ``target_epsilon``, a step past the ``epochs`` σ was calibrated for is refused (ε would
    pass the target) unless ``allow_over_budget=True``. ``max_physical_batch_size`` bounds
    the examples whose per-sample gradients are computed at once: a larger Poisson batch is
    stepped on in chunks, with the same noise and ε (:class:`PrivateTrainer`). ``precision``
    ('fp32', 'bf16' or 'fp16') runs the forward and backward under autocast; per-sample
    norms, clipping, noise and the update stay fp32 (:class:`~privgrad.per_sample.GradSampler`).
    ``seed`` seeds the Poisson sampling and the noise, for a reproducible run whose ε holds
    while the seed stays secret; unset (the default), a secret one is drawn from the OS
    (:mod:`privgrad.seeds`), kept in :meth:`PrivateTrainer.state_dict` for resuming.
    ``prior``: a model holding weights a privgrad run saved (loaded with
    :func:`privgrad.model_file.load_model`, or saved earlier by this process) is refused
    unless ``prior`` says how that run counts: the path of those weights (or their
    ``.privacy.json``), whose privacy events are then composed into this run's ε (with a
    ``noise_multiplier``; a ``target_epsilon`` is not calibrated across runs), or
    ``"disjoint"``, a statement that this run's data shares no example with that run's
    (``("disjoint", path)`` names that run's record where privgrad cannot find it, as for
    ``peft`` adapters, so that this run's record keeps its events for a later run).

    Example::

        private = privgrad.make_private(model, optimizer, loader, target_epsilon=1.0,
                                        epochs=10, max_grad_norm=1.0, device="auto")
        for epoch in range(10):
            for batch in private.batches():
                private.step(batch)
        print(private.epsilon())
    """
    if (target_epsilon is None) == (noise_multiplier is None):
        noiseless = getattr(mechanism, "name", mechanism) == "non-private"
        raise PrivgradError(
            "give exactly one of target_epsilon and noise_multiplier"
            + (
                " (mechanism 'non-private' adds no noise: noise_multiplier=0, ε = ∞)"
                if noiseless and target_epsilon is None
                else ""
            )
        )
    if noise_multiplier is not None and not (
        isinstance(noise_multiplier, (int, float))
        and not isinstance(noise_multiplier, bool)
        and 0 <= noise_multiplier < math.inf
    ):
        raise PrivgradError(
            f"the noise multiplier must be a finite number ≥ 0, got {noise_multiplier!r}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise PrivgradError(
            "the model has no trainable parameters (none with requires_grad=True): there is "
            "nothing to train"
        )
    prior_run = _resolve_prior(model, prior, delta)
    if prior_run.composed and target_epsilon is not None:
        raise PrivgradError(
            "target_epsilon cannot be calibrated across a prior run (prior=PATH): give "
            "noise_multiplier (privgrad train --noise-multiplier); trainer.epsilon() counts "
            "both runs' steps"
        )
    source = training_source(dataset)  # checks a DataLoader's sampling first
    check_copies(source)  # one record oversampled in memory (warns: equal records may be two)
    check_standardised(source)  # inputs scaled by the training set's own statistics (warns)
    loader_batch = dataset.batch_size if isinstance(dataset, torch.utils.data.DataLoader) else None
    if batch_size is not None and loader_batch is not None and batch_size != loader_batch:
        raise PrivgradError(
            f"batch_size={batch_size} and the DataLoader's batch_size={loader_batch} "
            "disagree; give one (it is the expected Poisson batch size)"
        )
    if (
        batch_size is None
        and isinstance(dataset, torch.utils.data.DataLoader)
        and loader_batch is None
    ):
        raise PrivgradError(
            "the DataLoader has no batch_size (it has a batch_sampler); give batch_size= "
            "(the expected Poisson batch size)"
        )
    batch_size = batch_size or loader_batch or 256
    if isinstance(mechanism, Mechanism):
        if mechanism_options or max_grad_norm is not None:
            raise PrivgradError(
                "a built mechanism carries its own options and clipping norm; "
                "pass them to build_mechanism"
            )
        mech = mechanism
        if noise_multiplier is not None:
            mech.noise_multiplier = noise_multiplier
    else:
        _check_mechanism_keywords(mechanism, mechanism_options)
        mech = build_mechanism(
            mechanism,
            noise_multiplier or 0.0,
            1.0 if max_grad_norm is None else max_grad_norm,
            **mechanism_options,
        )
        if noise_multiplier and mech.noise_stage is None:  # was dropped without a word
            raise PrivgradError(
                f"mechanism {mech.name!r} adds no noise, so noise_multiplier="
                f"{noise_multiplier:g} would be ignored: pass noise_multiplier=0 (ε = ∞)"
            )
    trainer = PrivateTrainer(
        model,
        optimizer,
        source,
        mech,
        batch_size,
        delta,
        seed,
        loss_fn,
        device,
        distributed,
        strict,
        flags,
        max_physical_batch_size,
        precision,
        prior_run,
    )
    if target_epsilon is None and noise_multiplier < 0:
        raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
    if not (isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0):
        raise PrivgradError(f"epochs must be a finite number > 0, got {epochs!r}")
    steps = max(1, round(epochs * trainer.sampler.steps_per_epoch))
    if steps > MAX_STEPS:
        raise PrivgradError(
            f"{epochs:g} epochs of {trainer.sampler.steps_per_epoch} steps are {steps} steps, "
            f"more than privgrad's limit of {MAX_STEPS} (the accountant's time and memory grow "
            "with the steps)"
        )
    n = trainer.sampler.dataset_size
    if delta >= 1 / n:
        warn_user(
            f"δ = {delta:g} is not below 1/n = 1/{n}: a mechanism that releases one example "
            f"outright meets (ε, δ)-DP at this δ; use δ < 1/n (e.g. 1e-5 for {n} examples)"
        )
    if isinstance(trainer.data, DatasetSource):
        trainer.data.check_collate()  # a collate_fn that mixes examples (the probe's blind spot)
        check_items(trainer.data.dataset)  # a __getitem__ that mixes examples (MixUp in one)
    check_trainer(trainer)  # refuses a model or loss that mixes examples, before calibration's work
    trainer._watch_buffers()  # the buffers the check saw no forward write stay unwritten
    trainer._note_loss_state()  # loss_fn's tensors stay as the check saw them (no queue)
    mech.plan(trainer.plan_context(steps, target_epsilon))  # GIP's k(t), ε₂; spectral geometry
    if target_epsilon is not None:
        mech.noise_multiplier = calibrate(
            mech,
            trainer.n_layers,
            target_epsilon,
            delta,
            trainer.sampling_rate,
            steps,
            target,
            trainer.sampler.expected_batch_size,
        )
    noise = mech.noise_record(trainer.n_layers, trainer.sampler.expected_batch_size)
    if (
        noise.effective > 0
    ):  # the accountant must be able to give ε for the whole run (before any step)
        check_pld_size([(trainer.sampler.event(noise.effective), steps)])
    trainer.prior = prior_run
    trainer.target_epsilon, trainer.planned_steps = target_epsilon, steps
    trainer.planned_sigma = mech.noise_multiplier
    trainer._described = (mech.noise_multiplier, noise)
    trainer.allow_over_budget = allow_over_budget
    return trainer
