"""In-process A/B of SpectralNoise's unit draw (spectral_noise_ab.md): the one draw for every
tensor of cef45ec (``standard_gaussian``) against the per-tensor ``randn`` + ``torch.complex``
draw it replaced (b18a184's ``SpectralNoise.standard_noise``/``__call__``, copied below), each
mechanism's step built by ``benchmarks/step_time.py`` on the same model, weights and batch,
timed in interleaved rounds (CPU time), one thread. Run from the repository root:

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python results/bench/spectral_noise_ab.py
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_time  # noqa: E402

from privgrad.mechanisms.spectral import SpectralNoise  # noqa: E402
from privgrad.mechanisms.stages import GaussianNoise  # noqa: E402

SETTINGS = [("lenet5", 256), ("model1", 256), ("model3-gn", 64)]
MECHANISMS = ("spectral-dp", "gredp")


def per_tensor_noise(like, generator):
    """b18a184's draw: one randn per tensor, two and a torch.complex for a complex one."""
    real = like.real.dtype if like.is_complex() else like.dtype
    z = torch.randn(like.shape, generator=generator, dtype=real, device=like.device)
    if like.is_complex():
        imag = torch.randn(like.shape, generator=generator, dtype=real, device=like.device)
        z = torch.complex(z, imag)
    return z


def per_tensor_step(stage, state):
    std = stage.std(state.noise_scale)
    state.grads = [g + std * per_tensor_noise(g, state.generator) for g in state.grads]
    state.noise.append(stage.record(std, state.sensitivity))
    return state


def main():
    torch.set_num_threads(1)
    old = {"on": False}
    SpectralNoise.__call__ = lambda self, state: (
        per_tensor_step if old["on"] else GaussianNoise.__call__
    )(self, state)
    cpu_device = torch.device("cpu")
    for model, batch in SETTINGS:
        spec = step_time.MODELS[model]
        x, y = spec.data(batch, torch.Generator().manual_seed(0))
        calls = {"non-private": step_time.make_contender("non-private", spec, x, y, cpu_device)}
        for mech in MECHANISMS:
            for per_tensor in (False, True):
                step = step_time.make_contender(mech, spec, x, y, cpu_device)

                def call(step=step, per_tensor=per_tensor):
                    old["on"] = per_tensor
                    step()

                calls[mech + ("-per-tensor" if per_tensor else "")] = call
        for call in calls.values():
            call()
            call()
        cpu, _ = step_time.interleaved_rounds(calls, rounds=7, per_round=3)
        base = statistics.median(cpu["non-private"])
        for name, times in cpu.items():
            ms = statistics.median(times) * 1e3
            print(f"{model} B={batch} {name}: {ms:.1f} ms, {ms / 1e3 / base:.2f}x non-private")
        for mech in MECHANISMS:
            ratio = statistics.median(a / b for a, b in zip(cpu[mech], cpu[mech + "-per-tensor"]))
            print(f"{model} B={batch} {mech}: one draw / per-tensor, median of rounds {ratio:.3f}")


if __name__ == "__main__":
    main()
