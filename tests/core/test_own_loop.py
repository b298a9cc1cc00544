"""privgrad.attach: the user's own loop (forward, loss.backward(), optimizer.step()) runs the
trainer's private step: same parameters and identical ε as make_private's trainer for one
seed, every mechanism, mean and sum reductions; each misuse is an error (issue 39, item 1)."""

import copy
import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import privgrad
from privgrad import PrivgradError
from privgrad.mechanisms import MECHANISMS

N, D, K = 64, 10, 3


def data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


def net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, K))


def options(mechanism="dpsgd", **kw):
    privacy = {"noise_multiplier": 0.0} if mechanism == "non-private" else {"target_epsilon": 2.0}
    return {"mechanism": mechanism, "epochs": 2, "batch_size": 16, "seed": 3, **privacy, **kw}


def run_trainer(train, build=net, **kw):
    model = build()
    trainer = privgrad.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), train, **kw)
    for _ in range(kw["epochs"]):
        for batch in trainer.batches():
            trainer.step(batch)
    return model, trainer


def run_own_loop(train, reduction="mean", loss_reduction=None, **kw):
    model, optimizer, loader = _attach(train, loss_reduction, **kw)
    for _ in range(kw["epochs"]):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction=reduction)
            loss.backward()
            optimizer.step()
    return model, optimizer


def _attach(train, loss_reduction=None, build=net, **kw):
    model = build()
    return privgrad.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train,
        loss_reduction=loss_reduction,
        **kw,
    )


def assert_same(a, b, tol=1e-5):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol)


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_same_parameters_and_identical_epsilon_as_the_trainer(mechanism):
    train = data()
    ref, trainer = run_trainer(train, **options(mechanism))
    own, optimizer = run_own_loop(train, "mean", **options(mechanism))
    assert optimizer.steps == trainer.steps == 8
    assert_same(ref, own)
    assert optimizer.epsilon() == trainer.epsilon()  # identical, not close
    assert optimizer.epsilon_claimed() == trainer.epsilon_claimed()
    assert optimizer.trainer.ledger.entries == trainer.ledger.entries
    if mechanism != "non-private":
        assert math.isfinite(optimizer.epsilon()) and optimizer.epsilon() <= 2.0 + 1e-6


def test_attach_takes_each_make_private_option_by_name():
    """attach's keywords are make_private's (and loss_reduction), spelled out so that an
    editor lists them, with the same defaults: one make_private gains cannot be left out."""
    own = inspect.signature(privgrad.attach).parameters
    trainer = inspect.signature(privgrad.make_private).parameters
    assert set(own) - {"data", "loss_reduction"} == set(trainer) - {"dataset"}
    for name, parameter in trainer.items():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            assert own[name].default == parameter.default, name


@pytest.mark.parametrize(
    "mechanism,reduction,declared",
    [
        (m, r, d)
        for m in ("dpsgd", "dp-signsgd")
        for r, d in (("sum", None), ("sum", "sum"), ("mean", "mean"))
    ]
    + [("gip", "sum", None)],
)  # gip with mean: test_same_parameters_and_identical_epsilon_as_the_trainer
def test_mean_and_sum_reductions(mechanism, reduction, declared):
    train = data()
    ref, trainer = run_trainer(train, **options(mechanism))
    own, optimizer = run_own_loop(train, reduction, declared, **options(mechanism))
    assert_same(ref, own)
    assert optimizer.epsilon() == trainer.epsilon()
    record = optimizer.privacy_record()
    assert (
        record["epsilon"] == trainer.epsilon()
        and record["steps"] == 8
        and record["mechanism"] == mechanism
    )


def test_a_non_finite_example_is_dropped_as_the_trainer_drops_it():
    x, y = data()
    x[5, 0] = float("nan")
    ref, trainer = run_trainer((x, y), **options(epochs=1, batch_size=32))
    own, optimizer = run_own_loop((x, y), "mean", **options(epochs=1, batch_size=32))
    assert trainer.nonfinite_examples > 0
    assert optimizer.trainer.nonfinite_examples == trainer.nonfinite_examples
    assert_same(ref, own)
    assert optimizer.epsilon() == trainer.epsilon()


class PairDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


@pytest.mark.parametrize("kind", ["dataset", "tensordataset", "dataloader"])
def test_a_dataset_and_a_dataloader_both_work(kind):
    x, y = data()
    ref, trainer = run_trainer((x, y), **options())
    kw = options()
    if kind == "dataset":
        train = PairDataset(x, y)
    elif kind == "tensordataset":
        train = TensorDataset(x, y)
    else:
        train = DataLoader(PairDataset(x, y), batch_size=kw.pop("batch_size"), shuffle=True)
    if kind == "dataloader":
        with pytest.warns(UserWarning, match="Poisson"):
            own, optimizer = run_own_loop(train, **kw)
    else:
        own, optimizer = run_own_loop(train, **kw)
    assert_same(ref, own)
    assert optimizer.epsilon() == trainer.epsilon()


def test_the_loader_is_one_epoch_of_poisson_batches_per_iter():
    model, optimizer, loader = _attach(data(), **options())
    assert len(loader) == 4
    sizes = []
    for x, y in loader:
        assert isinstance(x, torch.Tensor) and x.shape[1:] == (D,) and len(x) == len(y)
        sizes.append(len(x))
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert len(sizes) == 4 and optimizer.steps == 4 and len(set(sizes)) > 1  # sizes vary


def test_evaluation_under_no_grad_and_a_scheduler_are_allowed():
    model, optimizer, loader = _attach(data(), **options())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    val_x, _ = data(8, seed=9)
    for x, y in loader:
        with torch.no_grad():
            model(val_x)  # evaluation mid-step: not recorded
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            model(val_x)
        optimizer.step()
        scheduler.step()
    assert optimizer.steps == 4
    assert optimizer.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 16)


