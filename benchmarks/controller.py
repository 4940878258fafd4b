"""Reasoning-loop environment throughput and DQN time-to-target, in one run.

Part 1, environment steps per second (one environment, random actions, the same tasks for every row), measured
by ``benchmarks/env_throughput.py`` in a subprocess, once for this checkout and once for the commit before the
sandbox hardening (``PREVIOUS_COMMIT``, extracted with ``git archive``), back to back in each of ``--rounds``
rounds (medians reported):

* ``cold cache``: scripted planner/coder behind a simulated serving latency (``--llm-latency-ms`` per call, as
  a served LLM would add), every call recorded into an empty SQLite cache;
* ``warm cache``: the same episodes again, every call replayed from the cache (zero LLM calls);
* ``no LLM latency``: the environment's own cost (sandbox worker, embedding, parsing);
* baseline ``in-process exec`` (the public HYDRA code's way of running generated code: ``exec`` in the training
  process: no restriction layer, no worker, no wire, no limits), this checkout's execution code otherwise:
  the gap to it is what the sandbox costs.

Acceptance of the hardening: warm-cache throughput at least 80% of the previous sandbox's, same run.

Part 2, the quickstart DQN with each observation layout (``configs/quickstart/controller_dqn.yaml``: per part;
``controller_dqn_joint.yaml``: HYDRA's one joint embedding plus the planner probabilities, Eq. 2 selection): wall
time to the target held-out accuracy, and the final held-out accuracy against every rule without training
(planner argmax, argmin, random, the best fixed sample slot) and the oracle, on the same tasks.

    python benchmarks/controller.py [--part all|throughput|dqn] [--steps 1000] [--llm-latency-ms 20] [--rounds 5]
                                    [--no-record]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_throughput import measure  # noqa: E402
from results_file import machine, publish  # noqa: E402

from clova_train.controller.trainer import ControllerConfig, fit  # noqa: E402
from clova_train.envs import ReasoningLoopConfig  # noqa: E402
from clova_train.envs.scripted import ScriptedReasoningLLM  # noqa: E402
from clova_train.agents.sandbox import ExecutionResult, Sandbox, wire  # noqa: E402
from clova_train.agents.sandbox.worker import Worker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTARTS = ("controller_dqn.yaml", "controller_dqn_joint.yaml")
PREVIOUS_COMMIT = "1955ff0"  # the last commit with the pickle-wire, denylist sandbox
ROWS = ("cold cache", "warm cache", "no LLM latency")


class InProcessExec(Sandbox):
    """Baseline: the same execution code in this process, Python's full builtins, tool calls answered directly."""

    def run(self, source, variables, tools, image_id, size) -> ExecutionResult:
        worker = Worker(lambda call: Sandbox._serve(tools, call), output_chars=self.output_chars, restricted=False)
        done = worker.run({"code": source, "variables": wire.encode_value(variables, wire.Budget(1 << 20)),
                           "image": [image_id, size[0], size[1]]})
        return ExecutionResult(done["status"], wire.decode_value(done["variables"]) if done["status"] == "ok"
                               else dict(variables), done.get("stdout", ""), done.get("error", ""))


