"""The screenshot of the HTML review in the README (``docs/report-screenshot.png``).

Runs the default demo incident (``sdc-forensics demo``: 4 gloo ranks on CPU, 40 steps, bit 30 of
rank 2's local gradient flipped at step 23), writes its review with ``sdc-forensics report
-o review.html``, and photographs the top of the page (summary, plots, first actions) with
headless chromium. Everything runs in a temporary directory; only the PNG is kept.

Usage::

    python benchmarks/report_screenshot.py                       # -> docs/report-screenshot.png
    python benchmarks/report_screenshot.py --out /tmp/shot.png --height 2600
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "report-screenshot.png")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=1900)
    args = parser.parse_args()
    browser = next(
        (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None
    )
    if browser is None:
        sys.exit("error: no chromium, chromium-browser or google-chrome on PATH (Debian: apt-get install chromium)")
    command = str(Path(sys.executable).parent / "sdc-forensics")
    with tempfile.TemporaryDirectory(prefix="sdc-screenshot-") as tmp:
        run = Path(tmp) / "sdc-demo"
        subprocess.run([command, "demo", "--out", str(run)], check=True, stderr=subprocess.DEVNULL)
        review = Path(tmp) / "review.html"
        done = subprocess.run([command, "report", str(run / "trace"), "-o", str(review)], stderr=subprocess.DEVNULL)
        if done.returncode != 1:
            sys.exit(f"error: report exited {done.returncode}, expected 1 (corruption)")
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile",
                f"--window-size={args.width},{args.height}",
                f"--screenshot={args.out}",
                review.as_uri(),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    print(f"{args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
