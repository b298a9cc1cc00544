"""``privgrad report``: the reproduction page, built from run records alone.

Sources: the JSON run records committed under ``results/`` (any ``*.json`` below it: one
record, a list of records, or ``{"records": [...]}``), the audit records there, and,
optionally, the completed runs of a run store. Output (deterministic: the same records give
byte-identical text), opening with the Findings (one row per paper, computed from the
records), then the experiments in the Findings' order:

- ``<out>/REPRODUCTION.md``
- ``<out>/reproduction/index.html`` and one PNG per experiment (accuracy vs honest ε)

Every record read appears in the report: in its experiment's table (a cell of the
experiment's grid, or a *variant* run of one of its arms with other hyper-parameters),
under "Other results", and always in the appendix listing all records; every audit record
in the audit tables.

Modules: ``records`` (loading and de-duplicating records), ``placement`` (records to
experiment rows), ``formatting`` (numbers and ε as text), ``stats`` (comparisons: intervals,
Holm, power), ``findings`` (one verdict per paper), ``tables`` (section, audit and appendix
tables), ``plots`` (accuracy against honest ε), ``page`` (the block list of the page) and
``render`` (blocks to Markdown and HTML). This module builds and checks the report.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from privgrad.app.console import status
from privgrad.lab.report.findings import Finding, findings
from privgrad.lab.report.page import build_blocks
from privgrad.lab.report.placement import Row, Section, place
from privgrad.lab.report.plots import plot_section
from privgrad.lab.report.records import (
    Rec,
    _display_path,
    _harness_search_run,
    fingerprint,
    load_results,
    load_store,
    pending_sources,
    prepare,
)
from privgrad.lab.report.render import render_html, render_markdown
from privgrad.lab.report.stats import Comparison, compare
from privgrad.lab.reproduce import (
    EXPERIMENTS_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    list_experiments,
    search_state,
)

__all__ = [
    "DOCS_DIR",
    "HTML_SUBDIR",
    "MD_NAME",
    "Comparison",
    "Finding",
    "Rec",
    "Row",
    "Section",
    "build_blocks",
    "build_report",
    "check_report",
    "compare",
    "findings",
    "fingerprint",
    "load_results",
    "load_store",
    "place",
    "plot_section",
    "prepare",
    "render_html",
    "render_markdown",
]

DOCS_DIR = REPO_ROOT / "docs"

MD_NAME = "REPRODUCTION.md"

HTML_SUBDIR = "reproduction"


def build_report(
    out_dir: str | Path | None = None,
    results_dir: str | Path | None = None,
    db: str | Path | None = None,
    experiments_dir: str | Path | None = None,
    include_quick: bool = False,
) -> dict:
    """Writes ``REPRODUCTION.md`` and ``reproduction/`` (HTML + PNG) under ``out_dir``."""
    out = Path(out_dir or DOCS_DIR)
    html_dir = out / HTML_SUBDIR
    html_dir.mkdir(parents=True, exist_ok=True)  # an --out that cannot be made fails first
    experiments = list_experiments(experiments_dir or EXPERIMENTS_DIR)
    pairs, audits, searches, other_files = load_results(results_dir)
    sources = f"`{_display_path(Path(results_dir or RESULTS_DIR))}/`"
    if db:
        pairs += load_store(db)
        sources += f" and the run store `{Path(db).name}`"
    recs, n_dup = prepare(pairs)
    sections, others = place(experiments, recs, include_quick)
    searched = {}
    for s in sections:
        done = {
            r["cell"]: (r, src)
            for r, src in searches
            if _harness_search_run(r) and r.get("experiment") == s.exp.id and not r.get("quick")
        }
        searched[s.exp.id] = list(done.values())
        cells = {cell: r for cell, (r, _) in done.items()}
        s.search = search_state(s.exp, cells) if done and s.exp.runnable else []
    status(
        f"report: {len(recs)} records in {len(sections)} sections; each paper's claimed and "
        "honest ε recomputed by the accountants (about half a minute) …"
    )
    found = findings(sections, audits)
    sections = [s for f in found for s in f.sections] + [s for s in sections if not s.exp.seed_file]
    for old in html_dir.glob("*.png"):
        if old.name != "screenshot.png":
            old.unlink()
    plots = []
    drawn = [s for s in sections if s.exp.runnable or any(r.honest or r.nominal for r in s.rows)]
    status(f"report: {len(drawn)} plots …")
    for s in drawn:
        name = f"{s.exp.id}.png"
        ns = plot_section(s, html_dir / name)
        if ns is not None:
            s.plot, s.plot_n = name, ns
            plots.append(html_dir / name)
    validations = [(r, src) for r, src in searches if not _harness_search_run(r)]
    blocks = build_blocks(
        sections,
        found,
        others,
        recs,
        audits,
        validations,
        other_files,
        n_dup,
        sources,
        include_quick,
        searched,
        pending_sources(results_dir),
    )
    title = "privgrad: reproduction of the papers' tables"
    (html_dir / "index.html").write_text(render_html(blocks, title))
    md_path = out / MD_NAME
    md_path.write_text(render_markdown(blocks, f"{HTML_SUBDIR}/"))
    return {
        "markdown": md_path,
        "html": html_dir / "index.html",
        "plots": plots,
        "n_records": len(recs),
        "sections": sections,
        "findings": found,
        "others": others,
        "records": recs,
    }


def check_report(out_dir: str | Path | None = None, **kwargs) -> list[str]:
    """Differences between the report in ``out_dir`` and a fresh regeneration (empty: none)."""
    out = Path(out_dir or DOCS_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="privgrad-report-"))
    try:
        build_report(tmp, **kwargs)
        stale = []
        for rel in (MD_NAME, f"{HTML_SUBDIR}/index.html"):
            have = out / rel
            if not have.exists():
                stale.append(f"{have}: missing")
            elif have.read_text() != (tmp / rel).read_text():
                stale.append(f"{have}: differs from a fresh regeneration")
        fresh = {p.name for p in (tmp / HTML_SUBDIR).glob("*.png")}
        have = {p.name for p in (out / HTML_SUBDIR).glob("*.png")} - {"screenshot.png"}
        for name in sorted(fresh ^ have):
            stale.append(
                f"{out / HTML_SUBDIR / name}: "
                f"{'missing' if name in fresh else 'not in a fresh regeneration'}"
            )
        return stale
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
