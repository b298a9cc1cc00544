"""One guard for the tests of the fused norm kernels (privgrad/per_sample/fused.py)."""

import pytest
import torch

from privgrad.per_sample import fused


def skip_unless_fused_runs(device: str = "cpu") -> None:
    """Skips the calling test where the fused kernels cannot run on ``device``: they take CPU
    tensors only in Triton's interpreter, which tests/conftest.py turns on only where there is
    no CUDA (so on a GPU machine the CPU cases of a fused test are skipped, its CUDA ones run)."""
    if not fused.runs_on(torch.device(device)):
        pytest.skip("the fused kernels run on CPU only in Triton's interpreter (off: CUDA here)")
