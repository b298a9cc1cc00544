"""Per-sample gradients equal a loop of single-example autograd gradients."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import privgrad
from privgrad.errors import PrivgradError
from privgrad.app.models import build_model, cnn, lenet5
from privgrad.per_sample import EngineFlags, GradSampler, fused
from privgrad.per_sample import rules
from privgrad.per_sample.flags import fused_dot, gemm_dot
from privgrad.per_sample.independence import MAX_PROBE
from privgrad.per_sample.tables import ReplayInstead
from privgrad.per_sample.rules import (
    ConvGrads,
    LinearGrads,
    MaskedGrads,
    auto_takes_fused,
    products,
    tf32_split,
)
from privgrad.private import per_sample_cross_entropy
from kernel_guard import skip_unless_fused_runs  # tests/kernel_guard.py


class Scale(nn.Module):
    """A layer no rule knows: handled by the generic vmap rule."""

    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.tanh(x * self.gain)


class TextModel(nn.Module):
    """Embedding, a linear layer over a sequence, LayerNorm, a reused (recurrent) cell."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 6, padding_idx=0)
        self.proj = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.cell = nn.Linear(8, 8)
        self.scale = Scale(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(torch.relu(self.proj(self.emb(x))))
        state = torch.zeros(x.shape[0], 8, device=x.device)
        for t in range(h.shape[1]):
            state = torch.tanh(self.cell(state) + h[:, t])
        return self.head(self.scale(state))


def conv_groupnorm():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1, dilation=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, dilation=2, bias=False),
        nn.Flatten(),
        nn.LazyLinear(5),
    )


def conv_rectangular():
    """Unequal kernel sides, strides, padding and dilation along height and width."""
    return nn.Sequential(
        nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.Tanh(),
        nn.Flatten(),
        nn.LazyLinear(4),
    )


pytestmark = pytest.mark.usefixtures("float32_convolutions")


def loop_grads(model, x, y, loss_fn):
    out = []
    for i in range(len(x)):
        model.zero_grad()
        loss_fn(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        out.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    return out


CASES = {
    "cnn": (cnn, lambda: torch.randn(6, 1, 28, 28), 10),
    "lenet5": (lenet5, lambda: torch.randn(6, 1, 28, 28), 10),
    "conv-groupnorm": (conv_groupnorm, lambda: torch.randn(6, 1, 12, 12), 5),
    "conv-rectangular": (conv_rectangular, lambda: torch.randn(6, 2, 9, 7), 4),
    "text": (TextModel, lambda: torch.randint(0, 30, (6, 7)), 3),
    # residual blocks with GroupNorm, a 1×1 strided shortcut (WRN-10-1, 8×8 images)
    "wrn": (
        lambda: build_model("wrn", (3, 8, 8), 4, act="relu", depth=10, width=1, norm_groups=4),
        lambda: torch.randn(6, 3, 8, 8),
        4,
    ),
}


@pytest.mark.parametrize("build", ["grouped", "correlation", "patches"])
@pytest.mark.parametrize("name", CASES)
def test_per_sample_equals_loop(name, build, device):
    flags = EngineFlags(conv_build=build)
    make, make_x, classes = CASES[name]
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, classes, (6,), device=device)
    x[0, ...] = x[1, ...]  # repeated tokens / identical samples are handled too
    model(x)  # materialise lazy layers
    # settled layers (built during backward) included
    sampler = GradSampler(model, settle=True, flags=flags)
    psg, losses = sampler.compute(x, y, per_sample_cross_entropy)
    # the engine covers every trainable parameter, in model order
    assert [id(p) for p in psg.params] == [id(p) for p in model.parameters()]
    expected = loop_grads(model, x, y, per_sample_cross_entropy)
    per_sample = [g for layer in psg.layers for g in layer.per_sample()]
    for i in range(len(x)):
        for got, want in zip(per_sample, expected[i]):
            torch.testing.assert_close(got[i], want, atol=2e-5, rtol=1e-4)
    # the lazy views agree with the materialised gradients
    norms = sum(g.flatten(1).pow(2).sum(1) for g in per_sample)
    torch.testing.assert_close(psg.norms_sq(), norms, rtol=1e-4, atol=1e-6)
    w = torch.rand(len(x), device=device)
    for got, g in zip(psg.weighted_sum(w), per_sample):
        torch.testing.assert_close(got, torch.einsum("b,b...->...", w, g), atol=1e-5, rtol=1e-4)


class ConvTwice(nn.Module):
    """One conv layer called on two inputs in a forward pass (its gradient sums both calls)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(3 * 2 * 4 * 4, 4)

    def forward(self, x):
        return self.head(torch.cat([self.conv(x), self.conv(torch.tanh(x))], 1).flatten(1))


class CellConvTwice(nn.Module):
    """A conv whose kernel is a whole number of stride-sized cells ((4, 3) of stride (2, 1)),
    padded, called on two inputs of different sizes: the Gram form may use cells."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (4, 3), stride=(2, 1), padding=(1, 2))
        self.head = nn.LazyLinear(4)

    def forward(self, x):
        return self.head(
            torch.cat(
                [self.conv(x).flatten(1), self.conv(torch.tanh(x[..., :6, :5])).flatten(1)], 1
            )
        )


FAST_CASES = {
    **CASES,
    "conv-twice": (ConvTwice, lambda: torch.randn(6, 2, 8, 8), 4),
    "cell-conv-twice": (CellConvTwice, lambda: torch.randn(6, 2, 8, 7), 4),
}


@pytest.mark.parametrize(
    "form",
    [
        "ghost-cells",
        "ghost-patches",
        "build-grouped",
        "build-correlation",
        "build-patches",
        "fused",
    ],
)
@pytest.mark.parametrize("name", FAST_CASES)
def test_fast_paths_equal_materialised(name, form, device):
    """Trust checklist 14: the norms and the clipped sum that never materialise per-sample
    gradients (Gram/ghost form, chunked building or the fused Triton kernels, then
    book-keeping) equal those of the materialised gradients, for every conv and linear rule,
    whichever form a layer takes (a conv's Gram from patches or, where its kernel is whole
    cells, from cells; a conv builds any of three ways: samples as groups, input channels
    correlated, or unfolded patches times the output gradient), on every device present."""
    if form == "fused":
        skip_unless_fused_runs(device)
    flags = EngineFlags(
        norm_form=form.split("-")[0],
        conv_gram="cells" if form == "ghost-cells" else "patches",
        conv_build=form.removeprefix("build-") if form.startswith("build-") else "auto",
        chunk_floats=1,  # one sample per chunk: chunking is exercised
        cuda_chunk_floats=1,
        keep_built=False,  # book-keeping sum, not the built gradients
    )
    make, make_x, classes = FAST_CASES[name]
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, classes, (6,), device=device)
    model(x)
    sampler = GradSampler(model, flags=flags)
    fast, _ = sampler.compute(x, y, per_sample_cross_entropy)
    slow, _ = sampler.compute(x, y, per_sample_cross_entropy)
    per_sample = [g for layer in slow.layers for g in layer.per_sample()]
    norms = sum(g.flatten(1).pow(2).sum(1) for g in per_sample)
    torch.testing.assert_close(fast.norms_sq(), norms, rtol=1e-4, atol=1e-6)
    w = torch.rand(len(x), device=device)
    for got, g in zip(fast.weighted_sum(w), per_sample):
        torch.testing.assert_close(got, torch.einsum("b,b...->...", w, g), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["auto", "fused"])
