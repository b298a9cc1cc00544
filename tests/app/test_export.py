"""The trained model goes home: weights plain PyTorch loads with weights_only=True, and their
privacy record beside them, from --save-model, `privgrad export` and the trainer API."""

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import privgrad
from cli_helpers import run_cli
from privgrad.app import console
from privgrad.app.data import load_dataset
from privgrad.app.models import build_model
from privgrad.app.store import RunStore
from privgrad.app.train import evaluate

TRAIN = (
    "train",
    "--limit-train",
    "600",
    "--epochs",
    "1",
    "--batch-size",
    "100",
    "--epsilon",
    "2",
    "--device",
    "cpu",
    "--quiet",
    "--json",
)


def load_for_inference(path):
    """The README's three lines, with the recipe read from the sidecar."""
    recipe = json.loads(path.with_name(path.stem + ".privacy.json").read_text())["model"]
    model = build_model(
        recipe["name"],
        tuple(recipe["input_shape"]),
        recipe["num_classes"],
        act=recipe["act"],
        num_tokens=recipe["num_tokens"],
        act_params=recipe["act_params"],
    )
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def _mnist_dir():
    from privgrad.app.data import find_dataset_dir
    from privgrad.app.data.images import IDX_FILES

    return find_dataset_dir("mnist", IDX_FILES, None)


def _idx(path):
    """An IDX file's array, read with gzip and NumPy alone."""
    import gzip

    import numpy as np

    raw = gzip.open(path).read()
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(raw[3])]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * raw[3]).reshape(dims)


def test_save_model_loads_with_weights_only_and_reproduces_the_test_accuracy(tmp_path, monkeypatch):
    db, path = tmp_path / "runs.db", tmp_path / "out" / "model.pt"
    code, out, err = run_cli(*TRAIN, "--db", str(db), "--save-model", str(path))
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["model_path"] == str(path)
    model = load_for_inference(path)
    data = load_dataset("mnist")
    assert evaluate(model, (data.test_x, data.test_y)) == record["test_accuracy"]
    # the README's three lines, as written (imports included), in the folder of model.pt
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = next(
        b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "weights_only=True" in b
    )
    namespace = {}
    monkeypatch.chdir(path.parent)
    exec(compile(lines, "README.md", "exec"), namespace)
    assert evaluate(namespace["model"], (data.test_x, data.test_y)) == record["test_accuracy"]
    privacy = json.loads((tmp_path / "out" / "model.privacy.json").read_text())
    # the sidecar says how the inputs were made: the official test files, read without
    # privgrad's loader and preprocessed as "inputs" says, give the accuracy privgrad reported
    inputs = privacy["inputs"]
    x = torch.from_numpy(_idx(_mnist_dir() / "t10k-images-idx3-ubyte.gz")).float()
    x = x.reshape(-1, *inputs["layout"]) / inputs["divide_by"]
    x = (x - torch.tensor(inputs["mean"]).view(-1, 1, 1)) / torch.tensor(inputs["std"]).view(
        -1, 1, 1
    )
    y = torch.from_numpy(_idx(_mnist_dir() / "t10k-labels-idx1-ubyte.gz").astype("int64"))
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().item()
    assert correct / len(y) == record["test_accuracy"]
    # the accuracy says what it is of (a --limit-test run's was of a sample, unsaid)
    assert privacy["evaluated_examples"] == record["evaluated_examples"] == len(data.test_y)
    for key in (
        "epsilon",
        "delta",
        "effective_noise_multiplier",
        "sampling_rate",
        "steps",
        "accountant",
        "neighbouring",
        "mechanism",
        "privgrad_version",
        "git_commit",
        "code_version",
        "environment",
    ):
        assert privacy[key] == record[key], key
    assert 1.9 < privacy["epsilon"] <= 2.0
    # no --seed: a secret one, in the checkpoint only (the record and the sidecar say so)
    assert record["seed"] is None and record["seed_source"] == privacy["seed_source"]
    assert privacy["seed_source"].startswith("secret") and "seed" not in privacy

    # privgrad export of the same run gives the same weights and record
    code, out, err = run_cli("export", "1", str(tmp_path / "again.pt"), "--db", str(db))
    assert code == 0, err
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    saved = torch.load(path, weights_only=True)
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    assert json.loads((tmp_path / "again.privacy.json").read_text()) == privacy


