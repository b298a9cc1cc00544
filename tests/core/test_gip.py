"""GIP and Random-k: the exact Mallows sampler, grouping, budget, accounting, end to end."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from scipy import stats as sps
from torch import nn

import privgrad
from privgrad.accounting import epsilon_of, poisson_gaussian_event
from privgrad.accounting.pure_dp import (
    basic_composition,
    calibrate_with_pure_dp,
    composed_epsilon,
    pure_dp_event,
    pure_epsilon,
    rr_rdp,
    split_pure,
    tight_composition,
)
from privgrad.errors import PrivgradError
from privgrad.mechanisms import GaussianNoise, build_mechanism
from privgrad.per_sample import EngineFlags
from privgrad.mechanisms.gip import (
    GroupLayout,
    KSchedule,
    PrivateTopKMask,
    keep_count,
    mallows_topk,
    swap_distribution,
)
from kernel_guard import skip_unless_fused_runs  # tests/kernel_guard.py
from stats import chi_square_pvalue, fake_per_sample, std_matches

ALPHA = 1e-4  # chi-square significance: a correct sampler fails once in 10,000 runs
# the mask is drawn where the noise is: tests taking ``device`` run on CUDA too when a GPU is
# present (the conftest fixture)


def chi_square_p(observed_values, probs):
    """Goodness of fit of integer draws to ``probs`` (bins merged to expected ≥ 5)."""
    counts = np.bincount(np.asarray(observed_values), minlength=len(probs))[: len(probs)]
    return chi_square_pvalue(counts, probs)


def draw_swaps(theta, groups=5_000, n=256, k=0.1, seed=0, device="cpu"):
    """s of ``groups`` Mallows samples around the top-m of random scores, read off the masks."""
    gen = torch.Generator(device).manual_seed(seed)
    sizes = torch.full((groups,), n, device=device)
    m = keep_count(k, sizes)
    scores = torch.randn(groups, n, generator=gen, device=device)
    thetas = torch.full((groups,), float(theta), dtype=torch.float64, device=device)
    mask, centre, s = mallows_topk(scores, sizes, m, thetas, gen)
    assert mask.device == scores.device and s.device == scores.device
    assert torch.equal(mask.sum(1), m) and torch.equal(centre.sum(1), m)
    from_masks = m - (mask & centre).sum(1)
    assert torch.equal(from_masks, s)
    return s.cpu().numpy(), int(m[0])


# ---------------------------------------------------------------- the sampler (Eq. 11)


def test_swap_distribution_at_theta_0_is_hypergeometric():
    # θ = 0: a uniform m-subset; its overlap with the top-m is hypergeometric (scipy, independent)
    p = swap_distribution(256, 26, 0.0).numpy()
    s = np.arange(len(p))
    np.testing.assert_allclose(p, sps.hypergeom(256, 26, 26).pmf(26 - s), rtol=1e-10, atol=1e-300)


def test_sampled_swaps_follow_eq11_and_a_wrong_theta_is_caught(device):
    s, m = draw_swaps(theta=0.5, device=device)
    assert chi_square_p(s, swap_distribution(256, m, 0.5).numpy()) > ALPHA
    planted, _ = draw_swaps(theta=0.55, seed=1, device=device)  # a sampler that uses 1.1 θ
    assert chi_square_p(planted, swap_distribution(256, m, 0.5).numpy()) < ALPHA


def keep_frequencies_match(masks, centre, probs, m, n, z=5.0):
    """Each top coordinate is kept w.p. E[m−s]/m, each other one w.p. E[s]/(n−m) (symmetry
    of Eq. 3–4); every coordinate's count must lie within z binomial SDs (Bonferroni-safe)."""
    s = torch.arange(len(probs)).double()
    mean_s = float((s * probs).sum())
    q = torch.where(centre, (m - mean_s) / m, mean_s / (n - m))
    count, trials = masks.double().sum(0), masks.shape[0]
    return bool(((count - trials * q).abs() < z * (trials * q * (1 - q)).sqrt()).all())


