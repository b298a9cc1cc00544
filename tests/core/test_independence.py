"""Example independence (issue 43, item 2): DP-SGD's sensitivity C holds only if every
example's gradient is a function of that example alone. Batch mixers are refused by type
(rules.REFUSED, every module of the model) and everything else by the probe of
privgrad.per_sample.independence, which make_private runs before training."""

import copy
import math
import pickle
import random

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy as ce
from cli_helpers import run_cli as cli


def probe(model, loss_fn, x, y):
    # imported here: on the code before the probe existed, only the tests that need it fail
    from privgrad.per_sample.independence import check_example_independence

    check_example_independence(model, loss_fn, x, y)


def private(model, data=None, loss_fn=None, batch_size=8):
    x, y = data if data is not None else (torch.randn(64, 6), torch.randint(0, 3, (64,)))
    return privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        batch_size=batch_size,
        max_grad_norm=0.1,
        loss_fn=loss_fn,
    )


class Centre(nn.Module):
    """The batch-mean centring layer of the issue: no parameters, ``x - x.mean(0)``."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def mlp(*middle, d=6, h=8, k=3):
    return nn.Sequential(nn.Linear(d, h), *middle, nn.Tanh(), nn.Linear(h, k))


def sensitivity(model, x, y, clip=0.1, loss_fn=ce):
    """max over examples x_j of ‖Σ(D) − Σ(D∖x_j)‖ of the clipped per-sample gradient sum, with
    per-sample gradients taken by autograd one example at a time from the batch's losses (the
    issue's measure; an independent model gives at most C)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def clipped_sum(xb, yb):
        losses = loss_fn(model(xb), yb)
        total = [torch.zeros_like(p) for p in params]
        for i in range(len(xb)):
            g = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
            g = [gi if gi is not None else torch.zeros_like(p) for gi, p in zip(g, params)]
            norm = torch.sqrt(sum((gi**2).sum() for gi in g))
            total = [t + gi * min(1.0, clip / (float(norm) + 1e-12)) for t, gi in zip(total, g)]
        return total

    full = clipped_sum(x, y)
    worst = 0.0
    for j in range(len(x)):
        keep = torch.arange(len(x)) != j
        part = clipped_sum(x[keep], y[keep])
        worst = max(worst, math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(full, part))))
    return worst


# -- the wrong-ε cases of the issue: refused by make_private -----------------------------
def test_the_mixers_of_the_issue_move_the_clipped_sum_by_more_than_c():
    """Why they are refused: measured, not assumed (an MLP stays within C = 0.1)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    assert sensitivity(mlp(), x, y) <= 0.1 + 1e-6
    assert sensitivity(mlp(nn.BatchNorm1d(8, affine=False)), x, y) > 0.1 + 1e-3
    assert sensitivity(mlp(Centre()), x, y) > 0.1 + 1e-3


def test_make_private_refuses_parameter_free_batchnorm():
    with pytest.raises(
        PrivgradError, match=r"layer '1' \(BatchNorm1d\): BatchNorm mixes the examples"
    ):
        private(mlp(nn.BatchNorm1d(8, affine=False)))


def test_make_private_refuses_frozen_batchnorm():
    """Frozen (no trainable parameter) but in train mode: still batch statistics."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3)
    )
    model[1].requires_grad_(False)
    data = torch.randn(32, 1, 6, 6), torch.randint(0, 3, (32,))
    with pytest.raises(PrivgradError, match=r"layer '1' \(BatchNorm2d\): BatchNorm mixes"):
        private(model, data)


def test_make_private_refuses_a_batch_mean_centring_layer():
    with pytest.raises(
        PrivgradError, match=r"mixes the examples of a batch.*first at layer '1' \(Centre\)"
    ):
        private(mlp(Centre()))


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda out, y: ce(out, y) + ce(out, y).mean(),  # plus the batch mean
        lambda out, y: ce(out, y) - 0.5 * ce(out, y).mean(),  # minus a batch mean
        lambda out, y: ce(out, y) / ce(out, y).detach().mean(),  # normalized by a batch statistic
        lambda out, y: (
            ce(out, y) - ce(out, y).mean() + ce(out, y).mean().detach()
        ),  # same values, mixed gradient
        lambda out, y: ce(out, y) * 8 / len(y),  # depends on the batch size
    ],
    ids=["plus-mean", "minus-mean", "normalized", "detach-trick", "batch-size"],
)
def test_make_private_refuses_a_batch_coupled_loss(loss_fn):
    with pytest.raises(PrivgradError, match="per-sample losses mix the examples"):
        private(mlp(), loss_fn=loss_fn)


def test_a_batch_coupled_loss_moves_the_clipped_sum_by_more_than_c():
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    assert (
        sensitivity(mlp(), x, y, loss_fn=lambda out, t: ce(out, t) + ce(out, t).mean()) > 0.1 + 1e-3
    )


