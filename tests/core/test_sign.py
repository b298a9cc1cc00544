"""DP-SignSGD / DP-SignAdam (Ghosh & Das) and the DPLSTM used for IMDB."""

import collections

import pytest
import torch
from torch import nn

import privgrad
from privgrad.accounting import epsilon_of, poisson_gaussian_event
from privgrad.mechanisms import build_mechanism
from privgrad.app.models.text import BiLSTMClassifier, DPLSTM
from privgrad.optim import build_optimizer
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy


def trainer(mechanism, lr=0.01, optimizer=None, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(300, 10), torch.randint(0, 3, (300,))
    mech = build_mechanism(mechanism, 1.2, 1.0, **kw)
    opt = build_optimizer(optimizer or mech.optimizer, model.parameters(), lr)
    return privgrad.make_private(
        model, opt, (x, y), mechanism=mech, noise_multiplier=1.2, batch_size=30
    )


@pytest.mark.parametrize("mechanism,kw", [("dp-signsgd", {}), ("dp-signadam", {"variant": "alg2"})])
def test_every_coordinate_moves_by_exactly_lr(mechanism, kw):
    t = trainer(mechanism, lr=0.01, **kw)
    for batch in t.batches(3):
        before = [p.detach().clone() for p in t.model.parameters()]
        t.step(batch)
        for b, p in zip(before, t.model.parameters()):
            torch.testing.assert_close((p - b).abs(), torch.full_like(p, 0.01), atol=1e-7, rtol=0)


def test_signadam_alg4_is_adam_on_noisy_signs():
    t = trainer("dp-signadam", lr=0.01)
    assert isinstance(t.optimizer, torch.optim.Adam)
    batch = next(t.batches(1))
    before = [p.detach().clone() for p in t.model.parameters()]
    t.step(batch)
    # first Adam step on a ±1 gradient: m̂ = g, v̂ = 1, so the step is lr·g/(1+1e-8)
    for b, p in zip(before, t.model.parameters()):
        torch.testing.assert_close((p - b).abs(), torch.full_like(p, 0.01), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mechanism", ["dp-signsgd", "dp-signadam"])
def test_sign_mechanisms_cost_exactly_dpsgd_epsilon(mechanism):
    t, ref = trainer(mechanism), trainer("dpsgd")
    for run in (t, ref):
        for batch in run.batches(20):
            run.step(batch)
    expected = epsilon_of([(poisson_gaussian_event(0.1, 1.2), 20)], 1e-5)
    assert t.epsilon() == pytest.approx(expected, rel=1e-12) and ref.epsilon() == pytest.approx(
        expected, rel=1e-12
    )
    assert t.epsilon_claimed() == pytest.approx(t.epsilon(), rel=1e-9)


def test_literal_alg3_noise_on_the_average_is_accounted_at_b_sigma():
    mech = build_mechanism("dp-signsgd", 1.2, 1.0, noise_on="average")
    rec = mech.noise_record(n_layers=2, expected_batch_size=30)
    assert rec.effective == pytest.approx(36.0) and rec.claimed == pytest.approx(1.2)
    t = trainer("dp-signsgd", noise_on="average")
    batch = next(t.batches(1))
    t.step(batch)
    assert t.epsilon() < t.epsilon_claimed()


def test_dplstm_matches_torch_lstm():
    torch.manual_seed(0)
    ours, ref = (
        DPLSTM(5, 4, bidirectional=True),
        nn.LSTM(5, 4, batch_first=True, bidirectional=True),
    )
    for d, suffix in zip(ours.directions, ["", "_reverse"]):
        d.ih.weight.data = getattr(ref, "weight_ih_l0" + suffix).data.clone()
        d.ih.bias.data = (
            getattr(ref, "bias_ih_l0" + suffix) + getattr(ref, "bias_hh_l0" + suffix)
        ).data.clone()
        d.hh.weight.data = getattr(ref, "weight_hh_l0" + suffix).data.clone()
    x = torch.randn(3, 7, 5)
    torch.testing.assert_close(ours(x), ref(x)[0], atol=1e-6, rtol=1e-5)


def test_dplstm_backward_takes_no_per_step_slice_of_the_input_projection():
    """Each time step reads its gates from one unbind of the input projection: a slice
    gates_x[:, t] per step has a backward that zero-fills a whole (B, T, 4·hidden) gradient at
    every step (T² memory traffic; 68 % of the IMDB BiLSTM's step before 97101c5)."""
    torch.manual_seed(0)
    model, seen, stack = DPLSTM(5, 4, bidirectional=True), collections.Counter(), []
    stack.append(model(torch.randn(3, 7, 5)).sum().grad_fn)
    visited = set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        seen[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    assert seen["UnbindBackward0"] == 2, seen  # one per direction
    assert not any(name.startswith(("SelectBackward", "SliceBackward")) for name in seen), seen


def test_lstm_classifier_per_sample_gradients_equal_a_loop():
    torch.manual_seed(0)
    model = BiLSTMClassifier(num_tokens=50, embed=8, hidden=4)
    x = torch.randint(0, 50, (5, 9))
    x[1, 5:] = 0  # padding
    y = torch.randint(0, 2, (5,))
    psg, _ = GradSampler(model).compute(x, y, per_sample_cross_entropy)
    per_sample = [g for layer in psg.layers for g in layer.per_sample()]
    assert len(psg.params) == len(list(model.parameters()))
    for i in range(len(x)):
        model.zero_grad()
        per_sample_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for got, p in zip(per_sample, psg.params):
            torch.testing.assert_close(got[i], p.grad, atol=1e-6, rtol=1e-4)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in per_sample)
    torch.testing.assert_close(psg.norms_sq(), norms, rtol=1e-4, atol=1e-8)
