"""The seed of a run's Poisson sampling and noise.

ε assumes that whoever sees the released model cannot predict the batches drawn or the noise
added. A seed they know (the default 0 of an earlier privgrad, or a seed in a published
record) lets them replay every draw and noise vector and subtract the noise from the model,
which leaves a statistic of the data with no noise at all. So a run given no seed draws one
from the operating system's entropy (:mod:`secrets`, :data:`SEED_BITS` bits): it is kept in
the trainer's state and the run store, both private, to resume the run, and never in the
model's sidecar. A seed given makes the run reproducible, for experiments; its ε then
holds only while that seed stays secret.
"""

from __future__ import annotations

import secrets

SEED_BITS = 62  # torch generators take 64-bit seeds; the run's generators add offsets to it
MAX_SEED = 2**SEED_BITS - 1
SECRET, GIVEN = "secret: drawn from the OS", "given: ε holds while it stays secret"


def secret_seed(distributed=None) -> int:
    """A seed from the OS's entropy; rank 0's on every rank of a data-parallel run (every
    rank draws the same Poisson mask and noise, :mod:`privgrad.distributed`)."""
    seed = secrets.randbits(SEED_BITS)
    return seed if distributed is None else distributed.broadcast_int(seed)


def seed_source(given: bool) -> str:
    """What a record says of a run's seed (the seed itself stays in private records)."""
    return GIVEN if given else SECRET


def validate_seed(seed) -> int:
    """``seed`` if it is an integer in [0, :data:`MAX_SEED`]; else one line."""
    from privgrad.errors import PrivgradError

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise PrivgradError(f"seed must be an integer in [0, 2^{SEED_BITS} - 1], got {seed!r}")
    return seed
