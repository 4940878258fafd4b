"""HYDRA's environment with its planner and coder behind a real OpenAI-compatible HTTP server on 127.0.0.1:
``clova-train serve`` of the tiny LoRA export (random adapter weights, so its plans and code are poor), on the
offline OK-VQA-format evaluation set with the annotation oracle as tools. Malformed plans and code are statuses,
never exceptions; the recorded run replays with the server gone and no HTTP request; a server gone mid-episode or a
wrong port is one error naming the URL."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clova_train.core.errors import ClovaTrainError
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.common.world import SceneTools, make_task
from clova_train.envs.hydra.parts import MAX_INSTRUCTION_CHARS, PLACEHOLDER_INSTRUCTION, Planner
from clova_train.envs.tasks.formats import TaskFiles
from clova_train.envs.tasks.offline import write_offline_benchmark
from clova_train.envs.tasks.source import BenchmarkTasksConfig
from clova_train.llm.backends import BackendError
from clova_train.llm.config import LLMConfig
from clova_train.sandbox.supervisor import STATUSES
from helpers.serving import free_port, start_server, stop_server

N = 3  # planner samples: actions 0..2 run one, 3 rejects them all
REJECT = N
# Seeds 0..2 are recorded; 25 (seed 3: a question no other task asks, so its plans are not in the cache) is the
# episode the server goes away in.
EVAL_IDS = [5, 10, 15, 25]
SERVED_NAME = "tiny-lora"
# Actions per recorded episode (seed -> actions, repeated until the episode ends): always the first sample; a
# reject first; another slot, then a reject.
SCHEDULE = {0: [0], 1: [REJECT, 0], 2: [1, REJECT, 0]}
WELL_FORMED_LINE = re.compile(r"^\s*\d+\.\s*\[(0(\.\d+)?|1(\.0+)?)\]\s*\S")


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TaskFiles]:
    return write_offline_benchmark(tmp_path_factory.mktemp("bench"), [1, 2, 3, 4], EVAL_IDS, scale=1)


def scene_oracle(task) -> SceneTools:  # noqa: ANN001
    """The offline benchmark's images are the shapes world's scenes: its annotation tools answer for them."""
    return SceneTools(make_task(int(task.task_id)))


def served_config(files: dict[str, TaskFiles], base_url: str, cache: Path, mode: str) -> ReasoningLoopConfig:
    llm = LLMConfig(kind="openai", base_url=base_url, model=SERVED_NAME, api_key_env="CLOVA_TEST_NO_SUCH_KEY",
                    max_tokens=32, timeout_s=60.0, max_retries=1)
    # the test split is the whole eval file (a val file is given, so it is not halved): four tasks, task 25 unplayed
    return ReasoningLoopConfig(num_samples=N, max_iterations=3, split="test", llm=llm, cache_path=str(cache),
                               cache_mode=mode, tasks=BenchmarkTasksConfig(train=files["gqa-train"],
                                                                           val=files["okvqa-eval"],
                                                                           test=files["okvqa-eval"]))


@contextlib.contextmanager
def served(export: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``clova-train serve`` of ``export`` under SERVED_NAME; stopped on exit unless the test stopped it first."""
    # one torch thread: on a busy machine the default (one per core) makes the tiny model's replies ten times slower
    base, process = start_server([str(export), "--served-model-name", SERVED_NAME], env={"OMP_NUM_THREADS": "1"})
    try:
        yield base, process
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """A graceful stop of the server mid-test (SIGKILL only after 30 s)."""
    stop_server(process, timeout_s=30)


def play(env: ReasoningLoopEnv, seed: int, actions: list[int]) -> list[tuple]:
    """One episode: the reset's observation, info and samples, then each step's (action, observation, reward,
    terminated, truncated, info, samples after it); the samples are always N, whatever the planner replied."""
    obs, info = env.reset(seed=seed)
    transcript = [(obs, info, list(env.samples))]
    for k in range(env.config.max_iterations):
        action = actions[k % len(actions)]
        obs, reward, terminated, truncated, info = env.step(action)
        transcript.append((action, obs, reward, terminated, truncated, info, list(env.samples)))
        if terminated or truncated:
            return transcript
    raise AssertionError("the episode neither terminated nor was truncated within max_iterations")


def comparable(info: dict) -> dict:
    """A step's info less what differs between recording and replaying (backend calls and hit rate)."""
    return {k: v for k, v in info.items() if k not in ("costs", "cache_hit_rate")} | {
        "tool_calls": info["costs"]["tool_calls"]}


def planner_replies(cache: Path) -> list[str]:
    """The planner's replies the server gave, as recorded in the call cache."""
    with contextlib.closing(sqlite3.connect(cache)) as db:
        rows = db.execute("SELECT request, reply FROM calls").fetchall()
    return [reply.decode() for request, reply in rows
            if json.loads(request)["request"][0]["content"] == Planner.SYSTEM]


