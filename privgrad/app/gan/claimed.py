"""The privacy figure RDP-GAN's paper would print (Ma et al., Thms 1-4). NOT a guarantee.

The note ``shared/spec/rdp-gan.md`` shows why none of this bounds the privacy loss of
the released models: noise on a scalar loss never reaches the gradients (reading A),
noise on the output-layer error is multiplied by unclipped, data-dependent Jacobians
(reading B), the loss bound C is an empirical maximum that nothing enforces, Thm 1 is
not an upper bound on the subsampled Gaussian's RDP, Lemma 1 needs pure ε-DP and
Thm 4 sums ε's while dropping δ. privgrad computes the figure only so that runs can be
compared with the paper; it is stored as ``epsilon_claimed``, never as ``epsilon``.

Formulas, with q = m/N the sampling rate, ΔS = C/m (Eq. 13, C from Table II) and σ
the std of the noise:

* Thm 1 (one D-step, (α, ε)-RDP):  ε(α) = q α² ΔS² / (2 (α-1) σ²)
* Thm 2 (n_d D-steps, (ε_d, δ)):   ε_d = 4 ε(α) √(2 n_d log(1/δ))
* Thm 3 (the generator):           ε_g = ε_d   (post-processing)
* Thm 4 (n_g G-steps):             ε_total = Σ_t ε_g(σ_t)   (= n_g ε_g at constant σ)
* Alg. 2 line 4 (σ_0 of RDP-ANT):  σ² = 4 q α² ΔS² √(2 n_d log(1/δ)) / (2 (α-1) ε_total/n_g)

α and δ are never fixed by the paper. The defaults here are α = 2 (α²/(α-1) is
smallest there, so it is the paper-friendliest choice) and δ = 1e-5 (the value of
Remark 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privgrad.errors import PrivgradError

DEFAULT_ALPHA = 2.0
DEFAULT_DELTA = 1e-5

# Table II: the loss bound C (an empirical maximum of the non-private loss) per dataset
# and batch size. ΔS = C/m; the paper prints 0.1953 for MNIST at batch 64, which is
# 25/128 (a misprint): privgrad uses C/m = 25/64 = 0.3906.
TABLE_II_C = {("adult", 64): 20.0, ("adult", 128): 23.0, ("mnist", 64): 25.0, ("mnist", 128): 28.0}
TABLE_II_MAX_LOSS = {
    ("adult", 64): 17.852,
    ("adult", 128): 21.242,
    ("mnist", 64): 23.534,
    ("mnist", 128): 26.823,
}

NOT_A_GUARANTEE = (
    "claimed by the paper (Ma et al., Thms 1-4); not a valid DP guarantee: "
    "see shared/spec/rdp-gan.md section 3"
)


def table_ii_loss_bound(dataset: str, batch_size: float) -> float:
    """C of Table II for the dataset and batch size (64 or 128)."""
    key = (dataset, int(batch_size)) if float(batch_size).is_integer() else None
    if key not in TABLE_II_C:
        raise PrivgradError(
            f"Table II gives the loss bound C only for batch size 64 or 128 "
            f"(mnist, adult); pass --loss-bound for {dataset} at batch {batch_size:g}"
        )
    return TABLE_II_C[key]


@dataclass(frozen=True)
class PaperAccountant:
    """Thms 1-4 of RDP-GAN for one configuration; every method returns the paper's figure."""

    sampling_rate: float  # q = m / N
    sensitivity: float  # ΔS = C / m
    discriminator_steps: int  # n_d
    alpha: float = DEFAULT_ALPHA
    delta: float = DEFAULT_DELTA

    def __post_init__(self):
        if not 0 < self.sampling_rate <= 1:
            raise PrivgradError(f"the sampling rate must lie in (0, 1], got {self.sampling_rate}")
        if not self.sensitivity > 0:
            raise PrivgradError(f"the sensitivity ΔS must be > 0, got {self.sensitivity}")
        if self.discriminator_steps < 1:
            raise PrivgradError(f"n_d must be ≥ 1, got {self.discriminator_steps}")
        if not (self.alpha > 1 and math.isfinite(self.alpha)):
            raise PrivgradError(f"the Rényi order α must be > 1, got {self.alpha}")
        if not 0 < self.delta < 1:
            raise PrivgradError(f"δ must lie in (0, 1), got {self.delta}")

    @classmethod
    def for_run(
        cls,
        dataset: str,
        train_size: int,
        batch_size: float,
        discriminator_steps: int,
        alpha: float = DEFAULT_ALPHA,
        delta: float = DEFAULT_DELTA,
        loss_bound: float | None = None,
    ) -> "PaperAccountant":
        c = table_ii_loss_bound(dataset, batch_size) if loss_bound is None else loss_bound
        if not c > 0:
            raise PrivgradError(f"the loss bound C must be > 0, got {c}")
        return cls(batch_size / train_size, c / batch_size, discriminator_steps, alpha, delta)

    @property
    def _composition(self) -> float:
        return 4.0 * math.sqrt(2.0 * self.discriminator_steps * math.log(1.0 / self.delta))

    def step_rdp(self, sigma: float) -> float:
        """Thm 1: ε(α) of one discriminator step (∞ without noise)."""
        if sigma <= 0:
            return math.inf
        a = self.alpha
        return self.sampling_rate * a * a * self.sensitivity**2 / (2.0 * (a - 1.0) * sigma**2)

    def discriminator_epsilon(self, sigma: float) -> float:
        """Thm 2: ε_d after n_d discriminator steps."""
        return self._composition * self.step_rdp(sigma)

    def generator_epsilon(self, sigma: float) -> float:
        """Thm 3: ε_g of one generator iteration (= ε_d)."""
        return self.discriminator_epsilon(sigma)

    def total_epsilon(self, sigmas) -> float:
        """Thm 4: the plain sum of ε_g over the generator iterations run."""
        return float(sum(self.generator_epsilon(s) for s in sigmas))

    def theorem2_condition_holds(self, sigma: float) -> bool:
        """Thm 2's own side condition, log(1/δ) ≥ ε² n_d (the paper never checks it)."""
        return math.log(1 / self.delta) >= self.step_rdp(sigma) ** 2 * self.discriminator_steps

    def sigma_for(self, epsilon_total: float, generator_steps: int) -> float:
        """Alg. 2 line 4: the constant σ that spends ``epsilon_total`` in n_g iterations."""
        if not (epsilon_total > 0 and math.isfinite(epsilon_total)):
            raise PrivgradError(f"ε must be a finite number > 0, got {epsilon_total}")
        if generator_steps < 1:
            raise PrivgradError(f"n_g must be ≥ 1, got {generator_steps}")
        eps_g = epsilon_total / generator_steps
        a = self.alpha
        return math.sqrt(
            self._composition
            * self.sampling_rate
            * a
            * a
            * self.sensitivity**2
            / (2.0 * (a - 1.0) * eps_g)
        )

    def moments_accountant_generator_epsilon(self, sigma: float) -> float:
        """Eq. 23, the paper's 'MA' baseline per G-iteration: 2q√(n_d log(1/δ))/σ (no ΔS)."""
        if sigma <= 0:
            return math.inf
        return (
            2
            * self.sampling_rate
            * math.sqrt(self.discriminator_steps * math.log(1 / self.delta))
            / sigma
        )

    def describe(self) -> dict:
        return {
            "alpha": self.alpha,
            "delta": self.delta,
            "sampling_rate": self.sampling_rate,
            "sensitivity": self.sensitivity,
            "discriminator_steps": self.discriminator_steps,
            "formula": "ε_total = Σ_t 4·qα²ΔS²/(2(α−1)σ_t²)·√(2·n_d·log(1/δ)), ΔS = C/m",
            "note": NOT_A_GUARANTEE,
        }