def test_a_stopped_run_exports_its_checkpoint_with_the_epsilon_of_the_steps_it_ran(
    tmp_path, monkeypatch
):
    """Stopped at step 9 (6 steps an epoch): the export holds the 8 steps its checkpoint
    does, and `runs show` gives their ε (it gave the last epoch row's, 6 steps); the
    sidecar's "model" rebuilds it (it had the model's name only)."""
    from cli_helpers import interrupt_at_step
    from privgrad.app.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
    from privgrad.app.models import build_model

    db = tmp_path / "runs.db"
    interrupt_at_step(monkeypatch, 9)
    code, _, _ = run_cli(
        "train",
        "--limit-train",
        "600",
        "--epochs",
        "2",
        "--batch-size",
        "100",
        "--noise-multiplier",
        "1.5",
        "--device",
        "cpu",
        "--quiet",
        "--db",
        str(db),
    )
    assert code == 130 and RunStore(db).run(1)["status"] == "interrupted"
    code, out, err = run_cli("export", "1", str(tmp_path / "partial.pt"), "--db", str(db))
    assert code == 0, err
    privacy = json.loads((tmp_path / "partial.privacy.json").read_text())
    trainer_state = load_checkpoint(checkpoint_dir(db, 1))["trainer"]
    assert privacy["status"] == "interrupted" and privacy["steps"] == trainer_state["steps"] == 8
    assert privacy["inputs"]["mean"] == [0.1307] and privacy["inputs"]["std"] == [0.3081]
    expected = privgrad.accounting.epsilon_of(
        [(privgrad.accounting.poisson_gaussian_event(1 / 6, 1.5), 8)], 1e-5
    )
    assert privacy["epsilon"] == pytest.approx(expected, rel=1e-9)
    # the rest of a finished run's sidecar, as far as a checkpoint knows it
    assert privacy["epsilon_rdp"] == pytest.approx(
        privgrad.accounting.epsilon_of(
            [(privgrad.accounting.poisson_gaussian_event(1 / 6, 1.5), 8)], 1e-5, "rdp"
        ),
        rel=1e-9,
    )
    assert (
        privacy["effective_noise_multiplier"] == pytest.approx(1.5) and privacy["train_size"] == 600
    )
    assert (privacy["batch_size"], privacy["epochs"]) == (100, 2)
    # the seed stays out (a secret one was drawn: knowing it would let a reader replay the noise)
    assert "seed" not in privacy and privacy["seed_source"].startswith("secret")
    assert privacy["clip"] > 0 and privacy["nonfinite_examples"] == 0
    # an un-noised count over the training examples: named as outside ε
    assert privacy["not_covered_by_epsilon"] == ["nonfinite_examples"]
    assert privacy["environment"] == privgrad.records.environment()
    assert privacy["code_version"] == privgrad.records.code_version()
    weights = torch.load(tmp_path / "partial.pt", weights_only=True)
    assert all(torch.equal(weights[k], trainer_state["model"][k]) for k in weights)
    build_model(**privacy["model"]).load_state_dict(weights)
    code, out, err = run_cli("runs", "show", "1", "--db", str(db))
    assert code == 0, err
    spent = [line for line in out.splitlines() if "spent so far" in line]
    assert len(spent) == 1 and "after 8 steps" in spent[0], out
    assert f"{privacy['epsilon']:.4f}" in spent[0]
    # `runs` gives the claimed ε of those steps too (it showed "-"): DP-SGD's is the honest one
    code, out, err = run_cli("runs", "--db", str(db))
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert row[-2:] == [f"{privacy['epsilon']:.3f}"] * 2, out  # ε, ε claimed (no time yet)
    # a checkpoint without the ledgers of its steps: no ε to export, said as such
    saved = load_checkpoint(checkpoint_dir(db, 1))
    del saved["trainer"]["claimed_ledger"]
    save_checkpoint(checkpoint_dir(db, 1), saved)
    code, _, err = run_cli("export", "1", str(tmp_path / "again.pt"), "--db", str(db))
    assert code != 0 and "holds no ledger of the privacy events" in err, err