@pytest.mark.parametrize("name", FAST_CASES)
def test_masked_gradients_equal_the_masked_materialised(name, form, device):
    """GIP's prune-then-clip masks every per-sample gradient by one mask per parameter
    (:meth:`LayerGrads.masked`). The masked norms and clipped sum, unbuilt where the rule can
    (the fused kernels mask each tile before squaring; the sum is the mask times the
    book-kept sum) or materialised, equal those of the materialised gradients times the mask."""
    if form == "fused":
        skip_unless_fused_runs(device)
    make, make_x, classes = FAST_CASES[name]
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, classes, (6,), device=device)
    model(x)
    sampler = GradSampler(model, flags=EngineFlags(norm_form=form, keep_built=False))
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    gen = torch.Generator().manual_seed(0)
    keep = [(torch.rand(p.shape, generator=gen) < 0.5).to(device) for p in psg.params]
    it = iter(keep)
    masked = psg.map_layers(lambda layer: layer.masked([next(it) for _ in layer.params]))
    # unbuilt exactly where the kernel runs: every linear layer under "fused" (and the convs
    # it takes), under "auto" the linear layers auto_takes_fused sends to it (CUDA only)
    fused = [
        isinstance(layer, (LinearGrads, ConvGrads)) and layer.use_fused for layer in psg.layers
    ]
    assert [isinstance(layer, MaskedGrads) for layer in masked.layers] == fused
    if form == "fused":
        assert all(f for f, layer in zip(fused, psg.layers) if isinstance(layer, LinearGrads))
    elif device == "cpu":
        assert not any(fused)
    slow, _ = sampler.compute(x, y, per_sample_cross_entropy)
    grads = [g for layer in slow.layers for g in layer.per_sample()]
    per_sample = [g * k for g, k in zip(grads, keep)]
    norms = sum(g.flatten(1).pow(2).sum(1) for g in per_sample)
    torch.testing.assert_close(masked.norms_sq(), norms, rtol=1e-4, atol=1e-6)
    w = torch.rand(len(x), device=device)
    for got, g in zip(masked.weighted_sum(w), per_sample):
        torch.testing.assert_close(got, torch.einsum("b,b...->...", w, g), atol=1e-5, rtol=1e-4)


def test_empty_batch_gives_zero_gradients():
    model = cnn()
    psg, losses = GradSampler(model).compute(
        torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), per_sample_cross_entropy
    )
    assert psg.batch_size == 0 and losses.numel() == 0
    assert all(
        torch.equal(s, torch.zeros_like(p))
        for s, p in zip(psg.weighted_sum(torch.zeros(0)), psg.params)
    )


def test_batchnorm_is_refused():
    with pytest.raises(PrivgradError, match="BatchNorm"):
        GradSampler(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))


def test_fused_lstm_is_refused():
    """The refusal names a replacement that imports, as written (it named
    privgrad.app.models.DPLSTM, which does not)."""
    import importlib
    import re

    with pytest.raises(PrivgradError, match="DPLSTM") as refused:
        GradSampler(nn.LSTM(3, 4))
    path = re.search(r"use ([\w.]+DPLSTM)", str(refused.value)).group(1)
    module, name = path.rsplit(".", 1)
    lstm = getattr(importlib.import_module(module), name)(3, 4)
    assert lstm(torch.randn(2, 5, 3)).shape == (2, 5, 4)


@pytest.mark.parametrize(
    "layer", [nn.Embedding(9, 4, sparse=True), nn.EmbeddingBag(9, 4, sparse=True)]
)
def test_a_sparse_embedding_is_refused_in_one_line(layer):
    """make_private's check crashed on its sparse gradient (reshape of a sparse tensor)."""
    with pytest.raises(PrivgradError, match="use sparse=False"):
        GradSampler(nn.Sequential(layer))


def test_quantization_aware_training_with_observers_on_is_refused():
    """prepare_qat's observers record activation ranges from the batch into buffers; make_private
    crashed restoring them (their shapes change in the first forward)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    torch.ao.quantization.prepare_qat(model, inplace=True)
    with pytest.raises(PrivgradError, match="observers record value ranges"):
        GradSampler(model)
    model.apply(torch.ao.quantization.disable_observer)
    GradSampler(model)


def test_legacy_weight_norm_is_refused_naming_its_parameters_and_the_replacement():
    """It was refused with 'per-sample gradients missing for some parameters' alone."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the legacy form
        layer = nn.utils.weight_norm(nn.Linear(4, 3))
    with pytest.raises(PrivgradError, match=r"weight_g, weight_v .*parametrizations.weight_norm"):
        GradSampler(nn.Sequential(layer)).compute(
            torch.randn(4, 4), torch.zeros(4, dtype=torch.long), per_sample_cross_entropy
        )


def test_lstm_cell_is_refused_with_a_replacement_that_imports():
    """A loop of LSTMCell was refused as a loss reading a layer's second output, with the
    advice to detach it (which changes the model)."""
    import importlib
    import re

    with pytest.raises(PrivgradError, match="LSTMCell returns") as refused:
        GradSampler(nn.Sequential(nn.LSTMCell(3, 4)))
    path = re.search(r"as ([\w.]+LSTMDirection) does", str(refused.value)).group(1)
    module, name = path.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name)(3, 4)(torch.randn(2, 5, 3)).shape == (
        2,
        5,
        4,
    )


def test_reduced_loss_is_refused():
    model = nn.Linear(3, 2)
    with pytest.raises(PrivgradError, match="one value per sample"):
        GradSampler(model).compute(
            torch.randn(4, 3),
            torch.zeros(4, dtype=torch.long),
            lambda out, y: nn.functional.cross_entropy(out, y),
        )


