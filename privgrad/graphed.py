"""The private step replayed as a CUDA graph (``EngineFlags(cuda_graphs=True)``).

A private step of a small model on a GPU is bound by kernel launches: the forward, the
backward, every layer's norm rule, the clip, the sum and the noise each launch their own
kernels, hundreds per step, and the GPU waits on the host between them. Captured once in a
CUDA graph, they replay in one launch. Three things make the step capturable without
changing what it computes:

- **Static shapes.** A Poisson batch of n examples is written into buffers of
  P = ⌈n / ``graph_bucket``⌉ · ``graph_bucket`` rows; the rows past n are copies of its first
  example whose per-sample loss is multiplied by 0. Their per-sample gradients are exactly
  zero (a finite gradient times 0), so they add nothing to the clipped sum (a weight of at most
  1 on a zero gradient), and since no example's output depends on another's (``make_private``
  refuses a model that mixes examples), the real rows' gradients are unchanged: the sum, its
  sensitivity C and the noise are those of the n examples.
- **No host read inside.** The clipping stage marks the examples whose squared norm is not
  finite (:meth:`~privgrad.mechanisms.stages.StepState.check_finite`) instead of raising. The
  mark is read after the replay: if any row (padding included) is not finite, the replay's
  update is discarded before anything sees it, the noise generator is restored, and the step
  runs eagerly, which drops those examples as it always does.
- **The noise generator registered with the graph.** Each replay draws its Gaussian noise from
  the trainer's generator at its current state and advances it, as the eager step does.

The optimizer's step stays eager (learning-rate schedules and any optimizer work as before).
The noise records and facts are those the chain reported when it was captured, so only chains
whose stages are all declared ``graph_safe`` are captured (same records at every step, no
state): DP-SGD's. Off CUDA the same padded step runs eagerly (what the CPU tests check).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from privgrad.inputs import empty_rows, example_shape, rows, write_padded
from privgrad.mechanisms.stages import StepState, capabilities_of


def why_not_graphed(trainer) -> str | None:
    """Why ``trainer``'s steps cannot run as captured graphs, or None when they can."""
    stages = [s for s in trainer.mechanism.stages if not capabilities_of(s).graph_safe]
    if stages:
        return f"the mechanism's stage {type(stages[0]).__name__} is not declared graph_safe"
    if trainer.distributed is not None:
        return "data-parallel sums are all-reduced inside the chain"
    if trainer.grad_sampler.shared.sites:
        return (
            "a table the batch shares (T5's relative-attention bias, or the own parameters "
            "of a layer without a rule) is not captured"
        )
    if trainer.grad_sampler.precision != "fp32":
        return f"precision {trainer.grad_sampler.precision} (autocast) is not captured"
    return None


class GraphedSteps:
    """One trainer's captured steps, one per padded batch size and example shape, the
    ``graph_cache`` most recently replayed kept; all dropped and captured again when what they
    baked in changes (engine flags, the parameters' storage, the noise record)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._padded: OrderedDict[tuple, _PaddedStep] = OrderedDict()
        self._baked = None
        self.dropped = 0  # captured steps dropped for others (warned once at graph_cache)

    def run(self, x, y: torch.Tensor):
        """``(params, losses, grads, records, facts)`` of the private step on ``(x, y)``, or
        None when some per-sample gradient is not finite (the noise generator has then been
        advanced: the caller restores it)."""
        t = self.trainer
        baked = (
            t.grad_sampler.flags,
            tuple(p.data_ptr() for p in t.model.parameters()),
            t.mechanism.noise_record(t.n_layers, t.sampler.expected_batch_size),
        )
        if baked != self._baked:
            self._padded.clear()
            self._baked = baked
        n, flags = rows(x), t.grad_sampler.flags
        size = -(-n // flags.graph_bucket) * flags.graph_bucket
        key = (size, repr(example_shape(x)), tuple(y.shape[1:]))
        if key in self._padded:
            self._padded.move_to_end(key)
        else:
            while len(self._padded) >= flags.graph_cache:
                self._padded.popitem(last=False)
                self.dropped += 1
                if self.dropped == flags.graph_cache:
                    warnings.warn(
                        f"cuda_graphs: {self.dropped} captured steps dropped for new batch "
                        f"shapes (graph_cache {flags.graph_cache}); inputs of varying shape "
                        "are captured again and again: pad them to a few fixed lengths, raise "
                        "graph_cache or graph_bucket, or turn cuda_graphs off",
                        stacklevel=5,
                    )
            self._padded[key] = _PaddedStep(t, x, y, size)
        return self._padded[key].run(x, y, n)


def _own_cublas_workspace() -> None:
    """Makes the next capture allocate its own cuBLAS workspaces, in its own memory pool.

    cuBLAS keeps one workspace per (handle, stream), made on first use. Every capture runs on
    torch's one capture stream, so without this a capture bakes in the workspace that the
    first capture allocated in *its* graph's pool; dropping that graph (``graph_cache``, or
    another trainer's graphs freed) frees the memory the others still use, and their GEMMs
    then read whatever reuses it (PyTorch issue 193402; a captured step on an H200 ended far
    from the eager one, results/bench/README.md, fifth GPU run). Cleared here, the capture
    allocates a workspace in its own pool, which lives exactly as long as its graph; eager
    work allocates its workspaces again on next use."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # a CUDA build of torch has it
        clear()


class _PaddedStep:
    """The step on batches padded to ``size`` rows: static buffers and, on CUDA, its graph."""

    def __init__(self, trainer, x, y: torch.Tensor, size: int):
        self.trainer = trainer
        self.x, self.y = empty_rows(x, size), empty_rows(y, size)
        self.weight = torch.empty(size, device=trainer.device)  # 1: an example, 0: padding
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None

    def _body(self):
        t = self.trainer

        def loss_fn(out, y):
            return t.loss_fn(out, y) * self.weight

        per_sample, losses = t.grad_sampler.compute(self.x, self.y, loss_fn)
        state = StepState(
            per_sample, t.sampler.expected_batch_size, t.noise_generator, raise_nonfinite=False
        )
        state = t.mechanism.run(state)
        bad = None if state.nonfinite is None else state.nonfinite.any()
        return per_sample.params, losses, state.grads, state.noise, state.facts(), bad

    def _capture(self) -> None:
        generator = self.trainer.noise_generator
        before = generator.get_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation, kernel compiles
            self._body()
        torch.cuda.current_stream().wait_stream(side)
        _own_cublas_workspace()
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(generator)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.outputs = self._body()
        generator.set_state(before)  # the warm-up's draw undone; each replay draws afresh
        self.graph = graph

    def run(self, x, y: torch.Tensor, n: int):
        write_padded(self.x, x)
        write_padded(self.y, y)
        self.weight[:n].fill_(1.0)
        self.weight[n:].fill_(0.0)
        if self.trainer.device.type == "cuda":
            if self.graph is None:
                self._capture()
            self.graph.replay()
            params, losses, grads, records, facts, bad = self.outputs
        else:
            params, losses, grads, records, facts, bad = self._body()
        if bad is not None and bool(bad):
            return None
        return params, losses[:n], grads, records, facts
