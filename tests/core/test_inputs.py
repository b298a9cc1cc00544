"""Inputs as a tensor, a tuple/list or a dict of tensors (privgrad/inputs.py)."""

import types

import pytest
import torch

from privgrad.errors import DataError
from privgrad.inputs import call_model, logits_of, rows, split_labels, take, to_device


def test_rows_of_every_input_shape():
    a, b = torch.zeros(5, 3), torch.zeros(5, 7, 2)
    assert rows(a) == rows((a, b)) == rows([a, [b]]) == rows({"a": a, "b": (b,)}) == 5


@pytest.mark.parametrize(
    "bad, says",
    [
        ((torch.zeros(5, 3), torch.zeros(4, 3)), "inputs[0]: (5, 3), inputs[1]: (4, 3)"),
        ({"ids": torch.zeros(5), "mask": torch.tensor(1.0)}, "inputs['mask']: ()"),
        ({"ids": torch.zeros(5), "text": ["a"] * 5}, "inputs['text'][0] is a str"),
        ((), "hold no tensor"),
    ],
)
def test_bad_shapes_get_one_line_naming_the_input(bad, says):
    with pytest.raises(DataError) as err:
        rows(bad)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_take_and_to_device_keep_the_structure():
    x = {"ids": torch.arange(10).view(5, 2), "pair": (torch.arange(5), [torch.arange(5) * 2])}
    keep = torch.tensor([True, False, True, False, True])
    got = take(to_device(x, "cpu"), keep)
    assert got["ids"].tolist() == [[0, 1], [4, 5], [8, 9]]
    assert got["pair"][0].tolist() == [0, 2, 4] and isinstance(got["pair"][1], list)
    assert got["pair"][1][0].tolist() == [0, 4, 8]


def test_labels_inside_a_dict_are_taken_out_once():
    x = {"input_ids": torch.zeros(3, 4), "labels": torch.tensor([0, 1, 2])}
    inputs, y = split_labels(x)
    assert set(inputs) == {"input_ids"} and y.tolist() == [0, 1, 2]
    assert split_labels((torch.zeros(3),), torch.ones(3))[1].tolist() == [1, 1, 1]
    with pytest.raises(DataError, match="give them once"):
        split_labels(x, torch.zeros(3))


class _Pair(torch.nn.Module):
    def forward(self, a, b=None, *, mask=None):
        out = a + (0 if b is None else b)
        return out if mask is None else out * mask


def test_the_model_is_called_with_the_inputs_spread():
    a, b, m = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.zeros(2, 3)
    model = _Pair()
    assert call_model(model, a).sum() == 6
    assert call_model(model, (a, b)).sum() == 18
    assert call_model(model, {"a": a, "b": b, "mask": m}).sum() == 0


def test_logits_are_read_from_a_tensor_a_dict_or_an_attribute():
    t = torch.ones(2, 3)
    assert logits_of(t) is t
    assert logits_of({"logits": t, "loss": None}) is t
    assert logits_of(types.SimpleNamespace(logits=t, hidden_states=None)) is t
    with pytest.raises(DataError, match="returned a tuple"):
        logits_of((t, t))
