"""Reasoning-loop environment steps per second under whichever clova-train is importable (one JSON line out).

Run by ``benchmarks/controller.py`` in a subprocess for this checkout and for an earlier commit, so both are
measured by the same code on the same machine in the same run. Only API that every version has is used.

    python benchmarks/env_throughput.py --steps 2000 --llm-latency-ms 20
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
try:
    from clova_train.envs.hydra.scripted import ScriptedReasoningLLM
except ImportError:  # the earlier commit benchmarks/controller.py measures, whose envs/ was one flat folder
    from clova_train.envs.scripted import ScriptedReasoningLLM


class ServedScriptedLLM(ScriptedReasoningLLM):
    """The scripted model behind a fixed per-call latency, standing in for a served LLM."""

    def __init__(self, latency_s: float) -> None:
        super().__init__()
        self.latency_s = latency_s

    def chat(self, messages: list[dict]) -> str:
        time.sleep(self.latency_s)
        return super().chat(messages)


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


def measure(llm: ScriptedReasoningLLM, config: ReasoningLoopConfig, steps: int, sandbox=None) -> dict:
    env = ReasoningLoopEnv(config, llm=llm)
    if sandbox is not None:
        env.sandbox = sandbox
    env.reset(seed=0)
    env.step(0)  # start the sandbox worker outside the timing
    rate = run_steps(env, steps)
    calls = env.cache.stats.backend_calls if env.cache else llm.calls
    hit = env.cache.stats.hit_rate if env.cache else None
    env.close()
    return {"steps_per_s": rate, "llm_calls": calls, "cache_hit_rate": hit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--llm-latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    latency = args.llm_latency_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache.sqlite")
        print(json.dumps({
            "cold cache": measure(ServedScriptedLLM(latency), ReasoningLoopConfig(cache_path=cache), args.steps),
            "warm cache": measure(ServedScriptedLLM(latency), ReasoningLoopConfig(cache_path=cache,
                                                                                 cache_mode="replay"), args.steps),
            "no LLM latency": measure(ScriptedReasoningLLM(), ReasoningLoopConfig(), args.steps),
        }))


if __name__ == "__main__":
    main()
