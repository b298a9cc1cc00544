"""Inputs that are tuples or dicts, models that return ``.logits`` or a dict: a transformer
classifier over padded token ids with an attention mask, trained under DP-SGD by
``make_private``, by the own loop and by the command line, with per-sample gradients equal to
a loop of single-example autograd."""

import collections
import math
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import privgrad
from privgrad.errors import PrivgradError
from privgrad.inputs import call_model
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy

from cli_helpers import run_cli

VOCAB, LENGTH, CLASSES = 30, 8, 3


class MaskedEncoder(nn.Module):
    """Token ids and an attention mask (1 = token, 0 = padding) -> class logits, through
    ``nn.TransformerEncoderLayer``; returns a tensor, a dict or an object with ``.logits``."""

    def __init__(self, out: str = "tensor", batch_first: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(16, CLASSES)
        self.out, self.batch_first = out, batch_first

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.enc(h, src_key_padding_mask=attention_mask == 0)
        if not self.batch_first:
            h = h.transpose(0, 1)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head((h * m).sum(1) / m.sum(1))
        if self.out == "dict":
            return {"logits": logits}
        if self.out == "object":
            return types.SimpleNamespace(logits=logits, hidden_states=None)
        return logits


def text_data(n: int, seed: int = 0):
    """Padded token ids of lengths 2..LENGTH, their masks and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return ids * mask, mask, torch.randint(0, CLASSES, (n,), generator=g)


class Examples(Dataset):
    """``((ids, mask), label)`` pairs, or Hugging Face style dicts with ``labels``."""

    def __init__(self, n: int, kind: str):
        self.ids, self.mask, self.y = text_data(n)
        self.kind = kind

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kind == "dict":
            return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}
        return (self.ids[i], self.mask[i]), self.y[i]


@pytest.mark.parametrize("kind, out", [("tuple", "tensor"), ("dict", "object"), ("dict", "dict")])
def test_make_private_trains_on_tuple_and_dict_inputs(kind, out):
    torch.manual_seed(0)
    model = MaskedEncoder(out)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Examples(120, kind),
        noise_multiplier=1.0,
        batch_size=12,
        max_grad_norm=1.0,
    )
    for batch in trainer.batches(3):
        trainer.step(batch)
    assert trainer.steps == 3 and math.isfinite(trainer.epsilon())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_list_of_examples_is_a_dataset_as_a_dataloader_reads_it():
    """A list of dict examples (not a torch Dataset: it was refused) takes the steps of the
    same examples as a Dataset; a bare tensor or a dict of tensors is still refused."""
    steps = []
    for data in (Examples(120, "dict"), list(Examples(120, "dict"))):
        torch.manual_seed(0)
        model = MaskedEncoder("dict")
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
            batch_size=12, max_grad_norm=1.0, seed=0,
        )  # fmt: skip
        for batch in trainer.batches(3):
            trainer.step(batch)
        steps.append([p.detach() for p in model.parameters()])
    for a, b in zip(*steps):
        assert torch.equal(a, b)
    ids, mask, y = text_data(10)
    for data in (ids, {"input_ids": ids, "labels": y}):
        with pytest.raises(PrivgradError, match="cannot train on a"):
            privgrad.make_private(
                MaskedEncoder(), torch.optim.SGD(MaskedEncoder().parameters(), lr=0.1), data,
                noise_multiplier=1.0, batch_size=2,
            )  # fmt: skip


Pair = collections.namedtuple("Pair", "input_ids attention_mask")


def test_batch_encodings_and_namedtuples_train_as_dicts_and_tuples_do():
    """Hugging Face's collators return a BatchEncoding (a mapping, not a dict): it was refused;
    a namedtuple of inputs crashed rebuilding it. Each takes the steps of its plain twin."""
    import transformers
    from torch.utils.data import default_collate

    def trained(data, collate=None):
        torch.manual_seed(0)
        model = MaskedEncoder("dict")
        loader = DataLoader(data, batch_size=12, collate_fn=collate or default_collate)
        trainer = privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
            max_grad_norm=1.0, seed=0,
        )  # fmt: skip
        for batch in trainer.batches(3):
            trainer.step(batch)
        return [p.detach() for p in model.parameters()]

    dicts = Examples(120, "dict")
    tuples = Examples(120, "tuple")
    named = [(Pair(*x), y) for x, y in tuples]

    def encode(examples):
        return transformers.BatchEncoding(default_collate(examples))

    encoded = trained(dicts, encode)
    for a, b in zip(trained(dicts), encoded):
        assert torch.equal(a, b)
    for a, b in zip(trained(tuples), trained(named)):
        assert torch.equal(a, b)
    # the draw's record of its inputs sees a BatchEncoding's tensors (torch's pytree took it
    # for a leaf: a transform of the batch in place went unchecked)
    model = MaskedEncoder("dict")
    loader = DataLoader(dicts, batch_size=12, collate_fn=encode)
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0
    )
    batch = next(iter(trainer.batches(1)))
    assert isinstance(batch.x, transformers.BatchEncoding)
    batch.x["input_ids"][0] = 1
    with pytest.raises(PrivgradError, match="inputs are not the drawn ones"):
        trainer.step(batch)
    # and the own loop hands it out as it was collated
    model = MaskedEncoder("dict")
    model, optimizer, batches = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0
    )
    x, y = next(iter(batches))
    assert isinstance(x, transformers.BatchEncoding)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(**x)["logits"], y).backward()
    optimizer.step()
    assert optimizer.steps == 1


@pytest.mark.parametrize("batch_first", [True, False])
def test_per_sample_gradients_of_dict_inputs_equal_single_example_autograd(batch_first):
    torch.manual_seed(1)
    model = MaskedEncoder("object", batch_first)
    ids, mask, y = text_data(5, seed=1)
    x = {"input_ids": ids, "attention_mask": mask}
    grads, _ = GradSampler(model, settle=True).compute(x, y, per_sample_cross_entropy)
    norms = grads.norms_sq()
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(len(y)):
        one = {k: v[i : i + 1] for k, v in x.items()}
        loss = per_sample_cross_entropy(call_model(model, one), y[i : i + 1]).sum()
        want = sum(g.pow(2).sum() for g in torch.autograd.grad(loss, params))
        torch.testing.assert_close(norms[i], want, rtol=1e-4, atol=1e-6)


def test_the_own_loop_trains_on_dict_batches():
    torch.manual_seed(0)
    model = MaskedEncoder()
    loader = DataLoader(Examples(120, "dict"), batch_size=12)
    model, optimizer, loader = privgrad.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        epochs=1,
    )
    criterion = nn.CrossEntropyLoss()
    for step, (inputs, labels) in enumerate(loader):
        assert set(inputs) == {"input_ids", "attention_mask"}
        optimizer.zero_grad()
        criterion(model(**inputs), labels).backward()
        optimizer.step()
        if step == 2:
            break
    assert optimizer.steps == 3 and math.isfinite(optimizer.epsilon())


class NoLabels(Examples):
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


class Ragged(Examples):
    def __getitem__(self, i):
        return (self.ids[i], self.mask[i, :-1] if i % 2 else self.mask[i]), self.y[i]


@pytest.mark.parametrize(
    "dataset, says",
    [
        (NoLabels(40, "dict"), "must hold its label under 'labels'"),
        (Ragged(40, "tuple"), "stack expects each tensor to be equal size"),
    ],
)
def test_bad_examples_get_one_line(dataset, says):
    """Refused by make_private (it reads example 0) or at the first step, in one line."""
    model = MaskedEncoder()
    with pytest.raises((PrivgradError, RuntimeError)) as err:
        trainer = privgrad.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset,
            noise_multiplier=1.0,
            batch_size=10,
            max_grad_norm=1.0,
        )
        for batch in trainer.batches(2):
            trainer.step(batch)
    assert says in str(err.value)


@pytest.mark.parametrize(
    "classes, y, says",
    [
        (3, torch.arange(30) % 3 * 1.0, "labels (shape (5,), float32)"),  # float labels
        (1, torch.arange(30) % 3, "output (shape (5, 1), float32)"),  # one logit, 3 classes
    ],
)
def test_labels_the_default_loss_cannot_take_are_refused_with_what_to_pass(classes, y, says):
    """Float labels, or a model with one output for labels 0..2, failed inside attach's check
    with torch's bare 'expected target dtype to be Long' / 'Target 2 is out of bounds', which
    named neither the default loss_fn privgrad had called nor loss_fn=. Now one line gives
    the output's and labels' shapes and dtypes, torch's error and what to pass."""
    model = nn.Linear(4, classes)
    with pytest.raises(PrivgradError) as err:
        privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(30, 4), y),
            noise_multiplier=1.0, batch_size=10, max_grad_norm=1.0,
        )  # fmt: skip
    message = str(err.value)
    assert message.startswith("loss_fn failed on the model's output") and says in message
    assert "default loss_fn is cross-entropy" in message and "loss_fn=" in message


