"""Evaluation of generated samples, as in the paper's Sec. V, and PNG sample grids.

Every real-data reference comes from the public test split (MNIST's test files, Adult's
adult.test), never from the private training rows, so in every mode the record and plots
carry nothing computed from the training rows except through the trained generator.

* MNIST (the paper's score): an MLP with sigmoid units trained on the 10K MNIST *test*
  images classifies generated digits; the score is the fraction classified as the
  label the generator was asked for (per digit too, Fig. 6).
* Adult: the PMF of each attribute and the "absolute average error" of Eq. 22,
  Σ_{x=1}^{|X|} |p_g(x) − p_r(x)|·x (weighted by the 1-based category index, as
  printed), p_r being adult.test's PMF; an income classifier trained on adult.test and
  tested on synthetic rows (TRTS, the paper's Fig. 8a, the run's ``test_accuracy``; the
  same classifier gives RDP-ANT's S_t during training), and the reverse (TSTR, trained on
  synthetic, tested on adult.test, Fig. 8b). The paper trains its real classifier on its
  training split; that would release a non-private model's accuracy.

Neither dataset reports a real/real accuracy: its classifier is trained on the only public
real rows, so none are left to test it on (MNIST's evaluator scores 100 % on its own).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from privgrad.app.gan.data import (
    ADULT_ATTRIBUTES,
    ADULT_SIZES,
    INCOME,
    GanData,
    adult_features,
    decode_adult,
)
from privgrad.app.gan.models import IncomeClassifier, MnistEvaluator

# what "real" means in a record's evaluation (records without this field computed pmf_real,
# the TRTS classifier, income_trained_real_tested_real and evaluator_accuracy_on_real from the
# private training rows)
REAL_REFERENCE = {
    "mnist": "the MNIST test split (public), on which the evaluator is trained",
    "adult": "adult.test (public): pmf_real, and the rows the TRTS income classifier is trained on",
}


def _fit(
    factory,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    seed: int,
    lr: float = 1e-3,
    batch: int = 128,
) -> torch.nn.Module:
    """Adam on cross-entropy, seeded on its own (the global RNG is left as it was)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    return model


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    if len(x) == 0:
        return float("nan")
    pred = torch.cat([model(x[i : i + 4096]).argmax(1) for i in range(0, len(x), 4096)])
    return float((pred == y).float().mean())


