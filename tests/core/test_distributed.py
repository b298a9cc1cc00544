"""Data-parallel training on torch.distributed: 2 gloo processes on CPU against 1 process.

The ranks are fresh processes that join the group through the same environment
variables torchrun sets (``privgrad.distributed.process_group``); each writes what it
computed to a file that the test compares with a single-process run in this process.
"""

import functools
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from privgrad import make_private
from privgrad.distributed import Distributed, process_group, wait_released
from privgrad.errors import PrivgradError
from privgrad.app.gan.data import GanData
from privgrad.app.gan.train import GanConfig, GanTrainer
from privgrad.mechanisms import (
    ClipFlat,
    GaussianNoise,
    Mechanism,
    ScaleByExpectedBatch,
    Sum,
    build_mechanism,
)
from privgrad.per_sample import GradSampler
from privgrad.private import per_sample_cross_entropy
from privgrad.sampling import PoissonSampler
from privgrad.app.store import RunStore
from privgrad.app.train import TrainConfig, train
from stats import std_matches

N, B, C, SIGMA = 64, 16, 1.0, 2.0

# (label, mechanism, options, optimizer): every mechanism and variant, on one tiny conv net
MECHANISMS = [
    ("non-private", "non-private", {}, "sgd"),
    ("dpsgd", "dpsgd", {}, "sgd"),
    ("dp-adam", "dp-adam", {}, "adam"),
    ("dp-signsgd", "dp-signsgd", {}, "sgd"),
    ("dp-signsgd-average", "dp-signsgd", {"noise_on": "average"}, "sgd"),
    ("dp-signadam-alg4", "dp-signadam", {}, "adam"),
    ("dp-signadam-alg2", "dp-signadam", {"variant": "alg2"}, "sign-adam"),
    ("spectral-dp", "spectral-dp", {}, "sgd"),
    ("gredp", "gredp", {}, "sgd"),
    ("gip", "gip", {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}, "sgd"),
    (
        "gip-prune-then-clip",
        "gip",
        {
            "k_schedule": "constant",
            "k_end": 0.5,
            "group_size": 16,
            "prune_order": "prune-then-clip",
        },
        "sgd",
    ),
    ("random-k", "random-k", {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}, "sgd"),
    (
        "random-k-prune-then-clip",
        "random-k",
        {
            "k_schedule": "constant",
            "k_end": 0.5,
            "group_size": 16,
            "prune_order": "prune-then-clip",
        },
        "sgd",
    ),
]


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 2, 8, 8, generator=g), torch.randint(0, 3, (N,), generator=g)


def conv_model():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    )


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_steps(
    group, mechanism="dpsgd", options=None, optimizer="sgd", sigma=SIGMA, steps=3, seed=5
):
    from privgrad.optim import build_optimizer

    model = conv_model()
    opt = build_optimizer(optimizer, model.parameters(), 0.05, 0.9)
    private = make_private(
        model,
        opt,
        data(),
        mechanism=mechanism,
        noise_multiplier=0.0 if mechanism == "non-private" else sigma,  # it adds no noise
        batch_size=B,
        max_grad_norm=C,
        seed=seed,
        distributed=group,
        **(options or {}),
    )
    for batch in private.batches(steps):
        private.step(batch)
    return flat_params(model)


def own_loop_steps(group, chunk=None, steps=3):
    """``train_steps``' dpsgd run as the user's own loop (``attach``), the loader's batches in
    micro-batches of at most ``chunk``."""
    import torch.nn.functional as F

    import privgrad

    model = conv_model()
    model, optimizer, loader = privgrad.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        data(),
        noise_multiplier=SIGMA,
        batch_size=B,
        max_grad_norm=C,
        seed=5,
        distributed=group,
        max_physical_batch_size=chunk,
    )
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if optimizer.steps == steps:
            break
    return flat_params(model)


