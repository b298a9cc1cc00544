"""Provenance (issue 41, item 3): every record privgrad writes names the code that made it
(``git_commit`` and ``code_version``, privgrad/records.py)."""

import json

import torch

from cli_helpers import run_cli
from privgrad.records import code_version, git_commit

TRAIN = (
    "train",
    "--limit-train",
    "300",
    "--epochs",
    "1",
    "--batch-size",
    "100",
    "--noise-multiplier",
    "1.2",
    "--device",
    "cpu",
    "--quiet",
)


def test_a_train_record_and_its_model_sidecar_name_the_commit_and_the_code_version(tmp_path):
    out = tmp_path / "record.json"
    model = tmp_path / "model.pt"
    code, _, err = run_cli(
        *TRAIN, "--db", str(tmp_path / "r.db"), "--out", str(out), "--save-model", str(model)
    )
    assert code == 0, err
    record = json.loads(out.read_text())
    assert (record["git_commit"], record["code_version"]) == (git_commit(), code_version())
    sidecar = json.loads((tmp_path / "model.privacy.json").read_text())
    assert (sidecar["git_commit"], sidecar["code_version"]) == (git_commit(), code_version())


def test_the_own_loop_privacy_record_names_the_commit_and_the_code_version():
    import privgrad

    model = torch.nn.Linear(4, 2)
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    private = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        batch_size=16,
    )
    record = private.privacy_record()
    assert (record["git_commit"], record["code_version"]) == (git_commit(), code_version())
