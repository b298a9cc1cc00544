"""``privgrad train``: one private training run, recorded in the run store.

With a run store, the run is checkpointed after every epoch and when it is stopped
(Ctrl-C, SIGTERM) to ``checkpoints/<run_id>/`` next to the store; :func:`resume` continues
it to its planned end, bit-identically to a run that was never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils.data._utils.collate import default_collate
from tqdm.auto import tqdm

from privgrad.accounting import validate_delta, validate_epsilon
from privgrad.batches import inputs_and_labels, training_source
from privgrad.data_checks import COPIES_WARNING
from privgrad.app.checkpoint import (
    checkpoint_dir,
    clear_run_folder,
    load_checkpoint,
    save_checkpoint,
)
from privgrad.app.console import status
from privgrad.app.data import DATASETS, load_dataset, loader_options
from privgrad.app.defaults import MECHANISM_DEFAULTS, default_batch_size
from privgrad.device import resolve_device
from privgrad.distributed import Distributed
from privgrad.errors import PlanDeclined, PrivgradError
from privgrad.inputs import call_model, example_shape, take, to_device
from privgrad.app.export import build_from_recipe, privacy_of_run, rebuild_recipe
from privgrad.app.guidance import plan_guidance
from privgrad.model_file import hf_folder_path, save_model as save_model_file
from privgrad.mechanisms import MECHANISMS, build_mechanism
from privgrad.app.metrics import MetricsLog
from privgrad.optim import build_optimizer
from privgrad.per_sample import EngineFlags
from privgrad.app.plugins import PREFIX as PYTHON, user_datasets
from privgrad.private import NEIGHBOURING, events_record, make_private, trained_parameters
from privgrad.seeds import secret_seed, seed_source
from privgrad.signals import deferred_interrupts
from privgrad.app.store import RunStore, recorded_run
from privgrad.records import code_version, provenance, to_json

IMAGEFOLDER = "imagefolder:"


@dataclass
class TrainConfig:
    mechanism: str = "dpsgd"
    dataset: str = "mnist"
    model: str = "cnn"
    epsilon: float | None = None  # None (and no noise_multiplier): the mechanism's default
    delta: float = 1e-5
    noise_multiplier: float | None = None
    target: str = "honest"  # calibrate σ for the honest ε, or for the paper's claimed ε
    prior: str | None = None  # make_private's prior=: a saved run the model's weights come from
    epochs: float = 20
    batch_size: float | None = None  # expected (Poisson) batch size; None: default_batch_size
    lr: float | None = None  # lr, momentum, clip: None is the mechanism's default
    optimizer: str | None = None  # (privgrad/app/defaults.py); optimizer: the mechanism's own
    momentum: float | None = None
    clip: float | None = None
    activation: str = "tanh"
    activation_params: dict = field(
        default_factory=dict
    )  # tempered sigmoid: scale, temperature, offset
    seed: int | None = None  # None: a secret seed drawn from the OS (privgrad.seeds)
    limit_train: int | None = None
    limit_test: int | None = None  # evaluate on a fixed sample of N test examples (smoke runs)
    validation: int = 0  # hold out this many training examples and evaluate on them
    data_dir: str | None = None
    mechanism_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)  # e.g. block_size of block-circulant layers
    dataset_options: dict = field(default_factory=dict)  # IMDB's vocab_size, max_len
    device: str = "auto"  # cpu, cuda, cuda:N or auto (CUDA when available)
    precision: str = "fp32"  # forward/backward under autocast (fp32, bf16, fp16)

    def validate(self) -> None:
        from privgrad.validate import MAX_NOISE_MULTIPLIER, check_numbers, validate_precision

        self._check_types()
        if self.noise_multiplier is not None:
            if not 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER:
                raise PrivgradError(
                    f"the noise multiplier must lie in [0, {MAX_NOISE_MULTIPLIER:g}], "
                    f"got {self.noise_multiplier}"
                )
            if self.epsilon is not None:
                raise PrivgradError("give one of --epsilon and --noise-multiplier, not both")
        elif self.epsilon is not None:
            validate_epsilon(self.epsilon)
        validate_delta(self.delta)
        for name in ("epochs", "batch_size", "lr", "clip"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise PrivgradError(
                    f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise PrivgradError(f"--momentum must lie in [0, 1), got {self.momentum}")
        if (
            isinstance(self.validation, bool)
            or not isinstance(self.validation, int)
            or self.validation < 0
        ):
            raise PrivgradError(f"--validation must be an integer ≥ 0, got {self.validation!r}")
        check_numbers("train", {"--limit-test": self.limit_test})
        resolve_device(self.device)
        validate_precision(self.precision, "--precision")
        unknown = [k for k in self.dataset_options if k not in loader_options(self.dataset)]
        if unknown:  # in the command line's words (load_dataset's own refusal is the API's)
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in unknown)
            takers = [n for n in DATASETS if set(unknown) <= set(loader_options(n))]
            raise PrivgradError(
                f"{flags} appl{'ies' if len(unknown) == 1 else 'y'} to --dataset "
                f"{' or '.join(takers)}"
                if takers
                else f"{flags}: no dataset takes {'it' if len(unknown) == 1 else 'them'}"
            )

    _NUMBERS = (
        "epsilon",
        "delta",
        "noise_multiplier",
        "epochs",
        "batch_size",
        "lr",
        "momentum",
        "clip",
    )
    _TYPES = {
        "mechanism": str,
        "dataset": str,
        "model": str,
        "target": str,
        "activation": str,
        "device": str,
        "optimizer": (str, type(None)),
        "data_dir": (str, type(None)),
        "seed": (int, type(None)),
        "limit_train": (int, type(None)),
        "limit_test": (int, type(None)),
        "validation": int,
        "activation_params": dict,
        "mechanism_options": dict,
        "model_options": dict,
        "dataset_options": dict,
    }

    def _check_types(self) -> None:
        """Refuses (one line) a field of the wrong type, e.g. ``epochs = "twenty"`` in an
        experiment config, before a comparison with it raises a TypeError."""
        for name in self._NUMBERS:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise PrivgradError(f"{name} must be a number, got {value!r}")
        import os

        for name, kind in self._TYPES.items():
            value = getattr(self, name)
            if name == "data_dir" and isinstance(value, os.PathLike):
                continue
            if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
                names = " or ".join(
                    "None" if k is type(None) else k.__name__
                    for k in (kind if isinstance(kind, tuple) else (kind,))
                )
                raise PrivgradError(f"{name} must be {names}, got {value!r}")

    def with_defaults(self, train_size: int) -> "TrainConfig":
        """This configuration with every option left at None set from the mechanism's row of
        privgrad.app.defaults.MECHANISM_DEFAULTS; the batch size from the training-set size."""
        row = MECHANISM_DEFAULTS.get(self.mechanism)
        unset = [name for name in ("lr", "momentum", "clip") if getattr(self, name) is None]
        if row is None and self.mechanism not in MECHANISMS:
            own = (
                f"; a mechanism of your own is named in the environment "
                f"(PRIVGRAD_MECHANISMS={self.mechanism}), which adds its options' flags, and "
                "chosen by its name"
                if self.mechanism.startswith("python:")
                else ""
            )
            raise PrivgradError(
                f"unknown mechanism '{self.mechanism}'; choose from: {', '.join(MECHANISMS)}{own}"
            )
        if row is None and (unset or (self.epsilon is None and self.noise_multiplier is None)):
            raise PrivgradError(
                f"mechanism '{self.mechanism}' has no defaults (privgrad/app/defaults.py); "
                "give lr, momentum, clip and epsilon or noise_multiplier"
            )
        values = {name: getattr(row, name) for name in unset}
        if self.epsilon is None and self.noise_multiplier is None:
            values.update(
                {"epsilon": row.epsilon} if row.epsilon is not None else {"noise_multiplier": 0.0}
            )
        if self.batch_size is None:
            values["batch_size"] = default_batch_size(train_size, self.epochs)
        return dataclasses.replace(self, **values)


VALIDATION_SEED = 20_240_501  # one fixed split for every run, whatever its seed
TEST_SAMPLE_SEED = 20_261_127  # one fixed --limit-test sample for every run


def _fixed_sample(size: int, n: int, seed: int) -> torch.Tensor:
    """Mask of the ``n`` of ``size`` examples that a fixed, run-independent permutation picks
    (not the first ``n``: a test set may be sorted by label, as IMDB's is)."""
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(size, dtype=torch.bool)
    mask[perm[:n]] = True
    return mask


def _held_out(size: int, n: int) -> torch.Tensor:
    """Mask of the ``n`` examples the validation split holds out."""
    if n >= size:
        raise PrivgradError(
            f"--validation {n} leaves no training data (the training set has {size})"
        )
    return _fixed_sample(size, n, VALIDATION_SEED)


def _test_sample(size: int, limit_test: int | None) -> torch.Tensor | slice:
    """The test examples a run evaluates on: all, or ``limit_test`` of them (a fixed sample)."""
    if limit_test is None or limit_test >= size:
        return slice(None)
    return _fixed_sample(size, limit_test, TEST_SAMPLE_SEED)


def split_validation(train_x: torch.Tensor, train_y: torch.Tensor, n: int):
    """(train_x, train_y, val_x, val_y): ``n`` training examples chosen by a fixed,
    run-independent permutation are held out, for hyper-parameter search that never looks
    at the test set. The rest keep their order."""
    if n == 0:
        return train_x, train_y, None, None
    held = _held_out(len(train_x), n)
    return train_x[~held], train_y[~held], train_x[held], train_y[held]


def load_training_data(config: TrainConfig) -> dict:
    """train (tensors or a Dataset), eval (the validation set, or the test set: all of
    it, or a fixed sample of ``limit_test`` examples), input_shape,
    num_classes, num_tokens of ``config.dataset``: a built-in name, ``imagefolder:PATH`` or
    ``python:module:function``."""
    if config.dataset.startswith((IMAGEFOLDER, PYTHON)):
        from torch.utils.data import Subset

        if config.dataset.startswith(IMAGEFOLDER):
            from privgrad.app.data.folder import load_image_folder

            train, test, num_classes = load_image_folder(config.dataset[len(IMAGEFOLDER) :])
        else:
            train, test, num_classes = user_datasets(config.dataset)
        if config.limit_train is not None and config.limit_train < len(train):
            train = Subset(train, range(config.limit_train))
        if config.validation:
            held = _held_out(len(train), config.validation)
            train, test = (
                Subset(train, (~held).nonzero().flatten().tolist()),
                Subset(train, held.nonzero().flatten().tolist()),
            )
        elif isinstance(sample := _test_sample(len(test), config.limit_test), torch.Tensor):
            test = Subset(test, sample.nonzero().flatten().tolist())
        return {
            "train": train,
            "eval": test,
            "input_shape": example_shape(inputs_and_labels(default_collate([train[0]]))[0]),
            "num_classes": num_classes,
            "num_tokens": None,
        }
    data = load_dataset(
        config.dataset, config.data_dir, config.limit_train, **config.dataset_options
    )
    train_x, train_y, val_x, val_y = split_validation(data.train_x, data.train_y, config.validation)
    test = _test_sample(len(data.test_y), config.limit_test)
    return {
        "train": (train_x, train_y),
        "eval": (val_x, val_y)
        if config.validation
        else (take(data.test_x, test), data.test_y[test]),
        "input_shape": data.input_shape,
        "num_classes": data.num_classes,
        "num_tokens": data.num_tokens,
    }


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data,
    device: torch.device | None = None,
    batch: int = 2000,
    progress=None,
) -> float:
    """Accuracy on ``data``: (inputs, labels) tensors, or a Dataset of (input, label) pairs or
    of dicts with ``labels``, computed on ``device`` (default: the model's); NaN for an empty
    set. ``progress``: a tqdm bar (anything with ``update(n)``) told each batch's examples."""
    model.eval()
    device = device or next(model.parameters()).device
    if isinstance(data, tuple):
        x, y = data
        batches = (
            (take(x, slice(i, i + batch)), y[i : i + batch]) for i in range(0, len(y), batch)
        )
    else:
        from torch.utils.data import DataLoader

        loader = DataLoader(data, batch_size=batch, generator=torch.Generator())
        batches = (inputs_and_labels(out) for out in loader)
    correct = total = 0
    for xb, yb in batches:
        logits = call_model(model, to_device(xb, device))
        correct += int((logits.argmax(1) == yb.to(device)).sum())
        total += len(yb)
        if progress is not None:
            progress.update(len(yb))
    return correct / total if total else math.nan  # no examples: no accuracy (printed as n/a)


