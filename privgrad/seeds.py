"""The seed of a run's Poisson sampling and noise.

ε assumes that whoever sees the released model cannot predict the batches drawn or the noise
added. A seed they know (the default 0 of an earlier privgrad, or a seed in a published
record) lets them replay every draw and noise vector and subtract the noise from the model,
which leaves a statistic of the data with no noise at all. So a run given no seed draws one
from the operating system's entropy (:mod:`secrets`, :data:`SEED_BITS` bits, all of which
seed the run's generators, :func:`generator`): it is kept in the trainer's state (and the
CLI's checkpoint), private, to resume the run, and in no record or sidecar. A seed given
makes the run reproducible, for experiments; its ε then holds only while that seed stays
secret.
"""

from __future__ import annotations

import hashlib
from secrets import randbits

import torch

SEED_BITS = 62  # the run's generators add offsets to it
MAX_SEED = 2**SEED_BITS - 1
SECRET, GIVEN = "secret: drawn from the OS", "given: ε holds while it stays secret"


def secret_seed(distributed=None) -> int:
    """A seed from the OS's entropy; rank 0's on every rank of a data-parallel run (every
    rank draws the same Poisson mask and noise, :mod:`privgrad.distributed`)."""
    seed = randbits(SEED_BITS)
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


_MT_WORDS, _MT_AT = 624, 24  # a CPU generator's state: mt19937's 624 words (as uint64) from byte 24


def generator(seed: int, device=None) -> torch.Generator:
    """A generator seeded with all of ``seed``'s bits. A CPU generator's ``manual_seed`` keeps
    only the low 32 (mt19937 is seeded with a 32-bit word): a 62-bit secret seed would leave
    2^32 guesses to replay every batch and noise vector. So a CPU seed of 2^32 or more fills
    mt19937's whole state from a hash of the seed; a smaller one keeps torch's stream (a seed
    given to an earlier privgrad draws as it did), as does a CUDA generator (Philox takes 64
    bits)."""
    g = torch.Generator() if device is None else torch.Generator(device)
    g.manual_seed(seed)
    if g.device.type != "cpu" or seed < 2**32:
        return g
    state = g.get_state().clone()
    words = state[_MT_AT : _MT_AT + 8 * _MT_WORDS].view(torch.int64)
    if words[0].item() != seed & 0xFFFFFFFF:  # torch's CPU state layout changed
        from privgrad.errors import PrivgradError

        raise PrivgradError(
            f"torch {torch.__version__}'s CPU generator state is not laid out as privgrad "
            "expects, so a seed's bits above 32 cannot be kept; please report it"
        )
    digest = hashlib.shake_256(b"privgrad generator " + seed.to_bytes(16, "little"))
    new = torch.frombuffer(bytearray(digest.digest(4 * _MT_WORDS)), dtype=torch.int32)
    words.copy_(new.to(torch.int64) & 0xFFFFFFFF)
    g.set_state(state)
    return g
