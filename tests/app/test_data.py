"""Tests for privgrad.app.data: real datasets where present, tiny synthetic files otherwise."""

import gzip
import json
import pickle
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from privgrad.app.data import (
    DATASETS,
    find_dataset_dir,
    load_adult,
    load_cifar10,
    load_dataset,
    load_fashion_mnist,
    load_imdb,
    load_mnist,
    read_adult_frame,
    read_cifar_batch,
    read_idx,
    tokenize,
)
from privgrad.app.data import locate
from privgrad.app.data.images import CIFAR10_MEAN, CIFAR10_STD, IDX_FILES, MNIST_MEAN, MNIST_STD
from privgrad.errors import DataError, PrivgradError

REPO_DATA = locate.REPO_ROOT / "data"


def _find(name, files):
    """The shared datasets must be present (CI has ../shared beside the clone)."""
    return find_dataset_dir(name, files)


def write_idx(path, array):
    """Write a uint8 array as a gzip'd IDX file."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_tiny_mnist(folder, label):
    """A valid 3 + 2 image MNIST folder whose labels are all ``label``."""
    folder.mkdir(parents=True)
    for prefix, n in (("train", 3), ("t10k", 2)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", np.zeros((n, 28, 28), np.uint8))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", np.full(n, label, np.uint8))


# ---------------------------------------------------------------- MNIST / Fashion-MNIST


@pytest.fixture(scope="module")
def mnist():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PRIVGRAD_DATA", raising=False)
        assert find_dataset_dir("mnist", IDX_FILES) == REPO_DATA / "mnist"
        return load_mnist()


def test_mnist_from_repo_copy(mnist):
    assert mnist.name == "mnist" and mnist.num_classes == 10
    assert mnist.train_x.shape == (60000, 1, 28, 28) and mnist.test_x.shape == (10000, 1, 28, 28)
    assert mnist.input_shape == (1, 28, 28)
    assert mnist.train_x.dtype == torch.float32 and mnist.train_y.dtype == torch.int64
    assert mnist.train_y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    train_counts = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(mnist.train_y).tolist() == train_counts
    assert torch.bincount(mnist.test_y).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]
    lo, hi = (0 - MNIST_MEAN) / MNIST_STD, (1 - MNIST_MEAN) / MNIST_STD
    assert mnist.train_x.min() >= lo - 1e-5 and mnist.train_x.max() <= hi + 1e-5


OFFICIAL_MNIST_MD5 = {  # the official release (../shared/data/mnist/SOURCE.txt)
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}


def test_repo_mnist_is_the_official_release():
    import hashlib

    got = {
        f: hashlib.md5((REPO_DATA / "mnist" / f).read_bytes()).hexdigest()
        for f in OFFICIAL_MNIST_MD5
    }
    assert got == OFFICIAL_MNIST_MD5


def test_mnist_pixels_are_official(mnist):
    # official MNIST: black background (raw 0) and raw pixel mean 0.1307 on the train split
    raw = mnist.train_x * MNIST_STD + MNIST_MEAN
    assert abs(float(raw.mean()) - 0.1307) < 5e-4
    assert float((raw[:, :, 0, 0]).abs().max()) < 1e-5


def test_fashion_mnist_shapes():
    _find("fashion-mnist", IDX_FILES)
    d = load_fashion_mnist()
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(d.train_y).tolist() == [6000] * 10
    # The public constants are this dataset's own pixel mean/std.
    assert abs(d.train_x.mean().item()) < 0.01 and abs(d.train_x.std().item() - 1) < 0.01


def test_read_idx_plain_and_gzip(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", a)
    (tmp_path / "a").write_bytes(gzip.decompress((tmp_path / "a.gz").read_bytes()))
    for name in ("a", "a.gz"):
        b = read_idx(tmp_path / name)
        assert b.shape == (2, 3, 4) and b.flags.writeable and np.array_equal(a, b)
    big_endian = bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 2) + struct.pack(">2i", -7, 70000)
    (tmp_path / "i32").write_bytes(big_endian)
    assert read_idx(tmp_path / "i32").tolist() == [-7, 70000]


def test_truncated_idx_gz_raises(tmp_path):
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes((REPO_DATA / "mnist" / "train-labels-idx1-ubyte.gz").read_bytes()[:1000])
    with pytest.raises(DataError, match=re.escape(str(path))):
        read_idx(path)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x00\x00\x08", "magic"),  # too short
        (b"\x08\x03\x08\x01" + struct.pack(">I", 2) + b"\x01\x02", "magic"),  # bad magic
        (b"\x00\x00\x07\x01" + struct.pack(">I", 2) + b"\x01\x02", "magic"),  # bad type code
        (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated"),  # header cut short
        (b"\x00\x00\x08\x01" + struct.pack(">I", 3) + b"\x01\x02", "corrupt"),  # data cut short
        (b"\x00\x00\x08\x01" + struct.pack(">I", 1) + b"\x01\x02", "corrupt"),  # trailing bytes
    ],
)
def test_corrupt_idx_raises(tmp_path, raw, match):
    (tmp_path / "x").write_bytes(raw)
    with pytest.raises(DataError, match=match):
        read_idx(tmp_path / "x")


def test_negative_idx_labels_are_refused(tmp_path):
    """Issue 14, case 4: labels of the signed type code (0x09) below 0 are corrupt."""
    write_tiny_mnist(tmp_path / "mnist", 3)
    path = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(
            bytes([0, 0, 0x09, 1]) + struct.pack(">I", 3) + np.array([1, -2, 3], np.int8).tobytes()
        )
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{path}: train labels should be 3 values in 0..9, got int8 (3,) from -2 to 3"
        ),
    ):
        load_mnist(data_dir=tmp_path)


def test_loader_reports_corrupt_file(tmp_path):
    folder = tmp_path / "mnist"
    write_tiny_mnist(folder, 3)
    labels = folder / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:-6])
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        load_mnist(data_dir=tmp_path)


# ---------------------------------------------------------------- locating files


def test_explicit_data_dir_beats_env_beats_repo(tmp_path, monkeypatch):
    write_tiny_mnist(tmp_path / "explicit" / "mnist", 7)
    write_tiny_mnist(tmp_path / "env" / "mnist", 8)
    monkeypatch.setenv("PRIVGRAD_DATA", str(tmp_path / "env"))
    assert (
        find_dataset_dir("mnist", IDX_FILES, tmp_path / "explicit")
        == tmp_path / "explicit" / "mnist"
    )
    assert load_mnist(data_dir=tmp_path / "explicit").train_y.tolist() == [7, 7, 7]
    assert load_mnist().train_y.tolist() == [8, 8, 8]  # $PRIVGRAD_DATA before the repo's data/


def test_a_named_data_folder_is_the_only_one_used(tmp_path, monkeypatch):
    """Issue 14, case 5: with a file missing from the folder the user names (--data-dir or
    $PRIVGRAD_DATA), the data is not read from another folder."""
    write_tiny_mnist(tmp_path / "mine" / "mnist", 7)
    (tmp_path / "mine" / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    monkeypatch.delenv("PRIVGRAD_DATA", raising=False)
    with pytest.raises(DataError) as err:
        load_mnist(data_dir=tmp_path / "mine")  # the repo's data/mnist is complete
    assert str(err.value) == (
        f"mnist: expected {', '.join(IDX_FILES)} in one of: {tmp_path / 'mine' / 'mnist'}; "
        f"{tmp_path / 'mine' / 'mnist'} lacks t10k-labels-idx1-ubyte.gz"
    )
    monkeypatch.setenv("PRIVGRAD_DATA", str(tmp_path / "mine"))
    with pytest.raises(DataError, match="lacks t10k-labels-idx1-ubyte.gz"):
        load_mnist()


def test_missing_files_message(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIVGRAD_DATA", raising=False)
    with pytest.raises(DataError) as err:
        find_dataset_dir("mnist", ["no-such-file.gz"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("mnist: expected no-such-file.gz in one of: ")
    places = [REPO_DATA, locate.REPO_ROOT.parent / "shared" / "data"]
    positions = [msg.index(str(p / "mnist")) for p in places]
    assert positions == sorted(positions)
    assert msg.endswith("(set --data-dir or $PRIVGRAD_DATA)")


def test_loader_missing_dataset_names_files(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIVGRAD_DATA", raising=False)
    monkeypatch.setattr(locate, "REPO_ROOT", tmp_path / "repo")  # hide the repo and shared copies
    with pytest.raises(DataError) as err:
        load_mnist(data_dir=tmp_path / "mine")
    msg = str(err.value)
    assert (
        "\n" not in msg
        and all(f in msg for f in IDX_FILES)
        and str(tmp_path / "mine" / "mnist") in msg
    )
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        load_cifar10(data_dir=tmp_path / "mine")


# ---------------------------------------------------------------- load_dataset


def test_unknown_dataset():
    with pytest.raises(PrivgradError) as err:
        load_dataset("svhn")
    msg = str(err.value)
    assert "svhn" in msg and "\n" not in msg and all(name in msg for name in DATASETS)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_limit_train_must_be_positive_int(bad):
    with pytest.raises(PrivgradError, match="limit_train"):
        load_dataset("adult", limit_train=bad)


def test_limit_train_keeps_first_examples(tmp_path):
    write_tiny_mnist(tmp_path / "mnist", 2)
    full = load_dataset("mnist", data_dir=tmp_path)
    small = load_dataset("mnist", data_dir=tmp_path, limit_train=2)
    assert small.train_x.shape == (2, 1, 28, 28) and torch.equal(small.train_x, full.train_x[:2])
    assert small.test_x.shape == full.test_x.shape
    assert len(load_dataset("mnist", data_dir=tmp_path, limit_train=100).train_y) == 3


# ---------------------------------------------------------------- CIFAR-10


def write_cifar_batch(path, data, labels, numpy1_names=False):
    """A batch pickled like the official (python 2) files: bytes keys, protocol 2."""
    raw = pickle.dumps({b"batch_label": b"test", b"labels": labels, b"data": data}, protocol=2)
    if numpy1_names:  # the official files name numpy.core, which numpy 2 renamed numpy._core
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy.core.multiarray" in raw
    path.write_bytes(raw)


def test_cifar_pixel_layout(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batch1 = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    batch1[1, 1 * 1024 + 2 * 32 + 3] = 200  # image 1, green, row 2, column 3
    write_cifar_batch(folder / "data_batch_1", batch1, [0, 1, 2], numpy1_names=True)
    write_cifar_batch(
        folder / "data_batch_2", rng.integers(0, 256, (2, 3072), dtype=np.uint8), [3, 4]
    )
    write_cifar_batch(
        folder / "test_batch", rng.integers(0, 256, (2, 3072), dtype=np.uint8), [9, 8]
    )
    (folder / "batches.meta").write_bytes(
        pickle.dumps({b"label_names": [b"airplane"] * 10}, protocol=2)
    )
    # a run on fewer images than CIFAR-10's reports "cifar10": the load says it is a subset
    with pytest.warns(UserWarning, match=r"5 training and 2 test images, of CIFAR-10's 50,000 "):
        d = load_cifar10(data_dir=tmp_path)
    assert d.train_x.shape == (5, 3, 32, 32) and d.test_x.shape == (2, 3, 32, 32)
    assert d.train_y.tolist() == [0, 1, 2, 3, 4] and d.test_y.tolist() == [9, 8]

    def normalised(value, channel):
        return pytest.approx((value / 255 - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel], abs=1e-5)

    assert d.train_x[1, 1, 2, 3].item() == normalised(200, 1)
    assert d.train_x[0, 2, 31, 31].item() == normalised(
        batch1[0, -1], 2
    )  # last value: blue, bottom right


def test_cifar_real_subset():
    folder = _find("cifar10", ["data_batch_1", "test_batch"])
    images, labels = read_cifar_batch(folder / "test_batch")
    assert images.shape == (1000, 3, 32, 32) and images.dtype == np.uint8
    assert images[0, 0, 0, :9].tolist() == [158, 159, 165, 166, 160, 156, 162, 159, 158]
    assert labels[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]


class _Exploit:
    def __reduce__(self):
        return (print, ("pickle code ran",))


@pytest.mark.parametrize(
    "raw",
    [
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, protocol=2)[:-40],
        pickle.dumps({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}),
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}),
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}),
        pickle.dumps([1, 2, 3]),
        pickle.dumps({b"data": _Exploit(), b"labels": []}),
    ],
)
def test_corrupt_cifar_batch(tmp_path, raw, capsys):
    (tmp_path / "data_batch_1").write_bytes(raw)
    with pytest.raises(DataError, match="data_batch_1"):
        read_cifar_batch(tmp_path / "data_batch_1")
    assert "pickle code ran" not in capsys.readouterr().out


# ---------------------------------------------------------------- IMDB


def test_tokenizer():
    text = "Great film!<br /><br />It's 10/10 -- NAÏVE café<BR>end"
    assert tokenize(text) == ["great", "film", "it's", "10", "10", "na", "ve", "caf", "end"]
    assert tokenize(text) == tokenize(text)
    for s in ["İstanbul Kelvin: \u212a", "x<br/>y<br >z", "don't ''quote'' 3.14"]:
        expected = re.findall(r"[a-z0-9']+", re.sub(r"<br\s*/?>", " ", s.lower()))
        assert tokenize(s) == expected


def write_jsonl_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, (label, text) in enumerate(rows):
            f.write(
                json.dumps({"id": i, "rating": 8 if label else 2, "label": label, "text": text})
                + "\n"
            )


def test_imdb_vocab_pad_truncate(tmp_path):
    folder = tmp_path / "imdb"
    folder.mkdir()
    # Training counts: a 3, b 2, c 1, d 1 -> ids a 2, b 3, c 4 (c beats d alphabetically), d OOV.
    write_jsonl_gz(folder / "train.jsonl.gz", [(1, "b A a<br />c"), (0, "a b d")])
    write_jsonl_gz(folder / "test.jsonl.gz", [(0, "d c"), (1, ""), (1, "zzz a")])
    d = load_imdb(data_dir=tmp_path, vocab_size=3, max_len=3)
    assert d.train_x.tolist() == [[3, 2, 2], [2, 3, 1]]
    assert d.test_x.tolist() == [[1, 4, 0], [0, 0, 0], [1, 2, 0]]
    assert d.train_y.tolist() == [1, 0] and d.test_y.tolist() == [0, 1, 1]
    assert d.num_tokens == 5 and d.num_classes == 2 and d.input_shape == (3,)
    with pytest.raises(PrivgradError):
        load_imdb(data_dir=tmp_path, max_len=0)


def test_imdb_bad_record(tmp_path):
    folder = tmp_path / "imdb"
    folder.mkdir()
    write_jsonl_gz(folder / "train.jsonl.gz", [(1, "ok"), (2, "label 2")])
    write_jsonl_gz(folder / "test.jsonl.gz", [(1, "ok")])
    with pytest.raises(DataError, match=r"train.jsonl.gz: line 2"):
        load_imdb(data_dir=tmp_path)


def test_imdb_empty_file_is_refused(tmp_path):
    """Issue 14, case 6: an empty test file is not 0 test examples."""
    folder = tmp_path / "imdb"
    folder.mkdir()
    write_jsonl_gz(folder / "train.jsonl.gz", [(1, "ok"), (0, "bad")])
    write_jsonl_gz(folder / "test.jsonl.gz", [])
    with pytest.raises(DataError, match=re.escape(f"{folder / 'test.jsonl.gz'}: no reviews")):
        load_imdb(data_dir=tmp_path)


def test_imdb_full():
    _find("imdb", ["train.jsonl.gz", "test.jsonl.gz"])
    d = load_imdb()  # the only full IMDB load in this file (a few seconds)
    assert d.train_x.shape == (25000, 80) and d.test_x.shape == (25000, 80)
    assert d.train_x.dtype == torch.int64 and d.num_tokens == 20002
    assert d.train_x.min() == 0 and d.train_x.max() == 20001
    assert torch.bincount(d.train_y).tolist() == [12500, 12500] == torch.bincount(d.test_y).tolist()
    # Most reviews are longer than 80 tokens; padding only ever follows real tokens.
    assert (d.train_x[:, -1] != 0).float().mean() > 0.8
    nonzero = d.train_x != 0
    assert torch.equal(nonzero, nonzero.cummin(dim=1).values)


# ---------------------------------------------------------------- Adult


def test_adult():
    folder = _find("adult", ["adult.data", "adult.test"])
    d = load_adult()
    assert d.train_x.shape[0] == 32561 and d.test_x.shape[0] == 16281
    assert d.train_x.shape[1] == d.test_x.shape[1] and d.train_x.dtype == torch.float32
    assert torch.isfinite(d.train_x).all() and torch.isfinite(d.test_x).all()
    assert 0.2 < d.train_y.float().mean() < 0.28 and 0.2 < d.test_y.float().mean() < 0.28
    assert d.train_x[:, :6].min() >= 0 and d.train_x[:, :6].max() < 2
    assert torch.equal(d.train_x[:, 6:].sum(1), torch.full((32561,), 8.0))  # one hot per column
    test = read_adult_frame(folder / "adult.test")
    assert len(test["age"]) == 16281 and set(test["income"].tolist()) == {"<=50K", ">50K"}
    train = read_adult_frame(folder / "adult.data")
    assert train["age"][0] == 39 and train["workclass"][0] == "State-gov"
    assert "?" in set(train["workclass"].tolist())


def test_adult_features_do_not_depend_on_the_training_rows(tmp_path):
    """adult.data's one Holand-Netherlands row: without it the features keep their columns."""
    folder = _find("adult", ["adult.data", "adult.test"])
    lines = (folder / "adult.data").read_text(encoding="ascii").splitlines(keepends=True)
    rare = [line for line in lines if "Holand-Netherlands" in line]
    assert len(rare) == 1
    (tmp_path / "adult").mkdir()
    kept = "".join(line for line in lines if line not in rare)
    (tmp_path / "adult" / "adult.data").write_text(kept, encoding="ascii")
    shutil.copy(folder / "adult.test", tmp_path / "adult" / "adult.test")
    full, neighbour = load_adult(), load_adult(tmp_path)
    assert full.train_x.shape == (32561, 108) and neighbour.train_x.shape == (32560, 108)
    assert torch.equal(full.test_x, neighbour.test_x)