class FirstExampleEmbedding(nn.Module):
    """Embeds the first example's tokens only: the Embedding's input has no batch dimension."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.emb(x[0]).mean(0, keepdim=True).expand(len(x), -1))


def test_layer_input_without_batch_dimension_is_named():
    """Issue 14, case 12: not "stack expects each tensor to be equal size"."""
    x, y = torch.randint(0, 10, (3, 5)), torch.tensor([0, 1, 0])
    with pytest.raises(
        PrivgradError,
        match=r"layer 'emb' \(Embedding\) was called on an input of shape "
        r"\(5,\) and returned an output of shape \(5, 4\) for a batch of 3: per-sample "
        r"gradients need the batch",
    ):
        GradSampler(FirstExampleEmbedding()).compute(x, y, per_sample_cross_entropy)[0].norms_sq()


class PositionEmbedding(nn.Embedding):
    """Takes the batch's token ids and embeds positions 0..T-1 once for all examples, scaled,
    as BART's learned position embedding does when its caller passes cache positions (and
    its word embedding scales the rows it looks up)."""

    def forward(self, ids):
        return 3.0 * super().forward(torch.arange(ids.shape[1])[None])


class TablePositions(nn.Module):
    """A position table of its own (not an nn.Embedding): one row for all examples."""

    def __init__(self, positions: int, d: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(positions, d))

    def forward(self, ids):
        return self.table[None, : ids.shape[1]]


class SharedPositions(nn.Module):
    def __init__(self, table=False):
        super().__init__()
        self.tok, self.pos, self.head = (
            nn.Embedding(10, 4),
            TablePositions(5, 4) if table else PositionEmbedding(5, 4),
            nn.Linear(4, 2),
        )

    def forward(self, ids):
        return self.head((self.tok(ids) + self.pos(ids)).mean(1))


def test_an_embedding_subclass_is_recorded_at_its_lookup():
    """An nn.Embedding subclass whose forward makes its own ids and scales the rows: the layer
    recorded is the lookup inside it (the ids it was given, the rows it returned), under the
    Embedding rule, not the generic one. Its one row of positions for the batch is refused by
    a bare sampler and, once allowed (make_private's check), copied to each example: the
    per-sample gradients are the loop's."""
    torch.manual_seed(0)
    model = SharedPositions()
    x, y = torch.randint(0, 10, (3, 5)), torch.tensor([0, 1, 0])
    sampler = GradSampler(model)
    with pytest.raises(PrivgradError, match=r"'pos'.*\(1, 5\).*\(1, 5, 4\).*One row of ids"):
        sampler.compute(x, y, per_sample_cross_entropy)
    sampler.assume_layouts = True
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    assert sampler.expanded == {model.pos}
    assert all(type(layer).__name__ == "EmbeddingGrads" for layer in psg.layers[:2])
    got = [g for layer in psg.layers for g in layer.per_sample()]
    for i, want in enumerate(loop_grads(model, x, y, per_sample_cross_entropy)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w)


class FailingLookup(nn.Embedding):
    """Looks up its ids, then raises when told to (a subclass whose forward fails)."""

    fail = False

    def forward(self, ids):
        rows = super().forward(ids)
        if self.fail:
            raise ValueError("planted")
        return rows


def test_a_failing_embedding_subclass_leaves_no_lookup_recorder_behind():
    """The recorder of an Embedding subclass's lookups is active during its forward only:
    after a forward that raised, no torch function mode is left on the stack, and the next
    computation records as before."""
    torch.manual_seed(0)
    model = nn.Sequential(FailingLookup(10, 4), nn.Flatten(), nn.Linear(20, 2))
    x, y = torch.randint(0, 10, (3, 5)), torch.tensor([0, 1, 0])
    sampler = GradSampler(model)
    model[0].fail = True
    with pytest.raises(ValueError, match="planted"):
        sampler.compute(x, y, per_sample_cross_entropy)
    assert torch._C._len_torch_function_stack() == 0
    model[0].fail = False
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    got = [g for layer in psg.layers for g in layer.per_sample()]
    for i, want in enumerate(loop_grads(model, x, y, per_sample_cross_entropy)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w)


def test_a_layer_whose_output_ignores_the_batch_is_refused_with_the_cause():
    x, y = torch.randint(0, 10, (3, 5)), torch.tensor([0, 1, 0])
    with pytest.raises(
        PrivgradError, match=r"'pos'.*\(3, 5\).*\(1, 5, 4\).*output one row for all examples"
    ):
        GradSampler(SharedPositions(table=True)).compute(x, y, per_sample_cross_entropy)


class Film(nn.Module):
    """A layer no rule knows, called with several arguments: its input and a per-example
    condition in a tuple (the batch on their first axis), a shared table and a keyword
    (shared); with ``p``, a dropout inside it. Its input is multiplied by a matrix of its own
    through ``torch.mm``, which privgrad's tables do not read as meeting the batch (``@`` and
    ``F.linear`` do): the generic rule replays it."""

    def __init__(self, d, p=0.0):
        super().__init__()
        self.gain, self.shift = nn.Parameter(torch.randn(d, d)), nn.Parameter(torch.randn(d))
        self.drop = nn.Dropout(p)

    def forward(self, x, conditions, table=None, *, scale=1.0):
        out = self.drop(torch.mm(x, self.gain) * torch.sigmoid(conditions[0])) + self.shift * scale
        return out if table is None else out * table.mean(0)


class Conditioned(nn.Module):
    def __init__(self, p=0.0, rows=10):
        super().__init__()
        self.inp, self.film, self.head = nn.Linear(5, 4), Film(4, p), nn.Linear(4, 3)
        self.register_buffer("table", torch.randn(rows, 4))  # as many rows as a batch

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(self.film(h, (x[:, :4],), self.table, scale=2.0))


@pytest.mark.parametrize("form", ["vmap", "loop"])
def test_both_replay_forms_give_the_loops_gradients_and_refuse_dropout(form):
    """EngineFlags.replay_form: the generic rule's replay by vmap or one example at a time by
    autograd gives each example's gradients, and refuses a dropout inside the replayed layer
    in training alike (the loop sees the RNG move)."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 5), torch.arange(10) % 3
    flags = EngineFlags(replay_form=form)
    for model, fails in ((Conditioned(), False), (Conditioned(p=0.5), True)):
        sampler = GradSampler(model, flags=flags)
        sampler.assume_layouts = True  # as make_private's check leaves it
        with pytest.raises(ReplayInstead, match="'film'"):
            sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
        if fails:
            with pytest.raises(PrivgradError, match=r"'film': Film.*draws random numbers"):
                sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
            continue
        sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
        sampler.assume_layouts = False
        psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
        got = dict(zip(map(id, psg.params), (g for u in psg.layers for g in u.per_sample())))
        for i, want in enumerate(loop_grads(model, x, y, per_sample_cross_entropy)):
            for p, w in zip(model.parameters(), want):
                torch.testing.assert_close(got[id(p)][i], w)


def test_a_layer_called_with_several_arguments_is_replayed_on_those_the_check_saw_batched():
    """The generic rule replays a call with several arguments one example at a time on the
    arguments that carried the batch at the check (here on 4 examples: the input and the
    condition), the others shared. At a batch of 10, the 10-row table stays shared: splitting
    it between the examples, as its shape alone would suggest, gives other gradients. A bare
    sampler refuses the call, and a dropout inside the replayed layer in training is refused
    with the cause. A table whose rows number the probe's examples is learned shared by
    make_private's second check, on one example fewer."""
    torch.manual_seed(0)
    model = Conditioned()
    x, y = torch.randn(10, 5), torch.arange(10) % 3
    sampler = GradSampler(model)
    with pytest.raises(PrivgradError, match=r"'film' \(Film\).*several arguments.*not see"):
        sampler.compute(x, y, per_sample_cross_entropy)
    sampler.assume_layouts = True  # as make_private's check leaves it
    with pytest.raises(ReplayInstead, match="'film'"):  # its matrix meets no batch: replayed
        sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
    sampler.compute(x[:4], y[:4], per_sample_cross_entropy)
    sampler.assume_layouts = False
    assert sampler.batched_args == {model.film: frozenset({0, 1})}
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    got = dict(zip(map(id, psg.params), (g for layer in psg.layers for g in layer.per_sample())))
    params = list(model.parameters())
    for i, want in enumerate(loop_grads(model, x, y, per_sample_cross_entropy)):
        for p, w in zip(params, want):
            torch.testing.assert_close(got[id(p)][i], w)
    kept = torch.arange(10) % 2 == 0
    call = rules.Replay((x, (x[:, :4],), model.table), {"scale": 2.0}, frozenset({0, 1}))
    picked = call.select(model.film, kept)
    assert {k: t.shape[0] for k, t in picked.tensors().items()} == {0: 5, 1: 5, 2: 10}
    assert picked.kwargs == {"scale": 2.0} and torch.equal(picked.args[1][0], x[kept, :4])
    dropping = GradSampler(Conditioned(p=0.5))
    dropping.assume_layouts = True
    with pytest.raises(ReplayInstead, match="'film'"):
        dropping.compute(x, y, per_sample_cross_entropy)
    with pytest.raises(
        PrivgradError, match=r"layer 'film': Film.*draws random numbers in training"
    ):
        dropping.compute(x, y, per_sample_cross_entropy)
    chance = Conditioned(rows=MAX_PROBE)  # the shared table's rows number the probe's examples
    trainer = privgrad.make_private(
        chance, torch.optim.SGD(chance.parameters(), lr=0.1), (torch.randn(40, 5), y.repeat(4)),
        target_epsilon=3.0, epochs=1, batch_size=10,
    )  # fmt: skip
    # the check on the probe's 5 examples failed, the one on 4 passed and taught the layouts
    assert trainer.grad_sampler.batched_args == {chance.film: frozenset({0, 1})}
    x5, y5 = x[:MAX_PROBE], y[:MAX_PROBE]
    psg, _ = trainer.grad_sampler.compute(x5, y5, per_sample_cross_entropy)
    got = dict(zip(map(id, psg.params), (g for layer in psg.layers for g in layer.per_sample())))
    for i, want in enumerate(loop_grads(chance, x5, y5, per_sample_cross_entropy)):
        for p, w in zip(chance.parameters(), want):
            torch.testing.assert_close(got[id(p)][i], w)


class BatchState:
    """A cache-like argument: state of the whole batch, not a tensor argument."""

    def __init__(self, state):
        self.state = state


class CacheMix(nn.Module):
    """Reads its input as the rows of a cache of the whole batch (as a state cache does), and
    multiplies it by a matrix of its own through ``torch.mm`` (the generic rule replays it)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.eye(4))

    def forward(self, h, cache):
        return torch.mm(h.reshape(len(cache.state), -1), self.gain) + cache.state


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(5, 4), CacheMix(), nn.Linear(4, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.mix(h, BatchState(torch.zeros_like(h))))


def test_a_replay_that_fails_is_refused_with_the_layer_named():
    """A layer the generic rule replays with an argument holding the whole batch's state (a
    cache object): the replay on one example fails, and the refusal names the layer and the
    likely cause instead of torch's error alone."""
    x, y = torch.randn(6, 5), torch.arange(6) % 3
    sampler = GradSampler(Stateful())
    sampler.assume_layouts = True
    with pytest.raises(ReplayInstead, match="'mix'"):
        sampler.compute(x, y, per_sample_cross_entropy)
    with pytest.raises(PrivgradError, match=r"'mix'.*replay failed \(RuntimeError.*use_cache"):
        sampler.compute(x, y, per_sample_cross_entropy)


