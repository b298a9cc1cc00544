"""Claimed ε with each paper's own accountant, beside the honest PLD figure (issue 41, item 2).

A run record's ``epsilon_claimed`` is privgrad's PLD accountant at the σ the paper's analysis
calls for; the papers computed theirs with RDP (their ``[paper_privacy]``). From a record's
privacy facts (q, steps, epochs, σ as published, σ_eff, δ; GIP's index-selection budget, which
its paper adds by basic composition) this module rebuilds the run's events, checks that they
reproduce the recorded ε, and asks the accountant for:

- the run's claimed ε with the paper's accountant (the σ that ran, our steps);
- the *paper's setting* at a number of steps: the σ at which the paper's accountant gives the
  paper's ε, and at that σ the honest ε (PLD at its effective multiplier) and the claimed ε,
  at our steps and at the paper's (its epochs × our steps per epoch, the same q).

Nothing is typed in: every ε comes from dp-accounting, on the mechanism the record ran.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from privgrad.accounting.ledger import epsilon_of, poisson_gaussian_event
from privgrad.errors import PrivgradError
from privgrad.lab.report.records import Rec
from privgrad.lab.reproduce import Experiment

ACCOUNTANT_NAMES = {
    "rdp": "RDP",
    "rdp-mironov": "RDP, Mironov's conversion",
    "pld": "PLD",
    "own": "the paper's own bound",
}
GIP_INDEX_FRACTION = 0.01  # GIP's default index budget: 1 % of the target ε (gip.py)
REL_TOL = 1e-3  # rebuilt and recorded ε must agree this closely
# The papers' RDP: Opacus' default orders (Spectral-DP and GReDP name Opacus; Bottleneck picks α
# among the integers 2-64; GIP follows De et al.), converted to (ε, δ) by dp-accounting with
# Balle et al. (2020) Thm 21, as Opacus and GIP do. At the papers' ε (≥ 0.5 at δ = 1e-5) the
# best order lies inside this grid, so a wider grid gives the same ε.
PAPER_RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
CALIBRATION_TOL = 1e-4  # the paper's σ to 0.01 %, rounded up (its accountant's ε ≤ the paper's)


@dataclass(frozen=True)
class RunPrivacy:
    """One run's privacy events, rebuilt from its record: ``steps`` Poisson-subsampled
    Gaussian releases at rate ``q`` (noise multiplier ``sigma`` as published for the claim,
    ``sigma_eff`` for the honest ε), plus pure-DP steps of total ε ``pure`` (GIP's index
    selection, composed by basic composition as its paper does; 0 for the others)."""

    q: float
    steps: int
    epochs: float
    sigma: float
    sigma_eff: float
    delta: float
    pure: float
    paper_epsilon: float  # the paper's ε of the run's cell (its σ was calibrated to it)

    def steps_at(self, epochs: float) -> int:
        """Steps of ``epochs`` epochs at this run's q and steps per epoch."""
        return max(1, round(self.steps * epochs / self.epochs))

    def claimed(self, accountant: str, steps: int | None = None, sigma: float | None = None):
        """The paper's analysis: σ as published, composed by ``accountant``."""
        return (
            _gaussian(
                self.q,
                self.sigma if sigma is None else sigma,
                steps or self.steps,
                self.delta,
                accountant,
            )
            + self.pure
        )

    def honest(self, steps: int | None = None, sigma: float | None = None) -> float:
        """PLD at the effective multiplier of σ (σ_eff / σ of the run), pure steps added."""
        scale = self.sigma_eff / self.sigma
        s = self.sigma if sigma is None else sigma
        return _gaussian(self.q, s * scale, steps or self.steps, self.delta, "pld") + self.pure

    def paper_setting(self, accountant: str, steps: int) -> Setting:
        """The σ at which ``accountant`` gives the paper's ε over ``steps`` steps (to 0.01 %,
        never above it), and the honest and claimed ε there."""
        sigma = _calibrate(self.paper_epsilon - self.pure, self.delta, self.q, steps, accountant)
        return Setting(
            steps, sigma, self.honest(steps, sigma), self.claimed(accountant, steps, sigma)
        )