def test_unpadded_examples_of_different_lengths_are_refused_with_what_to_pass():
    """A list of Hugging Face style dicts of unpadded token ids failed in attach with torch's
    default collate's 'stack expects each tensor to be equal size', naming no fix (the guide
    says variable lengths need a collate_fn that pads). Now one line says so; a DataLoader
    whose collate_fn pads them trains."""
    from torch.nn.utils.rnn import pad_sequence

    g = torch.Generator().manual_seed(0)
    examples = [
        {
            "input_ids": torch.randint(1, VOCAB, (n,), generator=g),
            "attention_mask": torch.ones(n, dtype=torch.long),
            "labels": torch.tensor(n % CLASSES),
        }
        for n in [LENGTH, LENGTH - 3] * 20
    ]
    kw = dict(noise_multiplier=1.0, batch_size=10, max_grad_norm=1.0, epochs=1, seed=0)
    model = MaskedEncoder()
    with pytest.raises(PrivgradError, match="could not be stacked") as err:
        privgrad.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), examples, **kw)
    assert "equal size" in str(err.value) and "collate_fn pads" in str(err.value)

    def pad(batch):
        out = {
            k: pad_sequence([b[k] for b in batch], batch_first=True)
            for k in ("input_ids", "attention_mask")
        }
        return {**out, "labels": torch.stack([b["labels"] for b in batch])}

    loader = DataLoader(examples, batch_size=10, collate_fn=pad)
    model = MaskedEncoder()
    with pytest.warns(UserWarning, match="Poisson"):
        model, optimizer, batches = privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, **kw
        )
    for x, y in batches:
        nn.functional.cross_entropy(model(**x), y).backward()
        optimizer.step()
    assert optimizer.steps == 4


