"""The ``privgrad`` command line."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import warnings
from pathlib import Path

import click

from privgrad.app.console import status
from privgrad.errors import PrivgradError

try:  # the registry loads PRIVGRAD_MECHANISMS' plugins here: a bad entry is one line
    from privgrad.app.defaults import (
        BATCH_FRACTION,
        DATASET_NAMES,
        GAN_MODES,
        DEFAULT_EPSILON,
        MECHANISM_NAMES,
        MODEL_NAMES,
        OPTIMIZER_NAMES,
        defaults_table,
    )
except PrivgradError as err:
    click.echo(f"error: {err} (named in the environment variable PRIVGRAD_MECHANISMS)", err=True)
    sys.exit(2)
from privgrad.mechanisms.registry import cli_options
from privgrad.signals import Terminated, terminations_as_interrupts
from privgrad.app.store import DEFAULT_DB, RunStore
from privgrad.records import to_json
from privgrad.validate import PRECISIONS, check_numbers


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while a command runs: one line, ``warning: ...`` as the CLI's
    own warnings read, without the file, line and source of Python's format (the library's
    warnings name the user's line, which on the command line is click's)."""
    text = " ".join(str(message).split())
    kind = "" if category is UserWarning else f" ({category.__name__})"
    click.echo(f"warning{kind}: {text}", err=True)


def _fmt_eps(eps) -> str:
    return "∞ (no DP guarantee)" if eps is None or math.isinf(eps) else f"{eps:.4f}"


# the option values of the command being run (flag -> value), for naming the user's code in errors
_OPTIONS: dict[str, object] = {}


class CheckedNumbers:
    """A command (or group) whose numeric options are checked (finite, in range) before it runs."""

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        _OPTIONS.clear()
        _OPTIONS.update(
            {p.opts[0]: ctx.params.get(p.name) for p in self.params if isinstance(p, click.Option)}
        )
        check_numbers(
            self.name,
            {
                p.opts[0] if isinstance(p, click.Option) else p.human_readable_name: ctx.params[
                    p.name
                ]
                for p in self.params
                if isinstance(p.type, (click.types.FloatParamType, click.types.IntParamType))
            },
        )
        return rest


class Command(CheckedNumbers, click.Command):
    pass


class Group(CheckedNumbers, click.Group):
    command_class = Command


def _stopped_run(stop: KeyboardInterrupt) -> str:
    """Which run an interrupt stopped, and how to go on with it (train runs resume)."""
    stopped = getattr(stop, "stopped_run", None)
    if stopped is None:
        return ""
    db, run_id, kind = stopped
    if kind != "train":
        return f": run {run_id} is stored as interrupted"
    from privgrad.app.checkpoint import FILENAME, checkpoint_dir

    if not (checkpoint_dir(db, run_id) / FILENAME).exists():  # stopped before its first step
        return (
            f": run {run_id} stopped before its first checkpoint, so there is nothing to "
            f"resume; start it again"
        )
    now = _spent_so_far(db, run_id, {})
    where = f" after {now['steps']} of {now['planned_steps']} steps" if "steps" in now else ""
    return (
        f": run {run_id} is saved{where} (privgrad runs show {run_id} --db {db}); continue it "
        f"with: privgrad resume {run_id} --db {db}"
    )


def _string_options() -> dict[str, str]:
    """The running command's options given as text (``--model python:…``)."""
    return {k: v for k, v in _OPTIONS.items() if isinstance(v, str)}


class Main(click.Group):
    """Turns privgrad's own errors and bad command-line values into one line on stderr and
    exit status 2, and warnings into one line ``warning: ...``; Ctrl-C, SIGTERM and SIGHUP
    stop a command the same way (runs stored as ``interrupted``)."""

    command_class = Command

    def invoke(self, ctx):
        try:
            with terminations_as_interrupts(), warnings.catch_warnings():
                warnings.showwarning = _show_warning  # restored when the command ends
                return super().invoke(ctx)
        except PrivgradError as err:  # (one raised from the user's code names it too)
            from privgrad.app.plugins import user_code_error

            _fail(user_code_error(err, _string_options()) or str(err))
        except click.UsageError as err:
            where = f" (see '{err.ctx.command_path} --help')" if err.ctx else ""
            _fail(err.format_message() + where)
        except Terminated as stop:
            _fail(f"interrupted by {stop}{_stopped_run(stop)}", stop.exit_code)
        except KeyboardInterrupt as stop:
            _fail(f"interrupted{_stopped_run(stop)}", 130)
        except click.exceptions.Exit:  # --help, --version: a RuntimeError in click 8.2+
            raise
        except Exception as err:  # the user's python: code raising: one line naming it
            from privgrad.app.plugins import user_code_error

            line = user_code_error(err, _string_options())
            if line is None:
                raise
            _fail(line)


@click.group(cls=Main)
@click.version_option(package_name="privgrad")
def main():
    """Differentially private training with honest privacy accounting."""


# Options several commands share, declared once.
db_option = click.option(
    "--db", default=str(DEFAULT_DB), show_default=True, help="run store (SQLite)"
)
delta_option = click.option("--delta", type=float, default=1e-5, show_default=True)
seed_option = click.option("--seed", type=int, default=0, show_default=True)
secret_seed_option = click.option(
    "--seed",
    type=int,
    default=None,
    help="seed of the sampling, the noise and the initialisation, for a reproducible run "
    "(its ε holds while the seed stays secret); default: a secret seed drawn from the OS",
)
data_dir_option = click.option("--data-dir", default=None, help="folder holding the datasets")
record_out_option = click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="also write the run record to this JSON file",
)
record_json_option = click.option(
    "--json", "as_json", is_flag=True, help="print the run record as JSON on the last line"
)
quiet_option = click.option("--quiet", is_flag=True, help="no progress bar")
noise_multiplier_option = click.option(
    "--noise-multiplier", type=float, default=None, help="nominal σ, instead of --epsilon"
)
limit_train_option = click.option(
    "--limit-train", type=int, default=None, help="use the first N training examples"
)
experiments_dir_option = click.option(
    "--experiments-dir", default=None, help="folder of experiment configs (default: experiments/)"
)


def _names(names) -> str:
    return ", ".join(names)


def _optimizer_used(mechanism, optimizer):
    """The optimizer a run of ``mechanism`` uses: ``optimizer`` where given, else the
    mechanism's own (None for a mechanism privgrad does not list)."""
    from privgrad.app.defaults import MECHANISM_DEFAULTS

    row = MECHANISM_DEFAULTS.get(mechanism)
    return optimizer or (row.optimizer if row is not None else None)


def _check_ignored_options(mechanism, optimizer, momentum, clip, noise_multiplier, target):
    """Refuses options the run would not use, which it ran without and recorded as given:
    --momentum with Adam (dp-adam's own optimizer, or --optimizer adam), --clip with the
    non-private mechanism (which does not clip), --target claimed with --noise-multiplier
    (no calibration: the σ given is the σ used)."""
    used = _optimizer_used(mechanism, optimizer)
    if momentum is not None and used is not None and used != "sgd":
        raise PrivgradError(
            f"--momentum applies to SGD; this run's optimizer is {used}"
            + ("" if optimizer else f" ({mechanism}'s own)")
            + ": leave --momentum out, or pass --optimizer sgd"
        )
    if clip is not None and mechanism == "non-private":
        raise PrivgradError(
            "--clip: the non-private mechanism does not clip; for clipping without noise, "
            "use --mechanism dpsgd --noise-multiplier 0"
        )
    if target == "claimed" and noise_multiplier is not None:
        raise PrivgradError(
            "--target claimed calibrates σ to --epsilon; with --noise-multiplier there is "
            "nothing to calibrate: leave --target out"
        )


