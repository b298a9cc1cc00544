"""The table of results/precision/README.md from the records beside it (issue 39, item 6):
test accuracy per seed in fp32 and bf16, mean ± sd, the paired difference, the honest ε.

    python experiments/scripts/precision_table.py
"""

import json
import statistics as st
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "results" / "precision"


def table(folder: Path = FOLDER) -> str:
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["precision"], {})[r["seed"]] = r
    seeds = sorted(runs["fp32"])
    acc = {p: [runs[p][s]["test_accuracy"] * 100 for s in seeds] for p in ("fp32", "bf16")}
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| precision | {head} | mean ± sd (n = {len(seeds)}) | ε (honest) | wall s (mean) |",
        "|---|" + "---|" * (len(seeds) + 3),
    ]
    for p in ("fp32", "bf16"):
        a = acc[p]
        eps = sorted({f"{runs[p][s]['epsilon']:.4f}" for s in seeds})
        wall = st.mean(runs[p][s]["wall_time_s"] for s in seeds)
        cells = " | ".join(f"{v:.2f}" for v in a)
        lines.append(
            f"| {p} | {cells} | {st.mean(a):.2f} ± {st.stdev(a):.2f} | {', '.join(eps)} "
            f"| {wall:.0f} |"
        )
    diff = [b - a for a, b in zip(acc["fp32"], acc["bf16"])]
    cells = " | ".join(f"{d:+.2f}" for d in diff)
    lines.append(
        f"| bf16 − fp32 (paired by seed) | {cells} | {st.mean(diff):+.3f} ± {st.stdev(diff):.3f} "
        "| | |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