# --- misuse -------------------------------------------------------------------------------------


def first_batch(**kw):
    model, optimizer, loader = _attach(data(), **options(**kw))
    it = iter(loader)
    x, y = next(it)
    while len(x) == 0:  # a forward on an empty draw proves little here
        F.cross_entropy(model(x), y, reduction="sum").backward()
        optimizer.step()
        x, y = next(it)
    return model, optimizer, it, x, y


def test_step_without_backward_is_refused():
    model, optimizer, _, x, y = first_batch()
    F.cross_entropy(model(x), y)
    with pytest.raises(PrivgradError, match="without loss.backward"):
        optimizer.step()


def test_step_without_forward_is_refused():
    model, optimizer, _, x, y = first_batch()
    with pytest.raises(PrivgradError, match="without a forward"):
        optimizer.step()


def test_step_before_any_batch_is_refused():
    model, optimizer, loader = _attach(data(), **options())
    x, y = data(16, seed=7)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="without a batch"):
        optimizer.step()
    assert optimizer.steps == 0


def test_two_backwards_before_a_step_are_refused():
    model, optimizer, _, x, y = first_batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(PrivgradError, match="2 backwards|second backward"):
        optimizer.step()
    assert optimizer.steps == 0


def test_two_forwards_on_a_batch_are_refused():
    model, optimizer, _, x, y = first_batch()
    model(x)
    with pytest.raises(PrivgradError, match="second forward"):
        model(x)


def test_the_users_own_tensor_is_refused():
    model, optimizer, _, x, y = first_batch()
    own_x = torch.randn_like(x)  # same shape, not drawn by privgrad
    F.cross_entropy(model(own_x), y).backward()
    with pytest.raises(PrivgradError, match="not the batch"):
        optimizer.step()
    assert optimizer.steps == 0


def test_an_extra_backward_through_a_foreign_forward_is_refused():
    model, optimizer, _, x, y = first_batch()
    F.cross_entropy(model(x), y).backward()
    own_x, own_y = data(len(x), seed=5)
    F.cross_entropy(model(own_x), own_y).backward()
    with pytest.raises(PrivgradError, match="not the batch"):
        optimizer.step()


def test_an_earlier_batch_than_the_last_handed_out_is_refused():
    model, optimizer, it, x1, y1 = first_batch()
    x2, y2 = next(it)  # a later draw: x1 is no longer the batch
    F.cross_entropy(model(x1), y1).backward()
    with pytest.raises(PrivgradError, match="not the batch"):
        optimizer.step()


def test_taking_the_next_batch_without_stepping_is_refused():
    model, optimizer, it, x, y = first_batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="step once per batch") as refused:
        next(it)
    assert "max_physical_batch_size=N" in str(refused.value)  # what gradient accumulation is for


def test_step_twice_per_batch_is_refused():
    model, optimizer, _, x, y = first_batch()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    with pytest.raises(PrivgradError, match="without a batch"):
        optimizer.step()
    assert optimizer.steps == 1


@pytest.mark.parametrize(
    "loss",
    [
        lambda out, y: F.cross_entropy(out, y) + (out.mean(0) ** 2).sum(),  # mixes examples
        lambda out, y: 2 * F.cross_entropy(out, y),  # scaled
        lambda out, y: F.cross_entropy(out, y.roll(1)),  # other labels
        lambda out, y: F.mse_loss(out, F.one_hot(y, K).float()),  # another loss
    ],
)
def test_a_loss_other_than_the_declared_one_is_refused(loss):
    model, optimizer, _, x, y = first_batch()
    loss(model(x), y).backward()
    with pytest.raises(PrivgradError, match="not that of loss_fn"):
        optimizer.step()
    assert optimizer.steps == 0


def test_a_wrongly_declared_reduction_is_refused():
    model, optimizer, _, x, y = first_batch(loss_reduction="mean")
    F.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(PrivgradError, match="reduction 'mean'"):
        optimizer.step()
    with pytest.raises(PrivgradError, match="loss_reduction"):
        _attach(data(), **options(loss_reduction="average"))


class BatchMean(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_model_that_mixes_examples_is_refused_at_attach():
    model = nn.Sequential(nn.Linear(D, 16), BatchMean(), nn.Linear(16, K))
    with pytest.raises(PrivgradError):
        privgrad.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), **options())


class HalfBatch(nn.Module):
    """Uses only half the batch once ``broken`` is set (after the probe)."""

    def __init__(self):
        super().__init__()
        self.lin, self.broken = nn.Linear(D, K), False

    def forward(self, x):
        return self.lin(x[: len(x) // 2] if self.broken else x)


def test_a_captured_batch_other_than_the_drawn_one_is_refused():
    model = HalfBatch()
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data(), **options()
    )
    model.broken = True
    x, y = next(x for x in loader if len(x[0]) > 1)
    with pytest.raises(PrivgradError, match="for a batch of"):
        model(x)


def test_a_step_past_the_calibrated_budget_is_refused():
    model, optimizer, loader = _attach(data(), **options(epochs=1))
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="calibrated for"):
        optimizer.step()


