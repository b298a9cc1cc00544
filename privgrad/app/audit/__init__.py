"""Empirical privacy auditing: statistically valid lower bounds on ε, shown beside the
honest ε and the paper's claimed ε (trust checklist item 11).

* :func:`canary_audit` — gradient canaries, many trials of a few steps of a mechanism's
  own chain, Clopper–Pearson on a held-out threshold (Jagielski et al. 2020; Nasr et al.
  2021, 2023).
* :func:`one_run_audit` — m Dirac gradient canaries in one real training run
  (Steinke, Nasr & Jagielski 2023).
* :func:`mia_audit` — loss-threshold and shadow-model membership inference with a
  non-private control (Yeom et al. 2018; Salem et al. 2019).
* :mod:`privgrad.app.audit.stats` — the statistics, testable on mechanisms of known ε.
"""

from privgrad.app.audit.canary import CANARIES, STATISTICS, canary_audit
from privgrad.app.audit.common import AUDIT_MODELS, full_conv_model, small_model, synthetic_dataset
from privgrad.app.audit.mia import mia_audit
from privgrad.app.audit.one_run import one_run_audit
from privgrad.app.audit.run import METHODS, run_audit, verdict
from privgrad.app.audit.stats import (
    auc,
    clopper_pearson,
    epsilon_from_rates,
    epsilon_lower_bound,
    gaussian_epsilon,
    gaussian_mu_estimate,
    one_run_bound_from_scores,
    one_run_epsilon,
    one_run_p_value,
    tpr_at_fpr,
)

__all__ = [
    "canary_audit",
    "one_run_audit",
    "mia_audit",
    "run_audit",
    "verdict",
    "METHODS",
    "CANARIES",
    "STATISTICS",
    "AUDIT_MODELS",
    "small_model",
    "full_conv_model",
    "synthetic_dataset",
    "auc",
    "clopper_pearson",
    "epsilon_from_rates",
    "epsilon_lower_bound",
    "gaussian_epsilon",
    "gaussian_mu_estimate",
    "one_run_bound_from_scores",
    "one_run_epsilon",
    "one_run_p_value",
    "tpr_at_fpr",
]