def test_the_trainer_saves_its_model_and_privacy_record(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    p = privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        batch_size=20,
        epochs=1,
    )
    for b in p.batches():
        p.step(b)
    weights, sidecar = p.save_model(tmp_path / "m.pt", note="mine")
    fresh = nn.Sequential(nn.Linear(5, 3))
    fresh.load_state_dict(torch.load(weights, weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    privacy = json.loads(sidecar.read_text())
    assert (
        privacy["epsilon"] == p.epsilon() and privacy["steps"] == 10 and privacy["note"] == "mine"
    )
    assert privacy["sampling_rate"] == 0.1 and privacy["effective_noise_multiplier"] == 1.0
    # the run's parameters under the names `privgrad train`'s sidecar gives them
    assert privacy["clip"] == 1.0 and privacy["batch_size"] == 20 and privacy["train_size"] == 200
    assert privacy["epsilon_claimed_rdp"] == p.epsilon_claimed("rdp")
    # a keyword may add to the record, not replace its figures: epsilon=0.1 was written as
    # the weights' ε (their 10 steps give 2.85), and a Hugging Face model card would state it
    with pytest.raises(privgrad.PrivgradError, match="epsilon, steps would replace"):
        p.save_model(tmp_path / "n.pt", epsilon=0.1, steps=1, note="mine")
    assert not (tmp_path / "n.pt").exists()


def _examples(seed: int):
    """200 examples of 5 features, 3 classes (seed 0: the first run's data)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)


def _trained_and_saved(path, seed: int = 1):
    """A linear model trained 12 private steps on 200 examples, saved to ``path``; the data."""
    data = _examples(0)
    torch.manual_seed(0)
    first = _steps(nn.Linear(5, 3), data, seed)
    first.save_model(path)
    return first, data


def _attach(model, data, seed: int = 1, noise_multiplier: float = 1.0, **options):
    """make_private on ``model`` with SGD, σ, B = 50 of 200 and 3 epochs' plan."""
    return privgrad.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        noise_multiplier=noise_multiplier,
        batch_size=50,
        epochs=3,
        seed=seed,
        **options,
    )


def _steps(model, data, seed: int, steps: int = 12, **options):
    """:func:`_attach`, then ``steps`` private steps."""
    trainer = _attach(model, data, seed, **options)
    for batch in trainer.batches(steps):
        trainer.step(batch)
    return trainer


def _holding(state):
    """A fresh linear model holding a trainer state's weights."""
    model = nn.Linear(5, 3)
    model.load_state_dict(state["model"])
    return model


def _loaded(path):
    """A fresh linear model holding the weights saved at ``path`` (plain load_state_dict)."""
    model = nn.Linear(5, 3)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


@pytest.mark.parametrize("how", ["torch.load", "load_model"])
def test_a_saved_model_reloaded_and_trained_again_counts_its_earlier_run(tmp_path, how):
    """Weights saved by a private run, reloaded into a new model and attached again on the same
    data: the new trainer's ε counted from zero (6.45, run 2's 12 steps alone, while the
    weights had taken 24 steps: 8.79 by dp-accounting on both runs' events). Now make_private
    refuses until prior= says how the earlier run counts; prior=PATH composes its events (ε
    is the PLD accountant's on both runs' events), and the record says so."""
    from privgrad.accounting.pure_dp import composed_epsilon

    first, data = _trained_and_saved(tmp_path / "m.pt")
    if how == "torch.load":
        again = _loaded(tmp_path / "m.pt")
    else:
        from privgrad.model_file import load_model

        again = load_model(nn.Linear(5, 3), tmp_path / "m.pt")
    with pytest.raises(privgrad.PrivgradError, match="trained privately already.*prior="):
        _steps(again, data, seed=2)
    second = _steps(again, data, seed=2, prior=tmp_path / "m.pt")
    both = composed_epsilon([*first.ledger.entries, *second.ledger.entries], 1e-5)
    assert second.epsilon() == both > first.epsilon() * 1.3
    record = second.privacy_record()
    assert record["epsilon"] == both and record["prior"]["weights"] == str(tmp_path / "m.pt")
    # a third run from the second's weights composes all three runs' events
    second.save_model(tmp_path / "m2.pt")
    last = _steps(_loaded(tmp_path / "m2.pt"), data, seed=3, prior=tmp_path / "m2.privacy.json")
    assert last.epsilon() == composed_epsilon(
        [*first.ledger.entries, *second.ledger.entries, *last.ledger.entries], 1e-5
    )


def test_weights_load_model_cast_to_the_models_dtype_still_mark_it_as_trained(tmp_path):
    """load_model fingerprints the model by the file's weights unless load_state_dict cast
    them (float32 weights into a float64 model): the mark must be of the model's values, or
    the cast model would pass as fresh."""
    from privgrad.model_file import load_model

    _, data = _trained_and_saved(tmp_path / "m.pt")
    again = load_model(nn.Linear(5, 3).double(), tmp_path / "m.pt")
    with pytest.raises(privgrad.PrivgradError, match="trained privately already"):
        _attach(again, data)


def test_weights_saved_before_a_prior_runs_first_step_carry_that_runs_steps(tmp_path, monkeypatch):
    """A trainer made with prior=PATH saves the weights it was given, before any step of its
    own, with "steps": 0 and the earlier run's events (its ε 6.45). Loaded in another process
    (load_model, or from_pretrained of its .hf folder), such a file was taken as fresh: a new
    run of 12 steps on the same data printed ε = 6.45 where the 12 steps before them and those
    12 give 8.79. It is refused now until prior= names it, which composes those events."""
    import weakref

    from privgrad import model_file, private
    from privgrad.accounting.pure_dp import composed_epsilon

    first, data = _trained_and_saved(tmp_path / "m.pt")
    given = privgrad.make_private(
        first.model,
        torch.optim.SGD(first.model.parameters(), lr=0.1),
        data,
        noise_multiplier=1.0,
        batch_size=50,
        prior=tmp_path / "m.pt",
    )
    given.save_model(tmp_path / "m0.pt")
    assert json.loads((tmp_path / "m0.privacy.json").read_text())["steps"] == 0
    # another process: nothing saved or trained by it
    monkeypatch.setattr(model_file, "_SAVED", {})
    monkeypatch.setattr(private, "_TRAINED_MODELS", weakref.WeakSet())
    monkeypatch.setattr(private, "_TRAINED_VALUES", [])
    again = model_file.load_model(nn.Linear(5, 3), tmp_path / "m0.pt")
    with pytest.raises(privgrad.PrivgradError, match="trained privately already"):
        _steps(again, data, seed=2)
    second = _steps(again, data, seed=2, prior=tmp_path / "m0.pt")
    both = composed_epsilon([*first.ledger.entries, *second.ledger.entries], 1e-5)
    assert second.epsilon() == both > first.epsilon() * 1.3


def test_a_layer_copied_from_weights_load_model_read_is_refused_at_its_first_step(
    tmp_path, monkeypatch
):
    """In another process, a model read by load_model and copied into a fresh model (whole, by
    load_state_dict; or its first layer alone, a backbone under a new head) was taken as fresh:
    12 steps on the same data printed ε = 6.45 where the weights' 12 steps and those give 8.79.
    The record names its trained parameters; their values are known for trained now, so both
    are refused (the whole at make_private, the layer at its first step) until prior= says how
    that run counts; a fresh model of the same initial values is not."""
    import weakref

    from privgrad import model_file, private

    torch.manual_seed(0)
    first = _steps(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), _examples(0), seed=1)
    first.save_model(tmp_path / "m.pt")
    assert json.loads((tmp_path / "m.privacy.json").read_text())["trained_parameters"] == [
        "0.weight", "0.bias", "2.weight", "2.bias",
    ]  # fmt: skip
    monkeypatch.setattr(model_file, "_SAVED", {})  # another process: nothing saved,
    monkeypatch.setattr(private, "_TRAINED_MODELS", weakref.WeakSet())  # nothing trained
    monkeypatch.setattr(private, "_TRAINED_VALUES", [])

    def fresh():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    read = model_file.load_model(fresh(), tmp_path / "m.pt")
    whole, layer = fresh(), fresh()
    whole.load_state_dict(read.state_dict())
    layer[0].load_state_dict(read[0].state_dict())
    with pytest.raises(privgrad.PrivgradError, match="trained privately already"):
        _steps(whole, _examples(0), seed=2)
    with pytest.raises(privgrad.PrivgradError, match="'0.weight' holds a value that the weights"):
        _steps(layer, _examples(0), seed=2)
    assert _steps(fresh(), _examples(0), seed=2).steps == 12
    second = _steps(layer, _examples(0), seed=2, prior="disjoint")
    assert second.steps == 12


