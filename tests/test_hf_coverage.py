"""results/hf_coverage.md holds: each architecture's row (trains, or refused with privgrad's
reason) is what experiments/scripts/hf_coverage.py gives for it now, at the pinned
transformers, so a change to the engine that breaks or newly refuses an architecture fails
here instead of leaving the committed table stale."""

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "results" / "hf_coverage.md"


def _script():
    path = ROOT / "experiments" / "scripts" / "hf_coverage.py"
    spec = importlib.util.spec_from_file_location("hf_coverage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_rows() -> dict[str, tuple[str, str, str]]:
    """architecture -> (built as, outcome, detail) of the committed table."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] in ("trains", "refused", "error", "not built"):
            rows[cells[0]] = tuple(cells[1:])
    return rows


def test_the_table_covers_every_architecture_of_the_script():
    script = _script()
    assert list(committed_rows()) == [*script.TEXT, *script.IMAGE, *script.AUDIO]
    counts = re.search(
        r"(\d+) trains, (\d+) refused, (\d+) error, (\d+) not built", TABLE.read_text()
    )
    outcomes = [o for _, o, _ in committed_rows().values()]
    assert [int(n) for n in counts.groups()] == [
        outcomes.count(o) for o in ("trains", "refused", "error", "not built")
    ]


@pytest.mark.parametrize("name", list(committed_rows()))
def test_each_committed_row_is_what_the_script_gives_now(name):
    """The model's head and the outcome; a refusal's first 60 characters (the layer or
    parameter it names, and the start of its cause); a trained row's steps and ε."""
    head, outcome, detail = committed_rows()[name]
    _, now_head, now_outcome, now_detail = _script().row(name)
    assert (now_head, now_outcome) == (head, outcome), now_detail
    if outcome == "refused":
        assert now_detail[:60] == detail[:60]
    if outcome == "trains":
        assert now_detail.split(",")[:2] == detail.split(",")[:2]
