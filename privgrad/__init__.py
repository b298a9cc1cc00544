"""privgrad: differentially private deep learning, with honest privacy accounting.

Every mechanism reports ε from a proven accountant (dp-accounting) at its *effective*
noise multiplier, and, where a paper's own analysis would print a different figure,
that figure labelled as claimed.
"""
__version__ = "0.1.0"

from .errors import DataError, PrivgradError  # noqa: E402
from .private import PrivateTrainer, make_private  # noqa: E402

__all__ = ["make_private", "PrivateTrainer", "PrivgradError", "DataError", "__version__"]
