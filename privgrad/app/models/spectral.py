"""The Spectral-DP paper's models (Feng et al. 2023, §4 and App. Tables 12–13).

Layouts follow spectral-dp.md §4 and the authors' code (github cfeng6/Spectral-DP): their
spectral conv and block-circulant layers have no bias, so neither do these. Any
mechanism can train them; under 'spectral-dp'/'gredp' the convs and block-circulant
layers are handled in the frequency domain and the dense layers in the identity basis.
"""

from __future__ import annotations

from torch import nn

from privgrad.errors import PrivgradError
from privgrad.layers import BlockCirculantLinear
from privgrad.app.models import activation, register_model


def lenet5_bc(
    in_channels: int = 1,
    num_classes: int = 10,
    act: str = "tanh",
    block_size: int = 8,
    **act_params,
) -> nn.Module:
    """Spectral-DP's LeNet-5 (code ``models/lenet.py``): conv5×5 1→6, 6→16, 16→128, each with
    tanh, avgpool 2 after the first two; block-circulant FC 128→80 (block 8), tanh,
    80→classes (block = classes, 10). The code's first conv has no padding and so needs
    32×32 input; on 28×28 MNIST it is padded by 2 (classic LeNet-5), same feature sizes."""
    a = lambda: activation(act, **act_params)  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, padding=2, bias=False),
        a(),
        nn.AvgPool2d(2),
        nn.Conv2d(6, 16, 5, bias=False),
        a(),
        nn.AvgPool2d(2),
        nn.Conv2d(16, 128, 5, bias=False),
        a(),
        nn.Flatten(),
        BlockCirculantLinear(128, 80, block_size, bias=False),
        a(),
        BlockCirculantLinear(80, num_classes, num_classes, bias=False),
    )


def model1(
    in_channels: int = 1,
    num_classes: int = 10,
    act: str = "relu",
    block_size: int = 8,
    **act_params,
) -> nn.Module:
    """Model1 (Spectral-DP §4, after CirCNN; code ``models/mlp_mnist.py``): block-circulant FC
    784-2048-1024-160-classes, block size 8, last block = classes. The code uses ReLU (this
    factory's default); like every model it honours ``act``, and ``build_model`` passes
    the library's default (tanh) unless told ``act='relu'``."""
    a = lambda: activation(act, **act_params)  # noqa: E731
    return nn.Sequential(
        nn.Flatten(),
        BlockCirculantLinear(in_channels * 28 * 28, 2048, block_size, bias=False),
        a(),
        BlockCirculantLinear(2048, 1024, block_size, bias=False),
        a(),
        BlockCirculantLinear(1024, 160, block_size, bias=False),
        a(),
        BlockCirculantLinear(160, num_classes, num_classes, bias=False),
    )


def model2(
    in_channels: int = 3, num_classes: int = 10, act: str = "tanh", **act_params
) -> nn.Module:
    """Model2 (Table 12, tanh): conv32–pool–conv64–pool–conv64–pool–conv64–pool–conv(classes),
    global average pool; all convs 3×3, stride 1, padding 1; max-pool 2/2."""
    a = lambda: activation(act, **act_params)  # noqa: E731
    conv = lambda i, o: nn.Conv2d(i, o, 3, padding=1, bias=False)  # noqa: E731
    return nn.Sequential(
        conv(in_channels, 32),
        a(),
        nn.MaxPool2d(2),
        conv(32, 64),
        a(),
        nn.MaxPool2d(2),
        conv(64, 64),
        a(),
        nn.MaxPool2d(2),
        conv(64, 64),
        a(),
        nn.MaxPool2d(2),
        conv(64, num_classes),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def model3(
    in_channels: int = 3,
    num_classes: int = 10,
    act: str = "tanh",
    norm_groups: int = 0,
    **act_params,
) -> nn.Module:
    """Model3 (Table 13): 2×conv32–pool–2×conv64–pool–2×conv128–pool–FC120–FC(classes) on
    32×32 input; convs 3×3, stride 1, padding 1; max-pool 2/2. The activation is not
    given (tanh, as Model2). The FC layers are dense (the paper does not say they are
    block-circulant) and carry biases. ``norm_groups`` > 0 (not in the paper) puts a
    GroupNorm with that many groups after every conv; it must divide 32."""
    if not (
        isinstance(norm_groups, int)
        and norm_groups >= 0
        and (norm_groups == 0 or 32 % norm_groups == 0)
    ):
        raise PrivgradError(f"norm_groups must be 0 or a divisor of 32, got {norm_groups}")
    a = lambda: activation(act, **act_params)  # noqa: E731

    def conv(i, o):  # conv [→ GroupNorm] → activation
        return (
            [nn.Conv2d(i, o, 3, padding=1, bias=False)]
            + ([nn.GroupNorm(norm_groups, o)] if norm_groups else [])
            + [a()]
        )

    return nn.Sequential(
        *conv(in_channels, 32),
        *conv(32, 32),
        nn.MaxPool2d(2),
        *conv(32, 64),
        *conv(64, 64),
        nn.MaxPool2d(2),
        *conv(64, 128),
        *conv(128, 128),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 120),
        a(),
        nn.Linear(120, num_classes),
    )


register_model("lenet5-bc", lenet5_bc, input_size=(28, 28))
register_model("model1", model1, input_size=(28, 28))
register_model("model2", model2)
register_model("model3", model3, input_size=(32, 32))
