"""GIP (Gradient Index Pruning, seed 001) and its Random-k baseline.

GIP, Alg. 2 (default, the paper)::

    clip (Eq. 2) → sum → private top-k mask I (Alg. 1) → + N(0, σ²C²) → ⊙ I → ÷B

``prune_order='prune-then-clip'`` follows the authors' code instead: the mask is drawn
from the *unclipped* batch sum, applied to every per-sample gradient, and only then
are the masked per-sample gradients clipped, summed and noised (the clip budget is
spent on kept coordinates only). Both orders are accounted identically and soundly:
the Mallows mechanism is θ·s₁-DP with s₁ the *diameter* of S_k (Thm 1), a bound that
holds between any two batches whatever the scores (clipped or not), so it composes with
the subsampled Gaussian of the same step (see :mod:`privgrad.accounting.pure_dp`).
The mask is drawn with fresh randomness from the step's generator every step.

Private top-k (Alg. 1, Eq. 3–4, 11). The flat gradient is cut into groups of ℓ
coordinates, ``grouping='contiguous'`` over the whole flattened model in parameter
order (the paper) or ``'per-tensor'`` (groups never cross a tensor; each tensor has
its own tail; the authors' code groups *strided* columns of each tensor instead). A
group of n coordinates keeps m = clamp(⌊k·n + ½⌋, 1, n) of them (round half up, at
least one); the last group is shorter when ℓ ∤ d and has its own m and s₁. Within a
group the centre I₀ is the exact top-m by |g| with ties broken towards the lower index
(a stable sort). The Mallows sample at Hamming distance 2s from I₀ is drawn exactly
(Eq. 11): s with P(s) ∝ C(m,s)·C(n−m,s)·e^{−2θs} (log space, ``lgamma``), then s kept
and s dropped coordinates, each uniformly, swap (random 61-bit keys ranked within each
class). Everything is one batched computation over all groups.

Budget (Thm 1–2). A group with s₁ = 2·min(m, n−m) > 0 gets θ = ε_group/s₁; the run's
index budget ε₂ (default ``index_budget_fraction`` = 1 % of the target ε, as in the
paper) is split evenly over the steps that prune (m < n in some group: k = 1 is free)
and evenly over the pruning groups of a step. A step's index selection is pure
ε_step-DP, ε_step = Σ_groups θ·s₁ = ε₂ / (pruning steps), reported to the trainer as a
binary-RR event (honest: min of basic and tight composition; claimed: Thm 2's basic
composition). No subsampling amplification is credited to it (the authors' code divides
by q).

The run's length T and ε₂ are fixed by :func:`privgrad.make_private`, which calls
:meth:`PrivateTopKMask.plan` (with ``noise_multiplier`` given instead of a target,
ε₂ = f/(1−f) · ε_Gaussian, so that the index part is again the fraction f of the total
basic-composition ε). Used without ``make_private`` (e.g. in a benchmark) and without
``total_steps``/``index_epsilon_total``, the stage warns once and assumes T = 1000 and
ε₂ = 0.01; what it spends is still reported, step by step.

k(t) schedules, t = 0 … T−1, frac = t/(T−1) (1 after T−1): ``constant`` k = k_end;
``linear`` k_start + (k_end − k_start)·frac (GIP: 1.0 → 0.1); ``exponential``
k_start·(k_end/k_start)^frac (Random-k: 1.0 → 0.5). The paper gives no formula; the
authors' code uses kept% = 99.9 − (99.9 − k_final)·t/T and 99.9 − (99.9 − k_final)^{t/T}.

Random-k (Prop. 1): a fresh uniform mask with the same m per group every step,
independent of the data, so it costs no privacy: its ε equals DP-SGD's at the same σ.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from privgrad.accounting import epsilon_of
from privgrad.accounting.pure_dp import pure_dp_event
from privgrad.errors import PrivgradError
from privgrad.mechanisms.base import Mechanism
from privgrad.mechanisms.stages import (
    Capabilities,
    ClipFlat,
    GaussianNoise,
    PlanContext,
    ScaleByExpectedBatch,
    Stage,
    Sum,
)

GROUPINGS = ("contiguous", "per-tensor")
PRUNE_ORDERS = ("clip-then-prune", "prune-then-clip")
SCHEDULES = ("constant", "linear", "exponential")
FALLBACK_TOTAL_STEPS = 1000
FALLBACK_INDEX_EPSILON = 0.01


# --------------------------------------------------------------------------- pieces


def keep_count(k: float, n: torch.Tensor | int):
    """m = clamp(⌊k·n + ½⌋, 1, n): ones kept in a group of n coordinates."""
    if isinstance(n, torch.Tensor):
        return torch.clamp(torch.floor(k * n.double() + 0.5).long(), min=1).minimum(n)
    return min(n, max(1, math.floor(k * n + 0.5)))


def index_sensitivity(n, m):
    """s₁ = 2·min(m, n−m): the Hamming diameter of S_k in a group (Def. 3)."""
    return 2 * (torch.minimum(m, n - m) if isinstance(n, torch.Tensor) else min(m, n - m))


def swap_log_weights(sizes: torch.Tensor, m: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """log of C(m,s)·C(n−m,s)·e^{−2θs} for s = 0 … max_g min(m, n−m) (Eq. 11), shape
    (G, S+1), −∞ where s > min(m, n−m)."""
    a = m.long()[:, None]
    b = sizes.long()[:, None] - a
    smax = torch.minimum(a, b)
    s = torch.arange(int(smax.max()) + 1, device=sizes.device)[None]
    sc = torch.minimum(s, smax)
    lf = _log_factorials(int(sizes.max()), sizes.device)
    logw = (
        lf[a]
        - lf[sc]
        - lf[a - sc]
        + lf[b]
        - lf[sc]
        - lf[b - sc]
        - 2 * theta.double()[:, None] * sc.double()
    )
    return torch.where(s <= smax, logw, logw.new_tensor(-math.inf))


_LOG_FACTORIALS: dict[torch.device, torch.Tensor] = {}


def _log_factorials(n: int, device: torch.device) -> torch.Tensor:
    """log j! = lgamma(j + 1) for j = 0 … ≥ n, computed in float64 on the CPU (the same values
    on every device) and kept per device, so a GIP step on CUDA copies no table."""
    table = _LOG_FACTORIALS.get(device)
    if table is None or len(table) <= n:
        table = torch.lgamma(torch.arange(max(n + 1, 257), dtype=torch.float64) + 1).to(device)
        _LOG_FACTORIALS[device] = table
    return table


def swap_distribution(n: int, m: int, theta: float) -> torch.Tensor:
    """Exact P(s), s = 0 … min(m, n−m), of the number of swaps of a Mallows sample."""
    logw = swap_log_weights(torch.tensor([n]), torch.tensor([m]), torch.tensor([theta]))[0]
    return torch.softmax(logw[: min(m, n - m) + 1], 0)


def sample_swaps(sizes, m, theta, generator: torch.Generator) -> torch.Tensor:
    """One draw of s per group from Eq. 11 by inverting the float64 CDF."""
    cdf = torch.softmax(swap_log_weights(sizes, m, theta), 1).cumsum(1)
    u = (
        torch.rand(len(sizes), generator=generator, dtype=torch.float64, device=sizes.device)
        * cdf[:, -1]
    )
    s = (cdf < u[:, None]).sum(1)
    return torch.minimum(s, torch.minimum(m, sizes - m))


def mallows_topk(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    m: torch.Tensor,
    theta: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact Mallows samples (Eq. 3–4 via Eq. 11) around the top-m of every group.

    ``scores`` (G, L): each row holds a group's n_g scores first, then padding. Returns
    (mask (G, L) bool with exactly m_g ones among the first n_g, the centre I₀ (the
    top-m by |score|, lower index first on ties), the swaps s (G,)).
    """
    G, L = scores.shape
    pos = torch.arange(L, device=scores.device)
    valid = pos < sizes[:, None]
    order = _descending_order(torch.nan_to_num(scores.abs(), nan=0.0), valid)  # p-th largest
    s = sample_swaps(sizes, m, theta, generator)
    # in sorted coordinates p: top (p < m), dropped (m ≤ p < n), padding (p ≥ n); order each
    # class uniformly at random, then keep ranks s … m+s−1: s top ones out, s dropped in.
    cls = (pos >= m[:, None]).long() + (pos >= sizes[:, None]).long()
    shuffle = _argsort_rows(_random_keys(G, L, generator) + (cls << _KEY_BITS))
    keep = (pos >= s[:, None]) & (pos < (m + s)[:, None])
    original = torch.gather(order, 1, shuffle)
    mask = torch.zeros(G, L, dtype=torch.bool, device=scores.device).scatter_(1, original, keep)
    centre = torch.zeros(G, L, dtype=torch.bool, device=scores.device).scatter_(
        1, order, pos < m[:, None]
    )
    return mask, centre, s