class FlattensTokens(nn.Module):
    """Flattens (B, T, d) to (B·T, d) before a linear layer (as OPT's decoder layers do) or
    another ``layer`` (a Conv1d or a GroupNorm, which are not row-wise)."""

    def __init__(self, layer=None):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)
        self.fc = nn.Linear(4, 4) if layer is None else layer

    def forward(self, ids):
        h = self.emb(ids)
        flat = h.reshape(-1, 4)
        if isinstance(self.fc, nn.Conv1d):
            flat = flat[:, :, None]
        return self.head(self.fc(flat).reshape(h.shape).mean(1))


def test_a_layer_on_flattened_tokens_is_refused_with_the_cause():
    """A bare sampler refuses them; a row-wise layer's rows are read example-major only once
    make_private's check allowed it (test_attribution.py), a Conv1d's or a GroupNorm's
    never."""
    x, y = torch.randint(0, 10, (3, 5)), torch.tensor([0, 1, 0])
    with pytest.raises(PrivgradError, match=r"'fc'.*\(15, 4\).*15 rows are 5 per example.*r // 5"):
        GradSampler(FlattensTokens()).compute(x, y, per_sample_cross_entropy)
    for layer in (nn.Conv1d(4, 4, 1), nn.GroupNorm(2, 4)):
        sampler = GradSampler(FlattensTokens(layer))
        sampler.assume_layouts = True
        with pytest.raises(PrivgradError, match=r"'fc'.*15 rows are 5 per example.*no row.s"):
            sampler.compute(x, y, per_sample_cross_entropy)