@pytest.mark.parametrize("own_loop", [False, True])
def test_inputs_of_a_shape_the_model_cannot_take_are_refused_saying_so(own_loop):
    """Images flattened to another width than the first Linear's (a model for 3 × 28 × 28 fed
    1 × 28 × 28) failed inside make_private's and attach's check with torch's bare 'mat1 and
    mat2 shapes cannot be multiplied'. Now one line says the model failed on the first batch
    before training, gives the inputs' shape and torch's error, and points to the shape."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))
    data = (torch.randn(30, 1, 28, 28), torch.arange(30) % 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = privgrad.attach if own_loop else privgrad.make_private
    with pytest.raises(PrivgradError) as err:
        run(model, opt, data, noise_multiplier=1.0, batch_size=10, max_grad_norm=1.0)
    message = str(err.value)
    assert message.startswith("the model failed on the first batch of training examples")
    assert "inputs shape (5, 1, 28, 28), float32" in message
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied (5x784 and 2352x10)" in message
    assert "the shape the model takes" in message
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's error, chained
    data = (data[0].double(), data[1])  # another dtype: no word of the shape
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PrivgradError, match=r"failed on the first batch .*float64.*dtype") as err:
        run(model, opt, data, noise_multiplier=1.0, batch_size=10, max_grad_norm=1.0)
    assert "shape the model takes" not in str(err.value)


def test_inputs_and_labels_of_different_lengths_are_refused():
    x = {"input_ids": torch.zeros(6, 4, dtype=torch.long), "mask": torch.ones(5, 4)}
    model = MaskedEncoder()
    with pytest.raises(PrivgradError, match="first dimension"):
        privgrad.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            (x, torch.zeros(6, dtype=torch.long)),
            noise_multiplier=1.0,
            batch_size=3,
            max_grad_norm=1.0,
        )


def test_the_command_line_trains_a_dict_dataset_and_a_logits_model(tmp_path, monkeypatch):
    here = Path(__file__).resolve().parent
    (tmp_path / "textplug.py").write_text(
        f"import sys\nsys.path.insert(0, {str(here)!r})\n"
        "from test_any_inputs import CLASSES, Examples, MaskedEncoder\n\n\n"
        "def data():\n"
        "    return Examples(200, 'dict'), Examples(50, 'dict'), CLASSES\n\n\n"
        "def net(input_shape, num_classes):\n"
        "    return MaskedEncoder('object')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--dataset", "python:textplug:data", "--model", "python:textplug:net"]
    code, out, err = run_cli(
        "train", *args, "--epochs", "1", "--batch-size", "20", "--db", str(tmp_path / "r.db")
    )
    assert code == 0, err
    assert "test accuracy" in out + err and "ε" in out + err


class MixesDictInputs(nn.Module):
    """Centres the embeddings over the batch: each example's output depends on the others."""

    def __init__(self):
        super().__init__()
        self.inner = MaskedEncoder()

    def forward(self, input_ids, attention_mask):
        logits = self.inner(input_ids, attention_mask)
        return logits - logits.mean(0)


