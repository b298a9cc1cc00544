"""What ``privgrad train`` uses when an option is not given, and the registries' names,
without importing torch (the CLI's help is built from this module).

The per-mechanism table was chosen by experiments/scripts/defaults.sh (records and table in
results/defaults/): MNIST, the ``cnn`` model, target honest ε = 1, 10,000 training
examples, 3 epochs, expected batch 1/40 of the training set, seed 0, a five-value factor-2
grid of lr per mechanism (extended where the best value was on its edge), scored on 5,000
held-out *validation* examples, never the test set. Only lr was searched; momentum, clip,
optimizer and the batch rule were fixed beforehand.
"""

from __future__ import annotations

from dataclasses import dataclass

# the names in privgrad.mechanisms.MECHANISMS, privgrad.app.models.MODELS, privgrad.app.data.DATASETS
# and privgrad.optim.OPTIMIZERS (tests/app/test_defaults.py checks that they agree)
MECHANISM_NAMES = (
    "non-private",
    "dpsgd",
    "dp-adam",
    "dp-signsgd",
    "dp-signadam",
    "spectral-dp",
    "gredp",
    "gip",
    "random-k",
)
MODEL_NAMES = ("cnn", "lenet5", "bilstm", "lenet5-bc", "model1", "model2", "model3", "wrn")
DATASET_NAMES = ("mnist", "fashion-mnist", "imdb", "adult", "cifar10")
OPTIMIZER_NAMES = ("sgd", "adam", "sign-adam")

DEFAULT_EPSILON = 1.0
BATCH_FRACTION = 1 / 40  # expected batch = this fraction of the training set (q = 0.025)


@dataclass(frozen=True)
class Defaults:
    lr: float
    optimizer: str  # the mechanism's own optimizer (shown; the mechanism sets it)
    momentum: float  # SGD momentum (unused by adam)
    clip: float  # L2 clipping norm C (non-private: unused)
    epsilon: float | None = DEFAULT_EPSILON  # target honest ε; None: adds no noise


MECHANISM_DEFAULTS: dict[str, Defaults] = {
    "non-private": Defaults(lr=0.1, optimizer="sgd", momentum=0.9, clip=0.1, epsilon=None),
    "dpsgd": Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    "dp-adam": Defaults(lr=0.008, optimizer="adam", momentum=0.9, clip=0.1),
    "dp-signsgd": Defaults(lr=0.001, optimizer="sgd", momentum=0.9, clip=0.1),
    "dp-signadam": Defaults(lr=0.008, optimizer="adam", momentum=0.9, clip=0.1),
    "spectral-dp": Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    "gredp": Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    "gip": Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
    "random-k": Defaults(lr=2.0, optimizer="sgd", momentum=0.9, clip=0.1),
}


def default_batch_size(train_size: int) -> float:
    """The expected batch size when ``--batch-size`` is not given."""
    return max(1.0, train_size * BATCH_FRACTION)


def defaults_table() -> str:
    """The table, one line per mechanism, as ``privgrad train --help`` shows it."""
    rows = []
    for name, d in MECHANISM_DEFAULTS.items():
        momentum = f"momentum {d.momentum:g}" if d.optimizer == "sgd" else ""
        rest = "no clipping, no noise" if d.epsilon is None else f"clip {d.clip:g}"
        rows.append(f"{name:<12} {d.optimizer:<5} lr {d.lr:<7g} {momentum:<13} {rest}")
    return "\n".join(rows)
