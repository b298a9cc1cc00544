"""The page's tables: each experiment's accuracy and measurement tables, its setting and
search, the audit tables, and the appendix tables (other results, validation runs).
"""

from __future__ import annotations

import collections
import math
import statistics

from privgrad.lab.report.findings import (
    Finding,
    _audit_margin,
    _exceeds_honest,
    _span,
    _understatement,
    claimed_eps_comparisons,
    shared_audits,
    versus_dpsgd,
)
from privgrad.lab.report.formatting import _acc_text, _eps, _eps_text, _g
from privgrad.lab.report.placement import Section, _field, _setting
from privgrad.lab.report.privacy import ACCOUNTANT_NAMES, PrivacyRow, Setting
from privgrad.lab.report.records import Rec, provenance_text
from privgrad.lab.reproduce import Choice, Experiment


def _config_text(exp: Experiment, arm) -> str:
    values = {**exp.base, **arm.fields}
    keys = [
        "mechanism",
        "model",
        "dataset",
        "epochs",
        "batch_size",
        "lr",
        "optimizer",
        "momentum",
        "clip",
        "activation",
        "activation_params",
        "mechanism_options",
        "model_options",
        "delta",
    ]
    parts = []
    for k in keys:
        if k in values and values[k] not in ({}, None):
            v = values[k]
            v = ", ".join(f"{kk}={vv}" for kk, vv in v.items()) if isinstance(v, dict) else _g(v)
            parts.append(f"{k}={v}")
    if arm.space is not None:
        s = exp.search
        parts.append(
            ", ".join(
                f"{k} ∈ {{{', '.join(_g(v) for v in vals)}}}" for k, vals in arm.space.items()
            )
            + f" searched on {s.validation} held-out training examples"
            + f" (seeds {', '.join(map(str, s.seeds))}"
            + "".join(f", {k}={_g(v)}" for k, v in s.overrides.items())
            + ("" if s.epsilon is None else f", at ε = {_g(s.epsilon)}")
            + "), extended where the best value sat on an edge; each record's `selection` has "
            "the choice"
        )
    elif exp.search is not None:
        parts.append("not searched: run at the stated setting")
    if arm.private:
        parts.append(
            "σ calibrated for "
            + " and ".join(
                {"honest": "the honest ε", "claimed": "the paper's claimed ε"}[t]
                for t in arm.targets
            )
        )
    else:
        parts.append("no clipping, no noise")
    return "; ".join(parts)


def _anchor_text(s: Section) -> str:
    cells = [
        f"{r.arm} at ε = {_g(r.epsilon)}: {_acc_text(r.honest)}"
        + (f" (honest ε {_eps_text(r.honest, 'epsilon')})" if r.honest else "")
        for r in s.rows
        if not r.group and r.epsilon is not None
    ]
    return f"[{s.exp.id}](#{s.exp.id}): " + "; ".join(cells or ["no grid row"])


def _search_row(c: Choice) -> list[str]:
    """One search of a section's search table: every point's mean validation accuracy (the
    harness averages a point only once all its runs are done, so n is its number of cells)."""
    runs = collections.Counter(tuple(cell.point.values()) for cell in c.cells)
    chosen = None if c.chosen is None else tuple(c.chosen.values())
    points = ", ".join(
        f"{' '.join(_g(v) for v in point)}: {100 * mean:.2f} (n={runs[point]})"
        + (" ✓" if point == chosen else "")
        for point, mean in c.means.items()
    )
    state = (
        f"flat: {c.flat_text()}"
        if c.flat
        else f"waiting: {len(c.cells) - len(c.pending)} of {len(c.cells)} runs done"
        if c.chosen is None
        else "; ".join(c.edge)
        if c.edge
        else "chosen inside its grid"
    )
    return [
        c.label(),
        f"{' × '.join(c.axes)} — {points}",
        "—" if c.chosen is None else ", ".join(f"{k} {_g(v)}" for k, v in c.chosen.items()),
        state,
    ]


def _audit_eps(x) -> str:
    return "∞ (no guarantee)" if x is None else f"{x:.3f}"


