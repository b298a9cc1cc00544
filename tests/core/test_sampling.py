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
