"""Membership inference on trained models, always next to a non-private control.

Setting. A target pool of ``pool`` examples; each is a member (in the training set)
independently with probability ½. The target model is trained on the members with the
audited mechanism; the control model is trained on the same members, from the same
initialisation, with the same batches and hyper-parameters, without clipping or noise.

Attacks (scores: higher = "member"):

* ``loss`` (Yeom et al. 2018): the negative per-example loss.
* ``shadow`` (Salem et al. 2019, ML-Leaks adversary 1): a shadow model is trained the
  same way (same mechanism and σ; non-private for the control) on a disjoint shadow pool
  with its own ½ coin flips; an attack classifier (logistic regression on the sorted
  top-3 posteriors) learns member vs non-member on the shadow pool and scores the target
  pool.

Reported per model and attack: AUC (Mann–Whitney), TPR at 0.1 % and 1 % FPR (the
largest TPR of a threshold whose empirical FPR is at most that; with fewer than 1000
non-members, 0.1 % FPR means no false positive at all), and an ε lower bound: because
membership is a fair coin per example, Steinke et al.'s one-run theorem applies to the
attack's guesses (black-box, input space), each attack at α/2 (Bonferroni over the two
attacks and over the number of guesses).
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from privgrad.errors import PrivgradError
from privgrad.mechanisms import Mechanism
from privgrad.optim import build_optimizer
from privgrad.app.audit.common import (
    audit_model,
    load_audit_data,
    make_mechanism,
    private_trainer,
    trained_audit_record,
)
from privgrad.app.audit.stats import auc, one_run_bound_from_scores, tpr_at_fpr

FPRS = (0.001, 0.01)


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1e-2, iters: int = 50):
    """Logistic regression by Newton's method (standardised features, L2 on the weights).
    Returns a function that scores new rows (the logit)."""
    X = np.asarray(X, np.float64)
    y = np.asarray(y, np.float64)
    mu, sd = X.mean(0), X.std(0) + 1e-12
    Z = np.hstack([(X - mu) / sd, np.ones((len(X), 1))])
    w = np.zeros(Z.shape[1])
    reg = np.full(Z.shape[1], l2)
    reg[-1] = 0.0
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(Z @ w, -30, 30)))
        grad = Z.T @ (p - y) + reg * w
        hess = (Z * (p * (1 - p))[:, None]).T @ Z + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return lambda Xn: np.hstack([(np.asarray(Xn, np.float64) - mu) / sd, np.ones((len(Xn), 1))]) @ w


def top_posteriors(probs: torch.Tensor, k: int = 3) -> np.ndarray:
    """Salem et al.'s features: the k largest posteriors, sorted."""
    k = min(k, probs.shape[1])
    return probs.sort(1, descending=True).values[:, :k].double().numpy()


@torch.no_grad()
def _outputs(model, x, y, batch: int = 2000):
    model.eval()
    losses, probs = [], []
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        losses.append(F.cross_entropy(logits, y[i : i + batch], reduction="none"))
        probs.append(logits.softmax(1))
    return torch.cat(losses).double().numpy(), torch.cat(probs)


def _attack_metrics(scores: np.ndarray, member: np.ndarray, delta: float, alpha: float) -> dict:
    s1, s0 = scores[member], scores[~member]
    out = {"auc": auc(s1, s0)}
    for f in FPRS:
        out[f"tpr_at_{f * 100:g}%_fpr"] = tpr_at_fpr(s1, s0, f)
    bound = one_run_bound_from_scores(scores, member, delta, alpha)
    out.update(
        epsilon_lower_bound=bound["epsilon_lower_bound"],
        guesses=bound["guesses"],
        correct=bound["correct"],
    )
    return out