def test_a_reloaded_model_trains_on_disjoint_data_when_the_user_says_so(tmp_path):
    """Fine-tuning on other data stays possible, by a statement: prior='disjoint' counts the
    new run alone and its record names the weights it started from."""
    from privgrad.model_file import load_model

    first, _ = _trained_and_saved(tmp_path / "m.pt")
    other = _examples(5)
    model = load_model(nn.Linear(5, 3), tmp_path / "m.pt")
    second = _steps(model, other, seed=2, prior="disjoint")
    assert second.epsilon() == first.epsilon()  # the same plan, on its own data
    assert second.privacy_record()["prior"]["weights"] == str(tmp_path / "m.pt")
    assert "shares no example" in second.privacy_record()["prior"]["how"]


def test_the_saved_model_itself_continues_with_prior_in_the_same_process(tmp_path):
    """A notebook: train, save, then continue the same live model object with prior=PATH (same
    data) or prior='disjoint' (other data), as the docs say. It was refused for its earlier
    trainer's steps ("continue with that trainer"), though those steps are the saved record's
    and prior= composes them; now it trains, ε composed by the PLD accountant on both runs'
    events. A model that stepped on after its save, or was never saved, is still refused, and
    the message names save_model and prior=."""
    from privgrad.accounting.pure_dp import composed_epsilon

    first, data = _trained_and_saved(tmp_path / "m.pt")
    model = first.model
    second = _steps(model, data, seed=2, prior=tmp_path / "m.pt")
    assert second.epsilon() == composed_epsilon(
        [*first.ledger.entries, *second.ledger.entries], 1e-5
    )
    second.save_model(tmp_path / "m2.pt")
    other = _examples(5)
    third = _steps(model, other, seed=3, prior="disjoint")
    assert third.privacy_record()["prior"]["weights"] == str(tmp_path / "m2.pt")
    # stepped on since its save (the weights are no record's): refused, saying what to do
    with pytest.raises(privgrad.PrivgradError, match=r"save_model\(path\).*prior="):
        _steps(model, other, seed=4, prior="disjoint")
    with pytest.raises(privgrad.PrivgradError, match="not the ones whose privacy record"):
        _steps(model, other, seed=4, prior=tmp_path / "m2.pt")


def test_a_run_composing_weights_trained_on_disjoint_data_counts_the_runs_before_them(tmp_path):
    """prior='disjoint' then prior=PATH: run 1 on D1, run 2 on D2 (stated disjoint), run 3
    composing run 2's weights on data that may hold D1's examples too. Run 2's record kept
    its own events only, so run 3 printed ε 2.37 (runs 2 and 3) where D1's examples had taken
    run 1's and run 3's steps (2.85 by dp-accounting on those events alone). Now the disjoint
    run's record keeps the earlier runs' events, and a run composing it counts them."""
    from privgrad.accounting.pure_dp import composed_epsilon
    from privgrad.model_file import load_model

    first, data = _trained_and_saved(tmp_path / "m.pt")
    other = _examples(5)
    model = load_model(nn.Linear(5, 3), tmp_path / "m.pt")
    # σ = 3: a smaller ε than run 1's, on its own data
    second = _steps(model, other, 2, noise_multiplier=3.0, prior="disjoint")
    assert second.epsilon() < first.epsilon() / 2  # the disjoint run's own ε, as before
    second.save_model(tmp_path / "m2.pt")
    third = _steps(
        load_model(nn.Linear(5, 3), tmp_path / "m2.pt"), data, 3, prior=tmp_path / "m2.pt"
    )
    first_and_third = composed_epsilon([*first.ledger.entries, *third.ledger.entries], 1e-5)
    assert third.epsilon() >= first_and_third
    assert third.epsilon() == composed_epsilon(
        [*second.ledger.entries, *first.ledger.entries, *third.ledger.entries], 1e-5
    )
    # and a chain of them: disjoint again, then composed, still counts run 1
    third.save_model(tmp_path / "m3.pt")
    fourth = _steps(load_model(nn.Linear(5, 3), tmp_path / "m3.pt"), other, 4, prior="disjoint")
    fourth.save_model(tmp_path / "m4.pt")
    fifth = _steps(
        load_model(nn.Linear(5, 3), tmp_path / "m4.pt"), data, 5, prior=tmp_path / "m4.pt"
    )
    assert fifth.epsilon() >= composed_epsilon(
        [*first.ledger.entries, *third.ledger.entries, *fifth.ledger.entries], 1e-5
    )


