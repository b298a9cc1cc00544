"""One step's noise records in, its privacy events out: the one place that turns what a
mechanism's chain reported into what the ledgers and the accountant see.

A step reports a :class:`~privgrad.mechanisms.stages.NoiseRecord` per Gaussian draw
(effective and paper-claimed noise multipliers) and any σ-independent pure-DP events (GIP's
index selection). The honest event composes the Gaussian releases at their *effective*
multipliers with the pure-DP events; the claimed event uses the multipliers the paper's
analysis states. A step with neither is non-private (ε = ∞). The trainer, the audits and
the GAN runner all call :func:`step_events`, so every ε they print is composed the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from dp_accounting import dp_event

from privgrad.accounting.ledger import gaussian_event, poisson_gaussian_event


def compose(events: Sequence[dp_event.DpEvent]) -> dp_event.DpEvent:
    """One event for a step: the event itself, or their composition."""
    return events[0] if len(events) == 1 else dp_event.ComposedDpEvent(list(events))


def sampled_gaussian(sampling_rate: float) -> Callable[[float], dp_event.DpEvent]:
    """σ -> the event of one Gaussian release of a Poisson-sampled batch at rate q; at
    q ≥ 1 the plain Gaussian event (the same ε, and faster to account)."""
    if sampling_rate >= 1:
        return gaussian_event
    return lambda sigma: poisson_gaussian_event(sampling_rate, sigma)


def folded(multipliers: Sequence[float]) -> float:
    """One noise multiplier for several Gaussian draws on the same batch:
    (Σ σ_i⁻²)^(-1/2), the Gaussian mechanism their composition is (0 if one adds no noise).
    Composing each draw's subsampled event instead would treat the draws as made on
    independently sampled batches, an ε below the true one."""
    if len(multipliers) == 1:
        return multipliers[0]
    if any(m <= 0 for m in multipliers):
        return 0.0
    return sum(m**-2 for m in multipliers) ** -0.5


def step_events(
    records: Iterable,
    event: Callable[[float], dp_event.DpEvent],
    pure_events: Sequence[dp_event.DpEvent] = (),
    claimed_pure_events: Sequence[dp_event.DpEvent] | None = None,
) -> tuple[dp_event.DpEvent, dp_event.DpEvent]:
    """(honest, claimed) event of one step.

    Args:
        records: the step's noise records (``effective``, ``claimed`` multipliers), Gaussian
            draws on the step's one batch: folded into one Gaussian (:func:`folded`) before
            the sampling's event, since their batch is the same.
        event: σ -> the event of one Gaussian release under the run's sampling (the
            sampler's ``event``, or :func:`sampled_gaussian`).
        pure_events: σ-independent events the stages reported (honest ledger).
        claimed_pure_events: the same for the claimed ledger (default: ``pure_events``).
    """
    records = list(records)
    pure = list(pure_events)
    claimed_pure = pure if claimed_pure_events is None else list(claimed_pure_events)
    if not records and not pure:
        return dp_event.NonPrivateDpEvent(), dp_event.NonPrivateDpEvent()
    honest = [event(folded([r.effective for r in records]))] if records else []
    claimed = [event(folded([r.claimed for r in records]))] if records else []
    honest, claimed = honest + pure, claimed + claimed_pure
    return compose(honest), compose(claimed)


__all__ = ["step_events", "sampled_gaussian", "compose", "folded"]
