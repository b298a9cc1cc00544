"""``privgrad evaluate``: a model saved by ``privgrad train --save-model`` or ``privgrad export``,
rebuilt from its sidecar (:mod:`privgrad.model_file`) and scored on its dataset's test split,
as the run scored it; the sidecar's privacy figures beside the score."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from privgrad.app.console import status
from privgrad.errors import PrivgradError
from privgrad.model_file import SIDECAR_SUFFIX, sidecar_path


def load_model(path: str | Path) -> tuple[nn.Module, dict]:
    """The model saved at ``path``, rebuilt by its sidecar's ``"model"`` recipe (the arguments
    of :func:`privgrad.app.models.build_model`, or a ``python:`` model's function; an ``hf:``
    model from the ``save_pretrained`` folder saved beside it, where there is one) with the
    saved weights, on the CPU in eval mode; and the sidecar. Every missing piece is one line."""
    from privgrad.app.export import build_from_recipe

    path = Path(path)
    if path.name.endswith(SIDECAR_SUFFIX):
        weights = path.with_name(path.name[: -len(SIDECAR_SUFFIX)] + ".pt")
        raise PrivgradError(f"{path} is a privacy record; give the model it describes ({weights}?)")
    side = sidecar_path(path)
    if not path.is_file():
        raise PrivgradError(f"no model file at {path}")
    if not side.is_file():
        raise PrivgradError(f"{path} has no privacy record beside it ({side} is missing)")
    try:
        privacy = json.loads(side.read_text())
    except (OSError, ValueError) as err:
        raise PrivgradError(f"cannot read the privacy record {side}: {err}") from None
    recipe = privacy.get("model")
    if not isinstance(recipe, dict):
        raise PrivgradError(
            f'{side} has no "model" recipe: the model was saved from Python '
            "(save_model of make_private's trainer, attach's optimizer or DPTrainer), whose "
            f"architecture is the caller's; build it and load torch.load('{path}', "
            "weights_only=True) into it"
        )
    folder = privacy.get("hugging_face_folder")
    if isinstance(folder, str) and recipe.get("name", "").startswith("hf:"):
        if path.with_name(folder).is_dir():  # the trained model's own config, saved with it
            recipe = {**recipe, "name": f"hf:{path.with_name(folder)}"}
    try:
        model = build_from_recipe(recipe)
    except PrivgradError as err:  # an hf: or python: model whose folder or module moved
        raise PrivgradError(
            f"cannot rebuild the model {side} describes ({recipe.get('name')!r}, read again "
            f"as in training; the trained weights are in {path}): {err}"
        ) from None
    try:
        weights = torch.load(path, weights_only=True, map_location="cpu")
        model.load_state_dict(weights)
    except Exception as err:  # a file that is no state_dict, or another architecture's
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PrivgradError(
            f"cannot load {path} into the model its sidecar describes: {first}"
        ) from None
    return model.eval(), privacy


def evaluate_model(
    path: str | Path,
    data_dir: str | None = None,
    limit_test: int | None = None,
    device: str = "auto",
    progress: bool = False,
) -> dict:
    """The saved model at ``path`` (:func:`load_model`) scored on the test split of the dataset
    it was trained on (all of it, or the fixed sample of ``limit_test`` examples that
    ``privgrad train --limit-test`` evaluates on), loaded and preprocessed as training loaded
    it. Returns the sidecar's entries, with ``test_accuracy`` and ``evaluated_examples``
    measured now, the sidecar's own under ``recorded_test_accuracy`` and
    ``recorded_evaluated_examples``, and ``model_path``. ``progress``: in a terminal, a status
    line while the data load, then a bar of the examples scored, on stderr (IMDB's 25,000
    reviews took 12 s to load and 25 s to score with a tiny BERT on a CPU)."""
    from privgrad.app.train import TrainConfig, evaluate, load_training_data
    from privgrad.device import resolve_device

    model, privacy = load_model(path)
    dataset = privacy.get("dataset")
    if not isinstance(dataset, str):
        raise PrivgradError(
            f"{sidecar_path(path)} does not name the dataset the model was trained on"
        )
    config = TrainConfig(
        dataset=dataset,
        dataset_options=privacy.get("dataset_options") or {},  # IMDB's vocabulary and length
        data_dir=data_dir,
        limit_test=limit_test,
    )
    config.validate()
    if progress:
        status(f"{dataset}: loading the test split, preprocessed as in training …")
    evaluated = load_training_data(config)["eval"]
    device = resolve_device(device)
    total = len(evaluated[1] if isinstance(evaluated, tuple) else evaluated)
    with tqdm(
        total=total, disable=not progress, unit="example", dynamic_ncols=True, desc="evaluating"
    ) as bar:
        accuracy = evaluate(model.to(device), evaluated, device, progress=bar)
    out = {k: v for k, v in privacy.items() if k not in ("test_accuracy", "evaluated_examples")}
    return {
        **out,
        "model_path": str(path),
        "test_accuracy": accuracy,
        "evaluated_examples": total,
        "recorded_test_accuracy": privacy.get("test_accuracy"),
        "recorded_evaluated_examples": privacy.get("evaluated_examples"),
    }