@dataclass(frozen=True)
class Setting:
    steps: int
    sigma: float
    honest: float
    claimed: float

    @property
    def ratio(self) -> float:
        return self.honest / self.claimed


@functools.lru_cache(maxsize=4096)
def _gaussian(q: float, sigma: float, steps: int, delta: float, accountant: str) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian releases: privgrad's PLD accountant (the
    honest figure's), or dp-accounting's RDP accountant at :data:`PAPER_RDP_ORDERS`."""
    event = poisson_gaussian_event(q, sigma)
    if accountant not in ("rdp", "rdp-mironov"):
        return epsilon_of([(event, steps)], delta, accountant)
    rdp = RdpAccountant(orders=list(PAPER_RDP_ORDERS))
    rdp.compose(dp_event.SelfComposedDpEvent(event, steps))
    if accountant == "rdp":
        return float(rdp.get_epsilon(delta))
    return mironov_epsilon(PAPER_RDP_ORDERS, rdp._rdp, delta)  # noqa: SLF001 (no public getter)


def mironov_epsilon(orders, rdp, delta: float) -> float:
    """Mironov (2017), Prop. 3: an (α, ρ)-RDP mechanism is (ρ + log(1/δ)/(α − 1), δ)-DP; the
    smallest over ``orders``. Looser than Balle et al.'s conversion (dp-accounting's and
    Opacus'), so it calls for a larger σ at the same ε; Spectral-DP and GReDP state it (their
    Proposition 1)."""
    return float(min(r + math.log(1 / delta) / (a - 1) for a, r in zip(orders, rdp) if a > 1))


@functools.lru_cache(maxsize=256)
def _calibrate(target: float, delta: float, q: float, steps: int, accountant: str) -> float:
    """The smallest σ (to :data:`CALIBRATION_TOL`, from above) whose ε by ``accountant`` is at
    most ``target``: the σ the paper's analysis calls for."""

    def eps(sigma):
        return _gaussian(q, sigma, steps, delta, accountant)

    lo, hi = 0.0, 1.0
    while eps(hi) > target:
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            raise PrivgradError(f"no σ ≤ 1e4 gives ε = {target:g} over {steps} steps at q = {q:g}")
    while hi - lo > CALIBRATION_TOL * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return hi


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def run_privacy(data: dict, paper_epsilon: float) -> RunPrivacy | str:
    """The run's events from its record (a run at ``paper_epsilon``, the paper's ε of its
    cell), or why they cannot be rebuilt: a field is missing, or the rebuilt events do not give
    the recorded claimed and honest ε (within 0.1 %)."""
    v = {
        k: _number(data.get(k))
        for k in (
            "sampling_rate",
            "steps",
            "epochs",
            "noise_multiplier",
            "effective_noise_multiplier",
            "delta",
            "epsilon",
            "epsilon_claimed",
        )
    }
    cfg = data.get("config") or {}
    missing = [k for k, x in v.items() if x is None or x <= 0]
    if missing:
        return "the record has no finite positive " + ", ".join(missing)
    if not 0 < v["sampling_rate"] <= 1 or v["steps"] != int(v["steps"]):
        return "the record's q or steps are not a Poisson-sampled run's"
    pure = 0.0
    if data.get("mechanism") == "gip":
        opts = data.get("mechanism_options") or {}
        target = _number(cfg.get("epsilon")) or paper_epsilon
        pure = _number(opts.get("index_epsilon_total"))
        if pure is None:
            pure = float(opts.get("index_budget_fraction", GIP_INDEX_FRACTION)) * target
    run = RunPrivacy(
        q=v["sampling_rate"],
        steps=int(v["steps"]),
        epochs=v["epochs"],
        sigma=v["noise_multiplier"],
        sigma_eff=v["effective_noise_multiplier"],
        delta=v["delta"],
        pure=pure,
        paper_epsilon=paper_epsilon,
    )
    claimed, honest = run.claimed("pld"), run.honest()
    if not math.isclose(claimed, v["epsilon_claimed"], rel_tol=REL_TOL):
        recorded = v["epsilon_claimed"]
        return f"the rebuilt events give claimed ε {claimed:.4f}, the record {recorded:.4f}"
    # GIP's honest ε takes the smaller of basic and tight composition; the rebuilt one is basic
    if honest < v["epsilon"] * (1 - REL_TOL) or (
        not pure and not math.isclose(honest, v["epsilon"], rel_tol=REL_TOL)
    ):
        return f"the rebuilt events give honest ε {honest:.4f}, the record {v['epsilon']:.4f}"
    return run