def test_a_reduced_loss_is_refused_by_make_private():
    with pytest.raises(PrivgradError, match="one value per sample"):
        private(mlp(), loss_fn=lambda out, y: ce(out, y).mean())


CLI_MODELS = """
from torch import nn


def batchnorm(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), nn.BatchNorm1d(16, affine=False),
                         nn.ReLU(), nn.Linear(16, num_classes))


class Centre(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def centring(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), Centre(), nn.ReLU(),
                         nn.Linear(16, num_classes))
"""


@pytest.mark.parametrize(
    "fn, message",
    [
        ("batchnorm", "BatchNorm mixes the examples of a batch"),
        ("centring", "the model mixes the examples of a batch"),
    ],
)
def test_cli_refuses_a_batch_mixing_python_model(tmp_path, monkeypatch, fn, message):
    (tmp_path / "indep_cli_models.py").write_text(CLI_MODELS)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(
        "train",
        "--model",
        f"python:indep_cli_models:{fn}",
        "--limit-train",
        "100",
        "--epochs",
        "1",
        "--noise-multiplier",
        "1",
        "--device",
        "cpu",
        "--db",
        str(tmp_path / "runs.db"),
        "--quiet",
    )
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "ε" not in out


# -- by type: every module, trainable or not ---------------------------------------------
@pytest.mark.parametrize(
    "module, match",
    [
        (nn.BatchNorm1d(4, affine=False), "BatchNorm mixes"),
        (nn.BatchNorm1d(4, track_running_stats=False), "BatchNorm mixes"),
        (nn.LazyBatchNorm1d(), "BatchNorm mixes"),
        (nn.SyncBatchNorm(4), "BatchNorm mixes"),
        (nn.BatchNorm1d(4).requires_grad_(False), "BatchNorm mixes"),
        (nn.InstanceNorm1d(4, track_running_stats=True), "track_running_stats=True"),
        (
            nn.InstanceNorm1d(4, affine=True, track_running_stats=True).requires_grad_(False),
            "track_running_stats",
        ),
        (nn.Embedding(10, 4, max_norm=1.0), "max_norm"),
    ],
    ids=[
        "bn-affine-false",
        "bn-no-running-stats",
        "lazy-bn",
        "sync-bn",
        "frozen-bn",
        "instancenorm-running",
        "frozen-instancenorm-running",
        "embedding-max-norm",
    ],
)
def test_known_mixers_are_refused_by_type_with_their_path(module, match):
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), module))
    with pytest.raises(
        PrivgradError, match=rf"^layer '1\.1' \({type(module).__name__}\): .*{match}"
    ) as info:
        GradSampler(model)
    message = str(info.value)
    assert "\n" not in message and ("GroupNorm" in message or "max_norm=None" in message)


def test_only_a_trainable_fused_rnn_is_refused_and_instancenorm_without_running_stats_is_accepted():
    with pytest.raises(PrivgradError, match="DPLSTM"):
        GradSampler(nn.LSTM(3, 4))
    GradSampler(nn.Sequential(nn.LSTM(3, 4).requires_grad_(False)))
    GradSampler(nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True)))


# -- accepted: independent models train as before --------------------------------------
class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.out = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 3)

    def forward(self, t):
        return self.out(self.embedding(t).mean(1))


class RandomMask(nn.Module):
    """A custom random layer (not an nn.Dropout): per element, so independent."""

    def forward(self, x):
        return x * (torch.rand_like(x) > 0.3) if self.training else x


ACCEPTED = {
    "mlp": lambda: (mlp(), torch.randn(64, 6)),
    "cnn-groupnorm": lambda: (
        nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3)
        ),
        torch.randn(64, 1, 6, 6),
    ),
    "cnn-layernorm": lambda: (
        nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.LayerNorm([4, 4, 4]),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 16, 3),
        ),
        torch.randn(64, 1, 6, 6),
    ),
    "dropout": lambda: (mlp(nn.Dropout(0.5)), torch.randn(64, 6)),
    "dropout2d": lambda: (
        nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.Dropout2d(0.3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3)
        ),
        torch.randn(64, 1, 6, 6),
    ),
    "custom-random": lambda: (mlp(RandomMask()), torch.randn(64, 6)),
    # on a CPU it draws a slope for each negative element only: the others' draws move
    "rrelu": lambda: (mlp(nn.RReLU()), torch.randn(64, 6)),
    "embedding-tokens": lambda: (Tokens(), torch.randint(0, 20, (64, 5))),
    "instancenorm": lambda: (
        nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4), nn.Flatten(), nn.Linear(4 * 16, 3)),
        torch.randn(64, 1, 6, 6),
    ),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_independent_models_are_accepted_and_left_as_they_were(name):
    model, x = ACCEPTED[name]()
    model.eval()  # the probe runs in train mode and restores the modes
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = private(model, (x, torch.randint(0, 3, (len(x),))))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m.training for m in model.modules())
    for batch in trainer.batches(2):
        trainer.step(batch)
    assert math.isfinite(trainer.epsilon())