@torch.no_grad()
def generate(
    generator: torch.nn.Module,
    n: int,
    latent_dim: int,
    num_classes: int,
    gen: torch.Generator,
    batch: int = 500,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """n samples; class-conditional generators get labels 0..K-1 in equal shares."""
    generator.train()  # BatchNorm without running statistics: batch statistics always
    xs, ys = [], []
    labels = torch.arange(n) % num_classes if num_classes else None
    for i in range(0, n, batch):
        m = min(batch, n - i)
        z = torch.randn(m, latent_dim, generator=gen)
        y = labels[i : i + m] if num_classes else None
        xs.append(generator(z, y))
        ys.append(y)
    return torch.cat(xs), (torch.cat(ys) if num_classes else None)


class MnistScorer:
    """The paper's MNIST score; the MLP is trained once on the MNIST test split."""

    def __init__(self, data: GanData, epochs: int = 20, seed: int = 1234, lr: float = 3e-3):
        self.model = _fit(MnistEvaluator, data.test_x, data.test_y, epochs, seed, lr=lr)

    def score(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return accuracy(self.model, x, y)

    @torch.no_grad()
    def per_class(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        pred = torch.cat([self.model(x[i : i + 4096]).argmax(1) for i in range(0, len(x), 4096)])
        return [float((pred[y == c] == c).float().mean()) for c in range(10)]


def pmf(idx: torch.Tensor) -> list[np.ndarray]:
    """PMF of each attribute (N × 8 indices)."""
    return [
        np.bincount(idx[:, r].numpy(), minlength=n) / max(1, len(idx))
        for r, n in enumerate(ADULT_SIZES)
    ]


def pmf_error(p_g: np.ndarray, p_r: np.ndarray) -> float:
    """Eq. 22: Σ_{x=1}^{|X|} |p_g(x) − p_r(x)| · x."""
    p_g, p_r = np.asarray(p_g, float), np.asarray(p_r, float)
    return float(np.sum(np.abs(p_g - p_r) * np.arange(1, len(p_r) + 1)))


def income_classifier(idx: torch.Tensor, epochs: int = 5, seed: int = 4321) -> torch.nn.Module:
    return _fit(IncomeClassifier, adult_features(idx), idx[:, INCOME], epochs, seed, batch=256)


def income_accuracy(model: torch.nn.Module, idx: torch.Tensor) -> float:
    return accuracy(model, adult_features(idx), idx[:, INCOME])


class AdultScorer:
    """S_t and TRTS for Adult: the income classifier, trained on adult.test, on synthetic rows."""

    def __init__(self, data: GanData, epochs: int = 5):
        self.model = income_classifier(data.test_idx, epochs)

    def score(self, x: torch.Tensor, y=None) -> float:
        return income_accuracy(self.model, decode_adult(x))


def evaluate_adult(
    data: GanData, synthetic: torch.Tensor, scorer: AdultScorer, epochs: int = 5
) -> dict:
    """Final Adult metrics: Eq. 22 per attribute against adult.test, TRTS (``scorer``'s
    classifier) and TSTR. No real/real accuracy: no public real rows are left to test on."""
    syn = decode_adult(synthetic)
    p_r, p_g = pmf(data.test_idx), pmf(syn)
    syn_clf = income_classifier(syn, epochs)
    return {
        "pmf_error": {
            name: pmf_error(g, r) for (name, _, _), g, r in zip(ADULT_ATTRIBUTES, p_g, p_r)
        },
        "pmf_real": {name: r.tolist() for (name, _, _), r in zip(ADULT_ATTRIBUTES, p_r)},
        "pmf_synthetic": {name: g.tolist() for (name, _, _), g in zip(ADULT_ATTRIBUTES, p_g)},
        "income_trained_real_tested_synthetic": income_accuracy(scorer.model, syn),
        "income_trained_synthetic_tested_real": income_accuracy(syn_clf, data.test_idx),
        "synthetic_income_rate": float(syn[:, INCOME].float().mean()),
    }


def save_grid(images: torch.Tensor, path: str | Path, nrow: int, value_range=(-1.0, 1.0)) -> str:
    """Tile (N, 1, H, W) images into one grayscale PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    lo, hi = value_range
    x = ((images.detach().float().clamp(lo, hi) - lo) / (hi - lo))[:, 0].numpy()
    n, h, w = x.shape
    ncol = -(-n // nrow)
    pad = 1
    grid = np.ones((nrow * (h + pad) + pad, ncol * (w + pad) + pad), dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[
            pad + r * (h + pad) : pad + r * (h + pad) + h,
            pad + c * (w + pad) : pad + c * (w + pad) + w,
        ] = x[i]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scale = max(1, 64 // max(h, w))  # enlarge small images (Adult's 16×16) for viewing
    plt.imsave(path, np.kron(grid, np.ones((scale, scale))), cmap="gray", vmin=0, vmax=1)
    return str(path)


def save_pmf_plot(metrics: dict, path: str | Path, title: str = "") -> str:
    """Fig. 7-style PMFs of the 8 Adult attributes, real (adult.test) against synthetic."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 6))
    for ax, (name, _, cats) in zip(axes.flat, ADULT_ATTRIBUTES):
        x = np.arange(1, len(cats) + 1)
        ax.bar(x - 0.2, metrics["pmf_real"][name], 0.4, label="real (adult.test)")
        ax.bar(x + 0.2, metrics["pmf_synthetic"][name], 0.4, label="synthetic")
        ax.set_title(f"{name} (Eq. 22 error {metrics['pmf_error'][name]:.3f})", fontsize=9)
        ax.set_xticks(x)
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)
