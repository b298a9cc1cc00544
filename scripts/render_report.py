#!/usr/bin/env python
"""Renders the reproduction page in headless Chromium: a screenshot, and a check that the
browser's DOM holds every table and image of the file and that the screenshot is not blank.

    python scripts/render_report.py                 # docs/reproduction/index.html
    python scripts/render_report.py --page X.html --out shot.png --height 3000

Needs Debian's `chromium` (apt-get install chromium); CI does not install it, so the test
suite checks the HTML with html.parser instead (tests/lab/test_report.py).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=10000",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("error: headless Chromium not found (Debian: apt-get install chromium)")


def run(args: list[str], profile: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", default=str(ROOT / "docs" / "reproduction" / "index.html"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "reproduction" / "screenshot.png"))
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=2200)
    a = ap.parse_args()
    page = Path(a.page).resolve()
    if not page.is_file():
        sys.exit(f"error: no page at {page}; run `privgrad report` first")
    url = page.as_uri()
    source = page.read_text()
    with tempfile.TemporaryDirectory(prefix="privgrad-chromium-") as profile:
        dom = run(["--dump-dom", url], profile)
    with tempfile.TemporaryDirectory(prefix="privgrad-chromium-") as profile:
        shot = run(
            [f"--screenshot={Path(a.out).resolve()}", f"--window-size={a.width},{a.height}", url],
            profile,
        )
    problems = []
    if dom.returncode != 0 or "<main>" not in dom.stdout:
        problems.append(f"--dump-dom failed (rc {dom.returncode}): {dom.stderr[-500:]}")
    for tag in ("table", "img", "h2"):
        want, got = (
            len(re.findall(f"<{tag}[ >]", source)),
            len(re.findall(f"<{tag}[ >]", dom.stdout)),
        )
        if want != got:
            problems.append(f"the browser's DOM has {got} <{tag}>, the file {want}")
    out = Path(a.out)
    if shot.returncode != 0 or not out.is_file():
        problems.append(f"--screenshot failed (rc {shot.returncode}): {shot.stderr[-500:]}")
    else:
        import matplotlib.image as mpimg

        pixels = mpimg.imread(out)
        if pixels.std() < 0.02:
            problems.append("the screenshot is blank")
    if problems:
        print("\n".join("error: " + p for p in problems), file=sys.stderr)
        return 1
    print(
        f"rendered {page} in {Path(chromium()).name}: DOM complete; screenshot {out} "
        f"({a.width}×{a.height})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
