"""What HYDRA's environment costs in LLM calls on a benchmark's task files, and how the call cache bounds it.

Random-action episodes on a GQA-format training set (the offline benchmark, ``clova_train.envs.tasks.offline``;
scripted planner and coder, the scenes' annotation tools) with the call cache recording: at each checkpoint, the
environment steps so far, the LLM lookups (planner and coder prompts asked), the backend calls (lookups the cache
did not answer: what a served or paid LLM would see) and the cache hit rate. Baseline in the same run: the same
episodes without a cache, where every lookup is a backend call.

    python benchmarks/hydra_llm_calls.py                  # 200 training tasks, 2,000 episodes
    python benchmarks/hydra_llm_calls.py --tasks 50 --episodes 500 --no-record
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import machine, publish  # noqa: E402

from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv  # noqa: E402
from clova_train.envs.common.world import SceneTools, is_held_out, make_task  # noqa: E402
from clova_train.envs.tasks.offline import write_offline_benchmark  # noqa: E402
from clova_train.envs.tasks.source import BenchmarkTasksConfig  # noqa: E402


def scene_tools(task):  # noqa: ANN001, ANN201 (the offline benchmark's images are the shapes world's scenes)
    return SceneTools(make_task(int(task.task_id)))


def play(env: ReasoningLoopEnv, episodes: int, checkpoints: set[int], seed: int) -> list[tuple[int, int, int]]:
    """(episodes, env steps, backend calls so far: the planner's at each reset included) at each checkpoint."""
    rng = np.random.default_rng(seed)
    steps = 0
    rows = []
    for episode in range(episodes):
        env.reset(seed=seed * 1_000_003 + episode)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            steps, done = steps + 1, terminated or truncated
        if episode + 1 in checkpoints:
            rows.append((episode + 1, steps, env._backend_calls()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200, help="training tasks in the GQA-format set")
    parser.add_argument("--episodes", type=int, default=2000, help="random-action episodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="print the table without appending it")
    args = parser.parse_args()
    checkpoints = {n for n in (args.episodes // 10, args.episodes // 4, args.episodes // 2, args.episodes) if n}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train = [i for i in range(1, 10 * args.tasks) if not is_held_out(i)][:args.tasks]
        files = write_offline_benchmark(root / "bench", train, [5], scale=1)
        tasks = BenchmarkTasksConfig(train=files["gqa-train"], eval=files["okvqa-eval"])
        cached = ReasoningLoopEnv(ReasoningLoopConfig(tasks=tasks, cache_path=str(root / "calls.sqlite")),
                                  tools_factory=scene_tools)
        plain = ReasoningLoopEnv(ReasoningLoopConfig(tasks=tasks), tools_factory=scene_tools)
        try:
            with_cache = play(cached, args.episodes, checkpoints, args.seed)
            without = play(plain, args.episodes, checkpoints, args.seed)
            lookups = cached.cache.stats
        finally:
            cached.close()
            plain.close()
    rows = []
    for (episodes, steps, backend), (_, _, uncached) in zip(with_cache, without):
        rows.append(f"| {episodes:,} | {steps:,} | {uncached:,} ({uncached / steps:.2f}/step) | "
                    f"{backend:,} ({backend / steps:.2f}/step) | {1 - backend / uncached:.2f} |")
    publish("hydra_llm_calls", "HYDRA LLM-call cost results", f"cpu: {machine()}",
            f"HYDRA environment on a GQA-format set of {args.tasks} training tasks (offline benchmark, scripted "
            f"planner/coder at temperature 0, annotation tools), random actions, seed {args.seed}; backend calls "
            f"with the call cache recording vs without a cache (every lookup a call); the planner call of each reset "
            f"counted. Cache hit rate at the end: {lookups.hit_rate:.2f}.",
            ["episodes", "env steps", "LLM calls without cache", "backend calls with cache", "saved by the cache"],
            rows, record=not args.no_record)


if __name__ == "__main__":
    main()
