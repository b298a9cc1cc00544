import torch

from privgrad.sampling import PoissonSampler
from stats import follows_binomial


def batch_sizes(sampler, draws):
    return [len(sampler.sample()) for _ in range(draws)]


def test_poisson_batch_sizes_follow_binomial():
    sampler = PoissonSampler(1000, 50, torch.Generator().manual_seed(0))
    assert sampler.sampling_rate == 0.05
    assert follows_binomial(batch_sizes(sampler, 4000), 1000, 0.05)


def test_binomial_check_catches_fixed_size_batches():
    fixed = [50] * 4000  # shuffled fixed-size batches: what the Poisson accountant must not see
    assert not follows_binomial(fixed, 1000, 0.05)


def test_binomial_check_catches_wrong_rate():
    sampler = PoissonSampler(1000, 55, torch.Generator().manual_seed(0))
    assert not follows_binomial(batch_sizes(sampler, 4000), 1000, 0.05)


def test_binomial_count_then_uniform_subset_is_not_a_false_alarm():
    g = torch.Generator().manual_seed(1)
    sizes = [
        len(
            torch.randperm(1000, generator=g)[
                : int(torch.binomial(torch.tensor(1000.0), torch.tensor(0.05), generator=g))
            ]
        )
        for _ in range(4000)
    ]
    assert follows_binomial(sizes, 1000, 0.05)


def test_every_example_is_included_at_rate_q():
    sampler = PoissonSampler(200, 20, torch.Generator().manual_seed(2))
    counts = torch.zeros(200)
    draws = 3000
    for _ in range(draws):
        counts[sampler.sample()] += 1
    rate = counts / draws
    se = (0.1 * 0.9 / draws) ** 0.5
    assert (rate - 0.1).abs().max() < 5 * se


def test_empty_batches_occur_and_are_valid():
    sampler = PoissonSampler(100, 1, torch.Generator().manual_seed(3))
    sizes = batch_sizes(sampler, 500)
    assert 0 in sizes  # P(empty) = 0.99^100 ≈ 0.37


def test_the_inclusion_probability_is_at_most_q():
    """A float32 torch.rand takes the values k/2^24; an example joins when its value is below
    the sampler's threshold, so its probability is the number of such values over 2^24. Compared
    with q itself (rounded to float32), ⌈q·2^24⌉ values passed: for q = 1/40, 0.025000036."""
    levels = torch.arange(2**24, dtype=torch.float64).div(2**24).float()
    for n, batch in ((40, 1), (3, 1), (1000, 7), (10, 10)):
        sampler = PoissonSampler(n, batch, torch.Generator().manual_seed(0))
        q = sampler.sampling_rate
        inclusion = int((levels < sampler.inclusion_threshold).sum()) / 2**24
        assert q - 2**-24 < inclusion <= q, (n, batch, inclusion)
        # and sample() compares with that threshold
        g = torch.Generator().manual_seed(0)
        expected = (torch.rand(n, generator=g) < sampler.inclusion_threshold).nonzero().flatten()
        assert torch.equal(sampler.sample(), expected)


def test_a_rate_below_the_samplers_resolution_is_refused():
    """Below 2^-24 the threshold is 0: no example was ever drawn, silently."""
    import pytest

    from privgrad.errors import PrivgradError

    with pytest.raises(PrivgradError, match="below 2\\^-24"):
        PoissonSampler(20_000_000, 1, torch.Generator())
    assert PoissonSampler(1_000_000, 1, torch.Generator()).inclusion_threshold > 0


def test_a_signal_during_a_draw_leaves_a_state_that_loads():
    """A SIGINT or SIGTERM that landed between the sampler's draw and the trainer's record of
    it left the sampler a draw ahead of what state_dict saved ("the trainer state's sampler
    made 11 draws for 10 steps; it is not loaded": a resume after SIGTERM failed so, by
    chance, in CI). The draw is now held whole, the signal delivered after it."""
    import signal

    import pytest

    import privgrad

    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))

    def trainer():
        model = torch.nn.Linear(4, 2)
        return privgrad.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
            batch_size=8, epochs=1,
        )  # fmt: skip

    p = trainer()
    p.step(next(p.batches()))
    sample = p.sampler.sample

    def interrupted():  # the signal arrives right after the draw
        idx = sample()
        signal.raise_signal(signal.SIGINT)
        return idx

    p.sampler.sample = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(p.batches())
    again = trainer()
    again.load_state_dict(p.state_dict())  # refused before
    assert again.steps == 1
