"""Data-parallel private training on ``torch.distributed``, launched by ``torchrun``.

Rank r of W owns the contiguous shard ``[rN/W, (r+1)N/W)`` of the N training indices.
Every rank draws the same global Poisson mask (its sampler is seeded like the
single-process one) and keeps the part that falls in its shard, so each example joins a
step with probability q independently of all others, the union of the ranks' batches is
exactly the single-process batch, and the accountant's event is unchanged. A rank only
ever touches its own examples.

The mechanism's chain splits at the sum: each rank runs the per-sample stages (transform,
clipping) on its examples; :meth:`Distributed.all_reduce_sum`, passed as
``Mechanism.privatize(..., reduce=...)``, turns each rank's batch sum into the global
sum; every stage after it (noise, GIP's mask, spectral filter, sign, ÷B) runs on every
rank on that same sum with the same generator (seeded identically everywhere), so all
ranks draw the same noise and apply the same update. Only rank 0 computes ε and writes.

A rank that stops answering (killed, or stopped with SIGSTOP) does not hang the others:
every collective of the group times out after :func:`collective_timeout` seconds
(``PRIVGRAD_COLLECTIVE_TIMEOUT_S``, default :data:`COLLECTIVE_TIMEOUT_S`), the waiting rank
raises a one-line error and rank 0 stores the run ``failed``. The timeout must exceed the
longest stretch one rank works alone between two collectives: rank 0's evaluation, ε and
checkpoint at the end of an epoch, while the others wait in the next step's all-reduce.
:func:`launch` refuses more ranks than the CPU cores this process may use, or than
``MemAvailable`` holds at :data:`RANK_MEMORY_BYTES` each.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from privgrad.errors import PrivgradError
from privgrad.model_file import weights_fingerprint
from privgrad.sampling import PoissonSampler


COLLECTIVE_TIMEOUT_S = 300.0  # default; PRIVGRAD_COLLECTIVE_TIMEOUT_S overrides it
TIMEOUT_ENV = "PRIVGRAD_COLLECTIVE_TIMEOUT_S"
# Memory one rank is assumed to need: a rank of 'train --limit-train 300' on MNIST (CNN)
# peaked at 0.6 GB resident (measured with /usr/bin/time -v); larger data or models need more.
RANK_MEMORY_BYTES = 1 << 30


def collective_timeout() -> float:
    """Seconds a collective waits for the other ranks before the run fails."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86_400:  # also refuses nan and inf
        raise PrivgradError(
            f"{TIMEOUT_ENV} must be a number of seconds in (0, 86400], got {text!r}"
        )
    return value


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_nproc(nproc: int) -> None:
    """One-line error unless ``nproc`` ranks fit this machine: at least 1, at most the
    usable cores, and at most ``MemAvailable`` / :data:`RANK_MEMORY_BYTES`."""
    if nproc < 1:
        raise PrivgradError(f"--nproc must be ≥ 1, got {nproc}")
    cores = usable_cores()
    if nproc > cores:
        raise PrivgradError(
            f"--nproc {nproc} exceeds the {cores} CPU core(s) this process may use; "
            f"use at most --nproc {cores}"
        )
    available = available_memory()
    if available is not None and nproc * RANK_MEMORY_BYTES > available:
        fits = available // RANK_MEMORY_BYTES
        raise PrivgradError(
            f"--nproc {nproc} needs about {nproc * RANK_MEMORY_BYTES / 2**30:.0f} GiB "
            f"({RANK_MEMORY_BYTES / 2**30:g} GiB per process), more than the "
            f"{available / 2**30:.1f} GiB available; use at most --nproc {max(fits, 1)}"
            + ("" if fits else " once memory is freed")
        )


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_for(device: str | torch.device = "cpu") -> str:
    """gloo on CPU, nccl on CUDA."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class ShardedPoissonSampler(PoissonSampler):
    """This rank's part of a global Poisson sample at rate q = B/N over all N examples.

    ``expected_batch_size`` is the global B; ``generator`` must be seeded identically on
    every rank. :meth:`sample` returns global indices, all inside ``shard``.
    """

    def __init__(
        self,
        dataset_size: int,
        expected_batch_size: float,
        generator: torch.Generator,
        shard: range,
    ):
        super().__init__(dataset_size, expected_batch_size, generator)
        self.shard = shard

    def sample(self) -> torch.Tensor:
        idx = super().sample()
        return idx[(idx >= self.shard.start) & (idx < self.shard.stop)]


class Distributed:
    """This process's place in the process group and the collectives private training needs.

    ``verify=True`` makes :meth:`after_step` check, every step, that all ranks hold
    bit-identical parameters (a debug option: it costs one hash and one all-gather).
    """

    def __init__(self, rank: int, world_size: int, backend: str, verify: bool = False):
        self.rank, self.world_size, self.backend, self.verify = rank, world_size, backend, verify

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> range:
        return range(n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size)

    def sampler(
        self, dataset_size: int, expected_batch_size: float, generator: torch.Generator
    ) -> ShardedPoissonSampler:
        if dataset_size < self.world_size:
            raise PrivgradError(
                f"{self.world_size} processes need at least {self.world_size} "
                f"training examples, got {dataset_size}"
            )
        return ShardedPoissonSampler(
            dataset_size, expected_batch_size, generator, self.shard(dataset_size)
        )

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Σ over ranks of each tensor (real or complex), in one collective per dtype."""
        real = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
        out = [None] * len(real)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            which = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([real[i].detach().reshape(-1) for i in which])
            self._collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            for i, part in zip(which, flat.split([real[i].numel() for i in which])):
                out[i] = part.view(real[i].shape)
        return [torch.view_as_complex(o) if t.is_complex() else o for o, t in zip(out, tensors)]

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` (an int64) on every rank."""
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        )
        t = torch.tensor([value], dtype=torch.int64, device=device)
        self._collective(dist.broadcast, t, src=0)
        return int(t.item())

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        """With ``verify``: fails loudly unless every rank holds the same parameters."""
        if not self.verify:
            return
        differ = self._differing_ranks(model)
        if differ:
            raise PrivgradError(
                f"ranks disagree after step {step}: the parameters of rank(s) "
                f"{', '.join(map(str, differ))} differ from rank 0's"
            )

    def check_same_start(self, model: torch.nn.Module) -> None:
        """Refuses ranks whose models start from different parameters (each rank built its
        model from its own random initialisation): every rank applies the same update, so
        each would train a model of its own, with the per-sample gradients of the others'
        models summed into it, and rank 0's, the one saved, would not be the model the steps
        were computed on. DistributedDataParallel broadcasts rank 0's; privgrad does not
        change the model it is given."""
        differ = self._differing_ranks(model)
        if differ:
            raise PrivgradError(
                f"the model's parameters on rank(s) {', '.join(map(str, differ))} differ from "
                "rank 0's before training: build the model alike on every rank "
                "(torch.manual_seed(s) with the same s before building it, or load the same "
                "weights), so that all ranks train one model"
            )

    def _differing_ranks(self, model: torch.nn.Module) -> list[int]:
        """The ranks whose parameters' hash (:func:`~privgrad.model_file.weights_fingerprint`)
        differs from rank 0's (one all-gather); a lazy layer's parameters before its first
        forward (nothing to compare yet) count by their names alone."""
        state = {name: p for name, p in model.named_parameters() if not p.is_meta}
        digest = bytes.fromhex(weights_fingerprint(state))  # (a lazy layer's: by name alone)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        )
        mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], device=device)
        hashes = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._collective(dist.all_gather, hashes, mine)
        return [r for r, h in enumerate(hashes) if int(h) != int(hashes[0])]

    def _collective(self, fn, *args, **kwargs) -> None:
        """Runs ``fn(*args)``; on gloo, returns once its worker threads have let go of the
        tensors (:func:`wait_released`). Not on NCCL: torch's NCCL watchdog thread holds each
        work item until it next polls it, so the wait could stall every step (read from
        torch's design, not measured here: no GPU was available)."""
        tensors = (
            [
                t
                for a in args
                for t in (a if isinstance(a, list) else [a])
                if isinstance(t, torch.Tensor)
            ]
            if self.backend == "gloo"
            else []
        )
        held = [t._use_count() for t in tensors]
        try:
            fn(*args, **kwargs)
        except RuntimeError as err:  # a peer died, hung up or stopped answering: stop this rank too
            if "timed out" in str(err).lower():
                raise PrivgradError(
                    f"rank {self.rank}: another rank did not answer within "
                    f"{collective_timeout():g} s ({TIMEOUT_ENV}); the process group "
                    f"failed ({_first_line(err)})"
                ) from err
            raise PrivgradError(
                f"rank {self.rank}: the process group failed ({_first_line(err)})"
            ) from err
        wait_released(tensors, held)


def wait_released(tensors: list[torch.Tensor], held: list[int], timeout: float = 5.0) -> None:
    """Waits (at most ``timeout`` s) until no reference to ``tensors`` is held beyond the
    ``held`` counts taken before a collective.

    A collective returns as soon as its result is ready, while the backend's worker thread
    may still hold its work item, and with it the tensors, for a moment (about 15 % of gloo
    all-reduces on this machine, for up to 0.2 ms). If Python drops such a tensor first, the
    worker's last release must take the GIL to free the Python object; at interpreter exit
    it cannot, and the rank aborts ("terminate called without an active exception", exit
    −6) after a finished run. Waiting here makes Python's reference always the last one."""
    deadline = time.monotonic() + timeout
    while any(t._use_count() > n for t, n in zip(tensors, held)) and time.monotonic() < deadline:
        time.sleep(0)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def process_group(device: str | torch.device = "cpu", verify: bool = False):
    """Joins the group ``torchrun`` set up (env://) and yields its :class:`Distributed`;
    yields ``None`` when this process was not launched by ``torchrun``."""
    if not launched_by_torchrun():
        yield None
        return
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=collective_timeout())
    # torch.distributed.nn.functional binds group.WORLD as default arguments when first
    # imported (by torch._dynamo, which building an optimizer imports). Imported while the
    # group exists, it would keep the group alive past destroy_process_group: its gloo
    # threads then outlive the run, and one still releasing a tensor when the interpreter
    # finalizes aborts the rank ("terminate called without an active exception", exit -6).
    # Imported first, it binds None, and destroy_process_group joins those threads.
    import torch.distributed.nn.functional  # noqa: F401

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        dist.init_process_group(backend, timeout=timeout)
    except (RuntimeError, ValueError) as err:
        raise PrivgradError(f"could not join the process group ({_first_line(err)})") from err
    try:
        yield Distributed(dist.get_rank(), dist.get_world_size(), backend, verify)
    finally:
        dist.destroy_process_group()


def launch(nproc: int, module_args: list[str]) -> None:
    """Runs ``python -m privgrad <module_args>`` as ``nproc`` ranks on this machine through
    ``torch.distributed.run`` (torchrun's own launcher, standalone rendezvous), once
    :func:`check_nproc` and :func:`collective_timeout` have accepted them."""
    check_nproc(nproc)
    collective_timeout()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "privgrad"]
    )
    args.training_script_args = module_args  # not parsed: torchrun would take --nproc for its own
    if "LOGLEVEL" not in os.environ:  # torchrun's log lines (closing signals, failures): not ours
        _quiet_loggers("torch.distributed")
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode == 2:  # privgrad's own error: that rank printed its one line already
            raise SystemExit(2) from None
        raise PrivgradError(
            f"rank {rank} of {nproc} failed (exit code {failure.exitcode}); all ranks stopped"
        ) from None


def _quiet_loggers(prefix: str) -> None:
    """Sets the loggers named ``prefix`` and ``prefix.*`` (torch sets each one's level) to
    report only critical messages."""
    import logging

    logging.getLogger(prefix).setLevel(logging.CRITICAL)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(prefix + ".") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)
