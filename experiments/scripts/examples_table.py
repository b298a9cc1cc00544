"""The table of examples/README.md from the records in results/examples/ (examples/own_data.py
with ``--record``): test accuracy per seed, mean ± sd, the honest ε and the wall time, one row
per setting (images per digit and expected batch).

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


if __name__ == "__main__":
    print(table())
