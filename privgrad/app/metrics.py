"""A training run's metrics as files a person plots, and as TensorBoard scalars when asked.

In the run folder (``checkpoints/<run_id>/`` next to the run store, beside the checkpoint):

- ``steps.csv``: ``step, epoch, loss, batch_size, wall_time_s``, one row per step (the
  loss is the batch's mean per-sample loss, for display: it is not private; nor are the
  drawn batch's size and the step's wall time, which the accountant assumes secret);
- ``epochs.csv``: ``epoch, steps, loss, accuracy, evaluated_on, epsilon, delta,
  effective_noise_multiplier, lr, wall_time_s, nonfinite_examples``, one row per epoch
  (ε is the honest ε spent so far, at that δ; the claimed ε is in the final record).

From the Python API the same files come from ``MetricsLog(folder)``: call
:meth:`MetricsLog.after_step` after each private step (``make_private``'s trainer, or
``attach``'s optimizer) and :meth:`MetricsLog.after_epoch` after each epoch, which read ε, δ,
σ_eff, the step count and the learning rate from the trainer.

Rows are flushed with each checkpoint, and ``progress.json`` then says how far the run is
(steps done of planned, honest ε spent): what ``privgrad runs`` shows for a run that did not
complete. A resumed run first cuts both files back to its
checkpoint (a run killed mid-epoch wrote steps its checkpoint does not hold), so no row
appears twice. ``tensorboard_dir`` also writes every value as a TensorBoard scalar through
``torch.utils.tensorboard`` (the ``tensorboard`` package: ``pip install privgrad[tensorboard]``),
under ``<tensorboard_dir>/run-<run_id>``; a resumed run purges the events after its checkpoint.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
import warnings
from pathlib import Path

from privgrad.errors import PrivgradError

STEP_FIELDS = ("step", "epoch", "loss", "batch_size", "wall_time_s")
EPOCH_FIELDS = (
    "epoch",
    "steps",
    "loss",
    "accuracy",
    "evaluated_on",
    "epsilon",
    "delta",
    "effective_noise_multiplier",
    "lr",
    "wall_time_s",
    "nonfinite_examples",
)


def read_rows(path: Path) -> list[dict]:
    """The rows of ``steps.csv`` or ``epochs.csv`` (none for a missing file)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cut(path: Path, fields: tuple[str, ...], key: str, last: int) -> list[int]:
    """Keeps the rows of ``path`` whose ``key`` is at most ``last`` (a missing file: a header);
    returns the ``key`` of each row it removed."""
    old = read_rows(path)
    keep = [r for r in old if r.get(key, "").isdigit() and int(r[key]) <= last]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(keep)
    return [int(r[key]) for r in old if r.get(key, "").isdigit() and int(r[key]) > last]