def _check_out(out: str | None, flag: str = "--out") -> None:
    """Refuses, before any work, an output file that cannot be written (its folder is made)."""
    if not out:
        return
    path = Path(out)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise PrivgradError(f"cannot write {flag} {out}: {err.strerror or err}") from None


def _check_model_path(path: str | None, what: str = "--save-model") -> None:
    if path:
        from privgrad.model_file import sidecar_path

        _check_out(path, what)
        _check_out(str(sidecar_path(path)), f"{what} (its privacy record)")


def _write_out(out: str | None, record: dict) -> None:
    if not out:
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(json.loads(to_json(record)), indent=2) + "\n")
    except OSError as err:
        raise PrivgradError(
            f"cannot write --out {out}: {err.strerror or err} (the run itself is stored"
            + (f" as run {record['run_id']})" if record.get("run_id") else ")")
        ) from None


RUN_STATUSES = ("completed", "running", "interrupted", "declined", "failed", "lost")


def _option_help(declared: list) -> str:
    """One help line for a flag several mechanisms share: mechanisms with the same help
    are named together ("gip, random-k: …")."""
    groups: dict[str, list[str]] = {}
    for name, info in declared:
        groups.setdefault(info.help, []).append(name)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in groups.items())


def mechanism_options(command):
    """A click option per mechanism option flag, from the registered declarations
    (privgrad.mechanisms.registry); each reaches the command as ``**mechanism_options``."""
    click_types = {int: int, float: float}
    for flag, (first, declared) in reversed(list(cli_options().items())):
        command = click.option(
            flag,
            first.name,
            type=click_types.get(first.type),
            default=None,
            help=_option_help(declared),
        )(command)
    return command


@main.command(
    help=f"""Train a model privately and report honest (and claimed) ε.

Each mechanism's defaults (below) were chosen by a learning-rate search on a validation
split of MNIST with the cnn model at ε = {DEFAULT_EPSILON:g}, 10,000 examples, 3 epochs
(experiments/scripts/defaults.sh, results/defaults/); an option given overrides them.

\b
{defaults_table()}"""
)
@click.option(
    "--mechanism", default="dpsgd", show_default=True, help=f"one of: {_names(MECHANISM_NAMES)}"
)
@click.option(
    "--dataset",
    default="mnist",
    show_default=True,
    help=f"one of: {_names(DATASET_NAMES)}; imagefolder:PATH (one folder per class, optional "
    "train/ and test/); python:module:function → (train, test, num_classes)",
)
@click.option(
    "--model",
    default="cnn",
    show_default=True,
    help=f"one of: {_names(MODEL_NAMES)}; python:module:function, called as "
    "function(input_shape, num_classes); hf:PATH, a Hugging Face model saved there "
    "(pip install -e '.[hf]')",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="cpu, cuda, cuda:N or auto (CUDA if available)",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="fp32",
    show_default=True,
    help="forward and backward under autocast at this precision; per-sample norms, clipping, "
    "noise and the update stay fp32",
)
@click.option(
    "--epsilon",
    type=float,
    default=None,
    help=f"target honest ε (σ is calibrated)  "
    f"[default: {DEFAULT_EPSILON:g}; non-private: no noise, ε = ∞]",
)
@delta_option
@noise_multiplier_option
@click.option(
    "--target",
    type=click.Choice(["honest", "claimed"]),
    default="honest",
    show_default=True,
    help="calibrate σ so that the honest ε, or the paper's claimed ε, equals --epsilon",
)
@click.option(
    "--prior",
    default=None,
    help="for a model holding weights a privgrad run saved (an hf: folder it wrote): PATH "
    "of that run's privacy record (its .privacy.json, or privacy.json in the folder) to "
    "compose its steps into this run's ε (with --noise-multiplier), or 'disjoint' if this "
    "run's data shares no example with that run's",
)
@click.option("--epochs", type=float, default=20, show_default=True)
@click.option(
    "--batch-size",
    type=float,
    default=None,
    help=f"expected Poisson batch size  [default: 1/{1 / BATCH_FRACTION:g} of the training "
    "examples; below 10,000 of them, 40 × epochs (results/small_data)]",
)
@click.option(
    "--lr", type=float, default=None, help="learning rate  [default: the mechanism's, listed above]"
)
@click.option(
    "--optimizer",
    default=None,
    help=f"one of: {_names(OPTIMIZER_NAMES)}  [default: the mechanism's own, listed above]",
)
@click.option(
    "--momentum",
    type=float,
    default=None,
    help="SGD momentum  [default: the mechanism's, listed above]",
)
@click.option(
    "--clip",
    type=float,
    default=None,
    help="L2 clipping norm C  [default: the mechanism's, listed above]",
)
@click.option("--activation", default="tanh", show_default=True, help="tanh, relu or tempered")
@click.option(
    "--ts-scale", type=float, default=None, help="tempered sigmoid s (s·sigmoid(T·x) − o; tanh: 2)"
)
@click.option("--ts-temperature", type=float, default=None, help="tempered sigmoid T (tanh: 2)")
@click.option("--ts-offset", type=float, default=None, help="tempered sigmoid o (tanh: 1)")
@click.option(
    "--block-size",
    type=int,
    default=None,
    help="block-circulant models (model1, lenet5-bc): block size d",
)
@click.option("--depth", type=int, default=None, help="wrn: depth d = 6n + 4 (default 16)")
@click.option(
    "--width",
    type=int,
    default=None,
    help="wrn: width factor k (default 4); cnn: width multiplier (default 1); mlp: 64·width "
    "hidden units (default 1)",
)
@mechanism_options
@secret_seed_option
@limit_train_option
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="imdb: the most frequent training words that get ids (default 20,000)",
)
@click.option("--max-len", type=int, default=None, help="imdb: tokens kept per review (default 80)")
@click.option(
    "--limit-test", type=int, default=None, help="evaluate on a fixed sample of N test examples"
)
@click.option(
    "--validation",
    type=int,
    default=0,
    show_default=True,
    help="hold out N training examples (one fixed split for every run) and report accuracy on "
    "them instead of the test set: for hyper-parameter search",
)
@data_dir_option
@db_option
@record_out_option
@click.option(
    "--save-model",
    type=click.Path(dir_okay=False),
    default=None,
    help="write the trained weights here (torch.load(PATH, weights_only=True) reads them) and "
    "their privacy record beside it (<stem>.privacy.json)",
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False),
    default=None,
    help="also write the metrics as TensorBoard events to DIR/run-<id> (needs the tensorboard "
    "package)",
)
@record_json_option
@quiet_option
@click.option(
    "--nproc",
    type=int,
    default=None,
    help="data-parallel: run N processes on this machine through torch.distributed.run "
    "(or launch with torchrun, which this command joins)",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="CPU threads for torch  [default: OMP_NUM_THREADS if set, else one per usable core, "
    "waiting passively; see results/bench/threads.txt]",
)
@click.option(
    "--strict",
    is_flag=True,
    help="stop with an error when an example's per-sample gradient is not finite (NaN, inf, "
    "overflow), instead of letting it contribute zero (counted in the record)",
)
@click.option(
    "--physical-batch-size",
    type=int,
    default=None,
    help="compute per-sample gradients for at most N examples at once: a larger Poisson batch "
    "is stepped on in chunks (less memory; the same noise and ε)",
)
@click.option(
    "--cuda-graphs",
    is_flag=True,
    help="CUDA only: replay each step's per-sample part and chain as a CUDA graph, batches "
    "padded to a multiple of 32 (faster small-model steps, more GPU memory; the same noise "
    "and ε; DP-SGD, DP-Adam, DP-SignSGD, DP-SignAdam, non-private; experimental: a case "
    "failed once on a shared GPU, see docs/guide.md)",
)
@click.option(
    "--check-ranks",
    is_flag=True,
    help="data-parallel debug: verify every step that all ranks hold identical parameters",
)
def train(
    mechanism,
    dataset,
    model,
    device,
    precision,
    epsilon,
    delta,
    noise_multiplier,
    target,
    prior,
    epochs,
    batch_size,
    lr,
    optimizer,
    momentum,
    clip,
    activation,
    ts_scale,
    ts_temperature,
    ts_offset,
    seed,
    limit_train,
    vocab_size,
    max_len,
    limit_test,
    validation,
    data_dir,
    db,
    out,
    save_model,
    tensorboard,
    as_json,
    quiet,
    block_size,
    depth,
    width,
    nproc,
    check_ranks,
    threads,
    strict,
    physical_batch_size,
    cuda_graphs,
    **mechanism_options,
):
    if not quiet and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks
        status(f"{mechanism} on {dataset}: loading torch and the data …")
    _threads(threads, quiet or nproc is not None)
    from privgrad.app.train import TrainConfig, train as run_train

    act_params = {
        k: v
        for k, v in [("scale", ts_scale), ("temperature", ts_temperature), ("offset", ts_offset)]
        if v is not None
    }
    if act_params and activation != "tempered":
        raise PrivgradError("--ts-scale/--ts-temperature/--ts-offset need --activation tempered")
    given = click.get_current_context().get_parameter_source("activation")
    if given is not click.core.ParameterSource.DEFAULT and model.startswith(("hf:", "python:")):
        # build_model passes it to privgrad's own models only: it was recorded, never used
        raise PrivgradError(
            f"--activation applies to privgrad's built-in models; --model '{model}' has its "
            "own activations (an hf: model its config's, e.g. hidden_act; a python: model your "
            "function's): leave --activation out"
        )
    given_options = (("--block-size", block_size), ("--depth", depth), ("--width", width))
    options = [flag for flag, value in given_options if value is not None]
    if options and model.startswith("python:"):  # an hf: model refuses them when it is built
        raise PrivgradError(
            f"--model '{model}' takes no model options ({', '.join(options)} apply to "
            "privgrad's built-in models; your function builds its own architecture)"
        )
    _check_ignored_options(mechanism, optimizer, momentum, clip, noise_multiplier, target)
    _check_out(out)
    _check_model_path(save_model)
    from privgrad.app.metrics import check_tensorboard_dir

    check_tensorboard_dir(tensorboard)
    config = TrainConfig(
        mechanism=mechanism,
        dataset=dataset,
        model=model,
        epsilon=epsilon,
        delta=delta,
        noise_multiplier=noise_multiplier,
        target=target,
        prior=prior,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        clip=clip,
        activation=activation,
        activation_params=act_params,
        seed=seed,
        limit_train=limit_train,
        limit_test=limit_test,
        validation=validation,
        data_dir=data_dir,
        mechanism_options={k: v for k, v in mechanism_options.items() if v is not None},
        model_options={
            k: v
            for k, v in [("block_size", block_size), ("depth", depth), ("width", width)]
            if v is not None
        },
        dataset_options={
            k: v for k, v in [("vocab_size", vocab_size), ("max_len", max_len)] if v is not None
        },
        device=device,
        precision=precision,
    )
    config.validate()
    from privgrad.device import resolve_device
    from privgrad.distributed import launch, launched_by_torchrun, process_group

    if nproc is not None and not launched_by_torchrun():
        launch(nproc, sys.argv[1:])
        return
    if check_ranks and not launched_by_torchrun():
        raise PrivgradError("--check-ranks needs --nproc or a torchrun launch")
    command = "privgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with process_group(resolve_device(device), verify=check_ranks) as group:
        if group and nproc is not None and nproc != int(os.environ["LOCAL_WORLD_SIZE"]):
            raise PrivgradError(
                f"--nproc {nproc} disagrees with torchrun's "
                f"{os.environ['LOCAL_WORLD_SIZE']} processes per node"
            )
        main_rank = group is None or group.is_main
        store = RunStore(db) if main_rank else None
        record = run_train(
            config,
            store=store,
            progress=not quiet,
            command=command,
            distributed=group,
            save_model=save_model,
            tensorboard=tensorboard,
            strict=strict,
            physical_batch_size=physical_batch_size,
            cuda_graphs=cuda_graphs,
            confirm_plan=(
                (
                    lambda advice: click.confirm(
                        "train with this plan anyway?", default=True, err=True
                    )
                )
                if sys.stdin.isatty() and not quiet
                else None
            ),
        )
    if main_rank:
        _report_train(record, out, as_json)


