"""One PNG per experiment: accuracy against honest ε, with the paper's points."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from privgrad.errors import PrivgradError
from privgrad.lab.report.formatting import _g, _stats
from privgrad.lab.report.placement import Section
from privgrad.lab.report.records import Rec


def _point(rs: list[Rec]) -> tuple[float, float, float, int] | None:
    """A cell's plotted point: (mean honest ε, mean accuracy, sd or NaN, n); None without a
    finite honest ε or an accuracy."""
    accs = [r.acc for r in rs if r.acc is not None]
    eps = [r.eps("epsilon") for r in rs]
    if not accs or any(e is None for e in eps):
        return None
    mean, sd = _stats(accs)
    return statistics.fmean(eps), mean, math.nan if sd is None else sd, len(accs)


def plot_section(section: Section, path: Path) -> list[int] | None:
    """Accuracy against honest ε: each cell's mean with ± 1 sd error bars (none where n = 1).
    Returns the n of every point drawn (None: nothing to draw, no file written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PrivgradError("privgrad report needs matplotlib (pip install matplotlib)") from err
    exp = section.exp
    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs_all, ns, drew = [], [], False
    for i, arm in enumerate(exp.arms):
        col = colours[i % len(colours)]
        rows = [r for r in section.rows if r.arm == arm.name]
        if not arm.private:
            ours = [r for r in rows if r.group == "" and r.honest]
            if ours:
                m, _ = _stats([x.acc for x in ours[0].honest if x.acc is not None] or [math.nan])
                ax.axhline(m, color=col, lw=1.2, label=f"{arm.name} (ours)")
                drew = True
            if arm.paper.get(None) is not None:
                ax.axhline(arm.paper[None], color=col, lw=1.0, ls=":", label=f"{arm.name} (paper)")
                drew = True
            continue
        series = [
            ([r.honest for r in rows if not r.group], "o", "-", "ours, equal honest ε"),
            (
                [r.nominal for r in rows if not r.group and not r.nominal_is_honest],
                "s",
                "--",
                "ours, paper's nominal σ",
            ),
        ]
        series += [
            ([r.honest for r in rows if r.group == g], "x", "none", "variant runs")
            for g in dict.fromkeys(r.group for r in rows if r.group)
        ]
        labelled = set()
        for cells, marker, ls, label in series:
            pts = sorted(p for p in map(_point, cells) if p is not None)
            if not pts:
                continue
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                color=col,
                marker=marker,
                ls=ls,
                capsize=3,
                ms=5,
                label=None if label in labelled else f"{arm.name} ({label})",
            )
            labelled.add(label)
            xs_all += [p[0] for p in pts]
            ns += [p[3] for p in pts]
            drew = True
        paper = sorted((e, v) for e, v in arm.paper.items() if e is not None)
        if paper:
            ax.plot(
                [p[0] for p in paper],
                [p[1] for p in paper],
                ls=":",
                lw=1,
                marker="*",
                ms=11,
                markerfacecolor="none",
                markeredgewidth=1.3,
                color=col,
                label=f"{arm.name} (paper, its ε)",
            )
            xs_all += [p[0] for p in paper]
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xlabel("ε (honest for our runs; as the paper states it for the paper's points)")
    ax.set_ylabel(exp.metric.split(":")[0])  # a long metric's explanation is in the section's text
    ax.set_title(f"{exp.id}: {exp.table}", fontsize=11)
    if xs_all and max(xs_all) / min(xs_all) > 1.5:
        ax.set_xscale("log", base=2)
    if xs_all:
        ticks = sorted(exp.epsilons)
        for x in sorted(
            xs_all
        ):  # a run's ε next to a grid ε (0.499 by 0.5) gets no tick of its own
            if not any(math.isclose(x, t, rel_tol=0.05) for t in ticks):
                ticks.append(float(f"{x:.3g}"))
        ticks.sort()
        if len(ticks) > 8:
            ticks = sorted(set(exp.epsilons)) or ticks[:: max(1, len(ticks) // 8)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_g(t) for t in ticks])
        ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return sorted(ns)
