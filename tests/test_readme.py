"""The README's Python example runs as written (on the committed MNIST copy)."""

import re
from pathlib import Path


def test_readme_python_example_runs(capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "make_private" in b)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    eps = float(re.search(r"ε = ([0-9.]+)", out).group(1))
    assert 0.9 < eps <= 1.0


def test_readme_opens_with_the_two_commands():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks[0].strip() == "pip install -e . && privgrad train"
    assert blocks[1].strip() == 'pip install -e ".[test]" && python -m pytest -q'
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci


def test_guide_metrics_example_runs(tmp_path, monkeypatch):
    """The guide's MetricsLog example, in place of the loop of its Python API example (on a
    slice of MNIST), writes the CSV files it names."""
    import csv

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    api = next(b for b in blocks if "privgrad.make_private(model" in b)
    log = next(b for b in blocks if "MetricsLog(" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(api[: api.index("for epoch")], "guide.md", "exec"), namespace)
    exec(compile(log, "guide.md", "exec"), namespace)
    with open(tmp_path / "runs" / "mine" / "epochs.csv", newline="") as f:
        epochs = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in epochs] == [1, 2] and 0.9 < float(epochs[1]["epsilon"]) <= 1
    assert (tmp_path / "runs" / "mine" / "steps.csv").read_text().startswith("step,epoch,loss,")
