"""The ``privgrad`` command line."""
from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import click

from .errors import PrivgradError
from .store import DEFAULT_DB, RunStore, to_json


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _fmt_eps(eps) -> str:
    return "∞ (no DP guarantee)" if eps is None or math.isinf(eps) else f"{eps:.4f}"


class Main(click.Group):
    """Turns privgrad's own errors into one line on stderr and exit status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PrivgradError as err:
            _fail(str(err))
        except KeyboardInterrupt:
            _fail("interrupted", 130)


@click.group(cls=Main)
@click.version_option(package_name="privgrad")
def main():
    """Differentially private training with honest privacy accounting."""


@main.command()
@click.option("--mechanism", default="dpsgd", show_default=True, help="dpsgd, dp-adam, dp-signsgd, dp-signadam, non-private, ...")
@click.option("--dataset", default="mnist", show_default=True, help="mnist, fashion-mnist, imdb, adult, cifar10")
@click.option("--model", default="cnn", show_default=True, help="cnn, lenet5, ...")
@click.option("--epsilon", type=float, default=1.0, show_default=True, help="target honest ε (σ is calibrated)")
@click.option("--delta", type=float, default=1e-5, show_default=True)
@click.option("--noise-multiplier", type=float, default=None, help="nominal σ, instead of --epsilon")
@click.option("--target", type=click.Choice(["honest", "claimed"]), default="honest", show_default=True,
              help="calibrate σ so that the honest ε, or the paper's claimed ε, equals --epsilon")
@click.option("--epochs", type=float, default=20, show_default=True)
@click.option("--batch-size", type=float, default=2048, show_default=True, help="expected Poisson batch size")
@click.option("--lr", type=float, default=2.0, show_default=True)
@click.option("--optimizer", default=None, help="sgd or adam (default: the mechanism's own)")
@click.option("--momentum", type=float, default=0.9, show_default=True, help="SGD momentum")
@click.option("--clip", type=float, default=0.1, show_default=True, help="L2 clipping norm C")
@click.option("--activation", default="tanh", show_default=True, help="tanh, relu or tempered")
@click.option("--ts-scale", type=float, default=None, help="tempered sigmoid s (s·sigmoid(T·x) − o; tanh: 2)")
@click.option("--ts-temperature", type=float, default=None, help="tempered sigmoid T (tanh: 2)")
@click.option("--ts-offset", type=float, default=None, help="tempered sigmoid o (tanh: 1)")
@click.option("--noise-on", default=None, help="dp-signsgd: 'sum' (default) or 'average' (literal Alg. 3)")
@click.option("--signadam-variant", "variant", default=None, help="dp-signadam: 'alg4' (default) or 'alg2'")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--limit-train", type=int, default=None, help="use the first N training examples")
@click.option("--data-dir", default=None, help="folder holding the datasets")
@click.option("--db", default=str(DEFAULT_DB), show_default=True, help="run store (SQLite)")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write the run record to this JSON file")
@click.option("--json", "as_json", is_flag=True, help="print the run record as JSON on the last line")
@click.option("--quiet", is_flag=True, help="no progress bar")
def train(mechanism, dataset, model, epsilon, delta, noise_multiplier, target, epochs, batch_size, lr,
          optimizer, momentum, clip, activation, ts_scale, ts_temperature, ts_offset, seed, limit_train,
          data_dir, db, out, as_json, quiet, **mechanism_options):
    """Train a model privately and report honest (and claimed) ε."""
    from .train import TrainConfig, train as run_train
    act_params = {k: v for k, v in [("scale", ts_scale), ("temperature", ts_temperature),
                                    ("offset", ts_offset)] if v is not None}
    if act_params and activation != "tempered":
        raise PrivgradError("--ts-scale/--ts-temperature/--ts-offset need --activation tempered")
    config = TrainConfig(mechanism=mechanism, dataset=dataset, model=model, epsilon=epsilon,
                         delta=delta, noise_multiplier=noise_multiplier, target=target, epochs=epochs,
                         batch_size=batch_size, lr=lr, optimizer=optimizer, momentum=momentum,
                         clip=clip, activation=activation, activation_params=act_params, seed=seed,
                         limit_train=limit_train, data_dir=data_dir,
                         mechanism_options={k: v for k, v in mechanism_options.items() if v is not None})
    config.validate()
    command = "privgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    store = RunStore(db)
    record = run_train(config, store=store, progress=not quiet, command=command)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(json.loads(to_json(record)), indent=2) + "\n")
    click.echo(f"{record['mechanism']} on {record['dataset']}: test accuracy {record['test_accuracy']:.4f}", err=as_json)
    click.echo(f"  ε (honest, {record['accountant'].upper()}) = {_fmt_eps(record['epsilon'])} at δ = {record['delta']:g}"
               f"  [σ_eff = {record['effective_noise_multiplier']:.4f}, q = {record['sampling_rate']:.5f}, "
               f"{record['steps']} steps]", err=as_json)
    if not _same_eps(record["epsilon_claimed"], record["epsilon"]):
        click.echo(f"  ε claimed by the paper (not a guarantee) = {_fmt_eps(record['epsilon_claimed'])}"
                   f"  [nominal σ = {record['noise_multiplier']:.4f}]", err=as_json)
    if as_json:
        click.echo(to_json(record))


@main.command()
@click.option("--sampling-rate", type=float, required=True, help="Poisson sampling rate q")
@click.option("--noise-multiplier", type=float, required=True, help="noise multiplier σ")
@click.option("--steps", type=int, required=True)
@click.option("--delta", type=float, default=1e-5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def epsilon(sampling_rate, noise_multiplier, steps, delta, as_json):
    """ε of the Poisson-subsampled Gaussian mechanism (PLD and RDP)."""
    from .accounting import epsilon_of, poisson_gaussian_event, validate_delta
    if not 0 < sampling_rate <= 1:
        raise PrivgradError(f"the sampling rate must lie in (0, 1], got {sampling_rate}")
    if noise_multiplier < 0:
        raise PrivgradError(f"the noise multiplier must be ≥ 0, got {noise_multiplier}")
    if steps < 0:
        raise PrivgradError(f"the number of steps must be ≥ 0, got {steps}")
    validate_delta(delta)
    event = [(poisson_gaussian_event(sampling_rate, noise_multiplier), steps)]
    result = {"sampling_rate": sampling_rate, "noise_multiplier": noise_multiplier, "steps": steps,
              "delta": delta, "epsilon_pld": epsilon_of(event, delta, "pld"),
              "epsilon_rdp": epsilon_of(event, delta, "rdp")}
    if as_json:
        click.echo(to_json(result))
    else:
        click.echo(f"ε (PLD) = {_fmt_eps(result['epsilon_pld'])}\nε (RDP) = {_fmt_eps(result['epsilon_rdp'])}"
                   f"\n  at δ = {delta:g}, q = {sampling_rate:g}, σ = {noise_multiplier:g}, {steps} steps")


@main.command()
@click.option("--db", default=str(DEFAULT_DB), show_default=True)
@click.option("--status", default=None, help="completed, running, interrupted or failed")
@click.option("--limit", type=int, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def runs(db, status, limit, as_json):
    """List and compare the runs in the run store."""
    if not Path(db).exists():
        raise PrivgradError(f"no run store at {db}; run 'privgrad train' first")
    rows = RunStore(db).runs(status, limit)
    if as_json:
        click.echo(to_json(rows))
        return
    head = f"{'id':>4} {'status':<11} {'mechanism':<12} {'dataset':<13} {'model':<8} {'acc':>7} {'ε':>9} {'ε claimed':>10} {'time s':>7}"
    click.echo(head)
    for r in rows:
        rec, cfg = r["record"] or {}, r["config"]
        acc = rec.get("test_accuracy")
        click.echo(f"{r['id']:>4} {r['status']:<11} {cfg.get('mechanism', '?'):<12} {cfg.get('dataset', '?'):<13} "
                   f"{cfg.get('model', '?'):<8} {acc if acc is None else f'{acc:.4f}':>7} "
                   f"{_short(rec.get('epsilon'), rec):>9} {_short(rec.get('epsilon_claimed'), rec):>10} "
                   f"{rec.get('wall_time_s') or '':>7}")


def _same_eps(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9))


def _short(eps, rec) -> str:
    if not rec:
        return "-"
    return "∞" if eps is None else f"{eps:.3f}"


if __name__ == "__main__":
    main()
