"""Where mechanisms are declared and found, without importing torch.

A mechanism is declared in one file by a :class:`MechanismSpec`: its name, a frozen
dataclass of its options (type, range and help per field, written with :func:`option`),
the training defaults of ``privgrad train``, its paper and a ``build`` function that
returns the :class:`~privgrad.mechanisms.base.Mechanism`. The command line's flags, the
defaults table of ``privgrad train --help``, :mod:`privgrad.app.defaults` and the option
ranges of :mod:`privgrad.validate` are generated from the specs registered here.

Built-in specs live in :mod:`privgrad.mechanisms.catalog` (one file each). A mechanism
outside the package is registered with :func:`register_mechanism`, or named in the
environment variable ``PRIVGRAD_MECHANISMS`` as ``python:module:attribute`` (comma
separated; the attribute is a spec or a function returning one), which the command line,
the audits and the benchmarks read when they first look a mechanism up.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from privgrad.errors import PrivgradError
from privgrad.user_code import PREFIX, import_attribute

DEFAULT_EPSILON = 1.0
PLUGIN_ENV = "PRIVGRAD_MECHANISMS"
# the built-in mechanisms, in the order the help lists them (privgrad/mechanisms/catalog/)
BUILTIN = (
    "non_private",
    "dpsgd",
    "dp_adam",
    "dp_signsgd",
    "dp_signadam",
    "spectral_dp",
    "gredp",
    "gip",
    "random_k",
)


def option(default, help: str, *, range=None, flag: str | None = None, cli: bool = True):
    """A field of a mechanism's options dataclass: its default, one line of help, the
    :class:`privgrad.validate.Range` of a number, the command-line flag when it is not
    ``--name-with-dashes``, and ``cli=False`` for an option the API alone sets."""
    return field(default=default, metadata={"help": help, "range": range, "flag": flag, "cli": cli})


@dataclass(frozen=True)
class NoOptions:
    """The options of a mechanism that has none."""


@dataclass(frozen=True)
class OptionInfo:
    """One option as the command line sees it."""

    name: str
    type: type  # int, float or str
    default: Any
    help: str
    range: Any  # privgrad.validate.Range or None
    flag: str
    cli: bool


@dataclass(frozen=True)
class Defaults:
    """The values ``privgrad train`` uses when an option is not given."""

    lr: float
    optimizer: str  # the mechanism's own optimizer (shown; the mechanism sets it)
    momentum: float  # SGD momentum (unused by adam)
    clip: float | None  # L2 clipping norm C; None: the mechanism does not clip
    epsilon: float | None = DEFAULT_EPSILON  # target honest ε; None: adds no noise


def _plain_type(hint) -> type:
    """int, float or str from an annotation such as ``float | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return hint if hint in (int, float, str, bool) else str


@dataclass(frozen=True)
class MechanismSpec:
    """A mechanism's declaration (see the module docstring)."""

    name: str
    build: Callable[..., Any]  # build(noise_multiplier, max_grad_norm, **options) -> Mechanism
    options: type = NoOptions  # a frozen dataclass
    defaults: Defaults | None = None  # privgrad train's lr, optimizer, momentum, clip, ε
    paper: str = ""
    chain: str = ""  # the stages in one line, for the documentation

    def option_infos(self) -> list[OptionInfo]:
        hints = typing.get_type_hints(self.options)
        return [
            OptionInfo(
                f.name,
                _plain_type(hints.get(f.name, str)),
                f.default,
                f.metadata.get("help", ""),
                f.metadata.get("range"),
                f.metadata.get("flag") or "--" + f.name.replace("_", "-"),
                f.metadata.get("cli", True),
            )
            for f in dataclasses.fields(self.options)
        ]

    def make(self, noise_multiplier: float = 0.0, max_grad_norm: float = 1.0, **options):
        """Builds the mechanism; an option it does not use is an error, never ignored."""
        options = {k: v for k, v in options.items() if v is not None}
        accepted = {o.name for o in self.option_infos()}
        unused = sorted(set(options) - accepted)
        if unused:
            raise PrivgradError(
                f"mechanism '{self.name}' does not use option(s) "
                f"{', '.join(option_flag(u) for u in unused)}"
            )
        values = self.options(**options)
        options = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
        return self.build(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **options)


_SPECS: dict[str, MechanismSpec] = {}
_loaded = False


