"""benchmarks/fastdp_contender.py: fastDP's book-keeping step is DP-SGD with the same
clipping as the other contenders (σ = 0: the update equals a hand-computed clipped-sum
step), and its refusals.

fastDP is a third-party benchmark contender that is not on PyPI: it is copied from its
repository into .fastdp/ (git-ignored) by hand, so CI does not have it and these tests
skip there, as expected."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / ".fastdp" / "fastDP" / "__init__.py").is_file():
    pytest.skip(
        ".fastdp/fastDP absent: fastDP is a third-party benchmark contender, not on PyPI, set "
        "up by hand (see benchmarks/fastdp_contender.py); CI does not have it, as expected",
        allow_module_level=True,
    )


def _load():
    name = "fastdp_contender"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


contender = _load()


class TinyConv(nn.Module):
    """Conv2d → GroupNorm → tanh → Linear: the image models' layer types."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(self.conv(x))).flatten(1))


class TinySeq(nn.Module):
    """Embedding → Linear over positions → LayerNorm → mean → Linear: the transformer's."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.norm(torch.relu(self.lin(self.emb(ids)))).mean(1))


def _batch(kind, batch=6):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (batch,), generator=g)
    if kind == "conv":
        return torch.randn(batch, 2, 5, 5, generator=g, dtype=torch.float64), y
    return torch.randint(0, 11, (batch, 4), generator=g), y


def _model(kind):
    torch.manual_seed(0)
    return (TinyConv if kind == "conv" else TinySeq)().double()


def _per_sample_grads(model, x, y):
    """Each example's gradient of its own cross-entropy, by a loop."""
    params = list(model.parameters())
    grads = []
    for i in range(len(x)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads.append(torch.autograd.grad(loss, params))
    return grads


def _reference_update(kind, x, y, clip, lr):
    """DP-SGD at σ = 0 by hand: clip each example's flat gradient to ``clip`` (factor
    min(1, C / (‖g‖ + 1e-6)), as fastDP's Abadi clipping writes it), sum, divide
    by the batch size (fastDP's loss_reduction='mean'), one SGD step; returns the change."""
    model = _model(kind)
    before = [p.detach().clone() for p in model.parameters()]
    grads = _per_sample_grads(model, x, y)
    norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in grads])
    scale = torch.clamp(clip / (norms + 1e-6), max=1.0)  # 1e-6: fastDP's (and Opacus') guard
    summed = [sum(s * gs[j] for s, gs in zip(scale, grads)) for j in range(len(before))]
    return [-lr * g / len(x) for g in summed], norms, before


@pytest.mark.parametrize("mode", ["MixOpt", "ghost"])
@pytest.mark.parametrize("kind", ["conv", "seq"])
def test_sigma_zero_step_is_clipped_sum_dpsgd(kind, mode):
    x, y = _batch(kind)
    lr = 0.5
    # a threshold between the norms: some examples clipped, some not
    _, norms, _ = _reference_update(kind, x, y, 1.0, lr)
    clip = norms.median().item()
    expected, norms, before = _reference_update(kind, x, y, clip, lr)
    assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()

    model = _model(kind)
    step = contender.fastdp_step(model, x, y, 0.0, clip, lr, clipping_mode=mode)
    step()
    got = [p.detach() - b for p, b in zip(model.parameters(), before)]
    for (name, _), g, e in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12, msg=f"{name}")


def test_noise_is_sigma_c_over_batch():
    """σ > 0: the update differs from the σ = 0 update by N(0, (lr σ C / B)²) per coordinate."""
    x, y = _batch("conv", batch=4)
    sigma, clip, lr = 2.0, 0.5, 1.0
    updates = []
    for s in (0.0, sigma):
        model = _model("conv")
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.manual_seed(3)
        contender.fastdp_step(model, x, y, s, clip, lr)()
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    noise = updates[1] - updates[0]
    assert noise.numel() > 300
    assert noise.std().item() == pytest.approx(lr * sigma * clip / len(x), rel=0.15)


def test_refuses_unsupported_layers():
    """nn.MultiheadAttention (and BatchNorm) have no fastDP rule: refused, not dropped."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(contender.FastDPCannotHandle, match="BatchNorm1d"):
        contender.fastdp_step(model, x, y, 1.0, 1.0, 0.1)
    assert issubclass(contender.FastDPCannotHandle, contender.FastDPUnavailable)


def test_absent_checkout_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(contender, "FASTDP_ROOT", tmp_path)
    monkeypatch.setattr(contender, "FASTDP_INFO", {})
    with pytest.raises(contender.FastDPUnavailable, match="absent"):
        contender.load_fastdp()
