"""``privgrad train --model hf:PATH``: a Hugging Face model from a folder written by
``save_pretrained`` (tiny, random weights: nothing is downloaded) trains under DP-SGD from
the command line: ViT on MNIST (the repository's data/), BERT on token ids padded with 0,
GPT-2 and Mixtral on Hugging Face style dict examples, OPT, Qwen3.5 (linear attention), T5
and BART (read at each example's end token) on token ids; what cannot work is one line."""

import json
import math
import sys

import pytest
import torch

from cli_helpers import run_cli

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

HIDDEN = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
VOCAB, LENGTH = 40, 8

PLUGIN = f'''
import torch
from torch.utils.data import Dataset

VOCAB, LENGTH = {VOCAB}, {LENGTH}


class Tokens(Dataset):
    """Token ids padded with 0 (as the built-in text data); label: is token 1 present."""

    def __init__(self, n, seed, as_dict):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        self.ids, self.y = ids * self.mask, (ids == 1).any(1).long()
        self.as_dict = as_dict

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.as_dict:
            return {{"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}}
        return self.ids[i], self.y[i]


def tensors():
    return Tokens(200, 0, False), Tokens(50, 1, False), 2


def dicts():
    return Tokens(200, 0, True), Tokens(50, 1, True), 2
'''


def save(model, path):
    model.save_pretrained(path)
    return f"hf:{path}"


def vit(path):
    config = transformers.ViTConfig(
        image_size=28, patch_size=7, num_channels=1, num_labels=10, **HIDDEN
    )
    return save(transformers.ViTForImageClassification(config), path)


def bert(path):
    config = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=16, **HIDDEN)
    return save(transformers.BertForSequenceClassification(config), path)  # dropout 0.1 kept


def gpt2(path):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, num_labels=5
    )  # no pad_token_id (as GPT-2's own), 5 labels: a new head for the data's 2 classes
    return save(transformers.GPT2ForSequenceClassification(config), path)


def opt(path):
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=2,
        word_embed_proj_dim=32,
    )  # its decoder layers flatten the tokens to (B·T, d): read example-major once checked
    return save(transformers.OPTForSequenceClassification(config), path)


def mpnet(path):
    config = transformers.MPNetConfig(vocab_size=VOCAB, max_position_embeddings=20, **HIDDEN)
    # its relative-attention bias is a table the batch shares: attributed where it meets it
    return save(transformers.MPNetForSequenceClassification(config), path)


def mixtral(path):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, max_position_embeddings=16, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, pad_token_id=0,
    )  # fmt: skip
    # a mixture of experts: its experts take the tokens flattened and routed (experts.py)
    return save(transformers.MixtralForSequenceClassification(config), path)


def qwen3_5(path):
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, max_position_embeddings=16, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
        pad_token_id=0,
    )  # fmt: skip
    # a linear-attention mixer that reads its conv1d's weight (rules.READ_CHILDREN), saved
    # with use_cache=True (transformers' default), which the loader turns off
    assert config.use_cache
    return save(transformers.Qwen3_5TextForSequenceClassification(config), path)


def t5(path):
    config = transformers.T5Config(
        vocab_size=VOCAB + 1, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2
    )  # eos 1: the data's ids move up by 1; saved without a decoder_start_token_id
    assert getattr(config, "decoder_start_token_id", None) is None
    return save(transformers.T5ForSequenceClassification(config), path)


BART = dict(
    d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
)  # fmt: skip


def bart(path):
    config = transformers.BartConfig(
        vocab_size=VOCAB + 2, max_position_embeddings=LENGTH + 1, **BART
    )  # eos 2, pad 1 (the loader makes it 0); LENGTH + 1 positions: the data's and the end
    return save(transformers.BartForSequenceClassification(config), path)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "hfdata.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def train(tmp_path, *args):
    return run_cli(
        "train", *args, "--epochs", "1", "--batch-size", "50", "--db", str(tmp_path / "r.db")
    )


