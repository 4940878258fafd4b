"""Start-up of ``clova-train serve EXPORT``: seconds until ``/health`` answers and the peak resident memory of each
process of the server, for this checkout and for a named earlier commit (``--baseline-commit``, laid out from
``git archive`` as the package installs), back to back in each of ``--rounds`` (order alternating).

The server has three kinds of process: the command itself (``clova-train serve``; up to 6e47e99 it loaded every export
once to check it, then dropped it, and now checks only what needs no model), LitServe's API server and its process
manager, and one inference worker per export (which loads the export for serving). Peak RSS is each process's ``VmHWM`` sampled every 0.2 s until ``/health`` answers;
the table gives the command's, the largest other process's (the worker) and the sum over all of them (an upper
bound on what the machine needed at once: the peaks need not coincide). Appended to
``benchmarks/results/serve_startup.md`` with the machine.

    python benchmarks/serve_startup.py EXPORT [--baseline-commit 6e47e99] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from past_commit import package_at  # noqa: E402
from results_file import machine, publish  # noqa: E402
from serving_latency import free_port, healthy  # noqa: E402
from smoke_real import high_water_marks  # noqa: E402


def start_up(export: Path, device: str, pythonpath: Path | None, timeout: float) -> dict:
    """Start the server, sample its processes' memory until it is healthy, stop it (its whole process group)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    port = free_port()
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "clova_train", "serve", str(export), "--port", str(port),
                               "--device", device], cwd=tempfile.gettempdir(), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    marks: dict[int, int] = {}
    try:
        while not healthy(port):
            high_water_marks(server.pid, marks)
            if server.poll() is not None:
                raise SystemExit(f"serve_startup: the server exited ({server.returncode}) before it was healthy")
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"serve_startup: no healthy server within {timeout:.0f} s")
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        high_water_marks(server.pid, marks)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    command = marks.pop(server.pid, 0)
    return {"seconds": seconds, "command_gb": command / 1e6, "largest_other_gb": max(marks.values(), default=0) / 1e6,
            "total_gb": (command + sum(marks.values())) / 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--baseline-commit", default="6e47e99",
                        help="the commit to compare with (default: the last one whose server loaded each export twice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="back-to-back pairs, order alternating")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a server may take to start")
    parser.add_argument("--label", default=None, help="what the export is, for the heading (default: its path)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    export = args.export.resolve()
    results: dict[str, list[dict]] = {"this checkout": [], f"baseline {args.baseline_commit}": []}
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"this checkout": None, f"baseline {args.baseline_commit}": package_at(args.baseline_commit, Path(tmp))}
        for round_number in range(args.rounds):
            order = list(versions) if round_number % 2 == 0 else list(reversed(versions))
            for name in order:
                results[name].append(start_up(export, args.device, versions[name], args.timeout))
    rows = []
    for name, runs in results.items():
        def median(key: str) -> float:
            return statistics.median(run[key] for run in runs)
        rows.append(f"| {name} | {median('seconds'):.1f} | {median('command_gb'):.2f} | {median('largest_other_gb'):.2f} "
                    f"| {median('total_gb'):.2f} | {', '.join(format(run['seconds'], '.1f') for run in runs)} |")
    publish("serve_startup", "Server start-up benchmark results", f"{args.device}: {machine()}",
            f"{args.label or args.export}: `clova-train serve` until /health answers, {args.rounds} rounds (medians); "
            "peak RSS (GB) of the command itself, of the largest other process (the export's worker) and summed over "
            "the server's processes.",
            ["version", "seconds to healthy", "command peak RSS", "largest other peak RSS", "sum of peaks",
             "each round's seconds"], rows, record=not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
