"""Dataset loading: real benchmark datasets from their official on-disk formats.

``load_dataset(name)`` returns a :class:`DatasetSplits` for any name in :data:`DATASETS`;
where the files are looked for is described in :mod:`privgrad.app.data.locate`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path

from privgrad.app.data.base import DatasetSplits
from privgrad.app.data.images import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    MNIST_MEAN,
    MNIST_STD,
    load_cifar10,
    load_fashion_mnist,
    load_mnist,
    read_cifar_batch,
    read_idx,
)
from privgrad.app.data.locate import find_dataset_dir
from privgrad.app.data.tabular import load_adult, read_adult_frame
from privgrad.app.data.text import load_imdb, tokenize
from privgrad.errors import PrivgradError

DATASETS = ("mnist", "fashion-mnist", "imdb", "adult", "cifar10")

_LOADERS: dict[str, Callable[[str | Path | None], DatasetSplits]] = {
    "mnist": load_mnist,
    "fashion-mnist": load_fashion_mnist,
    "imdb": load_imdb,
    "adult": load_adult,
    "cifar10": load_cifar10,
}


def input_preprocessing(name: str, **options) -> dict | None:
    """How dataset ``name``'s inputs were made from its files (with :func:`load_dataset`'s
    ``options``), for a model's sidecar, so that the model can be evaluated on the official
    files without privgrad: for the image datasets, ``x = (pixels / divide_by - mean) / std``
    per channel, as float32 ``layout``; for the others, which function rebuilds them. ``None``
    for a dataset of the user's."""
    images = {
        "mnist": ([1, 28, 28], (MNIST_MEAN,), (MNIST_STD,)),
        "fashion-mnist": ([1, 28, 28], (FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,)),
        "cifar10": ([3, 32, 32], CIFAR10_MEAN, CIFAR10_STD),
    }
    if name in images:
        layout, mean, std = images[name]
        return {
            "formula": "x = (pixels / divide_by - mean) / std, per channel",
            "layout": layout,
            "divide_by": 255,
            "mean": list(mean),
            "std": list(std),
        }
    if name.startswith("imagefolder:"):
        return {
            "formula": "x = pixels / divide_by (channels first, no normalisation)",
            "divide_by": 255,
        }
    if name == "imdb":
        given = "".join(f", {k}={v!r}" for k, v in sorted(options.items()))
        vocab_size = options.get("vocab_size", 20000)
        return {
            "formula": f"as privgrad.app.data.load_dataset('imdb'{given}) makes them",
            "vocabulary": (
                f"the {vocab_size:,} most frequent words of all 25,000 training reviews "
                f"(whatever --limit-train){', as in the paper' if vocab_size == 20000 else ''}: "
                "a statistic of the training rows that ε does not cover, and the model's token "
                "ids name its words"
            ),
        }
    if name in _LOADERS:
        return {"formula": f"as privgrad.app.data.load_dataset({name!r}) makes them"}
    return None


def loader_options(name: str) -> list[str]:
    """The options :func:`load_dataset` passes to dataset ``name``'s loader (IMDB's
    ``vocab_size``, ``max_len``); none for a name it does not know (a user's dataset)."""
    loader = _LOADERS.get(name)
    return list(inspect.signature(loader).parameters)[1:] if loader else []  # after data_dir


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    limit_train: int | None = None,
    **options,
) -> DatasetSplits:
    """Load dataset ``name`` (one of :data:`DATASETS`).

    ``limit_train=N`` keeps the first N training examples (all of them if there are fewer).
    ``options`` go to the dataset's loader: for ``imdb``, ``vocab_size`` (the most frequent
    training words that get ids; default 20,000) and ``max_len`` (tokens kept per review;
    default 80), as :func:`load_imdb`; the other datasets take none. ``num_tokens`` of the
    result is the embedding rows a model needs (``vocab_size + 2``).
    """
    if name not in _LOADERS:
        raise PrivgradError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    bad_limit = isinstance(limit_train, bool) or not isinstance(limit_train, int) or limit_train < 1
    if limit_train is not None and bad_limit:
        raise PrivgradError(f"limit_train must be an integer >= 1, got {limit_train!r}")
    takes = loader_options(name)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        what = f"takes {', '.join(takes)}" if takes else "takes no options"
        raise PrivgradError(
            f"load_dataset({name!r}) {what}; got {', '.join(unknown)}"
            + (
                " (a DatasetSplits' num_tokens is vocab_size + 2)"
                if "num_tokens" in unknown
                else ""
            )
        )
    splits = _LOADERS[name](data_dir, **options)
    if limit_train is not None and limit_train < len(splits.train_y):
        splits = dataclasses.replace(
            splits,
            train_x=splits.train_x[:limit_train].clone(),
            train_y=splits.train_y[:limit_train].clone(),
        )
    return splits


__all__ = [
    "DATASETS",
    "DatasetSplits",
    "find_dataset_dir",
    "input_preprocessing",
    "load_adult",
    "load_cifar10",
    "load_dataset",
    "load_fashion_mnist",
    "load_imdb",
    "load_mnist",
    "read_adult_frame",
    "read_cifar_batch",
    "read_idx",
    "tokenize",
]
