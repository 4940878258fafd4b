"""Shared by the benchmarks that drive the product through its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clova_train(*args: str) -> None:
    """Run ``clova-train ARGS`` in a fresh process from the repository root; exit with its stderr if it fails."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "clova_train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"clova-train {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