def _audit_label(a: dict) -> str:
    """What was audited, from the record: mechanism, options, where RDP-GAN's noise went, the
    ε its σ was calibrated to."""
    cfg = a.get("config") or {}
    opts = cfg.get("mechanism_options") or {}
    label = a["mechanism"] + (
        " (" + ", ".join(f"{k} {v}" for k, v in sorted(opts.items())) + ")" if opts else ""
    )
    if a.get("noise_reading"):
        label += f", noise on: {a['noise_reading']}"
    if a["mechanism"] != "non-private" and cfg.get("target_epsilon") is not None:
        label += f", σ for {cfg.get('target', 'honest')} ε = {_g(cfg['target_epsilon'])}"
    return label


def _audit_verdict(a: dict) -> str:
    if _exceeds_honest(a):
        return "VIOLATION: lower bound > honest ε"
    if _audit_margin(a) > 0:
        return "claimed ε refuted: lower bound > claimed ε"
    return "consistent"


def _release_text(a: dict) -> str:
    steps, q = a.get("steps", 1), a.get("sampling_rate", 1.0)
    return f"{steps} step{'s' * (steps != 1)}, q {_g(q)}, {a.get('statistic', 'mean-shift')}"


def _power_text(a: dict) -> str:
    """The bound this audit reaches on the ideal release at the honest / claimed σ, and the
    largest any release could reach at its trial count (perfect separation)."""
    n = (a.get("test") or {}).get("n_eval")
    ceiling = ""
    if n:  # Clopper–Pearson at n of n and 0 of n, each at α/2
        tail = ((1 - a.get("confidence", 0.95)) / 2) ** (1 / n)
        ceiling = f"max {math.log((tail - a['delta']) / (1 - tail)):.2f}"
    if a.get("power_honest") is None:
        return ceiling or "—"
    return f"{a['power_honest']:.2f} / {a['power_claimed']:.2f} ({ceiling})"


def _best_attack(side: dict) -> float:
    return max(att["epsilon_lower_bound"] for att in side["attacks"].values())