@pytest.mark.parametrize("name", ["dropout", "custom-random"])
def test_the_probe_leaves_the_global_rng_and_the_modes_as_they_were(name):
    model, x = ACCEPTED[name]()
    model[1].eval()
    y = torch.randint(0, 3, (6,))
    rng = torch.get_rng_state()
    probe(model, ce, x[:6], y)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == [True, True, False, True, True]


def test_a_dataset_of_one_example_and_a_lazy_layer_are_probed():
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3))
    private(model, (torch.randn(1, 6), torch.tensor([1])), batch_size=0.5)
    assert model[0].weight.shape == (4, 6)
    with pytest.raises(PrivgradError, match="mixes"):
        private(
            nn.Sequential(nn.LazyLinear(4), Centre(), nn.Linear(4, 3)),
            (torch.randn(1, 6), torch.tensor([1])),
            batch_size=0.5,
        )


BUILT_IN = [
    ("cnn", (1, 28, 28), {}),
    ("lenet5", (1, 28, 28), {}),
    ("lenet5-bc", (1, 28, 28), {}),
    ("model1", (1, 28, 28), {}),
    ("model2", (3, 32, 32), {}),
    ("model3", (3, 32, 32), {}),
    ("model3", (3, 32, 32), {"norm_groups": 4}),
    ("wrn", (3, 32, 32), {"depth": 10, "width": 1}),
    ("wrn", (3, 32, 32), {}),
    ("bilstm", None, {}),
]


