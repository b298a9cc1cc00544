"""Micro-batch checks on the accelerator (CPU when there is none, smaller): chunked steps equal
whole-batch ones (dpsgd, spectral-dp, gredp, gip; parameters allclose, ε identical), and a
step's peak extra memory against the chunk size (CUDA: torch.cuda's peak allocated bytes).

    python benchmarks/microbatch_check.py
"""

import time
import torch
import privgrad
from privgrad.app.models import build_model
from torch import nn

dev = "cuda" if torch.cuda.is_available() else "cpu"
small = dev == "cpu"
print("device", dev, torch.__version__, torch.cuda.get_device_name() if dev == "cuda" else "")


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(144, 3))


def run(chunk, mech, **opt):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(120, 1, 8, 8, generator=g), torch.randint(0, 3, (120,), generator=g)
    model = conv_net()
    p = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        (x, y),
        mechanism=mech,
        noise_multiplier=1.0,
        batch_size=40,
        seed=3,
        device=dev,
        max_physical_batch_size=chunk,
        **opt,
    )
    for b in p.batches(3):
        p.step(b)
    return [t.detach().cpu() for t in model.parameters()], p.epsilon()


for mech, opt in [
    ("dpsgd", {}),
    ("spectral-dp", {}),
    ("gredp", {}),
    ("gip", {"k_schedule": "constant", "k_end": 0.5, "group_size": 16}),
]:
    a, ea = run(None, mech, **opt)
    b, eb = run(7, mech, **opt)
    d = max(float((u - v).abs().max()) for u, v in zip(a, b))
    ok = all(torch.allclose(v, u, rtol=1e-5, atol=1e-6) for u, v in zip(a, b))
    print(f"{mech}: max|diff| {d:.3g} allclose {ok} eps equal {ea == eb} ({ea:.6g})")


class Gate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


def peak(model_fn, B, shape, chunk, classes=2):
    torch.manual_seed(0)
    x, y = torch.randn(B, *shape), torch.randint(0, classes, (B,))
    model = model_fn()
    p = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        batch_size=B,
        noise_multiplier=1.0,
        device=dev,
        epochs=3,
    )
    out = []
    for i, batch in enumerate(p.batches(3)):
        p.max_physical_batch_size = chunk
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if dev == "cuda" else 0
        t = time.perf_counter()
        p.step(batch)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        extra = (torch.cuda.max_memory_allocated() - before) if dev == "cuda" else 0
        out.append((extra / 2**20, dt))
    return out[-1]  # after warm-up


B, D = (256, 4096) if small else (4096, 65536)
for chunk in [None, 1024, 256]:
    mb, dt = peak(lambda: nn.Sequential(Gate(D), nn.Linear(D, 2)), B, (D,), chunk)
    print(f"gate B={B} D={D} chunk={chunk}: step peak +{mb:.0f} MiB, {dt * 1e3:.0f} ms")

B = 256 if small else 8192
for chunk in [None, 2048, 512]:
    mb, dt = peak(lambda: build_model("cnn", (1, 28, 28), 10), B, (1, 28, 28), chunk, 10)
    print(f"mnist cnn B={B} chunk={chunk}: step peak +{mb:.0f} MiB, {dt * 1e3:.0f} ms")