def _run_seed(config: TrainConfig, resume_from, distributed) -> int:
    """The run's seed: the one given, or on resume the secret one its checkpoint holds, or a
    new secret one (:func:`privgrad.seeds.secret_seed`). It seeds the model's initialisation,
    the sampling and the noise; the run store's configuration keeps it unset."""
    if config.seed is not None:
        return config.seed
    if resume_from is not None:
        saved = resume_from[1]["trainer"].get("seed")
        if not isinstance(saved, int):
            raise PrivgradError(
                f"the checkpoint of run {resume_from[0]} holds no seed; it is not loaded"
            )
        return saved
    return secret_seed(distributed)


def train(
    config: TrainConfig,
    store: RunStore | None = None,
    progress: bool = True,
    command: str | None = None,
    resume_from: tuple[int, dict] | None = None,
    distributed: Distributed | None = None,
    save_model: str | None = None,
    tensorboard: str | None = None,
    strict: bool = False,
    confirm_plan=None,
    physical_batch_size: int | None = None,
    cuda_graphs: bool = False,
) -> dict | None:
    """Runs ``config`` and returns its run record (the object ``--json`` prints); with
    ``resume_from`` (run id, checkpoint; use :func:`resume`), continues that run. With
    ``save_model`` the trained weights and their privacy record are written there
    (:mod:`privgrad.model_file`). With a store, the run's steps and epochs are written to its run
    folder as CSV (:mod:`privgrad.app.metrics`), and with ``tensorboard`` to TensorBoard too.
    ``strict`` makes a non-finite per-sample gradient an error instead of a dropped example
    (not part of the configuration: it changes nothing in a run that has none).
    ``physical_batch_size`` steps on a Poisson batch in chunks of at most that many examples
    (``make_private``'s ``max_physical_batch_size``): memory only, the same noise and ε, so
    not part of the configuration either; the record says it. ``cuda_graphs`` replays the
    steps as CUDA graphs (``EngineFlags(cuda_graphs=True)``, :mod:`privgrad.graphed`): speed
    and memory only, so likewise; it needs a CUDA device.

    With ``distributed`` this process is one rank of a data-parallel run: only rank 0
    evaluates, computes ε, writes ``store`` and checkpoints and returns the record (other
    ranks: None)."""
    if cuda_graphs and resolve_device(config.device).type != "cuda":
        raise PrivgradError(
            f"--cuda-graphs needs a CUDA device; this run would train on "
            f"{resolve_device(config.device)} (--device {config.device})"
        )
    main = distributed is None or distributed.is_main
    if not main:
        store, progress = None, False
    config.validate()
    seed = _run_seed(config, resume_from, distributed)
    torch.manual_seed(seed)
    data = load_training_data(config)
    train_size = len(data["train"][0]) if isinstance(data["train"], tuple) else len(data["train"])
    config = config.with_defaults(train_size)
    metric = "validation_accuracy" if config.validation else "test_accuracy"
    recipe = rebuild_recipe(
        dataclasses.asdict(config), data["input_shape"], data["num_classes"], data["num_tokens"]
    )
    model = build_from_recipe(recipe)
    started = time.time()
    with recorded_run(
        store, dataclasses.asdict(config), run_id=resume_from and resume_from[0]
    ) as run_id:
        mechanism = build_mechanism(config.mechanism, 0.0, config.clip, **config.mechanism_options)
        optimizer_name = config.optimizer or mechanism.optimizer
        optimizer = build_optimizer(optimizer_name, model.parameters(), config.lr, config.momentum)
        # all labels of in-memory data, else those the independence probe reads; each batch's below
        train_labels = (
            data["train"][1]
            if isinstance(data["train"], tuple)
            else next(
                iter(training_source(data["train"]).load([torch.arange(min(4, train_size))]))
            )[1]
        )
        check_labels(train_labels, data["num_classes"])
        if progress and config.noise_multiplier is None:
            status(
                f"calibrating σ for {config.target} ε = {config.epsilon:g} at δ = {config.delta:g} "
                f"({train_size} examples, expected batch {config.batch_size:g}) …"
            )
        with warnings.catch_warnings():
            if not config.dataset.startswith((IMAGEFOLDER, PYTHON)):  # the published rows:
                # Adult's and IMDB's equal rows are the dataset's own (guide: the data)
                warnings.filterwarnings("ignore", message=f".*{COPIES_WARNING}")
            private = make_private(
                model,
                optimizer,
                data["train"],
                mechanism=mechanism,
                target_epsilon=config.epsilon if config.noise_multiplier is None else None,
                noise_multiplier=config.noise_multiplier,
                delta=config.delta,
                epochs=config.epochs,
                batch_size=config.batch_size,
                target=config.target,
                seed=seed,
                device=config.device,
                distributed=distributed,
                strict=strict,
                max_physical_batch_size=physical_batch_size,
                precision=config.precision,
                flags=EngineFlags(cuda_graphs=True) if cuda_graphs else None,
                prior=config.prior,
            )
        check_outputs(model, private, data["num_classes"])
        total_steps = max(1, round(config.epochs * private.sampler.steps_per_epoch))
        per_epoch = private.sampler.steps_per_epoch
        # what the loop carries across epochs (checkpointed with the trainer), with the code
        # version that started the run, kept through resumes
        loop = {
            "epoch": 0,
            "losses": [],
            "overlaps": [],
            "accuracy": math.nan,
            "elapsed": 0.0,
            "command": command,
            "resumes": 0,
            "code_version": code_version(),
        }
        folder = checkpoint_dir(store.path, run_id) if store else None
        if folder is not None and resume_from is None:
            clear_run_folder(folder)
        if resume_from is not None:
            saved = resume_from[1]
            if private.device.type == "cuda" and not isinstance(
                saved.get("cuda_rng"), torch.Tensor
            ):
                raise PrivgradError(
                    f"the checkpoint of run {run_id} holds no CUDA RNG state (written on "
                    "the CPU?); resume it with --device cpu"
                )
            try:
                private.load_state_dict(saved["trainer"])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
                raise PrivgradError(
                    f"the checkpoint of run {run_id} is malformed ({type(err).__name__}: "
                    f"{err}); it is not loaded"
                ) from None
            loop = {
                "code_version": None,  # a checkpoint written before the loop carried it
                **saved["loop"],
                "resumes": saved["loop"]["resumes"] + 1,
            }
            try:
                torch.set_rng_state(saved["torch_rng"])
                if private.device.type == "cuda":
                    torch.cuda.set_rng_state(saved["cuda_rng"], private.device)
            except (RuntimeError, TypeError) as err:
                raise PrivgradError(
                    f"the checkpoint of run {run_id} holds no valid RNG state ({err})"
                ) from None

        made_by = provenance()  # of the code writing the checkpoints (a stopped run's export)

        def checkpoint(epsilon: float | None = None):
            if log:
                log.flush()
                log.progress(
                    private.steps,
                    total_steps,
                    private.epsilon() if epsilon is None else epsilon,
                    private.epsilon_claimed(),
                )
            if folder is not None:
                save_checkpoint(
                    folder,
                    {
                        "config": dataclasses.asdict(config),
                        "model_recipe": recipe,  # privgrad export of a stopped run rebuilds it
                        "made_by": made_by,
                        "effective_noise_multiplier": sigma_eff,
                        "trained_parameters": trained_parameters(model),  # for export's record
                        "trainer": private.state_dict(),
                        "loop": {**loop, "elapsed": loop["elapsed"] + time.time() - started},
                        "torch_rng": torch.get_rng_state(),
                        **(
                            {"cuda_rng": torch.cuda.get_rng_state(private.device)}
                            if private.device.type == "cuda"
                            else {}
                        ),
                    },
                )

        log = (
            MetricsLog(folder, run_id, private.steps, loop["epoch"], tensorboard)
            if folder is not None
            else None
        )
        sigma_eff = private.mechanism.noise_record(
            private.n_layers, private.sampler.expected_batch_size
        ).effective
        advice = None
        if main and sigma_eff > 0:  # the plan's noise-to-signal (privgrad/app/guidance.py)
            advice = plan_guidance(
                sigma_eff,
                private.sampler.expected_batch_size,
                sum(p.numel() for p in model.parameters() if p.requires_grad),
                train_size,
                total_steps,
                config.epsilon,
                config.epochs,
            )
            if resume_from is None:
                status(advice.statement)
                if advice.warning:
                    print(advice.warning, file=sys.stderr, flush=True)
                    if confirm_plan is not None and not confirm_plan(advice):
                        raise PlanDeclined("not started: change the plan as the warning says")
        bar = tqdm(
            total=total_steps,
            initial=private.steps,
            disable=not progress,
            unit="step",
            dynamic_ncols=True,
            desc=f"{config.mechanism} {config.dataset}",
        )
        try:
            while loop["epoch"] < math.ceil(total_steps / per_epoch):
                end = min((loop["epoch"] + 1) * per_epoch, total_steps)
                for batch in private.batches(end - private.steps):
                    check_labels(batch.y, data["num_classes"])
                    with deferred_interrupts():  # the step and its loss/overlap: all or nothing
                        loop["losses"].append(private.step(batch))
                        if log:
                            log.step(
                                private.steps,
                                loop["epoch"] + 1,
                                loop["losses"][-1],
                                len(batch),
                                loop["elapsed"] + time.time() - started,
                            )
                        selection = private.last_facts.index_selection or {}
                        if (
                            selection.get("kept") and "swaps" in selection
                        ):  # GIP: the private top-k mask
                            loop["overlaps"].append(
                                (1 - selection["swaps"] / selection["kept"], selection["k"])
                            )
                    bar.update(1)
                if not main:
                    loop.update(epoch=loop["epoch"] + 1, losses=[])
                    continue
                accuracy = evaluate(model, data["eval"], private.device)
                eps = private.epsilon()
                metrics = {
                    "loss": _nanmean(loop["losses"]),
                    metric: accuracy,
                    "epsilon": eps,
                    "steps": private.steps,
                    "nonfinite_examples": private.nonfinite_examples,
                }
                bar.set_postfix(
                    loss=f"{metrics['loss']:.3f}", acc=f"{accuracy:.4f}", eps=_fmt_eps(eps)
                )
                with deferred_interrupts():
                    if store:
                        store.log_epoch(run_id, loop["epoch"] + 1, metrics)
                    if log:
                        log.epoch(
                            {
                                **metrics,
                                "epoch": loop["epoch"] + 1,
                                "accuracy": accuracy,
                                "evaluated_on": "validation" if config.validation else "test",
                                "delta": private.delta,
                                "effective_noise_multiplier": sigma_eff,
                                "lr": optimizer.param_groups[0]["lr"],
                                "wall_time_s": round(loop["elapsed"] + time.time() - started, 3),
                            }
                        )
                    loop.update(epoch=loop["epoch"] + 1, losses=[], accuracy=accuracy)
                    checkpoint(eps)
        except KeyboardInterrupt:
            checkpoint()
            raise
        finally:
            bar.close()
            if log:
                log.close()
        if not main:
            return None
        overlaps = loop["overlaps"]
        record = run_record(
            config,
            private,
            loop["accuracy"],
            optimizer_name,
            loop["elapsed"] + time.time() - started,
            len(private.data),
            loop["command"],
        )
        evaluated = data["eval"]
        # how many examples the accuracy is of (--limit-test: a fixed sample of the test set)
        record["evaluated_examples"] = len(
            evaluated[1] if isinstance(evaluated, tuple) else evaluated
        )
        if loop["resumes"]:
            record["resumes"] = loop["resumes"]
            if loop["code_version"] != record["code_version"]:  # resumed by other code
                record["started_by_code_version"] = loop["code_version"]
        if advice is not None:
            record["noise_to_signal"] = advice.ratio
        if overlaps:  # fraction of the kept coordinates that are true top-k (random mask: k)
            record["topk_overlap_mean"] = sum(o for o, _ in overlaps) / len(overlaps)
            record["topk_overlap_if_random"] = sum(k for _, k in overlaps) / len(overlaps)
        record["model_recipe"] = recipe
        if save_model:
            weights, sidecar = save_model_file(
                model,
                save_model,
                {
                    **privacy_of_run(record, record["model_recipe"]),
                    # what a run continuing from these weights composes (make_private's
                    # prior=): a --prior run's events too, and that run named (its ε counts
                    # them, or covers only this run's data)
                    **events_record(
                        private.prior, private.ledger.entries, private.claimed_ledger.entries
                    ),
                    "trained_parameters": trained_parameters(model),
                },
            )
            record["model_path"], record["privacy_path"] = str(weights), str(sidecar)
            if hasattr(model, "save_pretrained"):  # an hf: model: its save_pretrained folder too
                record["hugging_face_folder"] = str(hf_folder_path(weights))
        if store:
            store.finish(run_id, record)
            record["run_id"] = run_id
        return record