_KEY_BITS = 61  # random ranking keys: 61 random bits (ties ~ ℓ²/2⁶² per group), class above


def _argsort_rows(keys: torch.Tensor) -> torch.Tensor:
    """Ascending order of each row of int64 ``keys``. Rows of distinct keys have one such
    order, so any sort gives it: numpy's vectorised sort on the CPU, where it is faster than
    torch's (results/bench/engine_notes.md), torch's on other devices."""
    if keys.device.type == "cpu":
        return torch.from_numpy(np.argsort(keys.numpy(), axis=1))
    return torch.argsort(keys, dim=1)


def _descending_order(key: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's positions by ``key`` (≥ 0) from the largest, ties towards the lower
    position, positions that are not ``valid`` last: a stable descending sort. For float32
    keys on the CPU, as :func:`_argsort_rows` of one distinct int64 per position (valid bit,
    the key's bits, which order like the non-negative floats they encode, and the reversed
    position), which gives the same order faster."""
    L = key.shape[1]
    if key.dtype != torch.float32 or key.device.type != "cpu" or L > 1 << 31:
        return torch.sort(
            torch.where(valid, key, key.new_tensor(-1.0)), dim=1, descending=True, stable=True
        ).indices
    pos = torch.arange(L)
    bits = torch.where(valid, key, 0.0).view(torch.int32).long()
    rank = (valid.long() << 62) | (bits << 31) | (L - 1 - pos)
    return _argsort_rows(-rank)


def _random_keys(G: int, L: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(
        0, 2**_KEY_BITS, (G, L), generator=generator, dtype=torch.long, device=generator.device
    )


def uniform_masks(
    sizes: torch.Tensor, m: torch.Tensor, L: int, generator: torch.Generator
) -> torch.Tensor:
    """Uniformly random m_g-subsets of each group's first n_g positions (Random-k)."""
    pos = torch.arange(L, device=sizes.device)
    keys = _random_keys(len(sizes), L, generator) + ((pos >= sizes[:, None]).long() << _KEY_BITS)
    order = _argsort_rows(keys)
    return torch.zeros(len(sizes), L, dtype=torch.bool, device=sizes.device).scatter_(
        1, order, pos < m[:, None]
    )


class GroupLayout:
    """Maps a flat gradient of d coordinates to a padded (G, ℓ) matrix of groups."""

    def __init__(self, numels: list[int], group_size: int = 256, grouping: str = "contiguous"):
        if grouping not in GROUPINGS:
            raise PrivgradError(f"grouping must be one of {', '.join(GROUPINGS)}, got '{grouping}'")
        if not (isinstance(group_size, int) and group_size >= 1):
            raise PrivgradError(f"the group size must be a positive integer, got {group_size}")
        self.numels, self.group_size, self.grouping = list(numels), group_size, grouping
        self.d = d = sum(numels)
        chunks = [(0, d)] if grouping == "contiguous" else []
        if grouping == "per-tensor":
            offset = 0
            for n in numels:
                chunks.append((offset, n))
                offset += n
        rows = []
        for offset, n in chunks:  # once per layout, never per step
            g = -(-n // group_size)
            idx = offset + torch.arange(g * group_size).view(g, group_size)
            rows.append(torch.where(idx < offset + n, idx, torch.tensor(d)))
        self.index = torch.cat(rows) if rows else torch.zeros(0, group_size, dtype=torch.long)
        self.sizes = (self.index < d).sum(1)
        self.contiguous = grouping == "contiguous"

    @property
    def n_groups(self) -> int:
        return len(self.sizes)

    @property
    def device(self) -> torch.device:
        return self.sizes.device

    def to(self, device) -> "GroupLayout":
        """The same layout with its index tensors on ``device``."""
        moved = object.__new__(GroupLayout)
        moved.__dict__.update(
            self.__dict__, index=self.index.to(device), sizes=self.sizes.to(device)
        )
        return moved

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            return torch.cat([flat, flat.new_zeros(self.index.numel() - self.d)]).view(
                self.index.shape
            )
        return torch.cat([flat, flat.new_zeros(1)])[self.index]

    def scatter(self, grouped: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            return grouped.reshape(-1)[: self.d]
        out = grouped.new_zeros(self.d + 1)
        out[self.index.reshape(-1)] = grouped.reshape(-1)
        return out[: self.d]

    def split(self, flat: torch.Tensor, shapes) -> list[torch.Tensor]:
        return [t.view(s) for t, s in zip(torch.split(flat, self.numels), shapes)]


class KSchedule:
    """k(t): the kept fraction at step t of T (see the module docstring)."""

    def __init__(self, kind: str = "linear", k_start: float = 1.0, k_end: float = 0.1):
        if kind not in SCHEDULES:
            raise PrivgradError(f"k schedule must be one of {', '.join(SCHEDULES)}, got '{kind}'")
        for flag, k in (("--k-start", k_start), ("--keep-ratio", k_end)):
            if not 0 < k <= 1:
                raise PrivgradError(f"{flag} (the kept fraction) must lie in (0, 1], got {k}")
        self.kind, self.k_start, self.k_end = kind, float(k_start), float(k_end)

    def __call__(self, t: int, total: int) -> float:
        if self.kind == "constant":
            return self.k_end
        frac = 1.0 if total <= 1 else min(1.0, t / (total - 1))
        if self.kind == "linear":
            return self.k_start + (self.k_end - self.k_start) * frac
        return self.k_start * (self.k_end / self.k_start) ** frac


# --------------------------------------------------------------------------- stages


class RandomKMask(Stage):
    """Random-k (Prop. 1): a fresh uniform mask, m per group, every step; no privacy cost.

    Needs only the parameters' shapes (so it may run before clipping); stores the mask
    (one bool tensor per parameter, ``None`` when nothing is pruned) in ``state.mask``.
    """

    capabilities = Capabilities(keeps_sum=True)  # reads the sum (GIP's scores), draws a mask

    private = False

    def __init__(
        self,
        schedule: KSchedule,
        group_size: int = 256,
        grouping: str = "contiguous",
        total_steps: int | None = None,
    ):
        GroupLayout([1], group_size, grouping)  # validates the options early
        if total_steps is not None and not (isinstance(total_steps, int) and total_steps >= 1):
            raise PrivgradError(f"total_steps must be a positive integer, got {total_steps}")
        self.schedule, self.group_size, self.grouping = schedule, group_size, grouping
        self.given_total_steps = total_steps
        self.total_steps = total_steps
        self.layout: GroupLayout | None = None
        self._cache: dict = {}
        self.t = 0
        self._warned = False

    # -- planning -------------------------------------------------------------------
    def plan(self, context: PlanContext) -> None:
        """Fixes T (unless given) and the group layout for the run's parameters; resets t."""
        self.total_steps = self.given_total_steps or context.steps
        numels = [math.prod(shape) for shape in context.param_shapes]
        self.set_layout(GroupLayout(numels, self.group_size, self.grouping))
        self.t = 0

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["t"]

    def set_layout(self, layout: GroupLayout) -> None:
        self.layout = layout
        self._cache = {}

    def _fallback(self, numels) -> None:
        missing = self._missing()
        if missing and not self._warned:
            warnings.warn(
                f"{type(self).__name__} was not planned by make_private; assuming "
                + ", ".join(missing),
                stacklevel=3,
            )
            self._warned = True
        if self.total_steps is None:
            self.total_steps = FALLBACK_TOTAL_STEPS
        if self.layout is None or self.layout.numels != numels:
            self.set_layout(GroupLayout(numels, self.group_size, self.grouping))

    def _missing(self) -> list[str]:
        return [f"total_steps={FALLBACK_TOTAL_STEPS}"] if self.total_steps is None else []

    # -- one step ---------------------------------------------------------------------
    def group_keep(self, t: int, layout: GroupLayout):
        k = self.schedule(t, self.total_steps)
        m = keep_count(k, layout.sizes)
        return k, m

    def __call__(self, state):
        shapes = [p.shape for p in state.per_sample.params]
        numels = [math.prod(s) for s in shapes]
        if self.total_steps is None or self.layout is None or self.layout.numels != numels:
            self._fallback(numels)
        if self.layout.device != state.generator.device:  # the mask is drawn where the noise is
            self.set_layout(self.layout.to(state.generator.device))
        layout, t = self.layout, self.t
        self.t += 1
        k, m = self.group_keep(t, layout)
        info = {"step": t, "k": k, "kept": int(m.sum()), "groups": layout.n_groups, "epsilon": 0.0}
        if bool((m == layout.sizes).all()):
            state.mask = None
        else:
            grouped = self.sample(state, layout, m, info)
            flat = layout.scatter(grouped)
            state.mask = layout.split(flat, shapes)
        state.index_selection = info
        return state

    def sample(self, state, layout, m, info):
        return uniform_masks(layout.sizes, m, layout.group_size, state.generator)


class PrivateTopKMask(RandomKMask):
    """GIP's index selection (Alg. 1): grouped exact top-m centre + exact Mallows sample.

    Scores are ``state.grads`` (the clipped sum, or the unclipped one after
    :class:`UnclippedSum`). Reports the step's pure ε as a binary-RR event in
    ``state.pure_events`` and ``state.claimed_pure_events``.
    """

    private = True

    def __init__(
        self,
        schedule: KSchedule,
        group_size: int = 256,
        grouping: str = "contiguous",
        total_steps: int | None = None,
        index_epsilon_total: float | None = None,
        index_budget_fraction: float = 0.01,
    ):
        super().__init__(schedule, group_size, grouping, total_steps)
        if index_epsilon_total is not None and not (0 <= index_epsilon_total < math.inf):
            raise PrivgradError(
                f"index_epsilon_total must be finite and ≥ 0, got {index_epsilon_total}"
            )
        if not 0 < index_budget_fraction < 1:
            raise PrivgradError(
                f"index_budget_fraction must lie in (0, 1), got {index_budget_fraction}"
            )
        self.given_index_epsilon = index_epsilon_total
        self.index_epsilon_total = index_epsilon_total
        self.index_budget_fraction = index_budget_fraction

    def plan(self, context: PlanContext) -> None:
        """Fixes T, the layout and the index budget ε₂ (given; or f·target ε; or, with a
        fixed σ, f/(1−f)·ε of the Gaussian steps)."""
        super().plan(context)
        f = self.index_budget_fraction
        if self.given_index_epsilon is not None:
            self.index_epsilon_total = self.given_index_epsilon
        elif context.target_epsilon is not None:
            self.index_epsilon_total = f * context.target_epsilon
        else:
            sigma = context.noise.effective
            eps = epsilon_of([(context.noise_event(sigma), self.total_steps)], context.delta)
            if not math.isfinite(eps):
                raise PrivgradError(
                    "GIP with a noise multiplier of 0 has no finite ε to take a "
                    "share of; give index_epsilon_total"
                )
            self.index_epsilon_total = f / (1 - f) * eps

    def _missing(self) -> list[str]:
        return super()._missing() + (
            [f"index_epsilon_total={FALLBACK_INDEX_EPSILON}"]
            if self.index_epsilon_total is None
            else []
        )

    def _fallback(self, numels) -> None:
        super()._fallback(numels)
        if self.index_epsilon_total is None:
            self.index_epsilon_total = FALLBACK_INDEX_EPSILON

    # -- budget -----------------------------------------------------------------------
    def prunes(self, t: int) -> bool:
        """Whether step t selects indices: some group has 0 < m < n (s₁ > 0)."""
        k = self.schedule(t, self.total_steps)
        return any(index_sensitivity(n, keep_count(k, n)) > 0 for n in self._distinct_sizes())

    def _distinct_sizes(self) -> list[int]:
        if "sizes" not in self._cache:
            self._cache["sizes"] = sorted(set(self.layout.sizes.tolist()))
        return self._cache["sizes"]

    def pruning_steps(self, steps: int) -> int:
        """How many of the first ``steps`` steps select indices (k < 1 in some group)."""
        T = self.total_steps
        head = sum(self.prunes(t) for t in range(min(steps, T)))
        return head + (max(0, steps - T) if self.prunes(T) else 0)

    def epsilon_per_step(self) -> float:
        """ε_step = ε₂ / (pruning steps among the planned T); 0 if none prunes."""
        key = ("eps", self.total_steps, self.index_epsilon_total)
        if key not in self._cache:
            n = self.pruning_steps(self.total_steps)
            self._cache[key] = self.index_epsilon_total / n if n else 0.0
        return self._cache[key]

    def pure_dp_events(self, steps: int) -> list:
        """The (event, count) pairs the first ``steps`` steps will report (for calibration)."""
        if self.layout is None or self.total_steps is None or self.index_epsilon_total is None:
            raise PrivgradError("plan the GIP stage (make_private does) before calibrating")
        eps, n = self.epsilon_per_step(), self.pruning_steps(steps)
        return [(pure_dp_event(eps), n)] if eps > 0 and n > 0 else []

    def thetas(self, layout: GroupLayout, m: torch.Tensor, eps_step: float) -> torch.Tensor:
        """θ_g = ε_group/s₁_g (Thm 1) with ε_group = ε_step / (#groups with s₁ > 0)."""
        s1 = index_sensitivity(layout.sizes, m)
        pruning = int((s1 > 0).sum())
        eps_group = eps_step / pruning if pruning else 0.0
        # shaved by 1e-12 so that Σ θ·s₁ ≤ ε_step survives floating-point rounding
        return torch.where(
            s1 > 0,
            eps_group * (1 - 1e-12) / s1.clamp(min=1).double(),
            torch.zeros((), dtype=torch.float64, device=s1.device),
        )

    def sample(self, state, layout, m, info):
        eps_step = self.epsilon_per_step()
        theta = self.thetas(layout, m, eps_step)
        scores = torch.cat([g.reshape(-1) for g in state.grads]).detach()
        mask, _, s = mallows_topk(layout.gather(scores), layout.sizes, m, theta, state.generator)
        info.update(epsilon=eps_step, theta_max=float(theta.max()), swaps=int(s.sum()))
        if eps_step > 0:
            event = pure_dp_event(eps_step)
            state.pure_events.append(event)
            state.claimed_pure_events.append(event)
        return mask


class UnclippedSum(Sum):
    """Σ_i g_i without clipping: the score the authors' code prunes by (never released).
    Non-finite per-sample gradients are caught here, before the sum is reduced across ranks."""

    capabilities = Capabilities(per_sample=True, sums=True)

    def __call__(self, state):
        state.check_finite(state.per_sample.norms_sq())
        state.grads = state.per_sample.weighted_sum(
            torch.ones(state.per_sample.batch_size, device=state.generator.device)
        )
        return state


class MaskPerSample(Stage):
    """Zeroes the pruned coordinates of every per-sample gradient (prune-then-clip). The mask
    is one for every sample, so a layer's rule may keep the masked gradients unbuilt
    (:meth:`LayerGrads.masked`: under ``norm_form="fused"`` the linear and conv rules do)."""

    capabilities = Capabilities(per_sample=True)

    def __call__(self, state):
        masks = state.mask
        if masks is None:
            return state
        it = iter(masks)
        state.per_sample = state.per_sample.map_layers(
            lambda layer: layer.masked([next(it) for _ in layer.params])
        )
        return state


class ApplyMask(Stage):
    """g̃ ⊙ I (Alg. 2 line 10): pruned coordinates get exactly zero, noise included."""

    capabilities = Capabilities(coordinatewise=True)

    def __call__(self, state):
        masks = state.mask
        if masks is not None:
            state.grads = [g.masked_fill(~m, 0.0) for g, m in zip(state.grads, masks)]
        return state


# --------------------------------------------------------------------------- factories


def _chain(select: Stage, noise_multiplier, max_grad_norm, prune_order):
    if prune_order not in PRUNE_ORDERS:
        raise PrivgradError(
            f"prune_order must be one of {', '.join(PRUNE_ORDERS)}, got '{prune_order}'"
        )
    tail = [GaussianNoise(noise_multiplier), ApplyMask(), ScaleByExpectedBatch()]
    if prune_order == "clip-then-prune":
        return [ClipFlat(max_grad_norm), Sum(), select] + tail
    first = [UnclippedSum()] if select.private else []
    return first + [select, MaskPerSample(), ClipFlat(max_grad_norm), Sum()] + tail


def gip(
    noise_multiplier,
    max_grad_norm,
    k_schedule: str = "linear",
    k_start: float = 1.0,
    k_end: float = 0.1,
    group_size: int = 256,
    grouping: str = "contiguous",
    prune_order: str = "clip-then-prune",
    index_budget_fraction: float = 0.01,
    index_epsilon_total: float | None = None,
    total_steps: int | None = None,
) -> Mechanism:
    """GIP, Alg. 2: clip → sum → private top-k (Mallows) → N(0, σ²C²) → mask → ÷B."""
    select = PrivateTopKMask(
        KSchedule(k_schedule, k_start, k_end),
        group_size,
        grouping,
        total_steps,
        index_epsilon_total,
        index_budget_fraction,
    )
    return Mechanism(
        "gip",
        _chain(select, noise_multiplier, max_grad_norm, prune_order),
        "sgd",
        "GIP (seed 001), Alg. 1-2",
    )


def random_k(
    noise_multiplier,
    max_grad_norm,
    k_schedule: str = "exponential",
    k_start: float = 1.0,
    k_end: float = 0.5,
    group_size: int = 256,
    grouping: str = "contiguous",
    prune_order: str = "clip-then-prune",
    total_steps: int | None = None,
) -> Mechanism:
    """Random-k (GIP paper, Prop. 1): as GIP with a fresh uniform mask; costs no privacy."""
    select = RandomKMask(KSchedule(k_schedule, k_start, k_end), group_size, grouping, total_steps)
    return Mechanism(
        "random-k",
        _chain(select, noise_multiplier, max_grad_norm, prune_order),
        "sgd",
        "GIP (seed 001), Random-k, Prop. 1",
    )


__all__ = [
    "gip",
    "random_k",
    "PrivateTopKMask",
    "RandomKMask",
    "ApplyMask",
    "MaskPerSample",
    "UnclippedSum",
    "GroupLayout",
    "KSchedule",
    "keep_count",
    "index_sensitivity",
    "swap_distribution",
    "swap_log_weights",
    "sample_swaps",
    "mallows_topk",
    "uniform_masks",
]
