"""The Gaussian noise of a step drawn in one call for every tensor
(privgrad/mechanisms/stages.py: standard_gaussian, used by GaussianNoise and SpectralNoise):
unit scale on every real coordinate (the real and imaginary parts of a complex tensor each),
independent coordinates across tensors and parts, and one draw (the kernel count is the
point of the fused form)."""

import math
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from privgrad.mechanisms.stages import GaussianNoise, add_scaled, divided, standard_gaussian


class CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def unit_and_uncorrelated(z: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """z: all draws (mean 0, variance 1: sd 1/√n and √(2/n)); a, b: two equal-length runs of
    them that must not be correlated (sd 1/√m) nor the same stream reused."""
    n, m = z.numel(), a.numel()
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 5 / math.sqrt(m)
    assert not torch.equal(a[:100], b[:100])


def test_one_draw_of_unit_scale_and_independent_across_tensors():
    shapes = [(300, 100), (100,), (50, 20, 10), (1,)]
    like = [torch.full(s, 2.0) for s in shapes]
    with CountCalls() as calls:
        z = standard_gaussian(like, torch.Generator().manual_seed(0))
    assert calls.names.count("randn") == 1
    assert [tuple(t.shape) for t in z] == shapes and all(t.dtype == torch.float32 for t in z)
    unit_and_uncorrelated(  # 40,101 draws; the first and third tensors' first 10,000
        torch.cat([t.flatten() for t in z]), z[0].flatten()[:10_000], z[2].flatten()[:10_000]
    )


def test_complex_tensors_get_unit_real_and_imaginary_parts_from_the_same_one_draw():
    """Re and Im each N(0, 1) (not CN(0, 1), whose parts have variance 1/2), independent of
    each other; a real tensor of odd size before a complex one leaves its view aligned."""
    like = [torch.zeros(3), torch.zeros(100, 101, dtype=torch.complex64), torch.zeros(7)]
    with CountCalls() as calls:
        z = standard_gaussian(like, torch.Generator().manual_seed(1))
    assert calls.names.count("randn") == 1
    assert [t.dtype for t in z] == [torch.float32, torch.complex64, torch.float32]
    assert [t.shape for t in z] == [t.shape for t in like]
    re, im = z[1].real.flatten(), z[1].imag.flatten()
    unit_and_uncorrelated(re, re, im)
    unit_and_uncorrelated(im, re, im)


def test_the_stage_adds_std_times_the_draw_and_records_it():
    grads = [torch.full((40_000,), 2.0), torch.zeros(30_000, dtype=torch.complex64)]
    state = SimpleNamespace(
        grads=grads, noise_scale=2.0, sensitivity=2.0, noise=[], generator=torch.Generator()
    )
    out = GaussianNoise(1.5)(state)
    z = torch.cat([(out.grads[0] - 2.0), torch.view_as_real(out.grads[1]).flatten()]) / 3.0
    unit_and_uncorrelated(z, z[:30_000], z[40_000:70_000])
    assert out.noise[0].effective == 1.5
    assert out.grads[0] is not grads[0]  # a new tensor, the sum left as it was


def test_tensors_of_different_dtypes_are_drawn_one_by_one_and_keep_their_dtype():
    like = [
        torch.zeros(4),
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(2, dtype=torch.cdouble),
    ]
    z = standard_gaussian(like, torch.Generator().manual_seed(0))
    assert [t.dtype for t in z] == [torch.float32, torch.float64, torch.complex128]
    assert all(t.abs().sum() > 0 for t in z) and z[2].imag.abs().sum() > 0
    assert standard_gaussian([], torch.Generator()) == [] == add_scaled([], [], 1.0)
    assert divided([], 2.0) == []


def test_divided():
    out = divided([torch.full((2,), 6.0), torch.full((3, 1), 9.0)], 3.0)
    assert [o.tolist() for o in out] == [[2.0, 2.0], [[3.0], [3.0], [3.0]]]
