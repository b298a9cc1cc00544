"""DP-SGD: clipping, noise scale, normalisation, empty batches, accounting inputs."""

import math

import pytest
import torch
from torch import nn

import privgrad
from privgrad.accounting import epsilon_of, poisson_gaussian_event
from privgrad.errors import PrivgradError
from privgrad.mechanisms import GaussianNoise, StepState, build_mechanism
from stats import fake_per_sample, std_matches


def test_clipped_per_sample_norms_are_at_most_c():
    grads = [torch.randn(64, 30) * torch.logspace(-2, 2, 64)[:, None], torch.randn(64, 5, 4)]
    psg = fake_per_sample(grads)
    mech = build_mechanism("dpsgd", 0.0, max_grad_norm=1.5)
    state = mech.stages[0](StepState(psg, 64, torch.Generator()))
    clipped_norms = state.clip_weights * psg.norms_sq().sqrt()
    assert (clipped_norms <= 1.5 * (1 + 1e-6)).all()
    small = psg.norms_sq().sqrt() < 1.5
    assert torch.equal(state.clip_weights[small], torch.ones(int(small.sum())))


def test_update_is_clipped_sum_divided_by_expected_batch_size():
    grads = [torch.randn(10, 7) * 3]
    psg = fake_per_sample(grads)
    update, records, _ = build_mechanism("dpsgd", 0.0, 1.0).privatize(psg, 25.0, torch.Generator())
    norms = grads[0].norm(dim=1, keepdim=True)
    expected = (grads[0] / torch.clamp(norms, min=1.0)).sum(0) / 25.0  # public divisor, not 10
    torch.testing.assert_close(update[0], expected)