def test_the_readme_own_loop_example_runs(capsys, tmp_path, monkeypatch):
    import json
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "privgrad.attach" in b)
    monkeypatch.chdir(tmp_path)  # it saves the model in the working directory
    exec(compile(code, "README.md", "exec"), {})
    eps = float(re.search(r"ε = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert 0.9 < eps <= 1.0
    record = json.loads((tmp_path / "model.privacy.json").read_text())
    assert round(record["epsilon"], 3) == eps and (tmp_path / "model.pt").is_file()


def test_a_view_of_the_batch_and_a_lightning_closure_are_allowed():
    train = data()
    ref, trainer = run_trainer(train, **options())
    model, optimizer, loader = _attach(train, **options())
    for _ in range(2):
        for x, y in loader:

            def closure():
                optimizer.zero_grad()
                loss = F.cross_entropy(
                    model(x.reshape(len(x), 2, D // 2).flatten(1)), y
                )  # views, rows kept
                loss.backward()
                return loss

            loss = optimizer.step(closure)
            assert isinstance(loss, torch.Tensor)
    assert_same(ref, model)
    assert optimizer.epsilon() == trainer.epsilon()


def test_only_the_drawn_rows_count_as_the_batch():
    from privgrad.own_loop import _same

    x = torch.randn(6, 6)
    assert _same(x, x) and _same(x.view(6, 2, 3), x) and _same(x.t().t(), x) and _same(x.clone(), x)
    assert not _same(x.t(), x)  # rows become columns: examples mixed
    assert not _same(x * 2, x) and not _same(x[:3], x) and not _same(torch.randn(6, 6), x)


class SharedPositionRow(nn.Module):
    """Token and position embeddings, the positions one (1, T) row for the whole batch (as
    Hugging Face's default position ids)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.tok, self.pos, self.fc = nn.Embedding(20, 8), nn.Embedding(4, 8), nn.Linear(8, K)

    def forward(self, ids):
        return self.fc((self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None])).mean(1))


def token_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (n, 4), generator=g), torch.randint(0, K, (n,), generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("build", [net, SharedPositionRow])
def test_empty_batches_are_stepped_as_the_trainer_steps_them(reduction, build):
    """The forward on an empty draw records nothing: with one row of position ids for the
    batch it failed in the engine's hook (dividing by the batch's zero examples)."""
    train = data(8) if build is net else token_data(8)
    kw = dict(noise_multiplier=1.0, batch_size=1, epochs=2, seed=3, build=build)
    ref, trainer = run_trainer(train, **kw)
    model, optimizer, loader = _attach(train, **kw)
    sizes = []
    for _ in range(2):
        for x, y in loader:
            sizes.append(len(x))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y, reduction=reduction).backward()  # a mean over none is NaN
            optimizer.step()
    assert 0 in sizes and optimizer.steps == trainer.steps == 16
    assert_same(ref, model)
    assert optimizer.epsilon() == trainer.epsilon()


def test_a_copy_of_the_model_leaves_the_steps_alone():
    """``copy.deepcopy`` of the attached model (an EMA copy, run on each batch) works (it
    failed in torch's Optimizer.__setstate__, the hooks holding the optimizer), and the
    model's steps are the trainer's."""
    import copy

    train = data()
    ref, trainer = run_trainer(train, **options())
    model, optimizer, loader = _attach(train, **options())
    ema = copy.deepcopy(model)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.5).add_(p, alpha=0.5)
            ema(x)
    assert_same(ref, model)
    assert optimizer.epsilon() == trainer.epsilon()
    assert all(not torch.equal(e, p) for e, p in zip(ema.parameters(), model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["loss inside", "loss on the float output"])
def test_the_users_autocast_takes_the_trainers_steps_at_that_precision(dtype, where):
    """A forward under the user's torch.autocast (the loss inside it, or on the output cast to
    float after it) takes make_private(precision=...)'s steps; it was refused as a loss that
    is not loss_fn's (its output gradient rounded to the output's dtype). Declaring the
    autocast (attach(precision=...)) changes nothing here; a doubled loss is still refused."""
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    train = data()
    ref, trainer = run_trainer(train, **options(precision=precision))
    declared = {"precision": precision} if where == "loss inside" else {}  # both take them
    model, optimizer, loader = _attach(train, **options(**declared))
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
                loss = F.cross_entropy(out, y) if where == "loss inside" else None
            assert out.dtype == dtype
            if loss is None:
                loss = F.cross_entropy(out.float(), y)
            loss.backward()
            optimizer.step()
    assert_same(ref, model, tol=1e-4)
    assert optimizer.epsilon() == trainer.epsilon()
    model, optimizer, loader = _attach(train, **options())
    x, y = next(b for b in loader if len(b[0]) > 1)
    with torch.autocast("cpu", dtype=dtype):
        (2 * F.cross_entropy(model(x), y)).backward()
    with pytest.raises(PrivgradError, match="is not that of loss_fn"):
        optimizer.step()


@pytest.mark.parametrize("unscale", [False, True])
def test_a_grad_scaler_is_refused_in_one_line(unscale):
    """torch.amp.GradScaler failed inside torch ("No inf checks were recorded for this
    optimizer": the user's backward stops at the output, so there is no .grad to check); its
    skipped steps and its scale would follow overflows in un-noised gradients. Refused at
    scaler.step, after scaler.unscale_ too (clipping's pattern), no step taken."""
    model, optimizer, loader = _attach(data(), **options())
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if unscale:
        scaler.unscale_(optimizer)
    with pytest.raises(PrivgradError, match="GradScaler is not supported .*: drop it"):
        scaler.step(optimizer)
    assert optimizer.steps == 0 and not hasattr(optimizer, "found_inf")


def test_a_model_without_trainable_parameters_is_refused():
    """In one line, before anything else (the command line's plan divided by its zero
    parameters, a traceback)."""
    model = net()
    for p in model.parameters():
        p.requires_grad_(False)
    for make in (privgrad.make_private, privgrad.attach):
        with pytest.raises(PrivgradError, match="the model has no trainable parameters"):
            make(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), **options())


class KeepsHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 16), nn.Linear(16, K)

    def forward(self, x):
        self.hidden = torch.tanh(self.a(x))
        return self.b(self.hidden)


def test_a_loss_term_on_an_inner_activation_is_refused():
    model = KeepsHidden()
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data(), **options()
    )
    x, y = next(x for x in loader if len(x[0]) > 1)
    loss = (
        F.cross_entropy(model(x), y) + (model.hidden.mean(0) ** 2).sum()
    )  # mixes examples, inside
    loss.backward()
    with pytest.raises(PrivgradError, match="other than through its output"):
        optimizer.step()
    assert optimizer.steps == 0


def test_a_gradient_outside_the_private_update_is_refused():
    # a penalty on the weights
    model, optimizer, _, x, y = first_batch()
    (F.cross_entropy(model(x), y) + 1e-3 * sum((p**2).sum() for p in model.parameters())).backward()
    with pytest.raises(PrivgradError, match="without privacy"):
        optimizer.step()
    assert optimizer.steps == 0
    # a learnable parameter outside the model, in the optimizer: refused before any step
    model = net()
    temperature = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    with pytest.raises(PrivgradError, match="1 of its parameters are not the model's"):
        privgrad.attach(model, opt, data(), **options())


def test_a_learnable_tensor_in_loss_fn_is_refused():
    """A learnable temperature in the per-sample loss, outside the model and trained by an
    optimizer of its own: the user's loss.backward() gave it the batch's gradient, unclipped and
    un-noised, and the run printed an ε that covered the model only."""
    temperature = nn.Parameter(torch.ones(()))

    def loss_fn(logits, y):
        return F.cross_entropy(logits * temperature, y, reduction="none")

    model = net()
    model, optimizer, loader = privgrad.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data(), loss_fn=loss_fn, **options()
    )
    x, y = next(iter(loader))
    loss_fn(model(x), y).mean().backward()
    with pytest.raises(PrivgradError, match="loss_fn depends on 1 tensor"):
        optimizer.step()
    assert optimizer.steps == 0