def audit_blocks(audits: list[tuple[dict, str]]) -> list[tuple]:
    """The audit tables: one row per ``privgrad audit`` record (canary and GAN-step audits;
    membership inference with its non-private control)."""
    B: list[tuple] = [("h2", "Empirical privacy audits", "audits")]
    if not audits:
        return B + [("p", "None.")]
    canary = sorted(
        (a for a in audits if a[0].get("method") != "mia"), key=lambda a: (a[1], _audit_label(a[0]))
    )
    mia = sorted((a for a in audits if a[0].get("method") == "mia"), key=lambda a: a[1])
    shared = shared_audits(audits)
    B.append(
        (
            "p",
            "One row per `privgrad audit` record under results/ (its `command` field holds the "
            "exact "
            "command; `experiments/scripts/audit.sh` runs them all). Every lower bound is a 95 % "
            "Clopper–Pearson bound on ε at the record's δ, with the threshold chosen on held-out "
            "trials. "
            "**Canary audits** release one step (q = 1), or T Poisson-sampled steps (the "
            "end-to-end rows), with or without a canary: a dense gradient "
            "canary of norm 10 C for generic chains, an input canary through the model's own "
            "per-sample "
            "rules for layer-aware stages (Spectral-DP, GReDP, GIP), a ±1 checkerboard image "
            "through one "
            "discriminator step of the class-conditional DCGAN for the GAN rows. μ̂ is the "
            "measured mean "
            "shift over the noise std (an estimate, not a bound); for a Gaussian mechanism the "
            "honest ε "
            "corresponds to μ = 1/σ_eff. A bound above the claimed ε refutes the claim; above "
            "the honest "
            "ε it would be an accounting error. **Power** is the bound the same audit (trials, "
            "steps, q, statistic) reaches on a simulated ideal release: a Poisson-sampled Gaussian "
            "at the honest σ_eff, then at the claimed σ. A claim is refutable by the audit only "
            "if the first exceeds it. Beside it, the largest bound any release could give at "
            "this trial count (every held-out trial separated).",
        )
    )
    if canary:
        B.append(
            (
                "table",
                [
                    "Audited release",
                    "Model",
                    "Release",
                    "Honest ε",
                    "Claimed ε",
                    "Lower bound (95 %)",
                    "Power: honest / claimed σ",
                    "μ̂ ± se",
                    "Trials per side",
                    "Held-out TPR / FPR",
                    "Verdict",
                    "Source",
                ],
                [
                    [
                        _audit_label(a),
                        str(a.get("model", "—")),
                        _release_text(a),
                        _audit_eps(a.get("epsilon")),
                        _audit_eps(a.get("epsilon_claimed")),
                        f"{a['epsilon_lower_bound']:.3f}",
                        _power_text(a),
                        f"{a['mu_hat']:.3g} ± {a['mu_hat_se']:.2g}" if "mu_hat" in a else "—",
                        f"{a['trials']:,}" if "trials" in a else "—",
                        f"{a['test']['tpr']:.2e} / {a['test']['fpr']:.2e}" if "test" in a else "—",
                        _audit_verdict(a)
                        + (
                            f" (one experiment with {', '.join(shared[src])}: counted once)"
                            if src in shared
                            else ""
                        ),
                        src,
                    ]
                    for a, src in canary
                ],
            )
        )
    if mia:
        B.append(
            (
                "p",
                "**Membership inference**: a pool of training images, each a member with "
                "probability ½; "
                "the model trains on the members, and a non-private control trains on the same "
                "members "
                "from the same initialisation with the same batches and learning rate, without "
                "clipping "
                "or noise. Attacks: loss threshold (Yeom et al.) and a shadow model (Salem et "
                "al.); the ε "
                "lower bound applies Steinke et al.'s one-run theorem to the best attack's "
                "guesses.",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset, model",
                    "Honest ε",
                    "Test acc. (%)",
                    "Loss AUC",
                    "Shadow AUC",
                    "TPR @ 0.1 % / 1 % FPR (loss)",
                    "Lower bound (best attack)",
                    "Control: test acc. (%)",
                    "Control: loss AUC",
                    "Control: lower bound",
                    "Source",
                ],
                [
                    [
                        a["mechanism"],
                        f"{a.get('dataset')}, {a.get('model')}",
                        _audit_eps(a.get("epsilon")),
                        f"{100 * a['target']['test_accuracy']:.1f}",
                        f"{a['target']['attacks']['loss']['auc']:.3f}",
                        f"{a['target']['attacks']['shadow']['auc']:.3f}",
                        f"{a['target']['attacks']['loss']['tpr_at_0.1%_fpr']:.3f} / "
                        f"{a['target']['attacks']['loss']['tpr_at_1%_fpr']:.3f}",
                        f"{_best_attack(a['target']):.3f}",
                        f"{100 * a['control']['test_accuracy']:.1f}",
                        f"{a['control']['attacks']['loss']['auc']:.3f}",
                        f"{_best_attack(a['control']):.3f}",
                        src,
                    ]
                    for a, src in mia
                ],
            )
        )
    return B


def _tuning_caveat(name: str, c) -> str:
    """Where the paper's arm ran unsearched at its stated setting and DP-SGD's hyper-parameters
    were chosen on validation, say so: the gap then measures the stated setting at this
    experiment's scale, not the mechanism against an equally tuned DP-SGD."""
    mine, theirs = c.budgets
    if mine != 0 or not theirs:
        return ""
    return (
        f". Unequal tuning: {name} ran at the paper's stated hyper-parameters without search, "
        f"DP-SGD's were chosen on validation ({theirs} runs); this tests the stated setting at "
        "this experiment's scale-downs, not the mechanism against an equally tuned DP-SGD (for "
        "that, the tuned row at equal honest ε)"
    )


