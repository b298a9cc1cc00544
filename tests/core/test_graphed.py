"""The captured step (``EngineFlags(cuda_graphs=True)``, privgrad/graphed.py), run eagerly on
CPU: Poisson batches padded to a bucket give the unpadded step (float tolerance) with the
identical ledger; a non-finite example sends the step to the eager path, which drops it as
before; a chain that is not graph-safe runs eagerly with one warning; the padded step reads
nothing back to the host before its end (what capture requires). Where a GPU is present
(benchmarks/gpu_session.sh) the cases taking ``device`` also run captured, on CUDA."""

import copy
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import privgrad
from privgrad.mechanisms import Mechanism
from privgrad.mechanisms.stages import (
    ClipPerLayer,
    GaussianNoise,
    StepState,
    Sum,
    capabilities_of,
)
from privgrad.per_sample import EngineFlags
from test_microbatch import conv_net, data  # tests/core: the same batches and model

# Padding adds exact zeros to the clipped sum and changes only the order of its float32
# additions (a relative error of about 1e-7 each); the noise is the same draw. Three steps of
# lr 0.5 keep the parameters (of order 0.1-1) within 1e-6 of each other; a padded row counted
# once (an error of order lr·C/B ~ 1e-2) or a different noise draw fails by far.
RTOL, ATOL = 1e-5, 1e-6


def run(flags=None, mechanism="dpsgd", steps=3, x_y=None, device="cpu", after_step=None, **options):
    """(parameters after ``steps`` steps, trainer, the drawn batches' sizes); ``after_step()``
    runs after each step."""
    model = conv_net().to(device)
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        x_y or data(),
        mechanism=mechanism,
        noise_multiplier=0.0 if mechanism == "non-private" else 1.0,  # it adds no noise
        batch_size=40,
        seed=3,
        flags=flags,
        **options,
    )
    sizes = []
    for batch in private.batches(steps):
        sizes.append(len(batch.y))
        private.step(batch)
        if after_step is not None:
            after_step()
    return [p.detach().clone() for p in model.parameters()], private, sizes


GRAPHED = EngineFlags(cuda_graphs=True, graph_bucket=16)


def assert_same_run(eager, graphed):
    (a, pa, _), (b, pb, _) = eager, graphed
    for u, v in zip(a, b):
        torch.testing.assert_close(v, u, rtol=RTOL, atol=ATOL)
    assert pb.ledger.entries == pa.ledger.entries
    assert pb.claimed_ledger.entries == pa.claimed_ledger.entries
    assert pb.epsilon() == pa.epsilon()
    assert pb.nonfinite_examples == pa.nonfinite_examples
    assert torch.equal(pb.noise_generator.get_state(), pa.noise_generator.get_state())


