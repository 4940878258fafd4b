"""Reasoning-loop environment throughput and DQN time-to-target, in one run.

Part 1, environment steps per second (one environment, random actions, the same tasks for every row):

* ``clova-train, cold cache``: scripted planner/coder behind a simulated serving latency (``--llm-latency-ms``
  per call, as a served LLM would add), every call recorded into an empty SQLite cache;
* ``clova-train, warm cache``: the same episodes again, every call replayed from the cache (zero LLM calls);
* ``clova-train, no LLM latency``: the environment's own cost (sandbox worker, embedding, parsing);
* baseline ``in-process exec`` (the public HYDRA code's way of running generated code: ``exec`` in the
  training process, no checks, no worker, no limits), otherwise identical: what the sandbox costs.

Part 2, DQN wall time to reach the quickstart's target held-out accuracy (``configs/quickstart/controller_dqn.yaml``),
against the accuracy of the planner's top sample (HYDRA without RL) on the same held-out tasks.

    python benchmarks/controller.py [--steps 2000] [--llm-latency-ms 20] [--no-record]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402

from clova_train.controller import ControllerConfig, fit  # noqa: E402
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv  # noqa: E402
from clova_train.envs.scripted import ScriptedReasoningLLM  # noqa: E402
import clova_train.sandbox as sandbox_module  # noqa: E402
from clova_train.sandbox import ExecutionResult, Sandbox  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class ServedScriptedLLM(ScriptedReasoningLLM):
    """The scripted model behind a fixed per-call latency, standing in for a served LLM."""

    def __init__(self, latency_s: float) -> None:
        super().__init__()
        self.latency_s = latency_s

    def chat(self, messages: list[dict]) -> str:
        time.sleep(self.latency_s)
        return super().chat(messages)


class DirectConnection:
    """Answers ImagePatch's tool calls in this process (what the pipe to the parent does for the worker)."""

    def __init__(self, tools) -> None:
        self.tools, self.reply = tools, None

    def send(self, message) -> None:
        _, method, patch, args = message
        self.reply = Sandbox._serve(self.tools, method, patch, args)

    def recv(self):
        return self.reply


class InProcessExec(Sandbox):
    """Baseline: the same execution (scope, builtins, tools) in this process: no check, no worker, no limits."""

    def run(self, source, variables, tools, image_id, size) -> ExecutionResult:
        sandbox_module._CONNECTION = DirectConnection(tools)
        return sandbox_module._execute(source, variables, image_id, size)


def run_steps(env: ReasoningLoopEnv, steps: int, seed: int = 0) -> float:
    """Steps per second of random actions over the tasks seeded from ``seed``."""
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    episode = 0
    started = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            episode += 1
            env.reset(seed=seed + episode)
    return steps / (time.perf_counter() - started)


def throughput(args: argparse.Namespace, workdir: Path) -> list[str]:
    latency = args.llm_latency_ms / 1000
    cache = str(workdir / "bench_cache.sqlite")
    rows = []

    def measure(name: str, llm, config: ReasoningLoopConfig, sandbox: Sandbox | None = None) -> float:
        env = ReasoningLoopEnv(config, llm=llm)
        if sandbox is not None:
            env.sandbox = sandbox
        env.reset(seed=0)
        env.step(0)  # start the sandbox worker outside the timing
        rate = run_steps(env, args.steps)
        calls = env.cache.stats.backend_calls if env.cache else llm.calls
        hit = f"{env.cache.stats.hit_rate:.2f}" if env.cache else "-"
        env.close()
        rows.append(f"| {name} | {rate:.0f} | {calls} | {hit} |")
        return rate

    measure("clova-train, cold cache", ServedScriptedLLM(latency), ReasoningLoopConfig(cache_path=cache))
    measure("clova-train, warm cache", ServedScriptedLLM(latency),
            ReasoningLoopConfig(cache_path=cache, cache_mode="replay"))
    measure("clova-train, no LLM latency", ScriptedReasoningLLM(), ReasoningLoopConfig())
    measure("baseline: in-process exec, no LLM latency", ScriptedReasoningLLM(), ReasoningLoopConfig(),
            InProcessExec())
    return rows


def time_to_target(args: argparse.Namespace, workdir: Path) -> tuple[list[str], str]:
    import jsonargparse

    raw = yaml.safe_load((REPO / "configs/quickstart/controller_dqn.yaml").read_text())
    raw["train"].update(output_dir=str(workdir / "dqn"), log_formats=["csv"], eval_every=args.eval_every)
    raw["env"]["cache_path"] = str(workdir / "dqn_cache.sqlite")
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
    target = (workdir / "dqn" / "target_reached.json")
    reached = yaml.safe_load(target.read_text()) if target.exists() else None
    ours = results["trained controller"]
    top = results["planner top-probability (HYDRA without RL)"]
    rows = [
        f"| DQN controller, first evaluation at >= {config.train.target_accuracy:.2f} | "
        + (f"{reached['wall_seconds']:.1f} | {reached['timesteps']} | {reached['accuracy']:.3f} |" if reached
           else "not reached | - | - |"),
        f"| DQN controller, end of training | {total:.1f} | {config.train.total_timesteps} | {ours['accuracy']:.3f} |",
        f"| baseline: planner top-probability (no training) | 0 | 0 | {top['accuracy']:.3f} |",
    ]
    return rows, (f"{config.train.n_envs} environments, {config.train.total_timesteps} steps, evaluation every "
                  f"{config.train.eval_every} steps on {config.train.eval_episodes} held-out tasks; wall time "
                  "includes the evaluations; final steps/episode: controller "
                  f"{ours['steps']:.2f}, planner top {top['steps']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="environment steps per throughput row")
    parser.add_argument("--llm-latency-ms", type=float, default=20.0, help="simulated latency per LLM call")
    parser.add_argument("--eval-every", type=int, default=2500, help="DQN: steps between held-out evaluations")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        env_rows = throughput(args, workdir)
        dqn_rows, dqn_note = time_to_target(args, workdir)
    publish("controller", "Controller benchmark results", f"cpu: {machine()}",
            f"Environment steps per second, one environment, {args.steps} random-action steps per row, simulated "
            f"LLM latency {args.llm_latency_ms:g} ms per call where stated",
            ["environment", "steps/s", "LLM calls", "cache hit rate"], env_rows, record=not args.no_record)
    publish("controller", "Controller benchmark results", f"cpu: {machine()}", f"DQN time to target: {dqn_note}",
            ["run", "wall seconds", "environment steps", "held-out accuracy"], dqn_rows, record=not args.no_record)


if __name__ == "__main__":
    main()
