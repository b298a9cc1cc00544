"""Writes results/defaults/README.md from the run records in results/defaults/search/ (the
lr search, validation accuracy) and results/defaults/check/ (the defaults alone, test
accuracy). No numbers typed in."""
import math
from pathlib import Path

from records import load_records

from privgrad.defaults import MECHANISM_NAMES

OUT = Path("results/defaults")


def fmt_eps(eps):
    return "∞" if eps is None or math.isinf(eps) else f"{eps:.3f}"


def main():
    search = list(load_records(OUT / "search").values())
    mechanisms = [m for m in MECHANISM_NAMES if any(r["mechanism"] == m for r in search)]
    lines = ["# Per-mechanism defaults of `privgrad train`", "",
             "## The search (validation accuracy)", "",
             "Made by `bash experiments/scripts/defaults.sh MECHANISM [LR ...]` (each record's `command` "
             "field holds its exact command), then `python experiments/scripts/defaults_table.py`. "
             "MNIST, the `cnn` model, target honest ε = 1 (δ = 1e-5), seed 0; 15,000 training examples of "
             "which 5,000 are held out (`--validation 5000`): each run trains on 10,000 for 3 epochs at "
             "expected batch 250 and is scored on the held-out 5,000, never on the test set. Only lr was "
             "searched: a five-value factor-2 grid per mechanism, extended past an edge that held the "
             "best until the best lay inside. SGD mechanisms use momentum 0.9; clip 0.1 "
             "(non-private: no clipping, no noise). The best lr of each row (**bold**) is its default "
             "in `privgrad/defaults.py`. "
             "Scaled down from full MNIST and 20 epochs to fit 2 shared CPU cores; one seed, so a "
             "difference of about 1 point (the binomial standard error at 5,000 examples and 90 % is "
             "0.4 points) is noise. Each record's `git_commit` is the commit its working tree was based on "
             "(with this issue's uncommitted edits, which leave these runs' settings as they were); "
             "the runs at 9de90d4 predate main's perf commits for conv per-sample norms "
             "(0ea4b11) and spectral transforms (edd4761), which compute the same quantities faster; "
             "spectral-dp and gredp were searched after them.", "",
             "| mechanism | lr: validation accuracy | best lr |", "|---|---|---|"]
    for mech in mechanisms:
        runs = sorted((r for r in search if r["mechanism"] == mech), key=lambda r: r["lr"])
        best = max(runs, key=lambda r: r["validation_accuracy"])
        cells = [(f"**{r['lr']:g}: {r['validation_accuracy']:.4f}**" if r is best
                  else f"{r['lr']:g}: {r['validation_accuracy']:.4f}") for r in runs]
        edge = " (on the grid's edge)" if best in (runs[0], runs[-1]) else ""
        lines.append(f"| {mech} | {' · '.join(cells)} | {best['lr']:g}{edge} |")
    check = list(load_records(OUT / "check").values())
    if check:
        lines += ["", "## The defaults alone (test accuracy)", "",
                  "Made by `bash experiments/scripts/defaults_check.sh`: `privgrad train --mechanism M "
                  "--limit-train 10000 --epochs 3` and nothing else (the first 10,000 MNIST training "
                  "examples, 3 epochs, every other setting the default), one seed, scored on the 10,000 "
                  "test images. The options after `--epochs 3` in each command only silence the output and "
                  "say where the record goes; wall s is one thread on the shared 2-core machine.", "",
                  "| mechanism | test accuracy | honest ε | σ_eff | lr | optimizer | batch | steps | wall s | command |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(check, key=lambda r: -r["test_accuracy"]):
            lines.append(f"| {r['mechanism']} | {r['test_accuracy']:.4f} | {fmt_eps(r['epsilon'])} | "
                         f"{r['effective_noise_multiplier']:.3f} | {r['lr']:g} | {r['optimizer']} | "
                         f"{r['batch_size']:g} | {r['steps']} | {r['wall_time_s']:.0f} | `{r['command']}` |")
        private = [r for r in check if r["mechanism"] != "non-private"]
        control = [r for r in check if r["mechanism"] == "non-private"]
        worst, best = min(private, key=lambda r: r["test_accuracy"]), max(private, key=lambda r: r["test_accuracy"])
        lines += ["", f"Lowest private test accuracy: {worst['mechanism']} {100 * worst['test_accuracy']:.2f} %; "
                      f"best private: {best['mechanism']} {100 * best['test_accuracy']:.2f} %"
                  + (f"; non-private: {100 * control[0]['test_accuracy']:.2f} %." if control else ".")]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
