"""GAN training data: MNIST as 28×28 images in [-1, 1], Adult as a 16×16 matrix per row.

Adult uses the paper's 8 attributes (Table I order): Age, Occupation, Education, Gender,
Work Class, Marital Status, Work Hour, Income. Each becomes a categorical attribute with
a fixed, public list of categories (the classifier loader's,
:data:`privgrad.app.data.tabular.CATEGORIES`, where the column is categorical):

* Age: 9 regions (the paper bins age into 9; privgrad uses decades: 17-19, 20-29, …,
  80-89, 90), Work Hour: 10 regions (1-9, 10-19, …, 90-99);
* Education ordered by education-num (an ordinal scale), Income ``<=50K``, ``>50K``,
  the others in sorted order, with ``?`` (missing) a category of its own.

The paper converts rows "into square matrices" without saying how. privgrad puts
attribute r in row r of a 16×16 matrix as a one-hot vector over its categories
(at most 16, Education), rows 8-15 zero. The generator emits, per attribute row, a
Gumbel-softmax sample over that attribute's categories, so a synthetic row decodes by
argmax (a draw from the generator's categorical distribution). The
index x = 1..|X| of Eq. 22 is the category's position in these lists.

The official files are used (adult.data: 32,561 training rows; adult.test: 16,281
held-out rows); the paper reports a 20K/10K split of "30K" records.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from privgrad.app.data import load_dataset, read_adult_frame
from privgrad.app.data.images import MNIST_MEAN, MNIST_STD
from privgrad.app.data.locate import find_dataset_dir
from privgrad.app.data.tabular import CATEGORIES, EDUCATION_ORDER, INCOMES
from privgrad.errors import DataError, PrivgradError

ADULT_SIZE = 16
AGE_EDGES = [20, 30, 40, 50, 60, 70, 80, 90]
HOURS_EDGES = [10, 20, 30, 40, 50, 60, 70, 80, 90]

# (name shown, column in the UCI file, categories)
ADULT_ATTRIBUTES: list[tuple[str, str, tuple[str, ...]]] = [
    ("Age", "age", ("17-19", "20-29", "30-39", "40-49", "50-59", "60-69", "70-79", "80-89", "90")),
    ("Occupation", "occupation", CATEGORIES["occupation"]),
    ("Education", "education", EDUCATION_ORDER),
    ("Gender", "sex", CATEGORIES["sex"]),
    ("Work Class", "workclass", CATEGORIES["workclass"]),
    ("Marital Status", "marital-status", CATEGORIES["marital-status"]),
    (
        "Work Hour",
        "hours-per-week",
        ("1-9", "10-19", "20-29", "30-39", "40-49", "50-59", "60-69", "70-79", "80-89", "90-99"),
    ),
    ("Income", "income", INCOMES),
]
ADULT_SIZES = [len(c) for _, _, c in ADULT_ATTRIBUTES]
INCOME = len(ADULT_ATTRIBUTES) - 1


def adult_indices(frame: dict[str, np.ndarray]) -> np.ndarray:
    """N × 8 int64 category indices (0-based) of the paper's attributes."""
    cols = []
    for name, column, cats in ADULT_ATTRIBUTES:
        values = frame[column]
        if column == "age":
            idx = np.digitize(values, AGE_EDGES)
        elif column == "hours-per-week":
            idx = np.digitize(values, HOURS_EDGES)
        else:
            lookup = {c: i for i, c in enumerate(cats)}
            unknown = sorted(set(values.tolist()) - set(lookup))
            if unknown:
                raise DataError(f"adult: unknown {column} value(s) {unknown[:5]}")
            idx = np.array([lookup[v] for v in values.tolist()], dtype=np.int64)
        cols.append(np.asarray(idx, dtype=np.int64))
    return np.stack(cols, axis=1)


@lru_cache(maxsize=4)
def _adult_file_indices(path: str, mtime_ns: int) -> np.ndarray:
    """Parsed once per process (the text parse takes seconds); read-only thereafter."""
    idx = adult_indices(read_adult_frame(Path(path)))
    idx.setflags(write=False)
    return idx


def adult_mask() -> torch.Tensor:
    """(8, 16) bool: the valid category cells of each attribute row."""
    mask = torch.zeros(len(ADULT_SIZES), ADULT_SIZE, dtype=torch.bool)
    for r, n in enumerate(ADULT_SIZES):
        mask[r, :n] = True
    return mask


def encode_adult(idx: torch.Tensor) -> torch.Tensor:
    """(N, 8) category indices -> (N, 1, 16, 16) one-hot matrices."""
    out = torch.zeros(len(idx), ADULT_SIZE, ADULT_SIZE)
    rows = torch.arange(len(ADULT_SIZES))
    out[torch.arange(len(idx))[:, None], rows[None, :], idx] = 1.0
    return out[:, None]


def decode_adult(matrices: torch.Tensor) -> torch.Tensor:
    """(N, 1, 16, 16) matrices (one-hot or per-row probabilities) -> (N, 8) indices (argmax)."""
    rows = matrices[:, 0, : len(ADULT_SIZES), :].masked_fill(~adult_mask(), -float("inf"))
    return rows.argmax(-1)


def adult_features(idx: torch.Tensor) -> torch.Tensor:
    """One-hot of every attribute but Income, for the income classifier (N × 68)."""
    blocks = [
        torch.nn.functional.one_hot(idx[:, r], n).float()
        for r, n in enumerate(ADULT_SIZES)
        if r != INCOME
    ]
    return torch.cat(blocks, 1)


@dataclass
class GanData:
    """What a GAN run trains on and is evaluated with."""

    name: str
    train_x: torch.Tensor  # (N, 1, S, S) in the generator's output range
    train_y: torch.Tensor | None  # class labels for a class-conditional GAN (MNIST)
    num_classes: int  # 0: unconditional (Adult)
    image_size: int
    output: str  # 'tanh' (MNIST) or 'adult' (per-row softmax)
    test_x: torch.Tensor | None = None
    test_y: torch.Tensor | None = None
    train_idx: torch.Tensor | None = None  # Adult: (N, 8) category indices
    test_idx: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.train_x)


def mnist_to_gan_range(x: torch.Tensor) -> torch.Tensor:
    """privgrad's normalised MNIST -> pixels in [-1, 1] (the generator's tanh range)."""
    return ((x * MNIST_STD + MNIST_MEAN) * 2 - 1).clamp(-1, 1)


def load_gan_data(name: str, data_dir=None, limit_train: int | None = None) -> GanData:
    if name == "mnist":
        d = load_dataset("mnist", data_dir, limit_train)
        return GanData(
            "mnist",
            mnist_to_gan_range(d.train_x),
            d.train_y,
            10,
            28,
            "tanh",
            mnist_to_gan_range(d.test_x),
            d.test_y,
        )
    if name == "adult":
        folder = find_dataset_dir("adult", ["adult.data", "adult.test"], data_dir)
        train, test = (
            torch.from_numpy(
                _adult_file_indices(str(folder / f), (folder / f).stat().st_mtime_ns).copy()
            )
            for f in ("adult.data", "adult.test")
        )
        if limit_train is not None:
            if isinstance(limit_train, bool) or not isinstance(limit_train, int) or limit_train < 1:
                raise PrivgradError(f"limit_train must be an integer >= 1, got {limit_train!r}")
            train = train[:limit_train]
        return GanData(
            "adult",
            encode_adult(train),
            None,
            0,
            ADULT_SIZE,
            "adult",
            encode_adult(test),
            None,
            train,
            test,
        )
    raise PrivgradError(f"unknown GAN dataset {name!r}; valid names: mnist, adult")