def _cell(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else ("inf" if math.isinf(value) else repr(value))
    return value


class MetricsLog:
    """Appends a run's step and epoch rows to its run folder (and TensorBoard).

    ``privgrad train`` writes its run folder with it; from the API::

        log = MetricsLog("runs/mine")          # steps.csv, epochs.csv (started afresh)
        for epoch in range(epochs):
            for batch in private.batches():
                log.after_step(private, private.step(batch), len(batch))
            log.after_epoch(private, accuracy=evaluate(model, (test_x, test_y)))
        log.close()                            # or: with MetricsLog(...) as log:

    ``steps_done`` and ``epochs_done`` keep the rows up to a resumed run's checkpoint (the
    others are cut); ``tensorboard_dir`` writes TensorBoard events too, under
    ``run-<run_id>`` in it when ``run_id`` is given."""

    def __init__(
        self,
        folder: str | Path,
        run_id: int | None = None,
        steps_done: int = 0,
        epochs_done: int = 0,
        tensorboard_dir: str | Path | None = None,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.steps_path, self.epochs_path = self.folder / "steps.csv", self.folder / "epochs.csv"
        self._cut_steps = _cut(self.steps_path, STEP_FIELDS, "step", steps_done)
        _cut(self.epochs_path, EPOCH_FIELDS, "epoch", epochs_done)
        self._checked_resume = False
        self._steps_file = open(self.steps_path, "a", newline="")
        self._epochs_file = open(self.epochs_path, "a", newline="")
        self._steps = csv.DictWriter(self._steps_file, STEP_FIELDS)
        self._epochs = csv.DictWriter(self._epochs_file, EPOCH_FIELDS)
        self.writer = None
        if tensorboard_dir is not None:
            # events from step steps_done + 1 on are the resumed run's (steps count from 1)
            where = Path(tensorboard_dir)
            self.writer = tensorboard_writer(
                where / f"run-{run_id}" if run_id is not None else where, steps_done + 1
            )
        self.epochs_done, self._losses, self._started = epochs_done, [], time.time()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def after_step(self, trainer, loss: float | None = None, batch_size: int | None = None):
        """A ``steps.csv`` row for the private step ``trainer`` just took: ``make_private``'s
        trainer (``loss``: what its ``step`` returned), or ``attach``'s optimizer (``loss``
        by default the batch's mean loss it computed; after a micro-batch that did not take
        the step, nothing is written). ``batch_size``: the drawn batch's size, if you want it
        in the file (not private, as the loss; by default ``attach``'s optimizer's, whole
        batches, not micro-batches)."""
        stepped = getattr(trainer, "stepped", True)
        trainer, own_loop = _trainer_of(trainer)
        if not stepped:
            return
        self._check_resume(trainer, trainer.steps - 1)
        if loss is None:
            loss = own_loop.last_loss if own_loop is not None else math.nan
        if batch_size is None and own_loop is not None:
            batch_size = own_loop.last_batch_size
        loss = float(loss)
        self._losses.append(loss)
        self.step(
            trainer.steps,
            self.epochs_done + 1,
            loss,
            "" if batch_size is None else batch_size,
            time.time() - self._started,
        )

    def after_epoch(
        self,
        trainer,
        accuracy: float | None = None,
        evaluated_on: str = "test",
        loss: float | None = None,
    ) -> dict:
        """An ``epochs.csv`` row after an epoch of ``trainer`` (``make_private``'s, or
        ``attach``'s optimizer): the honest ε spent so far at its δ, σ_eff, steps, learning
        rate and non-finite examples read from it; ``loss`` by default the mean of the step
        losses :meth:`after_step` logged since the last epoch; ``accuracy`` as you measured it
        on ``evaluated_on``. Returns the row; flushes both files."""
        trainer, _ = _trainer_of(trainer)
        self._check_resume(trainer, trainer.steps)
        finite = [x for x in self._losses if not math.isnan(x)]
        if loss is None:
            loss = sum(finite) / len(finite) if finite else math.nan
        self.epochs_done += 1
        row = {
            "epoch": self.epochs_done,
            "steps": trainer.steps,
            "loss": float(loss),
            "accuracy": math.nan if accuracy is None else float(accuracy),
            "evaluated_on": "" if accuracy is None else evaluated_on,
            "epsilon": trainer.epsilon(),
            "delta": trainer.delta,
            "effective_noise_multiplier": trainer.mechanism.noise_record(
                trainer.n_layers, trainer.sampler.expected_batch_size
            ).effective,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "wall_time_s": round(time.time() - self._started, 3),
            "nonfinite_examples": trainer.nonfinite_examples,
        }
        self.epoch(row)
        self._losses = []
        self.flush()
        return row

    def _check_resume(self, trainer, before: int) -> None:
        """Once, at the first row: a resumed trainer (``before`` steps taken before that row)
        logged into a folder whose rows of those steps this log cut (``steps_done`` not
        given) is warned about."""
        if self._checked_resume:
            return
        self._checked_resume = True
        lost = [s for s in self._cut_steps if s <= before]
        if lost:
            warnings.warn(
                f"MetricsLog({str(self.folder)!r}) removed the rows of steps {min(lost)}–"
                f"{max(lost)}, which this trainer took before (it is at step {trainer.steps}): "
                f"for a resumed run, pass MetricsLog(folder, steps_done=<steps at the "
                f"checkpoint>, epochs_done=<epochs done>) to keep the earlier rows and number "
                f"the epochs on",
                UserWarning,
                stacklevel=3,
            )

    def step(self, step: int, epoch: int, loss: float, batch_size: int, wall_time_s: float) -> None:
        self._steps.writerow(
            {
                k: _cell(v)
                for k, v in zip(STEP_FIELDS, (step, epoch, loss, batch_size, round(wall_time_s, 3)))
            }
        )
        if self.writer is not None and math.isfinite(loss):
            self.writer.add_scalar("train/loss", loss, step)

    def epoch(self, row: dict) -> None:
        self._epochs.writerow({k: _cell(row.get(k)) for k in EPOCH_FIELDS})
        if self.writer is not None:
            for key in (
                "loss",
                "accuracy",
                "epsilon",
                "effective_noise_multiplier",
                "lr",
                "nonfinite_examples",
            ):
                value = row.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"epoch/{key}", value, row["steps"])

    def progress(
        self, steps: int, planned_steps: int, epsilon: float, epsilon_claimed: float
    ) -> None:
        """Writes ``progress.json`` (atomically): steps done, planned steps, honest ε spent
        and the paper-claimed ε of those steps."""
        tmp = self.folder / "progress.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "steps": steps,
                    "planned_steps": planned_steps,
                    "epsilon": epsilon if math.isfinite(epsilon) else None,
                    "epsilon_claimed": epsilon_claimed if math.isfinite(epsilon_claimed) else None,
                }
            )
            + "\n"
        )
        os.replace(tmp, self.folder / "progress.json")

    def flush(self) -> None:
        self._steps_file.flush()
        self._epochs_file.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        self.flush()
        self._steps_file.close()
        self._epochs_file.close()
        if self.writer is not None:
            self.writer.close()


