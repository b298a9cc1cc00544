"""privgrad: differentially private deep learning, with honest privacy accounting.

Every mechanism reports ε from a proven accountant (dp-accounting) at its *effective*
noise multiplier, and, where a paper's own analysis would print a different figure,
that figure labelled as claimed.

``make_private`` and ``PrivateTrainer`` are imported on first use, so that ``import
privgrad.app.cli`` (and ``privgrad --help``) does not wait for torch and dp-accounting.
"""

__version__ = "0.1.0"

from privgrad.errors import DataError, PrivgradError  # noqa: E402

__all__ = ["make_private", "PrivateTrainer", "attach", "PrivgradError", "DataError", "__version__"]


def __getattr__(name: str):
    if name in ("make_private", "PrivateTrainer"):
        from privgrad import private

        return getattr(private, name)
    if name == "attach":
        from privgrad.own_loop import attach

        return attach
    raise AttributeError(f"module 'privgrad' has no attribute {name!r}")
