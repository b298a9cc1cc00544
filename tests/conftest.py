import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def device(request):
    """Every device present: a test taking ``device`` runs on the CPU and, where a GPU is
    present (a GPU session runs these; CI has none), on CUDA too."""
    return request.param


@pytest.fixture
def float32_convolutions(monkeypatch):
    """cuDNN's convolutions default to TF32 (~1e-3 relative rounding): tests that compare
    computation paths to float32 tolerance on CUDA run them in float32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def empty_batch():
    """draw(trainer): the trainer's next batch, drawn by its own sampler, made empty (the
    Poisson draw with no example), as ``step`` takes only the trainer's own batches."""

    def draw(trainer):
        sample = trainer.sampler.sample
        trainer.sampler.sample = lambda: sample()[:0]
        try:
            return next(trainer.batches(1))
        finally:
            del trainer.sampler.sample

    return draw
