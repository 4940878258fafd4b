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

Part 3, AVIS (``configs/quickstart/controller_avis.yaml``): the masked DQN (never picks an action the transition
graph forbids) against the same DQN without the mask (it learns from the infeasible-action penalty), same seeds,
held-out evaluation every ``--avis-eval-every`` steps: environment steps and wall time to the target accuracy, and
the final accuracy, beside AVIS's rules without training (the planner LLM's own choice, a random feasible action).
Target: masking reaches the target in at most half the steps.

Part 4, HAMMR (``configs/quickstart/controller_hammr.yaml``): the trained dispatcher against the generic agent with
every tool and every example in one prompt (HAMMR's flat baseline), the LLM dispatcher's own choice, a random agent
and each specialist always, on the same held-out tasks: accuracy, dispatcher steps and LLM calls per episode
(nested calls included). The old target (the dispatcher beats the flat agent by at least 10 points) measured a
planner that read only its last two in-context examples; with every example in view (the default since) the flat
agent and the prompted dispatcher are right on every question of this world, and the target is withdrawn:
``benchmarks/controller_controls.py`` reports the dispatcher against them over seeds.

    python benchmarks/controller.py [--part all|throughput|dqn|avis|hammr] [--steps 1000] [--llm-latency-ms 20]
                                    [--rounds 5] [--seeds 0 1 2 3 4] [--no-record]
"""

from __future__ import annotations

import argparse
from dataclasses import fields
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_throughput import measure  # noqa: E402
from past_commit import package_at  # noqa: E402
from results_file import machine, publish  # noqa: E402

from clova_train.controller.trainer import ControllerConfig, fit  # noqa: E402
from clova_train.envs import ReasoningLoopConfig  # noqa: E402
from clova_train.envs.hydra.scripted import ScriptedReasoningLLM  # noqa: E402
from clova_train.sandbox import ExecutionResult, Sandbox, wire  # noqa: E402
from clova_train.sandbox.worker import Worker  # noqa: E402

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
    previous = package_at(PREVIOUS_COMMIT, workdir)
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
    from clova_train.controller.evaluation import best_rule

    config = load_quickstart(config_name, output_dir=str(workdir / config_name), eval_every=args.eval_every)
    config.hydra.cache_path = str(workdir / f"{config_name}.sqlite")
    results, total = quiet_fit(config)
    target = workdir / config_name / "target_reached.json"
    reached = yaml.safe_load(target.read_text()) if target.exists() else None
    layout = f"{config.hydra.layout}" + (" + probabilities" if config.hydra.layout == "joint" and config.hydra.probability_features else "")
    rule, rule_accuracy = best_rule(results, include_fitted=False)
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


def load_quickstart(name: str, **train: object) -> ControllerConfig:
    """A quickstart controller config as ``clova-train controller fit`` reads it, with ``train`` overrides."""
    import jsonargparse

    raw = yaml.safe_load((REPO / "configs/quickstart" / name).read_text())
    raw["train"].update(log_formats=["csv"], progress_bar=False, **train)
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(ControllerConfig, sub_configs=True)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    parsed = instantiate(parser.parse_object(raw))
    return ControllerConfig(**{f.name: parsed[f.name] for f in fields(ControllerConfig)})


def quiet_fit(config: ControllerConfig) -> tuple[dict, float]:
    started = time.perf_counter()
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        _, results = fit(config)
    finally:
        sys.stdout = stdout
    return results, time.perf_counter() - started


def avis_masking(args: argparse.Namespace, workdir: Path) -> tuple[list[str], str]:
    """Masked vs unmasked DQN on the AVIS quickstart, the same seeds; steps to the target and final accuracy."""
    rows, reached = [], {True: [], False: []}
    rules = None
    for seed in args.seeds:
        for masked in (True, False):
            out = workdir / f"avis-{'masked' if masked else 'unmasked'}-{seed}"
            config = load_quickstart("controller_avis.yaml", output_dir=str(out), seed=seed,
                                     eval_every=args.avis_eval_every, eval_episodes=args.avis_eval_episodes,
                                     total_timesteps=args.avis_steps)
            config.dqn.mask_actions = masked
            results, _ = quiet_fit(config)
            target = out / "target_reached.json"  # the first held-out evaluation at or above the target
            saved = json.loads(target.read_text()) if target.exists() else None
            reached[masked].append(saved["timesteps"] if saved else float("inf"))
            ours = results["trained controller"]
            crossing = f"{saved['timesteps']} | {saved['wall_seconds']:.1f}" if saved else "not reached | -"
            rows.append(f"| {'masked' if masked else 'unmasked'} DQN | {seed} | {crossing} | {ours['accuracy']:.3f} | "
                        f"{ours['rejects']:.2f} | {ours['steps']:.2f} |")
            rules = {k: v for k, v in results.items() if k != "trained controller"}
    for name, result in (rules or {}).items():
        rows.append(f"| {name} | - | - | - | {result['accuracy']:.3f} | {result['rejects']:.2f} | {result['steps']:.2f} |")
    masked_median, unmasked_median = (statistics.median(reached[m]) for m in (True, False))
    ratio = masked_median / unmasked_median if unmasked_median not in (0, float("inf")) else float("nan")
    note = (f"target accuracy {config.train.target_accuracy:.2f}; median steps to it: masked {masked_median:g}, unmasked "
            f"{unmasked_median:g} (ratio {ratio:.2f}; target <= 0.50); {args.avis_steps} steps per run, held-out "
            f"evaluation every {args.avis_eval_every} steps on {args.avis_eval_episodes} tasks (the same for every run)")
    return rows, note


def hammr_dispatch(args: argparse.Namespace, workdir: Path) -> tuple[list[str], str]:
    """The trained dispatcher against the flat generic agent and the rules without training, same held-out tasks."""
    rows, notes = [], []
    for seed in args.seeds:
        out = workdir / f"hammr-{seed}"
        config = load_quickstart("controller_hammr.yaml", output_dir=str(out), seed=seed,
                                 eval_every=0, eval_episodes=args.hammr_eval_episodes)
        results, wall = quiet_fit(config)
        flat = results["always agent generic"]
        ours = results["trained controller"]
        notes.append(f"seed {seed}: dispatcher {ours['accuracy']:.3f} - flat {flat['accuracy']:.3f} = "
                     f"{100 * (ours['accuracy'] - flat['accuracy']):+.1f} points")
        for name, result in results.items():
            if seed != args.seeds[0] and name != "trained controller":
                continue  # rules without training do not depend on the training seed
            label = {"trained controller": f"trained DQN dispatcher (seed {seed}, {wall:.0f} s)",
                     "always agent generic": "flat agent with every tool (generic ReAct-style prompt)"}.get(name, name)
            rows.append(f"| {label} | {result['accuracy']:.3f} | {result['steps']:.2f} | {result['llm_calls']:.1f} |")
    return rows, "; ".join(notes) + f"; {args.hammr_eval_episodes} held-out tasks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="environment steps per throughput row")
    parser.add_argument("--llm-latency-ms", type=float, default=20.0, help="simulated latency per LLM call")
    parser.add_argument("--eval-every", type=int, default=2500, help="DQN: steps between held-out evaluations")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (each runs both versions)")
    parser.add_argument("--part", choices=["all", "throughput", "dqn", "avis", "hammr"], default="all",
                        help="which part to run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="AVIS and HAMMR training seeds")
    parser.add_argument("--avis-steps", type=int, default=6000, help="AVIS: environment steps per run")
    parser.add_argument("--avis-eval-every", type=int, default=200, help="AVIS: steps between held-out evaluations")
    parser.add_argument("--avis-eval-episodes", type=int, default=200, help="AVIS: held-out tasks per evaluation")
    parser.add_argument("--hammr-eval-episodes", type=int, default=500, help="HAMMR: held-out tasks")
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
        if args.part in ("all", "avis"):
            rows, note = avis_masking(args, workdir)
            publish("controller", "Controller benchmark results", f"cpu: {machine()}",
                    f"AVIS: masked vs unmasked DQN on the quickstart world; {note}",
                    ["agent", "seed", "steps to target", "wall seconds to target", "final held-out accuracy",
                     "infeasible actions / episode", "steps / episode"], rows, record=not args.no_record)
        if args.part in ("all", "hammr"):
            rows, note = hammr_dispatch(args, workdir)
            publish("controller", "Controller benchmark results", f"cpu: {machine()}",
                    f"HAMMR: dispatcher vs flat agent vs the LLM's own choice on the quickstart world; {note}",
                    ["policy", "held-out accuracy", "dispatcher steps / episode", "LLM calls / episode"], rows,
                    record=not args.no_record)
        if args.part not in ("all", "dqn"):
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
