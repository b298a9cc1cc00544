"""The seed of the sampling and the noise (privgrad.seeds): ε assumes nobody can predict the
batches drawn or the noise added. Given no seed, a run draws a secret one from the OS (the
default was 0, known to every reader of the code: anyone could replay the noise and subtract
it from a released model); it is kept in the trainer's state for a resume, and no record or
sidecar holds it. A seed given makes the run reproducible."""

import json

import pytest
import torch
from torch import nn

import privgrad
from privgrad import PrivgradError
from privgrad.seeds import MAX_SEED


def trainer(seed="unset", n=60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    kw = {} if seed == "unset" else {"seed": seed}
    return privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=10, epochs=2, **kw,
    )  # fmt: skip


def steps(p, n=3) -> torch.Tensor:
    for batch in p.batches(n):
        p.step(batch)
    return torch.cat([q.detach().reshape(-1) for q in p.model.parameters()])


def test_without_a_seed_each_run_draws_a_secret_one_and_with_one_runs_repeat():
    a, b = trainer(), trainer()
    assert a.seed != b.seed and 0 <= a.seed <= MAX_SEED and not a.seed_given
    assert not torch.equal(steps(a), steps(b))  # other batches, other noise
    assert torch.equal(steps(trainer(7)), steps(trainer(7)))
    for record in (a.privacy_record(), trainer(7).privacy_record()):
        assert "seed" not in record
    assert a.privacy_record()["seed_source"].startswith("secret")
    assert trainer(7).privacy_record()["seed_source"].startswith("given")


def test_a_secret_seed_resumes_from_the_state_and_nowhere_else(tmp_path):
    """The state holds the seed: a trainer made without one takes it and continues as the
    run that never stopped; one made with another seed refuses it. The saved model's sidecar
    does not hold it."""
    whole = trainer()
    seed = whole.seed
    first = trainer()
    first.load_state_dict(whole.state_dict())  # the same start, the secret seed taken
    assert first.seed == seed
    steps(first, 2)
    state = first.state_dict()
    assert state["seed"] == seed
    resumed = trainer()
    resumed.load_state_dict(state)
    assert torch.equal(steps(resumed, 1), steps(whole, 3))
    with pytest.raises(PrivgradError, match="another seed than the one this trainer was given"):
        trainer(seed % 1000).load_state_dict(state)
    _, sidecar = resumed.save_model(tmp_path / "m.pt")
    assert str(seed) not in sidecar.read_text()
    assert "seed" not in json.loads(sidecar.read_text())


def test_a_state_saved_before_states_held_their_seed():
    """Such a state was saved by a run seeded 0 unless the user gave another: a trainer given
    that seed loads it; one drawing a secret seed refuses it, naming what to do."""
    old = trainer(0)
    steps(old, 2)
    state = old.state_dict()
    del state["seed"]
    trainer(0).load_state_dict(state)
    with pytest.raises(PrivgradError, match=r"names no seed.*seed=0"):
        trainer().load_state_dict(state)


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 1.5, True, "0"])
def test_a_seed_that_is_not_one_is_refused(seed):
    with pytest.raises(PrivgradError, match="seed must be an integer"):
        trainer(seed)


def test_every_bit_of_the_seed_counts():
    """A CPU torch.Generator's manual_seed keeps the low 32 bits of a seed: runs whose seeds
    differ above bit 31 drew the same batches and noise, leaving 2^32 guesses (not 2^62) to
    replay a secret-seed run. Seeds below 2^32 still draw torch's stream for that seed."""
    low = 0x5EED5EED
    runs = [trainer(low + (k << 32)) for k in (1, 2)]
    assert not torch.equal(steps(runs[0]), steps(runs[1]))
    from privgrad.seeds import generator

    assert torch.equal(generator(7).get_state(), torch.Generator().manual_seed(7).get_state())
    high = trainer(MAX_SEED)  # a state saved by such a run loads (its draws are replayed)
    steps(high, 2)
    trainer().load_state_dict(high.state_dict())


def test_a_generator_seeded_past_32_bits_draws_the_noise_and_batches_it_should():
    """privgrad.seeds.generator fills mt19937's state from a hash for a seed of 2^32 or more
    (a secret seed): its Gaussian draws have std 1, and the Poisson sampler's batch sizes are
    Binomial(N, q), by the suite's statistical checks (which fail at σ/√2 and fixed sizes)."""
    from stats import follows_binomial, std_matches

    from privgrad.sampling import PoissonSampler
    from privgrad.seeds import generator

    for seed in (2**32, 2**61 + 12345):
        z = torch.randn(200_000, generator=generator(seed + 1_000_003))
        assert std_matches(z, 1.0) and not std_matches(z / 2**0.5, 1.0)
        assert abs(float(z.mean())) < 6 / len(z) ** 0.5
        sampler = PoissonSampler(1000, 50, generator(seed))
        sizes = [len(sampler.sample()) for _ in range(3000)]
        assert follows_binomial(sizes, 1000, 0.05) and not follows_binomial([50] * 3000, 1000, 0.05)