def mia_audit(
    mechanism: str | Mechanism = "dpsgd",
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target: str = "honest",
    delta: float = 1e-5,
    pool: int = 500,
    dataset: str = "synthetic",
    data_dir=None,
    model: str = "small",
    input_shape=(1, 16, 16),
    num_classes: int = 10,
    labels: str = "random",
    epochs: float = 20,
    batch_size: float = 50,
    lr: float = 0.1,
    momentum: float = 0.9,
    optimizer: str | None = None,
    max_grad_norm: float = 1.0,
    alpha: float = 0.05,
    seed: int = 0,
    mechanism_options: dict | None = None,
) -> dict:
    """Trains target, control and their shadows; returns the MIA record (module docstring).

    Uses 2·``pool`` examples of ``dataset`` (the first ``pool`` are the target pool, the
    next ``pool`` the shadow pool). ``batch_size`` is the expected batch size over the
    members. ``labels`` applies to ``dataset='synthetic'`` ('random' labels can only be
    memorised: the easiest case for the attacker).
    """
    started = time.time()
    if pool < 20:
        raise PrivgradError("the MIA needs a pool of at least 20 examples")
    if target_epsilon is None and noise_multiplier is None:
        target_epsilon = 1.0
    x, y, num_classes, num_tokens = load_audit_data(
        dataset, 2 * pool, data_dir, seed, input_shape, num_classes, labels
    )
    rng = np.random.default_rng(seed)
    member = rng.random(pool) < 0.5
    shadow_member = rng.random(pool) < 0.5
    xt, yt, xs, ys = x[:pool], y[:pool], x[pool:], y[pool:]

    def mechanism_copy(private: bool) -> Mechanism:
        if not private:
            return make_mechanism("non-private")
        if isinstance(mechanism, Mechanism):
            return copy.deepcopy(mechanism)
        return make_mechanism(mechanism, max_grad_norm, **(mechanism_options or {}))

    def train(private: bool, xs_, ys_, init_seed: int):
        torch.manual_seed(init_seed)
        net = audit_model(model, tuple(x.shape[1:]), num_classes, num_tokens)
        mech = mechanism_copy(private)
        opt = build_optimizer(optimizer or mech.optimizer, net.parameters(), lr, momentum)
        trainer = private_trainer(
            net,
            opt,
            (xs_, ys_),
            mech,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            target=target,
            delta=delta,
            epochs=epochs,
            batch_size=batch_size,
            seed=init_seed,
        )
        for batch in trainer.batches(max(1, round(epochs * trainer.sampler.steps_per_epoch))):
            trainer.step(batch)
        return net, trainer

    tm, ts = torch.as_tensor(member), torch.as_tensor(shadow_member)
    if tm.sum() < 2 or ts.sum() < 2:
        raise PrivgradError("too few members drawn; use a larger pool (--trials, pool= in Python)")
    fewest = int(min(tm.sum(), ts.sum()))
    if batch_size > fewest:  # the record's batch size is the one that ran
        raise PrivgradError(
            f"batch size {batch_size:g} exceeds the {fewest} members drawn (about half of "
            f"the pool of {pool}); pass --batch-size at most {fewest} or a larger pool "
            "(--trials, pool= in Python)"
        )
    report, trainers = {}, {}
    for name, private in (("target", True), ("control", False)):
        net, trainer = train(private, xt[tm], yt[tm], seed)
        shadow, _ = train(private, xs[ts], ys[ts], seed + 1)
        losses, probs = _outputs(net, xt, yt)
        s_losses, s_probs = _outputs(shadow, xs, ys)
        attack = fit_logistic(top_posteriors(s_probs), shadow_member)
        scores = {"loss": -losses, "shadow": attack(top_posteriors(probs))}
        correct = (probs.argmax(1) == yt).numpy()
        report[name] = {
            "train_accuracy": float(correct[member].mean()),
            "test_accuracy": float(correct[~member].mean()),
            "attacks": {a: _attack_metrics(s, member, delta, alpha / 2) for a, s in scores.items()},
        }
        report[name]["epsilon_lower_bound"] = max(
            a["epsilon_lower_bound"] for a in report[name]["attacks"].values()
        )
        trainers[name] = trainer
    return {
        **trained_audit_record(
            "mia",
            trainers["target"],
            target,
            report["target"]["epsilon_lower_bound"],
            alpha,
            pool,
            delta,
        ),
        "epochs": epochs,
        "members": int(member.sum()),
        "pool": pool,
        "dataset": dataset,
        "model": model,
        "target": report["target"],
        "control": report["control"],
        "control_epsilon_lower_bound": report["control"]["epsilon_lower_bound"],
        "lr": lr,
        "batch_size": batch_size,
        "clip": max_grad_norm,
        "seed": seed,
        "wall_time_s": round(time.time() - started, 2),
    }


__all__ = ["mia_audit", "fit_logistic", "top_posteriors"]
