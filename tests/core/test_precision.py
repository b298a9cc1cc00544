"""Mixed precision (issue 39, item 6): the forward and backward under autocast, the private
part in the parameters' fp32 (privgrad/per_sample/engine.py, GradSampler's docstring)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.per_sample.engine import GradSampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def per_example_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def model_and_batch(device, batch=16):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 6, 3),
        nn.GroupNorm(2, 6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 10 * 10, 32),
        nn.LayerNorm(32),
        nn.Tanh(),
        nn.Linear(32, 10),
    ).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 1, 12, 12, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    return model, x, y


def loop_norms(model, x, y, dtype):
    """Each example's gradient norm from its own forward and backward under the same autocast
    (the single-example reference; fp32 when ``dtype`` is None)."""
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = per_example_loss(model(x[i : i + 1]), y[i : i + 1]).sum()
        loss.backward()
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    return torch.stack(norms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_norms_match_the_single_example_loop_and_are_fp32(device, precision, dtype):
    if device == "cpu" and precision == "fp16" and not _cpu_fp16_autocast():
        pytest.skip("this torch build has no fp16 autocast on CPU")
    model, x, y = model_and_batch(device)
    per_sample, losses = GradSampler(model, precision=precision).compute(x, y, per_example_loss)
    norms = per_sample.norms_sq().sqrt()
    # everything the mechanism touches is fp32, on the fp32 parameters
    assert norms.dtype == losses.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    sums = per_sample.weighted_sum(torch.ones(len(x), device=device))
    assert all(s.dtype == torch.float32 for s in sums)
    # the same low-precision forward per example: agreement to the rounding of a batched vs a
    # single-example low-precision forward (bf16 keeps 8 bits: relative 2^-8 per op, a few ops)
    ref = loop_norms(model, x, y, dtype)
    tol = 0.05 if precision == "bf16" else 0.01
    torch.testing.assert_close(norms, ref, rtol=tol, atol=1e-3)
    # and close to the fp32 gradient, farther than fp32's own agreement
    fp32 = GradSampler(model).compute(x, y, per_example_loss)[0].norms_sq().sqrt()
    torch.testing.assert_close(fp32, loop_norms(model, x, y, None), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norms, fp32, rtol=tol, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_forward_really_runs_in_bf16(device):
    """The autocast is on: a bf16 run's norms differ from fp32's by bf16 rounding (a silently
    ignored precision would give fp32's to the last bit)."""
    model, x, y = model_and_batch(device)
    fp32 = GradSampler(model).compute(x, y, per_example_loss)[0].norms_sq()
    bf16 = GradSampler(model, precision="bf16").compute(x, y, per_example_loss)[0].norms_sq()
    assert not torch.equal(fp32, bf16)
    assert ((bf16 - fp32).abs() / fp32).max() > 1e-4


def test_an_unknown_precision_is_refused():
    model, _, _ = model_and_batch("cpu")
    with pytest.raises(PrivgradError, match="precision must be one of fp32, bf16, fp16"):
        GradSampler(model, precision="fp8")


def _cpu_fp16_autocast() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.ones(2, 2) @ torch.ones(2, 2) is not None
    except RuntimeError:
        return False


def test_make_private_trains_in_bf16_with_the_same_epsilon_as_fp32():
    """The API's precision: the same run in bf16 and fp32 spends the identical ε (precision
    changes the gradients, not the mechanism) and both train."""
    from privgrad import make_private

    results = {}
    for precision in ("fp32", "bf16"):
        model, x, y = model_and_batch("cpu", batch=64)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        private = make_private(
            model, opt, (x, y), noise_multiplier=1.0, batch_size=16, precision=precision
        )
        assert private.grad_sampler.precision == precision
        for batch in private.batches(3):
            private.step(batch)
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        results[precision] = private.epsilon()
    assert results["fp32"] == results["bf16"]
    with pytest.raises(PrivgradError, match="precision must be one of"):
        model, x, y = model_and_batch("cpu")
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            (x, y),
            noise_multiplier=1.0,
            precision="half",
        )