def previous_package(workdir: Path) -> Path:
    """The package of ``PREVIOUS_COMMIT`` laid out as installed (``clova_train.envs`` inside ``clova_train``)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_COMMIT, "clova_train", "envs"],
                             check=True, capture_output=True).stdout
    source, package = workdir / "previous-src", workdir / "previous"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    (package).mkdir()
    os.rename(source / "clova_train", package / "clova_train")
    os.rename(source / "envs", package / "clova_train" / "envs")
    return package


def throughput_of(pythonpath: Path | None, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "env_throughput.py"), "--steps",
                             str(args.steps), "--llm-latency-ms", str(args.llm_latency_ms)], cwd="/tmp", env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def throughput(args: argparse.Namespace, workdir: Path) -> tuple[list[str], str]:
    """Median over rounds; in each round both versions run back to back (order alternating), and the ratio of
    their warm-cache throughputs is taken within the round, so that the machine's slow spells (a shared host:
    the same run varies by 1.5x from minute to minute here) hit both sides of each ratio alike."""
    previous = previous_package(workdir)
    versions = {"clova-train": None, f"previous sandbox ({PREVIOUS_COMMIT})": previous}
    runs: dict[str, list[dict]] = {name: [] for name in versions}
    ratios = []
    for round_ in range(args.rounds):
        order = list(versions) if round_ % 2 == 0 else list(reversed(versions))
        for name in order:
            runs[name].append(throughput_of(versions[name], args))
        ours, theirs = (runs[name][-1]["warm cache"]["steps_per_s"] for name in versions)
        ratios.append(ours / theirs)
    baseline = measure(ScriptedReasoningLLM(), ReasoningLoopConfig(), args.steps, InProcessExec())
    rows = []
    for name, results in runs.items():
        for row in ROWS:
            rate = statistics.median(r[row]["steps_per_s"] for r in results)
            last = results[-1][row]
            hit = "-" if last["cache_hit_rate"] is None else f"{last['cache_hit_rate']:.2f}"
            rows.append(f"| {name}, {row} | {rate:.0f} | {last['llm_calls']} | {hit} |")
    rows.append(f"| baseline: in-process exec, no LLM latency | {baseline['steps_per_s']:.0f} | "
                f"{baseline['llm_calls']} | - |")
    note = (f"median of {args.rounds} rounds, both versions back to back in each; warm-cache throughput of the "
            f"hardened sandbox relative to the previous one, median of the per-round ratios: "
            f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)}; acceptance: >= 0.80)")
    return rows, note


def time_to_target(args: argparse.Namespace, workdir: Path, config_name: str) -> tuple[list[str], str]:
    """Fit one quickstart config; its time to the target and every policy of its final held-out evaluation."""
    import jsonargparse

    from clova_train.controller.evaluation import best_rule

    raw = yaml.safe_load((REPO / "configs/quickstart" / config_name).read_text())
    raw["train"].update(output_dir=str(workdir / config_name), log_formats=["csv"], eval_every=args.eval_every,
                        progress_bar=False)
    raw["env"]["cache_path"] = str(workdir / f"{config_name}.sqlite")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(ControllerConfig, sub_configs=True)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    config = instantiate(parser.parse_object(raw))
    config = ControllerConfig(env=config.env, dqn=config.dqn, train=config.train)
    started = time.perf_counter()
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        _, results = fit(config)
    finally:
        sys.stdout = stdout
    total = time.perf_counter() - started
    target = workdir / config_name / "target_reached.json"
    reached = yaml.safe_load(target.read_text()) if target.exists() else None
    layout = f"{config.env.layout}" + (" + probabilities" if config.env.layout == "joint" and config.env.probability_features else "")
    rule, rule_accuracy = best_rule(results)
    ours = results["trained controller"]
    rows = [
        f"| {layout} | DQN controller, first evaluation at >= {config.train.target_accuracy:.2f} | "
        + (f"{reached['wall_seconds']:.1f} | {reached['timesteps']} | {reached['accuracy']:.3f} | - |" if reached
           else "not reached | - | - | - |"),
    ]
    for name, result in results.items():
        trained = name.startswith("trained controller")
        rows.append(f"| {layout} | {name} | {f'{total:.1f}' if trained else 0} | "
                    f"{config.train.total_timesteps if trained else 0} | {result['accuracy']:.3f} | {result['steps']:.2f} |")
    note = (f"{config_name}: {config.train.n_envs} environments, {config.train.total_timesteps} steps; controller "
            f"{ours['accuracy']:.3f} against the best rule without training ({rule}) {rule_accuracy:.3f}: "
            f"{100 * (ours['accuracy'] - rule_accuracy):+.1f} points")
    return rows, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="environment steps per throughput row")
    parser.add_argument("--llm-latency-ms", type=float, default=20.0, help="simulated latency per LLM call")
    parser.add_argument("--eval-every", type=int, default=2500, help="DQN: steps between held-out evaluations")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (each runs both versions)")
    parser.add_argument("--part", choices=["all", "throughput", "dqn"], default="all", help="which part to run")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.part in ("all", "throughput"):
            env_rows, env_note = throughput(args, workdir)
            publish("controller", "Controller benchmark results", f"cpu: {machine()}",
                    f"Environment steps per second, one environment, {args.steps} random-action steps per row, "
                    f"simulated LLM latency {args.llm_latency_ms:g} ms per call where stated; {env_note}",
                    ["environment", "steps/s", "LLM calls", "cache hit rate"], env_rows, record=not args.no_record)
        if args.part == "throughput":
            return
        dqn_rows, dqn_notes = [], []
        for config_name in QUICKSTARTS:
            rows, note = time_to_target(args, workdir, config_name)
            dqn_rows += rows
            dqn_notes.append(note)
    publish("controller", "Controller benchmark results", f"cpu: {machine()}",
            "DQN on the quickstart world, both observation layouts, evaluation every "
            f"{args.eval_every} steps on held-out tasks (the same tasks for every policy; wall time includes the "
            "evaluations; the oracle knows which instruction kinds are right: a ceiling, not a rule). "
            + "; ".join(dqn_notes),
            ["layout", "policy", "wall seconds", "environment steps", "held-out accuracy", "steps / episode"],
            dqn_rows, record=not args.no_record)


if __name__ == "__main__":
    main()