def clipped_sum(group, idx_of):
    """The clipped sum of this process's examples of one Poisson draw (all-reduced if ``group``)."""
    x, y = data()
    sampler = (group.sampler if group else PoissonSampler)(N, B, torch.Generator().manual_seed(11))
    idx = idx_of(sampler)
    per_sample, _ = GradSampler(conv_model()).compute(x[idx], y[idx], per_sample_cross_entropy)
    grads, _, _ = Mechanism("clip-sum", [ClipFlat(0.1), Sum()]).privatize(
        per_sample, B, torch.Generator(), group.all_reduce_sum if group else None
    )
    return torch.cat([g.reshape(-1) for g in grads]), idx


def noise_draws(group, steps=40):
    """(noisy − clean) update coordinates over ``steps`` Poisson batches, both all-reduced."""
    x, y = data()
    grad_sampler = GradSampler(conv_model())
    sampler = group.sampler(N, B, torch.Generator().manual_seed(2))
    noisy = Mechanism("dpsgd", [ClipFlat(C), Sum(), GaussianNoise(SIGMA), ScaleByExpectedBatch()])
    clean = Mechanism("clean", [ClipFlat(C), Sum(), ScaleByExpectedBatch()])
    gen = torch.Generator().manual_seed(9)
    out = []
    for _ in range(steps):
        idx = sampler.sample()
        per_sample, _ = grad_sampler.compute(x[idx], y[idx], per_sample_cross_entropy)
        a, _, _ = noisy.privatize(per_sample, B, gen, group.all_reduce_sum)
        b, _, _ = clean.privatize(per_sample, B, torch.Generator(), group.all_reduce_sum)
        out.append(torch.cat([(u - v).reshape(-1) for u, v in zip(a, b)]))
    return torch.cat(out)


def tiny_gan_data():
    g = torch.Generator().manual_seed(4)
    return GanData(
        "mnist",
        torch.rand(N, 1, 28, 28, generator=g) * 2 - 1,
        torch.randint(0, 10, (N,), generator=g),
        10,
        28,
        "tanh",
    )


def gan_params(group):
    config = GanConfig(
        mode="dp-gan",
        dataset="mnist",
        noise_multiplier=1.0,
        clip=1.0,
        generator_steps=2,
        discriminator_steps=2,
        batch_size=B,
        width=8,
        latent_dim=16,
        seed=0,
    )
    trainer = GanTrainer(config, tiny_gan_data(), distributed=group)
    trainer.run()
    return flat_params(trainer.D), flat_params(trainer.G)


def disagreement(group):
    model = conv_model()
    group.verify = True
    group.after_step(model, 1)  # agree: passes
    if group.rank == 1:
        with torch.no_grad():
            next(model.parameters())[0].add_(1e-6)
    try:
        group.after_step(model, 2)
    except PrivgradError as err:
        return str(err)
    return None


def different_start(group):
    """attach on ranks whose models were initialised apart (rank 1 built its own): the
    error each rank raises, or None if it trained."""
    import privgrad

    model = conv_model()
    if group.rank == 1:
        with torch.no_grad():
            next(model.parameters())[0].add_(1e-6)
    try:
        privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.05), data(), noise_multiplier=SIGMA,
            batch_size=B, max_grad_norm=C, seed=5, distributed=group,
        )  # fmt: skip
    except PrivgradError as err:
        return str(err)
    return None


def lazy_start(group):
    """attach on a model with a lazy layer, not materialised before attach: None if it
    trained, else the error."""
    import privgrad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))
    try:
        privgrad.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.05), data(), noise_multiplier=SIGMA,
            batch_size=B, max_grad_norm=C, seed=5, distributed=group,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 (reported to the test)
        return f"{type(err).__name__}: {err}"
    return None


def worker_all(group):
    return {
        "world_size": group.world_size,
        "backend": group.backend,
        "sum": clipped_sum(group, lambda s: s.sample()),
        "sigma0": train_steps(group, sigma=0.0, steps=5),
        "noise": noise_draws(group),
        "mechanisms": {
            label: train_steps(group, name, opts, optimizer)
            for label, name, opts, optimizer in MECHANISMS
        },
        "own loop": [own_loop_steps(group, chunk) for chunk in (None, 3)],
        "gan": gan_params(group),
        "secret seed": [train_steps(group, seed=None, steps=2) for _ in range(2)],
        "disagreement": disagreement(group),
        "different start": different_start(group),
        "lazy start": lazy_start(group),
    }