def test_an_own_loop_stepping_inside_its_autocast_block_takes_the_same_steps():
    """loss.backward() and optimizer.step() inside the `with torch.autocast(...)` block that
    runs the forward (a common layout) made the private step's clipping and noise run in
    bf16 and fail in torch's 'attempting to assign a gradient with dtype BFloat16'; the step
    runs in float32 there too, the same steps as a step outside the block."""
    import privgrad

    weights = {}
    for inside in (False, True):
        model, x, y = model_and_batch("cpu", batch=64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = privgrad.attach(
            model, optimizer, (x, y), noise_multiplier=1.0, batch_size=16, seed=0
        )
        for xb, yb in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(xb).float(), yb)
                if inside:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            if not inside:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        weights[inside] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights[False], weights[True]))


@pytest.mark.parametrize("own_loop", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_trainable_parameters_in_16_bits_are_refused(dtype, own_loop):
    """Held in bf16, the clipped sum was rounded apart from the norms that clipped it: one
    example's released gradient reached 1.01 C. Frozen 16-bit parameters are fine."""
    import privgrad

    model, x, y = model_and_batch("cpu")
    model.to(dtype)
    make = privgrad.attach if own_loop else privgrad.make_private
    with pytest.raises(PrivgradError, match="trainable parameter '0.weight' is .*float16"):
        make(model, torch.optim.SGD(model.parameters(), lr=0.1), (x.to(dtype), y),
             noise_multiplier=1.0, batch_size=4)  # fmt: skip
    frozen = nn.Linear(144, 32).to(dtype).requires_grad_(False)
    head = nn.Linear(32, 10)
    mixed = nn.Sequential(nn.Flatten(), frozen, Float(), head)
    make(mixed, torch.optim.SGD(head.parameters(), lr=0.1), (x.to(dtype), y),
         noise_multiplier=1.0, batch_size=4)  # fmt: skip


class Float(nn.Module):
    def forward(self, x):
        return x.float()


class Mixed(nn.Module):
    """A frozen bfloat16 base feeding a float32 head (a fine-tuned classifier): its forward
    cannot run without autocast."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(12, 16).bfloat16().requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x)))


def test_a_model_of_mixed_dtypes_is_checked_under_the_declared_autocast():
    """make_private's checks ran its forward without autocast: a raw dtype error from torch.
    Without a declared precision they now say to declare it; with one (make_private's
    precision, or attach's for the user's own autocast) they run under it, and the own loop
    takes the trainer's steps."""
    import privgrad

    g = torch.Generator().manual_seed(2)
    data = torch.randn(40, 12, generator=g), torch.randint(0, 3, (40,), generator=g)
    kw = dict(target_epsilon=2.0, epochs=1, batch_size=10, seed=3)
    for entry in (privgrad.make_private, privgrad.attach):
        model = Mixed()
        with pytest.raises(PrivgradError, match="mix dtypes \\(bfloat16, float32\\); declare"):
            entry(model, torch.optim.SGD(model.head.parameters(), lr=0.5), data, **kw)
    ref = Mixed()
    trainer = privgrad.make_private(
        ref, torch.optim.SGD(ref.head.parameters(), lr=0.5), data, precision="bf16", **kw
    )
    for batch in trainer.batches():
        trainer.step(batch)
    own = Mixed()
    base = own.base.weight.clone()
    model, optimizer, loader = privgrad.attach(
        own, torch.optim.SGD(own.head.parameters(), lr=0.5), data, precision="bf16", **kw
    )
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = per_example_loss(model(x), y).mean()
        loss.backward()
        optimizer.step()
    assert optimizer.steps == trainer.steps == 4
    assert optimizer.epsilon() == trainer.epsilon()
    for p, q in zip(ref.parameters(), own.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert torch.equal(own.base.weight, base) and not torch.equal(
        own.head.weight, Mixed().head.weight
    )


class MixedAndMixing(Mixed):
    """Mixed, plus a batch-mean term: one example moves the others' outputs."""

    def forward(self, x):
        h = torch.tanh(self.base(x))
        return self.head(h + h.mean(0, keepdim=True))


def test_a_model_of_mixed_dtypes_that_mixes_examples_is_refused_under_its_autocast():
    """The checks that run under the declared autocast still see a batch-mixing model."""
    import privgrad

    g = torch.Generator().manual_seed(2)
    data = torch.randn(40, 12, generator=g), torch.randint(0, 3, (40,), generator=g)
    for entry in (privgrad.make_private, privgrad.attach):
        model = MixedAndMixing()
        with pytest.raises(PrivgradError, match="one example moves the others"):
            entry(
                model, torch.optim.SGD(model.head.parameters(), lr=0.5), data,
                target_epsilon=2.0, epochs=1, batch_size=10, precision="bf16",
            )  # fmt: skip