def _table_for(section: Section) -> tuple[list[str], list[list[str]], list[str]]:
    head = [
        "Method",
        "ε",
        "Paper",
        "Nominal setting: accuracy",
        "ε honest",
        "ε claimed",
        "Equal honest ε: accuracy",
        "ε honest",
        "Δ vs DP-SGD at equal honest ε [95 % CI]",
    ]
    rows, notes = [], []
    exp = section.exp
    versus = versus_dpsgd(section)
    absent = "not run" if exp.runnable else "—"
    for r in section.rows:
        arm = exp.arm(r.arm)
        name = r.arm if not r.group else f"{r.arm} — {r.group}"
        paper = "—" if r.paper is None else str(float(r.paper))
        if r.paper is not None and arm.paper_note and r.group == "":
            mark = "*" * (len(notes) + 1)
            notes.append(f"{mark} {r.arm}: {arm.paper_note}")
            paper += f" {mark}"
        if not arm.private:
            acc = _acc_text(r.honest, absent)
            rows.append([name, "∞ (none)", paper, acc, "∞", "∞", acc, "∞", "—"])
            continue
        nom_acc = _acc_text(r.nominal, absent) + (" †" if r.nominal_is_honest and r.nominal else "")
        if not r.nominal and r.group:
            nom_acc = "—"
        hon_acc = _acc_text(r.honest, absent) if (r.honest or not r.group) else "—"
        rows.append(
            [
                name,
                _eps(r.epsilon) if r.epsilon is not None else "?",
                paper,
                nom_acc,
                _eps_text(r.nominal, "epsilon"),
                _eps_text(r.nominal, "epsilon_claimed"),
                hon_acc,
                _eps_text(r.honest, "epsilon"),
                versus[(r.arm, r.epsilon)].text()
                if not r.group and (r.arm, r.epsilon) in versus
                else "—",
            ]
        )
    for name, claimed, same_claim, same_honest in claimed_eps_comparisons(section):
        text = (
            f"Paper's setting against DP-SGD: {name} (claimed ε {_eps(claimed)}) − DP-SGD at the "
            f"same claimed ε: {same_claim.text()}"
        )
        if same_honest is not None:
            text += f"; − DP-SGD at its honest ε: {same_honest.text()}"
        notes.append(text + _tuning_caveat(name, same_claim))
    return head, rows, notes


def _columns_table(section: Section) -> tuple[list[str], list[list[str]]]:
    """The experiment's ``columns``: each row's runs' mean of every listed record field (rows whose
    runs record none of them are left out), and the paper's values where an arm gives them
    (``paper_columns``)."""
    exp = section.exp
    head = ["Method", "ε", "Runs", *exp.columns]
    rows = []
    for r in section.rows:
        arm = exp.arm(r.arm)
        name = r.arm if not r.group else f"{r.arm} — {r.group}"
        eps = "∞ (none)" if not arm.private else _eps(r.epsilon) if r.epsilon is not None else "?"
        paper = arm.paper_columns.get(r.epsilon if arm.private else None)
        if paper and not r.group:
            rows.append(
                [
                    f"{r.arm} (paper)",
                    eps,
                    "paper",
                    *("—" if math.isnan(v) else _g(v) for v in paper),
                ]
            )
        sets = (
            [("", r.honest)]
            if not arm.private or r.nominal_is_honest
            else [("nominal setting", r.nominal), ("equal honest ε", r.honest)]
        )
        for which, rs in sets:
            if not rs:
                continue
            cells = []
            for path in exp.columns.values():
                values = [
                    v for v in (_field(x.data, path) for x in rs) if isinstance(v, (int, float))
                ]
                cells.append(
                    f"{statistics.fmean(values):.3f}"
                    + (f" (n={len(values)})" if len(values) != len(rs) else "")
                    if values
                    else "—"
                )
            if any(c != "—" for c in cells):  # runs that record none of the fields are left out
                rows.append([name, eps, f"{which + ', ' if which else ''}n={len(rs)}", *cells])
    return head, rows


