"""Writes results/rdpgan/README.md from the GAN run records in results/rdpgan/ (no numbers typed in)."""
from pathlib import Path

from records import load_records, target_epsilon as target

OUT = Path("results/rdpgan")
MODES = ["non-private", "rdp-gan-b", "rdp-ant", "dp-gan"]
# Quoted from the paper for comparison: Table IV (MNIST, ε = 0.5) and Table III (Adult PMF errors).
PAPER_MNIST = {("non-private", None): 0.995, ("rdp-gan-b", 0.5): 0.863, ("rdp-ant", 0.5): 0.908}
PAPER_ITERATIONS = {("rdp-ant", 0.5): 868}
ATTRS = ["Age", "Occupation", "Education", "Gender", "Work Class", "Marital Status", "Work Hour", "Income"]
PAPER_ADULT = {None: [1.09, 0.68, 0.92, 0.01, 0.834, 0.36, 1.66, 0.06],
               5.0: [1.1, 1.23, 1.23, 0.009, 1.11, 0.57, 1.65, 0.17],
               0.5: [3.0, 1.75, 1.87, 0.048, 2.21, 0.69, 2.55, 0.44]}


def fmt(x, spec=".3f"):
    return "∞ (no guarantee)" if x is None else format(x, spec)


def main():
    recs = list(load_records(OUT).values())
    key = lambda r: (r["dataset"], MODES.index(r["mode"]), target(r) or 0)  # noqa: E731
    recs.sort(key=key)
    lines = ["# RDP-GAN, RDP-ANT and DP-GAN on MNIST and Adult", "",
             "Made by `bash experiments/scripts/rdpgan.sh` (each record's `command` field holds its exact command), "
             "then `python experiments/scripts/rdpgan_table.py`. \"claimed ε\" is the paper's Thms 1-4 figure, **not "
             "a guarantee** (../shared/spec/rdp-gan.md); only DP-GAN has an honest ε.", "",
             "## MNIST (Table IV)", "",
             "| mode | target ε | honest ε | claimed ε | n_g run (planned) | score | paper | samples |",
             "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in recs if r["dataset"] == "mnist"):
        t = target(r)
        paper = PAPER_MNIST.get((r["mode"], t))
        its = PAPER_ITERATIONS.get((r["mode"], t))
        img = Path(r["images"][0]).relative_to(OUT.resolve()) if r["images"] else ""
        lines.append(f"| {r['mode']} | {fmt(t, 'g') if t else '—'} | {fmt(r['epsilon'])} | {fmt(r['epsilon_claimed'])} | "
                     f"{r['generator_steps']} ({r['generator_steps_planned']}) | {r['test_accuracy']:.3f} | "
                     f"{paper if paper is not None else '—'}{f' ({its} iterations)' if its else ''} | "
                     f"![]({img}) |")
    lines += ["", "Score: the fraction of 10,000 generated digits that an MLP trained on the MNIST test split "
              "classifies as their intended label.", "",
              "## Adult (Table III: per-attribute PMF error, Eq. 22)", "",
              "| mode | target ε | honest ε | claimed ε | n_g run | " + " | ".join(ATTRS)
              + " | income acc. real→synthetic | synthetic→real | synthetic >50K rate | images |",
              "|---|---|---|---|---|" + "---|" * len(ATTRS) + "---|---|---|---|"]
    adult = [r for r in recs if r["dataset"] == "adult"]
    for r in adult:
        ev = r["evaluation"]
        imgs = ", ".join(f"[{Path(p).stem}]({Path(p).relative_to(OUT.resolve())})" for p in r["images"])
        lines.append(f"| {r['mode']} | {fmt(target(r), 'g') if target(r) else '—'} | {fmt(r['epsilon'])} | "
                     f"{fmt(r['epsilon_claimed'])} | {r['generator_steps']} | "
                     + " | ".join(f"{ev['pmf_error'][a]:.3f}" for a in ATTRS)
                     + f" | {ev['income_trained_real_tested_synthetic']:.3f} | "
                       f"{ev['income_trained_synthetic_tested_real']:.3f} | {ev['synthetic_income_rate']:.3f} | {imgs} |")
    for eps, row in PAPER_ADULT.items():
        lines.append(f"| paper (RDP-GAN) | {eps if eps else '∞'} | | | 1000 | " + " | ".join(f"{v:g}" for v in row)
                     + " | | | | |")
    if adult:
        ref = adult[0]["evaluation"]["income_trained_real_tested_real"]
        rate = sum(adult[0]["evaluation"]["pmf_real"]["Income"][1:])
        lines += ["", f"Income classifier trained on the real training rows and tested on adult.test: {ref:.3f} "
                  f"(the reference for the two synthetic columns); real >50K rate {rate:.3f}. Accuracy on synthetic "
                  "rows is high for a generator that emits one income class: read it with the >50K rate."]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