def test_swapped_coordinates_are_uniform_within_each_class():
    gen = torch.Generator().manual_seed(4)
    groups, n, theta = 5_000, 256, 0.5
    scores = torch.randn(n, generator=gen).expand(groups, n)  # the same group, many draws
    sizes = torch.full((groups,), n)
    m = keep_count(0.1, sizes)
    thetas = torch.full((groups,), theta, dtype=torch.float64)
    mask, centre, s = mallows_topk(scores, sizes, m, thetas, gen)
    probs = swap_distribution(n, 26, theta).double()
    assert keep_frequencies_match(mask, centre[0], probs, 26, n)
    # planted: right s, but always swap the weakest kept for the strongest dropped ones
    rank = torch.argsort(torch.argsort(-scores[0].abs()))  # 0 = largest |g|
    bad = (rank[None] < (m - s)[:, None]) | (
        (rank[None] >= m[:, None]) & (rank[None] < (m + s)[:, None])
    )
    assert torch.equal(bad.sum(1), m)
    assert not keep_frequencies_match(bad, centre[0], probs, 26, n)


@pytest.mark.parametrize("theta, spec", [(0.0, 0.102), (1.0, 0.366), (2.0, 0.681)])
def test_overlap_with_true_top_k_matches_spec_and_monte_carlo(theta, spec):
    p = swap_distribution(256, 26, theta).double()
    s = torch.arange(len(p)).double()
    exact = float(((26 - s) / 26 * p).sum())
    assert abs(exact - spec) < 5e-4  # the spec's table, rounded to 3 decimals
    sd = float((((26 - s) / 26 - exact) ** 2 * p).sum().sqrt())
    draws, _ = draw_swaps(theta, seed=2)
    mc = float(((26 - draws) / 26).mean())
    assert abs(mc - exact) < 5 * sd / math.sqrt(len(draws))


def test_exactly_m_ones_per_group_including_the_tail():
    gen = torch.Generator().manual_seed(0)
    for numels, grouping, ms in [
        ([1000], "contiguous", [26, 26, 26, 23]),
        ([300, 10, 600], "per-tensor", [26, 4, 1, 26, 26, 9]),
    ]:
        layout = GroupLayout(numels, 256, grouping)
        m = keep_count(0.1, layout.sizes)
        assert m.tolist() == ms
        theta = torch.full((layout.n_groups,), 0.3, dtype=torch.float64)
        for _ in range(20):
            mask, _, _ = mallows_topk(
                layout.gather(torch.randn(sum(numels), generator=gen)), layout.sizes, m, theta, gen
            )
            assert mask.sum(1).tolist() == ms
            valid = torch.arange(256) < layout.sizes[:, None]
            assert not (mask & ~valid).any()  # padding is never kept
            flat = layout.scatter(mask)
            assert flat.sum() == sum(ms) and torch.equal(layout.gather(flat), mask)


def test_ties_go_to_the_lower_index_and_a_percentile_threshold_is_caught():
    gen = torch.Generator().manual_seed(0)
    layout = GroupLayout([600], 256)
    m = keep_count(0.1, layout.sizes)
    scores = torch.ones(600)
    scores[[5, 300]] = 2.0  # one clear winner per group, the rest tied
    huge = torch.full((layout.n_groups,), 1e3, dtype=torch.float64)  # P(s = 0) = 1
    mask, centre, s = mallows_topk(layout.gather(scores), layout.sizes, m, huge, gen)
    assert (s == 0).all() and torch.equal(mask, centre)
    flat = layout.scatter(mask)
    expected = torch.zeros(600, dtype=torch.bool)
    expected[
        torch.tensor(list(range(26)) + list(range(256, 281)) + [300] + list(range(512, 521)))
    ] = True
    assert torch.equal(flat, expected)
    # Alg. 1 line 3 read literally (|g| > percentile) does not keep exactly m on ties
    group = layout.gather(scores)[0]
    assert int((group > torch.quantile(group, 1 - 0.1)).sum()) != int(m[0])


# ---------------------------------------------------------------- schedules and budget


