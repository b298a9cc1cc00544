"""Where a run computes: ``cpu``, ``cuda`` (``cuda:N``) or ``auto`` (CUDA when available)."""

from __future__ import annotations

import torch

from privgrad.errors import PrivgradError


def resolve_device(spec: str | torch.device) -> torch.device:
    """The torch device for ``spec``; a clear error if it names a device torch cannot use."""
    if isinstance(spec, str) and spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise PrivgradError(f"unknown device '{spec}'; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PrivgradError(
            f"device '{spec}' asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
            "use --device cpu or auto"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise PrivgradError(
            f"device '{spec}': only {torch.cuda.device_count()} CUDA device(s) here"
        )
    if device.type not in ("cpu", "cuda"):
        raise PrivgradError(f"device '{spec}' is not supported; use cpu, cuda, cuda:N or auto")
    return device