def check_outputs(model: torch.nn.Module, private, num_classes: int) -> None:
    """Refuses a model whose output for one training example is not one score per class
    (e.g. 3 outputs for 2 classes would train, a class never seen, and say nothing)."""
    x, _ = next(iter(private.data.load([torch.arange(1)])))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = call_model(model, to_device(x, private.device))
    finally:
        model.train(was_training)
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == (1, num_classes)):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PrivgradError(
            f"the model gives {shape} for one example; the dataset has {num_classes} classes, "
            f"so it must give (1, {num_classes}): one score per class"
        )


def check_labels(y: torch.Tensor, num_classes: int) -> None:
    """Refuses a batch whose labels are not class indices 0…K−1 (cross-entropy would skip
    −100 silently and fail mid-run on others). The step after it synchronises anyway."""
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise PrivgradError(f"labels must be integer class indices, got {y.dtype}")
    bad = y[(y < 0) | (y >= num_classes)]
    if len(bad):
        raise PrivgradError(
            f"label {int(bad[0])} is not a class index: the dataset has {num_classes} "
            f"classes, 0 to {num_classes - 1}"
        )


def resume(
    run_id: int,
    store: RunStore,
    progress: bool = True,
    save_model: str | None = None,
    tensorboard: str | None = None,
    strict: bool = False,
    physical_batch_size: int | None = None,
    cuda_graphs: bool = False,
) -> dict:
    """Continues run ``run_id`` from its checkpoint to its planned end (same run id). The
    checkpoint's hash and its configuration (against the run store's) must match."""
    run = store.train_run(run_id, "resume")
    if run["status"] == "completed":
        raise PrivgradError(f"run {run_id} is already completed")
    store.check_no_writer(run_id)  # before any work (reopen checks again, atomically)
    saved = load_checkpoint(checkpoint_dir(store.path, run_id))
    _check_checkpoint_structure(run_id, saved)
    if json.loads(to_json(saved["config"])) != run["config"]:
        raise PrivgradError(
            f"the checkpoint of run {run_id} was written for another configuration "
            "than the run store's; it is not loaded"
        )
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if set(saved["config"]) != fields:
        raise PrivgradError(
            f"the checkpoint of run {run_id} has configuration fields of another "
            "privgrad version; it is not loaded"
        )
    return train(
        TrainConfig(**saved["config"]),
        store,
        progress,
        resume_from=(run_id, saved),
        save_model=save_model,
        tensorboard=tensorboard,
        strict=strict,
        physical_batch_size=physical_batch_size,
        cuda_graphs=cuda_graphs,
    )