def test_a_resumed_state_names_its_prior_by_any_path_to_the_same_record(tmp_path, monkeypatch):
    """A run started with prior='m.pt' (relative) was refused on resume with the same record
    named by its absolute path or its .privacy.json: the state compared the path's spelling.
    The events and how they count are what must match."""
    from privgrad.model_file import load_model

    monkeypatch.chdir(tmp_path)
    _, data = _trained_and_saved(tmp_path / "m.pt")
    second = _steps(load_model(nn.Linear(5, 3), "m.pt"), data, seed=2, prior="m.pt")
    state = copy.deepcopy(second.state_dict())
    for named in (tmp_path / "m.pt", tmp_path / "m.privacy.json"):
        resumed = _attach(load_model(nn.Linear(5, 3), "m.pt"), data, 2, prior=named)
        resumed.load_state_dict(state)
        assert resumed.epsilon() == second.epsilon()


def test_a_run_resumed_on_its_saved_weights_loaded_first_is_not_refused(tmp_path):
    """Resuming in the process that saved the model: the checkpoint's weights loaded into the
    model first, then make_private and load_state_dict. make_private refused without prior=
    (the weights are the saved ones), and with prior= that file load_state_dict refused (the
    state's run has no prior): no way through. A state whose events are exactly that record's
    is the run that saved it, and loads, counting its steps once."""
    first, data = _trained_and_saved(tmp_path / "m.pt")
    state = copy.deepcopy(first.state_dict())
    with pytest.raises(privgrad.PrivgradError, match="resuming that run from its state_dict"):
        _attach(_holding(state), data)
    for prior in (tmp_path / "m.pt", tmp_path / "m.privacy.json"):
        resumed = _attach(_holding(state), data, prior=prior)
        resumed.load_state_dict(state)
        for batch in resumed.batches(3):
            resumed.step(batch)
        assert resumed.steps == 15 and "prior" not in resumed.privacy_record()
        assert resumed.epsilon() == privgrad.accounting.pure_dp.composed_epsilon(
            resumed.ledger.entries, 1e-5
        )
    # a state of another run than the record's (8 steps, not 12) is still refused
    other = _steps(nn.Linear(5, 3), data, 1, steps=8)
    resumed = _attach(_holding(state), data, prior=tmp_path / "m.pt")
    with pytest.raises(privgrad.PrivgradError, match="prior="):
        resumed.load_state_dict(other.state_dict())


def test_a_disjoint_run_resumed_on_its_saved_weights_loaded_first_is_not_refused(tmp_path):
    """As above, for a run that was itself prior='disjoint': its record's events are its own
    and the earlier run's it keeps; its state loads into a trainer made with prior= it."""
    from privgrad.model_file import load_model

    _, data = _trained_and_saved(tmp_path / "m.pt")
    second = _steps(load_model(nn.Linear(5, 3), tmp_path / "m.pt"), data, 2, prior="disjoint")
    second.save_model(tmp_path / "m2.pt")
    state = copy.deepcopy(second.state_dict())
    resumed = _attach(_holding(state), data, 2, prior=tmp_path / "m2.pt")
    resumed.load_state_dict(state)
    assert resumed.epsilon() == second.epsilon()
    assert resumed.privacy_record()["prior"] == second.privacy_record()["prior"]


def test_a_lazy_model_is_attached_after_this_process_saved_weights(tmp_path):
    """make_private fingerprints a new model's weights once the process has saved any, to see
    whether it holds them; a lazy layer's parameters hold no values yet, and reading them
    raised torch's ValueError (CI, a worker that had saved a model first)."""
    _trained_and_saved(tmp_path / "m.pt")
    assert _steps(nn.Sequential(nn.LazyLinear(3)), _examples(3), seed=4).steps == 12


def test_a_prior_record_must_be_of_the_models_weights_and_unedited(tmp_path):
    """prior=PATH is checked: the model must hold those weights, and the record's events must
    give its ε; a resumed state must have the same prior."""
    first, data = _trained_and_saved(tmp_path / "m.pt")
    with pytest.raises(privgrad.PrivgradError, match="not the ones whose privacy record"):
        _steps(nn.Linear(5, 3), data, seed=2, prior=tmp_path / "m.pt")
    sidecar = tmp_path / "m.privacy.json"
    record = json.loads(sidecar.read_text())
    record["privacy_events"][0][1] = 1  # one step instead of 12
    sidecar.write_text(json.dumps(record))
    with pytest.raises(privgrad.PrivgradError, match="edited"):
        _steps(_loaded(tmp_path / "m.pt"), data, seed=2, prior=sidecar)


def test_a_resumed_state_keeps_its_prior(tmp_path):
    _, data = _trained_and_saved(tmp_path / "m.pt")
    second = _steps(_loaded(tmp_path / "m.pt"), data, seed=2, prior=tmp_path / "m.pt")
    state = second.state_dict()
    with pytest.raises(privgrad.PrivgradError, match="prior="):
        _attach(nn.Linear(5, 3), data).load_state_dict(state)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--save-model", "/proc/x/model.pt"), "cannot write --save-model"),
    ],
)
def test_an_unwritable_model_path_is_refused_before_training(tmp_path, args, message):
    code, out, err = run_cli(*TRAIN, "--db", str(tmp_path / "runs.db"), *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "runs.db").exists() or RunStore(tmp_path / "runs.db").runs() == []


