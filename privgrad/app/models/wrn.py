"""Wide ResNet WRN-d-k (Zagoruyko & Komodakis 2016) with GroupNorm in place of BatchNorm, as
De et al. (2022) train it privately and GIP's Table 5 uses it (WRN-16-4 on CIFAR-10).

Pre-activation basic blocks: GroupNorm → activation → conv 3×3 → GroupNorm → activation →
conv 3×3, plus the input (a 1×1 conv where the width or stride changes). Three groups of
n = (d − 4)/6 blocks at widths 16k, 32k, 64k (strides 1, 2, 2); a 3×3 stem of 16 channels;
GroupNorm → activation → global average pool → linear. De et al. also standardise the conv
weights and augment each example 16 times; neither is here (a plain conv keeps the fast
per-sample rule; privgrad has no augmentation multiplicity).
"""

from __future__ import annotations

from torch import nn

from privgrad.errors import PrivgradError
from privgrad.app.models import activation, register_model


class WideBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int, act):
        super().__init__()
        self.norm1, self.act1 = nn.GroupNorm(groups, c_in), act()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm2, self.act2 = nn.GroupNorm(groups, c_out), act()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.shortcut = (
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x):
        out = self.conv1(self.act1(self.norm1(x)))
        out = self.conv2(self.act2(self.norm2(out)))
        return out + (x if self.shortcut is None else self.shortcut(x))


def wrn(
    in_channels: int = 3,
    num_classes: int = 10,
    act: str = "relu",
    depth: int = 16,
    width: int = 4,
    norm_groups: int = 16,
    **act_params,
) -> nn.Module:
    """WRN-``depth``-``width`` (``depth`` = 6n + 4); GroupNorm with ``norm_groups`` groups
    (De et al.: 16; it divides 16, so every width). WRN-16-4 has 2.75 M parameters."""
    if not (isinstance(depth, int) and depth >= 10 and (depth - 4) % 6 == 0):
        raise PrivgradError(f"WRN depth must be 6n + 4 with n ≥ 1 (10, 16, 22, ...), got {depth}")
    if not (isinstance(width, int) and width >= 1):
        raise PrivgradError(f"WRN width must be a positive integer, got {width}")
    if not (isinstance(norm_groups, int) and norm_groups >= 1 and 16 % norm_groups == 0):
        raise PrivgradError(f"norm_groups must divide 16, got {norm_groups}")
    a = lambda: activation(act, **act_params)  # noqa: E731
    n = (depth - 4) // 6
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)]
    c = 16
    for i, c_out in enumerate((16 * width, 32 * width, 64 * width)):
        for j in range(n):
            layers.append(WideBlock(c, c_out, 2 if i > 0 and j == 0 else 1, norm_groups, a))
            c = c_out
    layers += [
        nn.GroupNorm(norm_groups, c),
        a(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, num_classes),
    ]
    return nn.Sequential(*layers)


register_model("wrn", wrn)
