"""One function turns a step's noise records into privacy events, for the trainer, the audits
and the GAN runner alike; the trainer's step observer sees every release."""

import inspect

import pytest
import torch
from dp_accounting import dp_event

import privgrad
from privgrad.accounting import events
from privgrad.accounting.ledger import poisson_gaussian_event
from privgrad.mechanisms import NoiseRecord


def test_step_events_compose_records_and_pure_events():
    event = events.sampled_gaussian(0.1)
    one = NoiseRecord(2.0, 4.0)
    honest, claimed = events.step_events([one], event)
    assert honest == poisson_gaussian_event(0.1, 2.0)
    assert claimed == poisson_gaussian_event(0.1, 4.0)
    pure = dp_event.RandomizedResponseDpEvent(0.5, 2)
    honest, claimed = events.step_events([one], event, [pure])
    assert honest == dp_event.ComposedDpEvent([poisson_gaussian_event(0.1, 2.0), pure])
    assert claimed == dp_event.ComposedDpEvent([poisson_gaussian_event(0.1, 4.0), pure])
    assert events.step_events([], event) == (dp_event.NonPrivateDpEvent(),) * 2
    assert events.sampled_gaussian(1.0)(2.0) == dp_event.GaussianDpEvent(2.0)


def test_several_records_of_a_step_are_one_gaussian_on_its_one_batch():
    """Two Gaussian draws on the same Poisson batch are one Gaussian mechanism at
    (σ₁⁻² + σ₂⁻²)^(-1/2), then subsampled once; each draw's subsampled event composed (as if
    each had its own batch) gave an ε below the true one (the canary audit of a plugin
    reporting one record per layer printed 2.08 for noise worth 2.23)."""
    from privgrad.accounting.pure_dp import composed_epsilon

    event = events.sampled_gaussian(0.1)
    two = [NoiseRecord(2.0, 3.0), NoiseRecord(2.0, 3.0)]
    honest, claimed = events.step_events(two, event)
    for got, sigma in ((honest, 2.0), (claimed, 3.0)):
        assert isinstance(got, dp_event.PoissonSampledDpEvent) and got.sampling_probability == 0.1
        assert got.event.noise_multiplier == pytest.approx(sigma / 2**0.5, rel=1e-12)
    apart = dp_event.ComposedDpEvent([poisson_gaussian_event(0.1, 2.0)] * 2)
    eps = [composed_epsilon([[e, 10]], 1e-5, "pld") for e in (apart, honest)]
    assert eps[0] < eps[1]  # composing them apart would have printed the smaller
    noiseless = events.step_events([NoiseRecord(2.0, 2.0), NoiseRecord(0.0, 0.0)], event)[0]
    assert noiseless == poisson_gaussian_event(0.1, 0.0)


def test_observer_sees_each_release_and_the_ledger_its_events():
    x, y = torch.randn(40, 5), torch.randint(0, 2, (40,))
    model = torch.nn.Linear(5, 2)
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.5,
        batch_size=10,
    )
    seen = []
    remove = private.add_step_observer(lambda update, records, extra: seen.append(records))
    for batch in private.batches(3):
        private.step(batch)
    remove()
    for batch in private.batches(1):
        private.step(batch)
    assert len(seen) == 3 and private.steps == 4
    expected = [events.step_events(r, private.sampler.event)[0] for r in seen]
    assert [e for e, n in private.ledger.entries for _ in range(n)][:3] == expected


def test_one_run_audit_patches_nothing():
    from privgrad.app.audit import one_run

    source = inspect.getsource(one_run)
    assert "privatize =" not in source and "del mechanism" not in source
    assert "add_step_observer" in source


@pytest.mark.parametrize("module", ["privgrad.private", "privgrad.app.audit.common"])
def test_step_accounting_is_written_once(module):
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    assert "ComposedDpEvent(" not in source.replace("dp_event.ComposedDpEvent)", "")
    assert "step_events" in source