def test_export_of_an_unknown_run_is_one_line(tmp_path):
    run_cli(*TRAIN, "--db", str(tmp_path / "runs.db"))
    code, _, err = run_cli("export", "7", str(tmp_path / "m.pt"), "--db", str(tmp_path / "runs.db"))
    assert code == 2 and "no run 7" in err and len(err.strip().splitlines()) == 1


def test_a_limited_test_runs_record_says_how_many_examples_its_accuracy_is_of(tmp_path):
    code, out, err = run_cli(
        *TRAIN, "--db", str(tmp_path / "r.db"), "--limit-test", "200",
        "--save-model", str(tmp_path / "m.pt"),
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    privacy = json.loads((tmp_path / "m.privacy.json").read_text())
    assert record["evaluated_examples"] == privacy["evaluated_examples"] == 200
    # privgrad evaluate rebuilds it from the sidecar and scores it on the same 200 examples
    code, out, err = run_cli("evaluate", str(tmp_path / "m.pt"), "--limit-test", "200", "--json")
    assert code == 0, err
    scored = json.loads(out.strip().splitlines()[-1])
    assert scored["test_accuracy"] == scored["recorded_test_accuracy"] == record["test_accuracy"]
    assert scored["evaluated_examples"] == 200 and scored["epsilon"] == record["epsilon"]
    assert f"test accuracy {record['test_accuracy']:.4f} on 200 examples" in err
    assert "ε (honest, PLD)" in err


def test_evaluate_scores_a_saved_model_on_the_whole_test_split(tmp_path, monkeypatch):
    """A model saved on a --limit-test run, scored by privgrad evaluate on all 10,000 test
    examples: the accuracy of the README's three lines on the whole split."""
    monkeypatch.setattr(console, "interactive", lambda: True)  # as in a terminal
    path = tmp_path / "m.pt"
    code, _, err = run_cli(
        *TRAIN, "--db", str(tmp_path / "r.db"), "--limit-test", "200", "--save-model", str(path)
    )
    assert code == 0, err
    code, out, err = run_cli("evaluate", str(path))
    data = load_dataset("mnist")
    accuracy = evaluate(load_for_inference(path), (data.test_x, data.test_y))
    assert code == 0, err
    assert f"test accuracy {accuracy:.4f} on 10000 examples (the run recorded" in out
    # a line for each loading stage (IMDB's took 12 s in silence), then a bar of the examples
    # scored (IMDB's 25,000 reviews took 25 s in silence); --quiet: none
    loading = [f"{path}: loading torch and the model …", "mnist: loading the test split"]
    assert all(err.index(line) < err.index("evaluating") for line in loading), err
    assert "10000/10000" in err
    code, out, err = run_cli("evaluate", str(path), "--quiet")
    assert code == 0 and "evaluating" not in err and "loading" not in err, err
    assert f"test accuracy {accuracy:.4f} on 10000 examples" in out


def test_evaluate_says_in_one_line_what_it_lacks(tmp_path):
    """No file, no sidecar, a sidecar saved from Python (no recipe: the architecture is the
    caller's), weights of another architecture: each one line, no traceback."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    p = privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
        batch_size=10, epochs=1,
    )  # fmt: skip
    weights, sidecar = p.save_model(tmp_path / "api.pt")
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    other = tmp_path / "other.pt"
    torch.save(model.state_dict(), other)
    privacy = json.loads(sidecar.read_text())
    recipe = {"name": "cnn", "input_shape": [1, 28, 28], "num_classes": 10}
    (tmp_path / "other.privacy.json").write_text(json.dumps({**privacy, "model": recipe}))
    moved = tmp_path / "moved.pt"  # an hf: model whose folder is gone since training
    torch.save(model.state_dict(), moved)
    gone = {"name": f"hf:{tmp_path / 'gone'}", "input_shape": [80], "num_classes": 2}
    (tmp_path / "moved.privacy.json").write_text(json.dumps({**privacy, "model": gone}))
    for path, message in (
        (moved, f"cannot rebuild the model {tmp_path / 'moved.privacy.json'} describes"),
        (tmp_path / "none.pt", "no model file at"),
        (sidecar, f"is a privacy record; give the model it describes ({weights}?)"),
        (tmp_path / "bare.pt", "has no privacy record beside it"),
        (weights, 'has no "model" recipe: the model was saved from Python'),
        (other, "cannot load"),
    ):
        code, _, err = run_cli("evaluate", str(path))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_recipes_input_shape_reads_back_from_json_as_training_had_it():
    """build_from_recipe (train's model, evaluate's rebuild) gives a python: model the input
    shape training gave it, a tensor's a tuple, a tuple or dict of inputs' a list or dict of
    tuples; evaluate had made a JSON list of shapes a tuple of lists."""
    from privgrad.app.export import _example_shape, rebuild_recipe
    from privgrad.inputs import example_shape

    for x in (
        torch.zeros(2, 1, 28, 28),
        (torch.zeros(2, 7), torch.zeros(2, 3, 4)),
        {"ids": torch.zeros(2, 9), "mask": torch.zeros(2, 9)},
    ):
        shape = example_shape(x)
        recipe = rebuild_recipe({"model": "cnn"}, shape, 10, None)
        assert _example_shape(json.loads(json.dumps(recipe))["input_shape"]) == shape


def test_an_imdb_models_sidecar_names_its_vocabulary_as_outside_epsilon(tmp_path):
    """IMDB's vocabulary is the training reviews' most frequent words (as in the paper), a
    statistic of the training rows that ε does not cover and that a model's token ids name:
    its sidecar says so, under "inputs" and in "not_covered_by_epsilon"; an image dataset's
    sidecar names no such thing."""
    from privgrad.app.export import privacy_of_run
    from privgrad.model_file import write_privacy_record

    def sidecar(dataset):
        record = {"dataset": dataset, "epsilon": 1.0, "nonfinite_examples": 0}
        path = write_privacy_record(tmp_path / f"{dataset}.privacy.json", privacy_of_run(record))
        return json.loads(path.read_text())

    imdb = sidecar("imdb")
    assert "training reviews" in imdb["inputs"]["vocabulary"]
    assert imdb["not_covered_by_epsilon"] == ["nonfinite_examples", "inputs.vocabulary"]
    assert sidecar("mnist")["not_covered_by_epsilon"] == ["nonfinite_examples"]


def test_the_model_card_states_the_records_guarantee_or_its_absence():
    """model_card (README.md of a save_pretrained folder): ε, δ, σ_eff, q, steps and C as the
    record has them, the paper's claim only where it differs, the unnoised entries; a run
    without a guarantee says so and states no ε."""
    from privgrad.model_file import model_card

    record = {
        "epsilon": 2.71828, "delta": 1e-5, "dp_guarantee": True, "accountant": "pld",
        "neighbouring": "add/remove", "mechanism": "gredp", "effective_noise_multiplier": 0.7071,
        "noise_multiplier": 1.0, "sampling_rate": 0.004, "steps": 1200, "clip": 0.1,
        "epsilon_claimed": 1.5, "seed_source": "secret: drawn from the OS",
        "validation_accuracy": 0.9,
    }  # fmt: skip
    card = model_card(record)
    assert "**(ε, δ) = (2.718, 1e-05)**" in card and "`gredp`" in card
    figures = (
        "effective noise multiplier 0.7071", "(nominal 1)", "sampling rate 0.004", "1200 steps",
        "clip norm 0.1", "paper claims ε = 1.5: not a guarantee", "secret: drawn from the OS",
        "not covered by ε: `validation_accuracy`",
    )  # fmt: skip
    for figure in figures:
        assert figure in card, figure
    assert "claims" not in model_card({**record, "epsilon_claimed": 2.71828})
    none = model_card({**record, "epsilon": float("inf"), "dp_guarantee": False})
    assert "without a differential privacy guarantee" in none and "ε, δ" not in none


def test_the_model_card_of_a_run_with_a_prior_says_what_its_epsilon_covers():
    """A card of weights continued from an earlier run (prior=) stated the run's own steps and
    ε 'for each training example' and no word of the earlier run: composed, the ε counted steps
    the card did not list (5.86 from σ 1, q 0.2, "5 steps", which give 4.0 alone); disjoint
    (fine-tuned on other data), the earlier data's examples were covered at the earlier run's
    larger ε (5.26), not the card's 4.02. Now the card says which."""
    from privgrad.model_file import model_card

    record = {
        "epsilon": 4.0154, "delta": 1e-5, "dp_guarantee": True, "accountant": "pld",
        "neighbouring": "add/remove", "mechanism": "dpsgd", "effective_noise_multiplier": 1.0,
        "noise_multiplier": 1.0, "sampling_rate": 0.125, "steps": 16, "clip": 1.0,
    }  # fmt: skip
    plain = model_card(record)
    assert "for each training example" in plain and "earlier run" not in plain
    disjoint = model_card(
        {**record, "prior": {"weights": "cont.pt", "epsilon": 5.2648, "how": "not composed: x"}}
    )
    assert "for each example of this run's training data" in disjoint
    assert "`cont.pt`, ε = 5.265 there" in disjoint and "that run's guarantee" in disjoint
    composed = model_card(
        {**record, "prior": {"weights": "m.pt", "epsilon": 4.0154, "how": "composed: x"}}
    )
    assert "for each training example" in composed and "16 steps in this run" in composed
    assert "`m.pt`, ε = 4.015 there" in composed and "composes that run's privacy" in composed


def test_the_model_card_of_a_continued_run_states_the_earlier_runs_epsilon(tmp_path):
    """A run continued from saved weights on data stated disjoint (prior='disjoint') has the
    ε of its own steps (0.76 here), while its weights carry the earlier run's (6.45 here, its
    examples' guarantee): the README.md model card stated 0.76 alone, for "each training
    example". It now states the earlier run's ε and which examples it is theirs; a composed
    run's card says its ε counts the earlier steps."""
    from privgrad.model_file import load_model, model_card

    first, _ = _trained_and_saved(tmp_path / "m.pt")
    other = _examples(5)
    model = load_model(nn.Linear(5, 3), tmp_path / "m.pt")
    second = _steps(model, other, 2, steps=4, noise_multiplier=3.0, prior="disjoint")
    card = model_card(second.privacy_record())
    assert second.epsilon() < 1 < 6 < first.epsilon() < 7
    assert f"ε = {first.epsilon():.4g} there" in card
    assert "the examples of that run's data have that run's guarantee" in card
    model = load_model(nn.Linear(5, 3), tmp_path / "m.pt")
    composed = _steps(model, other, seed=3, prior=tmp_path / "m.pt")
    assert "counts every step these weights have taken" in model_card(composed.privacy_record())


class _Pretrained(nn.Linear):
    """A model with save_pretrained (a Hugging Face model's shape): its folder holds its
    weights; from_pretrained reads them back and names the folder (``name_or_path``)."""

    name_or_path = ""

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / "weights.pt")

    @classmethod
    def from_pretrained(cls, folder):
        model = cls(5, 3)
        model.load_state_dict(torch.load(Path(folder) / "weights.pt", weights_only=True))
        model.name_or_path = str(folder)
        return model


