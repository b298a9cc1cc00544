"""RDP-GAN as published (no guarantee), RDP-ANT schedules, and the sound DP-GAN.

The headline test: the literal Eq. 8 (a N(0, σ²) scalar added to the loss) trains
bit-for-bit the same parameters as non-private training, while noise on the
output-layer error (Eqs. 9-10) does change them.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from privgrad.accounting import epsilon_of, poisson_gaussian_event
from privgrad.errors import PrivgradError
from privgrad.app.gan import (
    GanConfig,
    GanTrainer,
    NoiseSchedule,
    PaperAccountant,
    iterations_within_budget,
)
from privgrad.app.gan.claimed import table_ii_loss_bound
from privgrad.app.gan.data import ADULT_SIZES, decode_adult, encode_adult, load_gan_data
from privgrad.app.gan.evaluate import AdultScorer, MnistScorer, pmf_error
from privgrad.app.gan.models import Discriminator, Generator, condition
from privgrad.app.gan.train import final_evaluation, gan_record, rdp_discriminator_loss, selection
from privgrad.app.store import RunStore
from cli_helpers import run_cli

TINY = dict(
    generator_steps=4, discriminator_steps=2, batch_size=32, width=8, latent_dim=16,
    loss_bound=25.0, seed=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def mnist():
    return load_gan_data("mnist", limit_train=300)


@pytest.fixture(scope="module")
def adult():
    return load_gan_data("adult", limit_train=2000)


def trained(data, mode, **kw):
    trainer = GanTrainer(GanConfig(mode=mode, dataset=data.name, **{**TINY, **kw}), data)
    trainer.run()
    return trainer


def same_params(a, b) -> bool:
    pa = [*a.G.parameters(), *a.D.parameters()]
    pb = [*b.G.parameters(), *b.D.parameters()]
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))


# ---------------------------------------------------------------- the no-op
def test_mode_a_is_bit_identical_to_non_private(mnist):
    """Eq. 8 read literally: noise on the loss value never reaches a gradient (the no-op)."""
    plain = trained(mnist, "non-private")
    mode_a = trained(mnist, "rdp-gan-a", noise_multiplier=25.0)
    assert same_params(plain, mode_a)  # every weight of G and D, bit for bit
    assert plain.losses != mode_a.losses  # the noise was drawn: the printed loss moved
    assert math.isinf(mode_a.epsilon()) and math.isfinite(mode_a.epsilon_claimed())


def test_mode_b_changes_the_parameters(mnist):
    plain = trained(mnist, "non-private")
    assert not same_params(plain, trained(mnist, "rdp-gan-b", noise_multiplier=1.0))
    # with σ = 0 the hook is the only difference and adds nothing: identical again
    assert same_params(plain, trained(mnist, "rdp-gan-b", noise_multiplier=0.0))


def test_mode_b_noise_sits_on_the_output_layer_error():
    """The last layer's bias gets Σ_i (δ_i + σ η_i)/m + Σ_j δ'_j/m, δ_i = sigmoid(z_i) − 1."""
    torch.manual_seed(0)
    D = Discriminator(num_classes=0, image_size=16, width=4)
    real, fake = torch.randn(7, 1, 16, 16), torch.randn(5, 1, 16, 16)
    sigma, m = 3.0, 8.0
    loss, _, _, _ = rdp_discriminator_loss(
        D, real, fake, "error", sigma, m, torch.Generator().manual_seed(5)
    )
    loss.backward()
    bias = D.net[-1].bias
    with torch.no_grad():
        eta = torch.randn(7, generator=torch.Generator().manual_seed(5))
        expected = (
            (torch.sigmoid(D(real)) - 1 + sigma * eta).sum() + torch.sigmoid(D(fake)).sum()
        ) / m
    torch.testing.assert_close(bias.grad, expected.reshape(1))
    # the same call in reading A: the gradient is the un-noised one, only the value moves
    D.zero_grad()
    noised, printed_a, _, _ = rdp_discriminator_loss(
        D, real, fake, "loss", sigma, m, torch.Generator().manual_seed(5)
    )
    noised.backward()
    grads_a = [p.grad.clone() for p in D.parameters()]
    D.zero_grad()
    clean, printed_0, _, _ = rdp_discriminator_loss(D, real, fake, None, 0.0, m, torch.Generator())
    clean.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_a, D.parameters()))
    assert printed_a != printed_0


# ---------------------------------------------------------------- the paper's ε
def test_claimed_epsilon_reproduces_the_notes_sigmas():
    """σ for ε_total = 0.5, n_g = 1000, n_d = 5, δ = 1e-5 (spec: 2.6, 7.3, 6.0; α = 10: 9.9)."""
    for q, ds, alpha, sigma in [
        (64 / 60000, 0.1953, 2, 2.64),
        (64 / 20000, 0.3125, 2, 7.32),
        (128 / 20000, 0.1796, 2, 5.95),
        (128 / 20000, 0.1796, 10, 9.92),
    ]:
        acct = PaperAccountant(q, ds, 5, alpha=alpha, delta=1e-5)
        s = acct.sigma_for(0.5, 1000)
        assert s == pytest.approx(sigma, abs=0.01)
        assert acct.total_epsilon([s] * 1000) == pytest.approx(0.5, rel=1e-12)


def test_claimed_epsilon_is_theorems_1_to_4():
    q, ds, nd, a, d, s = 0.01, 0.3, 5, 3.0, 1e-6, 2.0
    acct = PaperAccountant(q, ds, nd, alpha=a, delta=d)
    thm1 = q * a * a * ds * ds / (2 * (a - 1) * s * s)
    assert acct.step_rdp(s) == pytest.approx(thm1)
    assert acct.generator_epsilon(s) == pytest.approx(
        4 * thm1 * math.sqrt(2 * nd * math.log(1 / d))
    )
    assert acct.total_epsilon([s, s, 2 * s]) == pytest.approx(acct.generator_epsilon(s) * 2.25)
    assert math.isinf(acct.step_rdp(0.0))
    # ΔS = C/m with Table II's C; MNIST at batch 64 is 25/64 (the paper prints 25/128)
    acct = PaperAccountant.for_run("mnist", 60000, 64, 5)
    assert acct.sensitivity == pytest.approx(25 / 64) and acct.sampling_rate == pytest.approx(
        64 / 60000
    )
    assert table_ii_loss_bound("adult", 128) == 23
    with pytest.raises(PrivgradError, match="--loss-bound"):
        table_ii_loss_bound("mnist", 32)


# ---------------------------------------------------------------- schedules
def test_decay_schedules_follow_eqs_19_to_21():
    assert NoiseSchedule("time", 10, 0.05).sigma == 10
    for kind, expected in [
        ("time", lambda t: 10 / (1 + 0.05 * t)),
        ("exp", lambda t: 10 * math.exp(-0.01 * t)),
        ("step", lambda t: 10 * 0.6 ** (t // 100)),
    ]:
        s = NoiseSchedule(kind, 10, {"time": 0.05, "exp": 0.01, "step": 0.6}[kind])
        for t in range(350):
            assert s.sigma == pytest.approx(expected(t))
            s.advance(None)


def test_budget_rule_gives_the_notes_iteration_counts():
    """Cost ∝ 1/σ², a budget of exactly 1000 iterations at σ = 10 (spec §4: 86 / 152 / 280)."""
    cost = lambda s: 1 / s**2  # noqa: E731
    counts = {
        kind: iterations_within_budget(
            NoiseSchedule(kind, 10, k), cost, 1000 / 100, 1000, scores=lambda t: 0.0
        )
        for kind, k in [
            ("constant", None),
            ("time", 0.05),
            ("exp", 0.01),
            ("step", 0.6),
            ("ant", 0.8),
        ]
    }
    assert counts == {"constant": 1000, "time": 86, "exp": 152, "step": 280, "ant": 14}


def test_ant_rule_eqs_17_and_18():
    scores = [0.5, 0.75, 0.875, 0.25]  # exact in binary floating point
    smooth = NoiseSchedule("ant", 8.0, 0.5, tau=0.25, smoothing=True)
    plain = NoiseSchedule("ant", 8.0, 0.5, tau=0.25, smoothing=False)
    for s in scores:
        smooth.advance(s)
        plain.advance(s)
    # S_0 = 0: 0.5 ≥ τ keeps σ. Eq. 17: 0.75−0.5 keeps (≥ τ), 0.875−0.75 decays, 0.25−0.875 decays.
    assert plain.decisions == [False, False, True, True] and plain.sigma == 2.0
    # Eq. 18: 0.75−0.5 keeps, 0.875−0.625 keeps, 0.25−0.708 decays.
    assert smooth.decisions == [False, False, False, True] and smooth.sigma == 4.0
    with pytest.raises(PrivgradError):
        NoiseSchedule("ant", 8.0, 0.5).advance(None)


def test_rdp_ant_stops_when_the_claimed_budget_runs_out(mnist):
    trainer = GanTrainer(
        GanConfig(
            mode="rdp-ant",
            dataset="mnist",
            epsilon=0.5,
            **{**TINY, "generator_steps": 12, "discriminator_steps": 1},
        ),
        mnist,
    )
    trainer.run(score_fn=lambda G: 0.1)  # never improves by τ = 0.5: σ decays by k every step
    assert trainer.stopped_by_budget and 1 <= trainer.generator_iterations < 12
    assert trainer.sigmas == pytest.approx(
        [trainer.sigmas[0] * 0.8**t for t in range(len(trainer.sigmas))]
    )
    assert trainer.epsilon_claimed() <= 0.5 * (1 + 1e-9) and math.isinf(trainer.epsilon())
    # the constant schedule at the paper's σ spends exactly ε_total over n_g
    const = trained(mnist, "rdp-gan-b", epsilon=0.5)
    assert const.generator_iterations == TINY["generator_steps"]
    assert const.epsilon_claimed() == pytest.approx(0.5)


# ---------------------------------------------------------------- sound DP-GAN
def test_dp_gan_accounts_every_discriminator_step(mnist):
    trainer = trained(mnist, "dp-gan", noise_multiplier=1.3)
    q = 32 / 300
    steps = TINY["generator_steps"] * TINY["discriminator_steps"]
    assert trainer.ledger.steps == steps == trainer.d_steps  # one event per D-step, none per G-step
    assert trainer.sampler.sampling_rate == pytest.approx(q)
    assert trainer.ledger.entries == [[trainer.sampler.event(1.3), steps]]
    assert trainer.epsilon() == pytest.approx(
        epsilon_of([(poisson_gaussian_event(q, 1.3), steps)], 1e-5)
    )
    assert not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in trainer.D.modules()
    )


def test_dp_gan_calibrates_over_all_discriminator_steps(mnist, monkeypatch):
    import privgrad.app.gan.train as gan_train

    seen = {}

    def fake_calibrate(
        mechanism, n_layers, target_epsilon, delta, sampling_rate, steps, target, batch
    ):
        seen.update(
            eps=target_epsilon,
            delta=delta,
            q=sampling_rate,
            steps=steps,
            target=target,
            batch=batch,
        )
        return 0.77

    monkeypatch.setattr(gan_train, "calibrate", fake_calibrate)
    trainer = GanTrainer(
        GanConfig(
            mode="dp-gan",
            dataset="mnist",
            epsilon=2.0,
            delta=1e-6,
            **{**TINY, "generator_steps": 7, "discriminator_steps": 3},
        ),
        mnist,
    )
    assert seen == dict(
        eps=2.0, delta=1e-6, q=pytest.approx(32 / 300), steps=21, target="honest", batch=32
    )
    assert trainer.mechanism.noise_multiplier == 0.77


def test_dp_gan_real_gradient_is_clipped(mnist):
    """σ = tiny, all fake terms removed: D's update direction is a sum of per-sample
    gradients each of norm ≤ C, so its norm is ≤ C·|B|/m."""
    trainer = GanTrainer(
        GanConfig(mode="dp-gan", dataset="mnist", noise_multiplier=1.0, clip=1e-3, **TINY), mnist
    )
    trainer.mechanism.noise_multiplier = (
        1e-9  # a run at this σ is refused (no accountable ε): one step only
    )
    real = trainer._real_batch()
    per_sample, _ = trainer.grad_sampler.compute(
        real,
        torch.ones(len(real)),
        lambda z, t: F.binary_cross_entropy_with_logits(z, t, reduction="none"),
    )
    assert float(per_sample.norms_sq().sqrt().max()) > 1e-3  # clipping has work to do
    grads, _, _ = trainer.mechanism.privatize(per_sample, trainer.m, trainer.noise_gen)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    assert norm <= 1e-3 * len(real) / trainer.m * (1 + 1e-4)


# ---------------------------------------------------------------- data, evaluation
def test_adult_rows_are_square_one_hot_matrices(adult):
    x, idx = adult.train_x, adult.train_idx
    assert x.shape[1:] == (1, 16, 16) and idx.shape[1] == 8
    assert torch.equal(decode_adult(x), idx)
    assert torch.equal(x[:, 0, :8].sum(-1), torch.ones(len(x), 8)) and x[:, 0, 8:].abs().sum() == 0
    for r, n in enumerate(ADULT_SIZES):
        assert int(idx[:, r].max()) < n
    g = Generator(16, 0, 16, 4, "adult")
    out = g(torch.randn(5, 16))
    torch.testing.assert_close(out[:, 0, :8].sum(-1), torch.ones(5, 8))
    assert out[:, 0, 8:].abs().sum() == 0
    assert decode_adult(encode_adult(idx[:50])).equal(idx[:50])


def test_adult_generator_samples_its_categories():
    """G's Adult rows are draws, not probabilities: with one latent repeated (BatchNorm then gives
    equal logits, a uniform categorical) the decoded Age categories are spread evenly. A plain
    softmax decodes to category 0 every time: that generator collapsed to one row in training."""
    torch.manual_seed(0)
    n, k = 9000, ADULT_SIZES[0]
    g = Generator(16, 0, 16, 4, "adult")
    ages = decode_adult(g(torch.randn(1, 16).expand(n, 16)))[:, 0]
    freq = torch.bincount(ages, minlength=k).double() / n
    tol = 5 * math.sqrt((1 / k) * (1 - 1 / k) / n)  # 5 binomial sd
    assert (freq - 1 / k).abs().max() < tol, freq


def test_pmf_error_is_eq_22():
    assert pmf_error([0.5, 0.5], [1.0, 0.0]) == pytest.approx(0.5 * 1 + 0.5 * 2)
    assert pmf_error(np.ones(4) / 4, np.ones(4) / 4) == 0


def test_mnist_score_and_sample_grid(mnist, tmp_path):
    trainer = trained(mnist, "non-private", generator_steps=1)
    scorer = MnistScorer(mnist, epochs=1)
    trainer.config.final_samples = 100
    score, metrics, images = final_evaluation(trainer, scorer, tmp_path)
    assert 0 <= score <= 1 and len(metrics["score_per_digit"]) == 10
    assert images and all(p.endswith(".png") for p in images)
    assert open(images[0], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    x = condition(torch.zeros(3, 1, 28, 28), torch.tensor([0, 4, 9]), 10)
    assert x.shape == (3, 11, 28, 28) and x[1, 1 + 4].eq(1).all() and x[1, 1:].sum() == 28 * 28


def test_dp_gan_record_holds_nothing_computed_from_the_training_rows(adult, mnist, tmp_path):
    """Neighbouring training sets (one row replaced) and no training step: the generator is the
    same, so everything the record releases about it must be too."""

    def row_0(t, value):
        return torch.cat([value[None], t[1:]])

    for data, scorer, neighbour in (
        (  # Adult's row 0 replaced by a copy of row 1
            adult,
            AdultScorer,
            {k: row_0(getattr(adult, k), getattr(adult, k)[1]) for k in ("train_x", "train_idx")},
        ),
        (mnist, MnistScorer, {"train_y": row_0(mnist.train_y, (mnist.train_y[0] + 1) % 10)}),
    ):
        records = []
        for d in (data, dataclasses.replace(data, **neighbour)):
            config = GanConfig(mode="dp-gan", dataset=d.name, noise_multiplier=1.0, **TINY)
            config.final_samples = 200
            trainer = GanTrainer(config, d)
            out = final_evaluation(trainer, scorer(d, epochs=1), tmp_path / d.name)
            records.append(gan_record(trainer, *out, 0.0, None))
        assert records[0]["evaluation"] == records[1]["evaluation"]
        assert records[0]["test_accuracy"] == records[1]["test_accuracy"]
    trainer = trained(adult, "dp-gan", noise_multiplier=1.0)  # no loss of a real batch is kept
    assert trainer.losses == []
    assert gan_record(trainer, 0.0, {}, [], 0.0, None)["max_real_loss_sum"] is None


# ---------------------------------------------------------------- CLI and records


SMALL = [
    "--dataset",
    "adult",
    "--generator-steps",
    "2",
    "--discriminator-steps",
    "1",
    "--width",
    "4",
    "--limit-train",
    "1000",
    "--eval-samples",
    "50",
    "--final-samples",
    "200",
    "--quiet",
    "--json",
]


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("rdp-gan-a", ["--noise-multiplier", "3"]),
        ("rdp-ant", ["--epsilon", "0.5", "--schedule", "exp"]),
    ],
)
def test_cli_record_says_no_guarantee(mode, extra, tmp_path):
    code, out, err = run_cli(
        "gan",
        "--mode",
        mode,
        *SMALL,
        *extra,
        "--db",
        str(tmp_path / "r.db"),
        "--image-dir",
        str(tmp_path / "img"),
    )
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["epsilon"] is None and rec["dp_guarantee"] is False
    assert rec["guarantee"].startswith("no formal guarantee")
    assert rec["epsilon_claimed"] > 0 and "not a valid DP guarantee" in rec["epsilon_claimed_note"]
    assert rec["mechanism"] == mode and 0 <= rec["test_accuracy"] <= 1
    # SMALL runs 2 G-steps of 1 D-step: not the paper's n_g = 1000, n_d = 5
    assert rec["selection"] == {
        "on": "command line",
        "differs_from_paper": {"generator_steps": 2, "discriminator_steps": 1},
    }
    assert set(rec["evaluation"]["pmf_error"]) == {
        "Age",
        "Occupation",
        "Education",
        "Gender",
        "Work Class",
        "Marital Status",
        "Work Hour",
        "Income",
    }
    assert "no formal guarantee" in err and "NOT a guarantee" in err
    assert (tmp_path / "img" / "pmf.png").exists()
    code, out, _ = run_cli("runs", "--db", str(tmp_path / "r.db"), "--json")
    assert json.loads(out)[0]["kind"] == "gan" and json.loads(out)[0]["status"] == "completed"


def test_selection_is_paper_only_at_every_setting_the_paper_states():
    assert selection(GanConfig(mode="rdp-ant", epsilon=0.5, batch_size=128)) == {"on": "paper"}
    assert selection(GanConfig(mode="dp-gan", epsilon=5, lr=2e-4)) == {
        "on": "command line",
        "differs_from_paper": {"lr": 2e-4},
    }
    assert selection(GanConfig(mode="rdp-ant", epsilon=0.5, decay=0.9, batch_size=32))[
        "differs_from_paper"
    ] == {"decay": 0.9, "batch_size": 32}


def test_cli_dp_gan_reports_honest_epsilon(tmp_path):
    code, out, err = run_cli(
        "gan",
        "--mode",
        "dp-gan",
        *SMALL,
        "--noise-multiplier",
        "2",
        "--db",
        str(tmp_path / "r.db"),
        "--image-dir",
        str(tmp_path / "img"),
    )
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["dp_guarantee"] is True and rec["steps"] == 2 and rec["accountant"] == "pld"
    assert rec["epsilon"] == pytest.approx(
        epsilon_of([(poisson_gaussian_event(64 / 1000, 2.0), 2)], 1e-5)
    )
    assert rec["epsilon_rdp"] >= rec["epsilon"] > 0 and "ε (honest, PLD)" in err
    assert rec["evaluation"]["real_reference"].startswith("adult.test")
    epochs = RunStore(tmp_path / "r.db").epochs(rec["run_id"])
    assert epochs and all(e["loss"] is None for e in epochs)  # the real batch's loss: un-noised
    from privgrad.records import code_version, environment, git_commit

    assert rec["git_commit"] == git_commit()  # the code that ran, as in a training record
    assert rec["code_version"] == code_version()
    assert rec["environment"] == environment()  # and where it ran


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--mode", "non-private", "--epsilon", "1"], "neither --epsilon"),
        (["--mode", "rdp-gan-b"], "exactly one of --epsilon"),
        (["--mode", "rdp-gan-b", "--epsilon", "1", "--schedule", "exp"], "rdp-ant only"),
        (
            ["--mode", "rdp-gan-b", "--epsilon", "1", "--batch-size", "32", "--limit-train", "100"],
            "--loss-bound",
        ),
        (["--mode", "dp-gan", "--epsilon", "-1"], "--epsilon must be"),
    ],
)
def test_cli_errors_are_one_line(args, needle, tmp_path):
    code, _, err = run_cli("gan", "--dataset", "adult", *args, "--db", str(tmp_path / "r.db"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_dp_gan_drops_a_real_example_whose_gradient_is_not_finite(mnist):
    """A NaN real image contributes zero to the discriminator's clipped sum (no NaN weights),
    as in PrivateTrainer: the clipping stage raises before any noise is drawn."""
    import dataclasses

    broken = dataclasses.replace(mnist, train_x=mnist.train_x.clone())
    broken.train_x[:150] = float("nan")
    trainer = trained(broken, "dp-gan", noise_multiplier=1.3)
    assert all(torch.isfinite(p).all() for p in trainer.D.parameters())
    assert trainer.ledger.steps == TINY["generator_steps"] * TINY["discriminator_steps"]


def test_dp_gan_with_a_sigma_the_accountant_cannot_analyse_is_refused_before_training(mnist):
    with pytest.raises(PrivgradError, match="PLD accountant would need"):
        GanTrainer(
            GanConfig(
                mode="dp-gan",
                dataset="mnist",
                noise_multiplier=0.005,
                **{**TINY, "generator_steps": 2000, "discriminator_steps": 5, "batch_size": 300},
            ),
            mnist,
        )
