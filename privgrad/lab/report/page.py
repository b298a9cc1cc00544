"""The page as a list of blocks (headings, paragraphs, tables, images), built once and
rendered to both Markdown and HTML, so that the two always say the same.
"""

from __future__ import annotations

from privgrad.lab.report.findings import (
    Finding,
    _audit_text,
    _claim_text,
    _delta_text,
    _verdict,
    comparisons_table,
    refuted_text,
)
from privgrad.lab.report.formatting import _eps, _g
from privgrad.lab.report.placement import Section
from privgrad.lab.report.records import Rec, provenance_text
from privgrad.lab.report.tables import (
    _anchor_text,
    _columns_table,
    _config_text,
    _other_rows,
    _plot_caption,
    _search_row,
    _status,
    _table_for,
    _validation_rows,
    audit_blocks,
    privacy_sources,
    privacy_table,
)
from privgrad.lab.reproduce import DEFAULT_METRIC


def build_blocks(
    sections: list[Section],
    found: list[Finding],
    others: list[Rec],
    all_recs: list[Rec],
    audits: list[tuple[dict, str]],
    validations: list[tuple[dict, str]],
    other_files: list[str],
    n_dup: int,
    sources: str,
    include_quick: bool,
    search_records: dict[str, list[tuple[dict, str]]] | None = None,
    pending: set[str] | frozenset = frozenset(),
) -> list[tuple]:
    """The page: Findings first, then the sections in the order given (the Findings' order).
    ``search_records``: each experiment's search runs shown in its search table;
    ``pending``: the sources whose provenance awaits a rerun (records.pending_sources)."""
    search_records = search_records or {}
    B: list[tuple] = []
    B.append(("h1", "Reproduction of the papers' tables"))
    B.append(("h2", "Findings", "findings"))
    B.append(
        (
            "p",
            "Computed from the records (" + sources + "), never typed in: one row per paper "
            "(its experiment configs grouped by `paper`; its mechanisms are their `proposed`). "
            "**Claimed ε → honest ε:** the proposed mechanisms' runs at the paper's nominal "
            "setting (σ calibrated to the paper's own ε), per nominal ε, with honest / claimed "
            "for those runs (claims by PLD), then with the paper's own accountant at the σ it "
            "calls for, at our epochs and at the paper's where it states them (the table below "
            "the Findings). **Audit:** the "
            "`privgrad audit` records of those mechanisms; one refutes the claim when its 95 % "
            "lower bound on ε exceeds the claimed ε (shown: the audit whose bound exceeds its "
            "claimed ε the most, or comes closest); records with the same release, draws and "
            "outcome are one experiment and count once"
            + refuted_text(audits)
            + ". **Δ accuracy:** a proposed arm's mean test accuracy minus its DP-SGD arm's "
            "(same data and model) at the same honest ε, in points, counting only runs whose "
            "hyper-parameters were chosen on a validation split (`selection` on validation) on "
            "both sides, at the experiment's scale-downs from the paper (stated in the row). "
            "Where both arms ran the same seeds the estimate is paired by seed (a t interval on "
            "the per-seed differences, df = n − 1), else Welch's. A paper's comparisons are one "
            "family, tested with Holm's correction at α = 0.05, and each gets one label: **win "
            "resolved** / **loss resolved** (Holm-adjusted p of Δ = 0 below 0.05), else **claimed "
            "gain ruled out** (the paper claims a gain, its own Δ at that ε, and the "
            "Holm-adjusted one-sided p of a gain that large is below 0.025: with one comparison, "
            "the 95 % interval's upper end lies below it), else **underpowered**, with the "
            "minimum detectable effect MDE = (t(1 − α_i/2, df) + t(0.80, df)) · SE at 80 % power "
            "and the comparison's Holm level α_i. Shown: the comparison most favourable to the "
            "paper over its experiments and ε (a resolved win, then underpowered, then the "
            "claimed gain ruled out, then a resolved loss; the largest Δ among equals), with "
            "how many of the paper's comparisons have each label; every comparison is in the "
            "table below it. Order: papers whose claim an audit refutes first, then by how far "
            "the claimed ε understates the honest ε (largest first; by the paper's own "
            "accountant at the paper's setting where the verdict leads with it, else by the "
            "PLD claims), then by name; the sections below follow it.",
        )
    )
    B.append(
        (
            "table",
            [
                "Paper (proposed mechanisms)",
                "Claimed ε → honest ε, paper's setting (× honest / claimed)",
                "Empirical audit (ε lower bound, 95 %)",
                "Best proposed arm − tuned DP-SGD, equal honest ε: Δ accuracy [95 % CI]",
                "Verdict",
            ],
            [
                [
                    f"{f.name} ({', '.join(f.proposed) or 'none named'})",
                    _claim_text(f),
                    _audit_text(f),
                    _delta_text(f),
                    _verdict(f),
                ]
                for f in found
            ],
        )
    )
    B.append(
        (
            "p",
            "**Claimed ε with each paper's own accountant** (the Findings' claimed → honest "
            "column, one row per paper's ε and set of privacy facts). A record's claimed ε is "
            "privgrad's PLD accountant at the σ the paper's analysis calls for, and our runs' σ "
            "was calibrated so that it equals the paper's ε; the papers computed their ε with "
            "RDP (RDP-GAN: its own bound, which the recorded claim already follows; passages "
            "below). From each row's records (q, steps, epochs, σ as published, σ_eff, δ; GIP's "
            "index-selection budget, added by basic composition as its paper does) the events "
            "are rebuilt and must give the recorded claimed and honest ε within 0.1 %; then "
            "dp-accounting gives: the runs' claimed ε with the paper's accountant, and **the "
            "paper's setting**, the σ at which the paper's accountant gives exactly the paper's "
            "ε (same q and mechanism), with the honest ε there (PLD at that σ's effective "
            "multiplier) and honest / claimed, at our epochs and at the paper's (steps = its "
            "epochs × our steps per epoch, same q). RDP: Opacus' default orders (1.1–10.9, "
            "12–63), converted by Balle et al. (2020), Thm 21, as Opacus and GIP do (Bottleneck "
            "picks α among 2–64); for Spectral-DP and GReDP, whose Corollary 2 converts by "
            "Mironov (2017), Prop. 3, ε = RDP(α) + log(1/δ)/(α − 1) (their Proposition 1), that "
            'looser conversion ("RDP, Mironov\'s conversion"): it calls for a larger σ at the '
            "paper's ε, so its ratios are the smaller, the reading most favourable to those "
            "papers. Nothing is typed in.",
        )
    )
    B.append(("table", *privacy_table(found)))
    passages = privacy_sources(found)
    if passages:
        B.append(("p", "Each paper's accountant and epochs, in its own words (seed line):"))
        B.append(("ul", passages))
    B.append(
        (
            "p",
            "**Every tuned comparison, with its power** (the Findings' Δ accuracy column, one row "
            "per experiment and ε; Holm over each paper's rows). Search runs: the validation "
            "runs behind each side's chosen hyper-parameters in that experiment's search (grid "
            "points, edge extensions included, × search seeds, from the records' `selection`); "
            "where they differ the comparison is marked unequal, here and in the Findings, "
            "since the side with more runs had more chances to find a good setting (?: its "
            "records do not say, or disagree); a side whose chosen setting sits on its grid's "
            "edge (extensions exhausted, or a hard limit) is named, since a wider grid might "
            "have found better:",
        )
    )
    B.append(("table", *comparisons_table(found)))
    anchors = [s for s in sections if not s.exp.seed_file]
    if anchors:
        B.append(
            (
                "p",
                "**DP-SGD anchors** (privgrad's own DP-SGD baseline, not a paper), test accuracy "
                "at "
                "equal honest ε:",
            )
        )
        B.append(("ul", [_anchor_text(s) for s in anchors]))
    B.append(
        (
            "p",
            "Generated by `privgrad report` from the run records (" + sources + "); do not edit "
            "by hand. Each paper table is an experiment config in `experiments/`; "
            "`privgrad reproduce <id>` runs its grid through the normal training path and "
            "writes the records to `results/reproduce/<id>.json`.",
        )
    )
    B.append(
        (
            "p",
            "Columns: **Paper** is the paper's own number at its stated ε (reference data, "
            "cited below each table). **Nominal setting** is our run of the published mechanism "
            "with σ calibrated so that the paper's own analysis (the claimed ε) equals the "
            "paper's ε; the honest ε of that run, from a proven accountant at the mechanism's "
            "effective noise multiplier, is shown beside it. **Equal honest ε** calibrates σ so "
            "that the honest ε equals the paper's ε: the fair comparison. Accuracy is the "
            "final-epoch test accuracy in %, mean ± sample standard deviation over seeds "
            "(n runs). † the mechanism's claimed ε equals its honest ε, so the same runs fill "
            'both columns. "not run": no record yet. **Δ vs DP-SGD**: the row\'s mean minus its '
            "DP-SGD arm's (same data and model) at the same honest ε, with a 95 % interval when "
            "both have n ≥ 2 (paired by seed where both ran the same seeds, else Welch's; not "
            "corrected for multiplicity: the Findings are); a win only when the interval "
            "excludes 0.",
        )
    )
    B.append(("h2", "Contents"))
    B.append(
        (
            "ul",
            [f"[{s.exp.id}](#{s.exp.id}): {s.exp.title} — {_status(s)}" for s in sections]
            + [
                "[Empirical privacy audits](#audits)",
                "[Other results](#other-results)",
                "[All run records](#all-run-records)",
            ],
        )
    )
    for s in sections:
        exp = s.exp
        B.append(("h2", f"{exp.title}", exp.id))
        shown = {r.fp: r for row in s.rows for r in row.nominal + row.honest}
        code = _code_line(
            [(r.data, r.source) for r in shown.values()], search_records.get(exp.id, []), pending
        )
        if code:
            B.append(code)
        B.append(("p", f"**Status:** {_status(s)}."))
        where = f"{exp.table}, {exp.section}" if exp.section else exp.table
        seed = f"`../shared/seeds/{exp.seed_file}`" + (
            f" line {exp.seed_line}" if exp.seed_line else ""
        )
        B.append(
            (
                "p",
                f"**Source:** {exp.paper}. {where}. Seed text: {seed}. Page: "
                f"{exp.page or 'not given'}. "
                f"Implementation notes: `../shared/spec/{exp.spec}`.",
            )
        )
        if exp.metric != DEFAULT_METRIC:
            B.append(("p", f'**Metric** (the table\'s "accuracy" columns): {exp.metric}.'))
        if not exp.runnable:
            B.append(("p", f"**Not reproduced here:** {exp.reason}."))
        elif s.missing:
            B.append(
                (
                    "p",
                    f"**Waiting for:** {', '.join(s.missing)} (not in privgrad yet); the table "
                    "shows the paper's numbers until its arms can run.",
                )
            )
        head, rows, notes = _table_for(s)
        B.append(("table", head, rows))
        for n in notes:
            B.append(("small", n))
        if s.plot:
            B.append(
                ("img", s.plot, f"{exp.id}: accuracy against honest ε, paper's points as stars")
            )
            B.append(("small", _plot_caption(s.plot_n)))
        if exp.columns and any(r.nominal or r.honest for r in s.rows):
            B.append(("h3", "More measurements of these runs"))
            B.append(
                (
                    "p",
                    "Mean over each row's runs of these record fields: "
                    + "; ".join(f"{title}: `{path}`" for title, path in exp.columns.items())
                    + ".",
                )
            )
            head, rows = _columns_table(s)
            B.append(("table", head, rows))
        if s.search:
            B.append(("h3", "How the searched arms' hyper-parameters were chosen"))
            B.append(
                (
                    "p",
                    f"Validation accuracy (%) of every point tried, mean over the search seeds, on "
                    f"{exp.search.validation:,} training examples held out "
                    f"(`{exp.search_file()}`); "
                    "the best mean is chosen (✓), and a grid whose best value sits on its edge "
                    "is extended."
                    + (f" Caveat: {caveat}." if (caveat := exp.search_epochs_caveat()) else ""),
                )
            )
            B.append(
                (
                    "table",
                    ["Search", "Validation accuracy per point (mean, n runs)", "Chosen", "State"],
                    [_search_row(c) for c in s.search],
                )
            )
        if exp.runnable:
            B.append(("h3", "How to regenerate"))
            cmds = [
                (
                    f"privgrad reproduce {exp.id}",
                    f"full grid, resumable; writes results/reproduce/{exp.id}.json",
                ),
                (f"privgrad reproduce {exp.id} --quick", "CI smoke run (tiny; not a result)"),
                ("privgrad report", "rebuild this page and docs/REPRODUCTION.md"),
            ]
            width = max(len(c) for c, _ in cmds) + 3
            B.append(("code", "\n".join(f"{c:<{width}}# {why}" for c, why in cmds)))
        B.append(("h3", "Setting"))
        items = [f"**{a.name}:** {_config_text(exp, a)}" for a in exp.arms]
        if exp.runnable:
            items.append(
                "**grid:** ε ∈ {"
                + ", ".join(_g(e) for e in exp.epsilons)
                + "}, seeds "
                + ", ".join(str(x) for x in exp.seeds)
            )
        B.append(("ul", items))
        if exp.scaled_down:
            B.append(("p", "**Scaled down from the paper:**"))
            B.append(("ul", [f"**{k}:** {v}" for k, v in exp.scaled_down.items()]))
        if exp.notes:
            B.append(("p", "**Notes:** " + " ".join(exp.notes.split())))
    shown_audits = audit_blocks(audits)
    code = _code_line(audits, [], pending)
    B += shown_audits[:1] + ([code] if code else []) + shown_audits[1:]
    B.append(("h2", "Other results", "other-results"))
    if others:
        B.append(
            (
                "p",
                "Committed run records that belong to no experiment above (other datasets, models "
                "or mechanisms), grouped by setting; accuracy as above; each source with its "
                "code (version · commit (runs)).",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Setting",
                    "ε target",
                    "Accuracy",
                    "ε honest",
                    "ε claimed",
                    "Source",
                ],
                _other_rows(others, pending),
            )
        )
    else:
        B.append(("p", "None."))
    if validations:
        B.append(
            (
                "p",
                "Validation runs made outside the harness (`privgrad train --validation`: the "
                "per-mechanism defaults' search, searches of the earlier protocol), grouped by "
                "setting "
                "without lr; each lr's validation accuracy in %, mean over its runs, the best "
                "marked ✓; each source with its code (version · commit (runs)):",
            )
        )
        B.append(
            (
                "table",
                [
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Setting",
                    "ε",
                    "Validation accuracy per lr (n runs)",
                    "Source",
                ],
                _validation_rows(validations, pending),
            )
        )
    if other_files:
        B.append(
            (
                "p",
                "JSON files under results/ that hold no run, audit or validation record "
                "(listed so that nothing is dropped silently):",
            )
        )
        B.append(("ul", [f"`{f}`" for f in other_files]))
    B.append(("h2", "All run records", "all-run-records"))
    extra = (
        f" {n_dup} exact duplicate record(s) (the same run from two sources) merged."
        if n_dup
        else ""
    )
    quick = (
        "" if include_quick else " Records of `--quick` runs are listed but left out of the tables."
    )
    B.append(("p", f"{len(all_recs)} records.{extra}{quick}"))
    if all_recs:
        B.append(
            (
                "table",
                [
                    "id",
                    "Source",
                    "Mechanism",
                    "Dataset",
                    "Model",
                    "Seed",
                    "Accuracy",
                    "ε honest",
                    "ε claimed",
                    "Shown in",
                ],
                [
                    [
                        r.fp,
                        r.source,
                        str(r.data.get("mechanism")),
                        str(r.data.get("dataset")),
                        str(r.data.get("model")),
                        _seed(r.data.get("seed")),
                        "n/a" if r.acc is None else f"{r.acc:.2f}",
                        _eps(r.eps("epsilon")),
                        _eps(r.eps("epsilon_claimed")),
                        "; ".join(r.placed),
                    ]
                    for r in all_recs
                ],
            )
        )
    return B


def _code_line(
    runs: list[tuple[dict, str]], searches: list[tuple[dict, str]], pending
) -> tuple | None:
    """A section's code: each code version and commit of its runs (test and search runs apart
    where it has a search), ``-dirty`` and pending rerun marked; None when it has no runs."""
    if not runs and not searches:
        return None
    parts = [provenance_text(runs, pending)] if runs else []
    if searches:
        parts = [f"test runs: {parts[0]}"] if parts else []
        parts.append(f"search runs: {provenance_text(searches, pending)}")
    return ("p", "**Code** (version · commit (runs)): " + "; ".join(parts) + ".")


def _seed(seed) -> str:
    """A record's seed; a run given none drew a secret one (privgrad.seeds), not recorded."""
    return "secret" if seed is None else str(seed)
