"""privgrad.layers.replace_batch_norm: every BatchNorm becomes a GroupNorm over the same
channels, after which a model make_private refused for its BatchNorm trains."""

import pytest
import torch
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.layers import replace_batch_norm


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48, eps=1e-3), nn.ReLU(), nn.Conv2d(48, 8, 3)
        )
        self.norm = nn.BatchNorm2d(8, affine=False)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.BatchNorm1d(16))
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.head(self.norm(self.features(x))))


def data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model):
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data(), noise_multiplier=1.0,
        batch_size=10, epochs=1, seed=0,
    )  # fmt: skip
    for batch in trainer.batches():
        trainer.step(batch)
    return trainer


def test_every_batch_norm_becomes_a_group_norm_and_the_model_trains():
    torch.manual_seed(0)
    model = Net()
    with pytest.raises(PrivgradError, match="replace_batch_norm"):
        train(model)
    assert replace_batch_norm(model, groups=32) is model
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    first, second, last = model.features[1], model.norm, model.head[2]
    assert (first.num_groups, first.num_channels, first.eps) == (16, 48, 1e-3)  # gcd(32, 48)
    assert (second.num_groups, second.affine) == (8, False)
    assert last.num_groups == 1  # a BatchNorm1d: 16 groups of one feature would output 0
    before = [p.clone() for p in model.parameters()]
    trainer = train(model)
    assert trainer.steps == 4 and 0 < trainer.epsilon() < float("inf")
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.numel())


def test_a_batch_norm_itself_and_bad_arguments():
    assert replace_batch_norm(nn.BatchNorm2d(6), groups=4).num_groups == 2
    norm = replace_batch_norm(nn.BatchNorm1d(6), groups=4)
    assert isinstance(norm, nn.GroupNorm) and norm.num_groups == 1
    x = torch.randn(5, 6)
    assert norm(x).std(0).min() > 0.1  # the features keep their variation across examples
    assert replace_batch_norm(nn.BatchNorm1d(6).double()).weight.dtype == torch.float64
    with pytest.raises(PrivgradError, match="groups must be an integer ≥ 1"):
        replace_batch_norm(nn.BatchNorm1d(6), groups=0)
    with pytest.raises(PrivgradError, match="does not know its channels"):
        replace_batch_norm(nn.Sequential(nn.LazyBatchNorm2d()))


def test_hugging_face_resnet_trains_after_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config)
    model = replace_batch_norm(model)
    x, y = data(30)
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ({"pixel_values": x}, y),
        noise_multiplier=1.0, batch_size=10, epochs=1, seed=0,
    )  # fmt: skip
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps == 3


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d, reduced: its forward applies dropout and an activation after the
    normalization."""

    def __init__(self, num_features, **kw):
        super().__init__(num_features, **kw)
        self.drop = nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


class ConfiguredBatchNorm(nn.BatchNorm2d):
    def __init__(self, num_features):
        super().__init__(num_features, eps=1e-3)


def test_a_subclass_that_computes_more_is_refused_not_silently_stripped():
    """timm's BatchNormAct2d became a bare GroupNorm, its ReLU silently gone (the model's
    outputs changed, not only its normalization); a subclass that only configures is replaced."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), BatchNormAct2d(8))
    with pytest.raises(PrivgradError, match=r"'2' \(BatchNormAct2d\).*its activation"):
        replace_batch_norm(model)
    assert type(model[1]) is nn.BatchNorm2d  # refused before anything is replaced
    held = nn.BatchNorm2d(8)
    held.act = nn.ReLU()  # a layer held by a torch BatchNorm: refused too
    with pytest.raises(PrivgradError, match=r"holds layers \(act\)"):
        replace_batch_norm(nn.Sequential(held))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), ConfiguredBatchNorm(8))
    replace_batch_norm(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].eps == 1e-3


def test_a_shared_batch_norm_becomes_one_shared_group_norm():
    """named_children() yields a shared layer once: its second place kept its BatchNorm."""
    norm = nn.BatchNorm2d(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), norm, nn.Conv2d(8, 8, 1), norm)
    replace_batch_norm(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1] is model[3]