def test_a_privately_trained_folder_read_by_from_pretrained_in_another_process_is_not_fresh(
    tmp_path, monkeypatch
):
    """The save_pretrained folder of a private run (privacy.json inside, steps and weights'
    fingerprint), read by from_pretrained in a new process (this process's memory of saved
    weights empty) and trained again: make_private took it as fresh and its ε counted from
    zero (6.45 after 12 steps, where the weights had taken 24: 8.79). The folder the model
    names holds its record: refused until prior= says how it counts, which composes it."""
    from privgrad import model_file

    data = _examples(0)
    torch.manual_seed(0)
    first = _steps(_Pretrained(5, 3), data, seed=1)
    first.save_model(tmp_path / "m.pt")
    import weakref

    from privgrad import private

    monkeypatch.setattr(model_file, "_SAVED", {})  # another process: nothing saved,
    monkeypatch.setattr(private, "_TRAINED_MODELS", weakref.WeakSet())  # nothing trained
    again = _Pretrained.from_pretrained(tmp_path / "m.hf")
    with pytest.raises(privgrad.PrivgradError, match="trained privately already"):
        _steps(again, data, seed=2)
    second = _steps(again, data, seed=2, prior=tmp_path / "m.hf" / "privacy.json")
    assert second.epsilon() > first.epsilon() * 1.3
    # a fresh model that names no such folder is not refused
    assert _steps(_Pretrained(5, 3), data, seed=3).steps == 12


