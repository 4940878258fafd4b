"""Shared by the benchmarks that drive the product through its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clova_train(*args: str, env: dict[str, str] | None = None) -> None:
    """Run ``clova-train ARGS`` in a fresh process from the repository root (``env``: extra environment variables);
    exit with its stderr if it fails."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    done = subprocess.run([sys.executable, "-m", "clova_train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"clova-train {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")


def controller_evaluation(output_dir: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """The ``evaluation.json`` of ``clova-train controller fit ARGS --train.output_dir=OUTPUT_DIR``, fitted first
    unless that run already finished (a rerun of a benchmark reuses it)."""
    import json

    if not (output_dir / "evaluation.json").is_file():
        clova_train("controller", "fit", *args, f"--train.output_dir={output_dir}", "--train.progress_bar=false",
                    env=env)
    return json.loads((output_dir / "evaluation.json").read_text())
