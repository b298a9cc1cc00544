"""Errors a user can cause and fix; the CLI prints them as one line, without a traceback."""


class PrivgradError(Exception):
    """Invalid input or configuration: the message says what is wrong and how to fix it."""


class DataError(PrivgradError):
    """A dataset file is missing or corrupt."""


class PlanDeclined(PrivgradError):
    """The user declined a run's plan before its first step; the run store marks it
    ``declined``, not ``failed``."""