# --------------------------------------------------------------------------- launching


def _rank_main(rank, world, port, fn, out):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with process_group() as group:
        result = fn(group)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def run_ranks(fn, out, world=2, timeout=240):
    """Runs ``fn(group)`` on ``world`` fresh gloo ranks; returns (exit codes, results)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")  # fresh processes, privgrad imported once
    ctx.set_forkserver_preload([__name__])
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, str(out))) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = [
        torch.load(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else None
        for r in range(world)
    ]
    return [p.exitcode for p in procs], results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    codes, results = run_ranks(worker_all, tmp_path_factory.mktemp("ranks"))
    assert codes == [0, 0]
    return results


# --------------------------------------------------------------------------- in-process


def test_sharded_samplers_split_the_single_process_draw():
    for world in (2, 3):
        single = PoissonSampler(N, B, torch.Generator().manual_seed(1))
        ranks = [
            Distributed(r, world, "gloo").sampler(N, B, torch.Generator().manual_seed(1))
            for r in range(world)
        ]
        for _ in range(20):
            parts = [s.sample() for s in ranks]
            for s, part in zip(ranks, parts):
                assert all(i in s.shard for i in part.tolist())
            assert torch.equal(torch.cat(parts), single.sample())
        assert sum(len(s.shard) for s in ranks) == N
        assert all(s.sampling_rate == B / N for s in ranks)  # the accountant's q: global


def test_reduce_runs_after_every_sum_stage():
    x, y = data()
    calls = []

    def double(grads):
        calls.append(len(grads))
        return [2 * g for g in grads]

    per_sample, _ = GradSampler(conv_model()).compute(x[:5], y[:5], per_sample_cross_entropy)
    for name, options, sums in [
        ("dpsgd", {}, 1),
        (
            "gip",
            {"prune_order": "prune-then-clip", "total_steps": 10, "index_epsilon_total": 0.1},
            2,
        ),
    ]:
        calls.clear()
        mech = build_mechanism(name, 0.0, 1.0, **options)
        mech.privatize(per_sample, 5, torch.Generator(), double)
        assert len(calls) == sums
    mech = build_mechanism("dpsgd", 0.0, 1.0)
    plain, _, _ = mech.privatize(per_sample, 5, torch.Generator())
    doubled, _, _ = mech.privatize(per_sample, 5, torch.Generator(), double)
    assert all(torch.allclose(2 * a, b) for a, b in zip(plain, doubled))


def test_too_few_examples_for_the_ranks_is_an_error():
    with pytest.raises(PrivgradError, match="at least 3"):
        Distributed(0, 3, "gloo").sampler(2, 1, torch.Generator())


# --------------------------------------------------------------------------- 2 gloo ranks


def test_ranks_report_the_group(two_ranks):
    assert [r["world_size"] for r in two_ranks] == [2, 2]
    assert {r["backend"] for r in two_ranks} == {"gloo"}


def test_all_reduced_clipped_sum_equals_single_process_sum(two_ranks):
    single, idx = clipped_sum(None, lambda s: s.sample())
    assert len(idx) > 0
    for r in two_ranks:
        torch.testing.assert_close(r["sum"][0], single, rtol=1e-5, atol=1e-6)


def test_zero_noise_two_processes_train_like_one(two_ranks):
    single = train_steps(None, sigma=0.0, steps=5)
    assert torch.equal(two_ranks[0]["sigma0"], two_ranks[1]["sigma0"])
    torch.testing.assert_close(two_ranks[0]["sigma0"], single, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(single, flat_params(conv_model()))  # the steps moved the model


def test_one_shared_noise_draw_of_std_sigma_c_over_b(two_ranks):
    a, b = two_ranks[0]["noise"], two_ranks[1]["noise"]
    assert torch.equal(a, b)  # every rank applied the same noise
    assert std_matches(a, SIGMA * C / B)
    # the test has the power to see noise drawn per rank and summed (√2 too large)
    assert not std_matches(a * math.sqrt(2), SIGMA * C / B)


@pytest.mark.parametrize("label,name,options,optimizer", MECHANISMS, ids=[m[0] for m in MECHANISMS])
def test_every_mechanism_runs_on_two_processes(two_ranks, label, name, options, optimizer):
    mine = [r["mechanisms"][label] for r in two_ranks]
    assert torch.equal(mine[0], mine[1])  # identical parameters on every rank (σ > 0)
    single = train_steps(None, name, options, optimizer)
    torch.testing.assert_close(mine[0], single, rtol=1e-4, atol=1e-5)  # same noise, same batches


def test_the_own_loop_runs_on_two_processes_in_micro_batches_too(two_ranks):
    """attach(distributed=group): each rank's loader hands out its part of the global Poisson
    batch (in micro-batches of 3: the ranks' counts differ, the sum is reduced once)."""
    single = train_steps(None)
    for i in range(2):
        assert torch.equal(two_ranks[0]["own loop"][i], two_ranks[1]["own loop"][i])
        torch.testing.assert_close(two_ranks[0]["own loop"][i], single, rtol=1e-4, atol=1e-5)


def test_only_dp_gan_runs_data_parallel():
    config = GanConfig(
        mode="non-private", dataset="mnist", generator_steps=2, batch_size=B, width=8, latent_dim=16
    )
    with pytest.raises(PrivgradError, match="supports mode dp-gan only"):
        GanTrainer(config, tiny_gan_data(), distributed=Distributed(0, 2, "gloo"))


def test_dp_gan_discriminator_on_two_processes(two_ranks):
    (d0, g0), (d1, g1) = two_ranks[0]["gan"], two_ranks[1]["gan"]
    assert torch.equal(d0, d1) and torch.equal(g0, g1)
    d, g = gan_params(None)
    torch.testing.assert_close(d0, d, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g0, g, rtol=1e-4, atol=1e-5)


def test_a_secret_seed_is_rank_0s_on_every_rank(two_ranks):
    """make_private without a seed draws a secret one (privgrad.seeds): rank 0's, broadcast,
    so both ranks draw the same batches and noise and take the same steps; two runs draw
    two seeds, and differ."""
    a0, b0 = two_ranks[0]["secret seed"]
    a1, b1 = two_ranks[1]["secret seed"]
    assert torch.equal(a0, a1) and torch.equal(b0, b1) and not torch.equal(a0, b0)


def test_rank_check_fails_loudly_on_every_rank_when_parameters_differ(two_ranks):
    for r in two_ranks:
        assert (
            r["disagreement"]
            == "ranks disagree after step 2: the parameters of rank(s) 1 differ from rank 0's"
        )


def test_ranks_whose_models_start_apart_are_refused_on_every_rank(two_ranks):
    """An own loop under torchrun without a common seed built a model per rank from its own
    random initialisation; attach took them, every rank applied the same updates to its own
    model, and the ranks ended with different models (rank 0's saved), without a word."""
    for r in two_ranks:
        assert r["different start"].startswith(
            "the model's parameters on rank(s) 1 differ from rank 0's before training"
        )
        assert "torch.manual_seed" in r["different start"]
        assert r["lazy start"] is None  # a lazy layer's parameters: nothing to compare yet


# --------------------------------------------------------------------------- failures and the CLI


def crash_rank_1(group, db):
    """Rank 1 dies at its third step; rank 0 runs ``privgrad train`` with a run store."""
    import privgrad.app.train
    from privgrad.app.data.base import DatasetSplits
    from privgrad.private import PrivateTrainer

    step = PrivateTrainer._step
    g = torch.Generator().manual_seed(0)
    tiny = DatasetSplits(
        torch.randn(200, 1, 28, 28, generator=g),
        torch.randint(0, 10, (200,), generator=g),
        torch.randn(20, 1, 28, 28, generator=g),
        torch.randint(0, 10, (20,), generator=g),
        10,
        "tiny",
    )
    privgrad.app.train.load_dataset = lambda *args: tiny

    def failing(self, x, y):
        if group.rank == 1 and self.steps == 2:
            os._exit(3)
        return step(self, x, y)

    PrivateTrainer._step = failing
    store = RunStore(db) if group.is_main else None
    config = TrainConfig(
        dataset="mnist", limit_train=200, batch_size=50, epochs=2, noise_multiplier=1.0
    )
    try:
        train(config, store, progress=False, distributed=group)
    except PrivgradError as err:
        return {"error": str(err), "runs": store.runs() if store else None}
    return None


def test_a_dead_rank_stops_the_others_and_the_run_is_failed(tmp_path):
    codes, results = run_ranks(
        functools.partial(crash_rank_1, db=str(tmp_path / "runs.db")), tmp_path, timeout=120
    )
    assert codes == [0, 3]
    assert "rank 0: the process group failed" in results[0]["error"]
    (run,) = results[0]["runs"]
    assert run["status"] == "failed" and run["record"] is None


def _threads_after_the_group(rank, world, port, out):
    """Trains 3 steps in the group (building the optimizer imports torch._dynamo, which
    imports torch.distributed.nn.functional), then records this rank's threads once the group
    is destroyed."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with process_group() as group:
        train_steps(group)
    names = sorted(
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
    )
    torch.save(names, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_no_gloo_thread_outlives_the_group(tmp_path):
    """The cause of a rank's rare abort at exit ("terminate called without an active
    exception"): a group kept alive past destroy_process_group (torch.distributed.nn.functional,
    first imported inside it, binds group.WORLD as default arguments), so gloo's threads live on
    into interpreter finalization, where one releasing a tensor is killed in a noexcept
    destructor. After the group, only the main thread may be left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    procs = [
        ctx.Process(target=_threads_after_the_group, args=(r, 2, port, str(tmp_path)))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]
    for r in range(2):
        names = torch.load(tmp_path / f"rank{r}.pt")
        assert not [n for n in names if "gloo" in n], names