def test_a_model_compiled_after_attach_is_refused_in_one_line():
    """torch.compile of the attached model (or the Trainer's torch_compile=True) runs privgrad's
    hooks in part: step() failed with "'NoneType' object has no attribute 'shape'"."""
    model, optimizer, loader = _attach(data(), **options())
    x, y = next(iter(loader))
    F.cross_entropy(torch.compile(model, backend="eager")(x), y).backward()
    with pytest.raises(PrivgradError, match="not recorded whole by privgrad's hooks"):
        optimizer.step()
    assert optimizer.steps == 0


@pytest.mark.parametrize("how", ["torch.compile(model)", "torch.compile(layer)", "model.compile()"])
def test_a_model_compiled_before_attach_is_refused_in_one_line(how):
    """A compiled model handed to attach or make_private failed inside torch, on the check's
    second backward ('compiled with non-empty donated buffers'): refused, naming the fix."""

    def compiled():
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        if how == "model.compile()":
            model.compile(backend="eager")
        elif how == "torch.compile(layer)":
            model[0] = torch.compile(model[0], backend="eager")
        else:
            model = torch.compile(model, backend="eager")
        return model

    x, y = torch.randn(40, 3), torch.arange(40) % 2
    which = {
        "torch.compile(model)": r"layer '\(the model\)' \(OptimizedModule\)",
        "torch.compile(layer)": r"layer '0' \(OptimizedModule\)",
        "model.compile()": r"layer '\(the model\)' \(Sequential\)",
    }[how]
    for entry in (privgrad.attach, privgrad.make_private):
        model = compiled()
        with pytest.raises(PrivgradError, match=f"{which}: torch.compile'd.*_orig_mod"):
            entry(
                model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                noise_multiplier=1.0, batch_size=8, epochs=1,
            )  # fmt: skip


def test_labels_changed_in_place_are_refused():
    model, optimizer, _, x, y = first_batch()
    y.fill_(0)  # the check on the output gradient would agree with these
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="labels were modified"):
        optimizer.step()


def test_inputs_standardised_in_place_by_the_batch_are_refused():
    """x.sub_(x.mean(0)) in the loop kept x the loader's tensor, so its forward counted as the
    batch's: one example then moved the others' gradients (found by a red-team helper)."""
    model, optimizer, _, x, y = first_batch()
    x.sub_(x.mean(0)).div_(x.std(0) + 1e-6)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="inputs are not the drawn ones"):
        optimizer.step()
    assert optimizer.steps == 0


def test_the_optimizer_state_resumes_with_the_epsilon_spent():
    """optimizer.state_dict() saved by torch.save and read by a plain torch.load (weights_only,
    torch's default) resumes with the ε spent and ends where the run that never stopped does."""
    import io

    train = data()
    full, full_opt = run_own_loop(train, **options())
    model, optimizer, loader = _attach(train, **options())
    for x, y in loader:  # one of two epochs
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    checkpoint = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    checkpoint.seek(0)
    saved = torch.load(checkpoint)["optimizer"]
    model, optimizer, loader = _attach(train, **options())  # a fresh process
    with pytest.raises(PrivgradError, match="no privacy ledger"):
        optimizer.load_state_dict(optimizer.original_optimizer.state_dict())
    optimizer.load_state_dict(saved)
    assert optimizer.steps == 4 and optimizer.epsilon() > 0
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert optimizer.steps == 8
    assert_same(full, model)
    assert optimizer.epsilon() == full_opt.epsilon()


