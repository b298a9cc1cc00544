"""The layers of the package: the core imports nothing from the application or the lab, and
the application reaches the lab only from its command line.

``privgrad/`` is the core (per-sample engine, layers, mechanisms, accounting, sampling, the
private step, the own loop, the public API); ``privgrad/app/`` the application (CLI, training
runner, run store, checkpoints, data, model zoo, GAN and audit runners); ``privgrad/lab/``
the reproduction harness and the report. Every import counts, including those inside
functions.
"""

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "privgrad"
# the entry points, above every layer: ``privgrad`` (the command line, the one module of the
# application that reaches the lab) and ``python -m privgrad``
ENTRY_POINTS = ("privgrad.app.cli", "privgrad.__main__")


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones resolved."""
    name = _module_name(path, package)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from privgrad import app`` imports the subpackage
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "privgrad":
        return None
    if len(parts) > 1 and parts[1] in ("app", "lab"):
        return parts[1]
    return "core"


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """``file:line: importer -> imported`` for every import against the layering."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        importer = _module_name(path, package)
        layer = _layer(importer)
        if importer in ENTRY_POINTS:
            continue
        for line, imported in _imports(path, package):
            target = _layer(imported)
            upward = (layer == "core" and target in ("app", "lab")) or (
                layer == "app" and target == "lab"
            )
            if upward:
                bad.append(f"{path.relative_to(package.parent)}:{line}: {importer} -> {imported}")
    return bad


def test_no_module_imports_upward():
    assert upward_imports() == []


def test_the_three_layers_exist_and_each_holds_what_it_says():
    assert (PACKAGE / "app" / "cli.py").is_file() and (PACKAGE / "lab" / "reproduce.py").is_file()
    for core in (
        "private.py",
        "own_loop.py",
        "sampling.py",
        "mechanisms",
        "per_sample",
        "accounting",
    ):
        assert (PACKAGE / core).exists(), core


def test_a_planted_upward_import_is_caught(tmp_path):
    copy = tmp_path / "privgrad"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    sampling = copy / "sampling.py"
    sampling.write_text(
        sampling.read_text() + "\n\ndef _late():\n    from privgrad.app import store\n"
    )
    runner = copy / "app" / "train.py"
    runner.write_text(runner.read_text() + "\nfrom ..lab import reproduce\n")
    bad = upward_imports(copy)
    assert len(bad) == 2, bad
    assert any("privgrad.sampling -> privgrad.app.store" in b for b in bad)
    assert any("privgrad.app.train -> privgrad.lab.reproduce" in b for b in bad)
