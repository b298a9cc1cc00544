"""The two speeds of the test suite: the slow list names real tests, the marker is registered,
and the README gives the quick command beside the full one."""

import ast
import re
from pathlib import Path

import pytest

from conftest import SLOW

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", SLOW)
def test_each_slow_entry_names_a_test_module_or_function(name):
    module, _, function = name.partition("::")
    path = ROOT / module
    assert path.is_file(), f"{module} does not exist (renamed? update tests/conftest.py)"
    if function:
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert function in names, f"{name}: no such test (renamed? update tests/conftest.py)"
    assert SLOW[name].strip(), f"{name}: say why it is slow"


def test_the_marker_is_registered_and_the_readme_gives_both_commands():
    assert re.search(r"markers = \[\s*\"slow:", (ROOT / "pyproject.toml").read_text())
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pytest -m "not slow"' in readme
    assert 'pip install -e ".[test]" && python -m pytest -q' in readme
