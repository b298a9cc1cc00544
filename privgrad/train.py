"""``privgrad train``: one private training run, recorded in the run store."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from . import __version__
from .accounting import validate_delta, validate_epsilon
from .console import status
from .data import load_dataset
from .defaults import MECHANISM_DEFAULTS, default_batch_size
from .errors import PrivgradError
from .mechanisms import MECHANISMS, build_mechanism
from .models import build_model
from .optim import build_optimizer
from .private import NEIGHBOURING, make_private
from .store import RunStore, git_commit, recorded_run


@dataclass
class TrainConfig:
    mechanism: str = "dpsgd"
    dataset: str = "mnist"
    model: str = "cnn"
    epsilon: float | None = None      # None (and no noise_multiplier): the mechanism's default
    delta: float = 1e-5
    noise_multiplier: float | None = None
    target: str = "honest"            # calibrate σ for the honest ε, or for the paper's claimed ε
    epochs: float = 20
    batch_size: float | None = None   # expected (Poisson) batch size; None: default_batch_size
    lr: float | None = None           # lr, momentum, clip: None is the mechanism's default
    optimizer: str | None = None      # (privgrad/defaults.py); optimizer: the mechanism's own
    momentum: float | None = None
    clip: float | None = None
    activation: str = "tanh"
    activation_params: dict = field(default_factory=dict)  # tempered sigmoid: scale, temperature, offset
    seed: int = 0
    limit_train: int | None = None
    validation: int = 0               # hold out this many training examples and evaluate on them
    data_dir: str | None = None
    mechanism_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)  # e.g. block_size of block-circulant layers

    def validate(self) -> None:
        if self.noise_multiplier is not None:
            if self.noise_multiplier < 0 or not math.isfinite(self.noise_multiplier):
                raise PrivgradError(f"the noise multiplier must be ≥ 0, got {self.noise_multiplier}")
        elif self.epsilon is not None:
            validate_epsilon(self.epsilon)
        validate_delta(self.delta)
        for name in ("epochs", "batch_size", "lr", "clip"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise PrivgradError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise PrivgradError(f"--momentum must lie in [0, 1), got {self.momentum}")
        if isinstance(self.validation, bool) or not isinstance(self.validation, int) or self.validation < 0:
            raise PrivgradError(f"--validation must be an integer ≥ 0, got {self.validation!r}")

    def with_defaults(self, train_size: int) -> "TrainConfig":
        """This configuration with every option left at None set from the mechanism's row of
        privgrad.defaults.MECHANISM_DEFAULTS; the batch size from the training-set size."""
        row = MECHANISM_DEFAULTS.get(self.mechanism)
        unset = [name for name in ("lr", "momentum", "clip") if getattr(self, name) is None]
        if row is None and self.mechanism not in MECHANISMS:
            raise PrivgradError(f"unknown mechanism '{self.mechanism}'; choose from: {', '.join(MECHANISMS)}")
        if row is None and (unset or (self.epsilon is None and self.noise_multiplier is None)):
            raise PrivgradError(f"mechanism '{self.mechanism}' has no defaults (privgrad/defaults.py); "
                                "give lr, momentum, clip and epsilon or noise_multiplier")
        values = {name: getattr(row, name) for name in unset}
        if self.epsilon is None and self.noise_multiplier is None:
            values.update({"epsilon": row.epsilon} if row.epsilon is not None else {"noise_multiplier": 0.0})
        if self.batch_size is None:
            values["batch_size"] = default_batch_size(train_size)
        return dataclasses.replace(self, **values)


VALIDATION_SEED = 20_240_501  # one fixed split for every run, whatever its seed


def split_validation(train_x: torch.Tensor, train_y: torch.Tensor, n: int):
    """(train_x, train_y, val_x, val_y): ``n`` training examples chosen by a fixed,
    run-independent permutation are held out, for hyper-parameter search that never looks
    at the test set. The rest keep their order."""
    if n == 0:
        return train_x, train_y, None, None
    if n >= len(train_x):
        raise PrivgradError(f"--validation {n} leaves no training data (the training set has {len(train_x)})")
    perm = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(VALIDATION_SEED))
    held = torch.zeros(len(train_x), dtype=torch.bool)
    held[perm[:n]] = True
    return train_x[~held], train_y[~held], train_x[held], train_y[held]


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000) -> float:
    model.eval()
    correct = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
                  for i in range(0, len(x), batch))
    return correct / max(1, len(x))


def train(config: TrainConfig, store: RunStore | None = None, progress: bool = True,
          command: str | None = None) -> dict:
    """Runs ``config`` and returns its run record (the object ``--json`` prints)."""
    config.validate()
    torch.manual_seed(config.seed)
    data = load_dataset(config.dataset, config.data_dir, config.limit_train)
    train_x, train_y, val_x, val_y = split_validation(data.train_x, data.train_y, config.validation)
    config = config.with_defaults(len(train_x))
    eval_x, eval_y = (val_x, val_y) if config.validation else (data.test_x, data.test_y)
    metric = "validation_accuracy" if config.validation else "test_accuracy"
    model = build_model(config.model, data.input_shape, data.num_classes, act=config.activation,
                        num_tokens=data.num_tokens, act_params=config.activation_params,
                        **config.model_options)
    started = time.time()
    with recorded_run(store, dataclasses.asdict(config)) as run_id:
        mechanism = build_mechanism(config.mechanism, 0.0, config.clip, **config.mechanism_options)
        optimizer_name = config.optimizer or mechanism.optimizer
        optimizer = build_optimizer(optimizer_name, model.parameters(), config.lr, config.momentum)
        if progress and config.noise_multiplier is None:
            status(f"calibrating σ for {config.target} ε = {config.epsilon:g} at δ = {config.delta:g} "
                   f"({len(train_x)} examples, expected batch {config.batch_size:g}) …")
        private = make_private(
            model, optimizer, (train_x, train_y), mechanism=mechanism,
            target_epsilon=config.epsilon if config.noise_multiplier is None else None,
            noise_multiplier=config.noise_multiplier, delta=config.delta, epochs=config.epochs,
            batch_size=config.batch_size, target=config.target,
            seed=config.seed)
        total_steps = max(1, round(config.epochs * private.sampler.steps_per_epoch))
        per_epoch = private.sampler.steps_per_epoch
        bar = tqdm(total=total_steps, disable=not progress, unit="step", dynamic_ncols=True,
                   desc=f"{config.mechanism} {config.dataset}")
        accuracy, epoch, losses, overlaps = math.nan, 0, [], []
        while private.steps < total_steps:
            steps = min(per_epoch, total_steps - private.steps)
            for xb, yb in private.batches(steps):
                losses.append(private.step(xb, yb))
                selection = private.last_extra.get("index_selection") or {}
                if selection.get("kept") and "swaps" in selection:  # GIP: the private top-k mask
                    overlaps.append((1 - selection["swaps"] / selection["kept"], selection["k"]))
                bar.update(1)
            epoch += 1
            accuracy = evaluate(model, eval_x, eval_y)
            eps = private.epsilon()
            metrics = {"loss": _nanmean(losses), metric: accuracy, "epsilon": eps,
                       "steps": private.steps}
            losses = []
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{accuracy:.4f}", eps=_fmt_eps(eps))
            if store:
                store.log_epoch(run_id, epoch, metrics)
        bar.close()
        record = run_record(config, private, accuracy, optimizer_name, time.time() - started,
                            len(train_x), command)
        if overlaps:  # fraction of the kept coordinates that are true top-k (random mask: k)
            record["topk_overlap_mean"] = sum(o for o, _ in overlaps) / len(overlaps)
            record["topk_overlap_if_random"] = sum(k for _, k in overlaps) / len(overlaps)
        if store:
            store.finish(run_id, record)
            record["run_id"] = run_id
        return record


def run_record(config: TrainConfig, private, accuracy: float, optimizer_name: str,
               wall_time: float, train_size: int, command: str | None) -> dict:
    mech = private.mechanism
    noise = mech.noise_record(private.n_layers, private.sampler.expected_batch_size)
    eps = private.epsilon()
    eps_claimed = private.epsilon_claimed()
    return {
        "mechanism": config.mechanism, "dataset": config.dataset, "model": config.model,
        "test_accuracy": None if config.validation else accuracy,
        **({"validation_accuracy": accuracy, "validation_size": config.validation} if config.validation else {}),
        "epsilon": eps, "epsilon_claimed": eps_claimed,
        "epsilon_rdp": private.epsilon("rdp"),
        "dp_guarantee": math.isfinite(eps),
        "delta": config.delta, "accountant": "pld", "neighbouring": NEIGHBOURING,
        "noise_multiplier": mech.noise_multiplier,
        "effective_noise_multiplier": noise.effective,
        "sampling_rate": private.sampling_rate, "steps": private.steps,
        "epochs": config.epochs, "seed": config.seed, "wall_time_s": round(wall_time, 2),
        "batch_size": config.batch_size, "clip": config.clip, "lr": config.lr,
        "optimizer": optimizer_name, "momentum": config.momentum if optimizer_name == "sgd" else None,
        "activation": config.activation, "activation_params": config.activation_params,
        "target": config.target, "train_size": train_size,
        "mechanism_options": config.mechanism_options, "model_options": config.model_options,
        "privgrad_version": __version__, "git_commit": git_commit(), "command": command,
    }


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _fmt_eps(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:.3f}"
