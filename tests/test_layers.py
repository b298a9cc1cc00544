"""Per-sample rules of issue 39's layers equal a loop of single-example autograd.

Each model runs with the generic (vmap) rule disabled, so a layer without its own rule
fails here instead of passing by the fallback; norms and clipped sums come from a fresh
pass (their fast forms: Gram/ghost norms, chunked builds, book-kept sums), the per-sample
gradients from another."""
import pytest
import torch
from torch import nn

from privgrad.per_sample import GradSampler, engine, rules
from privgrad.private import per_sample_cross_entropy
from test_per_sample import loop_grads

pytestmark = pytest.mark.usefixtures("float32_convolutions")


def _no_generic(module, inputs, grads):
    raise AssertionError(f"{type(module).__name__} fell to the generic vmap rule")


class Seq(nn.Module):
    """Sequence input (B, T, d) through ``body``, then flattened to a linear head."""

    def __init__(self, *body, classes=3):
        super().__init__()
        self.body, self.head = nn.Sequential(*body), nn.LazyLinear(classes)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


LAYER_CASES = {
    "conv1d": (lambda: Seq(nn.Conv1d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                           nn.Conv1d(4, 5, 2, dilation=2, bias=False), nn.Tanh(), nn.Conv1d(5, 4, 4, stride=2)),
               lambda: torch.randn(6, 3, 19)),
    "conv3d": (lambda: Seq(nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1), nn.Tanh(),
                           nn.Conv3d(3, 2, 2, dilation=(1, 1, 2), bias=False)),
               lambda: torch.randn(6, 2, 4, 5, 6)),
    "conv-transpose2d": (lambda: Seq(nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                                     nn.ConvTranspose2d(3, 4, (2, 3), dilation=(1, 2), bias=False), nn.Tanh(),
                                     nn.ConvTranspose2d(4, 2, 4, stride=(2, 1), padding=(1, 2))),
                         lambda: torch.randn(6, 2, 4, 5)),
    "rmsnorm": (lambda: Seq(nn.Linear(5, 8), nn.RMSNorm(8), nn.Tanh(), nn.RMSNorm((7, 8), eps=1e-3)),
                lambda: torch.randn(6, 7, 5)),
    "instancenorm": (lambda: Seq(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True), nn.Tanh(),
                                 nn.Unflatten(2, (1, 5)), nn.InstanceNorm2d(4, affine=True), nn.Tanh(),
                                 nn.Unflatten(3, (1, 5)), nn.InstanceNorm3d(4, affine=True, eps=1e-3)),
                     lambda: torch.randn(6, 2, 7)),
    "prelu": (lambda: Seq(nn.Linear(5, 4), nn.PReLU(), nn.Linear(4, 4), nn.PReLU(7, init=0.1),
                          nn.Unflatten(2, (2, 2)), nn.PReLU(7, init=-0.3)),
              lambda: torch.randn(6, 7, 5)),
}


def check_against_loop(model, x, y, device, monkeypatch, rtol=1e-4, atol=2e-5):
    model(x)   # materialise lazy layers
    monkeypatch.setattr(engine, "generic_rule", _no_generic)
    sampler = GradSampler(model, settle=True)
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    assert [id(p) for p in fast.params] == [id(p) for p in model.parameters() if p.requires_grad]
    norms = fast.norms_sq()
    w = torch.rand(len(x), device=device)
    sums = fast.weighted_sum(w)
    slow, _ = sampler.compute(x, y, per_sample_cross_entropy)
    per_sample = [g for layer in slow.layers for g in layer.per_sample()]
    expected = loop_grads(model, x, y, per_sample_cross_entropy)
    for i in range(len(x)):
        for got, want in zip(per_sample, expected[i]):
            torch.testing.assert_close(got[i], want, atol=atol, rtol=rtol)
    want_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in expected])
    torch.testing.assert_close(norms, want_norms, rtol=1e-4, atol=1e-6)
    for got, *per_example in zip(sums, *expected):
        torch.testing.assert_close(got, sum(wi * g for wi, g in zip(w, per_example)), atol=atol, rtol=rtol)


@pytest.mark.parametrize("form", ["default", "ghost", "build-grouped", "build-correlation", "build-patches"])
@pytest.mark.parametrize("name", LAYER_CASES)
def test_layer_rule_equals_loop(name, form, device, monkeypatch):
    """Every new rule, and for the conv rules every form of the Conv2d machinery they reuse
    (Gram norms, the three builds, chunked, with book-kept sums)."""
    if form != "default":
        if name not in ("conv1d", "conv3d", "conv-transpose2d"):
            pytest.skip("one form only")
        monkeypatch.setattr(rules.ConvGrads, "use_ghost", property(lambda self: form == "ghost"))
        if form.startswith("build-"):
            monkeypatch.setattr(rules.ConvGrads, "build_form", form.removeprefix("build-"))
        monkeypatch.setattr(rules, "_CHUNK_FLOATS", 1)
        monkeypatch.setattr(rules, "CUDA_CHUNK_FLOATS", 1)
        monkeypatch.setattr(rules.ConvGrads, "keep_built", False)
        monkeypatch.setattr(rules.Conv3dGrads, "keep_built", False)
    make, make_x = LAYER_CASES[name]
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, 3, (6,), device=device)
    x[0] = x[1]
    check_against_loop(model, x, y, device, monkeypatch)
