"""Fuzzing the data readers: random truncations and corruptions of a small valid file of
each format give either a DataError naming the file or a parse that satisfies the
format's invariants; never another exception, never silent garbage (NaN features,
labels out of range, mismatched lengths)."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from privgrad.app.data import load_mnist, read_adult_frame, read_cifar_batch
from privgrad.app.data.images import IDX_FILES
from privgrad.app.data.tabular import CONTINUOUS, adult_features
from privgrad.app.data.text import read_imdb_jsonl
from privgrad.errors import DataError

N_CASES = 250  # per format


def corrupt(raw: bytes, rng: np.random.Generator) -> bytes:
    """One random truncation, byte flip, insertion, deletion or overwrite of ``raw``."""
    kind = rng.integers(5)
    at = int(rng.integers(len(raw) + 1))
    if kind == 0:
        return raw[:at]
    if kind == 1:
        buf = bytearray(raw)
        for i in rng.integers(0, len(raw), int(rng.integers(1, 9))):
            buf[i] = int(rng.integers(256))
        return bytes(buf)
    if kind == 2:
        return (
            raw[:at]
            + rng.integers(0, 256, int(rng.integers(1, 16))).astype(np.uint8).tobytes()
            + raw[at:]
        )
    if kind == 3:
        return raw[:at] + raw[at + int(rng.integers(1, 64)) :]
    fill = rng.choice([0, 0xFF, 0x30, 0x2C, 0x0A])
    return raw[:at] + bytes([fill]) * int(rng.integers(1, 32)) + raw[at + 32 :]


def corrupt_gzip(raw: bytes, rng: np.random.Generator) -> bytes:
    """Mostly the content (so that the parser, not only gzip's CRC, is exercised), else the
    stream."""
    if rng.random() < 0.75:
        return gzip.compress(corrupt(raw, rng), mtime=0)
    return corrupt(gzip.compress(raw, mtime=0), rng)


def fuzz(path, valid: bytes, read, check, rng, corrupter=corrupt):
    outcomes = {"refused": 0, "parsed": 0}
    for _ in range(N_CASES):
        path.write_bytes(corrupter(valid, rng))
        try:
            result = read()
        except DataError as e:
            assert str(path) in str(e) and "\n" not in str(e), str(e)
            outcomes["refused"] += 1
            continue
        check(result)
        outcomes["parsed"] += 1
    return outcomes


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    return (
        bytes([0, 0, code, array.ndim])
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.tobytes()
    )


def test_fuzz_idx(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "mnist"
    folder.mkdir()
    valid = {}
    for prefix, n in (("train", 3), ("t10k", 2)):
        valid[f"{prefix}-images-idx3-ubyte.gz"] = idx_bytes(
            rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        )
        valid[f"{prefix}-labels-idx1-ubyte.gz"] = idx_bytes(rng.integers(0, 10, n).astype(np.uint8))
    for name, raw in valid.items():
        (folder / name).write_bytes(gzip.compress(raw, mtime=0))

    def check(d):
        for x, y in ((d.train_x, d.train_y), (d.test_x, d.test_y)):
            assert x.shape[1:] == (1, 28, 28) and len(x) == len(y) > 0 and torch.isfinite(x).all()
            assert y.dtype == torch.int64 and 0 <= y.min() and y.max() <= 9

    def gzip_or_plain(raw, rng):
        return corrupt_gzip(raw, rng) if rng.random() < 0.5 else corrupt(raw, rng)

    totals = {"refused": 0, "parsed": 0}
    for name in IDX_FILES:  # each file in turn: the images' and the labels' checks
        out = fuzz(
            folder / name,
            valid[name],
            lambda: load_mnist(data_dir=tmp_path),
            check,
            rng,
            gzip_or_plain,
        )
        totals = {k: totals[k] + out[k] for k in totals}
        (folder / name).write_bytes(gzip.compress(valid[name], mtime=0))
    assert totals["refused"] > 2 * N_CASES and totals["parsed"] > 0


def test_fuzz_cifar_pickle(tmp_path):
    rng = np.random.default_rng(1)
    valid = pickle.dumps(
        {
            b"batch_label": b"x",
            b"labels": [3, 9],
            b"data": rng.integers(0, 256, (2, 3072)).astype(np.uint8),
        },
        protocol=2,
    )

    def check(result):
        data, labels = result
        assert data.dtype == np.uint8 and data.shape[1:] == (3, 32, 32) and len(data) > 0
        assert (
            labels.dtype == np.int64
            and labels.shape == (len(data),)
            and labels.min() >= 0
            and labels.max() <= 9
        )

    path = tmp_path / "data_batch_1"
    out = fuzz(path, valid, lambda: read_cifar_batch(path), check, rng)
    assert out["refused"] > N_CASES // 2


def test_fuzz_imdb_jsonl_gz(tmp_path):
    rng = np.random.default_rng(2)
    lines = [
        f'{{"id": {i}, "rating": {8 if i % 2 else 2}, "label": {i % 2}, "text": "review {i}: '
        f'fine<br />film"}}'
        for i in range(6)
    ]
    valid = ("\n".join(lines) + "\n").encode()

    def check(result):
        texts, labels = result
        assert len(texts) == len(labels) > 0 and all(isinstance(t, str) for t in texts)
        assert labels.dtype == np.int64 and set(labels.tolist()) <= {0, 1}

    path = tmp_path / "train.jsonl.gz"
    out = fuzz(path, valid, lambda: read_imdb_jsonl(path), check, rng, corrupt_gzip)
    assert out["refused"] > N_CASES // 2 and out["parsed"] > 0


def test_fuzz_adult_csv(tmp_path):
    rng = np.random.default_rng(3)
    valid = (
        b"39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
        b"Male, "
        b"2174, 0, 40, United-States, <=50K\n"
        b"50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, "
        b"Husband, White, "
        b"Male, 0, 0, 13, United-States, >50K.\n"
        b"|1x3 Cross validator\n"
        b"38, ?, 215646, HS-grad, 9, Divorced, ?, Not-in-family, White, Male, 0, 1902, 40, ?, "
        b"<=50K\n"
    )

    def check(frame):
        n = len(frame["income"])
        assert n > 0 and all(len(col) == n for col in frame.values())
        assert set(frame["income"].tolist()) <= {"<=50K", ">50K"}
        for name in CONTINUOUS:
            assert frame[name].dtype == np.int64 and frame[name].min() >= 0
        assert np.isfinite(adult_features(frame)).all()

    path = tmp_path / "adult.data"
    out = fuzz(path, valid, lambda: read_adult_frame(path), check, rng)
    assert out["refused"] > N_CASES // 4 and out["parsed"] > 0


@pytest.mark.parametrize("code", [0x09, 0x0B, 0x0C])
def test_signed_idx_labels_below_zero_are_refused(tmp_path, code):
    """A fuzz case written out: negative labels of every signed IDX type (issue 14, case 4)."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    dtype = {0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4"}[code]
    for prefix, n in (("train", 3), ("t10k", 2)):
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            idx_bytes(np.zeros((n, 28, 28), np.uint8))
        )
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            idx_bytes(np.array([-1] + [1] * (n - 1), dtype), code)
        )
    with pytest.raises(
        DataError, match="train-labels-idx1-ubyte.gz: train labels should be 3 values in 0..9"
    ):
        load_mnist(data_dir=tmp_path)