@pytest.mark.parametrize("mechanism", ["dpsgd", "dp-signsgd", "non-private"])
def test_padded_steps_equal_the_eager_steps_with_the_identical_ledger(
    mechanism, device, float32_convolutions
):
    eager, graphed = run(None, mechanism, device=device), run(GRAPHED, mechanism, device=device)
    assert_same_run(eager, graphed)
    sizes, padded = graphed[2], graphed[1]._graphed._padded
    assert all(n % 16 for n in sizes)  # every batch of this run was padded
    assert sorted(key[0] for key in padded) == sorted({-(-n // 16) * 16 for n in sizes})
    # on CUDA each size was captured once and replayed: fresh noise at every replay is what
    # makes the parameters match the eager run's three draws
    assert all((step.graph is not None) == (device == "cuda") for step in padded.values())


def test_per_layer_clipping_pads_too():
    def per_layer():
        return Mechanism("per-layer", [ClipPerLayer(1.0), Sum(), GaussianNoise(1.0)])

    assert_same_run(run(None, per_layer()), run(GRAPHED, per_layer()))


def test_a_non_finite_example_is_dropped_as_in_the_eager_step(device, float32_convolutions):
    x, y = data()
    x[5] = float("nan")
    eager = run(None, x_y=(x, y), device=device)
    graphed = run(GRAPHED, x_y=(x, y), device=device)
    assert graphed[1].nonfinite_examples > 0  # example 5 was drawn
    assert_same_run(eager, graphed)
    with pytest.raises(privgrad.PrivgradError, match="not finite"):
        run(GRAPHED, x_y=(x, y), strict=True)


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(device, float32_convolutions):
    """Trust checklist 16 for the captured step: two steps, a checkpoint loaded into a fresh
    trainer (which captures its graphs anew from the restored noise generator), two more
    steps: the parameters, the generator and both ledgers are those of four steps in a row."""
    whole = run(GRAPHED, steps=4, device=device)
    _, first, _ = run(GRAPHED, steps=2, device=device)
    _, resumed, _ = run(GRAPHED, steps=0, device=device)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for batch in resumed.batches(2):
        resumed.step(batch)
    for a, b in zip(whole[0], resumed.model.parameters()):
        assert torch.equal(a, b.detach())
    assert resumed.ledger.entries == whole[1].ledger.entries
    assert resumed.claimed_ledger.entries == whole[1].claimed_ledger.entries
    assert torch.equal(resumed.noise_generator.get_state(), whole[1].noise_generator.get_state())


def test_at_most_graph_cache_captured_steps_are_kept_the_least_recently_used_dropped(
    device, float32_convolutions
):
    """Batches of several padded sizes keep only ``graph_cache`` captured steps, those
    replayed last; the updates are the eager ones, and churning through shapes warns once."""
    flags = EngineFlags(cuda_graphs=True, graph_bucket=4, graph_cache=2)
    eager = run(None, steps=8, device=device)
    with pytest.warns(UserWarning, match="captured steps dropped for new batch shapes") as seen:
        graphed = run(flags, steps=8, device=device)
    assert len(seen) == 1
    assert_same_run(eager, graphed)

    def cache(recent_first: bool):
        """(sizes kept, oldest first; how many dropped) by a cache of 2 that moves a replayed
        size to the end (least recently used) or not (first in, first out)."""
        kept, dropped = [], 0
        for n in graphed[2]:
            size = -(-n // 4) * 4
            if size in kept:
                if recent_first:
                    kept.remove(size)
                    kept.append(size)
                continue
            if len(kept) == 2:
                kept.pop(0)
                dropped += 1
            kept.append(size)
        return kept, dropped

    assert cache(True) != cache(False)  # the draws tell the two apart
    steps = graphed[1]._graphed
    assert ([key[0] for key in steps._padded], steps.dropped) == cache(True)


def test_the_kept_steps_stay_right_when_dropped_steps_memory_is_reused(
    device, float32_convolutions
):
    """A dropped captured step frees its memory pool; the steps kept must use none of it.
    torch's cuBLAS workspace, one per (handle, stream) and first made inside a capture, was
    shared by every graph captured after it (PyTorch issue 193402; graphed.py clears it before
    each capture). After every step the freed memory is handed to a tensor of NaNs; the run
    must still be the eager one, step for step."""

    def reuse_freed_memory():
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the dropped pools' memory back to the device
            junk = torch.full((1 << 26,), float("nan"), device=device)  # 256 MB reuse it
            del junk

    flags = EngineFlags(cuda_graphs=True, graph_bucket=4, graph_cache=2)
    eager = run(None, steps=8, device=device)
    with pytest.warns(UserWarning, match="captured steps dropped"):
        graphed = run(flags, steps=8, device=device, after_step=reuse_freed_memory)
    assert graphed[1]._graphed.dropped >= 2
    assert_same_run(eager, graphed)


def test_a_chain_that_is_not_graph_safe_runs_eagerly_with_one_warning():
    options = {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}
    eager = run(None, "gip", **options)
    with pytest.warns(UserWarning, match="steps run eagerly: .*not declared graph_safe") as seen:
        graphed = run(GRAPHED, "gip", **options)
    assert len(seen) == 1
    assert graphed[1]._graphed is None
    for u, v in zip(eager[0], graphed[0]):
        assert torch.equal(u, v)


def test_a_subclass_with_its_own_step_is_not_graph_safe():
    class Louder(GaussianNoise):
        def __call__(self, state):
            return super().__call__(state)

    assert capabilities_of(GaussianNoise(1.0)).graph_safe
    assert not capabilities_of(Louder(1.0)).graph_safe


def test_a_model_holding_a_plain_tensor_is_captured_and_one_the_loop_writes_is_refused(
    device, float32_convolutions
):
    """The watch on a model's plain tensor attributes (PrivateTrainer._watch_plain_tensors)
    stays out of the captured forward, where its comparison would read back to the host (on
    CUDA a capture error), and still refuses a tensor the loop writes between replays."""

    def trainer(flags):
        model = conv_net().to(device)
        model.offset = torch.zeros(3, device=device)  # neither a parameter nor a buffer
        private = privgrad.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
            data(),
            noise_multiplier=1.0,
            batch_size=40,
            seed=3,
            flags=flags,
        )
        return model, private

    (eager_model, eager), (model, graphed) = trainer(None), trainer(GRAPHED)
    for private in (eager, graphed):
        for batch in private.batches(2):
            private.step(batch)
    for a, b in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    model.offset = model.offset + 1.0  # a memory bank the loop sets between steps
    with pytest.raises(privgrad.PrivgradError, match="offset"):
        for batch in graphed.batches(1):
            graphed.step(batch)


class _HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host (``bool()``,
    ``.item()``), which a CUDA graph cannot capture."""

    READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_the_padded_step_reads_nothing_back_before_its_end():
    _, private, _ = run(GRAPHED, steps=1)
    (padded,) = private._graphed._padded.values()
    with _HostReads() as mode:
        outputs = padded._body()
    assert mode.reads == [] and outputs[-1] is not None  # the finite mark, still on device
    # the detector catches the eager chain's check (bool of the mark)
    per_sample, _ = private.grad_sampler.compute(padded.x, padded.y, private.loss_fn)
    state = StepState(per_sample, 40.0, private.noise_generator)
    with _HostReads() as mode:
        private.mechanism.run(state)
    assert mode.reads


def test_cli_cuda_graphs_trains_on_cuda_with_the_same_epsilon_and_is_refused_elsewhere(
    tmp_path, device
):
    """``privgrad train --cuda-graphs``: on CUDA the run's ε and steps are those of the run
    without it, and the record says it was on; on the CPU it is a clear error before any
    work."""
    from cli_helpers import run_cli

    def train(*extra):
        code, out, err = run_cli(
            "train",
            "--device",
            device,
            "--limit-train",
            "300",
            "--epochs",
            "1",
            "--batch-size",
            "50",
            "--epsilon",
            "2",
            "--json",
            "--quiet",
            "--db",
            str(tmp_path / f"runs{len(extra)}.db"),
            *extra,
        )
        return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else err)

    code, graphed = train("--cuda-graphs")
    if device != "cuda":
        assert code != 0 and "--cuda-graphs needs a CUDA device" in graphed
        return
    assert code == 0, graphed
    code, eager = train()
    assert code == 0, eager
    assert (graphed["cuda_graphs"], eager["cuda_graphs"]) == (True, False)
    assert graphed["epsilon"] == eager["epsilon"] and graphed["steps"] == eager["steps"]
