"""UCI Adult (census income) from the official ``adult.data`` / ``adult.test`` files.

Features (in this order) are the 6 continuous columns scaled by fixed public constants
(:data:`CONTINUOUS_SCALING`), then a one-hot block for each of the 8 categorical columns
(:data:`CATEGORICAL`) over fixed public categories (:data:`CATEGORIES`, sorted): the values
adult.names lists, plus ``'?'`` (missing) in the three columns that have it. They are never
read from the (private) training rows, so a rare value there cannot change the feature count;
a value outside them is all zeros. The label is 1 for income ``>50K``, 0 for ``<=50K``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from privgrad.app.data.base import DatasetSplits
from privgrad.app.data.locate import find_dataset_dir
from privgrad.errors import DataError

ADULT_FILES = ["adult.data", "adult.test"]

COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status",
    "occupation", "relationship", "race", "sex", "capital-gain", "capital-loss",
    "hours-per-week", "native-country", "income",
)  # fmt: skip
CONTINUOUS = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
INCOMES = ("<=50K", ">50K")
# by education-num (an ordinal scale)
EDUCATION_ORDER = (
    "Preschool", "1st-4th", "5th-6th", "7th-8th", "9th", "10th", "11th", "12th", "HS-grad",
    "Some-college", "Assoc-voc", "Assoc-acdm", "Bachelors", "Masters", "Prof-school", "Doctorate",
)  # fmt: skip
# Each categorical column's categories, fixed and public (one source for the classifier's and
# the GAN's Adult loaders): adult.names's values, sorted, and '?' in the columns that have it.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "workclass": (
        "?", "Federal-gov", "Local-gov", "Never-worked", "Private", "Self-emp-inc",
        "Self-emp-not-inc", "State-gov", "Without-pay",
    ),
    "education": tuple(sorted(EDUCATION_ORDER)),
    "marital-status": (
        "Divorced", "Married-AF-spouse", "Married-civ-spouse", "Married-spouse-absent",
        "Never-married", "Separated", "Widowed",
    ),
    "occupation": (
        "?", "Adm-clerical", "Armed-Forces", "Craft-repair", "Exec-managerial", "Farming-fishing",
        "Handlers-cleaners", "Machine-op-inspct", "Other-service", "Priv-house-serv",
        "Prof-specialty", "Protective-serv", "Sales", "Tech-support", "Transport-moving",
    ),
    "relationship": (
        "Husband", "Not-in-family", "Other-relative", "Own-child", "Unmarried", "Wife",
    ),
    "race": ("Amer-Indian-Eskimo", "Asian-Pac-Islander", "Black", "Other", "White"),
    "sex": ("Female", "Male"),
    "native-country": (
        "?", "Cambodia", "Canada", "China", "Columbia", "Cuba", "Dominican-Republic", "Ecuador",
        "El-Salvador", "England", "France", "Germany", "Greece", "Guatemala", "Haiti",
        "Holand-Netherlands", "Honduras", "Hong", "Hungary", "India", "Iran", "Ireland", "Italy",
        "Jamaica", "Japan", "Laos", "Mexico", "Nicaragua", "Outlying-US(Guam-USVI-etc)", "Peru",
        "Philippines", "Poland", "Portugal", "Puerto-Rico", "Scotland", "South", "Taiwan",
        "Thailand", "Trinadad&Tobago", "United-States", "Vietnam", "Yugoslavia",
    ),
}  # fmt: skip
CATEGORICAL = tuple(CATEGORIES)

_LOG_MONEY = math.log1p(100_000)  # capital-gain is capped at 99,999 in the census data
CONTINUOUS_SCALING = {
    "age": lambda v: v / 100,
    "fnlwgt": lambda v: v / 1e6,  # census sampling weight, up to about 1.5e6
    "education-num": lambda v: v / 16,
    "capital-gain": lambda v: np.log1p(v) / _LOG_MONEY,
    "capital-loss": lambda v: np.log1p(v) / _LOG_MONEY,
    "hours-per-week": lambda v: v / 100,
}


def read_adult_frame(path: str | Path) -> dict[str, np.ndarray]:
    """Parse an Adult file into columns: continuous ones int64, the others str arrays.

    Fields are stripped of spaces; ``income`` loses the trailing ``.`` of adult.test, so
    it is ``'<=50K'`` or ``'>50K'``. Blank lines and ``|`` comment lines are skipped.
    """
    path = Path(path)
    rows = []
    try:
        with open(path, encoding="ascii") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip() or line.startswith("|"):
                    continue
                fields = [x.strip() for x in line.split(",")]
                if len(fields) != len(COLUMNS):
                    raise DataError(
                        f"{path}: line {lineno}: expected {len(COLUMNS)} fields, found "
                        f"{len(fields)}"
                    )
                fields[-1] = fields[-1].rstrip(".")
                if fields[-1] not in INCOMES:
                    raise DataError(f"{path}: line {lineno}: unknown income value {fields[-1]!r}")
                rows.append(fields)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    if not rows:
        raise DataError(f"{path}: no data rows")
    columns = dict(zip(COLUMNS, map(np.array, zip(*rows))))
    for name in CONTINUOUS:
        try:
            columns[name] = columns[name].astype(np.int64)
        except (ValueError, OverflowError) as e:
            raise DataError(f"{path}: column {name} is not all integers ({e})") from e
        if columns[name].min() < 0:
            raise DataError(f"{path}: column {name} has a negative value ({columns[name].min()})")
    return columns


def adult_features(frame: dict[str, np.ndarray]) -> np.ndarray:
    """float32 N x 108 matrix: scaled continuous columns, then one-hot blocks over CATEGORIES."""
    blocks = [
        CONTINUOUS_SCALING[name](frame[name].astype(np.float64))[:, None] for name in CONTINUOUS
    ]
    for name in CATEGORICAL:
        blocks.append(frame[name][:, None] == np.array(CATEGORIES[name])[None, :])
    return np.concatenate(blocks, axis=1).astype(np.float32)


def load_adult(data_dir: str | Path | None = None) -> DatasetSplits:
    """Adult: 32,561 train / 16,281 test rows, float32 features, label 1 = income >50K."""
    folder = find_dataset_dir("adult", ADULT_FILES, data_dir)
    train = read_adult_frame(folder / "adult.data")
    test = read_adult_frame(folder / "adult.test")
    return DatasetSplits(
        train_x=torch.from_numpy(adult_features(train)),
        train_y=torch.from_numpy((train["income"] == ">50K").astype(np.int64)),
        test_x=torch.from_numpy(adult_features(test)),
        test_y=torch.from_numpy((test["income"] == ">50K").astype(np.int64)),
        num_classes=2,
        name="adult",
    )