def test_inplace_activation_after_layer_gives_exact_gradients():
    """An activation that overwrites a layer's output in place: the tap hands the rule the
    gradient with respect to the layer's own output, as a per-sample loop computes it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    psg, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
    expected = loop_grads(model, x, y, per_sample_cross_entropy)
    got = [g for layer in psg.layers for g in layer.per_sample()]
    for i in range(len(x)):
        for g, want in zip(got, expected[i]):
            torch.testing.assert_close(g[i], want)


class OverwritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(x)
        out = self.lin(h)
        h.mul_(2)  # the input the layer's rule would use is no longer the one it saw
        return out + h[:, :2]


def test_input_modified_after_layer_is_refused():
    with pytest.raises(
        PrivgradError, match=r"input of layer 'lin' \(Linear\) was modified in place"
    ):
        GradSampler(OverwritesInput()).compute(
            torch.randn(4, 3), torch.zeros(4, dtype=torch.long), per_sample_cross_entropy
        )


class UnusedOutputs(nn.Module):
    """A layer whose output never reaches the loss, and a layer with one unused call."""

    def __init__(self):
        super().__init__()
        self.unused, self.twice, self.head = nn.Linear(3, 2), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        self.unused(x)
        self.twice(-x)
        return self.head(torch.tanh(self.twice(x)))


def test_unused_outputs_give_zero_gradients():
    torch.manual_seed(0)
    model, x, y = UnusedOutputs(), torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    psg, _ = GradSampler(model, settle=True).compute(x, y, per_sample_cross_entropy)
    unused, twice, head = psg.layers
    assert all(torch.equal(g, torch.zeros_like(g)) for g in unused.per_sample())
    for i in range(len(x)):
        model.zero_grad()
        per_sample_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for g, p in zip(
            twice.per_sample() + head.per_sample(),
            [*model.twice.parameters(), *model.head.parameters()],
        ):
            torch.testing.assert_close(g[i], p.grad)


def test_small_conv_layers_settle_to_built_gradients():
    """A conv layer whose built (B × P) gradients are kept drops its stored input and output
    gradient during the backward pass (autograd frees them as it goes), a ghost layer keeps
    them for the book-keeping sum."""
    from privgrad.per_sample import rules

    model = cnn()
    psg, _ = GradSampler(model, settle=True).compute(
        torch.randn(8, 1, 28, 28), torch.zeros(8, dtype=torch.long), per_sample_cross_entropy
    )
    conv1, conv2 = [layer for layer in psg.layers if isinstance(layer, rules.ConvGrads)]
    assert conv1.inputs is None and conv1.grads is None and conv1._per_sample is not None
    assert conv2.use_ghost and conv2.inputs is not None and conv2._per_sample is None


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes while the mode is on."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("form", ["patches", "grouped", "correlation"])
def test_kept_conv_gradients_are_built_in_chunks(form):
    """A conv layer that keeps its built (B × P) gradients builds them over chunks of samples
    within the flags' budget, as its norms do: the patches of a whole batch (T/C_out times
    the gradients: 150 MB a layer at B = 256 on WRN-16-4's 32 × 32 convs) are never made,
    and the kept gradients equal a whole-batch build."""
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(8, 3, 10, 10)
    one = EngineFlags(conv_build=form, chunk_floats=1, cuda_chunk_floats=1)
    whole = EngineFlags(conv_build=form, chunk_floats=1 << 30, cuda_chunk_floats=1 << 30)
    built = {}
    for name, flags in (("chunked", one), ("whole", whole)):
        psg, _ = GradSampler(conv, flags=flags).compute(x, torch.zeros(8, 4, 10, 10), _sum_loss)
        (layer,) = psg.layers
        assert layer.keep_built
        with _LargestTensor() as largest:
            built[name] = layer.per_sample()[0]
        built[name + " largest"] = largest.most
    torch.testing.assert_close(built["chunked"], built["whole"])
    # the whole build makes the batch's patches (8 × 100 × 27); a chunk one sample's at most,
    # besides the kept (8 × 108) result
    assert built["whole largest"] >= (8 * 100 * 27 if form == "patches" else 8 * 108)
    assert built["chunked largest"] <= max(8 * 108, 100 * 27 + 2 * 108) + 12 * 12 * 3


def _sum_loss(out, target):
    return (out * target).flatten(1).sum(1)


@pytest.mark.parametrize(
    "kernel, stride, padding, sides",
    [
        (4, 2, 0, [(12, 12)]),  # the CNN's second conv
        (3, 1, 1, [(8, 8)]),  # model3's 8×8 convs
        ((6, 3), (3, 1), (2, 1), [(11, 9)]),  # rectangular, padded, stride 3
        ((4, 2), (2, 2), 1, [(9, 7), (6, 5)]),  # two calls of different sizes
    ],
)
def test_cell_gram_gives_the_patch_grams_norms(kernel, stride, padding, sides):
    """The Gram form from stride-sized cells (summed along the kernel's lags) gives the
    per-sample norms of the Gram from patches, to float tolerance, call pairs included."""
    from privgrad.per_sample import rules

    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(3, 5, kernel, stride=stride, padding=padding, bias=False)
    xs = [torch.randn(4, 3, h, w, generator=gen) for h, w in sides]
    gs = [torch.randn(conv(x).shape, generator=gen) for x in xs]
    layer = rules.ConvGrads(conv, xs, gs)
    assert layer.cell_grids is not None
    by_cells, _ = layer._cell_gram_norms_sq(slice(None))
    a = torch.cat([layer._patches(x) for x in xs], 1)
    g = torch.cat([g.flatten(2) for g in gs], 2)
    by_patches = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g.transpose(1, 2), g)).sum((1, 2))
    torch.testing.assert_close(by_cells, by_patches, rtol=1e-4, atol=0)
    built = sum(layer._build(x, g) for x, g in zip(xs, gs)).flatten(1).pow(2).sum(1)
    torch.testing.assert_close(by_cells, built, rtol=1e-4, atol=0)


@pytest.mark.parametrize("blocks_from", [64, 2, None])
@pytest.mark.parametrize("T", [5, 63, 64, 65, 128])
def test_ghost_norm_from_symmetric_blocks_equals_the_built_norm(T, blocks_from):
    """From T = ``blocks_from`` on (64 by default) the ghost norm uses three blocks of the
    Grams' 2 × 2 split (the fourth is the transpose of one); it must equal ‖Σ_t g_t a_tᵀ‖²,
    odd T included, as the full Grams (None) do."""
    from privgrad.per_sample import rules

    gen = torch.Generator().manual_seed(T)
    a, g = torch.randn(3, T, 7, generator=gen), torch.randn(3, T, 4, generator=gen)
    built = torch.bmm(g.transpose(1, 2), a).flatten(1).pow(2).sum(1)
    torch.testing.assert_close(rules.gram_dot(a, g, blocks_from), built, rtol=1e-4, atol=0)


def test_gram_form_takes_cells_where_they_cost_less():
    """Cells for the CNN's second conv and an 8×8 3×3 conv; patches where the output is one
    position (cells would cost 25× more) and where the kernel is not whole cells."""
    from privgrad.per_sample import rules

    def layer(ci, co, k, s, p, side):
        conv = nn.Conv2d(ci, co, k, stride=s, padding=p)
        x = torch.zeros(1, ci, side, side)
        return rules.ConvGrads(conv, [x], [conv(x)])

    assert layer(16, 32, 4, 2, 0, 12).gram_by_cells
    assert layer(64, 128, 3, 1, 1, 8).gram_by_cells
    assert not layer(16, 128, 5, 1, 0, 5).gram_by_cells  # LeNet-5-BC's third conv
    assert layer(2, 3, 3, 2, 1, 8).cell_grids is None and not layer(2, 3, 3, 2, 1, 8).gram_by_cells


def test_frozen_parameters_are_skipped():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    psg, _ = GradSampler(model).compute(
        torch.randn(4, 3), torch.zeros(4, dtype=torch.long), per_sample_cross_entropy
    )
    assert [id(p) for p in psg.params] == [id(p) for p in model.parameters() if p.requires_grad]


def test_cnn_runs_channels_last_and_computes_what_a_contiguous_copy_does():
    """The CNN's conv weights are channels-last (its max-pool is ~10× faster so on CPU); the
    layout must not change its outputs or gradients."""
    import copy

    torch.manual_seed(0)
    model = cnn()
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    assert model[0](x).is_contiguous(memory_format=torch.channels_last)
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.data = p.data.clone(memory_format=torch.contiguous_format)
    assert not plain[0](x).is_contiguous(memory_format=torch.channels_last)
    outs = []
    for m in (model, plain):
        out = m(x)
        nn.functional.cross_entropy(out, y).backward()
        outs.append((out.detach(), [p.grad for p in m.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_private_chain_and_settling_run_without_tf32_and_restore_the_settings(monkeypatch):
    """On CUDA, cuDNN's TF32 default (and ``set_float32_matmul_precision("high")``) would round
    a clipped sum ~1e-3 apart from the norms that clipped it. Per-sample builds during the
    backward pass (settling), the norms and the book-kept sums run with TF32 off; the
    user's settings are back afterwards."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.allow_tf32, matmul.allow_tf32  # (monkeypatch cannot restore torch's flag modules)
    try:
        cudnn.allow_tf32 = matmul.allow_tf32 = True
        _check_tf32_off_in_private_arithmetic(monkeypatch, cudnn, matmul)
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