def test_a_state_saved_within_an_epoch_resumes_with_the_rest_of_that_epoch():
    """A loop stopped within an epoch and resumed as ``for epoch in range(saved_epoch,
    EPOCHS): for x, y in loader`` ends where an uninterrupted one does: iter(loader) hands
    out the epoch's remaining batches (a whole epoch took the run past its plan)."""
    import copy

    train = data()
    full, full_opt = run_own_loop(train, **options())
    model, optimizer, loader = _attach(train, **options())
    assert list(loader_steps(loader, model, optimizer)) == [1, 2, 3, 4]  # epoch 0
    assert list(itertools.islice(loader_steps(loader, model, optimizer), 2)) == [5, 6]
    saved = copy.deepcopy(optimizer.state_dict())
    model, optimizer, loader = _attach(train, **options())  # a fresh process
    optimizer.load_state_dict(saved)
    assert optimizer.steps == 6
    assert len(list(loader_steps(loader, model, optimizer))) == 2  # the rest of epoch 1
    assert optimizer.steps == 8 == full_opt.steps
    assert len(loader) == 4
    assert_same(full, model)
    assert optimizer.epsilon() == full_opt.epsilon()


def loader_steps(loader, model, optimizer):
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        yield optimizer.steps


@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("lenet5", (1, 28, 28))])
@pytest.mark.parametrize("mechanism", ["dpsgd", "spectral-dp"])
def test_conv_models_match_the_trainer(name, shape, mechanism):
    from privgrad.app.models import build_model

    g = torch.Generator().manual_seed(0)
    train = torch.randn(48, *shape, generator=g), torch.randint(0, 10, (48,), generator=g)
    kw = dict(mechanism=mechanism, noise_multiplier=1.0, batch_size=12, epochs=1, seed=3)
    torch.manual_seed(1)
    ref = build_model(name, shape, 10)
    trainer = privgrad.make_private(ref, torch.optim.SGD(ref.parameters(), lr=0.1), train, **kw)
    for batch in trainer.batches():
        trainer.step(batch)
    torch.manual_seed(1)
    own = build_model(name, shape, 10)
    model, optimizer, loader = privgrad.attach(
        own, torch.optim.SGD(own.parameters(), lr=0.1), train, **kw
    )
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        optimizer.step()
    assert optimizer.steps == trainer.steps == 4
    assert_same(ref, own)
    assert optimizer.epsilon() == trainer.epsilon()


class RootScaled(nn.Module):
    """Parameters on the root module itself (CLIP's logit_scale, a ViT's cls_token)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Linear(D, K)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.shift = nn.Parameter(torch.zeros(K))

    def forward(self, x):
        return self.logit_scale.exp() * F.normalize(self.body(x), dim=-1) + self.shift


def test_parameters_of_the_root_module_train_as_the_trainer_trains_them():
    """The own loop refused them ('reached the loss without being broadcast'): the engine's
    hook on the root, registered first, ran before attach's started recording."""
    train = data()
    ref, trainer = run_trainer(train, build=RootScaled, **options())
    own, optimizer = run_own_loop(train, "mean", build=RootScaled, **options())
    assert optimizer.steps == trainer.steps == 8
    assert_same(ref, own)
    assert not torch.equal(own.logit_scale, torch.tensor(0.5))


def weight_normed():
    torch.manual_seed(1)
    first = torch.nn.utils.parametrizations.weight_norm(nn.Linear(D, 16))
    return nn.Sequential(first, nn.Tanh(), nn.Linear(16, K))


def test_a_parametrized_layer_in_torch_code_trains_as_the_trainer_trains_it():
    """weight_norm in an nn.Sequential: its table use was located at the first frame outside
    torch, the line that called the model, which differs between attach's check and the
    loop; it was refused as 'did not see this use'."""
    train = data()
    ref, trainer = run_trainer(train, build=weight_normed, **options())
    own, optimizer = run_own_loop(train, "mean", build=weight_normed, **options())
    assert optimizer.steps == trainer.steps == 8
    assert_same(ref, own)


def micro_batch_loop(loader, model, optimizer, epochs=2, reduction="mean", stop_after=None):
    """The README's loop, recording each handed-out size and whether its step() stepped."""
    seen = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y, reduction=reduction).backward()
            optimizer.step()
            seen.append((len(y), optimizer.stepped))
            if len(seen) == stop_after:
                return seen
    return seen


@pytest.mark.parametrize(
    "mechanism,reduction", [(m, "mean") for m in MECHANISMS] + [("dpsgd", "sum")]
)
def test_micro_batches_take_the_trainers_chunked_steps(mechanism, reduction):
    """attach(max_physical_batch_size=5): the loader hands each Poisson batch out in
    micro-batches of at most 5, the batch's last step() takes the step; parameters and ε are
    make_private(max_physical_batch_size=5)'s, and the whole-batch own loop's up to rounding
    (a chunk's sum lost or added twice would show in both)."""
    train = data()
    ref, trainer = run_trainer(train, **options(mechanism, max_physical_batch_size=5))
    whole, _ = run_own_loop(train, reduction, **options(mechanism))
    model, optimizer, loader = _attach(train, **options(mechanism, max_physical_batch_size=5))
    seen = micro_batch_loop(loader, model, optimizer, reduction=reduction)
    assert all(n <= 5 for n, _ in seen) and len(seen) > 2 * trainer.steps
    assert sum(stepped for _, stepped in seen) == optimizer.steps == trainer.steps == 8
    assert_same(ref, model)
    assert_same(whole, model)
    assert optimizer.epsilon() == trainer.epsilon()
    assert optimizer.trainer.ledger.entries == trainer.ledger.entries


def test_micro_batches_are_refused_for_a_mechanism_that_needs_the_whole_batch():
    with pytest.raises(PrivgradError, match="MaskPerSample .*needs the whole batch"):
        _attach(data(), **options("gip", prune_order="prune-then-clip", max_physical_batch_size=5))