@main.command()
@click.argument("run_id", type=int)
@db_option
@record_out_option
@click.option(
    "--save-model",
    type=click.Path(dir_okay=False),
    default=None,
    help="write the trained weights and their privacy record here (as train --save-model)",
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False),
    default=None,
    help="also write the metrics as TensorBoard events to DIR/run-<id>",
)
@click.option(
    "--strict",
    is_flag=True,
    help="a non-finite per-sample gradient is an error (as train --strict)",
)
@click.option(
    "--threads", type=int, default=None, help="CPU threads for torch (as train --threads)"
)
@click.option(
    "--physical-batch-size",
    type=int,
    default=None,
    help="at most N examples' per-sample gradients at once (as train --physical-batch-size)",
)
@click.option(
    "--cuda-graphs", is_flag=True, help="steps replayed as CUDA graphs (as train --cuda-graphs)"
)
@record_json_option
@quiet_option
def resume(
    run_id,
    db,
    out,
    save_model,
    tensorboard,
    strict,
    threads,
    physical_batch_size,
    cuda_graphs,
    as_json,
    quiet,
):
    """Continue a stopped 'privgrad train' run from its checkpoint to its planned end."""
    _threads(threads, quiet)
    from privgrad.app.train import resume as run_resume

    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}")
    _check_out(out)
    _check_model_path(save_model)
    from privgrad.app.metrics import check_tensorboard_dir

    check_tensorboard_dir(tensorboard)
    record = run_resume(
        run_id,
        RunStore(db),
        progress=not quiet,
        save_model=save_model,
        tensorboard=tensorboard,
        strict=strict,
        physical_batch_size=physical_batch_size,
        cuda_graphs=cuda_graphs,
    )
    _report_train(record, out, as_json)