@pytest.mark.parametrize(
    "name, shape, options",
    BUILT_IN,
    ids=[f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}" for n, _, o in BUILT_IN],
)
def test_the_probe_accepts_every_built_in_model(name, shape, options):
    from privgrad.app.models import build_model

    if name == "bilstm":
        model, x = build_model("bilstm", (1,), 2, num_tokens=50), torch.randint(0, 50, (4, 12))
    else:
        model, x = build_model(name, shape, 10, **options), torch.rand(4, *shape)
    y = torch.randint(0, 2, (4,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    probe(model, ce, x, y)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# -- what the probe sees beyond plain batch statistics ----------------------------------
class BackwardMixer(torch.autograd.Function):
    """Identity forward; its backward hands every row the batch's mean gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.mean(0, keepdim=True).expand_as(g)


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class RunningMean(nn.Module):
    """A custom running statistic: per-example forward, but its buffer follows the batch."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


class Counter(nn.Module):
    """A buffer that changes in every forward, but not with the data: accepted, restored."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x


@pytest.mark.parametrize(
    "layer, match",
    [
        (Lambda(lambda x: BackwardMixer.apply(x)), "backward pass"),
        (Lambda(lambda x: x + x.mean(0) - x.mean(0).detach()), "backward pass"),
        (Lambda(lambda x: x * len(x)), "removed"),  # batch size
        (
            Lambda(lambda x: x * torch.arange(1, len(x) + 1, dtype=x.dtype)[:, None]),
            "mixes",
        ),  # position
        (Lambda(lambda x: x * x[-1]), "mixes"),  # one other example
        (Lambda(lambda x: x.roll(1, 0)), "mixes"),
        (Lambda(lambda x: x - x.max(0).values), "mixes"),
        (nn.Softmax(dim=0), "mixes"),
        (RunningMean(8), "buffer 'layer.mean' is updated from the training data"),
    ],
    ids=[
        "custom-backward",
        "detach-trick",
        "batch-size",
        "position",
        "last-example",
        "roll",
        "batch-max",
        "softmax-dim0",
        "running-buffer",
    ],
)
def test_the_probe_refuses_subtler_mixers(layer, match):
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(6, 8))
    model.add_module("layer", layer)
    model.add_module("out", nn.Linear(8, 3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PrivgradError, match=match):
        probe(model, ce, torch.randn(4, 6), torch.randint(0, 3, (4,)))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


class UnreproducibleBackward(torch.autograd.Function):
    """Identity forward; its backward scales each element of the gradient by 1 + ``rel`` · z
    (z standard normal, fresh at every backward): what a GPU's atomic additions do to the last
    bits, made larger. No example moves another's gradient."""

    generator = torch.Generator().manual_seed(7)

    @staticmethod
    def forward(ctx, x, rel):
        ctx.rel = rel
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        z = torch.randn(g.shape, generator=UnreproducibleBackward.generator)
        return g * (1 + ctx.rel * z), None


@pytest.mark.parametrize(
    "rel, mixer, refused",
    [
        (3e-4, False, False),  # GPU-like rounding (0.00035 at tolerance 0.00035 on an H200)
        (3e-4, True, True),  # ... does not hide a mixer that moves the others by ~1/B
        (5e-2, False, True),  # never more than MIXING (1e-2) of the scale is allowed
    ],
    ids=["rounding", "rounding-and-mixer", "beyond-mixing"],
)
def test_the_gradient_check_allows_the_backwards_own_run_to_run_change(rel, mixer, refused):
    """Check 5 on a backward that does not repeat to the bit (independence.py, Tolerance):
    with TOL alone the first case is refused as mixing, as WRN-16-4's probe was once on an
    H200 at 011316d; the rerun of the same backward sets the allowance, capped at MIXING."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), Lambda(lambda x: UnreproducibleBackward.apply(x, rel))]
    if mixer:
        layers.append(Lambda(lambda x: BackwardMixer.apply(x)))
    model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    if refused:
        with pytest.raises(PrivgradError, match="backward pass.*run twice differed"):
            probe(model, ce, x, y)
    else:
        probe(model, ce, x, y)


class Encoder(nn.Module):
    """Tokens → torch's TransformerEncoderLayer (its attention's dropout is functional, so the
    model stays random in the probe) → mean → head."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, batch_first=batch_first)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(self.encoder(self.embedding(tokens)).mean(1))


def test_attention_within_an_example_is_accepted_and_across_the_batch_refused():
    """batch_first=False on batch-first inputs attends across the examples of the batch."""
    x, y = torch.randint(0, 50, (4, 7)), torch.randint(0, 3, (4,))
    probe(Encoder(batch_first=True), ce, x, y)
    with pytest.raises(
        PrivgradError, match=r"mixes the examples.*first at layer 'encoder\.self_attn'"
    ):
        probe(Encoder(batch_first=False), ce, x, y)


def test_a_data_independent_buffer_is_accepted_and_restored():
    model = mlp(Counter())
    probe(model, ce, torch.randn(4, 6), torch.randint(0, 3, (4,)))
    assert int(model[1].calls) == 0


class ExampleCounter(nn.Module):
    """A buffer counting the examples its forwards saw: the Poisson batches' total size."""

    def __init__(self, sized: bool = False):
        super().__init__()
        self.sized = sized
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.sized:  # the last batch's rows, kept as a buffer of its size
            self.seen = x.new_zeros(len(x))
        else:
            self.seen += len(x)
        return x


@pytest.mark.parametrize("random", [False, True])
@pytest.mark.parametrize("sized", [False, True])
def test_a_buffer_that_follows_the_batch_size_is_refused(sized, random):
    """A buffer counting the examples seen passed the probe (replacing an example leaves the
    count alone) and was saved with the model: after 4 steps it held 210, the sum of the
    Poisson batches' sizes, which the accountant's subsampling keeps secret (with one training
    example, it says how often that example was drawn). A buffer sized by the batch was the
    same. Both now fail the probe's removal of an example, in a model with a custom random
    layer too (whose outputs the removal cannot compare); a count of forwards does not."""
    middle = (ExampleCounter(sized), RandomMask()) if random else (ExampleCounter(sized),)
    with pytest.raises(PrivgradError, match="buffer '1.seen' changes with the number of examples"):
        probe(mlp(*middle), ce, torch.randn(4, 6), torch.randint(0, 3, (4,)))
    probe(mlp(Counter()), ce, torch.randn(4, 6), torch.randint(0, 3, (4,)))


def test_a_buffer_first_written_after_the_check_is_refused_at_that_step():
    """A running mean that starts tracking only after its 20th call: make_private's probe saw
    its forward leave it alone, so it was accepted, and after 30 steps one example of 1000s
    (among 100) had moved the buffer, released with the model unnoised, by 8.6 per coordinate.
    The step after which it was first written is refused (and every later one, and
    save_model); a buffer every forward writes alike (a counter) still trains and resumes."""

    class LateRunningMean(RunningMean):
        def forward(self, x):
            self.calls += 1
            if self.training and self.calls > 20:
                self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
            return x

    def trainer(layer, **options):
        torch.manual_seed(0)
        model = mlp(layer)
        x, y = torch.randn(100, 6), torch.randint(0, 3, (100,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return privgrad.make_private(
            model, opt, (x, y), noise_multiplier=1.0, batch_size=20, seed=0, **options
        )

    late = trainer(LateRunningMean(8))
    with pytest.raises(PrivgradError, match="buffer '1.mean' was written during training"):
        for batch in late.batches(30):
            late.step(batch)
    assert late.steps < 30
    with pytest.raises(PrivgradError, match="buffer '1.mean'"):
        late.save_model("/nonexistent/m.pt")
    counted = trainer(Counter())
    for batch in counted.batches(3):
        counted.step(batch)
    state = counted.state_dict()
    again = trainer(Counter())
    again.load_state_dict(state)
    for batch in again.batches(2):
        again.step(batch)
    assert again.steps == 5


class LateRunningMean(RunningMean):
    """A running mean that starts tracking only after its 20th call (or, with ``put_back``,
    writes the batch's mean, uses it and writes the old value back)."""

    def __init__(self, d, put_back=False, start=20):
        super().__init__(d)
        self.put_back, self.start = put_back, start

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls > self.start:
            old = self.mean.clone()
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
            x = x - self.mean
            if self.put_back:
                self.mean.copy_(old)
        return x


def _buffer_trainer(layer, seed=0):
    torch.manual_seed(0)
    model = mlp(layer)
    x, y = torch.randn(100, 6), torch.randint(0, 3, (100,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return privgrad.make_private(model, opt, (x, y), noise_multiplier=1.0, batch_size=20, seed=seed)


def test_a_snapshot_restored_between_steps_is_not_a_written_buffer():
    """Evaluating with a snapshot of the weights, then restoring them (load_state_dict copies
    every buffer in place, with the values it held) and continuing, was refused as a buffer
    written during training. A buffer holding the value it was watched with is fine between
    steps; one a step's forward writes, even if it writes the old value back, is not."""
    counted = _buffer_trainer(LateRunningMean(8, start=10**9))  # its mean: watched, never written
    for batch in counted.batches(3):
        counted.step(batch)
    snapshot = copy.deepcopy(counted.model.state_dict())
    counted.model.load_state_dict(snapshot)
    for batch in counted.batches(2):
        counted.step(batch)
    assert counted.steps == 5
    put_back = _buffer_trainer(LateRunningMean(8, put_back=True))
    with pytest.raises(PrivgradError, match="buffer '1.mean' was written during training"):
        for batch in put_back.batches(30):
            put_back.step(batch)


def test_a_buffer_written_between_steps_is_not_checkpointed():
    """A train-mode forward on training examples outside the trainer (a user's accuracy on
    the training set) wrote a watched buffer; trainer.state_dict() saved it, and a trainer
    resumed from that state watched the written value as its own: its saved model released
    it (moved by 0.2 per coordinate here) with no refusal. state_dict now refuses it."""
    trainer = _buffer_trainer(LateRunningMean(8))
    for batch in trainer.batches(2):
        trainer.step(batch)
    layer = trainer.model[1]
    layer.calls.fill_(100)
    trainer.model(torch.randn(50, 6) + 2)  # writes the mean
    with pytest.raises(PrivgradError, match="buffer '1.mean' was written during training"):
        trainer.state_dict()


def test_a_forward_that_changes_a_parameter_in_place_is_refused():
    class Renorm(nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.mul_(1 + x.abs().mean())
            return super().forward(x)

    with pytest.raises(PrivgradError, match="changes parameter '0.weight' in place"):
        probe(nn.Sequential(Renorm(6, 3)), ce, torch.randn(4, 6), torch.randint(0, 3, (4,)))


def test_a_parameter_the_check_set_from_examples_keeps_the_model_refused():
    """Glow's ActNorm sets its parameters from its first batch: the check refused it, but left
    them holding the probe examples' statistics, and a retry with the init marked done was
    accepted with them (found by a red-team helper). The model is refused until they are
    written again."""

    class ActNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inited", torch.tensor(0))
            self.loc = nn.Parameter(torch.zeros(6))

        def forward(self, x):
            if not self.inited:
                with torch.no_grad():
                    self.loc.copy_(-x.mean(0))
                    self.inited.fill_(1)
            return x + self.loc

    torch.manual_seed(0)
    model = nn.Sequential(ActNorm(), nn.Linear(6, 3))
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))

    def make():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return privgrad.make_private(model, opt, (x, y), noise_multiplier=1.0, batch_size=8)

    with pytest.raises(PrivgradError, match="changes parameter '0.loc' in place"):
        make()
    assert torch.allclose(model[0].loc, -x[:5].mean(0))  # what the check left behind
    model[0].inited.fill_(1)
    with pytest.raises(PrivgradError, match="parameter '0.loc' holds the value"):
        make()
    with torch.no_grad():
        model[0].loc.zero_()  # reset (as a reload would)
    make()


# -- hypothesis: random models from independent and mixing blocks -------------------------
C, S = 4, 5  # channels and side of the blocks' (B, C, S, S) maps


def _attention_over_batch(x):
    f = x.flatten(1)
    weights = torch.softmax(f @ f.T / f.shape[1] ** 0.5, dim=1)  # (B, B): across examples
    return x + (weights @ f).view_as(x)


class Residual(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


INDEPENDENT = {
    "conv": lambda: nn.Conv2d(C, C, 3, padding=1),
    "groupnorm": lambda: nn.GroupNorm(2, C),
    "layernorm": lambda: nn.LayerNorm([C, S, S]),
    "instancenorm": lambda: nn.InstanceNorm2d(C),
    "relu": lambda: nn.ReLU(),
    "tanh": lambda: nn.Tanh(),
    "gelu": lambda: nn.GELU(),
    "dropout": lambda: nn.Dropout(0.3),
    "dropout2d": lambda: nn.Dropout2d(0.3),
    "random-mask": lambda: RandomMask(),
    "residual-conv": lambda: Residual(nn.Conv2d(C, C, 3, padding=1)),
    "maxpool": lambda: nn.MaxPool2d(3, stride=1, padding=1),
    "flat-linear": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(C * S * S, C * S * S), nn.Unflatten(1, (C, S, S))
    ),
    "softmax-channels": lambda: nn.Softmax(dim=1),
    "per-example-mean": lambda: Lambda(lambda x: x - x.mean((1, 2, 3), keepdim=True)),
}
MIXING = {
    "batch-mean-centring": lambda: Lambda(lambda x: x - x.mean(0, keepdim=True)),
    "batch-std-scaling": lambda: Lambda(lambda x: x / (x.std(0, keepdim=True) + 1e-3)),
    "attention-over-batch": lambda: Lambda(_attention_over_batch),
    "roll-batch": lambda: Lambda(lambda x: x.roll(1, 0)),
    "batch-sum": lambda: Lambda(lambda x: x + x.sum(0)),
    "batch-max": lambda: Lambda(lambda x: x + x.max(0).values),
    "weak-batch-mean": lambda: Lambda(lambda x: x + 0.01 * x.mean(0)),
    "batch-size": lambda: Lambda(lambda x: x * len(x) / 4),
    "batchnorm": lambda: nn.BatchNorm2d(C, affine=False),
    "detach-trick": lambda: Lambda(lambda x: x + x.mean(0) - x.mean(0).detach()),
}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(st.sampled_from(sorted(INDEPENDENT)), max_size=3),
    st.lists(st.sampled_from(sorted(MIXING)), max_size=2),
    st.randoms(use_true_random=False),
    st.integers(0, 2**16),
)
def test_the_probe_accepts_a_random_model_iff_it_has_no_mixing_block(
    independent, mixing, rnd, seed
):
    blocks = independent + mixing
    rnd.shuffle(blocks)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, C, 3, padding=1),
        *[(INDEPENDENT.get(b) or MIXING[b])() for b in blocks],
        nn.Flatten(),
        nn.Linear(C * S * S, 3),
    )
    x, y = torch.randn(4, 2, S, S), torch.randint(0, 3, (4,))
    # a custom random layer (not an nn.Dropout) has the checks that change the batch layout, the
    # only ones that see a batch-size dependence, run in eval mode (it skipped them)
    if mixing:
        with pytest.raises(PrivgradError, match="mix"):
            probe(model, ce, x, y)
    else:
        probe(model, ce, x, y)


INDEPENDENT_LOSSES = {
    "ce": ce,
    "ce-scaled": lambda out, y: 2 * ce(out, y),
    "mse": lambda out, y: ((out.softmax(1) - nn.functional.one_hot(y, 3)) ** 2).sum(1),
    "ce-plus-logit-penalty": lambda out, y: ce(out, y) + 0.1 * out.pow(2).mean(1),
    "label-smoothing": lambda out, y: nn.functional.cross_entropy(
        out, y, reduction="none", label_smoothing=0.1
    ),
}
COUPLED_LOSSES = {
    "plus-mean": lambda out, y: ce(out, y) + ce(out, y).mean(),
    "minus-mean": lambda out, y: ce(out, y) - 0.5 * ce(out, y).mean(),
    "normalized": lambda out, y: ce(out, y) / ce(out, y).detach().mean(),
    "detach-trick": lambda out, y: ce(out, y) - ce(out, y).mean() + ce(out, y).mean().detach(),
    "batch-size": lambda out, y: ce(out, y) / len(y),
    "logit-batch-centring": lambda out, y: ce(out - out.mean(0), y),
    "batch-label-frequency": lambda out, y: ce(out, y) * (y == y[0]).float().mean(),
    "rank-in-batch": lambda out, y: ce(out, y) * (1 + ce(out, y).argsort().argsort().float()),
}


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(INDEPENDENT_LOSSES) + sorted(COUPLED_LOSSES)), st.integers(0, 2**16))
def test_the_probe_accepts_a_loss_iff_it_is_per_example(name, seed):
    torch.manual_seed(seed)
    model = mlp()
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    if name in COUPLED_LOSSES:
        with pytest.raises(PrivgradError, match="mix"):
            probe(model, COUPLED_LOSSES[name], x, y)
    else:
        probe(model, INDEPENDENT_LOSSES[name], x, y)