def test_a_non_finite_example_in_a_micro_batch_is_dropped_as_the_trainer_drops_it():
    x, y = data()
    x[5, 0] = float("nan")
    kw = options(epochs=1, batch_size=32, max_physical_batch_size=4)
    ref, trainer = run_trainer((x, y), **kw)
    model, optimizer, loader = _attach((x, y), **kw)
    micro_batch_loop(loader, model, optimizer, epochs=1)
    assert trainer.nonfinite_examples > 0
    assert optimizer.trainer.nonfinite_examples == trainer.nonfinite_examples
    assert_same(ref, model)
    assert optimizer.epsilon() == trainer.epsilon()
    model, optimizer, loader = _attach((x, y), **kw, strict=True)
    with pytest.raises(PrivgradError, match="not finite"):
        micro_batch_loop(loader, model, optimizer, epochs=1)


def test_a_batch_left_in_part_is_refused_and_resumes_from_its_state():
    """Leaving a batch after some of its micro-batches (a break, an error in a step) is
    refused when the next batch is taken; a state saved there resumes with that batch drawn
    again, and the run ends where an uninterrupted one does."""
    import copy

    train = data()
    kw = options(max_physical_batch_size=5)
    full_model, full_opt, full_loader = _attach(train, **kw)
    micro_batch_loop(full_loader, full_model, full_opt)
    model, optimizer, loader = _attach(train, **kw)
    seen = micro_batch_loop(loader, model, optimizer, epochs=1)
    first = micro_batch_loop(loader, model, optimizer, epochs=1, stop_after=1)
    assert first == [(5, False)] and len(seen) > 4
    saved = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(PrivgradError, match="stepped on in part"):
        micro_batch_loop(loader, model, optimizer, epochs=1)
    model, optimizer, loader = _attach(train, **kw)  # a fresh process
    optimizer.load_state_dict(saved)
    assert optimizer.steps == 4
    micro_batch_loop(loader, model, optimizer, epochs=1)
    assert optimizer.steps == 8
    assert_same(full_model, model)
    assert optimizer.epsilon() == full_opt.epsilon()


def test_a_micro_batch_loss_divided_as_in_gradient_accumulation_is_refused_with_the_reason():
    """A loop ported from gradient accumulation divides each micro-batch's loss by their
    number; the refusal says that each micro-batch's own mean or sum is what is needed."""
    model, optimizer, loader = _attach(data(), **options(max_physical_batch_size=5))
    x, y = next(iter(loader))
    (F.cross_entropy(model(x), y) / 4).backward()
    with pytest.raises(PrivgradError, match="not divided by the number of micro-batches"):
        optimizer.step()


def test_the_next_micro_batch_without_a_step_is_refused():
    model, optimizer, loader = _attach(data(), **options(max_physical_batch_size=5))
    it = iter(loader)
    x, y = next(it)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivgradError, match="micro-batch 1/.* went through the model"):
        next(it)
    model, optimizer, loader = _attach(data(), **options(max_physical_batch_size=5))
    it = iter(loader)
    next(it)  # taken, never run: its examples would be left out of the step
    with pytest.raises(PrivgradError, match="stepped on in part \\(0 of its micro-batches\\)"):
        next(it)


def test_a_scheduler_stepped_on_every_micro_batch_is_refused_with_the_fix():
    """A loop ported from one without micro-batches steps its scheduler after every
    optimizer.step(); with max_physical_batch_size only a batch's last micro-batch updates
    the parameters, so the schedule ran once per micro-batch: a StepLR(gamma=0.5) ended at
    lr 0.1 / 2^29 after 8 private steps (29 micro-batches), silently. Stepping it when
    optimizer.stepped is True trains as before."""
    model, optimizer, loader = _attach(data(), **options(max_physical_batch_size=5))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.raises(PrivgradError, match=r"learning rate changed between micro-batches .*"
                       r"0\.1 → 0\.05.*when optimizer\.stepped is True"):  # fmt: skip
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    model, optimizer, loader = _attach(data(), **options(max_physical_batch_size=5))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if optimizer.stepped:
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**optimizer.steps)


class QueueLoss:
    """A MoCo-style loss: each output against its class's prototype, with a memory bank of
    earlier batches' outputs (raw) as negatives; ``push`` adds a batch's outputs to it."""

    def __init__(self, size=64):
        self.protos = F.normalize(torch.randn(K, K, generator=torch.Generator().manual_seed(2)))
        self.size, self.queue = size, torch.zeros(0, K)

    def __call__(self, out, y):
        pos = (out * self.protos[y]).sum(1, keepdim=True)
        logits = torch.cat([pos, out @ self.queue.T], 1) / 0.1
        return F.cross_entropy(logits, torch.zeros(len(y), dtype=torch.long), reduction="none")

    def push(self, out):
        self.queue = torch.cat([out.detach(), self.queue])[: self.size]


BANK = torch.zeros(0, K)  # a memory bank a lambda reads as a global


def _banked_loop(model, optimizer, loader, loss, push=None, refused=None):
    """The own loop, ``loss(out, y)`` its scalar loss and ``push(out)`` (if given) after each
    step; with ``refused`` (a pattern), its second step must be refused with it."""
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        out = model(x)
        loss(out, y).backward()
        if refused is not None and i == 1:
            with pytest.raises(PrivgradError, match=refused):
                optimizer.step()
            return
        optimizer.step()
        if push is not None:
            push(out)


