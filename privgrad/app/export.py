"""``privgrad export`` and the sidecar of a finished run: the run store's side of
:mod:`privgrad.model_file`."""

from __future__ import annotations

from pathlib import Path

from privgrad.errors import PrivgradError
from privgrad.model_file import save_model
from privgrad.seeds import seed_source

# what the sidecar keeps of a run record (train.run_record), beside the rebuild recipe
PRIVACY_KEYS = (
    "epsilon",
    "epsilon_rdp",
    "epsilon_claimed",
    "epsilon_claimed_rdp",
    "dp_guarantee",
    "delta",
    "accountant",
    "neighbouring",
    "noise_multiplier",
    "effective_noise_multiplier",
    "sampling_rate",
    "steps",
    "mechanism",
    "clip",
    "batch_size",
    "epochs",
    "train_size",
    "nonfinite_examples",
    "dataset",
    "dataset_options",
    "test_accuracy",
    "validation_accuracy",
    "evaluated_examples",
    "seed_source",  # never the seed: ε holds while it stays secret (privgrad.seeds)
    "privgrad_version",
    "git_commit",
    "code_version",
    "environment",
)


def privacy_of_run(record: dict, rebuild: dict | None = None) -> dict:
    """The sidecar of a run record: its privacy figures, and how to rebuild the model."""
    out = {k: record[k] for k in PRIVACY_KEYS if k in record}
    if rebuild is not None:
        out["model"] = rebuild
    return _with_inputs(out, record.get("dataset"), record.get("dataset_options") or {})


def _with_inputs(privacy: dict, dataset, options: dict) -> dict:
    """``privacy`` with ``"inputs"``: how the dataset's inputs were preprocessed, so the model
    can be evaluated on the dataset's files without privgrad (none for a user's dataset)."""
    from privgrad.app.data import input_preprocessing

    inputs = input_preprocessing(dataset, **options) if isinstance(dataset, str) else None
    return {**privacy, "inputs": inputs} if inputs is not None else privacy


def rebuild_recipe(config: dict, input_shape, num_classes: int, num_tokens: int | None) -> dict:
    """The arguments of :func:`privgrad.app.models.build_model` that give the run's architecture
    (a ``python:`` model: the function to call with ``input_shape`` and ``num_classes``)."""
    return {
        "name": config["model"],
        "input_shape": list(input_shape) if isinstance(input_shape, tuple) else input_shape,
        "num_classes": num_classes,
        "act": config.get("activation", "tanh"),
        "num_tokens": num_tokens,
        "act_params": config.get("activation_params") or {},
        **(config.get("model_options") or {}),
    }


def build_from_recipe(recipe: dict):
    """The model :func:`rebuild_recipe` describes, in memory or read back from JSON: what
    ``privgrad train`` trains and ``privgrad evaluate`` rebuilds."""
    from privgrad.app.models import build_model
    from privgrad.app.plugins import PREFIX as PYTHON, user_model

    recipe = {**recipe, "input_shape": _example_shape(recipe["input_shape"])}
    if recipe["name"].startswith(PYTHON):
        return user_model(recipe["name"], recipe["input_shape"], recipe["num_classes"])
    return build_model(**recipe)


def _example_shape(shape):
    """:func:`privgrad.inputs.example_shape`'s value from its JSON form: a tensor's shape a
    tuple again (JSON made it a list of ints), a list or dict of shapes kept as one."""
    if isinstance(shape, dict):
        return {k: _example_shape(v) for k, v in shape.items()}
    if all(isinstance(v, int) for v in shape):
        return tuple(shape)
    return [_example_shape(v) for v in shape]


