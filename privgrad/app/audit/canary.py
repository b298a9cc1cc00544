"""Gradient-canary audit: many trials of a few steps of one mechanism, with and without
a canary, through the mechanism's own chain (Jagielski et al. 2020; Nasr et al. 2021, 2023).

Setting (white-box, the strongest auditor). The auditor fixes the model's parameters and
a small background set D0 (empty by default) and adds one canary, D1 = D0 + canary. The
canary's per-sample gradient is made large enough that every clipping stage clips it to
exactly its bound: ``canary='dense'`` (random ±1 coordinates) or ``'dirac'`` (one
coordinate per layer) inject a fixed gradient vector, with equal norm in every layer so
that per-layer clipping saturates too; ``'input'`` is a real input whose gradient comes
through the model's per-sample rules, its loss weighted so that every layer's gradient
is large. ``'auto'`` (default) injects a dense canary when every stage is one of the
shared stages (which see gradients only through the LayerGrads interface) and uses an
input canary otherwise, so that layer-aware stages (the spectral transforms) see real
layers. Each trial runs ``steps`` steps of ``mechanism.privatize`` on D0 or on D1
(Poisson sampling at ``sampling_rate``; at q = 1 every step sees the whole set) with
fresh noise, and scores the release by

    t = Σ_steps ⟨release, m⟩ / ‖m‖,   m = release(D1) − release(D0) with the noise switched off

(the same chain with every ``noise_multiplier`` set to 0: for a linear mechanism with
Gaussian noise at q = 1 this is the Neyman–Pearson test; for sign post-processing it is
⟨sign(·), sign(canary)⟩). At q < 1 the canary is in a step's batch with probability q, and
``statistic='likelihood-ratio'`` scores the steps' projections x_t by the log-likelihood
ratio Σ_t log(1 − q + q·exp(a·x_t/s − a²/2)) of Poisson-sampled Gaussian steps (a = the
noiseless shift ‖m‖/s, s = the noise std along m, estimated on threshold-selection trials
only), which the sum under-weights: the test a multi-step end-to-end audit needs.
``statistic='empirical'`` instead estimates m from a separate batch of noisy trials, which
adapts to any post-processing. Each record also gives the audit's power: the bound it reaches
on a simulated ideal release (Poisson-sampled Gaussian at the honest, and at the claimed,
effective σ) with the same trials, steps, q and statistic. The trial scores go to
:func:`privgrad.app.audit.stats.epsilon_lower_bound` (threshold on held-out trials,
Clopper–Pearson), next to the honest and the claimed ε of exactly the audited steps.

Stages that need the run's length or budget are planned as ``make_private`` plans them,
and every stage's attributes are restored before each trial, so that stateful stages (a
step counter, a schedule) make the trials independent replicates.

Speed. When every stage before the first noise stage is deterministic (clip, sum,
scale) and every stage from it on acts on each trial on its own (the Gaussian noise
stages, scaling, sign), those stages are run on a stack of trials at once:
the same stage objects and code, with a leading trial dimension. At q < 1 with no
background each step's batch is the canary or nothing, so a stacked step picks, per trial,
the prefix with or without the canary. Any other chain (FFT
transforms, index selection, unknown stages) runs one ``privatize`` call per trial and
step. Which stages are which is what they declare (``Capabilities.trial_shared``, before
the noise; ``trial_stacked``, from the noise on, acting on each trial independently); a
stage defined outside privgrad opts in the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privgrad.errors import PrivgradError
from privgrad.mechanisms import Mechanism
from privgrad.mechanisms.stages import StepState, capabilities_of, run_stages
from privgrad.per_sample import GradSampler, MaterializedGrads, PerSampleGrads
from privgrad.app.audit.common import (
    audit_model,
    epsilons,
    flat,
    has_noise,
    make_mechanism,
    noise_off,
    set_noise,
)
from privgrad.app.audit.stats import (
    epsilon_lower_bound,
    gaussian_epsilon,
    gaussian_mu_estimate,
    mu_exceeds,
    simulated_gaussian_bound,
    subsampled_gaussian_statistic,
)

CANARIES = ("auto", "dense", "dirac", "input")
# trials × steps × parameters, both sides together: each is one coordinate of a release
# (noise drawn, clipped, scored). The committed audits go up to 8.6·10^9 (4·10^6 trials per
# side of a 1,078-parameter model, about 4 minutes on 2 cores); 10^11 is some hours.
MAX_AUDIT_WORK = 10**11
STATISTICS = ("mean-shift", "likelihood-ratio", "empirical")


def generic_chain(mech: Mechanism) -> bool:
    """True if every stage sees per-sample gradients only through the LayerGrads interface
    (``Capabilities.injected_canaries``), so injected gradient canaries take the real path."""
    return all(capabilities_of(s).injected_canaries for s in mech.stages)


class _Snapshot:
    """The stages' attributes after set-up; restored before every trial, so that stateful
    stages (a step counter, a schedule) make every trial an independent replicate of the
    same ``steps`` steps."""

    def __init__(self, mech: Mechanism):
        self.saved = [(stage, dict(vars(stage))) for stage in mech.stages]

    def restore(self) -> None:
        for stage, attrs in self.saved:
            vars(stage).clear()
            vars(stage).update(attrs)


def _plan(
    mech: Mechanism,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    B: float,
    delta: float,
    steps: int,
    target_epsilon: float | None,
    seed: int,
) -> None:
    """What ``make_private`` does for stages that need the run's model, data shapes, length
    or budget: ``mech.plan(context)`` with the context of a trainer over the audited set D1."""
    from privgrad.private import PrivateTrainer

    trainer = PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y), mech, B, delta, seed
    )
    mech.plan(trainer.plan_context(steps, target_epsilon))


def _is_noise(stage) -> bool:
    return capabilities_of(stage).noise


def batched_split(mech: Mechanism) -> int | None:
    """Index of the first noise stage if the chain can run trials stacked (see module
    docstring), else None. A chain without noise is deterministic: its index is len."""
    k = next((i for i, s in enumerate(mech.stages) if _is_noise(s)), len(mech.stages))
    pre_ok = all(capabilities_of(s).trial_shared for s in mech.stages[:k])
    post_ok = all(capabilities_of(s).trial_stacked for s in mech.stages[k:])
    return k if pre_ok and post_ok else None


def _loss(logits, target):
    return F.cross_entropy(logits, target, reduction="none")


def _layer_tensors(psg: PerSampleGrads) -> list[list[torch.Tensor]]:
    return [[g.detach() for g in layer.per_sample()] for layer in psg.layers]


def _materialized(layers, tensors: list[list[torch.Tensor]], rows=None) -> PerSampleGrads:
    out, batch = [], None
    for params, ts in zip(layers, tensors):
        ts = ts if rows is None else [t[rows] for t in ts]
        batch = ts[0].shape[0]
        out.append(MaterializedGrads(params, ts))
    return PerSampleGrads(out, batch)


def _injected_canary(
    layer_params, kind: str, norm: float, gen: torch.Generator
) -> list[list[torch.Tensor]]:
    """One canary gradient per layer with norm/√L in each layer (total norm ``norm``)."""
    per_layer = norm / math.sqrt(len(layer_params))
    out = []
    for params in layer_params:
        sizes = [p.numel() for p in params]
        if kind == "dense":
            v = torch.sign(torch.randn(sum(sizes), generator=gen))
            v[v == 0] = 1.0
        else:  # dirac
            v = torch.zeros(sum(sizes))
            v[int(torch.randint(0, sum(sizes), (1,), generator=gen))] = 1.0
        v = v * (per_layer / v.norm())
        out.append([c.reshape(p.shape) for c, p in zip(v.split(sizes), params)])
    return out


def _weighted_loss(weights: torch.Tensor):
    def loss(logits, target):
        return F.cross_entropy(logits, target, reduction="none") * weights

    return loss


def _input_canary(sampler, input_shape, num_classes, norm: float, gen, candidates: int = 32):
    """A real input example as the canary: of ``candidates`` random inputs with random
    labels, the one whose smallest non-zero per-layer gradient norm is largest, with its
    loss weighted by w so that every layer's gradient has norm ≥ ``norm`` (so that any
    clipping, flat or per layer, saturates; the adversary chooses the canary's gradient).
    Returns (x, y, w, norm of the weighted gradient)."""
    x = torch.randn(candidates, *input_shape, generator=gen)
    y = torch.randint(0, num_classes, (candidates,), generator=gen)
    psg, _ = sampler.compute(x, y, _loss)
    per_layer = torch.stack(psg.layer_norms_sq()).sqrt()  # (L, candidates)
    smallest = torch.where(per_layer > 0, per_layer, torch.inf).min(0).values
    smallest = torch.where(torch.isinf(smallest), torch.zeros_like(smallest), smallest)
    i = int(smallest.argmax())
    if not smallest[i] > 0:
        raise PrivgradError("no candidate canary input has a non-zero gradient")
    w = norm / float(smallest[i])
    return x[i : i + 1], y[i : i + 1], w, w * float(per_layer[:, i].norm())


class _Sides:
    """The neighbouring datasets D0 (rows :n0) and D1 (rows :n0+1, the canary last) as
    per-sample gradients, and their Poisson batches. Injected canaries are materialised
    gradients; input canaries go through the model's per-sample gradient rules each time
    (so that layer-type-aware stages, e.g. the spectral transforms, see real layers)."""

    def __init__(self, kind, sampler, layers, x, y, w, tensors, n0, q, gen):
        self.kind, self.sampler, self.layers = kind, sampler, layers
        self.x, self.y, self.w, self.tensors = x, y, w, tensors
        self.n0, self.q, self.gen = n0, q, gen
        self._full = {}

    def _rows(self, rows: torch.Tensor) -> PerSampleGrads:
        if self.kind == "input":
            if len(rows) == 0:
                return self.sampler.empty()
            return self.sampler.compute(self.x[rows], self.y[rows], _weighted_loss(self.w[rows]))[0]
        return _materialized(self.layers, self.tensors, rows)

    def full(self, side: int) -> PerSampleGrads:
        if side not in self._full:
            self._full[side] = self._rows(torch.arange(self.n0 + side))
        return self._full[side]

    def batch(self, side: int) -> PerSampleGrads:
        if self.q >= 1:
            return self.full(side)
        keep = torch.rand(self.n0 + side, generator=self.gen) < self.q
        return self._rows(keep.nonzero().flatten())


def _prefix(mech: Mechanism, psg: PerSampleGrads, B: float, gen, split: int) -> StepState:
    return run_stages(mech.stages[:split], StepState(psg, B, gen))


# StepState facts a q < 1 stacked trial cannot mix between the two prefixes (an index
# selection made on one batch): chains that set them run trial by trial
_UNSHARED = ("mask", "index_selection")


def _agree(with_canary: StepState, empty: StepState) -> bool:
    """Whether the two prefixes agree on every StepState fact the later stages read."""
    return all(
        getattr(with_canary, f) == getattr(empty, f)
        for f in ("sensitivity", "noise_scale", "spectral_layers")
    ) and all(getattr(st, f) is None for st in (with_canary, empty) for f in _UNSHARED)


def stacked_prefixes(mech, sides, side, B, gen, split) -> tuple[StepState, StepState] | None:
    """The prefix states (chain up to the first noise stage) with and without the canary
    in the batch, when trials can run stacked: q = 1 (both are the whole side), or q < 1
    with no background (each step's batch is the canary or nothing) and prefixes that
    agree on every field the later stages read. None: run trial by trial."""
    if split is None:
        return None
    if sides.q >= 1:
        full = _prefix(mech, sides.full(side), B, gen, split)
        return full, full
    if sides.n0 != 0:
        return None
    empty = _prefix(mech, sides.full(0), B, gen, split)
    if side == 0:
        return empty, empty
    canary = _prefix(mech, sides.full(1), B, gen, split)
    return (canary, empty) if _agree(canary, empty) else None


def _releases(
    mech: Mechanism,
    sides: _Sides,
    side: int,
    n: int,
    steps: int,
    B: float,
    gen: torch.Generator,
    split: int | None,
    snapshot: _Snapshot,
    direction: torch.Tensor | None = None,
    chunk_elems: int = 1 << 22,
):
    """Yields, for successive chunks of the n trials, the (K, P) releases summed over the
    ``steps`` steps, or with ``direction`` (a unit (P,) vector) the (K, steps) per-step
    projections ⟨release_t, direction⟩."""
    prefixes = stacked_prefixes(mech, sides, side, B, gen, split)
    if prefixes is not None:
        with_canary, without = prefixes
        P = sum(g.numel() for g in with_canary.grads)
        chunk = max(1, min(n, chunk_elems // max(1, P)))
        done = 0
        while done < n:
            K = min(chunk, n - done)
            total, per_step = 0, []
            for _ in range(steps):
                if with_canary is without:
                    grads = [g.unsqueeze(0).expand(K, *g.shape).clone() for g in with_canary.grads]
                else:  # Poisson: the canary is in this step's batch with probability q
                    keep = torch.rand(K, generator=sides.gen) < sides.q
                    grads = [
                        torch.where(keep.view(K, *[1] * g1.dim()), g1, g0)
                        for g1, g0 in zip(with_canary.grads, without.grads)
                    ]
                st = dataclasses.replace(
                    with_canary,
                    grads=grads,
                    noise=[],
                    pure_events=list(with_canary.pure_events),
                    claimed_pure_events=list(with_canary.claimed_pure_events),
                    extra=dict(with_canary.extra),
                )
                st = run_stages(mech.stages[split:], st)
                r = flat(st.grads, 1)  # the release (a spectral prefix is complex)
                if direction is None:
                    total = total + r
                else:
                    per_step.append(r @ direction)
            done += K
            yield total if direction is None else torch.stack(per_step, 1)
        return
    buf = []
    for i in range(n):
        total, per_step = None, []
        snapshot.restore()
        for _ in range(steps):
            grads, _, _ = mech.privatize(sides.batch(side), B, gen)
            r = flat(grads)
            if direction is None:
                total = r if total is None else total + r
            else:
                per_step.append(r @ direction)
        buf.append(total if direction is None else torch.stack(per_step))
        if len(buf) == 256 or i == n - 1:
            yield torch.stack(buf)
            buf = []


def _step_scores(mech, sides, side, n, steps, B, gen, split, snapshot, direction) -> np.ndarray:
    """(n, steps) per-step projections of the releases on ``direction``."""
    chunks = _releases(mech, sides, side, n, steps, B, gen, split, snapshot, direction)
    return torch.cat(list(chunks)).double().numpy()


def canary_audit(
    mechanism: str | Mechanism = "dpsgd",
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target: str = "honest",
    delta: float = 1e-5,
    trials: int = 10_000,
    steps: int = 1,
    sampling_rate: float = 1.0,
    model: nn.Module | str = "small",
    input_shape: tuple[int, ...] = (1, 16, 16),
    num_classes: int = 10,
    background: int = 0,
    canary: str = "auto",
    canary_scale: float = 10.0,
    statistic: str = "mean-shift",
    alpha: float = 0.05,
    selection_fraction: float = 0.5,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    vectorize: bool | str = "auto",
    mechanism_options: dict | None = None,
    keep_scores: bool = False,
) -> dict:
    """Runs the canary audit and returns its record (see the module docstring).

    ``trials`` is the number of trials *per side* (D0 and D1); the first
    ``selection_fraction`` of them choose the threshold. ``expected_batch_size`` is the
    public size of D1 times q. Give ``noise_multiplier`` (nominal σ) or ``target_epsilon``
    (σ calibrated for these ``steps`` at ``sampling_rate``; ``target='claimed'`` calibrates
    the paper's ε, as GReDP's authors would).
    """
    started = time.time()
    if canary not in CANARIES:
        raise PrivgradError(f"canary must be one of {', '.join(CANARIES)}, got '{canary}'")
    if statistic not in STATISTICS:
        raise PrivgradError(f"statistic must be one of {', '.join(STATISTICS)}, got '{statistic}'")
    if not 0 < sampling_rate <= 1:
        raise PrivgradError(f"the sampling rate must lie in (0, 1], got {sampling_rate}")
    if steps < 1 or trials < 4 or background < 0:
        raise PrivgradError("need steps ≥ 1, trials ≥ 4 and background ≥ 0")
    if not canary_scale >= 1:
        raise PrivgradError(
            f"the canary scale must be ≥ 1 (so that clipping saturates), got {canary_scale}"
        )
    if target_epsilon is None and noise_multiplier is None:
        target_epsilon = 1.0
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model_name = model if isinstance(model, str) else type(model).__name__
    if isinstance(model, str):
        model = audit_model(model, input_shape, num_classes)
    sampler = GradSampler(model)
    layers = [layer.params for layer in sampler.empty().layers]
    n_params = sum(p.numel() for ps in layers for p in ps)
    if 2 * trials * steps * n_params > MAX_AUDIT_WORK:
        raise PrivgradError(
            f"{trials} trials per side × {steps} step(s) × {n_params} parameters is over the "
            f"canary audit's limit of {MAX_AUDIT_WORK:.0e} released coordinates (both sides): "
            "use fewer trials or steps, or a smaller --model"
        )
    mech = make_mechanism(mechanism, max_grad_norm, **(mechanism_options or {}))
    C = _clip_norm(mech, max_grad_norm)

    if canary == "auto":
        canary = "dense" if generic_chain(mech) else "input"
    # the neighbouring datasets, as per-sample gradients at the audited parameters
    x0 = torch.randn(background, *input_shape, generator=gen)
    y0 = torch.randint(0, num_classes, (background,), generator=gen)
    if canary == "input":
        xc, yc, w, canary_norm = _input_canary(
            sampler, input_shape, num_classes, canary_scale * C, gen
        )
        x1, y1 = torch.cat([x0, xc]), torch.cat([y0, yc])
        weights, tensors = torch.cat([torch.ones(background), torch.tensor([w])]), None
    else:
        base = sampler.compute(x0, y0, _loss)[0] if background else sampler.empty()
        can = _injected_canary(layers, canary, canary_scale * C, gen)
        canary_norm = canary_scale * C
        tensors = [
            [torch.cat([b, c.unsqueeze(0)]) for b, c in zip(tb, tc)]
            for tb, tc in zip(_layer_tensors(base), can)
        ]
        x1 = y1 = weights = None
    B = sampling_rate * (background + 1)
    sides = _Sides(
        canary,
        sampler,
        layers,
        x1,
        y1,
        weights,
        tensors,
        background,
        sampling_rate,
        torch.Generator().manual_seed(seed + 7919),
    )
    psg0, psg1 = sides.full(0), sides.full(1)

    if noise_multiplier is not None and has_noise(mech):
        mech.noise_multiplier = noise_multiplier
    if x1 is None:  # injected canary: D1 is the background plus a placeholder row
        x1, y1 = (
            torch.cat([x0, torch.zeros(1, *input_shape)]),
            torch.cat([y0, torch.zeros(1, dtype=y0.dtype)]),
        )
    _plan(mech, model, x1, y1, B, delta, steps, target_epsilon, seed)
    set_noise(
        mech,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        target=target,
        delta=delta,
        n_layers=len(layers),
        sampling_rate=sampling_rate,
        steps=steps,
        expected_batch_size=B,
    )
    snapshot = _Snapshot(mech)
    g = torch.Generator().manual_seed(seed + 1)
    step_facts = [mech.privatize(psg1, B, g)[1:] for _ in range(steps)]  # (records, facts) per step
    snapshot.restore()
    records, facts = step_facts[0]
    eps, eps_claimed = epsilons(step_facts, sampling_rate, delta)

    split = batched_split(mech)
    if vectorize is False or vectorize == "never":
        split = None
    elif vectorize is True and split is None:
        raise PrivgradError(f"the chain of '{mech.name}' has stages that cannot run stacked trials")

    n_dir = 0
    vectorized = stacked_prefixes(mech, sides, 1, B, torch.Generator(), split) is not None
    if statistic != "empirical":
        with noise_off(mech):
            g = torch.Generator().manual_seed(seed + 2)
            quiet = _Snapshot(mech)
            r1 = flat(mech.privatize(psg1, B, g)[0])
            quiet.restore()
            r0 = flat(mech.privatize(psg0, B, g)[0])
        snapshot.restore()
        direction = r1 - r0
    else:
        n_dir = max(2, int(trials * selection_fraction))
        gd = torch.Generator().manual_seed(seed + 3)
        means = [
            sum(
                r.sum(0) for r in _releases(mech, sides, side, n_dir, steps, B, gd, split, snapshot)
            )
            / n_dir
            for side in (0, 1)
        ]
        direction = means[1] - means[0]
    norm = float(direction.norm())
    if norm == 0 or not math.isfinite(norm):
        raise PrivgradError("the canary does not move the noiseless release; no test direction")
    direction = direction / norm

    steps0, steps1 = (
        _step_scores(
            mech,
            sides,
            side,
            trials,
            steps,
            B,
            torch.Generator().manual_seed(seed + 11 + 2 * side),
            split,
            snapshot,
            direction,
        )
        for side in (0, 1)
    )
    step_shift = noise_std = None
    if statistic == "likelihood-ratio":
        # a = noiseless per-step shift / noise std along the direction, the std from the
        # D0 trials that choose the threshold (never from those that evaluate it)
        n_sel = int(trials * selection_fraction)
        noise_std = float(steps0[:n_sel].std())
        if not noise_std > 0:
            raise PrivgradError("the likelihood-ratio statistic needs a release with noise")
        step_shift = norm / noise_std
        s0, s1 = (
            subsampled_gaussian_statistic(x / noise_std, step_shift, sampling_rate)
            for x in (steps0, steps1)
        )
    else:
        s0, s1 = steps0.sum(1), steps1.sum(1)
    bound = epsilon_lower_bound(s0, s1, delta, alpha, selection_fraction)
    mu_hat, mu_se = gaussian_mu_estimate(s0, s1)
    mu_honest = mu_claimed = None
    if sampling_rate >= 1 and records and not facts.pure_events:
        mu_honest = math.sqrt(
            steps * sum(1 / r.effective**2 if r.effective > 0 else math.inf for r in records)
        )
        mu_claimed = math.sqrt(
            steps * sum(1 / r.claimed**2 if r.claimed > 0 else math.inf for r in records)
        )
    power_honest = power_claimed = None
    gaussian = records and not facts.pure_events and statistic != "empirical"
    if gaussian and all(r.effective > 0 and r.claimed > 0 for r in records):
        power_honest, power_claimed = (
            simulated_gaussian_bound(
                math.sqrt(sum(1 / sd(r) ** 2 for r in records)),
                sampling_rate,
                steps,
                trials,
                statistic,
                delta,
                alpha,
                selection_fraction,
                seed,
            )
            for sd in (lambda r: r.effective, lambda r: r.claimed)
        )
    lb = bound.epsilon_lower_bound
    excess = mu_exceeds(mu_hat, mu_se, mu_honest)
    record = {
        "method": "canary",
        "mechanism": mech.name,
        "paper_mode": target == "claimed",
        "epsilon": eps,
        "epsilon_claimed": eps_claimed,
        "epsilon_lower_bound": lb,
        "confidence": bound.confidence,
        "trials": trials,
        "delta": delta,
        "violation": lb > eps or excess,
        "mu_exceeds_honest": excess,
        "refutes_claimed": lb > eps_claimed,
        "noise_multiplier": mech.noise_multiplier,
        "effective_noise_multiplier": records[0].effective if records else 0.0,
        "claimed_noise_multiplier": records[0].claimed if records else 0.0,
        "sampling_rate": sampling_rate,
        "steps": steps,
        "background": background,
        "expected_batch_size": B,
        "clip": C,
        "canary": canary,
        "canary_norm": canary_norm,
        "statistic": statistic,
        "direction_trials": n_dir,
        "step_shift": step_shift,
        "noise_std": noise_std,
        "power_honest": power_honest,
        "power_claimed": power_claimed,
        "model": model_name,
        "n_params": sum(p.numel() for ps in layers for p in ps),
        "n_layers": len(layers),
        "vectorized": vectorized,
        "test": bound.as_dict(),
        "mu_hat": mu_hat,
        "mu_hat_se": mu_se,
        "mu_honest": mu_honest,
        "mu_claimed": mu_claimed,
        "epsilon_gaussian_estimate": gaussian_epsilon(abs(mu_hat), delta)
        if sampling_rate >= 1
        else None,
        "seed": seed,
        "wall_time_s": round(time.time() - started, 2),
    }
    if keep_scores:  # the raw trial scores (numpy arrays; not part of the JSON record)
        record["scores0"], record["scores1"] = s0, s1
    return record


def _clip_norm(mech: Mechanism, default: float) -> float:
    return default if mech.clip_norm is None else mech.clip_norm


__all__ = ["canary_audit", "batched_split", "generic_chain", "CANARIES", "STATISTICS"]
