"""Image datasets: MNIST and Fashion-MNIST (IDX files) and CIFAR-10 (python pickles).

Pixels are scaled to [0, 1] and then normalised with fixed public constants, so the
result does not depend on which examples were loaded.
"""

from __future__ import annotations

import codecs
import gzip
import math
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from numpy._core import multiarray as _multiarray

from privgrad.app.data.base import DatasetSplits
from privgrad.app.data.locate import find_dataset_dir
from privgrad.errors import DataError, warn_user

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

IDX_FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]

# IDX type codes (third magic byte); multi-byte values are big-endian.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip'd or plain) into a writable, native-endian array.

    The magic number, type code, dimensions and exact data length are checked; a
    truncated or corrupt file raises :class:`DataError` naming the file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read IDX file ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX file ({len(raw)} bytes, header needs {header})")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(
            f"{path}: corrupt IDX file: dimensions {dims} need {expected} bytes, found {len(raw)}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=math.prod(dims), offset=header)
    return data.astype(dtype.newbyteorder("="), copy=True).reshape(dims)


class _NumpyUnpickler(pickle.Unpickler):
    """Unpickler that can only build numpy arrays: a pickle can otherwise run any code."""

    _GLOBALS = {
        ("numpy._core.multiarray", "_reconstruct"): _multiarray._reconstruct,
        ("numpy._core.multiarray", "scalar"): _multiarray.scalar,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
    }

    def find_class(self, module: str, name: str):
        if module.startswith("numpy.core."):  # pickles written by numpy 1.x
            module = "numpy._core." + module[len("numpy.core.") :]
        try:
            return self._GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}") from None


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch: ``(uint8 N x 3 x 32 x 32 images, int64 N labels)``.

    The file is a pickled dict with ``b'data'`` (uint8 N x 3072, channel-major: 1024 red,
    then green, then blue values, each row by row) and ``b'labels'``; any N is accepted.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            batch = _NumpyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # unpickling corrupt bytes can fail in many ways
        raise DataError(f"{path}: cannot read CIFAR-10 batch ({type(e).__name__}: {e})") from e
    if not isinstance(batch, dict):
        raise DataError(
            f"{path}: corrupt CIFAR-10 batch (expected a dict, got {type(batch).__name__})"
        )
    try:
        data = np.asarray(batch.get(b"data", batch.get("data")))
        labels = np.asarray(batch.get(b"labels", batch.get("labels")))
    except (ValueError, TypeError) as e:  # e.g. ragged lists
        raise DataError(f"{path}: corrupt CIFAR-10 batch ({type(e).__name__}: {e})") from e
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or not len(data):
        raise DataError(
            f"{path}: corrupt CIFAR-10 batch (expected b'data' uint8 N x 3072, N ≥ 1, "
            f"got {data.dtype} {data.shape})"
        )
    if (
        labels.shape != (len(data),)
        or labels.dtype.kind not in "iu"
        or (labels.size and (labels.min() < 0 or labels.max() > 9))
    ):
        raise DataError(
            f"{path}: corrupt CIFAR-10 batch (expected {len(data)} labels in 0..9, "
            f"got {labels.dtype} {labels.shape})"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _normalise(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 N x C x H x W -> float32, scaled to [0, 1], then per-channel (x - mean) / std."""
    x = torch.from_numpy(images).to(torch.float32).div_(255)
    return x.sub_(torch.tensor(mean).view(-1, 1, 1)).div_(torch.tensor(std).view(-1, 1, 1))


def _load_idx_dataset(
    name: str, mean: float, std: float, data_dir: str | Path | None
) -> DatasetSplits:
    folder = find_dataset_dir(name, IDX_FILES, data_dir)
    tensors = []
    for prefix in ("train", "t10k"):
        images = read_idx(folder / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz")
        if images.dtype != np.uint8 or images.shape[1:] != (28, 28):
            raise DataError(
                f"{folder / f'{prefix}-images-idx3-ubyte.gz'}: {prefix} images should be "
                f"uint8 N x 28 x 28, got {images.dtype} {images.shape}"
            )
        if len(images) == 0:
            raise DataError(f"{folder / f'{prefix}-images-idx3-ubyte.gz'}: no images")
        bad_values = (
            labels.dtype.kind not in "iu" or labels.min(initial=0) < 0 or labels.max(initial=0) > 9
        )
        if labels.shape != (len(images),) or bad_values:
            raise DataError(
                f"{folder / f'{prefix}-labels-idx1-ubyte.gz'}: {prefix} labels should be "
                f"{len(images)} values in 0..9, got {labels.dtype} {labels.shape}"
                + (
                    f" from {labels.min()} to {labels.max()}"
                    if labels.dtype.kind in "iu" and labels.size
                    else ""
                )
            )
        tensors += [
            _normalise(images[:, None], (mean,), (std,)),
            torch.from_numpy(labels.astype(np.int64)),
        ]
    return DatasetSplits(*tensors, num_classes=10, name=name)


def load_mnist(data_dir: str | Path | None = None) -> DatasetSplits:
    """MNIST: 60,000 / 10,000 images as float32 N x 1 x 28 x 28, normalised (0.1307, 0.3081)."""
    return _load_idx_dataset("mnist", MNIST_MEAN, MNIST_STD, data_dir)


def load_fashion_mnist(data_dir: str | Path | None = None) -> DatasetSplits:
    """Fashion-MNIST: like :func:`load_mnist`, normalised with (0.2860, 0.3530)."""
    return _load_idx_dataset("fashion-mnist", FASHION_MNIST_MEAN, FASHION_MNIST_STD, data_dir)


CIFAR10_SIZES = (50_000, 10_000)  # the full release's training and test images


def load_cifar10(data_dir: str | Path | None = None) -> DatasetSplits:
    """CIFAR-10 from ``cifar-10-batches-py``: every ``data_batch_1..5`` present, and ``test_batch``.

    Images are float32 N x 3 x 32 x 32 normalised per channel with the public constants
    :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`.
    """
    folder = find_dataset_dir("cifar10", ["data_batch_1", "test_batch"], data_dir)
    train = [
        read_cifar_batch(p) for i in range(1, 6) if (p := folder / f"data_batch_{i}").is_file()
    ]
    test_images, test_labels = read_cifar_batch(folder / "test_batch")
    n_train, n_test = sum(len(b[1]) for b in train), len(test_labels)
    if n_train < CIFAR10_SIZES[0] or n_test < CIFAR10_SIZES[1]:
        # a run on it reports "cifar10" and its accuracy: say that it is not CIFAR-10's
        warn_user(
            f"cifar10 in {folder} has {n_train:,} training and {n_test:,} test images, of "
            f"CIFAR-10's {CIFAR10_SIZES[0]:,} and {CIFAR10_SIZES[1]:,}: results on it are a "
            f"subset's (label them so, e.g. 'CIFAR-10, {n_train / 1000:g}k subset'), not "
            "comparable to full CIFAR-10's"
        )
    return DatasetSplits(
        train_x=_normalise(np.concatenate([b[0] for b in train]), CIFAR10_MEAN, CIFAR10_STD),
        train_y=torch.from_numpy(np.concatenate([b[1] for b in train])),
        test_x=_normalise(test_images, CIFAR10_MEAN, CIFAR10_STD),
        test_y=torch.from_numpy(test_labels),
        num_classes=10,
        name="cifar10",
    )