def _plot_caption(ns: list[int]) -> str:
    if not ns:
        n = "no runs of ours yet"
    elif ns[-1] == 1:
        n = "one run per point (n = 1), so no error bars"
    elif ns[0] == ns[-1]:
        n = f"error bars ± 1 sd over seeds, n = {ns[0]} runs per point"
    else:
        n = (
            f"error bars ± 1 sd over seeds, n = {ns[0]}–{ns[-1]} runs per point (each cell's n is "
            "in the "
            "table)" + ("; a point with n = 1 has no bar" if ns[0] == 1 else "")
        )
    return (
        "Each point is a cell's mean test accuracy: circles at equal honest ε, squares at the "
        "paper's "
        f"nominal σ (placed at their honest ε), crosses for variant settings; {n}. Hollow stars: "
        "the "
        "paper's numbers at the ε it states; horizontal lines: non-private means (solid: ours, "
        "dotted: paper)."
    )


def _status(s: Section) -> str:
    if not s.exp.runnable:
        n = len({r.fp for row in s.rows for r in row.nominal + row.honest})
        return "not run by `privgrad reproduce`" + (
            f"; {n} records from other commands" if n else ""
        )
    if s.missing:
        return "waiting for " + ", ".join(s.missing)
    runs = sum(
        len(r.honest) + (0 if r.nominal_is_honest else len(r.nominal))
        for r in s.rows
        if not r.group
    )
    cells = s.exp.n_test_cells()
    return f"{min(runs, cells)} of {cells} grid runs done" if runs else "runnable, not run yet"


def _other_rows(others: list[Rec], pending=frozenset()) -> list[list[str]]:
    """Other results, one row per setting; its sources with their code (``pending``: sources
    whose provenance awaits a rerun)."""
    groups: dict[tuple, list[Rec]] = {}
    for r in others:
        d = r.data
        key = (
            str(d.get("mechanism")),
            str(d.get("dataset")),
            str(d.get("model")),
            _setting(d),
            -1.0 if r.nominal is None else round(r.nominal, 3),
            r.target,
        )
        groups.setdefault(key, []).append(r)
    rows = []
    for key in sorted(groups):
        rs = groups[key]
        srcs = sorted({r.source.split("[")[0] for r in rs})
        rows.append(
            [
                key[0],
                key[1],
                key[2],
                key[3],
                "∞ (none)" if key[4] < 0 else f"{_eps(key[4])} ({key[5]})",
                _acc_text(rs),
                _eps_text(rs, "epsilon"),
                _eps_text(rs, "epsilon_claimed"),
                ", ".join(srcs)
                + "; code "
                + provenance_text([(r.data, r.source) for r in rs], pending),
            ]
        )
    return rows


def _validation_rows(validations: list[tuple[dict, str]], pending=frozenset()) -> list[list[str]]:
    groups: dict[tuple, dict[float, list[float]]] = {}
    sources: dict[tuple, set[str]] = {}
    runs: dict[tuple, list[tuple[dict, str]]] = {}
    for r, src in validations:
        setting = _setting({k: v for k, v in r.items() if k != "lr"})
        key = (
            str(r.get("mechanism")),
            str(r.get("dataset")),
            str(r.get("model")),
            setting,
            -1.0 if r.get("epsilon") is None else round(float(r["epsilon"]), 2),
        )
        groups.setdefault(key, {}).setdefault(float(r.get("lr") or 0), []).append(
            100 * r["validation_accuracy"]
        )
        sources.setdefault(key, set()).add(src.rsplit("/", 1)[0] + "/")
        runs.setdefault(key, []).append((r, src))
    rows = []
    for key in sorted(groups):
        means = {lr: statistics.fmean(v) for lr, v in sorted(groups[key].items())}
        best = max(means, key=means.get)
        cells = ", ".join(
            f"{_g(lr)}: {m:.2f} (n={len(groups[key][lr])})" + (" ✓" if lr == best else "")
            for lr, m in means.items()
        )
        rows.append(
            [
                *key[:4],
                "∞" if key[4] < 0 else f"{key[4]:.2f}",
                cells,
                ", ".join(sorted(sources[key])) + "; code " + provenance_text(runs[key], pending),
            ]
        )
    return rows