def _check_tf32_off_in_private_arithmetic(monkeypatch, cudnn, matmul):
    """Builds (grouped: conv2d_weight with groups = samples), norms (vector_norm) and the
    book-kept sums (conv2d_weight, one group) recorded with the TF32 settings they ran under."""
    from privgrad.mechanisms import build_mechanism

    seen = []
    conv2d_weight, vector_norm = torch.nn.grad.conv2d_weight, torch.linalg.vector_norm

    def recording(fn, what):
        def run(*args, **kwargs):
            seen.append((what, cudnn.allow_tf32, matmul.allow_tf32))
            return fn(*args, **kwargs)

        return run

    def weight_grad(*args, groups=1, **kwargs):
        seen.append(("build" if groups > 1 else "sum", cudnn.allow_tf32, matmul.allow_tf32))
        return conv2d_weight(*args, groups=groups, **kwargs)

    monkeypatch.setattr(torch.nn.grad, "conv2d_weight", weight_grad)
    monkeypatch.setattr(torch.linalg, "vector_norm", recording(vector_norm, "norm"))
    model = cnn()
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    sampler = GradSampler(model, settle=True, flags=EngineFlags(conv_build="grouped"))
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    build_mechanism("dpsgd", 1.0, 1.0).privatize(psg, 6.0, torch.Generator().manual_seed(0))
    assert {what for what, _, _ in seen} == {"build", "norm", "sum"}
    assert all(not c and not m for _, c, m in seen), seen
    assert cudnn.allow_tf32 and matmul.allow_tf32


def test_lag_sum_view_equals_the_sum_of_lagged_slices():
    """The cell Gram's lag sum: CUDA's one reduction over a strided view equals the CPU's sum
    of slices and a direct sum, on a block that starts inside a larger Gram (a storage
    offset); off CUDA the rule adds the slices."""
    from privgrad.per_sample import rules

    gram = torch.randn(9 * 8, 7 * 6, 5, dtype=torch.float64)
    block = (
        gram[8 : 8 + 6 * 7, 7 : 7 + 5 * 6].unflatten(1, (5, 6)).unflatten(0, (6, 7))
    )  # (6, 7, 5, 6, b)
    out, lags = (5, 5, 3, 4), (2, 3)  # 2 × 3 lags: rows 5 + 2 − 1 = 6, cols 5 + 3 − 1 = 7, ...
    want = sum(
        block[u : u + 5, v : v + 5, u : u + 3, v : v + 4] for u in range(2) for v in range(3)
    )
    torch.testing.assert_close(rules.lag_sum_by_view(block, out, lags), want)
    torch.testing.assert_close(rules.lag_sum_by_slices(block, out, lags), want)
    for form in ("auto", "view", "slices"):
        torch.testing.assert_close(rules.lag_sum(block, out, lags, form), want)


def test_engine_flags_are_frozen_and_refuse_unknown_forms_and_bad_sizes():
    import dataclasses

    from privgrad.per_sample import DEFAULT_FLAGS

    assert EngineFlags() == DEFAULT_FLAGS and hash(DEFAULT_FLAGS) == hash(EngineFlags())
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_FLAGS.chunk_floats = 1
    with pytest.raises(PrivgradError, match="conv_build must be one of"):
        EngineFlags(conv_build="unfold")
    with pytest.raises(PrivgradError, match="chunk_floats must be an integer"):
        EngineFlags(chunk_floats=0)
    with pytest.raises(PrivgradError, match="float32_guard must be True or False"):
        EngineFlags(float32_guard=1)
    with pytest.raises(PrivgradError, match="flags must be an EngineFlags"):
        GradSampler(nn.Linear(2, 2), flags={"chunk_floats": 1})


def _built_norms_sq(a, g):
    return torch.bmm(g.transpose(1, 2).double(), a.double()).flatten(1).pow(2).sum(1)