def test_a_model_that_mixes_dict_inputs_is_refused():
    model = MixesDictInputs()
    with pytest.raises(PrivgradError, match="mixes the examples"):
        privgrad.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            Examples(40, "dict"),
            noise_multiplier=1.0,
            batch_size=10,
            max_grad_norm=1.0,
        )


class MixesLogitsObject(MixesDictInputs):
    """The mixing model, its logits in an object's ``.logits`` (Hugging Face's ModelOutput)."""

    def forward(self, input_ids, attention_mask):
        return types.SimpleNamespace(logits=super().forward(input_ids, attention_mask))


def test_the_own_loop_refuses_a_model_that_mixes_examples_behind_logits():
    """attach() takes outputs with ``.logits``; one whose logits mix the batch is refused
    before any step, as make_private refuses it."""
    model = MixesLogitsObject()
    with pytest.raises(PrivgradError, match="mixes the examples"):
        privgrad.attach(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(Examples(40, "dict"), batch_size=10),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


class FloatFeatures(Dataset):
    """``{"features": x, "scale": s, "labels": y}``; example 3's scale is NaN."""

    def __init__(self, n: int = 40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.s = torch.ones(n, 1)
        self.s[3] = float("nan")
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "scale": self.s[i], "labels": self.y[i]}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, CLASSES)

    def forward(self, features, scale):
        return self.lin(features * scale)


def test_a_non_finite_dict_example_contributes_nothing_and_is_counted():
    torch.manual_seed(0)
    model = Scaled()
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        FloatFeatures(),
        noise_multiplier=1.0,
        batch_size=40 * 0.99,
        max_grad_norm=1.0,
    )
    for batch in trainer.batches(3):
        trainer.step(batch)
    assert trainer.nonfinite_examples >= 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_inputs_and_labels_as_numpy_arrays_are_refused_with_the_conversion():
    """(x, y) as NumPy arrays were read as a map-style dataset of two examples: the error
    said the batch size must lie in (0, 2], "the training set size", or that an example was
    not an (input, label) pair, neither naming the arrays. Now it says to convert them."""
    import numpy as np

    x, y = np.zeros((50, 4), dtype=np.float32), np.zeros(50, dtype=np.int64)
    model = torch.nn.Linear(4, 2)
    for data in ((x, y), [x, y], (torch.as_tensor(x), y)):
        with pytest.raises(PrivgradError, match=r"\(inputs, labels\) must be tensors, got \("):
            privgrad.make_private(
                model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
                batch_size=10,
            )  # fmt: skip