def _key(run: RunPrivacy) -> tuple:
    return tuple(float(f"{x:.9g}") for x in vars(run).values())


@dataclass
class PrivacyRow:
    """One cell of a paper's claims (its nominal ε, one set of privacy facts), over the
    experiments that show its runs."""

    paper: str
    epsilon: float
    accountant: str  # rdp | pld | own
    experiments: list[str]
    runs: list[Rec]
    run: RunPrivacy | None = None
    why: str = ""  # why run is None
    paper_epochs: float | None = None
    claimed_paper: float | None = None  # the runs' claimed ε with the paper's accountant
    ours: Setting | None = None  # the paper's setting at our steps
    theirs: Setting | None = None  # ... at the paper's epochs
    sources: dict = field(default_factory=dict)

    @property
    def arms(self) -> str:
        """The arms its runs are of ("GReDP · paper, ..."), in the order first seen."""
        return ", ".join(dict.fromkeys(str(r.data.get("arm", "?")) for r in self.runs))

    @property
    def run_ratio(self) -> float:
        """Recorded honest ε / claimed ε with the paper's accountant (∞: no guarantee)."""
        honest = [r.eps("epsilon") for r in self.runs]
        if any(h is None for h in honest) or not self.claimed_paper:
            return math.inf
        return max(honest) / self.claimed_paper


def privacy_rows(paper: str, cells: list[tuple[Experiment, float, list[Rec]]]) -> list[PrivacyRow]:
    """The rows of one paper: its proposed arms' runs at the paper's setting, per experiment and
    nominal ε (``cells``), grouped by nominal ε, accountant, the paper's epochs and the runs'
    privacy facts (experiments whose runs share them make one row)."""
    rows: dict[tuple, PrivacyRow] = {}
    for exp, eps, recs in cells:
        pp = exp.paper_privacy
        acc = pp.get("accountant")
        if acc is None:
            continue
        epochs = pp.get("epochs")
        for r in recs:
            run = None if acc == "own" else run_privacy(r.data, eps)
            fact = ("own",) if acc == "own" else _key(run) if isinstance(run, RunPrivacy) else run
            key = (eps, acc, epochs, fact)
            row = rows.get(key)
            if row is None:
                row = rows[key] = PrivacyRow(paper, eps, acc, [], [], paper_epochs=epochs)
                row.sources = {"accountant": pp["accountant_source"], "epochs": pp["epochs_source"]}
                if isinstance(run, RunPrivacy):
                    row.run = run
                elif isinstance(run, str):
                    row.why = run
            if exp.id not in row.experiments:
                row.experiments.append(exp.id)
            if r.fp not in {x.fp for x in row.runs}:
                row.runs.append(r)
    for row in rows.values():
        if row.run is None:
            if row.accountant == "own":
                values = [r.eps("epsilon_claimed") for r in row.runs]
                row.claimed_paper = max(values) if None not in values else None
            continue
        row.claimed_paper = row.run.claimed(row.accountant)
        row.ours = row.run.paper_setting(row.accountant, row.run.steps)
        if row.paper_epochs is not None:
            row.theirs = row.run.paper_setting(row.accountant, row.run.steps_at(row.paper_epochs))
    return sorted(rows.values(), key=lambda w: (w.epsilon, w.experiments, w.run is None))
