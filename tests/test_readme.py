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


def test_readme_and_guide_load_a_saved_model_as_written(tmp_path, monkeypatch):
    """Their loading snippet rebuilds any built-in model from its sidecar, not only the CNN
    (it hard-coded build_model("cnn", (1, 28, 28), 10)): here an IMDB BiLSTM whose embedding
    has --vocab-size 100's rows (num_tokens 102)."""
    import json

    import torch

    from privgrad.app.models import build_model

    recipe = {"name": "bilstm", "input_shape": [20], "num_classes": 2, "act": "tanh"}
    recipe |= {"num_tokens": 102, "act_params": {}}
    monkeypatch.chdir(tmp_path)
    torch.save(build_model(**recipe).state_dict(), "model.pt")
    (tmp_path / "model.privacy.json").write_text(json.dumps({"model": recipe}))
    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/guide.md"):
        blocks = re.findall(r"```python\n(.*?)```", (root / doc).read_text(), re.S)
        code = next(b for b in blocks if 'torch.load("model.pt"' in b)
        namespace = {}
        exec(compile(code, doc, "exec"), namespace)
        assert namespace["model"](torch.ones(3, 20, dtype=torch.long)).shape == (3, 2)
