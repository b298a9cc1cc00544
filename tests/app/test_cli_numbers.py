"""Every numeric option of every command, over finite, infinite, NaN, zero and negative
values: an invalid one exits 2 with one line and no traceback, before any work starts;
a valid one passes the check (only parsed here, never run)."""

import math

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privgrad.app.cli import main
from privgrad.validate import range_of

# What each command needs besides the option under test.
REQUIRED = {
    "epsilon": ["--sampling-rate", "0.5", "--noise-multiplier", "1", "--steps", "10"],
    "gan": ["--mode", "dp-gan"],
    "resume": ["1"],
    "evaluate": ["model.pt"],
}
# What follows an argument under test (export's RUN_ID: the PATH).
AFTER = {"export": ["model.pt"]}
# Independent of privgrad.validate: the options for which 0, or a negative value, is meaningful.
ZERO_OK = {
    "--noise-multiplier",
    "--momentum",
    "--filter-ratio",
    "--seed",
    "--validation",
    "--background",
    "--decay",
    "--tau",
    "--ts-offset",
    ("epsilon", "--steps"),
}
NEGATIVE_OK = {"--ts-offset"}

NUMERIC = [
    (
        name,
        p.opts[0] if isinstance(p, click.Option) else p.human_readable_name,
        isinstance(p.type, click.types.IntParamType),
    )
    for name, cmd in sorted(main.commands.items())
    for p in cmd.params
    if isinstance(p.type, (click.types.FloatParamType, click.types.IntParamType))
]


def test_every_command_with_numbers_is_covered():
    assert {name for name, _, _ in NUMERIC} == {
        "train",
        "epsilon",
        "runs",
        "gan",
        "reproduce",
        "audit",
        "resume",
        "export",
        "evaluate",
    }
    for name, flag, _ in NUMERIC:
        range_of(name, flag)  # every numeric option has a range (a KeyError otherwise)


def _args(command: str, flag: str, text: str) -> list[str]:
    if not flag.startswith("--"):  # an argument (resume's RUN_ID)
        return [command, "--", text, *AFTER.get(command, [])]
    base = REQUIRED.get(command, [])
    if flag in base:
        i = base.index(flag)
        return [command, *base[: i + 1], text, *base[i + 2 :]]
    return [command, *base, flag, text]


def _expected_valid(command: str, flag: str, is_int: bool, value: float) -> bool:
    if not math.isfinite(value) or (is_int and value != int(value)):
        return False
    if value < 0:
        return flag in NEGATIVE_OK
    if value == 0:
        return flag in ZERO_OK or (command, flag) in ZERO_OK
    return value in range_of(command, flag)  # upper limits (e.g. at most 10^7 steps)


VALUES = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, -1.0, 1.0, 0.5, 1.5, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**12), 10**12).map(float),
)


@pytest.mark.parametrize("command,flag,is_int", NUMERIC, ids=[f"{c} {f}" for c, f, _ in NUMERIC])
@settings(
    max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(value=VALUES)
def test_numeric_option(command, flag, is_int, value):
    text = (
        str(int(value)) if is_int and math.isfinite(value) and value == int(value) else repr(value)
    )
    args = _args(command, flag, text)
    if _expected_valid(command, flag, is_int, value):
        main.commands[command].make_context(command, args[1:])  # parsed and checked, not run
        return
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, SystemExit), result.exception  # no other exception
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and result.stdout == "", (args, result.stderr)
    assert lines[0].startswith("error: ") and flag in lines[0] and "Traceback" not in lines[0]