def noise_samples(mechanism, clip, batch=8, size=50_000, trials=4):
    """The noise the mechanism adds to the clipped sum (per-sample grads are zero)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        psg = fake_per_sample([torch.zeros(batch, size)])
        update, records, _ = mechanism.privatize(psg, batch, gen)
        out.append(update[0] * batch)
    return torch.cat(out).numpy(), records


def test_noise_on_the_sum_has_std_sigma_c():
    mech = build_mechanism("dpsgd", noise_multiplier=1.3, max_grad_norm=0.7)
    samples, records = noise_samples(mech, 0.7)
    assert std_matches(samples, 1.3 * 0.7)
    assert records[0].effective == pytest.approx(1.3) and records[0].claimed == pytest.approx(1.3)


def test_noise_check_catches_sigma_over_sqrt2():
    class HalfVariance(GaussianNoise):  # the GReDP bug, planted
        def std(self, noise_scale):
            return self.noise_multiplier * noise_scale / math.sqrt(2)

    mech = build_mechanism("dpsgd", 1.3, 0.7)
    mech.stages[2] = HalfVariance(1.3)
    samples, records = noise_samples(mech, 0.7)
    assert not std_matches(samples, 1.3 * 0.7)
    assert records[0].effective == pytest.approx(1.3 / math.sqrt(2))  # and it is accounted as such


def make_trainer(mechanism="dpsgd", n=200, noise=1.0, batch=20, clip=1.0, lr=0.1, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(n, 12), torch.randint(0, 3, (n,))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return privgrad.make_private(
        model,
        opt,
        (x, y),
        mechanism=mechanism,
        noise_multiplier=noise,
        batch_size=batch,
        max_grad_norm=clip,
        **kw,
    )


def test_empty_batch_still_adds_noise_and_counts(empty_batch):
    trainer = make_trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step(empty_batch(trainer))
    assert trainer.steps == 1
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_accountant_sees_the_sampler_rate_and_the_noise_that_ran():
    trainer = make_trainer(n=200, batch=20, noise=1.1)
    for batch in trainer.batches(7):
        trainer.step(batch)
    assert trainer.sampling_rate == 0.1 and trainer.steps == 7
    expected = epsilon_of([(poisson_gaussian_event(0.1, 1.1), 7)], trainer.delta)
    assert trainer.epsilon() == pytest.approx(expected)
    assert trainer.epsilon_claimed() == pytest.approx(expected)


@pytest.mark.parametrize("clip", [0.1, 0.7, 1.1])
def test_dpsgds_effective_multiplier_is_its_sigma_to_the_last_bit(clip):
    """σ_eff was std / sensitivity = (σ·C)/C, one bit off σ at these C (σ = 1.92266845703125,
    a calibrated one), so DP-SGD's honest and claimed ε differed in the 12th digit and a
    script comparing them for equality saw two figures. It is σ · (C/C) = σ exactly now."""
    sigma = 1.92266845703125
    assert (sigma * clip) / clip != sigma  # the case the old form missed
    trainer = make_trainer(noise=sigma, clip=clip)
    for batch in trainer.batches(3):
        trainer.step(batch)
    record = trainer.privacy_record()
    assert record["effective_noise_multiplier"] == sigma
    assert trainer.epsilon() == trainer.epsilon_claimed()


def test_make_private_calibrates_to_target():
    model = nn.Linear(4, 2)
    x, y = torch.randn(1000, 4), torch.randint(0, 2, (1000,))
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        target_epsilon=2.0,
        epochs=2,
        batch_size=50,
    )
    for _ in range(2):
        for batch in trainer.batches():
            trainer.step(batch)
    assert trainer.steps == 40
    assert 1.95 < trainer.epsilon() <= 2.0


def test_non_private_reports_infinite_epsilon():
    trainer = make_trainer("non-private", noise=0.0)
    for batch in trainer.batches(3):
        trainer.step(batch)
    assert math.isinf(trainer.epsilon())


def test_non_private_without_a_noise_multiplier_says_to_pass_zero():
    """attach(mechanism='non-private') with neither target_epsilon nor noise_multiplier said
    only 'give exactly one of target_epsilon and noise_multiplier'; a nonzero one was
    dropped without a word."""
    model = nn.Linear(4, 2)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    with pytest.raises(PrivgradError, match="non-private' adds no noise: noise_multiplier=0"):
        privgrad.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                        mechanism="non-private", batch_size=10)  # fmt: skip
    with pytest.raises(PrivgradError, match="noise_multiplier=1.5 would be ignored"):
        privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
            mechanism="non-private", noise_multiplier=1.5, batch_size=10,
        )  # fmt: skip


def test_unknown_mechanism_and_unused_option_are_errors():
    with pytest.raises(PrivgradError, match="unknown mechanism"):
        build_mechanism("dp-magic", 1.0, 1.0)
    with pytest.raises(PrivgradError, match="does not use"):
        build_mechanism("dpsgd", 1.0, 1.0, filter_ratio=0.5)


@pytest.mark.parametrize(
    "entry, keyword, needle",
    [
        ("make_private", {"clip": 0.5}, r"clip \(the clipping norm is max_grad_norm=\)"),
        ("attach", {"clip": 0.5}, r"clip \(the clipping norm is max_grad_norm=\)"),
        ("make_private", {"clip_norm": 1.0}, r"clip_norm \(the clipping norm is max_grad_norm"),
        ("make_private", {"loss_reduction": "sum"}, r"loss_reduction \(attach\(\) takes it"),
        ("make_private", {"poisson_sampling": False}, "always Poisson-sampled"),
    ],
)
def test_a_keyword_no_one_takes_is_refused_in_the_apis_words(entry, keyword, needle):
    """make_private(..., clip=0.5) (the CLI's --clip, or Opacus' keywords) was refused with
    "mechanism 'dpsgd' does not use option(s) --clip": a command-line flag, in Python, with
    no word of max_grad_norm. It stays refused (never ignored), in the API's words."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    make = getattr(privgrad, entry)
    with pytest.raises(PrivgradError, match=needle) as err:
        make(model, torch.optim.SGD(model.parameters(), lr=0.1),
             (torch.randn(20, 4), torch.randint(0, 2, (20,))), noise_multiplier=1.0,
             batch_size=5, **keyword)  # fmt: skip
    assert "--" not in str(err.value) and "takes these options: none" in str(err.value)
    with pytest.raises(PrivgradError, match="takes these options: .*filter_ratio"):
        make(model, torch.optim.SGD(model.parameters(), lr=0.1),
             (torch.randn(20, 4), torch.randint(0, 2, (20,))), mechanism="spectral-dp",
             noise_multiplier=1.0, batch_size=5, clip=0.5)  # fmt: skip


def test_the_clip_norm_that_runs_is_the_one_given():
    trainer = make_trainer(clip=0.37)
    assert trainer.mechanism.stages[0].max_grad_norm == 0.37
    assert trainer.mechanism.describe(trainer.n_layers)["sensitivity"] == 0.37
    built = build_mechanism("dpsgd", 1.0, 0.5)
    with pytest.raises(PrivgradError, match="own options and clipping norm"):
        privgrad.make_private(
            nn.Linear(2, 2),
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
            (torch.randn(10, 2), torch.zeros(10, dtype=torch.long)),
            mechanism=built,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
