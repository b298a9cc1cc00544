"""``privgrad audit``: run one audit, record it in the run store, return its record."""

from __future__ import annotations

import math
import time

from privgrad.app.audit.stats import MU_EXCESS_SE
from privgrad.errors import PrivgradError
from privgrad.private import NEIGHBOURING
from privgrad.records import provenance
from privgrad.app.store import RunStore, recorded_run

METHODS = ("canary", "one-run", "mia")


def run_audit(
    method: str = "canary", *, store: RunStore | None = None, command: str | None = None, **options
) -> dict:
    """Dispatches to :func:`canary_audit` (:func:`gan_canary_audit` for the GAN modes and
    ``model='cdcgan'``), :func:`one_run_audit` or :func:`mia_audit` (keyword options are
    theirs), stores the run (kind 'audit') and returns the record."""
    from privgrad.app.audit.canary import canary_audit
    from privgrad.app.audit.gan import gan_canary_audit, is_gan_audit
    from privgrad.app.audit.mia import mia_audit
    from privgrad.app.audit.one_run import one_run_audit

    runner = {"canary": canary_audit, "one-run": one_run_audit, "mia": mia_audit}.get(method)
    if method == "canary" and is_gan_audit(options.get("mechanism"), options.get("model")):
        runner = gan_canary_audit
    if runner is None:
        raise PrivgradError(f"unknown audit method '{method}'; choose from: {', '.join(METHODS)}")
    config = {"method": method, **{k: v for k, v in options.items() if not callable(v)}}
    if not isinstance(config.get("mechanism", ""), str):
        config["mechanism"] = getattr(config["mechanism"], "name", str(config["mechanism"]))
    started = time.time()
    with recorded_run(store, config, "audit") as run_id:
        record = runner(**options)
    record.update(
        accountant="pld",
        neighbouring=NEIGHBOURING,
        dp_guarantee=math.isfinite(record["epsilon"]),
        **provenance(),
        command=command,
        config=config,
        wall_time_s=round(time.time() - started, 2),
    )
    if store:
        store.finish(run_id, record)
        record["run_id"] = run_id
    return record


def verdict(record: dict) -> str:
    lb, eps, claimed = record["epsilon_lower_bound"], record["epsilon"], record["epsilon_claimed"]
    conf = f"{100 * record['confidence']:g}%"
    if lb > eps:
        return (
            f"AUDIT FAILURE: the lower bound exceeds the honest ε at {conf} confidence; the "
            "accounting or the implementation of this mechanism is wrong"
        )
    if record.get("mu_exceeds_honest"):
        return (
            f"AUDIT FAILURE: the estimated shift μ̂ = {record['mu_hat']:.3f} passes the honest "
            f"μ = {record['mu_honest']:.3f} by more than {MU_EXCESS_SE} standard errors (∞: the "
            "release has no noise); one example moves it more than the accounting assumes"
        )
    if lb > claimed:
        return f"the paper's claimed ε is refuted at {conf} confidence (lower bound > claimed ε)"
    return "consistent: the lower bound does not exceed the reported ε"


__all__ = ["run_audit", "verdict", "METHODS"]
