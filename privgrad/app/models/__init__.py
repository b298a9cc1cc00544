"""Models from the papers, all free of BatchNorm (per-sample gradients forbid it)."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import nn

from privgrad.errors import PrivgradError


class TemperedSigmoid(nn.Module):
    """s·σ(T·x) − o (Papernot et al. 2021); tanh is s=2, T=2, o=1."""

    def __init__(self, scale: float = 2.0, temperature: float = 2.0, offset: float = 1.0):
        super().__init__()
        self.scale, self.temperature, self.offset = scale, temperature, offset

    def forward(self, x):
        return self.scale * torch.sigmoid(self.temperature * x) - self.offset


def activation(name: str, **params) -> nn.Module:
    if name == "relu":
        return nn.ReLU()
    if name == "tanh":
        return nn.Tanh()
    if name == "tempered":
        return TemperedSigmoid(**params)
    raise PrivgradError(f"unknown activation '{name}'; choose from: relu, tanh, tempered")


def cnn(
    in_channels: int = 1, num_classes: int = 10, act: str = "tanh", width: int = 1, **act_params
) -> nn.Module:
    """The 26,010-parameter MNIST CNN of Tramèr & Boneh (2021) and Ghosh & Das (Table 1);
    ``width`` multiplies every hidden width (16, 32 channels, 32 units): ×16 has 6.3 M
    parameters.

    Its conv weights are channels-last, so its activations are too (a convolution follows
    its weight's memory format): torch's CPU max-pool with stride 1 is about 10× slower on
    contiguous (N, C, H, W) maps of this size than on channels-last ones, and took about
    40 % of a non-private step. The layout does not change the outputs or gradients (a test
    compares them with a contiguous copy's)."""
    if not (isinstance(width, int) and width >= 1):
        raise PrivgradError(f"width must be a positive integer, got {width}")
    a = lambda: activation(act, **act_params)  # noqa: E731
    c1, c2 = 16 * width, 32 * width
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, 8, stride=2, padding=2),
        a(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(c1, c2, 4, stride=2),
        a(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(c2 * 4 * 4, c2),
        a(),
        nn.Linear(c2, num_classes),
    ).to(memory_format=torch.channels_last)


def lenet5(
    in_channels: int = 1, num_classes: int = 10, act: str = "tanh", **act_params
) -> nn.Module:
    """LeNet-5 (GReDP Table II): conv 6@5×5 → pool → conv 16@5×5 → pool → FC 120-84-10."""
    a = lambda: activation(act, **act_params)  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, padding=2),
        a(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        a(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        a(),
        nn.Linear(120, 84),
        a(),
        nn.Linear(84, num_classes),
    )


def bilstm(
    num_tokens: int | None = None, num_classes: int = 2, act: str = "relu", **act_params
) -> nn.Module:
    """The IMDB BiLSTM of Ghosh & Das (Table 2), about 2.02 M parameters."""
    from privgrad.app.models.text import BiLSTMClassifier

    if num_tokens is None:
        raise PrivgradError("model 'bilstm' takes token ids (use --dataset imdb)")
    return BiLSTMClassifier(num_tokens, num_classes, act=activation(act, **act_params))


def mlp(
    in_features: int, num_classes: int = 2, act: str = "tanh", width: int = 1, **act_params
) -> nn.Module:
    """A perceptron with one hidden layer of 64·``width`` units on the flattened example:
    tabular data (Adult's 108 features) or any other."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, 64 * width),
        activation(act, **act_params),
        nn.Linear(64 * width, num_classes),
    )


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": cnn,
    "lenet5": lenet5,
    "bilstm": bilstm,
    "mlp": mlp,
}
# the models that take no images (C, H, W), and what they take; every other one does
FLAT_INPUTS = {"bilstm": "token ids", "mlp": "any example, flattened"}
# the image size (H, W) a model requires; models not listed take any size
INPUT_SIZES: dict[str, tuple[int, int]] = {"cnn": (28, 28), "lenet5": (28, 28)}


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    act: str = "tanh",
    num_tokens: int | None = None,
    act_params: dict | None = None,
    **model_options,
) -> nn.Module:
    """Builds model ``name``; ``act_params`` parameterise the activation (tempered sigmoid),
    ``model_options`` the architecture (e.g. ``block_size``); an option the model does not
    take is an error. ``hf:PATH`` loads a Hugging Face model from a folder on disk
    (:mod:`privgrad.app.models.hf`)."""
    if name.startswith("hf:"):
        from privgrad.app.models.hf import load_hf_model

        if model_options:
            raise PrivgradError(f"--model '{name}' takes no model options")
        return load_hf_model(name, input_shape, num_classes, num_tokens)
    if name not in MODELS:
        raise PrivgradError(f"unknown model '{name}'; choose from: {', '.join(MODELS)}")
    act_params = act_params or {}
    named = {
        p.name
        for p in inspect.signature(MODELS[name]).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    unused = sorted(set(model_options) - named)
    if unused:
        raise PrivgradError(
            f"model '{name}' does not take option(s) "
            f"{', '.join('--' + u.replace('_', '-') for u in unused)}"
        )
    if name not in FLAT_INPUTS and len(input_shape) != 3:
        flat = ", ".join(f"{m} ({what})" for m, what in FLAT_INPUTS.items())
        raise PrivgradError(
            f"model '{name}' takes images (channels, height, width); the data's examples have "
            f"shape {tuple(input_shape)}: use {flat}, or your own (--model python:...)"
        )
    size = INPUT_SIZES.get(name)
    if size is not None and tuple(input_shape[1:]) != size:
        have = tuple(input_shape[1:])
        fits = [m for m in MODELS if m not in FLAT_INPUTS and INPUT_SIZES.get(m, have) == have]
        raise PrivgradError(
            f"model '{name}' takes {size[0]}×{size[1]} images, the data has shape "
            f"{tuple(input_shape)}: use {', '.join(fits)} (these take "
            f"{'×'.join(map(str, have))} images), mlp (any example, flattened), or your own "
            "(--model python:...)"
        )
    if name == "bilstm":
        return bilstm(num_tokens, num_classes, act, **act_params)
    if name == "mlp":
        return mlp(math.prod(input_shape), num_classes, act, **model_options, **act_params)
    return MODELS[name](
        in_channels=input_shape[0], num_classes=num_classes, act=act, **model_options, **act_params
    )


def register_model(
    name: str, factory: Callable[..., nn.Module], input_size: tuple[int, int] | None = None
) -> None:
    MODELS[name] = factory
    if input_size is not None:
        INPUT_SIZES[name] = tuple(input_size)


# registers lenet5-bc, model1, model2, model3
from privgrad.app.models import spectral as _spectral  # noqa: E402,F401
from privgrad.app.models import wrn as _wrn  # noqa: E402,F401  (registers wrn)