@pytest.mark.parametrize(
    "B, T, d_in, d_out",
    [(5, 7, 33, 20), (3, 1, 130, 5), (2, 70, 1, 129), (4, 33, 64, 64), (0, 4, 8, 8)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_norms_equal_built_norms(B, T, d_in, d_out, dtype, device):
    """The fused kernel's ‖g_iᵀ a_i‖² against the built gradients (float64), over tile
    edges (d > 64, T > 32, d = 1), a strided input and an empty batch; 16-bit inputs to
    their own rounding."""
    skip_unless_fused_runs(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(T, B, d_in, generator=gen).transpose(0, 1).to(device, dtype)  # strided
    g = torch.randn(B, T, d_out, generator=gen).to(device, dtype)
    got = fused.linear_norms_sq(a, g)
    assert got.dtype == torch.float32 and got.shape == (B,)
    expected = _built_norms_sq(a.float(), g.float()).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


CONVS = {
    "3x2 stride 2x1, dilation 1x2": (dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2),
                                          dilation=(1, 2)), 3, 5, (9, 8)),
    "3x3 same, tiles in K and C_out": (dict(kernel_size=3, padding=1), 40, 70, (12, 12)),
    "1x1": (dict(kernel_size=1), 8, 16, (5, 7)),
    "4x4 stride 2, no padding": (dict(kernel_size=4, stride=2), 2, 3, (10, 10)),
}  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("name", CONVS)
def test_fused_conv_norms_equal_built_norms(name, layout, device):
    """The fused conv kernel (patch entries gathered from x, padding masked) against the
    single-sample weight gradients, for strides, padding, dilation, a non-square kernel,
    tiles in both weight dimensions and channels-last inputs."""
    skip_unless_fused_runs(device)
    kwargs, c_in, c_out, hw = CONVS[name]
    torch.manual_seed(0)
    conv = nn.Conv2d(c_in, c_out, **kwargs).to(device)
    x = torch.randn(3, c_in, *hw, device=device)
    if layout == "channels-last":
        x = x.to(memory_format=torch.channels_last)
    g = torch.randn_like(conv(x))
    m = conv
    expected = torch.stack(
        [
            torch.nn.grad.conv2d_weight(
                x[i : i + 1].double(), m.weight.shape, g[i : i + 1].double(),
                m.stride, m.padding, m.dilation,
            )
            for i in range(len(x))
        ]
    ).flatten(1).pow(2).sum(1)  # fmt: skip
    got = fused.conv2d_norms_sq(x, g, m.kernel_size, m.stride, m.padding, m.dilation)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_fused_tf32x3_products_keep_float32_accuracy(layer, device):
    """``EngineFlags(fused_dot="tf32x3")``: three TF32 tensor-core products per product on
    CUDA (float32 multiply-adds in the interpreter) give the built norms to float32's
    tolerance, where one TF32 product is ~1e-3 off; the flags pick the dot (TF32 only
    without the guard) and an unknown dot is refused."""
    skip_unless_fused_runs(device)
    torch.manual_seed(0)
    if layer == "linear":
        a, g = torch.randn(4, 33, 64, device=device), torch.randn(4, 33, 64, device=device)
        got = fused.linear_norms_sq(a, g, "tf32x3")
        expected = _built_norms_sq(a, g)
    else:
        conv = nn.Conv2d(40, 70, 3, padding=1).to(device)
        x = torch.randn(3, 40, 12, 12, device=device)
        g = torch.randn(3, 70, 12, 12, device=device)
        got = fused.conv2d_norms_sq(x, g, (3, 3), (1, 1), (1, 1), (1, 1), "tf32x3")
        expected = torch.stack(
            [
                torch.nn.grad.conv2d_weight(
                    x[i : i + 1].double(), conv.weight.shape, g[i : i + 1].double(), 1, 1, 1
                )
                for i in range(3)
            ]
        ).flatten(1).pow(2).sum(1)  # fmt: skip
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert fused_dot(EngineFlags(fused_dot="tf32x3")) == "tf32x3"
    assert fused_dot(EngineFlags(fused_dot="tf32x3", float32_guard=False)) == "tf32"
    with pytest.raises(PrivgradError, match="dot is one of"):
        fused.linear_norms_sq(
            torch.ones(2, 3, 4, device=device), torch.ones(2, 3, 5, device=device), "fp16"
        )


def test_fused_form_off_cuda_without_the_interpreter_is_refused(monkeypatch):
    """On CPU tensors without Triton's interpreter the fused form names the fix instead of
    failing inside Triton."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(PrivgradError, match="norm_form='auto'"):
        fused.linear_norms_sq(torch.ones(2, 3, 4), torch.ones(2, 3, 5))


def test_auto_takes_the_fused_kernel_on_cuda_only_in_the_measured_band():
    """norm_form="auto" takes a linear layer's norms by the fused kernel on CUDA where the
    Gram form would run and the kernel's multiply-adds are at most 4× the Gram form's (the
    transformer's layers, measured faster on an H100), nowhere else: not off CUDA, not where
    building is cheaper (long sequences), not where the positions are few for the weight."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused.runs_on(cuda)  # Triton is a test requirement (pyproject.toml)
    assert auto_takes_fused(128, 256, 1024, cuda)  # the transformer's feed-forward
    assert auto_takes_fused(128, 256, 256, cuda)  # and its projections
    assert not auto_takes_fused(128, 256, 1024, cpu)
    assert not auto_takes_fused(1024, 256, 256, cuda)  # T² > d_in·d_out: built by cuBLAS
    assert not auto_takes_fused(25, 4096, 512, cuda)  # 4T(d_in+d_out) < d_in·d_out: Gram
    assert not auto_takes_fused(1, 256, 256, cuda)  # one position: the outer-product form


def test_auto_linear_rule_off_cuda_never_calls_the_fused_kernel(monkeypatch):
    """On CPU "auto" keeps the Gram and built forms (the kernel runs there only in Triton's
    interpreter): the linear rule's norms never reach it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernel was called under norm_form='auto' on CPU")

    monkeypatch.setattr(fused, "linear_norms_sq", refuse)
    layer = nn.Linear(256, 256)
    a, g = torch.randn(4, 128, 256), torch.randn(4, 128, 256)
    rule = LinearGrads(layer, a, g, layer.weight.shape, EngineFlags())
    assert not rule.use_fused
    built = torch.bmm(g.transpose(1, 2), a).flatten(1).square().sum(1) + g.sum(1).square().sum(1)
    torch.testing.assert_close(rule.norms_sq(), built, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "flags, dot",
    [
        (EngineFlags(norm_form="fused"), "ieee"),
        (EngineFlags(norm_form="fused", fused_dot="tf32x3"), "tf32x3"),
        (EngineFlags(norm_form="fused", fused_dot="tf32x3", float32_guard=False), "tf32"),
    ],
)
def test_rules_pass_the_flags_dot_to_the_fused_kernels(flags, dot, monkeypatch):
    """The linear and conv rules hand the kernels the products the flags ask for: float32
    multiply-adds by default, tensor-core products with ``fused_dot``, TF32 only without the
    guard."""
    seen = []

    def record(real, where):
        def kernel(*args, **kwargs):
            seen.append(args[where])
            return real(*args, **kwargs)

        return kernel

    monkeypatch.setattr(fused, "linear_norms_sq", record(fused.linear_norms_sq, 2))
    monkeypatch.setattr(fused, "conv2d_norms_sq", record(fused.conv2d_norms_sq, 6))
    # a conv, then a linear layer over its 2 channels as positions (T = 2: the kernel's case)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(2), nn.Linear(16, 3), nn.Flatten())
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 6, (4,))
    psg, _ = GradSampler(model, flags=flags).compute(x, y, per_sample_cross_entropy)
    psg.norms_sq()
    assert seen == [dot, dot]


# --------------------------------------------------------------- three TF32 products (gemm_dot)


def _tensor_core(t: torch.Tensor) -> torch.Tensor:
    """What a TF32 tensor core reads of a float32: its 13 low mantissa bits dropped."""
    return (t.view(torch.int32) & -(1 << 13)).view(torch.float32)


def _tensor_core_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A TF32 matmul as a tensor core forms it (inputs read as TF32, products summed exactly)."""
    return _tensor_core(a).double() @ _tensor_core(b).double()


def test_tf32_split_is_exact_and_on_the_tf32_grid():
    """x = hi + lo bit for bit, hi on TF32's grid, |lo| < 2⁻¹⁰|x| (subnormals: 2⁻¹³⁶);
    strided inputs too."""
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(0)).T  # a strided view
    x[0, :3] = torch.tensor([0.0, -1e-40, 3e38])  # zero, a subnormal, near the largest float
    hi, lo = tf32_split(x)
    assert torch.equal(hi + lo, x)
    assert torch.equal(_tensor_core(hi), hi)
    assert (lo.abs() <= 2**-10 * x.abs() + 2**-136).all()  # subnormals: absolute
    assert (lo != 0).float().mean() > 0.99  # the split is not trivially hi = x


def test_three_tf32_products_keep_float32_accuracy():
    """``products(op, x, y, "tf32x3")`` with a tensor core's TF32 reads stays within
    3·2⁻²⁰ of Σ|x||y| of the exact product, where one TF32 product, or two of the three, do
    not (the bound catches a dropped term); on CPU "ieee" and "tf32x3" are both within a
    float32 dot's K·2⁻²⁴ bound; other dtypes take one product."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 300, generator=gen), torch.randn(300, 50, generator=gen)
    exact = x.double() @ y.double()
    bound = 3 * 2**-20 * (x.double().abs() @ y.double().abs())
    three = products(_tensor_core_mm, x, y, "tf32x3")
    assert ((three - exact).abs() <= bound).all()
    assert ((_tensor_core_mm(x, y) - exact).abs() > bound).any()  # one TF32 product
    (x_hi, _), (y_hi, y_lo) = tf32_split(x), tf32_split(y)
    two = _tensor_core_mm(x_hi, y_hi) + _tensor_core_mm(x_hi, y_lo)
    assert ((two - exact).abs() > bound).any()  # x_lo · y_hi dropped
    float32_bound = 300 * 2**-24 * (x.double().abs() @ y.double().abs())  # K·u: a float32 dot
    for dot in ("ieee", "tf32x3"):
        assert ((products(torch.mm, x, y, dot) - exact).abs() <= float32_bound).all()
    assert torch.equal(products(torch.mm, x.double(), y.double(), "tf32x3"), exact)  # one call


@pytest.mark.parametrize(
    "form", ["ghost-cells", "ghost-patches", "build-grouped", "build-correlation", "build-patches"]
)
@pytest.mark.parametrize("name", FAST_CASES)
def test_tf32x3_forms_equal_float32_forms(name, form, device):
    """``EngineFlags(gemm_dot="tf32x3")``: every linear and conv form's norms, built
    per-sample gradients and book-kept sum equal the float32 products' ("ieee") to float32's
    tolerance: on CUDA through three TF32 tensor-core products each (one TF32 product is
    ~1e-3 off), elsewhere through the same three products in float32."""
    forms = dict(
        norm_form=form.split("-")[0],
        conv_gram="cells" if form == "ghost-cells" else "patches",
        conv_build=form.removeprefix("build-") if form.startswith("build-") else "auto",
        chunk_floats=1,
        cuda_chunk_floats=1,
        keep_built=False,
    )
    make, make_x, classes = FAST_CASES[name]
    torch.manual_seed(0)
    model = make().to(device)
    x, y = make_x().to(device), torch.randint(0, classes, (6,), device=device)
    model(x)
    w = torch.rand(len(x), device=device)
    results = []
    for dot in ("ieee", "tf32x3"):
        sampler = GradSampler(model, flags=EngineFlags(gemm_dot=dot, **forms))
        psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
        built, _ = sampler.compute(x, y, per_sample_cross_entropy)
        results.append(
            (
                psg.norms_sq(),
                psg.weighted_sum(w),
                [g for lay in built.layers for g in lay.per_sample()],
            )
        )
    (norms, sums, grads), (norms_x3, sums_x3, grads_x3) = results
    torch.testing.assert_close(norms_x3, norms, rtol=1e-5, atol=1e-7)  # sums of squares
    for got, want in zip([*sums_x3, *grads_x3], [*sums, *grads]):  # cancelling sums
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class _UnroutedProducts(TorchDispatchMode):
    """The matrix products (M, N > 1) and convolutions that run outside :func:`products`."""

    def __init__(self):
        super().__init__()
        self.inside, self.outside = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and (
            name in ("convolution", "convolution_backward")
            or (name in ("mm", "bmm") and min(args[0].shape[-2], args[1].shape[-1]) > 1)
        ):
            self.outside.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "flags, dot",
    [
        (EngineFlags(), "ieee"),
        (EngineFlags(gemm_dot="tf32x3"), "tf32x3"),
        (EngineFlags(gemm_dot="tf32x3", float32_guard=False), "tf32"),
    ],
)
@pytest.mark.parametrize(
    "form", ["ghost-cells", "ghost-patches", "build-grouped", "build-correlation", "build-patches"]
)
def test_rules_pass_the_flags_dot_to_every_product(flags, dot, form, monkeypatch):
    """The conv and linear rules take every Gram, build and book-kept sum, in every form,
    through :func:`products` with the dot the flags ask for (float32 by default, three TF32
    products with ``gemm_dot``, TF32 where PyTorch allows it without the guard): no matrix
    product or convolution of the norms, sums or built gradients runs outside it (only the
    weighted sums' matrix-vector products and the biases' sums do)."""
    seen, mode = [], _UnroutedProducts()

    def record(op, x, y, d="ieee"):
        seen.append(d)
        mode.inside = True
        try:
            return products(op, x, y, d)
        finally:
            mode.inside = False

    monkeypatch.setattr(rules, "products", record)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),  # 6 × 6 → 4 × 4, a whole number of cells
        nn.Conv2d(4, 5, 2, stride=2),  # more input channels: another build
        nn.Flatten(2),
        nn.Linear(4, 6),  # on 5 positions
        nn.Flatten(),
        nn.Linear(30, 3),
    )
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    flags = dataclasses.replace(
        flags,
        norm_form=form.split("-")[0],
        conv_gram="cells" if form == "ghost-cells" else "patches",
        conv_build=form.removeprefix("build-") if form.startswith("build-") else "auto",
        keep_built=False,
    )
    sampler = GradSampler(model, flags=flags)
    psg, _ = sampler.compute(x, y, per_sample_cross_entropy)
    built, _ = sampler.compute(x, y, per_sample_cross_entropy)
    with mode:
        psg.norms_sq()
        psg.weighted_sum(torch.rand(4))
        [layer.per_sample() for layer in built.layers]
    assert mode.outside == []
    assert len(seen) >= 8 and set(seen) == {dot}
    assert gemm_dot(flags) == dot


class Checkpointed(nn.Module):
    """A conv block and a generic-rule layer run under activation checkpointing (the
    non-reentrant torch.utils.checkpoint): their forward runs again in the backward."""

    def __init__(self, checkpointed: bool, calls: list):
        super().__init__()
        self.checkpointed = checkpointed
        self.conv, self.scale = nn.Conv2d(1, 4, 3), Scale(4 * 6 * 6)
        self.head = nn.Linear(4 * 6 * 6, 3)
        self.conv.register_forward_hook(lambda *_: calls.append(1))

    def block(self, x):
        return self.scale(torch.relu(self.conv(x)).flatten(1))

    def forward(self, x):
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            h = self.block(x)
        return self.head(h)


def assert_checkpointing_keeps_the_gradients(make_model, x, y):
    """``make_model(checkpointed, calls)``, built under one seed, appends to ``calls`` when its
    checkpointed layer runs: with checkpointing that layer runs again (the recomputation), and
    the per-sample norms and clipped sums are those without it."""
    w, results = torch.rand(len(y)), []
    for checkpointed in (False, True):
        calls = []
        torch.manual_seed(0)
        model = make_model(checkpointed, calls)
        grads, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
        results.append((grads.norms_sq(), grads.weighted_sum(w)))
        assert len(calls) == 1 + checkpointed  # the recomputation ran
    (norms, sums), (norms_ckpt, sums_ckpt) = results
    torch.testing.assert_close(norms_ckpt, norms)
    for a, b in zip(sums_ckpt, sums):
        torch.testing.assert_close(a, b)


def test_activation_checkpointing_gives_the_same_per_sample_gradients():
    """The taps belong to the first forward's graph, whose saved tensors the recomputation
    refills; the recomputed calls are not recorded (the engine records only during the
    forward): norms and clipped sums are those without checkpointing."""
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 3, (6,))
    assert_checkpointing_keeps_the_gradients(Checkpointed, x, y)


class ReZero(nn.Module):
    """A residual scaled by a 0-dim parameter (ReZero's α, a learned temperature)."""

    def __init__(self):
        super().__init__()
        self.f, self.alpha = nn.Linear(5, 5), nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        return x + self.alpha * torch.tanh(self.f(x))


def test_a_zero_dim_parameter_has_per_sample_gradients_of_shape_b():
    """Its per-sample gradient is (B,): the norms took .flatten(1) of it, an IndexError."""
    torch.manual_seed(0)
    model = nn.Sequential(ReZero(), nn.Linear(5, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    psg, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
    expected = loop_grads(model, x, y, per_sample_cross_entropy)
    per_sample = [g for layer in psg.layers for g in layer.per_sample()]
    for i in range(len(x)):
        for got, want in zip(per_sample, expected[i]):
            torch.testing.assert_close(got[i], want, atol=2e-6, rtol=1e-5)
    want_norms = torch.stack([sum(g.pow(2).sum() for g in e) for e in expected])
    torch.testing.assert_close(psg.norms_sq(), want_norms, rtol=1e-5, atol=1e-7)
