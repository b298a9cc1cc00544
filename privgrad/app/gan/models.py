"""DCGAN-style networks for RDP-GAN: 3 transposed convolutions (G), 3 convolutions (D).

The paper gives no widths, kernels or normalisation; privgrad's choices:

* G: (z, one-hot label) as a (z+K)×1×1 map → ConvT(k=S/4) → S/4 × S/4 → BN → ReLU →
  ConvT(4, 2, 1) → S/2 → BN → ReLU → ConvT(4, 2, 1) → S × S, then tanh (MNIST) or, per
  attribute row, a Gumbel-softmax sample over its categories (Adult; temperature 0.2 as in
  CTGAN). With a plain softmax D tells soft rows from the real one-hot rows and G collapsed
  to one category per attribute (non-private, 1000 G-steps, at lr 5e-5 and 2e-4 alike).
  G never sees real data, so its BatchNorm (batch statistics only, no running averages)
  couples fake samples only.
* D: input with K one-hot label planes concatenated (class-conditional; Adult has
  K = 0) → Conv(4, 2, 1) → LeakyReLU(0.2) → Conv(4, 2, 1) → GroupNorm → LeakyReLU(0.2)
  → Conv(k=S/4) → one logit. No BatchNorm (it couples the samples of a batch, which
  per-sample clipping forbids); the same D is used in every mode so that the modes
  differ only in how noise enters. The sigmoid of the paper's last layer is folded
  into the loss (``binary_cross_entropy_with_logits``, the same function, stable), so
  the logit is z^L, the quantity whose error δ^L = d(x) − y Eq. 9 perturbs.

Weights are initialised as in DCGAN (Radford et al. 2016): convolutions N(0, 0.02), norm
scales N(1, 0.02), biases 0. (With PyTorch's default initialisation and the paper's
learning rate of 5e-5, G had not left its initial checkerboard after 150 G-steps.)

D takes a single tensor (image and label planes concatenated, see :func:`condition`),
which is what :class:`privgrad.per_sample.GradSampler` needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from privgrad.app.gan.data import ADULT_SIZE, ADULT_SIZES, adult_mask

GUMBEL_TEMPERATURE = 0.2  # CTGAN's (Xu et al. 2019) for discrete columns


def condition(x: torch.Tensor, y: torch.Tensor | None, num_classes: int) -> torch.Tensor:
    """Concatenate K one-hot label planes to the image channels (identity if K = 0)."""
    if not num_classes:
        return x
    planes = F.one_hot(y, num_classes).to(x.dtype)[:, :, None, None]
    return torch.cat([x, planes.expand(-1, -1, x.shape[2], x.shape[3])], 1)


def dcgan_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


class Generator(nn.Module):
    def __init__(
        self,
        latent_dim: int = 100,
        num_classes: int = 10,
        image_size: int = 28,
        width: int = 64,
        output: str = "tanh",
    ):
        super().__init__()
        if image_size % 4:
            raise ValueError("image_size must be a multiple of 4")
        self.latent_dim, self.num_classes, self.output = latent_dim, num_classes, output
        base = image_size // 4
        self.net = nn.Sequential(
            nn.ConvTranspose2d(latent_dim + num_classes, 2 * width, base, 1, 0, bias=False),
            nn.BatchNorm2d(2 * width, track_running_stats=False),
            nn.ReLU(),
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width, track_running_stats=False),
            nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, 2, 1),
        )
        self.apply(dcgan_init)
        if output == "adult":
            self.register_buffer("mask", adult_mask(), persistent=False)

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = z
        if self.num_classes:
            h = torch.cat([z, F.one_hot(y, self.num_classes).to(z.dtype)], 1)
        out = self.net(h[:, :, None, None])
        if self.output == "tanh":
            return torch.tanh(out)
        # Adult: per attribute row, a Gumbel-softmax sample over its valid categories (zeros
        # elsewhere)
        logits = out[:, 0, : len(ADULT_SIZES), :].masked_fill(~self.mask, -float("inf"))
        rows = F.gumbel_softmax(logits, tau=GUMBEL_TEMPERATURE, dim=-1)
        return F.pad(rows, (0, 0, 0, ADULT_SIZE - len(ADULT_SIZES)))[:, None]


class Discriminator(nn.Module):
    def __init__(
        self, num_classes: int = 10, image_size: int = 28, width: int = 64, groups: int = 8
    ):
        super().__init__()
        base = image_size // 4
        self.net = nn.Sequential(
            nn.Conv2d(1 + num_classes, width, 4, 2, 1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, 2, 1),
            nn.GroupNorm(min(groups, 2 * width), 2 * width),
            nn.LeakyReLU(0.2),
            nn.Conv2d(2 * width, 1, base, 1, 0),
        )
        self.apply(dcgan_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits z^L, shape (B,): d(x) = sigmoid(z^L)."""
        return self.net(x).flatten()


class MnistEvaluator(nn.Module):
    """The paper's scorer: a 3-layer MLP (784 → 256 → 10) with sigmoid units."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(784, hidden), nn.Sigmoid(), nn.Linear(hidden, 10)
        )

    def forward(self, x):
        return self.net(x)


class IncomeClassifier(nn.Module):
    """Income > 50K from the other 7 Adult attributes (one-hot): 68 → 64 → 2."""

    def __init__(self, in_features: int = 68, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)
