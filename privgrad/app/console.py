"""Status lines for a person watching a command: what it is doing before its progress bar.

They go to stderr only when stderr is a terminal, so that piped output, logs and the
one-line ``error: ...`` of a failed command stay as they are.
"""

from __future__ import annotations

import sys


def interactive() -> bool:
    return sys.stderr.isatty()


def status(message: str) -> None:
    """Prints ``message`` on stderr if a person is watching."""
    if interactive():
        print(message, file=sys.stderr, flush=True)