def _trainer_of(trainer):
    """(the PrivateTrainer, the own loop's DPOptimizer or None) of ``trainer``, either."""
    from privgrad.own_loop import DPOptimizer
    from privgrad.private import PrivateTrainer

    if isinstance(trainer, DPOptimizer):
        return trainer.trainer, trainer
    if isinstance(trainer, PrivateTrainer):
        return trainer, None
    raise PrivgradError(
        "MetricsLog logs make_private's trainer or attach's optimizer, got "
        f"{type(trainer).__name__}"
    )


def tensorboard_writer(logdir: Path, purge_step: int = 0):
    """A ``SummaryWriter`` for ``logdir``; events from ``purge_step`` on (those a resumed run
    writes again) are discarded. A clear error when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise PrivgradError(
            "--tensorboard needs the tensorboard package: pip install 'privgrad[tensorboard]'"
        ) from None
    try:
        return SummaryWriter(str(logdir), purge_step=purge_step if purge_step > 1 else None)
    except OSError as err:
        raise PrivgradError(
            f"cannot write TensorBoard events to {logdir}: {err.strerror or err}"
        ) from None


def check_tensorboard_dir(path: str | None) -> None:
    """Refuses, before any work, a --tensorboard folder that cannot be made, or a missing
    tensorboard package."""
    if path is None:
        return
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise PrivgradError(
            "--tensorboard needs the tensorboard package: pip install 'privgrad[tensorboard]'"
        ) from None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PrivgradError(
            f"cannot make the --tensorboard folder {path}: {err.strerror or err}"
        ) from None


def read_progress(folder: str | Path) -> dict:
    """``progress.json`` of a run folder; {} when there is none or it cannot be read."""
    try:
        data = json.loads((Path(folder) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
