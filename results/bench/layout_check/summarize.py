"""Summary of the check run: DP-SGD and GIP step time over the non-private step (CPU time,
cnn, batch 256, one thread), before this session's redesign (d742391) and after it (HEAD of
the session), three alternated processes each. Run from the repository root."""

import json
import statistics
from pathlib import Path

here = Path(__file__).parent
for contender in ("dpsgd", "gip"):
    line = [contender]
    for version in ("old", "new"):
        ratios = [
            row["cpu_ratio"]
            for i in (1, 2, 3)
            for row in json.loads((here / f"{version}-{i}.json").read_text())["rows"]
            if row["contender"] == contender
        ]
        line.append(f"{version} {ratios} median {statistics.median(ratios):.3f}")
    print(" | ".join(line))
