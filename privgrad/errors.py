"""Errors a user can cause and fix; the CLI prints them as one line, without a traceback.
Warnings for the user point at their own line (:func:`warn_user`)."""

import os
import sys
import warnings


class PrivgradError(Exception):
    """Invalid input or configuration: the message says what is wrong and how to fix it."""


class DataError(PrivgradError):
    """A dataset file is missing or corrupt."""


class PlanDeclined(PrivgradError):
    """The user declined a run's plan before its first step; the run store marks it
    ``declined``, not ``failed``."""


def warn_user(message: str) -> None:
    """``warnings.warn(message)`` attributed to the first caller outside privgrad (the user's
    ``make_private`` or ``attach`` line, however deep inside privgrad it is raised)."""
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2  # stacklevel 1 is this function
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