@pytest.mark.parametrize(
    "build, data",
    [
        (vit, "mnist"),
        (bert, "python:hfdata:tensors"),
        (gpt2, "python:hfdata:dicts"),
        (opt, "python:hfdata:tensors"),
        (mpnet, "python:hfdata:tensors"),
        (mixtral, "python:hfdata:dicts"),
        (qwen3_5, "python:hfdata:tensors"),
        (t5, "python:hfdata:tensors"),
        (bart, "python:hfdata:tensors"),
    ],
)
def test_the_command_line_trains_a_saved_model(build, data, plugin):
    spec = build(plugin / "model")
    limit = ["--limit-train", "200"] if data == "mnist" else []
    code, out, err = train(plugin, "--dataset", data, "--model", spec, *limit, "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["model"] == spec and record["steps"] == 4, record
    assert 0 < record["epsilon"] < math.inf and 0 <= record["test_accuracy"] <= 1, record


def test_missing_folder_config_and_transformers_are_one_line(plugin, monkeypatch):
    data = ["--dataset", "python:hfdata:tensors"]
    (plugin / "empty").mkdir()
    (plugin / "broken").mkdir()
    (plugin / "broken" / "config.json").write_text("{")
    cases = [
        (f"hf:{plugin / 'none'}", f"no folder {plugin / 'none'}"),
        (f"hf:{plugin / 'empty'}", "holds no config.json"),
        (f"hf:{plugin / 'broken'}", "its config.json cannot be read"),
        ("hf:", "write hf:PATH"),
    ]
    for spec, needle in cases:
        code, _, err = train(plugin, *data, "--model", spec)
        assert code == 2 and err.count("\n") == 1 and needle in err, err
    spec = vit(plugin / "vit")
    code, _, err = train(plugin, *data, "--model", spec)
    assert code == 2 and "takes images of shape (1, 28, 28)" in err, err
    short = transformers.BartForSequenceClassification(
        transformers.BartConfig(vocab_size=VOCAB + 2, max_position_embeddings=LENGTH, **BART)
    )  # room for the data's tokens, not for the end token after them
    code, _, err = train(plugin, *data, "--model", save(short, plugin / "short"))
    assert code == 2 and f"are {LENGTH + 1} long with its end token" in err, err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the extra were not installed
    code, _, err = train(plugin, *data, "--model", spec)
    assert code == 2 and err.count("\n") == 1 and "pip install -e '.[hf]'" in err, err


def test_the_wrapper_feeds_token_ids_as_hugging_face_would():
    """Token ids reach the model with the attention mask of their padding and positions
    0..T−1 for every example, as the model's own defaults give one example."""
    from privgrad.app.models.hf import HFClassifier

    config = transformers.BertConfig(
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=3, **HIDDEN
    )
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(1, VOCAB, (3, LENGTH))
    ids[0, 5:] = 0
    got = HFClassifier(model)(ids)
    for i in range(3):
        n = int((ids[i] != 0).sum())
        torch.testing.assert_close(got[i], model(ids[i : i + 1, :n]).logits[0])


@pytest.mark.parametrize("build", [t5, bart])
def test_the_wrapper_ends_each_example_as_a_tokenizer_would(build, tmp_path):
    """A model read at its end token gets, for each padded example, what it gets for that
    example alone as its tokenizer gives it: the data's ids moved clear of the end token,
    then the end token."""
    from privgrad.app.models.hf import load_hf_model

    wrapper = load_hf_model(build(tmp_path / "model"), (LENGTH,), 3, VOCAB).eval()
    model, eos = wrapper.model, wrapper.eos_token_id
    assert eos == model.config.eos_token_id > 0 and model.config.pad_token_id == 0
    ids = torch.randint(1, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(0))
    ids[0, 3:] = 0
    ids[1, 6:] = 0
    ids[2, :] = eos  # data ids equal to the end token are words like any other
    got = wrapper(ids)
    assert got.shape == (4, 3)
    for i in range(4):
        n = int((ids[i] != 0).sum())
        alone = torch.cat([ids[i, :n] + eos, torch.tensor([eos])])[None]
        torch.testing.assert_close(got[i], model(input_ids=alone).logits[0])


def test_a_saved_model_comes_home_as_save_pretrained_writes_it(plugin):
    """--save-model of an hf: model also writes <stem>.hf/, a save_pretrained folder with the
    privacy record inside: from_pretrained reads it and gives the trained model's logits (its
    config holds the data's 2 labels, the padding id 0). privgrad evaluate rebuilds from it,
    so the model scores with its training-time folder gone, and privgrad export of the run
    writes one too."""
    import shutil

    from privgrad.app.evaluate import load_model

    spec = bert(plugin / "model")
    db = str(plugin / "r.db")
    code, out, err = run_cli(
        "train", "--dataset", "python:hfdata:tensors", "--model", spec, "--epochs", "1",
        "--batch-size", "50", "--db", db, "--save-model", str(plugin / "dp.pt"), "--json",
    )  # fmt: skip
    assert code == 0, err
    folder = plugin / "dp.hf"
    assert f"and as save_pretrained writes it to {folder}/" in err
    sidecar = json.loads((plugin / "dp.privacy.json").read_text())
    inside = json.loads((folder / "privacy.json").read_text())
    assert sidecar["hugging_face_folder"] == "dp.hf"
    # the same record, but for the fingerprint of the weights from_pretrained gives back
    assert {**inside, "weights_sha256": None} == {**sidecar, "weights_sha256": None}
    assert sidecar["epsilon"] == json.loads(out)["epsilon"]

    trained, _ = load_model(plugin / "dp.pt")
    home = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert home.config.num_labels == 2 and home.config.pad_token_id == 0
    ids = torch.tensor([[3, 1, 5, 0, 0, 0, 0, 0], [7, 8, 9, 4, 2, 6, 0, 0]])
    with torch.no_grad():
        theirs = home(input_ids=ids, attention_mask=(ids != 0).long()).logits
        ours = trained(ids)
    torch.testing.assert_close(theirs, ours)
    assert not torch.equal(  # the trained weights, not the folder's initial ones
        home.classifier.weight,
        transformers.AutoModelForSequenceClassification.from_pretrained(
            plugin / "model", num_labels=2
        ).classifier.weight,
    )

    # the folder's weights attached again count the run that trained them (prior=)
    import privgrad
    from privgrad.model_file import weights_fingerprint

    assert inside["weights_sha256"] == weights_fingerprint(home.state_dict())
    data = (ids.repeat(10, 1), torch.tensor([0, 1] * 10))
    optimizer = torch.optim.SGD(home.parameters(), lr=0.1)
    with pytest.raises(privgrad.PrivgradError, match="trained privately already"):
        privgrad.make_private(home, optimizer, data, noise_multiplier=1.0, batch_size=5)
    again = privgrad.make_private(
        home, optimizer, data, noise_multiplier=1.0, batch_size=5, prior=folder / "privacy.json"
    )
    assert again.epsilon() == sidecar["epsilon"]  # the earlier run's steps, none of its own yet

    shutil.rmtree(plugin / "model")  # the folder training read is gone
    code, out, err = run_cli("evaluate", str(plugin / "dp.pt"), "--json")
    assert code == 0, err
    assert json.loads(out)["test_accuracy"] == sidecar["test_accuracy"]

    code, out, err = run_cli("export", "1", str(plugin / "again.pt"), "--db", db)
    assert code == 0, err
    assert f"and as save_pretrained writes it to {plugin / 'again.hf'}/" in out
    again = transformers.AutoModelForSequenceClassification.from_pretrained(plugin / "again.hf")
    torch.testing.assert_close(again.state_dict(), home.state_dict())
    shutil.rmtree(folder)  # neither the folder training read nor the run's own is left
    code, out, err = run_cli("export", "1", str(plugin / "bare.pt"), "--db", db)
    assert code == 0 and "no save_pretrained folder" in out, (out, err)
    assert not (plugin / "bare.hf").exists()
    assert "hugging_face_folder" not in json.loads((plugin / "bare.privacy.json").read_text())


def test_the_command_line_continues_a_saved_hf_folder_with_prior(plugin):
    """privgrad train --model hf:<the .hf folder a private run saved> is refused until --prior
    says how that run counts (the message names the flag); --prior PATH composes its events
    (with --noise-multiplier: no calibration across runs), its ε the PLD accountant's on both
    runs' events; --prior disjoint counts this run alone and its record says so."""
    from privgrad.accounting.ledger import PrivacyLedger
    from privgrad.accounting.pure_dp import composed_epsilon

    spec = vit(plugin / "vit")
    args = ("--limit-train", "200", "--json")
    code, out, err = train(plugin, "--model", spec, *args, "--save-model", "m.pt")
    assert code == 0, err
    first = json.loads((plugin / "m.hf" / "privacy.json").read_text())
    code, _, err = train(plugin, "--model", "hf:m.hf", *args)
    assert code == 2 and "(privgrad train --prior m." in err, err  # m.pt here, found in memory
    sigma = str(first["noise_multiplier"])
    code, _, err = train(plugin, "--model", "hf:m.hf", *args, "--prior", "m.hf/privacy.json")
    assert code == 2 and "--noise-multiplier" in err, err  # no calibration across runs
    code, out, err = train(
        plugin, "--model", "hf:m.hf", *args, "--prior", "m.hf/privacy.json",
        "--noise-multiplier", sigma,
    )  # fmt: skip
    assert code == 0, err
    both = json.loads(out.strip().splitlines()[-1])
    earlier = PrivacyLedger()
    earlier.load_state_dict(first["privacy_events"])
    assert earlier.steps == 4 and both["steps"] == 4
    want = composed_epsilon([*earlier.entries, *earlier.entries], 1e-5)  # the same plan twice
    assert math.isclose(both["epsilon"], want, rel_tol=1e-9) and both["epsilon"] > first["epsilon"]
    code, out, err = train(plugin, "--model", "hf:m.hf", *args, "--prior", "disjoint")
    assert code == 0, err
    alone = json.loads(out.strip().splitlines()[-1])
    assert math.isclose(alone["epsilon"], first["epsilon"], rel_tol=1e-9)


def test_a_prior_run_saved_or_exported_keeps_the_earlier_runs_events(plugin, monkeypatch):
    """The weights of a --prior run, saved (--save-model) or exported (privgrad export), carry
    the earlier run's privacy events as make_private's save_model does: its record had held
    this run's alone. A --prior disjoint run's record lost the earlier run's events, so a run
    continuing it on data that may share examples with that run (--prior its record) printed
    ε = 1.357 (runs 2 and 3) where the PLD accountant on all three runs' events gives 1.640;
    a composed run's record stated ε of both runs beside the events of one, so it could not be
    continued at all; a stopped composed run's export said ε = 0.803 (its 5 steps) where its
    checkpoint's trainer counted 1.264 with the earlier run's 8."""
    import sqlite3

    from privgrad.accounting.ledger import PrivacyLedger
    from privgrad.accounting.pure_dp import composed_epsilon
    from cli_helpers import interrupt_at_step

    spec = vit(plugin / "vit")
    args = ("--limit-train", "200", "--json")
    code, out, err = train(plugin, "--model", spec, *args, "--save-model", "m1.pt")
    assert code == 0, err
    first = json.loads((plugin / "m1.hf" / "privacy.json").read_text())
    run = PrivacyLedger()
    run.load_state_dict(first["privacy_events"])
    assert run.steps == 4  # each run below: the same plan, the same 4 events

    def eps(runs):
        return composed_epsilon([*run.entries] * runs, 1e-5)

    sigma = ("--noise-multiplier", str(first["noise_multiplier"]))
    code, out, err = train(
        plugin, "--model", "hf:m1.hf", *args, "--prior", "disjoint", *sigma, "--save-model", "m2.pt"
    )
    assert code == 0, err
    assert math.isclose(json.loads(out.strip().splitlines()[-1])["epsilon"], eps(1), rel_tol=1e-9)
    second = json.loads((plugin / "m2.hf" / "privacy.json").read_text())
    assert second["prior"]["how"].startswith("not composed")
    assert (
        "each example of this run's training data" in (plugin / "m2.hf" / "README.md").read_text()
    )
    code, out, err = train(
        plugin, "--model", "hf:m2.hf", *args, "--prior", "m2.hf/privacy.json", *sigma,
        "--save-model", "m3.pt",
    )  # fmt: skip
    assert code == 0, err
    third = json.loads(out.strip().splitlines()[-1])
    assert math.isclose(third["epsilon"], eps(3), rel_tol=1e-9), third["epsilon"]
    assert third["prior"]["how"].startswith("composed")
    code, out, err = run_cli("runs", "show", str(third["run_id"]), "--db", str(plugin / "r.db"))
    assert code == 0 and "from the weights of m2.hf/privacy.json" in out, (out, err)
    # the composed run's saved record is continued in turn, its ε counting all four runs
    code, out, err = train(plugin, "--model", "hf:m3.hf", *args, "--prior", "m3.pt", *sigma)
    assert code == 0, err
    assert math.isclose(json.loads(out.strip().splitlines()[-1])["epsilon"], eps(4), rel_tol=1e-9)

    # a composed run stopped after 2 of its 4 steps, exported: the earlier run's steps count
    interrupt_at_step(monkeypatch, 3)
    code, _, err = train(plugin, "--model", "hf:m1.hf", *args, "--prior", "m1.pt", *sigma)
    assert code == 130, err
    stopped = sqlite3.connect(plugin / "r.db").execute("SELECT MAX(id) FROM runs").fetchone()[0]
    code, _, err = run_cli("export", str(stopped), "x.pt", "--db", str(plugin / "r.db"))
    assert code == 0, err
    exported = json.loads((plugin / "x.privacy.json").read_text())
    want = composed_epsilon([*run.entries, (run.entries[0][0], 2)], 1e-5)
    assert exported["steps"] == 2 and math.isclose(exported["epsilon"], want, rel_tol=1e-9)
    assert exported["prior"]["how"].startswith("composed")


def test_a_model_too_small_for_imdb_names_the_options_that_fit_it():
    """A tiny hf: model refused for IMDB's ids or length said only how far the data's ids or
    length go (20,001 and 80 by default), not that --vocab-size and --max-len set them."""
    from types import SimpleNamespace

    from privgrad.app.models.hf import _check_shape
    from privgrad.errors import PrivgradError

    config = SimpleNamespace(vocab_size=50, max_position_embeddings=32)
    with pytest.raises(PrivgradError, match="ids go up to 101 .*--vocab-size"):
        _check_shape("hf:tiny", config, False, (16,), 102, None)
    with pytest.raises(PrivgradError, match="are 80 long .*--max-len"):
        _check_shape("hf:tiny", config, False, (80,), 50, None)
