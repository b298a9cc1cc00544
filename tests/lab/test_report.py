"""privgrad report: placement of every record, determinism, well-formed HTML, the committed
page matching a fresh regeneration, and --quick runs rendered end to end.

(The page's rendering in a real browser is checked by scripts/render_report.py with headless
Chromium, which CI does not install; here the HTML is checked with html.parser.)
"""

import dataclasses
import json
import math
import re
import shutil
import statistics
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from privgrad.app import console
from privgrad.errors import PrivgradError
from privgrad.lab.report import (
    DOCS_DIR,
    HTML_SUBDIR,
    MD_NAME,
    build_report,
    check_report,
    fingerprint,
    load_results,
)
from privgrad.lab.reproduce import EXPERIMENTS_DIR, RESULTS_DIR, config_dict, load_experiment
from privgrad.records import code_version
from privgrad.app.train import TrainConfig

from test_reproduce import QUICK_IN_REPORT_TEST  # noqa: E402  (tests/ is on sys.path)

VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


class _Checker(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.ids, self.hrefs, self.imgs, self.doctype = (
            [],
            [],
            [],
            [],
            [],
            False,
        )
        self.text = []

    def handle_decl(self, decl):
        self.doctype = self.doctype or decl.lower() == "doctype html"

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "a" and "href" in a:
            self.hrefs.append(a["href"])
        if tag == "img":
            self.imgs.append(a.get("src"))
            if not a.get("alt"):
                self.errors.append("img without alt")
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_html(path: Path) -> str:
    """Asserts the page is well-formed; returns its visible text."""
    text = path.read_text()
    c = _Checker()
    c.feed(text)
    c.close()
    assert c.doctype and '<meta charset="utf-8">' in text
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert len(c.ids) == len(set(c.ids)), "duplicate ids"
    for h in c.hrefs:
        assert not h.startswith("#") or h[1:] in c.ids, f"dangling link {h}"
    for src in c.imgs:
        assert (path.parent / src).is_file(), f"missing image {src}"
    visible = " ".join(c.text)
    for bad in ("nan", "None", "inf"):
        assert f" {bad} " not in f" {visible} ".replace("(", " ").replace(")", " "), bad
    return visible


def fake_record(cfg: TrainConfig, acc, eps, claimed=None, tag=None, **extra):
    rec = {
        "mechanism": cfg.mechanism,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "test_accuracy": acc,
        "epsilon": eps,
        "epsilon_claimed": eps if claimed is None else claimed,
        "epsilon_rdp": eps,
        "dp_guarantee": eps is not None,
        "delta": cfg.delta,
        "accountant": "pld",
        "neighbouring": "add/remove",
        "noise_multiplier": 1.0,
        "effective_noise_multiplier": 1.0,
        "sampling_rate": 0.01,
        "steps": 100,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "wall_time_s": 10.0 + acc,
        "batch_size": cfg.batch_size,
        "clip": cfg.clip,
        "lr": cfg.lr,
        "optimizer": cfg.optimizer or "sgd",
        "momentum": cfg.momentum,
        "activation": cfg.activation,
        "activation_params": cfg.activation_params,
        "target": cfg.target,
        "train_size": 60000,
        "mechanism_options": cfg.mechanism_options,
        "privgrad_version": "0.1.0",
        "command": None,
    }
    if tag:
        cell = tag
        rec.update(
            experiment=cell.experiment,
            arm=cell.arm,
            cell=cell.key,
            nominal_epsilon=cell.epsilon,
            quick=cell.quick,
            code_version=code_version(),
            config=config_dict(cfg),
        )
    rec.update(extra)
    return rec


@pytest.fixture
def synthetic(tmp_path):
    exps = tmp_path / "experiments"
    exps.mkdir()
    for name in ("bottleneck-t3-mnist", "gredp-t1-mnist"):
        shutil.copy(EXPERIMENTS_DIR / f"{name}.toml", exps)
    t3, gr = load_experiment("bottleneck-t3-mnist", exps), load_experiment("gredp-t1-mnist", exps)
    res = tmp_path / "results"
    (res / "reproduce").mkdir(parents=True)
    # DP-SGD's lr is searched: its grid cells are at the value each record's selection chose
    chose = {("DP-SGD", 1.0, "honest"): {"on": "validation", "chosen": {"lr": 1.0}}}
    grid = [
        c
        for c in t3.cells(choices=chose)
        if c.arm == "DP-SGD" and c.epsilon == 1.0 and c.seed in (0, 1)
    ]
    assert len(grid) == 2 and all(c.config.lr == 1.0 for c in grid)
    tagged = [
        fake_record(c.config, acc, 0.999, tag=c, selection=c.selection)
        for c, acc in zip(grid, (0.95, 0.96))
    ]
    g = next(c for c in gr.cells() if c.arm == "GReDP · paper" and c.seed == 0)
    tagged.append(fake_record(g.config, 0.93, 1.75, claimed=1.0, tag=g))
    q = t3.cells(quick=True, choices=chose)[0]
    tagged.append(fake_record(q.config, 0.11, 0.999, tag=q, selection=q.selection))
    (res / "reproduce" / "mixed.json").write_text(json.dumps(tagged))
    variant = fake_record(
        TrainConfig(
            mechanism="dp-signsgd",
            dataset="mnist",
            model="cnn",
            activation="relu",
            lr=0.01,
            epochs=3,
            batch_size=512,
            momentum=0.0,
        ),
        0.9412,
        0.9991,
    )
    (res / "sign_eps1.json").write_text(json.dumps(variant))
    (res / "copy_of_sign.json").write_text(json.dumps({"records": [variant]}))  # exact duplicate
    other = fake_record(
        TrainConfig(
            mechanism="gip", dataset="fashion-mnist", model="cnn", mechanism_options={"k_end": 0.1}
        ),
        0.7777,
        2.0,
    )
    (res / "gip_fmnist.json").write_text(json.dumps(other))
    (res / "audit.json").write_text(json.dumps({"audit": "canary", "epsilon_lower_bound": 0.3}))
    return {"exps": exps, "res": res, "tagged": tagged, "variant": variant, "other": other}


def test_every_record_is_placed_and_shown(synthetic, tmp_path):
    out = tmp_path / "docs"
    built = build_report(out, results_dir=synthetic["res"], experiments_dir=synthetic["exps"])
    md = (out / MD_NAME).read_text()
    visible = check_html(out / HTML_SUBDIR / "index.html")
    # every record read appears (appendix id), the quick one as left out
    pairs, _, _, others = load_results(synthetic["res"])
    assert len(pairs) == 7 and built["n_records"] == 6 and any("audit.json" in o for o in others)
    for rec, _ in pairs:
        assert fingerprint(rec) in md and fingerprint(rec) in visible
    assert "left out (--quick run)" in md and "1 exact duplicate record(s)" in md
    # the grid cell: mean ± sd over the two seeds, in both columns (dpsgd's claimed ε is its
    # honest ε)
    t3 = md.split('<a id="bottleneck-t3-mnist"></a>')[1]
    row = next(line for line in t3.splitlines() if line.startswith("| DP-SGD | 1.00 |"))
    assert row.count("95.50 ± 0.71 (n=2)") == 2 and "†" in row and "| 94.9 |" in row
    # the paper's nominal setting of GReDP: honest ε 1.75, claimed 1.00; equal-honest not run
    row = next(line for line in md.splitlines() if line.startswith("| GReDP · paper | 1.00 |"))
    assert "93.00 (n=1) | 1.75 | 1.00 | not run" in row and "| 96.5 |" in row
    # a committed record with other hyper-parameters is a variant row of its arm
    row = next(
        line for line in md.splitlines() if line.startswith("| DP-SignSGD — variant: E=3 B=512")
    )
    assert "94.12 (n=1)" in row and "| 1.00 |" in row
    # a record no experiment covers is in Other results
    assert "| gip | fashion-mnist | cnn |" in md and "77.77 (n=1)" in md
    assert (out / HTML_SUBDIR / "bottleneck-t3-mnist.png").stat().st_size > 5000


def test_a_person_watching_sees_what_the_report_is_doing(synthetic, tmp_path, monkeypatch, capsys):
    """Status lines on stderr before the slow parts (the accountants, the plots), and only in
    a terminal: piped or logged output stays as it was."""
    kwargs = dict(results_dir=synthetic["res"], experiments_dir=synthetic["exps"])
    build_report(tmp_path / "piped", **kwargs)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(console, "interactive", lambda: True)  # as in a terminal
    build_report(tmp_path / "terminal", **kwargs)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("report: 6 records in ") and "accountants" in err[0]
    assert re.fullmatch(r"report: [1-9]\d* plots …", err[1]), err


def test_record_text_is_escaped_in_the_markdown(synthetic, tmp_path):
    """Issue 14, case 9: record text is plain text in REPRODUCTION.md, as on the HTML page."""
    hostile = "<img src=x onerror=alert(1)> **bold** [link](https://x) `code` a_b_ | & \\"
    rec = fake_record(TrainConfig(mechanism="dpsgd", dataset="mnist", model="cnn"), 0.5, 1.0)
    rec["mechanism"] = hostile
    (synthetic["res"] / "hostile.json").write_text(json.dumps(rec))
    out = tmp_path / "docs"
    build_report(out, results_dir=synthetic["res"], experiments_dir=synthetic["exps"])
    md = (out / MD_NAME).read_text()
    for markup in ("<img", "**bold", "[link]", "`code`"):
        assert not re.search(r"(?<!\\)" + re.escape(markup), md), markup  # never unescaped
    escaped = (
        r"\<img src=x onerror=alert(1)\> \*\*bold\*\* \[link\](https://x) \`code\` a\_b\_ \| \& \\"
    )
    assert escaped in md
    assert hostile in check_html(out / HTML_SUBDIR / "index.html")


def test_report_is_deterministic_and_check_detects_staleness(synthetic, tmp_path):
    kwargs = dict(results_dir=synthetic["res"], experiments_dir=synthetic["exps"])
    a, b = tmp_path / "a", tmp_path / "b"
    build_report(a, **kwargs)
    build_report(b, **kwargs)
    for rel in (MD_NAME, f"{HTML_SUBDIR}/index.html"):
        assert (a / rel).read_text() == (b / rel).read_text()
    assert check_report(a, **kwargs) == []
    (synthetic["res"] / "late.json").write_text(json.dumps({**synthetic["variant"], "seed": 7}))
    assert any("differs" in s for s in check_report(a, **kwargs))


def test_committed_report_matches_a_fresh_regeneration():
    """docs/REPRODUCTION.md and docs/reproduction/ are what `privgrad report` builds from the
    committed results/ alone, and every committed run record appears in them."""
    assert (DOCS_DIR / MD_NAME).exists(), "run `privgrad report` and commit docs/"
    stale = check_report(DOCS_DIR)
    assert stale == [], "the committed report is stale; run `privgrad report`:\n" + "\n".join(stale)
    md = (DOCS_DIR / MD_NAME).read_text()
    visible = check_html(DOCS_DIR / HTML_SUBDIR / "index.html")
    for rec, source in load_results(RESULTS_DIR)[0]:
        assert fingerprint(rec) in md and fingerprint(rec) in visible, (
            f"{source} is not in the report"
        )


# --quick runs of these experiments happen here (the others in test_reproduce.py), then the
# report is built from that run store.
QUICK_HERE = sorted(QUICK_IN_REPORT_TEST)


def test_quick_runs_render_in_the_report(tmp_path):
    from privgrad.app.cli import main

    db = tmp_path / "runs.db"
    ran = []
    for exp_id in QUICK_HERE:
        exp = load_experiment(exp_id)
        assert not exp.missing(), f"{exp_id} is marked runnable but needs {exp.missing()}"
        result = CliRunner().invoke(
            main, ["reproduce", exp_id, "--quick", "--db", str(db), "--quiet"]
        )
        assert result.exit_code == 0, result.stderr
        ran.append(exp)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "docs"
    result = CliRunner().invoke(
        main,
        [
            "report",
            "--out",
            str(out),
            "--results-dir",
            str(tmp_path / "empty"),
            "--db",
            str(db),
            "--include-quick",
        ],
    )
    assert result.exit_code == 0, result.stderr
    md = (out / MD_NAME).read_text()
    check_html(out / HTML_SUBDIR / "index.html")
    for exp in ran:
        section = md.split(f'<a id="{exp.id}"></a>')[1].split('<a id="')[0]
        n_cells = exp.n_test_cells(quick=True)  # searched arms included
        assert f"{n_cells} of {exp.n_test_cells()} grid runs done" in section
        assert section.count("(n=1)") >= n_cells
        assert (out / HTML_SUBDIR / f"{exp.id}.png").is_file()
    if any(e.id == "gredp-t1-mnist" for e in ran):  # the claimed-ε run shows a larger honest ε
        row = next(line for line in md.splitlines() if line.startswith("| GReDP · paper | 1.00 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) > 1.2 and cells[5] == "1.00"
        row = next(line for line in md.splitlines() if line.startswith("| GReDP · tuned | 1.00 |"))
        assert float([c.strip() for c in row.strip("|").split("|")][7]) <= 1.0


def test_gan_records_fill_the_rdpgan_table(tmp_path):
    """`privgrad gan` records (no TrainConfig) sit in the non-runnable RDP-GAN section: RDP-GAN,
    with no honest ε, in the claimed-ε column (honest ∞); DP-GAN in the honest column; nothing in
    Other results."""
    exps, res, out = tmp_path / "experiments", tmp_path / "results", tmp_path / "docs"
    exps.mkdir(), res.mkdir()
    shutil.copy(EXPERIMENTS_DIR / "rdpgan-t4-mnist.toml", exps)
    base = {
        "dataset": "mnist",
        "model": "cdcgan",
        "delta": 1e-5,
        "seed": 0,
        "lr": 5e-5,
        "batch_size": 64.0,
        "config": {"mode": "x", "generator_steps": 1000, "epsilon": 0.5, "noise_multiplier": None},
    }
    recs = [
        dict(
            base,
            mechanism="rdp-gan-b",
            mode="rdp-gan-b",
            test_accuracy=0.4321,
            epsilon=None,
            epsilon_claimed=0.5,
            dp_guarantee=False,
        ),
        dict(
            base,
            mechanism="dp-gan",
            mode="dp-gan",
            test_accuracy=0.2345,
            epsilon=0.4996,
            epsilon_claimed=0.4996,
            dp_guarantee=True,
        ),
        dict(
            base,
            mechanism="dp-gan",
            mode="dp-gan",
            test_accuracy=0.5555,
            epsilon=0.4996,
            epsilon_claimed=0.4996,
            dp_guarantee=True,
            lr=2e-4,
        ),  # not the config's lr: a variant
        dict(
            base,
            mechanism="rdp-ant",
            mode="rdp-ant",
            test_accuracy=0.1111,
            epsilon=None,
            epsilon_claimed=0.4862,
            dp_guarantee=False,
            schedule={"kind": "time"},
        ),
        dict(
            base,
            mechanism="rdp-ant",
            mode="rdp-ant",
            test_accuracy=0.2222,
            epsilon=None,
            epsilon_claimed=0.4587,
            dp_guarantee=False,
            schedule={"kind": "ant", "tau": 0.5},  # the literal τ the RDP-ANT row matches
        ),
    ]
    (res / "gan.json").write_text(json.dumps(recs))
    build_report(out, results_dir=res, experiments_dir=exps)
    md = (out / MD_NAME).read_text()
    row = next(line for line in md.splitlines() if line.startswith("| RDP-GAN (mode B) | 0.50 |"))
    assert "| 43.21 (n=1) | ∞ (no guarantee) | 0.50 | — |" in row and "86.3" in row
    row = next(line for line in md.splitlines() if line.startswith("| DP-GAN (sound) | 0.50 |"))
    assert row.count("23.45 (n=1)") == 2
    # RDP-ANT and its Time baseline share a mechanism; the record's schedule decides the row
    row = next(line for line in md.splitlines() if line.startswith("| RDP-ANT | 0.50 |"))
    assert "| 22.22 (n=1) | ∞ (no guarantee) | 0.46 |" in row and "11.11" not in row
    row = next(line for line in md.splitlines() if line.startswith("| Time decay | 0.50 |"))
    assert "| 11.11 (n=1) | ∞ (no guarantee) | 0.49 |" in row and "87.4" in row
    row = next(
        line
        for line in md.splitlines()
        if line.startswith("| DP-GAN (sound) — variant: B=64 lr=0.0002 |")
    )
    assert row.count("55.55 (n=1)") == 2
    assert md.count("— variant:") == 1 and "## Other results\n\nNone." in md
    assert "not run by `privgrad reproduce`; 5 records from other commands" in md


# ------------------------------------------------------------- findings, comparisons, plots

VALIDATION = {"on": "validation", "chosen": {}}
TOY = """id = "%(id)s"
title = "%(name)s, Table 1 (a toy table)"
paper = "%(name)s: a toy paper"
table = "Table 1"
page = "n/a"
%(cite)s
[scaled_down]
epochs = "1"
data = "300 examples"
reason = "a test"
[base]
dataset = "mnist"
model = "lenet5"
epochs = 1
[grid]
epsilon = [1.0]
seeds = [0, 1, 2]
[quick]
limit_train = 300
epochs = 1
[[arms]]
name = "DP-SGD"
mechanism = "dpsgd"
note = "not in the paper"
"""
PAPER_ARM = """[[arms]]
name = "%(arm)s"
mechanism = "%(mech)s"
targets = ["claimed", "honest"]
paper = { "1.0" = 95.0 }
"""


def toy(folder, id, name, mech=None):
    """A paper table of DP-SGD and ``mech`` (the paper's proposed mechanism, arm ``name``) at ε = 1;
    without ``mech``, an anchor: DP-SGD alone and no seed text."""
    folder.mkdir(exist_ok=True)
    cite = f'seed_file = "toy.txt"\nseed_line = 1\nproposed = ["{mech}"]' if mech else ""
    text = TOY % {"id": id, "name": name, "cite": cite} + (
        PAPER_ARM % {"arm": name, "mech": mech} if mech else ""
    )
    (folder / f"{id}.toml").write_text(text)
    return load_experiment(id, folder)


def runs(exp, arm, accs, target="honest", eps=1.0, claimed=None, **extra):
    """Records of ``exp``'s grid cells of one arm, seeds 0, 1, ..., one per accuracy."""
    cells = [
        c for c in exp.cells(seeds=list(range(len(accs)))) if c.arm == arm and c.target == target
    ]
    return [
        fake_record(
            c.config, acc, eps, claimed=claimed, tag=c, **{"selection": c.selection, **extra}
        )
        for c, acc in zip(cells, accs)
    ]


def findings_report(tmp_path, records, audits=()):
    res, out = tmp_path / "results", tmp_path / "docs"
    res.mkdir()
    (res / "runs.json").write_text(json.dumps(records))
    for i, audit in enumerate(audits):
        (res / f"audit_{i}.json").write_text(json.dumps(audit))
    built = build_report(out, results_dir=res, experiments_dir=tmp_path / "experiments")
    md = (out / MD_NAME).read_text()
    check_html(out / HTML_SUBDIR / "index.html")
    table = md.split("## Findings")[1].split("\n\n")[2].splitlines()[2:]
    return built, md, {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table}


@pytest.mark.parametrize("case", ["win", "overlap", "one seed", "untuned"])
def test_findings_label_each_comparison_with_its_power(tmp_path, case):
    """Δ = GReDP − tuned DP-SGD at equal honest ε, paired by seed (both ran seeds 0, 1, 2): a
    resolved win when the paired test rejects Δ = 0, else underpowered with its MDE; n < 2 on a
    side has no MDE; runs not chosen on validation are no tuned comparison. The section's Δ
    column shows the same (unadjusted) paired interval."""
    from scipy.stats import t, ttest_rel

    gredp, dpsgd = {
        "win": ([97.0, 97.2, 97.1], [95.0, 95.3, 95.1]),
        "overlap": ([95.0, 96.0, 97.0], [95.5, 96.5, 95.0]),
        "one seed": ([97.0], [95.0, 95.3, 95.1]),
        "untuned": ([97.0, 97.2, 97.1], [95.0, 95.3, 95.1]),
    }[case]
    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    sel = {} if case == "untuned" else {"selection": VALIDATION}  # else the harness's "paper"
    records = (
        runs(exp, "GReDP", [a / 100 for a in gredp], **sel)
        + runs(exp, "DP-SGD", [a / 100 for a in dpsgd], **sel)
        + runs(exp, "GReDP", [0.9], target="claimed", eps=1.75, claimed=1.0)
    )
    audits = [
        {
            "mechanism": "gredp",
            "epsilon": 1.75,
            "epsilon_claimed": 1.0,
            "epsilon_lower_bound": 1.2,
            "trials": 1000,
        },
        {"mechanism": "dpsgd", "epsilon": 1.0, "epsilon_claimed": 1.0, "epsilon_lower_bound": 0.5},
    ]
    built, md, rows = findings_report(tmp_path, records, audits)
    claim, audit, cell, verdict = rows["GReDP (gredp)"]
    assert (
        claim == "1.00 → 1.75 (×1.75)" and "Claimed ε understates the honest ε by ×1.75" in verdict
    )
    assert (
        audit.startswith("refutes the claim: lower bound 1.20 \\> claimed ε 1.00")
        and "1 of 1 audits" in audit
    )
    section_row = next(line for line in md.splitlines() if line.startswith("| GReDP | 1.00 |"))
    paired = case != "one seed"
    ci = ttest_rel(gredp, dpsgd).confidence_interval(0.95) if paired else None
    interval = "" if ci is None else f" \\[{ci.low:+.2f}, {ci.high:+.2f}\\]"
    delta = statistics.fmean(gredp) - statistics.fmean(dpsgd)
    n = f"n={len(gredp)}/{len(dpsgd)}"
    said = {"win": "GReDP wins", "overlap": "no difference resolved"}
    said = said.get(case, "n too small to compare" if not paired else "GReDP wins")
    expected = f"{delta:+.2f}{interval} ({n}{', paired' if paired else ''}): {said}"
    assert section_row.endswith(f"| {expected} |")  # the section compares every grid run
    if case == "untuned":
        assert cell == "no tuned comparison yet" and verdict.endswith("no tuned comparison yet. |")
        return
    diffs = [x - y for x, y in zip(gredp, dpsgd)]
    mde = None
    if paired:
        se = statistics.stdev(diffs) / math.sqrt(len(diffs))
        mde = (t.ppf(0.975, 2) + t.ppf(0.80, 2)) * se
    test = "paired t, df 2" if paired else "n \\< 2"  # Markdown escapes "<"
    label = {
        "win": "win resolved",
        "overlap": f"underpowered (MDE {mde or 0:.2f} points)",
        "one seed": "underpowered (n \\< 2)",
    }[case]
    assert cell == (
        "GReDP − DP-SGD at ε = 1 (gredp-t1; 60,000-image training subset, 1 epoch): "
        f"{delta:+.2f}{interval} ({test}, {n}); paper gives no Δ; {label}"
    ), cell
    assert verdict.endswith(
        {
            "win": f"GReDP beats tuned DP-SGD by {delta:.2f} points (n = 3/3). |",
            "overlap": (
                f"underpowered against tuned DP-SGD (MDE {mde or 0:.2f} points) (n = 3/3). |"
            ),
            "one seed": "underpowered against tuned DP-SGD (n \\< 2) (n = 1/3). |",
        }[case]
    )
    power_row = next(line for line in md.splitlines() if line.startswith("| GReDP | GReDP − "))
    assert power_row.endswith(f"| {label} |"), power_row


def test_paper_setting_is_compared_with_dpsgd_at_the_same_claimed_epsilon(tmp_path):
    """GReDP at its paper's setting (claimed ε 1, honest 1.75) against DP-SGD at ε 1, paired by
    seed, under the section's table; DP-SGD's runs at ε 1.75 would be the second comparison,
    and this grid has none."""
    from scipy.stats import ttest_rel

    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    gredp, dpsgd = [90.0, 91.0, 93.0], [95.0, 95.3, 95.1]
    records = runs(exp, "GReDP", [a / 100 for a in gredp], target="claimed", eps=1.75, claimed=1.0)
    records += runs(exp, "DP-SGD", [a / 100 for a in dpsgd])
    _, md, _ = findings_report(tmp_path, records)
    ci = ttest_rel(gredp, dpsgd).confidence_interval(0.95)
    delta = statistics.fmean(gredp) - statistics.fmean(dpsgd)
    assert (
        "<sub>Paper's setting against DP-SGD: GReDP (claimed ε 1.00) − DP-SGD at the same "
        f"claimed ε: {delta:+.2f} [{ci.low:+.2f}, {ci.high:+.2f}] (n=3/3, paired): DP-SGD "
        "wins</sub>"
    ) in md


def test_findings_show_the_most_favourable_label_before_the_largest_delta(tmp_path):
    """Among a paper's tuned comparisons the Findings show a resolved win before underpowered
    before a resolved loss, the largest Δ among equals: a resolved loss of −1.70 (beta-t1, still
    resolved after Holm over the two) is not shown ahead of an underpowered −2.33 (beta-t2)."""
    exps = tmp_path / "experiments"
    t1, t2 = toy(exps, "beta-t1", "Beta", "gredp"), toy(exps, "beta-t2", "Beta", "gredp")
    path = exps / "beta-t2.toml"  # another model, so that each table's records are its own
    path.write_text(path.read_text().replace('model = "lenet5"', 'model = "model1"'))
    t2 = load_experiment("beta-t2", exps)
    sel = {"selection": VALIDATION}
    records = (
        runs(t1, "Beta", [0.950, 0.952, 0.951], **sel)
        + runs(t1, "DP-SGD", [0.967, 0.968, 0.969], **sel)
        + runs(t2, "Beta", [0.92, 0.95, 0.98], **sel)
        + runs(t2, "DP-SGD", [0.95, 0.98, 0.99], **sel)
    )
    _, _, rows = findings_report(tmp_path, records)
    cell = rows["Beta (gredp)"][2]
    assert cell.startswith("Beta − DP-SGD at ε = 1 (beta-t2; ") and ": -2.33 \\[" in cell, cell
    assert "underpowered (MDE" in cell
    assert cell.endswith("Holm over the 2 (loss resolved: 1, underpowered: 1)"), cell
    # the verdict names the loss beside it, not the most favourable comparison alone
    assert rows["Beta (gredp)"][3].endswith(
        "its most favourable of 2 comparisons (loss resolved: 1, underpowered: 1). |"
    ), rows["Beta (gredp)"][3]


def test_papers_are_ordered_by_the_understatement_their_verdict_leads_with():
    """Where a verdict leads with the paper's own accountant's ratio at its setting, the papers
    are ordered by it, not by the PLD claims' ratio the verdict puts second: ×1.3 by the paper's
    accountant comes before ×1.1, whatever their PLD ratios (2.0 and 1.5)."""
    from types import SimpleNamespace as NS

    from privgrad.lab.report.findings import Finding

    def paper(name, pld, own):
        rec = NS(eps=lambda key: pld if key == "epsilon" else 1.0)
        row = NS(ours=NS(ratio=own), theirs=None)
        return Finding(name, [], [], {1.0: [rec]}, [], [], privacy=[row])

    found = [paper("A", pld=2.0, own=1.1), paper("B", pld=1.5, own=1.3)]
    assert [f.name for f in sorted(found, key=Finding.order)] == ["B", "A"]
    # a paper whose own accountant calls its claim conservative is ordered by the PLD ratio
    assert paper("C", pld=1.5, own=0.9).order()[1] == -1.5


def test_findings_order_the_sections_and_anchors_are_not_a_paper(tmp_path):
    """One row per paper (its tables grouped); papers whose claim an audit refutes first, then the
    largest understatement of ε, then by name, in the Findings and in the sections below; an
    experiment without a seed text (an anchor) is a line of its own, after the papers."""
    exps = tmp_path / "experiments"
    toy(exps, "alpha-t1", "Alpha", "dp-signsgd")
    beta = toy(exps, "beta-t1", "Beta", "gredp")
    toy(exps, "beta-t2", "Beta", "gredp")
    toy(exps, "gamma-t1", "Gamma", "spectral-dp")
    toy(exps, "anchors", "Anchors")
    audits = [
        {
            "mechanism": "spectral-dp",
            "epsilon": 2.9,
            "epsilon_claimed": 2.0,
            "epsilon_lower_bound": 2.3,
        },
        {"mechanism": "gredp", "epsilon": 1.0, "epsilon_claimed": 1.0, "epsilon_lower_bound": 0.3},
        {
            "mechanism": "dp-signsgd",
            "epsilon": 1.0,
            "epsilon_claimed": 1.0,
            "epsilon_lower_bound": 0.2,
        },
    ]
    built, md, rows = findings_report(
        tmp_path, runs(beta, "Beta", [0.9], target="claimed", eps=1.9, claimed=1.0), audits
    )
    # Gamma (refuted) first, then Beta (claimed ε understated ×1.9), then Alpha: not alphabetical
    assert list(rows) == ["Gamma (spectral-dp)", "Beta (gredp)", "Alpha (dp-signsgd)"]
    assert [f.name for f in built["findings"]] == ["Gamma", "Beta", "Alpha"]
    order = ["gamma-t1", "beta-t1", "beta-t2", "alpha-t1", "anchors"]
    assert [s.exp.id for s in built["sections"]] == order
    positions = [md.index(f'<a id="{i}"></a>') for i in order]
    assert positions == sorted(positions) and md.index("## Findings") < positions[0]
    assert "**DP-SGD anchors**" in md and "- [anchors](#anchors): DP-SGD at ε = 1: not run" in md
    assert rows["Alpha (dp-signsgd)"][2] == "no tuned comparison yet"
    assert rows["Alpha (dp-signsgd)"][1].startswith("does not refute the claim")


def test_findings_say_no_comparison_is_possible_without_a_finite_honest_eps(tmp_path):
    """A paper whose runs at its own setting all have honest ε ∞ (RDP-GAN) can never be compared
    with DP-SGD at equal honest ε: the Findings say so instead of "not yet"; one finite run among
    them makes it "not yet" again."""

    def delta(folder):
        folder.mkdir()
        return toy(folder / "experiments", "delta-t1", "Delta", "rdp-gan-b")

    exp = delta(tmp_path / "a")
    unbounded = runs(exp, "Delta", [0.9], target="claimed", eps=None, claimed=1.0)
    _, _, rows = findings_report(tmp_path / "a", unbounded)
    claim, _, cell, verdict = rows["Delta (rdp-gan-b)"]
    assert claim == "1.00 → ∞ (no guarantee)"
    assert (
        cell == "none possible: the proposed mechanisms give no finite honest ε to match DP-SGD at"
    )
    assert verdict.endswith("no equal-honest-ε comparison is possible. |")
    delta(tmp_path / "b")
    finite = unbounded + runs(exp, "Delta", [0.9, 0.8], target="claimed", eps=1.5, claimed=1.0)[1:]
    _, _, rows = findings_report(tmp_path / "b", finite)
    assert rows["Delta (rdp-gan-b)"][2] == "no tuned comparison yet"


def test_plots_draw_cell_means_with_sd_error_bars(synthetic, tmp_path, monkeypatch):
    """Each plotted cell is its mean with ± 1 sd over seeds (no bar where n = 1), and the caption
    says so with the n of the points drawn."""
    from matplotlib.axes import Axes

    calls, errorbar = [], Axes.errorbar

    def spy(self, x, y, yerr=None, **kwargs):
        calls.append((list(x), list(y), list(yerr)))
        return errorbar(self, x, y, yerr=yerr, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", spy)
    out = tmp_path / "docs"
    build_report(out, results_dir=synthetic["res"], experiments_dir=synthetic["exps"])
    # the DP-SGD grid cell at ε = 1: seeds 95 % and 96 %
    x, y, yerr = next(c for c in calls if c[1] == [pytest.approx(95.5)])
    assert x == [pytest.approx(0.999)] and yerr == [pytest.approx(statistics.stdev([95, 96]))]
    # single-run cells (the DP-SignSGD variant, GReDP at its claimed ε) are points without a bar
    singles = [c for c in calls if c[1] in ([pytest.approx(94.12)], [pytest.approx(93.0)])]
    assert len(singles) == 2 and all(math.isnan(c[2][0]) for c in singles)
    md = (out / MD_NAME).read_text()
    assert (
        "error bars ± 1 sd over seeds, n = 1–2 runs per point (each cell's n is in the table); "
        "a point with n = 1 has no bar"
    ) in md


def test_every_audit_record_is_a_row_of_the_audit_tables(tmp_path):
    """Canary and GAN-step audits in one table, membership inference in another; the verdict
    compares the lower bound with the honest and the claimed ε (∞ where null); audit files are
    not listed as files without records."""
    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    canary = {
        "method": "canary",
        "mechanism": "gredp",
        "epsilon": 2.95,
        "epsilon_claimed": 2.0,
        "epsilon_lower_bound": 2.37,
        "mu_hat": 0.71,
        "mu_hat_se": 0.0007,
        "trials": 4_000_000,
        "steps": 50,
        "sampling_rate": 0.1,
        "statistic": "likelihood-ratio",
        "delta": 1e-5,
        "confidence": 0.95,
        "power_honest": 2.46,
        "power_claimed": 1.81,
        "test": {"tpr": 1.59e-4, "fpr": 7.5e-6, "n_eval": 2_000_000},
        "model": "fullconv",
        "config": {
            "mechanism_options": {"noise": "paper"},
            "target": "claimed",
            "target_epsilon": 2.0,
        },
    }
    sound = {
        **canary,
        "epsilon": 1.0,
        "epsilon_claimed": 0.68,
        "epsilon_lower_bound": 0.6,
        "config": {"target": "honest", "target_epsilon": 1.0},
    }
    broken = {**sound, "mechanism": "dpsgd", "epsilon_claimed": 1.0, "epsilon_lower_bound": 1.3}
    gan = {
        "method": "canary",
        "mechanism": "rdp-gan-b",
        "epsilon": None,
        "epsilon_claimed": 1.0,
        "epsilon_lower_bound": 0.95,
        "noise_reading": "error",
        "model": "cdcgan discriminator",
    }
    side = lambda acc, auc, lb: {  # noqa: E731
        "test_accuracy": acc,
        "attacks": {
            "loss": {
                "auc": auc,
                "tpr_at_0.1%_fpr": 0.004,
                "tpr_at_1%_fpr": 0.015,
                "epsilon_lower_bound": lb,
            },
            "shadow": {"auc": 0.48, "epsilon_lower_bound": lb / 2},
        },
    }
    mia = {
        "method": "mia",
        "mechanism": "dpsgd",
        "epsilon": 8.0,
        "epsilon_claimed": 8.0,
        "epsilon_lower_bound": 0.15,
        "dataset": "mnist",
        "model": "cnn",
        "target": side(0.239, 0.586, 0.153),
        "control": side(0.93, 0.639, 0.886),
    }
    built, md, _ = findings_report(
        tmp_path, runs(exp, "DP-SGD", [0.95]), [canary, sound, broken, gan, mia]
    )
    audits = md.split('<a id="audits"></a>')[1].split('<a id="other-results"></a>')[0]
    rows = {
        line.split(" | ")[-1].rstrip(" |").rsplit("/", 1)[-1]: line.split(" | ")
        for line in audits.splitlines()
        if line.startswith("| ") and "audit\\_" in line
    }
    assert len(rows) == 5
    assert rows["audit\\_0.json"][0] == "| gredp (noise paper), σ for claimed ε = 2"
    # the largest bound 2·10^6 held-out trials allow: Clopper–Pearson at n of n and 0 of n
    tail = 0.025 ** (1 / 2_000_000)
    ceiling = math.log((tail - 1e-5) / (1 - tail))
    assert rows["audit\\_0.json"][2] == "50 steps, q 0.1, likelihood-ratio"
    assert rows["audit\\_0.json"][5:11] == [
        "2.370",
        f"2.46 / 1.81 (max {ceiling:.2f})",
        "0.71 ± 0.0007",
        "4,000,000",
        "1.59e-04 / 7.50e-06",
        "claimed ε refuted: lower bound \\> claimed ε",
    ]
    assert rows["audit\\_1.json"][10] == "consistent"  # 0.6 ≤ claimed 0.68 ≤ honest 1
    assert rows["audit\\_2.json"][10] == "VIOLATION: lower bound \\> honest ε"
    assert rows["audit\\_3.json"][0] == "| rdp-gan-b, noise on: error"
    assert (
        rows["audit\\_3.json"][3:5] == ["∞ (no guarantee)", "1.000"]
        and rows["audit\\_3.json"][6] == "—"  # no trial counts in this toy record: no power
        and rows["audit\\_3.json"][10] == "consistent"
    )
    assert rows["audit\\_4.json"][:9] == [
        "| dpsgd",
        "mnist, cnn",
        "8.000",
        "23.9",
        "0.586",
        "0.480",
        "0.004 / 0.015",
        "0.153",
        "93.0",
    ]
    _, read, _, no_record = load_results(tmp_path / "results")
    assert len(read) == 5 and not any("audit_" in f for f in no_record)


SEARCHED = TOY.replace(
    "[quick]",
    """[search]
validation = 100
seeds = [0, 1]
[search.space]
lr = [0.1, 0.2, 0.4]
[quick]
validation = 100""",
)


@pytest.mark.parametrize("best", ["inside", "edge"])
def test_each_search_is_a_row_of_its_sections_search_table(tmp_path, best):
    """The section shows every searched point's mean validation accuracy and the harness's own
    choice; a best value on the grid's edge is not chosen until its extension has run."""
    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / "toy-search.toml").write_text(
        SEARCHED % {"id": "toy-search", "name": "Toy", "cite": ""}
    )
    exp = load_experiment("toy-search", folder)
    ((arm, eps, target),) = exp.search_units()
    accs = (
        {0.1: (0.80, 0.82), 0.2: (0.90, 0.86), 0.4: (0.85, 0.85)}
        if best == "inside"
        else {0.1: (0.80, 0.82), 0.2: (0.84, 0.86), 0.4: (0.90, 0.91)}
    )
    search = [
        {
            **fake_record(c.config, 0.0, 1.0),
            "test_accuracy": None,
            "validation_accuracy": accs[c.point["lr"]][c.config.seed],
            "experiment": exp.id,
            "arm": c.arm,
            "cell": c.key,
            "search_point": c.point,
            "nominal_epsilon": eps,
        }
        for c in exp.search_cells(arm, eps, target, {"lr": [0.1, 0.2, 0.4]})
    ]
    res = tmp_path / "results" / "reproduce"
    res.mkdir(parents=True)
    (res / "toy-search.search.json").write_text(json.dumps(search))
    build_report(tmp_path / "docs", results_dir=tmp_path / "results", experiments_dir=folder)
    md = (tmp_path / "docs" / MD_NAME).read_text()
    row = next(line for line in md.splitlines() if line.startswith("| DP-SGD ε=1 |"))
    if best == "inside":
        assert row == (
            "| DP-SGD ε=1 | lr — 0.1: 81.00 (n=2), 0.2: 88.00 (n=2) ✓, 0.4: 85.00 (n=2) | lr 0.2 | "
            "chosen inside its grid |"
        )
    else:
        assert row == (
            "| DP-SGD ε=1 | lr — 0.1: 81.00 (n=2), 0.2: 85.00 (n=2), 0.4: 90.50 (n=2) | — | "
            "waiting: 6 of 8 runs done |"
        )
    _, _, searched, no_record = load_results(tmp_path / "results")
    assert len(searched) == 6 and no_record == []


def test_columns_show_more_record_fields_per_row_beside_the_papers(tmp_path):
    """[columns]: each row's mean of the listed (dotted) record fields over its runs, the paper's
    values (paper_columns) in a row of their own; a field some runs lack says over how many runs."""
    folder = tmp_path / "experiments"
    folder.mkdir()
    text = TOY % {"id": "toy-cols", "name": "Toy", "cite": ""}
    text = text.replace(
        "[base]", '[columns]\n"err" = "evaluation.err"\n"steps" = "steps"\n\n[base]', 1
    )
    text = text.replace(
        'note = "not in the paper"',
        'note = "not in the paper"\npaper_columns = { "1.0" = [0.5, nan] }',
    )
    (folder / "toy-cols.toml").write_text(text)
    exp = load_experiment("toy-cols", folder)
    assert exp.columns == {"err": "evaluation.err", "steps": "steps"}
    recs = runs(exp, "DP-SGD", [0.9, 0.8, 0.7])
    for rec, err in zip(recs, (0.25, 0.35, None)):
        if err is not None:
            rec["evaluation"] = {"err": err}
    res = tmp_path / "results"
    res.mkdir()
    (res / "runs.json").write_text(json.dumps(recs))
    build_report(tmp_path / "docs", results_dir=res, experiments_dir=folder)
    md = (tmp_path / "docs" / MD_NAME).read_text()
    table = md.split("### More measurements of these runs")[1].split("###")[0]
    assert "| DP-SGD (paper) | 1.00 | paper | 0.5 | — |" in table
    assert "| DP-SGD | 1.00 | n=3 | 0.300 (n=2) | 100.000 |" in table
    bad = text.replace("[0.5, nan]", "[0.5]")
    (folder / "toy-cols.toml").write_text(bad)
    with pytest.raises(PrivgradError, match="one number per \\[columns\\] entry"):
        load_experiment("toy-cols", folder)


def test_validation_runs_outside_the_harness_are_tabled_by_setting(tmp_path):
    """`privgrad train --validation` records (no experiment): one row per setting without lr,
    each lr's mean validation accuracy, the best marked; never shown as results."""
    exp = toy(tmp_path / "experiments", "toy-v", "Toy")
    base = TrainConfig(
        mechanism="dpsgd", dataset="mnist", model="cnn", epochs=3, batch_size=250, lr=1.0
    )
    runs_ = [
        {
            **fake_record(dataclasses.replace(base, lr=lr, seed=seed), 0.0, 1.0),
            "test_accuracy": None,
            "validation_accuracy": acc,
        }
        for lr, seed, acc in ((1.0, 0, 0.80), (1.0, 1, 0.84), (2.0, 0, 0.90))
    ]
    other = {
        **fake_record(dataclasses.replace(base, lr=4.0, epochs=5), 0.0, 1.0),
        "test_accuracy": None,
        "validation_accuracy": 0.5,
    }
    res = tmp_path / "results" / "search"
    res.mkdir(parents=True)
    for i, r in enumerate(runs_ + [other]):
        (res / f"v{i}.json").write_text(json.dumps(r))
    built = build_report(
        tmp_path / "docs",
        results_dir=tmp_path / "results",
        experiments_dir=tmp_path / "experiments",
    )
    md = (tmp_path / "docs" / MD_NAME).read_text()
    rows = [
        line.rsplit(" | ", 1)[0]
        for line in md.splitlines()
        if line.startswith("| dpsgd | mnist | cnn | E=")
    ]
    assert rows == [
        "| dpsgd | mnist | cnn | E=3 B=250 sgd tanh N=60000 | 1.00 | "
        "1: 82.00 (n=2), 2: 90.00 (n=1) ✓",
        "| dpsgd | mnist | cnn | E=5 B=250 sgd tanh N=60000 | 1.00 | 4: 50.00 (n=1) ✓",
    ]
    assert built["n_records"] == 0 and exp.id in md


def test_a_grid_cell_of_one_experiment_is_not_a_variant_of_another(tmp_path):
    """The anchors' DP-SGD cells match bottleneck-t4-mnist's DP-SGD-TS arm (mnist, cnn, tanh):
    they are shown in their own grid only; a record in no grid is still a variant of both, but
    one the harness made for the anchors (its config since edited) a variant of the anchors only."""
    exps = tmp_path / "experiments"
    exps.mkdir()
    for name in ("dpsgd-anchors-mnist", "bottleneck-t4-mnist"):
        shutil.copy(EXPERIMENTS_DIR / f"{name}.toml", exps)
    anchors = load_experiment("dpsgd-anchors-mnist", exps)
    chose = {("DP-SGD", 1.0, "honest"): {"on": "validation", "chosen": {"lr": 2.0}}}
    cell = next(c for c in anchors.cells(choices=chose) if c.epsilon == 1.0 and c.seed == 0)
    res = tmp_path / "results"
    res.mkdir()
    (res / "anchor.json").write_text(
        json.dumps(fake_record(cell.config, 0.9703, 0.999, tag=cell, selection=cell.selection))
    )
    loose = fake_record(dataclasses.replace(cell.config, lr=0.3, epochs=2), 0.9111, 0.999)
    (res / "loose.json").write_text(json.dumps(loose))
    stale = fake_record(
        dataclasses.replace(cell.config, epochs=3),
        0.9222,
        0.999,
        tag=cell,
        cell="0123456789abcdef",
        selection=cell.selection,
    )
    (res / "stale.json").write_text(json.dumps(stale))
    build_report(tmp_path / "docs", results_dir=res, experiments_dir=exps)
    md = (tmp_path / "docs" / MD_NAME).read_text()
    t4 = md.split('<a id="bottleneck-t4-mnist"></a>')[1].split("<a id=")[0]
    own = md.split('<a id="dpsgd-anchors-mnist"></a>')[1].split("<a id=")[0]
    assert "97.03 (n=1)" in own and "97.03" not in t4
    assert "91.11 (n=1)" in t4 and "91.11 (n=1)" in own and "— variant: E=2 B=1500 lr=0.3" in t4
    assert "92.22 (n=1)" in own and "92.22" not in t4


def _shared_non_private_cell(tmp_path):
    """gip-mnist's and bottleneck-t4-mnist's configs in ``tmp_path``, and ``write(file, name,
    seeds, acc, **fields)``, which writes that experiment's non-private runs of ``seeds`` (one
    cell, the same configuration in both) to ``results/file``; returns (write, report), the
    latter building the report and returning each section's text by id."""
    exps, res = tmp_path / "experiments", tmp_path / "results"
    exps.mkdir(), res.mkdir()
    for name in ("gip-mnist", "bottleneck-t4-mnist"):
        shutil.copy(EXPERIMENTS_DIR / f"{name}.toml", exps)
    chose = {"on": "validation", "chosen": {"lr": 0.025}}
    cells = {}
    for name, arm in (("gip-mnist", "Non-private"), ("bottleneck-t4-mnist", "Non-private (tanh)")):
        exp = load_experiment(name, exps)
        cells[name] = [c for c in exp.cells(choices={(arm, None, None): chose}) if c.arm == arm]
    assert cells["gip-mnist"][0].key == cells["bottleneck-t4-mnist"][0].key

    def write(file, name, seeds, acc, **fields):
        recs = [
            {**fake_record(c.config, acc, None, tag=c, selection=c.selection), **fields}
            for c in cells[name]
            if c.seed in seeds
        ]
        (res / file).write_text(json.dumps(recs))

    def report() -> dict:
        build_report(tmp_path / "docs", results_dir=res, experiments_dir=exps)
        md = (tmp_path / "docs" / MD_NAME).read_text()
        return {e: md.split(f'<a id="{e}"></a>')[1].split("<a id=")[0] for e in cells}

    return write, report


def test_a_cell_two_experiments_ran_shows_each_experiments_own_run(tmp_path):
    """gip-mnist's and bottleneck-t4-mnist's non-private arms share a cell (same configuration).
    Each section shows its own store's run, whatever the file order, so a row mixes stores (and
    code versions) only where its own store lacks the cell: then the other's run fills it."""
    write, report = _shared_non_private_cell(tmp_path)
    # file order: gip-mnist's runs first, bottleneck's (seed 0 only) last
    write("a.json", "gip-mnist", (0, 1), 0.9811)
    write("b.json", "bottleneck-t4-mnist", (0,), 0.9922)
    sections = report()
    assert "98.11 ± 0.00 (n=2)" in sections["gip-mnist"] and "99.22" not in sections["gip-mnist"]
    # bottleneck's seed 1 is gip-mnist's run: its own store lacks that cell
    assert "98.66 ± 0.78 (n=2)" in sections["bottleneck-t4-mnist"]


def test_another_experiments_run_of_other_code_does_not_fill_a_row(tmp_path):
    """A row takes another experiment's run of a cell its own store lacks only where that run
    is the code version of the row's own runs: bottleneck-t4-fmnist's seeds 3 and 4 (its own
    code version) filled gip-fmnist's DP-SGD and non-private rows beside gip-fmnist's seeds 0-2
    of another, so one row pooled two code versions."""
    write, report = _shared_non_private_cell(tmp_path)
    for theirs, shown in (("src-other", False), ("src-same", True)):
        write("a.json", "gip-mnist", (0,), 0.9811, code_version="src-same")
        write("b.json", "bottleneck-t4-mnist", (0, 1), 0.9922, code_version=theirs)
        # bottleneck's seed 1 (gip-mnist's store lacks that cell) joins only of the same code
        assert ("98.66 ± 0.78 (n=2)" if shown else "98.11 (n=1)") in report()["gip-mnist"]


def _searched(points: int, seeds: int = 2) -> dict:
    """A record's ``selection`` after a search of ``points`` lr values × ``seeds`` seeds."""
    return {
        "on": "validation",
        "chosen": {"lr": 1.0},
        "axes": {"lr": [float(2**i) for i in range(points)]},
        "seeds": list(range(seeds)),
    }


def test_tuned_comparisons_show_each_sides_search_budget_and_flag_unequal_ones(tmp_path):
    """GReDP chosen from 4 points × 2 seeds, DP-SGD from 6 × 2 (its grid extended at an edge):
    the Findings' cell and the comparisons table say the budgets differ (8 vs 12); equal
    budgets are shown without the flag."""
    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    gredp, dpsgd = [0.950, 0.952, 0.951], [0.967, 0.968, 0.969]
    for theirs, flagged in ((6, True), (4, False)):
        root = tmp_path / f"dpsgd-{theirs}"
        root.mkdir()
        (root / "experiments").mkdir()
        (root / "experiments" / "gredp-t1.toml").write_text(
            (tmp_path / "experiments" / "gredp-t1.toml").read_text()
        )
        records = runs(exp, "GReDP", gredp, selection=_searched(4)) + runs(
            exp, "DP-SGD", dpsgd, selection=_searched(theirs)
        )
        _, md, rows = findings_report(root, records)
        cell = rows["GReDP (gredp)"][2]
        power_row = next(line for line in md.splitlines() if line.startswith("| GReDP | GReDP − "))
        if flagged:
            assert "; search budget unequal: GReDP 8 vs DP-SGD 12 validation runs" in cell, cell
            assert "| 8 / 12 (unequal) |" in power_row, power_row
        else:
            assert "search budget unequal" not in cell, cell
            assert "| 8 / 8 |" in power_row, power_row


def test_paper_setting_against_a_searched_dpsgd_says_the_tuning_is_unequal(tmp_path):
    """GReDP at its paper's stated setting (not searched) against DP-SGD whose lr was chosen
    from 4 points × 2 seeds: the note under the table says the tuning is unequal and points to
    the tuned row; against an unsearched DP-SGD it says nothing of the kind."""
    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    gredp = runs(exp, "GReDP", [0.90, 0.91, 0.93], target="claimed", eps=1.75, claimed=1.0)
    assert all(r["selection"]["on"] != "validation" for r in gredp)
    searched = runs(exp, "DP-SGD", [0.95, 0.953, 0.951], selection=_searched(4))
    _, md, _ = findings_report(tmp_path, gredp + searched)
    note = next(line for line in md.splitlines() if "Paper's setting against DP-SGD" in line)
    assert note.endswith(
        ". Unequal tuning: GReDP ran at the paper's stated hyper-parameters without search, "
        "DP-SGD's were chosen on validation (8 runs); this tests the stated setting at this "
        "experiment's scale-downs, not the mechanism against an equally tuned DP-SGD (for that, "
        "the tuned row at equal honest ε)</sub>"
    ), note
    other = tmp_path / "unsearched"
    other.mkdir()
    (other / "experiments").mkdir()
    (other / "experiments" / "gredp-t1.toml").write_text(
        (tmp_path / "experiments" / "gredp-t1.toml").read_text()
    )
    _, md, _ = findings_report(other, gredp + runs(exp, "DP-SGD", [0.95, 0.953, 0.951]))
    assert "Unequal tuning" not in md


def test_a_choice_on_its_grids_edge_is_named_in_the_findings_and_the_comparisons_table(tmp_path):
    """GReDP's lr chosen at its grid's edge (``selection.edge``, extensions exhausted): the
    Findings' cell and the comparisons table say so; DP-SGD's, inside its grid, is not named."""
    exp = toy(tmp_path / "experiments", "gredp-t1", "GReDP", "gredp")
    records = runs(exp, "GReDP", [0.950, 0.952, 0.951], selection={**_searched(4), "edge": True})
    records += runs(exp, "DP-SGD", [0.967, 0.968, 0.969], selection={**_searched(4), "edge": False})
    _, md, rows = findings_report(tmp_path, records)
    cell = rows["GReDP (gredp)"][2]
    assert "; GReDP's chosen setting sits on its search grid's edge" in cell, cell
    assert "DP-SGD's chosen setting" not in cell
    power_row = next(line for line in md.splitlines() if line.startswith("| GReDP | GReDP − "))
    assert "| 8 / 8; GReDP's chosen setting sits on its search grid's edge |" in power_row