def test_wait_released_outlasts_a_late_release():
    """A collective's tensor is handed back only when no other thread holds it: here a view
    (which holds its base, as a backend's work item does) released 50 ms later."""
    t = torch.zeros(8)
    held = [t._use_count()]
    hold = [t.view(2, 4)]
    assert t._use_count() > held[0]
    release = threading.Timer(0.05, hold.clear)
    start = time.monotonic()
    release.start()
    wait_released([t], held)
    waited = time.monotonic() - start
    release.join()
    assert t._use_count() == held[0] and waited >= 0.05


def test_cli_nproc_2_matches_one_process(tmp_path):
    args = [
        "train",
        "--limit-train",
        "300",
        "--validation",
        "50",
        "--batch-size",
        "64",
        "--epochs",
        "1",
        "--noise-multiplier",
        "1",
        "--seed",
        "0",
        "--quiet",
        "--json",
        "--db",
        str(tmp_path / "runs.db"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [sys.executable, "-m", "privgrad", *args, "--nproc", "2", "--check-ranks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr
    record = json.loads(two.stdout.strip().splitlines()[-1])
    one = train(
        TrainConfig(
            limit_train=300, validation=50, batch_size=64, epochs=1, noise_multiplier=1.0, seed=0
        ),
        progress=False,
    )
    assert record["world_size"] == 2 and record["backend"] == "gloo" and one["world_size"] == 1
    for key in ("epsilon", "epsilon_rdp", "noise_multiplier", "sampling_rate", "steps"):
        assert record[key] == one[key]
    assert math.isclose(record["validation_accuracy"], one["validation_accuracy"], abs_tol=0.02)
    runs = RunStore(tmp_path / "runs.db").runs()
    assert [r["status"] for r in runs] == ["completed"]  # one writer: rank 0