@main.command()
@click.argument("run_id", type=int)
@click.argument("path", type=click.Path(dir_okay=False))
@db_option
def export(run_id, path, db):
    """Write run RUN_ID's trained weights to PATH (torch.load(PATH, weights_only=True) reads
    them) and its privacy record beside it (<stem>.privacy.json). A stopped run exports its
    last checkpoint, with the ε of the steps it ran."""
    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}")
    _check_model_path(path, "the model to")
    from privgrad.app.export import export_run

    weights, sidecar = export_run(RunStore(db), run_id, path)
    click.echo(f"run {run_id}: weights in {weights}, privacy record in {sidecar}")
    privacy = json.loads(sidecar.read_text())
    folder, model = privacy.get("hugging_face_folder"), (privacy.get("model") or {}).get("name")
    if folder:
        click.echo(
            f"  and as save_pretrained writes it to {weights.with_name(folder)}/ "
            "(from_pretrained reads it)"
        )
    elif str(model).startswith("hf:"):
        click.echo(
            f"  no save_pretrained folder: the model's folder ({model[3:]}) is gone or no "
            "longer fits its weights, and so is the run's own"
        )


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@data_dir_option
@click.option(
    "--limit-test", type=int, default=None,
    help="evaluate on the fixed sample of N test examples that train --limit-test uses",
)  # fmt: skip
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto")
@record_out_option
@record_json_option
@quiet_option
def evaluate(path, data_dir, limit_test, device, out, as_json, quiet):
    """Score the model saved at PATH (by train --save-model or export) on the test split of
    the dataset it was trained on, rebuilt from its privacy record (<stem>.privacy.json),
    and print that record's ε beside the score."""
    _check_out(out)
    if not quiet:
        status(f"{path}: loading torch and the model …")
    from privgrad.app.evaluate import evaluate_model

    record = evaluate_model(path, data_dir, limit_test, device, progress=not quiet)
    _write_out(out, record)
    recorded = record["recorded_test_accuracy"]
    click.echo(
        f"{path}: {record.get('mechanism', '?')} on {record['dataset']}: test accuracy "
        f"{record['test_accuracy']:.4f} on {record['evaluated_examples']} examples"
        + (
            f" (the run recorded {recorded:.4f} on {record['recorded_evaluated_examples']})"
            if isinstance(recorded, float)
            else ""
        ),
        err=as_json,
    )
    _report_privacy(record, as_json)
    if as_json:
        click.echo(to_json(record))


def _threads(threads: int | None, quiet: bool) -> None:
    """Torch's CPU threads (and a passive OpenMP wait), set before torch starts; said unless
    quiet."""
    from privgrad.app.threads import configure_threads

    n, source = configure_threads(threads)
    if not quiet and os.environ.get("RANK", "0") == "0":
        status(
            f"{n} CPU thread{'s' * (n != 1)} ({source}; --threads to change), "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
        )


def _report_train(record: dict, out: str | None, as_json: bool) -> None:
    _write_out(out, record)
    which = "validation" if "validation_accuracy" in record else "test"
    accuracy = record[which + "_accuracy"]
    accuracy = (
        f"{accuracy:.4f}"
        if accuracy is not None and math.isfinite(accuracy)
        else f"n/a (empty {which} set)"
    )
    click.echo(
        f"{record['mechanism']} on {record['dataset']}: {which} accuracy {accuracy}", err=as_json
    )
    _report_privacy(record, as_json)
    if record.get("model_path"):
        click.echo(
            f"  model saved to {record['model_path']} (privacy record: {record['privacy_path']})",
            err=as_json,
        )
    if record.get("hugging_face_folder"):
        click.echo(
            f"  and as save_pretrained writes it to {record['hugging_face_folder']}/ "
            "(from_pretrained reads it; privacy.json inside)",
            err=as_json,
        )
    if record.get("nonfinite_examples"):
        click.echo(
            f"  {record['nonfinite_examples']} example draw(s) had a per-sample gradient that is "
            "not finite (NaN, inf or overflow) and contributed zero; ε holds (--strict makes "
            "this an error)",
            err=as_json,
        )
    if as_json:
        click.echo(to_json(record))


def _report_privacy(record: dict, as_json: bool) -> None:
    """The honest ε of a run record or sidecar, and the claimed ε where it differs."""
    click.echo(
        f"  ε (honest, {record['accountant'].upper()}) = {_fmt_eps(record['epsilon'])} at δ = "
        f"{record['delta']:g}"
        f"  [σ_eff = {record['effective_noise_multiplier']:.4f}, q = "
        f"{record['sampling_rate']:.5f}, "
        f"{record['steps']} steps]",
        err=as_json,
    )
    claimed, honest = record["epsilon_claimed"], record["epsilon"]
    if not _same_eps(claimed, honest):
        understated = claimed is not None and (honest is None or claimed < honest)
        label = "not a guarantee: below the honest ε" if understated else "valid but looser"
        click.echo(
            f"  ε claimed ({label}) = {_fmt_eps(claimed)}"
            f"  [the paper's nominal σ = {record['noise_multiplier']:.4f}, PLD"
            + (f"; {rdp}" if (rdp := _claimed_rdp(record)) else "")
            + "]",
            err=as_json,
        )


@main.command()
@click.option("--sampling-rate", type=float, required=True, help="Poisson sampling rate q")
@click.option("--noise-multiplier", type=float, required=True, help="noise multiplier σ")
@click.option("--steps", type=int, required=True)
@delta_option
@click.option("--json", "as_json", is_flag=True)
def epsilon(sampling_rate, noise_multiplier, steps, delta, as_json):
    """ε of the Poisson-subsampled Gaussian mechanism (PLD and RDP)."""
    from privgrad.accounting import epsilon_of, poisson_gaussian_event

    event = [(poisson_gaussian_event(sampling_rate, noise_multiplier), steps)]
    result = {
        "sampling_rate": sampling_rate,
        "noise_multiplier": noise_multiplier,
        "steps": steps,
        "delta": delta,
        "epsilon_pld": epsilon_of(event, delta, "pld"),
        "epsilon_rdp": epsilon_of(event, delta, "rdp"),
    }
    pld = _fmt_eps(result["epsilon_pld"])
    if math.isinf(result["epsilon_pld"]) and math.isfinite(result["epsilon_rdp"]):
        # noise there is; the PLD accountant's truncated tails (about 1e-15 each) exceed δ
        pld = "∞ (δ is below what the PLD accountant resolves; the RDP bound holds)"
    if as_json:
        click.echo(to_json(result))
    else:
        click.echo(
            f"ε (PLD) = {pld}\nε (RDP) = "
            f"{_fmt_eps(result['epsilon_rdp'])}"
            f"\n  at δ = {delta:g}, q = {sampling_rate:g}, σ = {noise_multiplier:g}, {steps} steps"
        )