def test_a_card_save_pretrained_wrote_is_kept_with_the_privacy_section_appended(tmp_path):
    """peft's save_pretrained writes a model card (README.md: its base model, library_name);
    privgrad's save of the .hf folder replaced it with its own. The card's text is kept and
    the privacy section appended, as DPTrainer's save_model does."""

    class _Carded(_Pretrained):
        def save_pretrained(self, folder):
            super().save_pretrained(folder)
            (Path(folder) / "README.md").write_text("---\nlibrary_name: peft\n---\n# Adapter\n")

    g = torch.Generator().manual_seed(0)
    data = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    trainer = _steps(_Carded(5, 3), data, seed=1)
    trainer.save_model(tmp_path / "m.pt")
    card = (tmp_path / "m.hf" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n---\n# Adapter\n\n")
    assert "## Differential privacy (privgrad)" in card
    assert f"**(ε, δ) = ({trainer.epsilon():.4g}, " in card


def test_imdb_vocabulary_and_length_from_the_command_line_reach_the_record_and_evaluate(tmp_path):
    """--vocab-size and --max-len (IMDB's load_dataset options) shape the model's inputs: the
    record and sidecar keep them (the sidecar's "inputs" names them and the vocabulary's
    size), evaluate encodes the test reviews as training did, and another dataset refuses
    them in one line."""
    import gzip

    folder = tmp_path / "imdb"
    folder.mkdir()
    words = ["good", "bad", "fine", "dull", "great", "awful", "plot", "cast"]
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 60), ("test", 20)):
        with gzip.open(folder / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            for i in range(n):
                label = i % 2
                ids = torch.randint(0, len(words), (int(torch.randint(2, 9, (1,), generator=g)),))
                text = " ".join(words[j] for j in ids.tolist()) + (" great" if label else " bad")
                f.write(json.dumps({"id": i, "rating": 9 if label else 2, "label": label,
                                    "text": text}) + "\n")  # fmt: skip
    path = tmp_path / "m.pt"
    args = ["--dataset", "imdb", "--model", "bilstm", "--data-dir", str(tmp_path), "--epochs", "1"]
    code, out, err = run_cli(
        "train", *args, "--vocab-size", "5", "--max-len", "6", "--db", str(tmp_path / "r.db"),
        "--save-model", str(path), "--seed", "0", "--json",
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["dataset_options"] == {"vocab_size": 5, "max_len": 6}
    sidecar = json.loads((tmp_path / "m.privacy.json").read_text())
    assert sidecar["dataset_options"] == {"vocab_size": 5, "max_len": 6}
    assert "load_dataset('imdb', max_len=6, vocab_size=5)" in sidecar["inputs"]["formula"]
    assert sidecar["inputs"]["vocabulary"].startswith("the 5 most frequent words")
    assert sidecar["model"]["num_tokens"] == 7  # vocab_size + 2 embedding rows
    code, out, err = run_cli("evaluate", str(path), "--data-dir", str(tmp_path), "--json")
    assert code == 0, err
    scored = json.loads(out.strip().splitlines()[-1])
    assert scored["test_accuracy"] == record["test_accuracy"] and scored["evaluated_examples"] == 20
    code, _, err = run_cli("train", "--max-len", "6", "--db", str(tmp_path / "r.db"))
    assert code != 0 and err.strip() == "error: --max-len applies to --dataset imdb"
