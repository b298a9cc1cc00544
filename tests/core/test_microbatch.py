"""Physical micro-batches (``max_physical_batch_size``, ``--physical-batch-size``): a Poisson
batch stepped on in chunks gives the whole-batch step (float tolerance) with the identical
ε, computes per-sample gradients for at most a chunk at once, and bounds peak memory by the
chunk; a mechanism whose per-sample stages need the whole batch is refused."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.mechanisms import Mechanism, build_mechanism
from privgrad.mechanisms.stages import (
    ClipFlat,
    GaussianNoise,
    NonFiniteGradients,
    Sum,
    capabilities_of,
)
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy

N = 120
# every built-in chain that runs chunk by chunk (GIP and random-k prune before they clip:
# refused, below); options that change the chain once each
CHUNKED = [
    ("dpsgd", {}),
    ("dp-adam", {}),
    ("non-private", {}),
    ("dp-signsgd", {}),
    ("dp-signsgd", {"noise_on": "average"}),
    ("dp-signadam", {}),
    ("dp-signadam", {"variant": "alg2"}),
    ("gip", {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}),
    ("random-k", {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}),
    ("spectral-dp", {}),
    ("gredp", {}),
]
REFUSED = [
    ("gip", {"prune_order": "prune-then-clip"}, "MaskPerSample"),
    ("random-k", {"prune_order": "prune-then-clip"}, "RandomKMask"),
]
# Chunks change only the order of the float32 additions of the clipped sum (a relative error
# of about 1e-7 per addition); the noise is the same draw. Three steps of lr 0.5 keep the
# parameters (of order 0.1-1) within 1e-6 of each other; 1e-5/1e-6 leaves a margin while a
# lost or double-counted chunk (an error of order lr·C/B ~ 1e-3) fails by far.
RTOL, ATOL = 1e-5, 1e-6


def data(n=N, nan_rows=()):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    for i in nan_rows:
        x[i] = float("nan")
    return x, y


def conv_net():
    torch.manual_seed(0)  # conv for the spectral mechanisms, then a linear layer
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(144, 3))


def run(chunk, mechanism="dpsgd", steps=3, batch_size=40, x_y=None, **options):
    """(parameters after ``steps`` steps, trainer, sizes of the per-sample computations)."""
    model = conv_net()
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        x_y or data(),
        mechanism=mechanism,
        noise_multiplier=0.0 if mechanism == "non-private" else 1.0,  # it adds no noise
        batch_size=batch_size,
        seed=3,
        max_physical_batch_size=chunk,
        **options,
    )
    computed, compute = [], private.grad_sampler.compute

    def counted(x, y, loss_fn):
        computed.append(len(y))
        return compute(x, y, loss_fn)

    private.grad_sampler.compute = counted
    for batch in private.batches(steps):
        private.step(batch)
    return [p.detach().clone() for p in model.parameters()], private, computed


def assert_same_step(whole, chunked):
    (a, pa, _), (b, pb, _) = whole, chunked
    for u, v in zip(a, b):
        torch.testing.assert_close(v, u, rtol=RTOL, atol=ATOL)
    assert pb.ledger.entries == pa.ledger.entries
    assert pb.claimed_ledger.entries == pa.claimed_ledger.entries
    assert pb.epsilon() == pa.epsilon() and pb.epsilon_claimed() == pa.epsilon_claimed()


@pytest.mark.parametrize("name, options", CHUNKED, ids=[f"{n}{o}" for n, o in CHUNKED])
def test_chunked_steps_equal_whole_batch_steps_with_the_identical_epsilon(name, options):
    whole = run(None, name, **options)
    chunked = run(7, name, **options)
    assert_same_step(whole, chunked)
    sizes, computed = whole[2], chunked[2]
    assert all(n % 7 for n in sizes)  # no batch of this run is a multiple of the chunk
    assert max(computed) <= 7 and sum(computed) == sum(sizes)  # at most a chunk at once


@pytest.mark.parametrize("chunk", [1, 16])
def test_any_chunk_size_gives_the_whole_batch_step(chunk):
    assert_same_step(run(None), run(chunk))


def test_a_batch_not_larger_than_the_chunk_is_one_computation_bit_for_bit():
    whole, chunked = run(None), run(1000)
    assert chunked[2] == whole[2]  # one computation per step, of the whole batch
    assert all(torch.equal(u, v) for u, v in zip(whole[0], chunked[0]))


@pytest.mark.parametrize("name, options, stage", REFUSED)
def test_a_chain_that_needs_the_whole_batch_is_refused_in_one_line(name, options, stage):
    with pytest.raises(PrivgradError, match="physical micro-batches") as err:
        run(7, name, **options)
    assert stage in str(err.value) and "\n" not in str(err.value)
    _, private, _ = run(None, name, steps=0, **options)
    with pytest.raises(PrivgradError, match=stage):
        private.max_physical_batch_size = 7  # setting it later is refused as well


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_the_chunk_size_is_an_integer_of_at_least_one(bad):
    with pytest.raises(PrivgradError, match="max_physical_batch_size must be an integer"):
        run(bad)


def test_the_split_is_declared_by_the_stages():
    options = {"gip": {"prune_order": "prune-then-clip"}}
    for name in ["non-private", "dpsgd", "spectral-dp", "gredp", "gip"]:
        for stage in build_mechanism(name, 1.0, 1.0, **options.get(name, {})).stages:
            caps, kind = capabilities_of(stage), type(stage).__name__
            assert caps.sums == (kind in {"Sum", "UnclippedSum"}), kind
            assert caps.per_example == (
                kind in {"NoClip", "ClipFlat", "ClipPerLayer", "SpectralTransform"}
            ), kind
    assert [build_mechanism(n, 1.0, 1.0).chunk_split() for n in ["dpsgd", "gredp"]] == [2, 3]


def test_a_stage_with_its_own_step_is_not_assumed_per_example():
    class Rescaled(ClipFlat):  # might, say, clip at the batch's median norm
        def __call__(self, state):
            return super().__call__(state)

    ok = Mechanism("ok", [ClipFlat(1.0), Sum(), GaussianNoise(1.0)])
    mech = Mechanism("own", [Rescaled(1.0), Sum(), GaussianNoise(1.0)])
    assert ok.chunk_split() == 2
    with pytest.raises(PrivgradError, match="Rescaled runs before the sum"):
        mech.chunk_split()


def test_the_sum_is_reduced_once_per_step_after_the_chunks():
    calls = []

    def double(grads):  # a data-parallel all-reduce stand-in
        calls.append(1)
        return [2 * g for g in grads]

    x, y = data(30)
    compute, loss = GradSampler(conv_net()).compute, per_sample_cross_entropy
    parts = [compute(x[i : i + 8], y[i : i + 8], loss)[0] for i in range(0, 30, 8)]
    mech = build_mechanism("dpsgd", 0.0, 1.0)
    whole, _, _ = mech.privatize(compute(x, y, loss)[0], 30, torch.Generator())
    _, chunked, _, _ = mech.privatize_chunks(
        [lambda p=p: p for p in parts], 30, torch.Generator(), double
    )
    assert calls == [1]
    for u, v in zip(whole, chunked):
        torch.testing.assert_close(v, 2 * u, rtol=RTOL, atol=ATOL)


def test_non_finite_examples_in_several_chunks_are_dropped_once_each():
    # q = 1: every step draws all 40 examples; rows 2 and 20 (chunks 1 and 3 of 7) are NaN
    x_y = data(40, nan_rows=(2, 20))
    whole = run(None, batch_size=40, x_y=x_y, steps=2)
    chunked = run(7, batch_size=40, x_y=x_y, steps=2)
    assert whole[1].nonfinite_examples == chunked[1].nonfinite_examples == 4  # 2 per step
    assert_same_step(whole, chunked)
    assert all(torch.isfinite(p).all() for p in chunked[0])
    with pytest.raises(PrivgradError, match="2 example"):
        run(7, batch_size=40, x_y=x_y, strict=True)


def test_non_finite_mask_covers_the_whole_batch():
    mech = build_mechanism("dpsgd", 1.0, 1.0)
    x, y = data(20, nan_rows=(9,))
    compute, loss = GradSampler(conv_net()).compute, per_sample_cross_entropy
    chunks = [(lambda i=i: compute(x[i : i + 8], y[i : i + 8], loss)[0]) for i in range(0, 20, 8)]
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    with pytest.raises(NonFiniteGradients) as bad:
        mech.privatize_chunks(chunks, 20.0, gen)
    assert bad.value.mask.tolist() == [i == 9 for i in range(20)]
    assert torch.equal(gen.get_state(), state)  # no noise was drawn


MEMORY_PROBE = textwrap.dedent(
    """
    import sys, torch, privgrad
    from torch import nn

    class Gate(nn.Module):  # no rule of its own: vmap builds its per-sample gradients
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
        def forward(self, x):
            return x * self.weight

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    B, D = 512, 32768
    x, y = torch.randn(B, D), torch.randint(0, 2, (B,))
    model = nn.Sequential(Gate(D), nn.Linear(D, 2))
    private = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=B,
        noise_multiplier=1.0, epochs=2,
    )
    # the chunked step first: memory it frees and the whole-batch step reuses can only
    # lower the whole-batch peak, never raise the chunked one
    for chunk, batch in zip([int(sys.argv[1]), None], private.batches(2)):
        private.max_physical_batch_size = chunk
        try:  # reset the peak to the current resident size (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = status("VmRSS:")
        except OSError:
            before = status("VmHWM:")
        private.step(batch)
        print(len(batch), status("VmHWM:") - before)
    """
)
# the own loop's micro-batches: attach(max_physical_batch_size=...)'s loader hands out chunks
OWN_LOOP_PROBE = MEMORY_PROBE.split("private = ")[0] + textwrap.dedent(
    """
    import torch.nn.functional as F
    for chunk in [int(sys.argv[1]), None]:
        torch.manual_seed(0)
        model = nn.Sequential(Gate(D), nn.Linear(D, 2))
        model, optimizer, loader = privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=B,
            noise_multiplier=1.0, epochs=2, max_physical_batch_size=chunk,
        )
        parts = iter(loader)
        part, target = next(parts)  # the batch is loaded whole, as the trainer's
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = status("VmRSS:")
        except OSError:
            before = status("VmHWM:")
        n = 0
        while True:
            F.cross_entropy(model(part), target).backward()
            optimizer.step()
            n += len(target)
            if optimizer.stepped:
                break
            part, target = next(parts)
        print(n, status("VmHWM:") - before)
        optimizer.detach()
        del model, optimizer, loader
    """
)


@pytest.mark.parametrize("probe", [MEMORY_PROBE, OWN_LOOP_PROBE], ids=["trainer", "own loop"])
def test_peak_memory_of_a_step_is_bounded_by_the_chunk(probe):
    # A step's peak resident memory above what it held before (the batch included), in a
    # fresh process: the Gate's per-sample gradients of a whole batch of ~512 examples are
    # B·D floats (64 MiB; its activations, gradients and vmap's work as much again, several
    # times); a chunk of 32 examples needs about 1/16 of it. glibc's malloc serves blocks above
    # a threshold it raises as it frees them from its heap, whose pages it keeps or returns
    # as it goes: the chunked peak then ranged over 8-68 MB from run to run (one CI run
    # failed at 67.7 MB). A fixed threshold maps every block over 128 KiB on its own, so the
    # resident size follows the tensors alive (23 MB in five runs, against 335 MB)
    out = subprocess.run(
        [sys.executable, "-c", probe, "32"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    (rows_chunked, chunked), (rows, whole) = [map(int, line.split()) for line in lines]
    assert min(rows, rows_chunked) > 400
    per_sample = rows * 32768 * 4
    assert whole > per_sample, (whole, per_sample)  # the probe sees the per-sample gradients
    assert chunked < whole / 8, (chunked, whole)


def train_cli(tmp_path, *extra):
    from cli_helpers import run_cli

    return run_cli(
        "train",
        "--limit-train",
        "600",
        "--epochs",
        "1",
        "--batch-size",
        "100",
        "--epsilon",
        "2",
        "--seed",
        "0",
        "--json",
        "--quiet",
        "--db",
        str(tmp_path / f"runs{len(extra)}.db"),
        *extra,
    )


def test_cli_physical_batch_size_gives_the_same_epsilon(tmp_path):
    code, out, err = train_cli(tmp_path)
    assert code == 0, err
    whole = json.loads(out.strip().splitlines()[-1])
    code, out, err = train_cli(tmp_path, "--physical-batch-size", "32")
    assert code == 0, err
    chunked = json.loads(out.strip().splitlines()[-1])
    assert chunked["epsilon"] == whole["epsilon"] and chunked["steps"] == whole["steps"] == 6
    assert (whole["physical_batch_size"], chunked["physical_batch_size"]) == (None, 32)
    assert abs(chunked["test_accuracy"] - whole["test_accuracy"]) <= 0.002  # float rounding


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--physical-batch-size", "0"], "--physical-batch-size must be an integer ≥ 1, got 0"),
        (
            ["--mechanism", "gip", "--prune-order", "prune-then-clip"]
            + ["--physical-batch-size", "8"],
            "cannot step on a batch in physical micro-batches",
        ),
    ],
)
def test_cli_refuses_in_one_line(tmp_path, extra, needle):
    code, _, err = train_cli(tmp_path, *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
