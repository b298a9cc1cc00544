"""``privgrad runs plot``: runs' curves in one PNG, several runs overlaid, against the step:
the training loss of each step (and each epoch's), the accuracy after each epoch (test or
validation) and the honest ε spent (after each epoch, and at a stopped run's last checkpoint),
from the run folder's ``steps.csv``, ``epochs.csv`` and ``progress.json``
(:mod:`privgrad.app.metrics`). The losses are statistics of the training rows without noise,
which ε does not cover: the loss panel says so."""

from __future__ import annotations

import math
from pathlib import Path

from privgrad.app.checkpoint import checkpoint_dir
from privgrad.app.metrics import read_progress, read_rows
from privgrad.app.store import RunStore
from privgrad.errors import PrivgradError


def _float(text) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _curves(store: RunStore, run_id: int) -> dict:
    """One run's labelled series: (steps, losses), epochs' (steps, losses, accuracies, ε)."""
    run = store.train_run(run_id, "plot")
    folder = checkpoint_dir(store.path, run_id)
    cfg, record = run["config"], run["record"] or {}
    return _series(
        folder,
        f"run {run_id}",
        f"run {run_id}: {cfg.get('mechanism')} on {cfg.get('dataset')} ({run['status']})",
        record,
    )


def _folder_curves(folder: Path) -> dict:
    """The series of a folder that :class:`~privgrad.app.metrics.MetricsLog` wrote from a loop
    of one's own (no run store: no claimed ε beside it)."""
    return _series(folder, str(folder), str(folder), {})


def _series(folder: Path, name: str, label: str, record: dict) -> dict:
    steps, epochs = read_rows(folder / "steps.csv"), read_rows(folder / "epochs.csv")
    if not steps and not epochs:
        raise PrivgradError(f"{name} has no metrics in {folder} (no step finished?)")
    evaluated = {e.get("evaluated_on") for e in epochs} - {None, ""}
    spent_steps, spent = [int(e["steps"]) for e in epochs], [_float(e["epsilon"]) for e in epochs]
    progress = read_progress(folder)  # a run stopped mid-epoch: the ε its checkpoint spent
    if progress and progress.get("steps", 0) > (spent_steps[-1] if spent_steps else 0):
        spent_steps.append(int(progress["steps"]))
        spent.append(_float(progress["epsilon"]))
    return {
        "name": name,
        "label": label,
        "step": [int(r["step"]) for r in steps],
        "loss": [_float(r["loss"]) for r in steps],
        "epoch_step": [int(e["steps"]) for e in epochs],
        "epoch_loss": [_float(e["loss"]) for e in epochs],
        "accuracy": [_float(e["accuracy"]) for e in epochs],
        "epsilon_step": spent_steps,
        "epsilon": spent,
        "evaluated_on": (
            evaluated.pop() if len(evaluated) == 1 else "test or validation" if evaluated else None
        ),  # None: no accuracy logged (a MetricsLog without one)
        "claimed": record.get("epsilon_claimed"),
        "final_epsilon": record.get("epsilon"),
    }


def plot_runs(db: str | Path, run_ids: list[int | Path], out: str | Path) -> Path:
    """Writes the curves of ``run_ids`` (of the run store ``db``; a ``Path``: a folder
    ``MetricsLog`` wrote from one's own loop) to the PNG ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PrivgradError("privgrad runs plot needs matplotlib (pip install matplotlib)") from err
    store = None
    if any(not isinstance(run_id, Path) for run_id in run_ids):
        if not Path(db).exists():
            raise PrivgradError(f"no run store at {db}; run 'privgrad train' first")
        store = RunStore(db)
    runs = [
        _folder_curves(run_id) if isinstance(run_id, Path) else _curves(store, run_id)
        for run_id in run_ids
    ]
    fig = _figure(plt, runs)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    except OSError as err:
        raise PrivgradError(f"cannot write the plot to {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return out


def _figure(plt, runs: list[dict]):
    """The figure of :func:`plot_runs`: loss, accuracy and ε panels, runs overlaid."""
    fig, (loss_ax, acc_ax, eps_ax) = plt.subplots(1, 3, figsize=(14, 4.2), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        col = colours[i % len(colours)]
        loss_ax.plot(r["step"], r["loss"], color=col, alpha=0.3, lw=0.8)
        loss_ax.plot(r["epoch_step"], r["epoch_loss"], "o-", color=col, label=r["label"])
        acc_ax.plot(
            r["epoch_step"], r["accuracy"], "o-", color=col,
            label=f"{r['name']}: {r['evaluated_on'] or 'no'} accuracy",
        )  # fmt: skip
        eps_ax.plot(
            [0, *r["epsilon_step"]], [0.0, *r["epsilon"]], "o-", color=col, label=r["label"]
        )
        claimed = r["claimed"]
        if claimed is not None and r["epoch_step"] and claimed != r["final_epsilon"]:
            eps_ax.plot(
                r["epoch_step"][-1], claimed, "x", color=col, ms=9,
                label=f"{r['name']}: ε claimed (the paper's; not a guarantee)",
            )  # fmt: skip
    accuracies = {r["evaluated_on"] for r in runs} - {None} or {"test"}
    titles = (
        (loss_ax, "training loss (steps; ● epochs)\nun-noised statistic of the training rows"),
        (acc_ax, f"{' / '.join(sorted(accuracies))} accuracy after each epoch"),
        (eps_ax, "honest ε spent (PLD)"),
    )
    for ax, title in titles:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    eps_ax.legend(fontsize=8, loc="best")
    if len(accuracies) > 1:
        # runs scored on different splits (a --validation run beside a test-set one) share the
        # panel: say which curve is which, or a validation curve reads as a test accuracy
        acc_ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
