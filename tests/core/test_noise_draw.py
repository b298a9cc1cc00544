"""The Gaussian noise of a step drawn in one call for every tensor
(privgrad/mechanisms/stages.py: add_gaussian): the right scale, independent coordinates
across tensors, and one draw (the kernel count is the point of the fused form)."""

import math

import torch
from torch.overrides import TorchFunctionMode

from privgrad.mechanisms.stages import add_gaussian, divided


class CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_one_draw_of_the_right_scale_and_independent_across_tensors():
    shapes = [(300, 100), (100,), (50, 20, 10), (1,)]
    grads = [torch.full(s, 2.0) for s in shapes]
    with CountCalls() as calls:
        out = add_gaussian(grads, 3.0, torch.Generator().manual_seed(0))
    assert calls.names.count("randn") == 1
    assert [tuple(o.shape) for o in out] == shapes and all(o.dtype == torch.float32 for o in out)
    z = torch.cat([(o - 2.0).flatten() for o in out]) / 3.0
    n = z.numel()  # 40,101 draws: mean's sd 1/√n, the variance estimate's sd √(2/n)
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    # the first two tensors' noise is not the same stream reused (correlation's sd 1/√m)
    a, b = (out[0] - 2.0).flatten()[:10_000], (out[2] - 2.0).flatten()[:10_000]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 5 / math.sqrt(10_000)
    assert not torch.equal(out[0].flatten()[:100], out[2].flatten()[:100])


def test_tensors_of_different_dtypes_are_drawn_one_by_one_and_keep_their_dtype():
    grads = [torch.zeros(4), torch.zeros(3, dtype=torch.float64)]
    out = add_gaussian(grads, 1.0, torch.Generator().manual_seed(0))
    assert [o.dtype for o in out] == [torch.float32, torch.float64]
    assert all(o.abs().sum() > 0 for o in out)
    assert add_gaussian([], 1.0, torch.Generator()) == [] == divided([], 2.0)


def test_divided():
    out = divided([torch.full((2,), 6.0), torch.full((3, 1), 9.0)], 3.0)
    assert [o.tolist() for o in out] == [[2.0, 2.0], [[3.0], [3.0], [3.0]]]
