"""The user's own code from the command line: ``python:module:function``.

``module`` is imported from the current directory or ``sys.path``. For ``--dataset`` the
function is called with no arguments and returns ``(train_dataset, test_dataset,
num_classes)`` (map-style Datasets of (input, label) pairs); for ``--model`` it is called as
``function(input_shape, num_classes)`` and returns an ``nn.Module``.
"""
from __future__ import annotations

import importlib
import os
import sys

from torch import nn
from torch.utils.data import Dataset, IterableDataset

from .errors import PrivgradError

PREFIX = "python:"


def load_function(spec: str, what: str):
    """The callable named by ``python:module:function``."""
    module_name, sep, name = spec[len(PREFIX):].rpartition(":")
    if not spec.startswith(PREFIX) or not sep or not module_name or not name:
        raise PrivgradError(f"{what} '{spec}': write python:module:function")
    here = os.getcwd()
    sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any error is reported, in one line
        raise PrivgradError(f"{what} '{spec}': cannot import {module_name}: {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(here)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise PrivgradError(f"{what} '{spec}': {module_name} has no function {name}")
    return fn


def user_datasets(spec: str) -> tuple[Dataset, Dataset, int]:
    out = load_function(spec, "--dataset")()
    if not (isinstance(out, tuple) and len(out) == 3):
        raise PrivgradError(f"--dataset '{spec}' must return (train_dataset, test_dataset, num_classes)")
    train, test, num_classes = out
    for split, ds in (("train", train), ("test", test)):
        if not isinstance(ds, Dataset) or isinstance(ds, IterableDataset):
            raise PrivgradError(f"--dataset '{spec}': the {split} set is a {type(ds).__name__}, "
                                "not a map-style torch Dataset")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise PrivgradError(f"--dataset '{spec}': num_classes must be an integer ≥ 2, got {num_classes!r}")
    return train, test, num_classes


def user_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    model = load_function(spec, "--model")(input_shape, num_classes)
    if not isinstance(model, nn.Module):
        raise PrivgradError(f"--model '{spec}' returned a {type(model).__name__}, not an nn.Module")
    return model