def _setting_text(w: PrivacyRow, s: Setting | None, epochs: float | None) -> str:
    if s is None:
        return "—"
    return (
        f"{_g(epochs)} epochs ({s.steps:,} steps): σ {s.sigma:.4g}; honest {s.honest:.2f} / "
        f"claimed {s.claimed:.2f} = ×{s.ratio:.2f}"
    )


def privacy_table(found: list[Finding]) -> tuple[list[str], list[list[str]]]:
    """Every paper's claims with its own accountant: one row per cell of the Findings' claimed →
    honest column (experiments whose runs have the same privacy facts share a row)."""
    rows_ = [(f, w) for f in found for w in f.privacy]
    names = " / ".join(dict.fromkeys(ACCOUNTANT_NAMES[w.accountant] for _, w in rows_)) or "RDP"
    head = [
        "Paper",
        "Experiments (runs)",
        "Paper's ε",
        "Our runs: q, steps (epochs), σ as published → σ_eff",
        "Honest ε (PLD)",
        "Claimed ε (PLD)",
        f"Claimed ε (paper's accountant: {names})",
        "Honest / claimed, our runs: PLD claim · paper's accountant",
        "Paper's setting at our epochs (σ from the paper's accountant)",
        "Paper's setting at the paper's epochs",
    ]
    rows = []
    for f, w in rows_:
        run, own = w.run, w.accountant == "own"
        if run is not None:
            facts = (
                f"q {run.q:.4g}, {run.steps:,} steps ({_g(run.epochs)} epochs), σ {run.sigma:.4g}"
                f" → {run.sigma_eff:.4g}"
                + (f"; index selection ε {run.pure:g} (basic composition)" if run.pure else "")
            )
        else:
            facts = "—" if own else f"not rebuilt: {w.why}"
        pld = [_understatement(r) for r in w.runs]
        ratio_pld = "∞" if any(math.isinf(x) for x in pld) else _span(pld)
        claimed = (
            f"{_eps_text(w.runs, 'epsilon_claimed')} (as recorded)"
            if own
            else "—"
            if w.claimed_paper is None
            else f"{w.claimed_paper:.2f}"
        )
        ratio_paper = (
            "—"
            if w.claimed_paper is None
            else "∞"
            if math.isinf(w.run_ratio)
            else f"×{w.run_ratio:.2f}"
        )
        theirs = (
            _setting_text(w, w.theirs, w.paper_epochs)
            if w.theirs is not None
            else "—"
            if own or run is None
            else "not stated by the paper"
        )
        rows.append(
            [
                f.name,
                f"{', '.join(w.experiments)} (n={len(w.runs)}: {w.arms})",
                _g(w.epsilon),
                facts,
                _eps_text(w.runs, "epsilon"),
                "—" if own else _eps_text(w.runs, "epsilon_claimed"),
                claimed,
                f"{ratio_pld} · {ratio_paper}" if not own else "∞",
                "—" if w.ours is None else _setting_text(w, w.ours, run.epochs),
                theirs,
            ]
        )
    return head, rows


def privacy_sources(found: list[Finding]) -> list[str]:
    """Each paper's accountant and epochs, with the seed passages that state them."""
    out = []
    for f in found:
        seen = []
        for s in f.sections:
            pp = s.exp.paper_privacy
            if not pp:
                continue
            item = f"{ACCOUNTANT_NAMES[pp['accountant']]} ({pp['accountant_source']}); epochs: " + (
                f"{_g(pp['epochs'])} ({pp['epochs_source']})"
                if "epochs" in pp
                else pp["epochs_source"]
            )
            ids = next((ids for text, ids in seen if text == item), None)
            if ids is None:
                seen.append((item, [s.exp.id]))
            else:
                ids.append(s.exp.id)
        seed = f.sections[0].exp.seed_file if f.sections else ""
        for item, ids in seen:
            which = "" if len(seen) == 1 else f" ({', '.join(ids)})"
            out.append(f"**{f.name}**{which}, `{seed}`: {item}")
    return out