@main.group(cls=Group, invoke_without_command=True)
@db_option
@click.option(
    "--status",
    default=None,
    help="completed, running, interrupted, declined (at the plan's prompt), failed or lost "
    "(died unrecorded)",
)
@click.option("--limit", type=int, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def runs(ctx, db, status, limit, as_json):
    """List and compare the runs in the run store (steps done and ε spent, whatever their
    status); 'privgrad runs show ID' prints one run, its epochs and its privacy record."""
    if ctx.invoked_subcommand is not None:
        return
    if status is not None and status not in RUN_STATUSES:
        raise PrivgradError(f"unknown --status '{status}'; choose from: {_names(RUN_STATUSES)}")
    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}; run 'privgrad train' first")
    store = RunStore(db)
    rows = store.runs(status, limit)
    if as_json:
        click.echo(to_json([_with_progress(store, r) for r in rows]))
        return
    table = [
        (
            "id",
            "kind",
            "status",
            "mechanism",
            "dataset",
            "model",
            "steps",
            "acc",
            "ε",
            "ε claimed",
            "time s",
        )
    ]
    for r in rows:
        rec, cfg = r["record"] or {}, r["config"]
        # a run that did not complete: its last epoch, and how far its last checkpoint got
        last = {} if rec else (store.epochs(r["id"]) or [{}])[-1]
        now = {} if rec else _spent_so_far(db, r["id"], last)
        scores = rec or last  # a --validation run's test_accuracy is None
        acc = next(
            (
                scores[k]
                for k in ("test_accuracy", "validation_accuracy")
                if scores.get(k) is not None
            ),
            None,
        )
        steps = rec.get("steps") if rec else now.get("steps")
        planned = now.get("planned_steps")
        eps = rec.get("epsilon") if rec else now.get("epsilon")
        table.append(
            (
                str(r["id"]),
                r["kind"],
                r["status"],
                str(cfg.get("mechanism", cfg.get("mode", "?"))),
                str(cfg.get("dataset", rec.get("dataset") or "-")),
                str(cfg.get("model", "-")),
                "-" if steps is None else (f"{steps}/{planned}" if planned else str(steps)),
                "-" if acc is None else f"{acc:.4f}",
                _short(eps, rec or now),
                _short(rec.get("epsilon_claimed"), rec)
                if rec
                else (_short(now["epsilon_claimed"], now) if "epsilon_claimed" in now else "-"),
                str(rec.get("wall_time_s") or ""),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {0, 6, 7, 8, 9, 10}
    for row in table:
        click.echo(
            " ".join(
                cell.rjust(w) if i in right else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )


@runs.command("show")
@click.argument("run_id", type=int)
@db_option
@click.option("--json", "as_json", is_flag=True)
def show(run_id, db, as_json):
    """One run: its configuration, its epochs and its privacy record."""
    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}; run 'privgrad train' first")
    store = RunStore(db)
    run = store.run(run_id)
    if run is None:
        raise PrivgradError(f"no run {run_id} in the run store {db}")
    epochs = store.epochs(run_id)
    if as_json:
        click.echo(to_json({**_with_progress(store, run, epochs), "epochs": epochs}))
        return
    cfg, rec = run["config"], run["record"] or {}
    click.echo(
        f"run {run_id} ({run['kind']}): {run['status']}"
        + (f", git {run['git_commit']}" if run.get("git_commit") else "")
    )
    if run.get("error"):
        click.echo(f"  error: {run['error']}")
    shown = _options_that_apply(cfg, rec) if run["kind"] == "train" else cfg
    click.echo(
        "  " + ", ".join(f"{k}={_option(v)}" for k, v in shown.items() if v not in (None, {}, []))
    )
    if epochs:
        which = "validation_accuracy" if "validation_accuracy" in epochs[0] else "test_accuracy"
        click.echo(
            f"  {'epoch':>5} {'steps':>7} {'loss':>8} "
            f"{'val acc' if which == 'validation_accuracy' else 'test acc':>9} {'ε':>8}"
        )
        for e in epochs:
            acc = e.get(which)
            click.echo(
                f"  {e['epoch']:>5} {e.get('steps', '-'):>7} {_num(e.get('loss'), 4):>8} "
                f"{_num(acc, 4):>9} {_short(e['epsilon'], e) if 'epsilon' in e else '-':>8}"
            )
    if rec:
        click.echo(
            f"  ε (honest, {str(rec.get('accountant', 'pld')).upper()}) = "
            f"{_fmt_eps(rec.get('epsilon'))} at "
            f"δ = {rec.get('delta')}  [σ_eff = {_num(rec.get('effective_noise_multiplier'), 4)}, "
            f"q = {_num(rec.get('sampling_rate'), 5)}, {rec.get('steps')} steps, "
            f"{rec.get('neighbouring', '')}]"
        )
        prior = rec.get("prior")
        if isinstance(prior, dict):  # --prior: whether ε counts the earlier run's steps too
            before = prior.get("epsilon")
            before = "unknown" if before is None else _fmt_eps(before)
            click.echo(
                f"  from the weights of {prior.get('weights')} (ε = {before} there), "
                f"{prior.get('how')}"
            )
        if not _same_eps(rec.get("epsilon_claimed"), rec.get("epsilon")):
            click.echo(
                f"  ε claimed (the paper's nominal σ, PLD) = {_fmt_eps(rec.get('epsilon_claimed'))}"
                + (f"  [{rdp}]" if (rdp := _claimed_rdp(rec)) else "")
            )
    else:
        now = _spent_so_far(db, run_id, epochs[-1] if epochs else {})
        if now:
            click.echo(
                f"  ε (honest) spent so far = {_fmt_eps(now.get('epsilon'))} after "
                f"{now.get('steps')} steps (run {run['status']}, not completed)"
            )
            if "epsilon_claimed" in now and not _same_eps(
                now["epsilon_claimed"], now.get("epsilon")
            ):
                click.echo(
                    "  ε claimed (the paper's nominal σ, PLD), so far = "
                    f"{_fmt_eps(now['epsilon_claimed'])}"
                )


def _options_that_apply(cfg: dict, rec: dict) -> dict:
    """A training run's configuration as ``runs show`` prints it: the options the run used,
    not the stored defaults it had no use for (momentum with Adam, clip, δ and target for the
    non-private mechanism, target with a fixed σ, the activation of an hf: or python: model,
    no validation split); the optimizer that ran where the mechanism chose it."""
    shown = dict(cfg)
    optimizer = _optimizer_used(cfg.get("mechanism"), cfg.get("optimizer") or rec.get("optimizer"))
    shown["optimizer"] = optimizer  # where the mechanism chose it (stored as None)
    unused = set()
    if optimizer and optimizer != "sgd":
        unused.add("momentum")
    if cfg.get("mechanism") == "non-private":
        unused |= {"epsilon", "delta", "noise_multiplier", "target", "clip"}
    elif cfg.get("noise_multiplier") is not None:
        unused.add("target")  # nothing calibrated
    if str(cfg.get("model", "")).startswith(("hf:", "python:")):
        unused |= {"activation", "activation_params"}
    if not cfg.get("validation"):
        unused.add("validation")
    if not cfg.get("dataset_options"):
        unused.add("dataset_options")
    return {k: v for k, v in shown.items() if k not in unused}


@runs.command("plot")
@click.argument("run_ids", nargs=-1, required=True)
@db_option
@click.option(
    "--out", type=click.Path(dir_okay=False), default=None,
    help="the PNG to write (default: run<IDS>.png beside the run store; with a folder, "
    "plot.png in the first folder given)",
)  # fmt: skip
def plot(run_ids, db, out):
    """Plot runs RUN_IDS (one or several, overlaid): training loss per step, accuracy after
    each epoch and the honest ε spent, against the step, in one PNG. A RUN_ID may also be a
    folder that MetricsLog wrote from your own loop (steps.csv, epochs.csv)."""
    ids = []
    for text in run_ids:
        if text.isdigit() and int(text) >= 1:
            ids.append(int(text))
        elif Path(text).is_dir():
            ids.append(Path(text))
        else:
            raise PrivgradError(
                f"RUN_IDS must be run ids (integers ≥ 1) or folders a MetricsLog wrote "
                f"(steps.csv, epochs.csv), got '{text}'"
            )
    from privgrad.app.plots import plot_runs

    folders = [i for i in ids if isinstance(i, Path)]
    out = out or (
        folders[0] / "plot.png"
        if folders
        else Path(db).parent / f"run{'-'.join(map(str, ids))}.png"
    )
    _check_out(str(out))
    named = ", ".join(map(str, ids))
    click.echo(f"plot of run(s) {named} in {plot_runs(db, ids, out)}")


def _claimed_rdp(record: dict) -> str:
    """'X by RDP, ...': the claimed ε composed as the papers composed theirs (a record's
    ``epsilon_claimed_rdp``; '' for records made before it)."""
    if "epsilon_claimed_rdp" not in record:
        return ""
    return f"{_fmt_eps(record['epsilon_claimed_rdp'])} by RDP, the accountant the papers used"


def _with_progress(store: RunStore, run: dict, epochs: list | None = None) -> dict:
    """A run as JSON, with an incomplete run's ``progress`` (steps done and planned, honest and
    claimed ε spent: :func:`_spent_so_far`), which its null record lacks."""
    if run.get("record"):
        return run
    if epochs is None:
        epochs = store.epochs(run["id"])
    now = _spent_so_far(store.path, run["id"], epochs[-1] if epochs else {})
    keys = ("steps", "planned_steps", "epsilon", "epsilon_claimed")
    return {**run, "progress": {k: now[k] for k in keys if k in now} or None}


def _spent_so_far(db, run_id: int, last: dict) -> dict:
    """An incomplete run's steps and honest ε: its last checkpoint's (``progress.json``,
    written also when a run stops mid-epoch), else ``last``, its last epoch row."""
    from privgrad.app.checkpoint import checkpoint_dir
    from privgrad.app.metrics import read_progress

    return read_progress(checkpoint_dir(db, run_id)) or last


def _option(value) -> str:
    """A configuration value as typed: a whole float (epochs, batch size) without '.0'."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _num(x, digits: int) -> str:
    return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:.{digits}f}"


def _same_eps(a, b) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    )


def _short(eps, rec) -> str:
    if not rec:
        return "-"
    return "∞" if eps is None else f"{eps:.3f}"


@main.command()
@click.option(
    "--mode",
    required=True,
    type=click.Choice(GAN_MODES),
    help="rdp-gan-a: noise on the loss (Eq. 8, a no-op); rdp-gan-b: noise on the output-layer "
    "error (Eqs. 9-10); rdp-ant: B with an adaptive/decaying σ; dp-gan: DP-SGD on D (honest "
    "ε); non-private: the control",
)
@click.option(
    "--dataset", type=click.Choice(["mnist", "adult"]), default="mnist", show_default=True
)
@click.option("--generator-steps", type=int, default=1000, show_default=True, help="n_g")
@click.option(
    "--discriminator-steps", type=int, default=5, show_default=True, help="n_d (D-steps per G-step)"
)
@click.option(
    "--epsilon",
    type=float,
    default=None,
    help="dp-gan: target honest ε (σ calibrated); rdp-*: the paper's claimed ε_total (σ from Thms "
    "3-4)",
)
@click.option(
    "--noise-multiplier", type=float, default=None, help="σ (σ_0 for rdp-ant), instead of --epsilon"
)
@delta_option
@click.option(
    "--alpha",
    type=float,
    default=2.0,
    show_default=True,
    help="Rényi order α of the paper's claimed ε",
)
@click.option(
    "--loss-bound", type=float, default=None, help="the paper's C (ΔS = C/m); default: Table II"
)
@click.option(
    "--schedule",
    type=click.Choice(["ant", "time", "exp", "step"]),
    default=None,
    help="rdp-ant only: ANT (Eqs. 17-18, default) or the Time / Exp / Step decays",
)
@click.option(
    "--decay", type=float, default=None, help="decay rate k (default: the paper's Tables IV/V)"
)
@click.option("--tau", type=float, default=0.5, show_default=True, help="ANT threshold τ")
@click.option("--t-star", type=int, default=100, show_default=True, help="Step decay period t*")
@click.option(
    "--no-smoothing",
    is_flag=True,
    help="ANT: compare with S_t (Eq. 17), not the running mean (Eq. 18)",
)
@click.option(
    "--batch-size",
    type=float,
    default=64,
    show_default=True,
    help="expected (Poisson) real batch size m",
)
@click.option("--lr", type=float, default=5e-5, show_default=True)
@click.option(
    "--clip", type=float, default=1.0, show_default=True, help="dp-gan: per-sample L2 clipping norm"
)
@click.option("--latent-dim", type=int, default=100, show_default=True)
@click.option(
    "--width", type=int, default=64, show_default=True, help="base channel width of G and D"
)
@click.option(
    "--eval-every",
    type=int,
    default=None,
    help="score every N G-steps (default: 1 for rdp-ant, else 10)",
)
@click.option("--eval-samples", type=int, default=500, show_default=True)
@click.option("--final-samples", type=int, default=10000, show_default=True)
@secret_seed_option
@limit_train_option
@data_dir_option
@click.option(
    "--image-dir", default=None, help="where the PNGs go (default: next to the run store)"
)
@db_option
@record_out_option
@record_json_option
@quiet_option
def gan(
    mode,
    dataset,
    generator_steps,
    discriminator_steps,
    epsilon,
    noise_multiplier,
    delta,
    alpha,
    loss_bound,
    schedule,
    decay,
    tau,
    t_star,
    no_smoothing,
    batch_size,
    lr,
    clip,
    latent_dim,
    width,
    eval_every,
    eval_samples,
    final_samples,
    seed,
    limit_train,
    data_dir,
    image_dir,
    db,
    out,
    as_json,
    quiet,
):
    """Train a GAN: RDP-GAN as published (no guarantee), RDP-ANT, or a sound DP-GAN."""
    if not quiet and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks
        status(f"{mode} on {dataset}: loading torch …")
    from privgrad.app.gan.train import GanConfig, train_gan

    config = GanConfig(
        mode=mode,
        dataset=dataset,
        generator_steps=generator_steps,
        discriminator_steps=discriminator_steps,
        epsilon=epsilon,
        noise_multiplier=noise_multiplier,
        delta=delta,
        alpha=alpha,
        loss_bound=loss_bound,
        schedule=schedule,
        decay=decay,
        tau=tau,
        t_star=t_star,
        smoothing=not no_smoothing,
        batch_size=batch_size,
        lr=lr,
        clip=clip,
        latent_dim=latent_dim,
        width=width,
        eval_every=eval_every,
        eval_samples=eval_samples,
        final_samples=final_samples,
        seed=seed,
        limit_train=limit_train,
        data_dir=data_dir,
        image_dir=image_dir,
    )
    config.validate()
    _check_out(out)
    command = "privgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    from privgrad.distributed import process_group

    with process_group() as group:  # under torchrun: one rank of a data-parallel dp-gan run
        main_rank = group is None or group.is_main
        record = train_gan(
            config,
            store=RunStore(db) if main_rank else None,
            progress=not quiet,
            command=command,
            distributed=group,
        )
    if not main_rank:
        return
    _write_out(out, record)
    echo = lambda s: click.echo(s, err=as_json)  # noqa: E731
    echo(
        f"{record['mode']} on {record['dataset']}: score {record['test_accuracy']:.4f} "
        f"({record['score']}), "
        f"{record['generator_steps']} G-steps / {record['steps']} D-steps"
    )
    if record["dp_guarantee"]:
        echo(
            f"  ε (honest, PLD) = {_fmt_eps(record['epsilon'])} at δ = {record['delta']:g}"
            f"  [σ = {record['noise_multiplier']:.4f}, C = {record['clip']:g}, q = "
            f"{record['sampling_rate']:.5f}, "
            f"{record['steps']} D-steps]"
        )
    else:
        echo(f"  ε (honest) = ∞: {record['guarantee']}")
    if record.get("paper_accounting"):
        pa = record["paper_accounting"]
        echo(
            f"  ε claimed by the paper (Thms 1-4, α = {pa['alpha']:g}, δ = {pa['delta']:g}; NOT a "
            "guarantee) = "
            f"{_fmt_eps(record['epsilon_claimed'])}  [σ_0 = {record['noise_multiplier']:.4f}, "
            f"ΔS = {pa['sensitivity']:.4f}]"
        )
    for path in record["images"]:
        echo(f"  image: {path}")
    if as_json:
        click.echo(to_json(record))


@main.command()
@click.argument("experiment", required=False)
@click.option(
    "--quick",
    is_flag=True,
    help="the experiment's [quick] grid: a few hundred examples, one epoch, one seed",
)
@click.option(
    "--seeds", "n_seeds", type=int, default=None, help="use seeds 0..N-1 instead of the config's"
)
@click.option(
    "--jobs", type=int, default=1, show_default=True, help="cells run in parallel (processes)"
)
@click.option("--arm", "arms", multiple=True, help="run only this arm (repeatable)")
@db_option
@click.option("--force", is_flag=True, help="rerun cells that are already done")
@click.option(
    "--any-version", is_flag=True, help="count cells done with another code version as done"
)
@click.option(
    "--from-results",
    is_flag=True,
    help="also count the cells whose records are committed in results/reproduce/<id>(.search).json "
    "as done: a fresh checkout resumes a grid that another machine started",
)
@click.option(
    "--dry-run", is_flag=True, help="list the cells and whether each is done; run nothing"
)
@click.option(
    "--export/--no-export",
    default=None,
    help="write the grid's records to results/reproduce/<id>.json (default: on, off with --quick; "
    "with --dry-run: the records done so far, running nothing)",
)
@click.option(
    "--list", "list_only", is_flag=True, help="list the experiments and whether each can run"
)
@experiments_dir_option
@click.option("--results-dir", default=None, help="where --export writes (default: results/)")
@data_dir_option
@click.option("--quiet", is_flag=True, help="no progress bars")
def reproduce(
    experiment,
    quick,
    n_seeds,
    jobs,
    arms,
    db,
    force,
    any_version,
    from_results,
    dry_run,
    export,
    list_only,
    experiments_dir,
    results_dir,
    data_dir,
    quiet,
):
    """Run a paper table's grid (experiments/<EXPERIMENT>.toml) into the run store.

    Cells already done with the same configuration and code version are skipped, and a cell
    stopped mid-run goes on from its checkpoint, so an interrupted run resumes where it
    stopped. With a [search] section, each searched arm's hyper-parameters are first chosen
    on a validation split (docs/experiments.md).
    """
    from privgrad.lab.reproduce import (
        export_plan,
        list_experiments,
        load_experiment,
        plan,
        reproduce as run,
    )

    if list_only:
        for exp in list_experiments(experiments_dir):
            missing = exp.missing() if exp.runnable else []
            state = (
                "not runnable here: " + exp.reason
                if not exp.runnable
                else "needs " + ", ".join(missing)
                if missing
                else exp.size_text()
            )
            click.echo(f"{exp.id:<24} {state}")
        return
    if not experiment:
        raise PrivgradError("name an experiment (privgrad reproduce --list shows them)")
    exp = load_experiment(experiment, experiments_dir)
    seeds = list(range(n_seeds)) if n_seeds else None
    if dry_run:
        from privgrad.lab.reproduce import check_runnable, resumable_runs
        from privgrad.records import code_version

        check_runnable(exp, list(arms) or None)
        store = RunStore(db)
        p = plan(
            exp,
            store,
            quick,
            seeds,
            list(arms) or None,
            force,
            any_version,
            data_dir,
            from_results,
            results_dir,
        )
        click.echo("\n".join(p.describe()))
        stopped = resumable_runs(store, [*p.search_todo, *p.todo], code_version())
        if stopped:
            click.echo(
                f"{len(stopped)} of the cells to run go on from their checkpoints (runs "
                f"{', '.join(map(str, sorted(stopped.values())))})"
            )
        if export:  # --dry-run --export: write the records done so far (a long run's progress)
            for path in export_plan(p, results_dir):
                click.echo(f"records written to {path}", err=True)
        return
    summary = run(
        exp,
        db,
        quick=quick,
        seeds=seeds,
        jobs=jobs,
        arms=list(arms) or None,
        force=force,
        any_version=any_version,
        progress=not quiet,
        data_dir=data_dir,
        from_results=from_results,
        results_dir=results_dir,
        echo=lambda m: click.echo(m, err=True),
    )
    if export if export is not None else not quick:
        for path in export_plan(summary["plan"], results_dir):
            click.echo(f"records written to {path}", err=True)
    failures = summary["failures"]
    click.echo(
        f"{exp.id}: {summary['ran']} cells run, {summary['skipped']} skipped, {len(failures)} "
        "failed",
        err=True,
    )
    if failures:
        raise PrivgradError(
            f"{len(failures)} of {len(summary['cells'])} cells failed (first: "
            f"{failures[0][0].label()}: {failures[0][1]}); rerun to retry them"
        )


@main.command()
@click.option(
    "--out",
    "out_dir",
    default=None,
    help="output folder (default: docs/): REPRODUCTION.md and reproduction/",
)
@click.option("--results-dir", default=None, help="committed run records (default: results/)")
@click.option("--db", default=None, help="also use the completed runs of this run store")
@experiments_dir_option
@click.option("--include-quick", is_flag=True, help="include --quick runs (left out by default)")
@click.option(
    "--check", is_flag=True, help="regenerate into a temporary folder and fail if --out differs"
)
def report(out_dir, results_dir, db, experiments_dir, include_quick, check):
    """Build docs/REPRODUCTION.md and the HTML page (with plots) from the run records."""
    from privgrad.lab.report import build_report, check_report

    kwargs = dict(
        results_dir=results_dir, db=db, experiments_dir=experiments_dir, include_quick=include_quick
    )
    if check:
        stale = check_report(out_dir, **kwargs)
        if stale:
            click.echo("\n".join(stale), err=True)
            raise PrivgradError(
                "the committed report differs from a fresh regeneration; run 'privgrad report'"
            )
        click.echo("the report matches a fresh regeneration")
        return
    try:
        built = build_report(out_dir, **kwargs)
    except OSError as err:  # an --out folder that cannot be made or written
        raise PrivgradError(
            f"cannot write the report: {err.strerror or err}"
            + (f": {err.filename}" if err.filename else "")
        ) from None
    click.echo(
        f"{built['markdown']}\n{built['html']}  ({built['n_records']} records, "
        f"{len(built['plots'])} plots)"
    )


def _input_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise PrivgradError(f"--input-shape takes positive integers like 1,16,16, got '{text}'")
    return shape


def _option_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@main.command()
@click.option(
    "--method",
    type=click.Choice(["canary", "one-run", "mia"]),
    default="canary",
    show_default=True,
    help="canary: many trials of a few steps with/without a gradient canary; one-run: Steinke et "
    "al. "
    "in one training run; mia: membership inference with a non-private control",
)
@click.option(
    "--mechanism",
    default="dpsgd",
    show_default=True,
    help=f"one of: {_names(MECHANISM_NAMES)}; canary also: rdp-gan-a, rdp-gan-b, dp-gan (one "
    "discriminator step of the GAN; --model cdcgan with non-private for the GAN control)",
)
@click.option(
    "--epsilon",
    type=float,
    default=None,
    help="σ is calibrated so that the audited run's honest ε (with --claimed: the paper's ε) is "
    "this "
    "[default 1, unless --noise-multiplier]",
)
@click.option("--claimed", is_flag=True, help="paper mode: calibrate σ for the paper's claimed ε")
@noise_multiplier_option
@delta_option
@click.option(
    "--trials",
    type=int,
    default=None,
    help="canary: trials per side [10000]; one-run: canaries [1000]; mia: pool size [500]",
)
@click.option("--steps", type=int, default=1, show_default=True, help="canary: steps per trial")
@click.option(
    "--sampling-rate", type=float, default=1.0, show_default=True, help="canary: Poisson rate q"
)
@click.option(
    "--canary",
    default="auto",
    show_default=True,
    help="canary: auto, dense, dirac or input (auto: input for chains with layer-aware stages)",
)
@click.option(
    "--statistic",
    default="mean-shift",
    show_default=True,
    help="canary: mean-shift, likelihood-ratio (the test for q < 1 over several steps) or "
    "empirical",
)
@click.option(
    "--input-shape",
    default="1,16,16",
    show_default=True,
    help="canary: the audit model's input shape, comma-separated (a smaller input makes a "
    "smaller model, for audits of many steps)",
)
@click.option(
    "--background", type=int, default=None, help="canary: examples in D0 [0; GAN: 63 MNIST images]"
)
@click.option(
    "--model",
    default=None,
    help=f"small [default], fullconv, {_names(MODEL_NAMES)}; cdcgan: the GAN's "
    "discriminator (canary, GAN modes' default)",
)
@click.option(
    "--dataset",
    default="synthetic",
    show_default=True,
    help=f"one-run/mia: synthetic, {_names(DATASET_NAMES)}",
)
@click.option(
    "--n-train", type=int, default=500, show_default=True, help="one-run: real training examples"
)
@click.option("--epochs", type=float, default=None, help="one-run [2] / mia [20]")
@click.option(
    "--batch-size", type=float, default=None, help="one-run [100] / mia [50]: expected batch size"
)
@click.option("--lr", type=float, default=None, help="one-run [0.1] / mia [0.1]")
@click.option("--clip", type=float, default=1.0, show_default=True, help="L2 clipping norm C")
@click.option("--confidence", type=float, default=0.95, show_default=True)
@seed_option
@click.option(
    "--option",
    "options",
    multiple=True,
    help="mechanism option KEY=VALUE (repeatable), e.g. filter_ratio=0",
)
@data_dir_option
@db_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="also write the record to this JSON file (committed audits: results/audit/...)",
)
@click.option("--json", "as_json", is_flag=True, help="print the record as JSON on the last line")
@click.option(
    "--fail-on-violation", is_flag=True, help="exit 1 if the lower bound exceeds the honest ε"
)
def audit(
    method,
    mechanism,
    epsilon,
    claimed,
    noise_multiplier,
    delta,
    trials,
    steps,
    sampling_rate,
    canary,
    statistic,
    background,
    model,
    input_shape,
    dataset,
    n_train,
    epochs,
    batch_size,
    lr,
    clip,
    confidence,
    seed,
    options,
    data_dir,
    db,
    out,
    as_json,
    fail_on_violation,
):
    """Audit a mechanism empirically: a lower bound on ε beside the honest and the claimed ε."""
    from privgrad.app.audit import run_audit, verdict
    from privgrad.app.audit.gan import is_gan_audit

    if claimed and noise_multiplier is not None:
        raise PrivgradError(
            "--claimed calibrates σ for the paper's ε; it cannot be combined with "
            "--noise-multiplier"
        )
    if epsilon is not None and noise_multiplier is not None:
        raise PrivgradError("give --epsilon or --noise-multiplier, not both")
    mech_options = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PrivgradError(f"--option takes KEY=VALUE, got '{item}'")
        mech_options[key.strip().replace("-", "_")] = _option_value(value.strip())
    if noise_multiplier is None and epsilon is None:
        epsilon = 1.0
    common = dict(
        mechanism=mechanism,
        noise_multiplier=noise_multiplier,
        target_epsilon=epsilon,
        target="claimed" if claimed else "honest",
        delta=delta,
        alpha=1 - confidence,
        seed=seed,
        max_grad_norm=clip,
        mechanism_options=mech_options or None,
    )
    if method == "canary" and is_gan_audit(mechanism, model):
        if canary != "auto" or statistic != "mean-shift":
            raise PrivgradError(
                "the GAN audit uses its own canary image and the empirical statistic; "
                "drop --canary and --statistic"
            )
        kw = dict(
            trials=trials or 2000,
            steps=steps,
            sampling_rate=sampling_rate,
            model="cdcgan",
            background=63 if background is None else background,
            data_dir=data_dir,
        )
    elif method == "canary":
        kw = dict(
            trials=trials or 10_000,
            steps=steps,
            sampling_rate=sampling_rate,
            canary=canary,
            statistic=statistic,
            background=background or 0,
            model=model or "small",
            input_shape=_input_shape(input_shape),
        )
    else:
        defaults = {"one-run": (2.0, 100.0, 0.1), "mia": (20.0, 50.0, 0.1)}[method]
        kw = dict(
            dataset=dataset,
            data_dir=data_dir,
            model=model or "small",
            epochs=epochs or defaults[0],
            batch_size=batch_size or defaults[1],
            lr=lr or defaults[2],
        )
        kw.update(
            {"canaries": trials or 1000, "n_train": n_train}
            if method == "one-run"
            else {"pool": trials or 500}
        )
    _check_out(out)
    command = "privgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    record = run_audit(method, store=RunStore(db), command=command, **common, **kw)
    _write_out(out, record)
    what = {
        "canary": f"{record['trials']} trials per side, {record.get('steps', 1)} step(s), "
        f"q = {record['sampling_rate']:g}, {record.get('canary')} canary",
        "one-run": f"{record['trials']} canaries in one run of {record['steps']} steps",
        "mia": (
            f"pool of {record['trials']} ({record.get('members')} members), {record['steps']} steps"
        ),
    }[method]
    click.echo(f"{method} audit of {record['mechanism']}: {what}", err=as_json)
    click.echo(
        f"  ε (honest, PLD)          = {_fmt_eps(record['epsilon'])} at δ = {record['delta']:g}"
        f"  [σ_eff = {record['effective_noise_multiplier']:.4f}]",
        err=as_json,
    )
    if not _same_eps(record["epsilon_claimed"], record["epsilon"]):
        click.echo(
            f"  ε claimed                = {_fmt_eps(record['epsilon_claimed'])} (not a guarantee)"
            f"  [the paper's nominal σ = {record['noise_multiplier']:.4f}, PLD]",
            err=as_json,
        )
    click.echo(
        f"  ε empirical lower bound  = {record['epsilon_lower_bound']:.4f} at "
        f"{100 * record['confidence']:g}% confidence",
        err=as_json,
    )
    if method == "canary" and record.get("mu_hat") is not None and math.isfinite(record["mu_hat"]):
        mu_ref = record.get("mu_honest")
        click.echo(
            f"  μ̂ (mean shift / std)     = {record['mu_hat']:.3f} ± {record['mu_hat_se']:.3f}"
            + (
                f"  [honest μ = {mu_ref:.3f}, claimed μ = {record['mu_claimed']:.3f}]"
                if mu_ref
                else ""
            )
            + " (an estimate, not a bound)",
            err=as_json,
        )
    if method == "mia":
        for name in ("target", "control"):
            for attack, m in record[name]["attacks"].items():
                click.echo(
                    f"  {name:<7} {attack:<6} AUC {m['auc']:.3f}  TPR@0.1%FPR "
                    f"{m['tpr_at_0.1%_fpr']:.3f}  "
                    f"TPR@1%FPR {m['tpr_at_1%_fpr']:.3f}  ε ≥ {m['epsilon_lower_bound']:.3f}",
                    err=as_json,
                )
    click.echo(f"  {verdict(record)}", err=as_json)
    if as_json:
        click.echo(to_json(record))
    if fail_on_violation and record["violation"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