@pytest.mark.slow  # a server process (about 10 s to start on 2 cores) and the tiny Llama
def test_a_served_lora_model_drives_the_env_and_the_recorded_run_replays_without_it(lora_export: Path, offline,
                                                                                     tmp_path: Path) -> None:
    cache = tmp_path / "calls.sqlite"
    with served(lora_export) as (base, process):
        url = base + "/v1"
        env = ReasoningLoopEnv(served_config(offline, url, cache, "record"), tools_factory=scene_oracle)
        try:
            recorded = {seed: play(env, seed, actions) for seed, actions in SCHEDULE.items()}
            backend_calls = env.cache.stats.backend_calls
            http_requests = env.llm.backend.client.requests

            # The server goes away mid-episode: the next call that is not in the cache is one error naming the URL.
            env.reset(seed=3)  # task 25, never played: its plan comes from the server
            stop(process)
            with pytest.raises(BackendError, match=re.escape(f"{url}/chat/completions failed after 2 attempts")
                               + ".*connection failed") as failure:
                env.step(REJECT)  # a new plan (attempt 1) is asked for
            assert isinstance(failure.value, ClovaTrainError)
            stored = len(env.cache)
        finally:
            env.close()

    steps = [step for episode in recorded.values() for step in episode[1:]]
    assert [step[0] for step in recorded[0][1:]] == [0] * len(recorded[0][1:])
    for episode in recorded.values():
        assert all(len(entry[-1]) == N for entry in episode)  # the reset's samples and every step's
        for instruction, probability in (s for entry in episode for s in entry[-1]):
            assert isinstance(instruction, str) and 0 < len(instruction) <= MAX_INSTRUCTION_CHARS
            assert 0.0 <= probability <= 1.0
    for action, obs, reward, terminated, truncated, info, _ in steps:
        assert obs.shape == env.observation_space.shape and np.isfinite(obs).all() and np.isfinite(reward)
        assert info["status"] in STATUSES or info["status"] is None
        assert (info["status"] is None) == (action == REJECT) == info["rejected"]
        if info["instruction"] == PLACEHOLDER_INSTRUCTION:
            assert info["code"] == "pass" and info["status"] == "ok"  # padding: a no-op step, no coder call
    # the tiny model's code does not run: its failures are statuses (with the error), never exceptions
    assert any(info["status"] not in (None, "ok") and info["error"] for *_, info, _ in steps)
    # its plans are not N lines of "<k>. [<p>] <instruction>", yet every plan gave N samples (parse_samples)
    replies = planner_replies(cache)
    assert replies and any(sum(map(bool, map(WELL_FORMED_LINE.match, r.splitlines()))) < N for r in replies)
    assert sum(info["costs"]["llm_calls"] for *_, info, _ in steps) > 0
    assert backend_calls >= len(replies) and http_requests >= backend_calls > 0  # each call at least one request
    assert stored == backend_calls + 1  # the calls before the server went, and task 25's plan; not the failed one
    assert process.poll() is not None

    # Replay: the same config and actions, the server gone; every reply comes from the cache, none over HTTP.
    replay = ReasoningLoopEnv(served_config(offline, url, cache, "replay"), tools_factory=scene_oracle)
    try:
        replayed = {seed: play(replay, seed, actions) for seed, actions in SCHEDULE.items()}
        assert replay.cache.stats.backend_calls == 0 and replay.llm.backend.client.requests == 0
        assert replay.cache.stats.misses == 0 and replay.cache.stats.hits > 0
    finally:
        replay.close()
    for seed, episode in recorded.items():
        again = replayed[seed]
        assert len(again) == len(episode)
        np.testing.assert_array_equal(again[0][0], episode[0][0])
        assert again[0][1:] == episode[0][1:]
        for (action, obs, reward, terminated, truncated, info, samples), step in zip(episode[1:], again[1:]):
            np.testing.assert_array_equal(step[1], obs)
            assert (step[0], step[2], step[3], step[4], step[6]) == (action, reward, terminated, truncated, samples)
            assert comparable(step[5]) == comparable(info)
            assert step[5]["costs"]["llm_calls"] == 0


def test_a_wrong_port_is_one_error_naming_the_url_and_records_nothing(offline, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    cache = tmp_path / "calls.sqlite"
    env = ReasoningLoopEnv(served_config(offline, url, cache, "record"), tools_factory=scene_oracle)
    try:
        with pytest.raises(BackendError, match=re.escape(f"{url}/chat/completions failed after 2 attempts; last "
                                                         "error: connection failed")):
            env.reset(seed=0)
        assert len(env.cache) == 0 and env.cache.stats.backend_calls == 1
    finally:
        env.close()