def export_run(store, run_id: int, path: str | Path) -> tuple[Path, Path]:
    """``privgrad export``: the weights of run ``run_id``'s last checkpoint, with its privacy
    record: the final record of a completed run; for a stopped one, ε of the steps it ran
    (from the checkpoint's ledgers, which ``resume`` would check against the configuration)."""
    from privgrad.accounting.ledger import decode_entries
    from privgrad.accounting.pure_dp import composed_epsilon
    from privgrad.app.checkpoint import checkpoint_dir, load_checkpoint
    from privgrad.private import NEIGHBOURING, NO_PRIOR, Prior, events_record

    run = store.train_run(run_id, "have a model to export")
    saved = load_checkpoint(checkpoint_dir(store.path, run_id))
    trainer = saved.get("trainer") if isinstance(saved, dict) else None
    if not isinstance(trainer, dict) or not isinstance(trainer.get("model"), dict):
        raise PrivgradError(f"the checkpoint of run {run_id} holds no model")
    # the run its weights continued (--prior): composed, its events count in ε; disjoint, they
    # are kept for a later run composing these weights (make_private's prior=)
    # its run's events (honest, claimed), where the checkpoint holds both ledgers
    logged = "ledger" in trainer and "claimed_ledger" in trainer
    try:
        prior = NO_PRIOR if trainer.get("prior") is None else Prior.from_state(trainer["prior"])
        events = (
            [decode_entries(trainer[k]) for k in ("ledger", "claimed_ledger")] if logged else None
        )
    except (KeyError, TypeError, ValueError) as err:
        raise PrivgradError(f"the checkpoint of run {run_id} is malformed ({err})") from None
    record = run["record"]
    if run["status"] == "completed" and record:
        privacy = privacy_of_run(record, record.get("model_recipe"))
    else:
        if events is None:
            raise PrivgradError(
                f"the checkpoint of run {run_id} is malformed (it holds no ledger of the "
                "privacy events of the steps it ran)"
            )
        run_honest, run_said = events
        try:
            delta = trainer["delta"]
            sampler = trainer["sampler"]
            q = sampler["expected_batch_size"] / sampler["dataset_size"]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            raise PrivgradError(f"the checkpoint of run {run_id} is malformed ({err})") from None
        honest = [*prior.entries, *run_honest]  # a composed --prior run's too
        said = [*prior.claimed_entries, *run_said]
        eps = composed_epsilon(honest, delta, "pld", "best")
        cfg, made_by = run["config"], saved.get("made_by") or {}
        privacy = {
            "status": run["status"],
            "epsilon": eps,
            "epsilon_claimed": composed_epsilon(said, delta, "pld", "basic"),
            "epsilon_claimed_rdp": composed_epsilon(said, delta, "rdp", "basic"),
            "epsilon_rdp": composed_epsilon(honest, delta, "rdp", "best"),
            "dp_guarantee": eps != float("inf"),
            "delta": delta,
            "accountant": "pld",
            "neighbouring": NEIGHBOURING,
            # the build_model arguments the run saved with its checkpoints (older ones: the name)
            "model": saved.get("model_recipe") or {"name": run["config"].get("model")},
            "noise_multiplier": trainer.get("mechanism", {}).get("noise_multiplier"),
            "effective_noise_multiplier": saved.get("effective_noise_multiplier"),
            "sampling_rate": q,
            "steps": sum(n for _, n in run_honest),
            **{k: cfg.get(k) for k in ("mechanism", "clip", "batch_size", "epochs", "dataset")},
            "dataset_options": cfg.get("dataset_options") or {},
            "train_size": sampler["dataset_size"],
            "nonfinite_examples": trainer.get("nonfinite_examples"),
            "seed_source": seed_source(cfg.get("seed") is not None),
            "git_commit": run.get("git_commit"),
            # checkpoints written before they carried these: absent
            **{
                k: made_by[k]
                for k in ("privgrad_version", "code_version", "environment")
                if k in made_by
            },
        }
        privacy = _with_inputs(privacy, cfg.get("dataset"), privacy["dataset_options"])
    # what a run continuing from these weights composes (make_private's prior=)
    if events is not None:
        privacy = {**privacy, **events_record(prior, *events)}
    if isinstance(saved.get("trained_parameters"), list):  # checkpoints written since 2026-12-07
        privacy["trained_parameters"] = saved["trained_parameters"]
    folders = [(record or {}).get("hugging_face_folder")] if run["status"] == "completed" else []
    model = _hugging_face_or_weights(privacy.get("model"), folders, trainer["model"])
    return save_model(model, path, privacy)


def _hugging_face_or_weights(recipe, folders: list, weights: dict):
    """The checkpoint's ``weights`` loaded into the ``hf:`` model of ``recipe`` (so
    :func:`~privgrad.model_file.save_model` writes its ``save_pretrained`` folder too), built
    from the folder training read or else from one of ``folders`` (the run's saved ones); or
    the weights alone: any other model, or no such folder that is still there and fits."""
    from privgrad.app.models.hf import PREFIX

    if not isinstance(recipe, dict) or not str(recipe.get("name", "")).startswith(PREFIX):
        return weights
    names = [recipe["name"]] + [f"{PREFIX}{f}" for f in folders if isinstance(f, str)]
    for name in names:
        try:
            model = build_from_recipe({**recipe, "name": name})
            model.load_state_dict(weights)
        except (PrivgradError, RuntimeError, KeyError, TypeError):
            continue
        return model
    return weights