# what a checkpoint written by train() holds, part by part
CHECKPOINT_PARTS = {"config": dict, "trainer": dict, "loop": dict, "torch_rng": torch.Tensor}
LOOP_PARTS = {
    "epoch": int,
    "losses": list,
    "overlaps": list,
    "accuracy": (int, float),
    "elapsed": (int, float),
    "resumes": int,
}
TRAINER_PARTS = {
    "steps": int,
    "ledger": list,
    "claimed_ledger": list,
    "sampler": dict,
    "mechanism": dict,
    "model": dict,
    "optimizer": dict,
}


def _check_checkpoint_structure(run_id: int, saved) -> None:
    """Refuses (one line) a checkpoint whose hash matched but whose content is not what
    train() writes, before any part of it is used."""

    def check(where: str, value, parts: dict) -> None:
        if not isinstance(value, dict):
            raise PrivgradError(
                f"the checkpoint of run {run_id} is malformed: {where} is a "
                f"{type(value).__name__}, not a dict; it is not loaded"
            )
        for key, kind in parts.items():
            if key not in value or isinstance(value[key], bool) or not isinstance(value[key], kind):
                raise PrivgradError(
                    f"the checkpoint of run {run_id} is malformed: {where}['{key}'] is "
                    f"{'missing' if key not in value else type(value[key]).__name__}; "
                    "it is not loaded"
                )

    check("the checkpoint", saved, CHECKPOINT_PARTS)
    check("its loop state", saved["loop"], LOOP_PARTS)
    check("its trainer state", saved["trainer"], TRAINER_PARTS)
    if not isinstance(saved["loop"].get("code_version"), (str, type(None))):
        raise PrivgradError(
            f"the checkpoint of run {run_id} is malformed: its loop state's 'code_version' "
            "is not a string; it is not loaded"
        )


