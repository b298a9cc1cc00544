"""Guidance before a private run (privgrad/app/guidance.py): the noise-to-signal measure, the
warning threshold and the small-data batch rule, checked against the committed records of
experiments/scripts/small_data.py (results/small_data/runs.jsonl). No training."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from privgrad.app import guidance
from privgrad.app.defaults import BATCH_FRACTION, default_batch_size

RECORDS = Path(__file__).resolve().parents[2] / "results" / "small_data" / "runs.jsonl"


def _cells() -> dict:
    """(N, fraction, epochs) → records, full cells (3 seeds) only."""
    out: dict = {}
    for line in RECORDS.read_text().splitlines():
        r = json.loads(line)
        out.setdefault((r["N"], r["fraction"], r["epochs"]), []).append(r)
    return {k: v for k, v in out.items() if len(v) == 3}


def _mean_val(rs) -> float:
    return statistics.mean(r["validation_accuracy"] for r in rs)


def test_noise_to_signal_is_sigma_root_d_over_batch():
    assert guidance.noise_to_signal(2.0, 100, 10_000) == pytest.approx(2.0)
    assert guidance.noise_to_signal(0.0, 100, 10_000) == 0.0
    with pytest.raises(ValueError):
        guidance.noise_to_signal(1.0, 0, 10)


def test_records_r_is_the_measure_of_their_plan():
    for rs in _cells().values():
        for r in rs:
            assert r["noise_to_signal"] == pytest.approx(
                guidance.noise_to_signal(
                    r["effective_noise_multiplier"], r["batch_size"], r["parameters"]
                )
            )
            assert r["epsilon"] == pytest.approx(1.0, abs=0.01)  # privgrad's accountant


def test_threshold_is_the_largest_r_that_reached_half_accuracy():
    """No measured cell above the threshold reached 50 % mean validation accuracy; the
    threshold is (rounded up to 0.1) the largest r of a cell that did."""
    cells = _cells()
    good = [rs[0]["noise_to_signal"] for rs in cells.values() if _mean_val(rs) >= 0.5]
    above = [
        rs for rs in cells.values() if rs[0]["noise_to_signal"] > guidance.NOISE_TO_SIGNAL_WARN
    ]
    assert good and above
    assert math.ceil(max(good) * 10) / 10 == pytest.approx(guidance.NOISE_TO_SIGNAL_WARN)
    assert all(_mean_val(rs) < 0.5 for rs in above)


def test_min_steps_is_the_fewest_steps_that_sufficed_below_the_threshold():
    """Below the threshold, every cell with at least MIN_STEPS steps reached 50 % mean
    validation accuracy; MIN_STEPS is the smallest measured step count with that property."""
    quiet = [
        rs for rs in _cells().values() if rs[0]["noise_to_signal"] <= guidance.NOISE_TO_SIGNAL_WARN
    ]

    def all_good_from(s):
        return all(_mean_val(rs) >= 0.5 for rs in quiet if rs[0]["steps"] >= s)

    counts = sorted({rs[0]["steps"] for rs in quiet})
    assert min(s for s in counts if all_good_from(s)) == guidance.MIN_STEPS
    assert any(_mean_val(rs) < 0.5 for rs in quiet if rs[0]["steps"] < guidance.MIN_STEPS)


def test_few_steps_are_warned():
    g = guidance.plan_guidance(4.08, 320, 26_010, 800, 6, 1.0, epochs=3)
    assert g.ratio <= guidance.NOISE_TO_SIGNAL_WARN
    assert g.warning is not None and "--epochs 10" in g.warning


def _columns(cells: dict) -> dict:
    """(N, epochs) → {expected batch: records}, for columns of at least 3 batch sizes."""
    out: dict = {}
    for (size, _, epochs), rs in cells.items():
        out.setdefault((size, epochs), {})[rs[0]["batch_size"]] = rs
    return {k: v for k, v in out.items() if len(v) >= 3}


def _best(column: dict) -> float:
    return max(column, key=lambda b: _mean_val(column[b]))


def _nearest(column: dict, batch: float) -> float:
    return min(column, key=lambda b: abs(math.log(b / batch)))


def test_batch_per_epoch_is_the_geometric_mean_of_the_best_cells():
    """Per (N, epochs) column, the best expected batch divided by the epochs; the rule's
    constant is their geometric mean, rounded to a multiple of 10."""
    ratios = [_best(col) / epochs for (_, epochs), col in _columns(_cells()).items()]
    mean = math.exp(statistics.mean(math.log(x) for x in ratios))
    assert round(mean, -1) == guidance.BATCH_PER_EPOCH
    assert min(ratios) <= guidance.BATCH_PER_EPOCH <= max(ratios)


def test_rule_batch_is_at_most_one_grid_step_from_the_best():
    """In every (N, epochs) column the grid batch nearest the rule's is the best one or its
    neighbour on the grid, and never worse than the 1/40 default."""
    for (size, epochs), col in _columns(_cells()).items():
        n = next(iter(col.values()))[0]["train_size"]
        grid = sorted(col)
        rule = _nearest(col, guidance.small_data_batch_size(n, epochs))
        assert abs(grid.index(rule) - grid.index(_best(col))) <= 1, (size, epochs)
        for default in (b for b in col if b == pytest.approx(n / 40)):
            assert _mean_val(col[rule]) >= _mean_val(col[default]), (size, epochs)


def test_rule_keeps_one_fortieth_from_ten_thousand():
    for n in (10_000, 12_345, 60_000):
        for epochs in (1, 3, 20):
            assert guidance.small_data_batch_size(n, epochs) == pytest.approx(n / 40)
    assert default_batch_size(60_000) == pytest.approx(guidance.small_data_batch_size(60_000, 20))
    assert guidance.small_data_batch_size(4000, 10) == pytest.approx(400)
    assert guidance.small_data_batch_size(1600, 20) == pytest.approx(800)
    assert guidance.small_data_batch_size(800, 20) == pytest.approx(640)  # 0.8 n
    assert guidance.small_data_batch_size(9000, 1) == pytest.approx(225)  # n/40
    assert guidance.small_data_batch_size(1, 20) == 1.0
    # never below 1/40 of the data (the default from 10,000 on), never above
    # MAX_SMALL_FRACTION of it; the CLI's default is this rule
    for n in range(2, 10_000, 37):
        for epochs in (1, 3, 10, 20, 100):
            b = guidance.small_data_batch_size(n, epochs)
            assert b == default_batch_size(n, epochs)
            assert b >= max(1.0, n * BATCH_FRACTION) - 1e-9
            assert b <= max(1.0, guidance.MAX_SMALL_FRACTION * n) + 1e-9


def test_plan_below_threshold_is_stated_without_warning():
    g = guidance.plan_guidance(1.0, 400, 26_010, 4000, 100, 1.0, epochs=10)
    assert g.warning is None
    assert "r = " in g.statement and f"{g.ratio:.2f}" in g.statement


def test_table_row_with_default_batch_warns_and_names_the_rule():
    """The table's N = 2000, 1/40, 10 epochs row (r ≈ 8.4, near chance) is warned, and the
    warning names the rule's batch."""
    rs = _cells()[(2000, "1/40", 10.0)]
    r0 = rs[0]
    g = guidance.plan_guidance(
        r0["effective_noise_multiplier"],
        r0["batch_size"],
        r0["parameters"],
        r0["train_size"],
        r0["steps"],
        1.0,
        epochs=20,
    )
    assert g.ratio == pytest.approx(r0["noise_to_signal"])
    assert g.warning is not None
    rule = guidance.small_data_batch_size(r0["train_size"], 20)
    assert f"--batch-size {rule:g}" in g.warning


def test_warning_without_a_batch_fix_names_other_levers():
    g = guidance.plan_guidance(20.0, 640, 26_010, 800, 25, 1.0, epochs=20)
    assert g.warning is not None and "--batch-size" not in g.warning
    assert "--epsilon" in g.warning


def test_a_batch_fix_that_leaves_r_over_the_threshold_names_the_other_levers():
    """A 1.3M-parameter transformer on 1,000 IMDB reviews (r = 13.88 at B = 100) was told
    only 'try --batch-size 120', which leaves r over 11 even before σ grows with B."""
    g = guidance.plan_guidance(1.1905, 100, 1_359_874, 1000, 30, 3.0, epochs=3)
    assert g.warning is not None and "--batch-size 120" in g.warning
    assert "leaves r above 11.6" in g.warning
    assert "--epsilon" in g.warning and "d = 1,359,874" in g.warning


def test_guidance_is_torch_free():
    code = (
        "import sys, privgrad.app.guidance; "
        "print(any(m in sys.modules for m in ('torch', 'numpy', 'scipy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