def test_a_loss_that_keeps_earlier_batches_outputs_is_refused():
    """A memory bank of earlier batches' outputs used as negatives in loss_fn (MoCo's queue,
    pushed after each step, in a loss object or a global a lambda reads) trained without a
    word: the probe saw one fixed bank. One example (q = 8/40, σ = 0, its own loss weighted
    0, so it moves steps through the bank alone) moved the clipped sum of 8 steps that did not
    draw it by 4.9 to 8.7 C each (a bank of 64 raw outputs), where ε counts at most C in the
    steps that draw it: conditioned on its one draw, those steps alone are a Gaussian of
    sensitivity 18.7 at σ = 1, ε 245 at δ = 1e-5 for q = 0.2 (dp-accounting PLD), where 5.35
    is printed for 12 steps. A tensor loss_fn holds changed since attach/make_private is
    refused at the next step now; constant class weights and a float the loop sets are not."""
    global BANK
    train = data()
    crit = QueueLoss()
    model, optimizer, loader = _attach(train, "mean", loss_fn=crit, **options(epochs=1))
    _banked_loop(
        model, optimizer, loader, lambda out, y: crit(out, y).mean(), crit.push,
        refused="loss_fn holds state that changed",
    )  # fmt: skip

    def banked(out, y):
        return F.cross_entropy(torch.cat([out, out @ BANK.T], 1), y, reduction="none")

    def push(out):
        global BANK
        BANK = torch.cat([out.detach(), BANK])[:64]

    model, optimizer, loader = _attach(train, "sum", loss_fn=banked, **options(epochs=1))
    _banked_loop(
        model, optimizer, loader, lambda out, y: banked(out, y).sum(), push, refused="its 'BANK'"
    )
    BANK = torch.zeros(0, K)

    crit = QueueLoss()  # make_private's trainer, the bank pushed between its steps
    model = net()
    trainer = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train, loss_fn=crit,
        **options(epochs=1),
    )  # fmt: skip
    batches = trainer.batches(2)
    trainer.step(next(batches))
    crit.push(model(train[0][:4]))
    with pytest.raises(PrivgradError, match="'loss_fn.queue'"):
        trainer.step(next(batches))

    class Lit(nn.Module):  # a LightningModule-like holder: its queue buffer, its loss method
        def __init__(self):
            super().__init__()
            self.model = net()
            self.register_buffer("queue", torch.zeros(0, K))

        def loss(self, out, y):
            return F.cross_entropy(torch.cat([out, out @ self.queue.T], 1), y, reduction="none")

    for pushed in (True, False):
        lit = Lit()
        model, optimizer, loader = privgrad.attach(
            lit.model, torch.optim.SGD(lit.model.parameters(), lr=0.1), train, loss_fn=lit.loss,
            loss_reduction="mean", **options(epochs=1),
        )  # fmt: skip

        def push(out, lit=lit):
            lit.queue = torch.cat([out.detach(), lit.queue])[:64]

        _banked_loop(
            model, optimizer, loader, lambda out, y: lit.loss(out, y).mean(),
            push if pushed else None, refused="its 'Lit.queue'" if pushed else None,
        )  # fmt: skip
    assert optimizer.steps == 4  # the model's own modules (privgrad's hooks) are not compared

    class Weighted(nn.Module):  # constant class weights, a temperature the loop sets
        def __init__(self):
            super().__init__()
            self.ce, self.temperature = nn.CrossEntropyLoss(torch.ones(K), reduction="none"), 1.0

        def forward(self, out, y):
            return self.ce(out / self.temperature, y)

    crit = Weighted()
    model, optimizer, loader = _attach(train, "mean", loss_fn=crit, **options(epochs=1))
    for x, y in loader:
        optimizer.zero_grad()
        crit(model(x), y).mean().backward()
        optimizer.step()
        crit.temperature *= 0.9
    assert optimizer.steps == 4


def test_a_loss_that_keeps_one_number_as_a_tensor_is_not_refused():
    """A loss keeping its last value for logging as a 0-d tensor (self.last =
    loss.detach().mean()), counting its calls in a 0-d buffer, or scaled by a 0-d weight the
    loop schedules (a global) was refused at the second step as state that changed, while the
    same as a Python float was accepted. A tensor of one number is read as the number now;
    the queue of earlier outputs stays refused (test above)."""
    train = data()

    class Logged(nn.Module):
        def __init__(self):
            super().__init__()
            self.last = None
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, out, y):
            self.calls += 1
            loss = F.cross_entropy(out, y, reduction="none") * SCHEDULE
            self.last = loss.detach().mean()
            return loss

    global SCHEDULE
    crit = Logged()
    model, optimizer, loader = _attach(train, "mean", loss_fn=crit, **options(epochs=1))
    for x, y in loader:
        optimizer.zero_grad()
        crit(model(x), y).mean().backward()
        optimizer.step()
        SCHEDULE = SCHEDULE * 0.9
    SCHEDULE = torch.tensor(1.0)
    assert optimizer.steps == 4


class Runner:
    """A training runner whose ``loss`` method is loss_fn, holding the model, the optimizer,
    loader and LR scheduler attach returns (set after attach), and the losses so far."""

    def __init__(self):
        self.model, self.optimizer, self.loader, self.scheduler = net(), None, None, None
        self.smoothing, self.history = 0.1, []

    def loss(self, out, y):
        return F.cross_entropy(out, y, label_smoothing=self.smoothing, reduction="none")

    def fit(self):
        for x, y in self.loader:
            self.optimizer.zero_grad()
            loss = self.loss(self.model(x), y).mean()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.history.append(loss.item())


def test_a_runner_holding_the_loss_and_the_optimizer_is_not_refused():
    """A runner whose loss method is loss_fn, holding the optimizer attach returned (and its
    LR scheduler, loader), was refused at the second step: 'Runner.optimizer._out' (new
    since), the optimizer's own tensors read as the loss's state. The optimizer, LR
    scheduler, privgrad's trainer and loader a loss's holder holds are not compared now; a
    queue the holder keeps is (test_a_loss_that_keeps_earlier_batches_outputs_is_refused)."""
    for make in (torch.optim.SGD, torch.optim.Adam):
        runner = Runner()
        runner.model, runner.optimizer, runner.loader = privgrad.attach(
            runner.model, make(runner.model.parameters(), lr=0.01), data(), loss_fn=runner.loss,
            loss_reduction="mean", **options(epochs=1),
        )  # fmt: skip
        runner.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(runner.optimizer, 10)
        runner.fit()
        assert runner.optimizer.steps == 4