def run_record(
    config: TrainConfig,
    private,
    accuracy: float,
    optimizer_name: str,
    wall_time: float,
    train_size: int,
    command: str | None,
) -> dict:
    mech = private.mechanism
    noise = mech.noise_record(private.n_layers, private.sampler.expected_batch_size)
    eps = private.epsilon()
    eps_claimed = private.epsilon_claimed()
    return {
        "mechanism": config.mechanism,
        "dataset": config.dataset,
        "model": config.model,
        "test_accuracy": None if config.validation else accuracy,
        **(
            {"validation_accuracy": accuracy, "validation_size": config.validation}
            if config.validation
            else {}
        ),
        "epsilon": eps,
        "epsilon_claimed": eps_claimed,
        # the same claim composed by RDP, as the papers composed theirs (never a guarantee)
        "epsilon_claimed_rdp": private.epsilon_claimed("rdp"),
        "epsilon_rdp": private.epsilon("rdp"),
        "dp_guarantee": math.isfinite(eps),
        "delta": config.delta,
        "accountant": "pld",
        "neighbouring": NEIGHBOURING,
        "noise_multiplier": mech.noise_multiplier,
        "effective_noise_multiplier": noise.effective,
        "sampling_rate": private.sampling_rate,
        "steps": private.steps,
        "epochs": config.epochs,
        "seed": config.seed,
        "seed_source": seed_source(config.seed is not None),
        "wall_time_s": round(wall_time, 2),
        "batch_size": config.batch_size,
        "clip": config.clip,
        "lr": config.lr,
        "optimizer": optimizer_name,
        "momentum": config.momentum if optimizer_name == "sgd" else None,
        "activation": config.activation,
        "activation_params": config.activation_params,
        "target": config.target,
        "train_size": train_size,
        "world_size": private.distributed.world_size if private.distributed else 1,
        "backend": private.distributed.backend if private.distributed else None,
        "mechanism_options": config.mechanism_options,
        "model_options": config.model_options,
        "dataset_options": config.dataset_options,
        **private.prior.record(),  # --prior: the earlier run, and whether ε counts its steps
        "nonfinite_examples": private.nonfinite_examples,
        "strict": private.strict,
        "physical_batch_size": private.max_physical_batch_size,
        "cuda_graphs": private.grad_sampler.flags.cuda_graphs,
        "precision": private.grad_sampler.precision,
        **provenance(),
        "command": command,
    }


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _fmt_eps(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:.3f}"
