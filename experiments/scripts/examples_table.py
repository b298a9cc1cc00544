"""The tables of examples/README.md from the records in results/examples/ (examples/own_data.py
with ``--record``: test accuracy per seed, mean ± sd, the honest ε and the wall time, one row
per setting, images per digit and expected batch) and results/examples/language_model/
(examples/language_model.py with ``--record``: held-out perplexity per seed, one row per
mechanism), and results/examples/language_model_mixtral/ (the same with ``--arch mixtral``).

    python experiments/scripts/examples_table.py
"""

import json
import statistics as st
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "results" / "examples"


def table(folder: Path = FOLDER) -> str:
    runs: dict[tuple[int, int], dict[int, dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        a = r["args"]
        runs.setdefault((a["per_class"], a["batch_size"]), {})[a["seed"]] = r
    lines = [
        "| setting | train / test images | expected batch | test accuracy per seed | "
        "mean ± sd | honest ε | wall s (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (per_class, batch), by_seed in sorted(runs.items(), reverse=True):
        rs = [by_seed[s] for s in sorted(by_seed)]
        acc = [100 * r["test_accuracy"] for r in rs]
        eps = ", ".join(sorted({f"{r['epsilon']:.4f}" for r in rs}))
        walls = [r["wall_time_s"] for r in rs if r.get("wall_time_s") is not None]
        seeds = ", ".join(str(s) for s in sorted(by_seed))
        lines.append(
            f"| `--per-class {per_class} --batch-size {batch}` | {rs[0]['train_images']:,} / "
            f"{rs[0]['test_images']:,} | {batch} | "
            + ", ".join(f"{a:.2f}" for a in acc)
            + f" % (seeds {seeds}) | {st.mean(acc):.2f} ± {st.stdev(acc):.2f} % | {eps} | "
            + (f"{st.mean(walls):.0f}" if walls else "—")
            + " |"
        )
    return "\n".join(lines)


def language_model_table(folder: Path = FOLDER / "language_model") -> str:
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["args"]["mechanism"], {})[r["args"]["seed"]] = r
    lines = [
        "| mechanism | held-out perplexity per seed | mean ± sd | − non-private, paired by seed "
        "| before training | word frequencies | honest ε | steps | wall s (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = runs.get("non-private", {})
    for mechanism, by_seed in sorted(runs.items()):
        rs = [by_seed[s] for s in sorted(by_seed)]
        ppl = [r["perplexity_after"] for r in rs]
        gaps = [
            r["perplexity_after"] - base[s]["perplexity_after"]
            for s, r in by_seed.items()
            if s in base
        ]
        gap = (
            f"{st.mean(gaps):+.1f} ± {st.stdev(gaps):.1f} (n = {len(gaps)})"
            if mechanism != "non-private" and len(gaps) > 1
            else "—"
        )
        eps = ", ".join(
            sorted({"∞" if r["epsilon"] is None else f"{r['epsilon']:.4f}" for r in rs})
        )
        lines.append(
            f"| {mechanism} | "
            + ", ".join(f"{x:.1f}" for x in ppl)
            + f" (seeds {', '.join(str(s) for s in sorted(by_seed))}) | "
            f"{st.mean(ppl):.1f} ± {st.stdev(ppl):.1f} | {gap} | "
            f"{st.mean(r['perplexity_before'] for r in rs):.0f} | "
            f"{st.mean(r['perplexity_unigram'] for r in rs):.1f} | {eps} | {rs[0]['steps']} | "
            f"{st.mean(r['wall_time_s'] for r in rs):.0f} |"
        )
    return "\n".join(lines)


def language_model_search_table(folder: Path = FOLDER / "language_model" / "search") -> str:
    """Validation perplexity (the training reviews after the first 5,000) per Adam lr and
    mechanism, seed 0: how the learning rates of the table above were chosen."""
    runs: dict[float, dict[str, float]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["args"]["lr"], {})[r["args"]["mechanism"]] = r["perplexity_after"]
    mechanisms = sorted({m for by_mechanism in runs.values() for m in by_mechanism})
    lines = [
        "| Adam lr | " + " | ".join(mechanisms) + " |",
        "|---" * (len(mechanisms) + 1) + "|",
    ]
    for lr, by_mechanism in sorted(runs.items()):
        cells = [f"{by_mechanism[m]:.1f}" if m in by_mechanism else "—" for m in mechanisms]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MIXTRAL = FOLDER / "language_model_mixtral"  # examples/language_model.py --arch mixtral


if __name__ == "__main__":
    print(table())
    print()
    print(language_model_table())
    print()
    print(language_model_search_table())
    print()
    print(language_model_table(MIXTRAL))
    print()
    print(language_model_search_table(MIXTRAL / "search"))