def _load() -> None:
    """Registers the built-in specs, then those named in ``PRIVGRAD_MECHANISMS``, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BUILTIN:
        spec = importlib.import_module(f"privgrad.mechanisms.catalog.{module}").MECHANISM
        _SPECS.setdefault(spec.name, spec)
    for name in os.environ.get(PLUGIN_ENV, "").split(","):
        if name.strip():
            register_mechanism(load_mechanism(name.strip()))


def load_mechanism(spec: str) -> MechanismSpec:
    """The :class:`MechanismSpec` named by ``python:module:attribute`` (the attribute is a
    spec or a function returning one); ``module`` is imported from the current directory
    or ``sys.path``, as ``--model python:…`` is."""
    module, module_name, found = import_attribute(spec, "mechanism", "attribute")
    if callable(found) and not isinstance(found, MechanismSpec):
        found = found()
    if not isinstance(found, MechanismSpec):
        raise PrivgradError(
            f"mechanism '{spec}': {module_name}.{spec.rpartition(':')[2]} is not a MechanismSpec"
        )
    return found


def register_mechanism(spec: MechanismSpec) -> MechanismSpec:
    """Adds a mechanism declared by ``spec``; a name registered again is replaced."""
    _load()
    if not isinstance(spec, MechanismSpec):
        raise PrivgradError(f"register_mechanism takes a MechanismSpec, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name or spec.name.startswith(PREFIX):
        raise PrivgradError(f"a mechanism needs a plain name, got {spec.name!r}")
    _SPECS[spec.name] = spec
    return spec


def unregister_mechanism(name: str) -> None:
    """Removes a registered mechanism (a test's toy, say); an unknown name is an error."""
    _load()
    if name not in _SPECS:
        raise PrivgradError(f"unknown mechanism '{name}'")
    del _SPECS[name]


def mechanism_spec(name: str) -> MechanismSpec:
    """The spec registered as ``name``; ``python:module:attribute`` loads and registers one."""
    _load()
    if name not in _SPECS and isinstance(name, str) and name.startswith(PREFIX):
        return register_mechanism(load_mechanism(name))
    if name not in _SPECS:
        raise PrivgradError(f"unknown mechanism '{name}'; choose from: {', '.join(_SPECS)}")
    return _SPECS[name]


def mechanism_specs() -> dict[str, MechanismSpec]:
    """Every registered spec by name, built-ins first."""
    _load()
    return dict(_SPECS)


class _Registered(Mapping):
    """A live view name -> spec of the registry (so a later registration shows)."""

    def __getitem__(self, name: str) -> MechanismSpec:
        _load()
        return _SPECS[name]

    def __iter__(self) -> Iterator[str]:
        _load()
        return iter(list(_SPECS))

    def __len__(self) -> int:
        _load()
        return len(_SPECS)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)})"


MECHANISMS: Mapping[str, MechanismSpec] = _Registered()


def build_mechanism(
    name: str, noise_multiplier: float = 0.0, max_grad_norm: float = 1.0, **options
):
    """Builds a registered mechanism; an option it does not use is an error, never silently
    ignored."""
    return mechanism_spec(name).make(noise_multiplier, max_grad_norm, **options)


def option_flag(name: str) -> str:
    """The command-line flag of mechanism option ``name``."""
    for spec in mechanism_specs().values():
        for info in spec.option_infos():
            if info.name == name:
                return info.flag
    return "--" + name.replace("_", "-")


def cli_options() -> dict[str, tuple[OptionInfo, list[tuple[str, OptionInfo]]]]:
    """flag -> (first declaration, [(mechanism, its declaration), …]) over every option
    with a command-line flag: one flag serves every mechanism that declares it."""
    out: dict[str, tuple[OptionInfo, list]] = {}
    for spec in mechanism_specs().values():
        for info in spec.option_infos():
            if info.cli:
                out.setdefault(info.flag, (info, []))[1].append((spec.name, info))
    return out


def option_range(flag: str):
    """The declared :class:`~privgrad.validate.Range` of a mechanism flag (any finite number
    where its option declares none), or None for a flag of no mechanism."""
    from privgrad.validate import ANY

    found = cli_options().get(flag)
    if not found:
        return None
    return found[0].range if found[0].range is not None else ANY


__all__ = [
    "MechanismSpec",
    "Defaults",
    "NoOptions",
    "OptionInfo",
    "option",
    "register_mechanism",
    "unregister_mechanism",
    "load_mechanism",
    "mechanism_spec",
    "mechanism_specs",
    "build_mechanism",
    "option_flag",
    "cli_options",
    "option_range",
    "MECHANISMS",
    "DEFAULT_EPSILON",
]
