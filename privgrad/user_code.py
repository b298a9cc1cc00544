"""The user's own code named on the command line or in the environment:
``python:module:attribute``, ``module`` imported from the current directory or ``sys.path``.
Shared by ``--model``/``--dataset`` (:mod:`privgrad.app.plugins`) and by mechanisms
registered from outside (:mod:`privgrad.mechanisms.registry`)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from privgrad.errors import PrivgradError

PREFIX = "python:"


def import_attribute(spec: str, what: str, noun: str) -> tuple[ModuleType, str, object]:
    """``(module, module name, attribute or None)`` of ``spec``; a malformed spec or a module
    that cannot be imported is a one-line :class:`PrivgradError` naming ``what``."""
    module_name, sep, name = spec[len(PREFIX) :].rpartition(":")
    if not spec.startswith(PREFIX) or not sep or not module_name or not name:
        raise PrivgradError(f"{what} '{spec}': write python:module:{noun}")
    here = os.getcwd()
    sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any error is reported, in one line
        raise PrivgradError(
            f"{what} '{spec}': cannot import {module_name}: {type(err).__name__}: {err}"
        ) from None
    finally:
        sys.path.remove(here)
    return module, module_name, getattr(module, name, None)