def test_adult_bad_row(tmp_path):
    (tmp_path / "adult.data").write_text("39, State-gov, 77516, Bachelors\n")
    with pytest.raises(DataError, match="line 1: expected 15 fields"):
        read_adult_frame(tmp_path / "adult.data")


def test_adult_negative_value_is_refused(tmp_path):
    row = (
        "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
        "Male, {}, 0, 40, United-States, <=50K\n"
    )
    (tmp_path / "adult.data").write_text(row.format(2174) + row.format(-5))
    with pytest.raises(DataError, match="adult.data: column capital-gain has a negative value"):
        read_adult_frame(tmp_path / "adult.data")  # log1p(-5) would be a NaN feature


def test_load_dataset_passes_the_text_options_to_the_loader(tmp_path):
    """load_dataset('imdb') could not set the vocabulary's size (nor max_len): only
    load_imdb could, which load_dataset's users do not call. It passes them on; a dataset
    that takes no such option says which it takes."""
    folder = tmp_path / "imdb"
    folder.mkdir()
    write_jsonl_gz(folder / "train.jsonl.gz", [(1, "b A a<br />c"), (0, "a b d")])
    write_jsonl_gz(folder / "test.jsonl.gz", [(0, "d c"), (1, ""), (1, "zzz a")])
    d = load_dataset("imdb", tmp_path, vocab_size=3, max_len=3)
    assert d.num_tokens == 5 and d.train_x.tolist() == [[3, 2, 2], [2, 3, 1]]
    one = load_dataset("imdb", tmp_path, limit_train=1, vocab_size=1, max_len=4)
    assert one.num_tokens == 3 and one.train_x.tolist() == [[1, 2, 2, 1]]  # only 'a' has an id
    for bad in (0, 2.5, True):
        with pytest.raises(PrivgradError, match="vocab_size and max_len must be integers"):
            load_dataset("imdb", tmp_path, vocab_size=bad)
    with pytest.raises(PrivgradError, match=r"load_dataset\('imdb'\) takes vocab_size, max_len; "):
        load_dataset("imdb", tmp_path, vocab=10)
    with pytest.raises(PrivgradError, match=r"load_dataset\('mnist'\) takes no options; got "):
        load_dataset("mnist", vocab_size=10)
