"""Start-up time of ``clova-train COMMAND --help``: the lazy-import CLI against eager Lightning imports.

Each command runs as a fresh process (``python -m clova_train COMMAND --help``), timed wall-clock, median of
``--repeats`` runs after one warm-up (so the page cache holds the packages). Baseline: the same help behind
``import lightning.pytorch`` first, which is what every subcommand paid when the CLI imported Lightning
before parsing. ``fit --help`` is shown for reference: it needs Lightning (it documents every Trainer
argument). Goal (issue 12): argparse-only subcommands answer ``--help`` in under 2 s.

    python benchmarks/cli_startup.py [--repeats 5] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from results_file import machine, publish

COMMANDS = ["export", "serve", "predict", "tiny-model", "controller"]
EAGER = "import lightning.pytorch, sys; from clova_train.cli import main; sys.exit(main(sys.argv[1:]))"


def wall(argv: list[str], repeats: int) -> float:
    subprocess.run(argv, capture_output=True, check=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    args = parser.parse_args()
    rows = []
    for command in COMMANDS:
        ours = wall([sys.executable, "-m", "clova_train", command, "--help"], args.repeats)
        eager = wall([sys.executable, "-c", EAGER, command, "--help"], args.repeats)
        rows.append(f"| `{command} --help` | {ours:.2f} | {eager:.2f} | {eager / ours:.0f}x |")
    fit = wall([sys.executable, "-m", "clova_train", "fit", "--help"], args.repeats)
    rows.append(f"| `fit --help` (needs Lightning) | {fit:.2f} | {fit:.2f} | 1x |")
    publish("cli_startup", "CLI start-up time", machine(),
            f"Median wall seconds of {args.repeats} runs per command, fresh process each.",
            ["command", "clova-train (s)", "eager Lightning import (s)", "speed-up"], rows, not args.no_record)


if __name__ == "__main__":
    main()