def test_k_schedules():
    lin, exp = KSchedule("linear", 1.0, 0.1), KSchedule("exponential", 1.0, 0.5)
    assert (
        lin(0, 11) == 1.0
        and lin(10, 11) == pytest.approx(0.1)
        and lin(5, 11) == pytest.approx(0.55)
    )
    assert exp(10, 11) == pytest.approx(0.5) and exp(5, 11) == pytest.approx(math.sqrt(0.5))
    assert lin(50, 11) == pytest.approx(0.1)  # past T: stays at k_end
    assert KSchedule("constant", 1.0, 0.3)(0, 5) == 0.3
    with pytest.raises(PrivgradError):
        KSchedule("linear", 1.0, 0.0)
    with pytest.raises(PrivgradError, match="does not use"):
        build_mechanism("gip", 1.0, 1.0, filter_ratio=0.5)
    with pytest.raises(PrivgradError, match="grouping"):
        build_mechanism("gip", 1.0, 1.0, grouping="global")


def run_mechanism(mech, grads, steps, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    psg = fake_per_sample(grads)
    return [mech.privatize(psg, grads[0].shape[0], gen) for _ in range(steps)]


def test_theta_comes_from_the_budget_and_k1_costs_nothing():
    T, budget = 12, 0.3
    mech = build_mechanism("gip", 1.0, 1.0, total_steps=T, index_epsilon_total=budget)
    outs = run_mechanism(mech, [torch.randn(4, 1000)], T)
    stage = next(s for s in mech.stages if isinstance(s, PrivateTopKMask))
    eps = [sum(pure_epsilon(e) for e in facts.pure_events) for _, _, facts in outs]
    assert eps[0] == 0 and outs[0][2].mask is None  # k(0) = 1: no pruning, no cost
    assert all(e == pytest.approx(budget / (T - 1), rel=1e-12) for e in eps[1:])
    assert math.fsum(eps) == pytest.approx(budget, rel=1e-12)
    # Thm 1 per group: θ = ε_group / s₁, s₁ = 2 min(m, n − m); Σ θ s₁ = ε_step (never more)
    layout = stage.layout
    m = keep_count(0.1, layout.sizes)
    theta = stage.thetas(layout, m, 0.04)
    s1 = 2 * torch.minimum(m, layout.sizes - m)
    assert s1.tolist() == [52, 52, 52, 46]
    assert (
        float((theta * s1).sum()) == pytest.approx(0.04, rel=1e-9)
        and float((theta * s1).sum()) <= 0.04
    )
    assert float(theta[0]) == pytest.approx(0.01 / 52, rel=1e-9)
    # constant k = 1: never prunes, never pays
    free = build_mechanism(
        "gip", 1.0, 1.0, k_schedule="constant", k_end=1.0, total_steps=5, index_epsilon_total=budget
    )
    assert all(
        not facts.pure_events and facts.mask is None
        for _, _, facts in run_mechanism(free, [torch.randn(4, 1000)], 5)
    )


def test_unplanned_mechanism_warns_and_still_reports_its_cost():
    mech = build_mechanism("gip", 1.0, 1.0, k_schedule="constant")  # the benchmark's call
    with pytest.warns(UserWarning, match="not planned"):
        _, _, facts = run_mechanism(mech, [torch.randn(4, 300)], 1)[0]
    assert pure_epsilon(facts.pure_events[0]) == pytest.approx(0.01 / 1000)


# ---------------------------------------------------------------- accounting


def test_one_pure_step_at_eps_1_gives_eps_1():
    e = pure_dp_event(1.0)
    assert isinstance(e, dp_event.RandomizedResponseDpEvent) and e.num_buckets == 2
    assert 1.0 <= pure_epsilon(e) < 1.0 + 1e-12  # p rounded so the analysed ε is never below
    assert tight_composition([(e, 1)], 1e-12, "pld") == pytest.approx(1.0, abs=2e-4)
    for accountant in ("pld", "rdp"):
        assert composed_epsilon([(e, 1)], 1e-12, accountant) == pytest.approx(1.0, abs=1e-12)
    assert isinstance(pure_dp_event(0.0), dp_event.NoOpDpEvent)
    # why privgrad composes RR itself: dp-accounting refuses it under add/remove
    assert not PLDAccountant().supports(e)


def test_rr_rdp_is_exact_even_for_tiny_epsilon():
    from decimal import Decimal, getcontext

    getcontext().prec = 60
    for eps in (1e-9, 1e-4, 0.5, 5.0):
        for order in (1.5, 2, 32, 256):
            e, a = Decimal(eps), Decimal(order)
            exact = (((a * e).exp() + ((1 - a) * e).exp()) / (1 + e.exp())).ln() / (a - 1)
            assert float(rr_rdp(eps, [order])[0]) == pytest.approx(float(exact), rel=1e-12)


def test_tight_composition_of_pure_steps_matches_the_exact_formula():
    n, eps, delta = 50, 0.1, 1e-6

    def delta_of(e):  # exact optimal composition of n ε-DP steps (Kairouz et al. 2015)
        return (
            sum(
                math.comb(n, j) * max(0.0, math.exp((n - j) * eps) - math.exp(e + j * eps))
                for j in range(n + 1)
            )
            / (1 + math.exp(eps)) ** n
        )

    lo, hi = 0.0, n * eps
    for _ in range(60):
        lo, hi = ((lo + hi) / 2, hi) if delta_of((lo + hi) / 2) > delta else (lo, (lo + hi) / 2)
    entries = [(pure_dp_event(eps), n)]
    pld = tight_composition(entries, delta, "pld")
    assert hi - 1e-9 <= pld <= hi + n * 1e-4  # an upper bound, ≤ one grid step per event above
    assert tight_composition(entries, delta, "rdp") >= pld  # PLD ≤ RDP (checklist 2)
    assert basic_composition(entries, delta) == pytest.approx(n * eps)
    assert hi < 0.9 * n * eps  # here exact composition beats adding the ε's


def test_basic_composition_adds_the_pure_epsilons():
    gauss, grid = poisson_gaussian_event(0.1, 2.0), 1e-3
    entries = [(dp_event.ComposedDpEvent([gauss, pure_dp_event(0.01)]), 9), (gauss, 1)]
    others, pure = split_pure(entries)
    assert others == [(gauss, 10)] and len(pure) == 1 and pure[0][1] == 9
    g = epsilon_of([(gauss, 10)], 1e-5, pld_interval=grid)
    basic = basic_composition(entries, 1e-5, pld_interval=grid)
    assert basic == pytest.approx(g + 0.09, rel=1e-12)
    tight = tight_composition(entries, 1e-5, pld_interval=grid)
    assert g < tight < basic  # composing exactly beats adding
    assert composed_epsilon(entries, 1e-5, pld_interval=grid) == tight
    assert composed_epsilon(entries, 1e-5, method="basic", pld_interval=grid) == basic
    assert tight <= tight_composition(entries, 1e-5, "rdp")  # PLD ≤ RDP (checklist 2)
    assert basic_composition(entries, 1e-5, "rdp") == pytest.approx(
        epsilon_of([(gauss, 10)], 1e-5, "rdp") + 0.09, rel=1e-12
    )


def test_calibration_with_pure_steps_meets_the_target():
    pure = [(pure_dp_event(0.01 / 9), 9)]
    sigma = calibrate_with_pure_dp(1.0, 1e-5, 0.1, 10, pure, "basic")  # the paper: σ for 0.99 ε
    assert epsilon_of([(poisson_gaussian_event(0.1, sigma), 10)], 1e-5) <= 0.99
    assert (
        0.98
        < composed_epsilon([(poisson_gaussian_event(0.1, sigma), 10)] + pure, 1e-5, method="basic")
        <= 1.0
    )
    with pytest.raises(PrivgradError, match="index budget"):
        calibrate_with_pure_dp(0.01, 1e-5, 0.1, 10, [(pure_dp_event(0.02), 1)])


# ---------------------------------------------------------------- the step


def test_kept_coordinates_get_noise_sigma_c_and_pruned_ones_exactly_zero():
    sigma, clip, batch = 1.3, 0.7, 8
    opts = dict(k_schedule="constant", k_end=0.3, total_steps=10, index_epsilon_total=1.0)
    mech = build_mechanism("gip", sigma, clip, **opts)
    noise, kept_total = [], 0
    for update, _, facts in run_mechanism(mech, [torch.zeros(batch, 40_000)], 3):
        mask = facts.mask[0]
        assert (update[0][~mask] == 0).all()  # no noise, no update
        assert (
            int(mask.sum()) == 156 * 77 + 19
        )  # 156 groups of 256 keep 77, the tail of 64 keeps 19
        noise.append(update[0][mask] * batch)
        kept_total += int(mask.sum())
    assert std_matches(torch.cat(noise).numpy(), sigma * clip)

    class HalfVariance(GaussianNoise):  # planted: noise at σ/√2
        def std(self, noise_scale):
            return self.noise_multiplier * noise_scale / math.sqrt(2)

    bad = build_mechanism("gip", sigma, clip, **opts)
    bad.stages[3] = HalfVariance(sigma)
    noise = [
        u[0][facts.mask[0]] * batch
        for u, _, facts in run_mechanism(bad, [torch.zeros(batch, 40_000)], 3)
    ]
    assert not std_matches(torch.cat(noise).numpy(), sigma * clip)


def test_clip_then_prune_and_prune_then_clip_updates():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(6, 600, generator=gen) * 3
    opts = dict(
        k_schedule="constant", k_end=0.2, total_steps=4, index_epsilon_total=1e9
    )  # θ huge: top-k
    for order in ("clip-then-prune", "prune-then-clip"):
        mech = build_mechanism("gip", 0.0, 1.0, prune_order=order, **opts)
        update, _, facts = run_mechanism(mech, [g], 1)[0]
        mask = facts.mask[0]
        if order == "clip-then-prune":
            clipped = g / g.norm(dim=1, keepdim=True).clamp(min=1.0)
            score = clipped.sum(0)
            expected = clipped.sum(0) * mask / 6
        else:  # the authors' code: mask from the unclipped sum, then clip the masked rows
            score = g.sum(0)
            masked = g * mask
            expected = (masked / masked.norm(dim=1, keepdim=True).clamp(min=1.0)).sum(0) / 6
        layout = GroupLayout([600], 256)
        top = layout.scatter(
            mallows_topk(
                layout.gather(score),
                layout.sizes,
                keep_count(0.2, layout.sizes),
                torch.full((3,), 1e3, dtype=torch.float64),
                gen,
            )[1]
        )
        assert torch.equal(mask, top)
        torch.testing.assert_close(update[0], expected)
        assert len(facts.pure_events) == 1  # both orders report the same pure-DP event
    # Random-k, prune then clip: the uniform mask is applied to each row before clipping
    mech = build_mechanism(
        "random-k", 0.0, 1.0, prune_order="prune-then-clip", k_schedule="constant", total_steps=4
    )
    update, _, facts = run_mechanism(mech, [g], 1)[0]
    masked = g * facts.mask[0]
    clipped = masked / masked.norm(dim=1, keepdim=True).clamp(min=1.0)
    torch.testing.assert_close(update[0], clipped.sum(0) / 6)
    assert not facts.pure_events


@pytest.mark.parametrize("mechanism", ["gip", "random-k"])
def test_prune_then_clip_steps_alike_with_masked_gradients_unbuilt(mechanism):
    """Prune-then-clip under norm_form="fused" (the masked per-sample gradients never built:
    masked kernel norms, masked book-kept sum) takes the same steps as with them built."""
    skip_unless_fused_runs()
    params = []
    for flags in (EngineFlags(), EngineFlags(norm_form="fused")):
        trainer = make_trainer(
            mechanism,
            noise_multiplier=1.0,
            epochs=1,
            prune_order="prune-then-clip",
            k_schedule="constant",
            flags=flags,
        )
        for batch in trainer.batches(2):
            trainer.step(batch)
        assert trainer.last_facts.mask is not None
        params.append([p.detach().clone() for p in trainer.model.parameters()])
    for built, unbuilt in zip(*params):
        torch.testing.assert_close(unbuilt, built, rtol=1e-5, atol=1e-6)


def test_an_empty_batch_still_gets_masked_noise_and_counts(empty_batch):
    trainer = make_trainer("gip", noise_multiplier=2.0, epochs=1, k_schedule="constant")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step(empty_batch(trainer))
    assert trainer.steps == 1 and len(trainer.last_facts.pure_events) == 1
    for b, p, m in zip(before, trainer.model.parameters(), trainer.last_facts.mask):
        assert torch.equal(b[~m], p.detach()[~m]) and (b[m] != p.detach()[m]).all()


def make_trainer(mechanism, n=200, batch=20, **kw):
    """A private trainer of a tiny MLP on random data (``device=`` passes through)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 3))
    x, y = torch.randn(n, 12), torch.randint(0, 3, (n,))
    return privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        mechanism=mechanism,
        batch_size=batch,
        **{"seed": 0, **kw},
    )


def test_random_k_costs_nothing_and_draws_a_fresh_mask_each_step(device):
    trainer = make_trainer(
        "random-k", noise_multiplier=2.0, epochs=1, k_schedule="constant", device=device
    )
    masks = []
    for batch in trainer.batches(5):
        trainer.step(batch)
        masks.append(torch.cat([m.flatten() for m in trainer.last_facts.mask]))
        assert masks[-1].device.type == device
        assert not trainer.last_facts.pure_events
    assert all(int(m.sum()) == 128 + 34 for m in masks)  # d = 323: groups of 256 and 67 (k = 0.5)
    assert not torch.equal(masks[0], masks[1])
    expected = epsilon_of([(poisson_gaussian_event(0.1, 2.0), 5)], trainer.delta)
    assert trainer.epsilon() == pytest.approx(expected)
    assert trainer.epsilon_claimed() == pytest.approx(expected)


def test_make_private_gip_hits_the_target_epsilon():
    model = nn.Linear(4, 2)
    x, y = torch.randn(500, 4), torch.randint(0, 2, (500,))
    trainer = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        mechanism="gip",
        target_epsilon=1.0,
        epochs=1,
        batch_size=50,
    )
    for batch in trainer.batches():
        trainer.step(batch)
    assert trainer.steps == 10
    eps = trainer.epsilon()
    assert 0.97 < eps <= 1.0
    assert trainer.epsilon_claimed() >= eps  # Thm 2's basic composition is the looser bound
    _, pure = split_pure(trainer.ledger.entries)
    assert math.fsum(e * n for e, n in pure) == pytest.approx(0.01, rel=1e-9)  # 1 % of ε
    # d = 10: one group; k(t) = 1, 0.9, …, 0.1: all steps but the first prune, the last keeps 1
    assert [n for _, n in pure] == [9] and trainer.last_facts.index_selection["kept"] == 1


def test_with_a_fixed_sigma_the_index_budget_is_one_percent_of_the_total(device):
    trainer = make_trainer("gip", noise_multiplier=2.0, epochs=1, device=device)
    for batch in trainer.batches():
        trainer.step(batch)
        assert all(m.device.type == device for m in trainer.last_facts.mask or [])
    gauss = epsilon_of([(poisson_gaussian_event(0.1, 2.0), 10)], trainer.delta)
    _, pure = split_pure(trainer.claimed_ledger.entries)
    spent = math.fsum(e * n for e, n in pure)
    assert spent == pytest.approx(0.01 / 0.99 * gauss, rel=1e-9)
    assert trainer.epsilon_claimed() == pytest.approx(gauss + spent, rel=1e-9)
    assert trainer.epsilon() <= trainer.epsilon_claimed()


def test_fast_row_sorts_give_torchs_orders():
    """The numpy-backed sorts of the masks give exactly torch's orders: the stable descending
    order of |scores| with ties (lower position first) and padding last, and the ascending
    order of distinct int64 keys."""
    from privgrad.mechanisms.gip import _argsort_rows, _descending_order

    gen = torch.Generator().manual_seed(5)
    for L in (1, 7, 256):
        key = torch.randn(40, L, generator=gen).abs()
        key[:, ::3] = key[:, :1].clone()  # ties within rows
        key[:5] = 0.0  # all-tied rows
        key[5, 0] = torch.finfo(torch.float32).max
        valid = torch.arange(L) < torch.randint(1, L + 1, (40, 1), generator=gen)
        want = torch.sort(
            torch.where(valid, key, -1.0), dim=1, descending=True, stable=True
        ).indices
        assert torch.equal(_descending_order(key, valid), want)
        keys = torch.randint(0, 2**62, (40, L), generator=gen)
        assert torch.equal(_argsort_rows(keys), torch.argsort(keys, dim=1))