class _DrawsByLength(nn.Module):
    """Token ids with padding (0); in training, each example's non-pad tokens are dropped by a
    NumPy draw of its length, example by example (a SpecAugment on ids). No floating input
    to perturb: the check cannot keep the draws of the examples after a replaced one."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

    def forward(self, ids):
        h = self.emb(ids)
        if self.training:
            keep = [torch.from_numpy(np.random.rand(int((r > 0).sum())) > 0.3) for r in ids]
            h = torch.stack([
                torch.cat([row[: len(k)] * k[:, None], row[len(k):]]) for row, k in zip(h, keep)
            ])  # fmt: skip
        return self.head(h.mean(1))


def test_draws_sized_by_each_example_are_refused_naming_them():
    """A model whose NumPy draws follow each example's length, on token ids, is refused as
    mixing examples (a replaced example moves the others' draws) and the refusal says the
    two forwards drew differently, and how to train."""
    ids = torch.randint(1, 10, (12, 6))
    ids[::2, 3:] = 0  # every other example padded after 3 tokens
    model = _DrawsByLength()
    with pytest.raises(PrivgradError, match="drew a different number of values from NumPy"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, torch.arange(12) % 2),
            noise_multiplier=1.0, batch_size=4,
        )  # fmt: skip


class _OwnGenerator(nn.Module):
    """Input noise in training drawn from a generator the layer holds (reproducible
    augmentation), of each kind: torch's, NumPy's (Generator, RandomState) or Python's."""

    def __init__(self, kind: str):
        super().__init__()
        self.gen = {
            "torch": lambda: torch.Generator().manual_seed(1),
            "numpy": lambda: np.random.default_rng(1),
            "randomstate": lambda: np.random.RandomState(1),
            "python": lambda: random.Random(1),
        }[kind]()

    def forward(self, x):
        if not self.training:
            return x
        g = self.gen
        if isinstance(g, torch.Generator):
            noise = torch.randn(x.shape, generator=g)
        elif isinstance(g, (np.random.Generator, np.random.RandomState)):
            noise = torch.from_numpy(g.standard_normal(tuple(x.shape))).float()
        else:
            noise = torch.tensor([g.gauss(0, 1) for _ in range(x.numel())]).view(x.shape)
        return x + 0.1 * noise


@pytest.mark.parametrize("kind", ["torch", "numpy", "randomstate", "python"])
def test_a_model_drawing_from_a_generator_it_holds_is_accepted_and_its_draws_kept(kind):
    """The checks seed a generator the model holds alike for the forwards they compare, as the
    global RNGs (each forward drew on from the last, which looked like examples mixed), and
    leave it where it was; the training steps draw from it. A mixer holding one is still
    refused."""
    layer = _OwnGenerator(kind)
    before = _generator_state(layer.gen)
    trainer = private(nn.Sequential(layer, mlp()))
    assert _generator_state(layer.gen) == before
    for batch in trainer.batches(1):
        trainer.step(batch)
    assert _generator_state(layer.gen) != before
    with pytest.raises(PrivgradError, match="mixes the examples"):
        private(nn.Sequential(_OwnGenerator(kind), mlp(Centre())))


def _generator_state(g) -> bytes:
    if isinstance(g, torch.Generator):
        return g.get_state().numpy().tobytes()
    if isinstance(g, np.random.Generator):
        return pickle.dumps(g.bit_generator.state)
    return pickle.dumps(g.get_state() if isinstance(g, np.random.RandomState) else g.getstate())


def test_a_buffer_whose_bytes_cannot_be_read_is_compared_by_nothing():
    """The watched-buffer check compares a rewritten buffer's value by its bytes' digest; a
    buffer whose bytes cannot be read so (sparse) must neither crash make_private nor pass a
    write: its digest equals nothing, so any write to it is refused as before."""
    from privgrad.private import _buffer_digest

    sparse = torch.eye(3).to_sparse()
    assert _buffer_digest(sparse) != _buffer_digest(sparse)
    assert _buffer_digest(torch.eye(3)) == _buffer_digest(torch.eye(3).clone())
    assert _buffer_digest(torch.eye(3)) != _buffer_digest(torch.eye(3).double())


class _TutorialEncoding(nn.Module):
    """PyTorch's tutorial positional encoding, which expects (sequence, batch, width), with a
    functional dropout: fed batch-first, it adds the encoding of each example's batch row."""

    def __init__(self, width: int = 8, length: int = 100):
        super().__init__()
        position = torch.arange(length).unsqueeze(1)
        rate = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        pe = torch.zeros(length, 1, width)
        pe[:, 0, 0::2], pe[:, 0, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return nn.functional.dropout(x + self.pe[: x.size(0)], 0.1, self.training)


def test_a_layout_dependence_is_refused_under_a_functional_dropout():
    """A model whose forward draws random numbers beyond nn.Dropout's had the checks that
    remove or reorder examples skipped, the only ones that see an example's row moving the
    others: the tutorial encoding fed batch-first with F.dropout passed, though one example
    drawn before 16 others moved the clipped sum (σ = 0, q = 1, C = 0.1) by 1.47 C, so at
    σ = 1, q = 0.1, 100 steps the printed ε = 7.05 stood for 15.6 (σ/1.47). They now run in
    eval mode there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), _TutorialEncoding(), Lambda(lambda h: h.mean(1)))
    model.append(nn.Linear(8, 2))
    data = torch.randint(0, 50, (64, 6)), torch.randint(0, 2, (64,))
    with pytest.raises(PrivgradError, match="when example 0 was removed"):
        private(model, data)


class _SometimesMixup(nn.Module):
    """MixUp of the hidden states (manifold mixup) on 30 % of training batches, each row with
    its neighbour's."""

    def forward(self, h):
        if self.training and float(torch.rand(())) < 0.3:
            lam = float(torch.distributions.Beta(torch.tensor(2.0), torch.tensor(2.0)).sample())
            h = lam * h + (1 - lam) * h.roll(1, 0)
        return h


def test_a_layer_that_mixes_the_batch_at_some_draws_only_is_refused():
    """Every forward of the probe starts from one seed: a manifold mixup drawing whether to
    mix (30 % of batches) drew no mixing there and passed make_private, though where it
    mixes, one example removed from 17 moved the clipped sum (σ = 0, q = 1) by 1.51 C, so at
    σ = 1, q = 0.1, 100 steps the printed ε = 7.05 stood for 11.3 with 30 of the steps mixing
    (16.5 if all did; dp-accounting PLD at σ/1.51). A forward that draws random numbers
    (nn.Dropout is off in the probe) has checks 1 and 2 run again under 8 more seeds; a model
    with F.dropout still passes."""
    torch.manual_seed(0)
    model = mlp(_SometimesMixup())
    with pytest.raises(PrivgradError, match="under seed .* may mix at some draws"):
        private(model)
    torch.manual_seed(0)
    private(mlp(_FunctionalDropout()))


class _FunctionalDropout(nn.Module):
    def forward(self, h):
        return nn.functional.dropout(h, 0.3, self.training)


class _TrimmedMean(nn.Module):
    """Token ids padded to a fixed length, trimmed to the batch's longest, averaged over it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(50, 8, padding_idx=0), nn.Linear(8, 2)

    def forward(self, ids):
        ids = ids[:, : int((ids != 0).sum(1).max())]  # the padding every row has, cut
        return self.head(self.emb(ids).mean(1))


def _ids_with_one_long(long: int) -> tuple[torch.Tensor, torch.Generator]:
    """64 rows of token ids padded to 20: 4 tokens each but row ``long``'s 20; and the
    generator that drew them, to draw the labels."""
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(64, 20, dtype=torch.long)
    for i in range(64):
        n = 20 if i == long else 4
        ids[i, :n] = torch.randint(1, 50, (n,), generator=g)
    return ids, g


def test_a_model_that_depends_on_the_batchs_longest_example_anywhere_is_refused():
    """The probe removed example 0 only and replaced example 0 and the last: a model trimming
    the padding every row shares (to the batch's longest) before an unmasked mean passed
    make_private where the probe's longest example was another (example 2 of 20 tokens, the
    others 4), though removing it from 17 moved the clipped sum (σ = 0, q = 1) by 2.55 C, so
    at σ = 1, q = 0.1, 100 steps the printed ε = 7.05 stood for 55.9 (dp-accounting PLD at
    σ/2.55). Each example is removed in turn now."""
    ids, g = _ids_with_one_long(2)
    with pytest.raises(PrivgradError, match="when example 2 was removed"):
        private(_TrimmedMean(), (ids, torch.randint(0, 2, (64,), generator=g)))


def test_a_model_that_depends_on_a_longest_example_outside_the_probe_is_refused():
    """The same trimming model with the first 5 examples all short and one of 20 tokens at
    example 40 passed make_private (the probe sees the first 5 only), though one such example
    among short ones moves the clipped sum by 2.55 C (above) in each batch that draws it. The
    first 4 are now also run with and without the example with the most nonzero entries
    among 64 spread over the data."""
    ids, g = _ids_with_one_long(40)
    with pytest.raises(PrivgradError, match="depend on the batch's longest example"):
        private(_TrimmedMean(), (ids, torch.randint(0, 2, (64,), generator=g)))
    masked = _TrimmedMean()
    masked.forward = lambda ids: masked.head(
        (masked.emb(ids) * (ids != 0)[..., None]).sum(1) / (ids != 0).sum(1, keepdim=True)
    )
    private(masked, (ids, torch.randint(0, 2, (64,), generator=g)))


class WithUnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.body(x)


def test_a_trainable_layer_the_model_never_calls_is_warned_of():
    """A trainable layer the forward never calls (an auxiliary head left in the model) got no
    gradient, and every step moved it by noise alone, without a word; make_private and attach
    now warn, naming it. A model that calls every layer gets no warning."""
    import warnings

    model = WithUnusedHead()
    before = model.unused.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"1 trainable layer .*\('unused'\).*noise alone"):
        trainer = private(model)
    trainer.step(next(iter(trainer.batches())))
    assert not torch.equal(before, model.unused.weight)  # noise alone moved it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
