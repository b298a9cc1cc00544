"""What ``privgrad train`` uses when an option is not given, and the registries' names,
without importing torch (the CLI's help is built from this module). Each mechanism's row
is declared with it (privgrad/mechanisms/catalog/).

The per-mechanism table was chosen by experiments/scripts/defaults.sh (records and table in
results/defaults/): MNIST, the ``cnn`` model, target honest ε = 1, 10,000 training
examples, 3 epochs, expected batch 1/40 of the training set, seed 0, a five-value factor-2
grid of lr per mechanism (extended where the best value was on its edge), scored on 5,000
held-out *validation* examples, never the test set. Only lr was searched; momentum, clip,
optimizer and the batch rule were fixed beforehand.
"""

from __future__ import annotations

from collections.abc import Mapping

from privgrad.mechanisms.registry import DEFAULT_EPSILON, Defaults, mechanism_specs  # noqa: F401

# privgrad.app.models.MODELS, privgrad.app.data.DATASETS and privgrad.optim.OPTIMIZERS
# (tests/app/test_defaults.py checks that they agree); the mechanisms' names and rows come
# from their declarations (privgrad/mechanisms/catalog/, privgrad.mechanisms.registry)
MODEL_NAMES = ("cnn", "lenet5", "bilstm", "mlp", "lenet5-bc", "model1", "model2", "model3", "wrn")
DATASET_NAMES = ("mnist", "fashion-mnist", "imdb", "adult", "cifar10")
OPTIMIZER_NAMES = ("sgd", "adam", "sign-adam")
GAN_MODES = ("non-private", "rdp-gan-a", "rdp-gan-b", "rdp-ant", "dp-gan")  # privgrad gan --mode

BATCH_FRACTION = 1 / 40  # expected batch = this fraction of the training set (q = 0.025)


def mechanism_names() -> tuple[str, ...]:
    """Every registered mechanism's name, built-ins first."""
    return tuple(mechanism_specs())


MECHANISM_NAMES = mechanism_names()  # at import: built-ins and PRIVGRAD_MECHANISMS'


class _Rows(Mapping):
    """name -> :class:`Defaults` of every registered mechanism that declares them; a live
    view, so that a mechanism registered later has its row."""

    def __getitem__(self, name):
        row = mechanism_specs()[name].defaults
        if row is None:
            raise KeyError(name)
        return row

    def __iter__(self):
        return iter([n for n, s in mechanism_specs().items() if s.defaults is not None])

    def __len__(self):
        return len(list(iter(self)))


MECHANISM_DEFAULTS: Mapping[str, Defaults] = _Rows()


def default_batch_size(train_size: int, epochs: float = 20) -> float:
    """The expected batch size when ``--batch-size`` is not given: 1/40 of the training set
    from 10,000 examples on, below that 40 × epochs within [n/40, 0.8 n]
    (privgrad.app.guidance.small_data_batch_size; results/small_data/)."""
    from privgrad.app.guidance import small_data_batch_size

    return small_data_batch_size(train_size, epochs)


def defaults_table() -> str:
    """The table, one line per mechanism, as ``privgrad train --help`` shows it."""
    rows = []
    for name, d in MECHANISM_DEFAULTS.items():
        momentum = f"momentum {d.momentum:g}" if d.optimizer == "sgd" else ""
        rest = "no clipping, no noise" if d.epsilon is None else f"clip {d.clip:g}"
        rows.append(f"{name:<12} {d.optimizer:<5} lr {d.lr:<7g} {momentum:<13} {rest}")
    return "\n".join(rows)