def test_a_runner_keeping_the_best_weights_is_not_refused():
    """A runner whose loss method is loss_fn, keeping a copy of the model's state_dict as the
    best so far after an evaluation (copy.deepcopy(model.state_dict())), was refused at the
    second step: 'Runner.best.0.bias' (new since). A mapping of the model's own
    parameter and buffer names to tensors of their shapes is a snapshot of the weights, which
    follow the private steps, and is not compared now; other tensors it keeps are."""
    runner = Runner()
    runner.model, optimizer, loader = privgrad.attach(
        runner.model, torch.optim.SGD(runner.model.parameters(), lr=0.1), data(),
        loss_fn=runner.loss, loss_reduction="mean", **options(epochs=1),
    )  # fmt: skip
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        runner.loss(runner.model(x), y).mean().backward()
        if i == 2:
            with pytest.raises(PrivgradError, match="'Runner.kept."):
                optimizer.step()
            break
        optimizer.step()
        runner.best = copy.deepcopy(runner.model.state_dict())
        if i == 1:
            runner.kept = {"0.bias": torch.zeros(16), "outputs": torch.zeros(16)}
    assert optimizer.steps == 2


SCHEDULE = torch.tensor(1.0)  # a loss weight the loop schedules


class Banked(nn.Module):
    """A model whose logits are shifted by the mean of a memory bank of earlier batches'
    outputs, a plain attribute the loop sets (neither a parameter nor a buffer)."""

    def __init__(self):
        super().__init__()
        self.f, self.bank = net(), torch.zeros(0, K)

    def forward(self, x):
        z = self.f(x)
        return z + (self.bank.mean(0) if len(self.bank) else 0)


def test_a_model_that_keeps_earlier_batches_outputs_is_refused():
    """A memory bank of earlier batches' outputs the model's forward reads, set by the loop as
    a plain attribute (model.bank = torch.cat([out.detach(), model.bank])[:64]), trained
    without a word: the buffer watch sees buffers only. One example (q = 8/40, σ = 0, its own
    loss weighted 0) moved the clipped sums of steps that did not draw it by up to 1.26 C (9
    such steps of 12, each should be 0). A tensor a module holds besides its parameters and
    buffers written outside its forwards is refused at the next step now; one its forward
    writes (an activation kept for a plot) is not."""
    train = data()
    model, optimizer, loader = _attach(train, "mean", build=Banked, **options(epochs=1))
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        if i == 1:
            with pytest.raises(PrivgradError, match="its attribute 'bank'"):
                optimizer.step()
            break
        optimizer.step()
        model.bank = torch.cat([out.detach(), model.bank])[:64]

    class Kept(nn.Module):  # keeps its last activation, written in its forward
        def __init__(self):
            super().__init__()
            self.f, self.last = net(), torch.zeros(0)

        def forward(self, x):
            out = self.f(x)
            self.last = out.detach()
            return out

    model, optimizer, loader = _attach(train, "mean", build=Kept, **options(epochs=1))
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        with torch.no_grad():
            model(x[:2])  # an evaluation between steps writes it too
    assert optimizer.steps == 4


def test_a_model_holding_one_number_as_a_tensor_the_loop_sets_is_not_refused():
    """A temperature the loop anneals (model.temperature = torch.tensor(t), read by the
    forward) or a step counter it increments (model.steps += 1) was refused at the next step
    as a plain tensor written outside the forwards, while the same as a Python float was
    accepted. A tensor of one number is read as the number now; the bank of earlier outputs
    stays refused (test above)."""

    class Annealed(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.temperature, self.steps = net(), torch.tensor(1.0), torch.tensor(0)

        def forward(self, x):
            return self.f(x) / self.temperature

    model, optimizer, loader = _attach(data(), "mean", build=Annealed, **options(epochs=1))
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        model.temperature = model.temperature * 0.9
        model.steps += 1
    assert optimizer.steps == 4


class Attention(nn.Module):
    """A layer keeping its last attention weights for a plot (written in its forward)."""

    def __init__(self):
        super().__init__()
        self.q, self.last = nn.Linear(D, D), torch.zeros(0)

    def forward(self, x):
        weights = torch.softmax(self.q(x)[:, :, None] * x[:, None, :], -1)
        self.last = weights.detach()
        return (weights @ x[:, :, None])[..., 0]


class Encoded(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.head = Attention(), net()

    def forward(self, x):
        return self.head(self.encoder(x))


def test_a_module_evaluated_alone_between_steps_may_keep_what_its_forward_writes():
    """An evaluation of one of the model's modules between steps (model.encoder(x_val), as
    for embeddings), whose forward keeps its attention weights as a plain tensor, was refused
    at the next step as a tensor written outside the model's forwards: only the whole model's
    forward was watched. What a module's forward writes is not compared now, called alone too;
    the same tensor set by the loop (outside any forward) is still refused."""
    x_val = data(7, seed=5)[0]
    for written_by_loop in (False, True):
        model, optimizer, loader = _attach(data(), "mean", build=Encoded, **options(epochs=1))
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if written_by_loop and i == 1:
                with pytest.raises(PrivgradError, match="'encoder.last'"):
                    optimizer.step()
                break
            optimizer.step()
            model.eval()
            with torch.no_grad():
                model.encoder(x_val)
            model.train()
            if written_by_loop:
                model.encoder.last = model.encoder.last + 1.0
        assert written_by_loop or optimizer.steps == 4
