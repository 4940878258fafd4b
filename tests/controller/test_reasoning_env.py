"""The HYDRA reasoning-loop environment: checkers, Eq. 3 rewards, reject, truncation, cache replay, vectorisation."""

from __future__ import annotations

import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from clova_train.envs import ENV_ID, ReasoningLoopConfig, ReasoningLoopEnv, eq3_step_reward
from clova_train.envs.common.world import make_task
from clova_train.core.observation_builder import max_reply_lines, parse_samples_report
from clova_train.envs.hydra.parts import PLACEHOLDER_INSTRUCTION, parse_samples
from clova_train.envs.hydra.scripted import ScriptedReasoningLLM
from clova_train.llm.backends import BackendError, ChatBackend

N = 5
COUNT_TASK = next(i for i in range(1, 200) if make_task(i).question_type == "count" and not i % 5 == 0)


class ScenarioLLM(ChatBackend):
    """Planner: slot k always proposes instruction kind k (tagged with the attempt). Coder: code per kind."""

    KINDS = ("answer right", "note a number", "answer wrong", "answer off-topic", "break a rule")

    def __init__(self, gold: str) -> None:
        wrong = str(int(gold) + 1)
        self.code = {"answer right": f"final_answer = {gold!r}", "note a number": "seen = 1",
                     "answer wrong": f"final_answer = {wrong!r}", "answer off-topic": "final_answer = 'banana'",
                     "break a rule": "import os"}
        self.planner_prompts: list[str] = []

    def identity(self) -> dict:
        return {"kind": "scenario"}

    def chat(self, messages: list[dict]) -> str:
        prompt = messages[-1]["content"]
        if "Write Python code" in prompt:
            instruction = prompt.split("Instruction: ")[1].split("\n")[0]
            return f"```python\n{self.code[instruction.split(' (attempt')[0]]}\n```"
        self.planner_prompts.append(prompt)
        attempt = prompt.split("Attempt: ")[1].split("\n")[0]
        return "\n".join(f"{i + 1}. [0.{i + 1}] {k} (attempt {attempt})" for i, k in enumerate(self.KINDS))


def scenario_env(**overrides) -> tuple[ReasoningLoopEnv, ScenarioLLM]:
    llm = ScenarioLLM(make_task(COUNT_TASK).answer)
    config = ReasoningLoopConfig(**{"num_samples": N, "max_iterations": 4, "reject_penalty": 3.0, **overrides})
    return ReasoningLoopEnv(config, llm=llm), llm


def test_env_passes_gymnasium_and_sb3_checkers() -> None:
    from gymnasium.utils.env_checker import check_env as gym_check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = gym.make(ENV_ID, config=ReasoningLoopConfig())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker's warning is a failure, not a line in the log
            gym_check_env(env.unwrapped, skip_render_check=True)
            sb3_check_env(env.unwrapped, warn=True)
    finally:
        env.close()


def test_eq3_reward_arithmetic_on_a_scripted_episode() -> None:
    env, llm = scenario_env()
    try:
        env.reset(seed=0, options={"task_id": COUNT_TASK})
        rewards = []
        for action in (N, 1, 4, 0):  # reject, intermediate step, sandbox violation, right answer
            _, reward, terminated, truncated, info = env.step(action)
            rewards.append(reward)
        r1, alpha = 100.0, 100.0
        assert rewards == [r1 - 1 - 3.0, -2.0, -3.0 - 10.0, alpha * 1.0]
        assert terminated and not truncated and info["correct"] and info["answer"] == make_task(COUNT_TASK).answer
        assert sum(rewards) == eq3_step_reward(1, "continue", r1, alpha, rejected=True, reject_penalty=3.0) + \
            eq3_step_reward(2, "continue", r1, alpha) + \
            eq3_step_reward(3, "continue", r1, alpha, failed=True, error_penalty=10.0) + \
            eq3_step_reward(4, "related", r1, alpha, m=1.0)
    finally:
        env.close()


@pytest.mark.parametrize(("action", "expected", "correct"), [(0, 100.0 + 100.0, True), (2, 100.0 + 0.0, False),
                                                             (3, 100.0 - 100.0, False)])
def test_final_answer_rewards(action: int, expected: float, correct: bool) -> None:
    env, _ = scenario_env()
    try:
        env.reset(seed=0, options={"task_id": COUNT_TASK})
        _, reward, terminated, truncated, info = env.step(action)
        assert (reward, terminated, truncated, info["correct"]) == (expected, True, False, correct)
    finally:
        env.close()


def test_reject_replans_with_a_new_attempt() -> None:
    env, llm = scenario_env()
    try:
        env.reset(seed=0, options={"task_id": COUNT_TASK})
        before = list(env.samples)
        _, _, terminated, truncated, info = env.step(N)
        assert info["rejected"] and info["rejects"] == 1 and not (terminated or truncated)
        assert "Attempt: 0" in llm.planner_prompts[0] and "Attempt: 1" in llm.planner_prompts[1]
        assert env.samples != before and all("(attempt 1)" in s for s, _ in env.samples)
    finally:
        env.close()


def test_truncation_at_the_iteration_limit() -> None:
    env, _ = scenario_env(max_iterations=3)
    try:
        env.reset(seed=0, options={"task_id": COUNT_TASK})
        results = [env.step(1) for _ in range(3)]
        assert [r[2] for r in results] == [False] * 3 and [r[3] for r in results] == [False, False, True]
        assert [r[1] for r in results] == [100.0 - 1, -2.0, -100.0]
        assert "Step 2: note a number (attempt 0) -> ok" in env.memory.text()
    finally:
        env.close()


def test_parse_samples_pads_and_trims_to_n() -> None:
    reply = "Here are my ideas:\n1. [0.7] count the circles\n2) (p=0.2) guess\n- look closer [no number]\n"
    samples = parse_samples(reply, 5)
    assert samples[:4] == [("Here are my ideas:", 0.0), ("count the circles", 0.7), ("guess", 0.2),
                           ("look closer [no number]", 0.0)]
    assert samples[4] == (PLACEHOLDER_INSTRUCTION, 0.0) and len(samples) == 5
    assert parse_samples("\n".join(f"{i}. [1.5] s{i}" for i in range(1, 9)), 3) == [("s1", 1.0), ("s2", 1.0), ("s3", 1.0)]


def rollout(env: ReasoningLoopEnv, seed: int, actions: list[int]) -> list[tuple]:
    obs, _ = env.reset(seed=seed)
    trace = [obs]
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        trace.append((obs, reward, terminated, truncated, info.get("answer")))
        if terminated or truncated:
            obs, _ = env.reset()
            trace.append(obs)
    return trace


class RefusingLLM(ChatBackend):
    def identity(self) -> dict:
        return ScriptedReasoningLLM().identity()  # same identity: replays the scripted model's records

    def chat(self, messages: list[dict]) -> str:
        raise AssertionError("the backend was called during replay")


def test_cache_replay_gives_identical_episodes_without_backend_calls(tmp_path: Path) -> None:
    actions = [0, 1, 5, 2, 0, 3, 4, 0, 1, 2, 5, 0] * 3
    config = ReasoningLoopConfig(cache_path=str(tmp_path / "cache.sqlite"))
    recorder = ReasoningLoopEnv(config)
    recorded = rollout(recorder, 7, actions)
    assert recorder.cache.stats.backend_calls > 0
    recorder.close()

    replay_config = ReasoningLoopConfig(cache_path=str(tmp_path / "cache.sqlite"), cache_mode="replay")
    replayer = ReasoningLoopEnv(replay_config, llm=RefusingLLM())
    replayed = rollout(replayer, 7, actions)
    assert replayer.cache.stats.backend_calls == 0 and replayer.cache.stats.misses == 0
    replayer.close()
    for a, b in zip(recorded, replayed, strict=True):
        if isinstance(a, tuple):
            np.testing.assert_array_equal(a[0], b[0])
            assert a[1:] == b[1:]
        else:
            np.testing.assert_array_equal(a, b)


def test_replay_mode_names_the_missing_request(tmp_path: Path) -> None:
    env = ReasoningLoopEnv(ReasoningLoopConfig(cache_path=str(tmp_path / "empty.sqlite"), cache_mode="replay"))
    with pytest.raises(BackendError, match=r"empty.sqlite \(replay mode\) has no reply for scripted-reasoning"):
        env.reset(seed=0)
    env.close()


@pytest.mark.parametrize("vectoriser", ["gymnasium-sync", "sb3-dummy", pytest.param("sb3-subproc", marks=pytest.mark.slow)])
def test_vectorised_rollouts_match_sequential(vectoriser: str) -> None:
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    n_envs, seeds = 2, [11, 12]
    rng = np.random.default_rng(0)
    actions = rng.integers(0, N + 1, size=(12, n_envs))

    sequential = []
    for k in range(n_envs):
        env = ReasoningLoopEnv(ReasoningLoopConfig())
        sequential.append(rollout(env, seeds[k], list(actions[:, k])))
        env.close()
    rewards_seq = [[step[1] for step in trace if isinstance(step, tuple)] for trace in sequential]

    make = [lambda: ReasoningLoopEnv(ReasoningLoopConfig()) for _ in range(n_envs)]
    if vectoriser == "gymnasium-sync":
        vec = gym.vector.SyncVectorEnv(make, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        obs, _ = vec.reset(seed=seeds)
        rewards = []
        for row in actions:
            obs, reward, _, _, _ = vec.step(row)
            rewards.append(reward)
    else:
        vec = (SubprocVecEnv if vectoriser == "sb3-subproc" else DummyVecEnv)(make)
        vec.seed(seeds[0])  # SB3 seeds env k with seed + k
        obs = vec.reset()
        np.testing.assert_array_equal(obs, np.stack([t[0] for t in sequential]))
        rewards = []
        for row in actions:
            vec.step_async(row)
            obs, reward, _, _ = vec.step_wait()
            rewards.append(reward)
    vec.close()
    np.testing.assert_allclose(np.asarray(rewards).T, np.asarray(rewards_seq))


def _planner_lists(count: int) -> list[tuple[str, list[tuple[str, float]]]]:
    """(step, samples) of the scripted planner for ``count`` tasks, both steps of each comparison."""
    from clova_train.envs.hydra.parts import MemoryBank, Planner

    planner = Planner(ScriptedReasoningLLM(malformed_probability=0.0), N)
    lists = []
    for task_id in range(1, count + 1):
        task = make_task(task_id)
        steps = [(task.question_type, MemoryBank())]
        if task.question_type == "compare":
            steps = [("compare-1", MemoryBank()), ("compare-2", MemoryBank(["Step 1: ... -> ok; variables: count_a = 2"]))]
        # the reply is a function of the prompt: the attempt number varies it for questions asked before
        lists += [(step, planner.propose(task.question, memory, task_id)) for step, memory in steps]
    return lists


def test_planner_probabilities_are_informative_only_given_the_question_and_memory() -> None:
    """The offline world's premise (envs/hydra/scripted.py): where the good sample sits among the planner's confidences
    depends on the step (question type, and the memory for comparisons), and the confidences themselves look
    alike whatever the step, so no rule over the probabilities alone finds the good sample often; a rule that
    knows the step does."""
    from clova_train.envs.hydra.scripted import CONFIDENCE_RANGE, GOOD, GOOD_RANK

    kinds = ScriptedReasoningLLM()
    by_step: dict[str, list[tuple[np.ndarray, int | None]]] = {}
    for step, samples in _planner_lists(1500):
        probabilities = np.array([p for _, p in samples])
        good = [i for i, (text, _) in enumerate(samples) if kinds.instruction_kind(text) == GOOD]
        by_step.setdefault(step, []).append((probabilities, good[0] if good else None))
    assert set(by_step) == set(GOOD_RANK)
    everything = [item for items in by_step.values() for item in items]
    assert 0.9 <= np.mean([g is not None for _, g in everything]) <= 0.99

    def hit_rate(items, rule) -> float:
        return float(np.mean([g is not None and rule(p) == g for p, g in items]))

    # every rank rule (argmax, second highest, ..., argmin) and every fixed slot: right on few lists overall
    for rank in range(N):
        assert hit_rate(everything, lambda p: int(np.argsort(-p, kind="stable")[rank])) < 0.45, rank
    for slot in range(N):
        assert hit_rate(everything, lambda p: slot) < 0.3, slot
    # the confidences carry no trace of the step: for every step their sorted values are the order statistics of
    # N uniform draws from CONFIDENCE_RANGE (means low + (high - low) * k / (N + 1))
    low, high = CONFIDENCE_RANGE
    expected = low + (high - low) * np.arange(1, N + 1) / (N + 1)
    for step, items in by_step.items():
        np.testing.assert_allclose(np.mean([np.sort(p) for p, _ in items], axis=0), expected, atol=0.025, err_msg=step)
    # knowing the step, the rank rule of that step is right whenever a good sample is there
    for step, items in by_step.items():
        rule = lambda p, r=GOOD_RANK[step]: int(np.argsort(-p, kind="stable")[r % N])  # noqa: E731
        assert hit_rate(items, rule) == pytest.approx(np.mean([g is not None for _, g in items])), step


def test_baselines_report_every_rule_and_the_oracle_is_not_a_rule() -> None:
    from clova_train.controller.evaluation import baselines, best_rule

    env = ReasoningLoopEnv(ReasoningLoopConfig(split="eval"))
    try:
        results = baselines(env, 30, 0, 1)
    finally:
        env.close()
    names = list(results)
    assert names[:3] == ["planner top-probability (HYDRA without RL)", "planner lowest-probability", "random sample"]
    assert names[3] == "one program from the planner's top sample, no memory (ViperGPT-like)"
    assert names[4].startswith("best fixed sample slot (") and names[5].startswith("oracle")
    assert results[names[5]]["accuracy"] >= 0.9  # the oracle: a ceiling, far above the rules
    # one program: never a second step, so a comparison (two counts) is never answered
    assert results[names[3]]["steps"] == 1.0 and results[names[3]]["accuracy"] <= results[names[0]]["accuracy"]
    name, accuracy = best_rule({**results, "trained controller": {"accuracy": 1.0}})
    assert name in names[:5] and accuracy == max(results[n]["accuracy"] for n in names[:5])


@pytest.mark.parametrize(("line", "expected"), [
    ("(0.7) find the cat", ("find the cat", 0.7)), ("find the cat (0.7)", ("find the cat", 0.7)),
    ("0.7 find the cat", ("find the cat", 0.7)), ("0.7: find the cat", ("find the cat", 0.7)),
    ("2) 0.6 - look left", ("look left", 0.6)), ("- count the circles [p=0.25]", ("count the circles", 0.25)),
    ("1. [0.83] count", ("count", 0.83)), ("1. find 3 cats", ("find 3 cats", 0.0)), ("(7) find", ("find", 0.0)),
    # bare trailing number, percent, scientific, leading dot, labels, other brackets, sentence end
    ("go left 0.7", ("go left", 0.7)), ("turn (70%)", ("turn", 0.7)), ("70% turn", ("turn", 0.7)),
    ("x (p=1e-1)", ("x", 0.1)), ("(p=.7) x", ("x", 0.7)), ("go left .7", ("go left", 0.7)),
    ("[p=0.7] x", ("x", 0.7)), ("{0.7} x", ("x", 0.7)), ("<0.7> x", ("x", 0.7)), ("- 0.7 - x", ("x", 0.7)),
    ("p: 0.7 x", ("x", 0.7)), ("find the cat 70 %", ("find the cat", 0.7)), ("find it 0.70.", ("find it", 0.7)),
    ("find the cat (0.7).", ("find the cat", 0.7)), ("Find the cat - Probability: 70%", ("Find the cat", 0.7)),
    ("find the cat | 0.4", ("find the cat", 0.4)), ("find the cat \u2014 0.4", ("find the cat", 0.4)),
    ("find the cat (confidence: 0.8)", ("find the cat", 0.8)), ("find the cat, confidence 0.8", ("find the cat", 0.8)),
    ("probability=0.3: find the cat", ("find the cat", 0.3)), ("find the cat p=0,7", ("find the cat", 0.7)),
    ("1. **Find the cat** \u2014 *0.7*", ("**Find the cat**", 0.7)), ("**[0.7]** find", ("find", 0.7)),
    ("find the cat (0.7 probability)", ("find the cat", 0.7)), ("find the cat [70% chance]", ("find the cat", 0.7)),
    ("find the cat, 80% sure", ("find the cat", 0.8)), ("find the cat, P(success)=0.7", ("find the cat", 0.7)),
    ("find the cat (p \u2248 0.7)", ("find the cat", 0.7)), ("~0.7 find the cat", ("find the cat", 0.7)),
    ("Instruction: find the cat, Probability: 0.7", ("find the cat", 0.7)), ("0.7\tfind", ("find", 0.7)),
    # list markers are not probabilities
    ("1) find", ("find", 0.0)), ("* find", ("find", 0.0)), ("[2] find (0.5)", ("find", 0.5)),
    ("Step 1: find (0.4)", ("find", 0.4)), ("a) find 0.3", ("find", 0.3)), ("- 1. [0.8] find", ("find", 0.8)),
    # a number inside the instruction is the instruction's
    ("pick the 2 red cubes", ("pick the 2 red cubes", 0.0)), ("zoom 1.5x", ("zoom 1.5x", 0.0)),
    ("zoom 1.5", ("zoom 1.5", 0.0)), ("scale the image by 0.5", ("scale the image by 0.5", 0.0)),
    ("check if the score is 0.5", ("check if the score is 0.5", 0.0)),
    ("find the cat, probability is 0.7", ("find the cat", 0.7)), ("crop the top 30%", ("crop the top 30%", 0.0)),
    ("find object (2)", ("find object (2)", 0.0)),
    ("pick the 2 red cubes (0.9)", ("pick the 2 red cubes", 0.9)), ("move to (0,7)", ("move to (0,7)", 0.0)),
    # out of range in brackets or after a label: clipped
    ("x (1.7)", ("x", 1.0)), ("x (170%)", ("x", 1.0)), ("x (p=-3)", ("x", 0.0)), ("x 170%", ("x 170%", 0.0)),
])
def test_parse_samples_reads_a_probability_before_or_after_the_instruction(line: str, expected: tuple) -> None:
    """A planner writing "(0.7)" after its instruction, or a bare "0.7" before it, is read, not turned into probability
    0 with the number left in the text (nor "0.7" taken for list item 0, nor "2" in "the 2 red cubes" for one)."""
    assert parse_samples(line, 1) == [expected]


@pytest.mark.parametrize(("reply", "samples", "notes"), [
    ("find the cat", [("find the cat", 0.0)], [(1, "missing")]),
    ("find the cat (0.7)", [("find the cat", 0.7)], []),
    ("x (1.7)\ny (170%)", [("x", 1.0), ("y", 1.0)], [(1, "clipped"), (2, "clipped")]),
    ("[1e309] inf\n(p=-3) negative", [("inf", 1.0), ("negative", 0.0)], [(1, "clipped"), (2, "clipped")]),
    ("x (p=high)\nmove to (0,7)\ngo 0,7", [("x (p=high)", 0.0), ("move to (0,7)", 0.0), ("go 0,7", 0.0)],
     [(1, "unreadable"), (2, "unreadable"), (3, "unreadable")]),
    # a probability on a line of its own: with the instruction above it when that has none ...
    ("1. find the cat\n   Probability: 0.7\n2. count\n   Probability: 0.5", [("find the cat", 0.7), ("count", 0.5)],
     []),
    # ... else with the next one (reply start, below a heading, below an instruction with its own)
    ("(0.7)\nfind the cat\n(0.5)\ncount", [("find the cat", 0.7), ("count", 0.5)], []),
    ("My ideas:\n(0.6)\nfind", [("My ideas:", 0.0), ("find", 0.6)], [(1, "missing")]),
    ("a (0.9)\n0.2\n(0.3)\nb", [("a", 0.9), ("b", 0.3)], [(2, "unpaired")]),
    ("a (0.9)\n0.2\nb (0.4)", [("a", 0.9), ("b", 0.4)], [(2, "unpaired")]),
    ("a (0.9)\nprobability: 0.2", [("a", 0.9), (PLACEHOLDER_INSTRUCTION, 0.0)], [(2, "unpaired")]),
    ("(p=high)\nfind", [("find", 0.0), (PLACEHOLDER_INSTRUCTION, 0.0)], [(1, "unreadable"), (2, "missing")]),
    # the n-th sample still takes the probability on the line below it; a later instruction is dropped
    ("a\nb\n(0.4)\nc (0.9)", [("a", 0.0), ("b", 0.4)], [(1, "missing")]),
    # a reply of stray probabilities is read up to max_reply_lines(n) non-empty lines, then cut
    ("(0.7)\n" * 500 + "late (0.9)", [(PLACEHOLDER_INSTRUCTION, 0.0)],
     [(i, "unpaired") for i in range(1, max_reply_lines(1) + 1)] + [(max_reply_lines(1) + 1, "cut")]),
])
def test_parse_samples_report_notes_every_probability_not_read_as_written(reply: str, samples: list,
                                                                         notes: list) -> None:
    """No line is read as 0 without a note (missing, unreadable, clipped or unpaired), and a line holding only a
    probability never becomes a sample of its own (which would shift every later slot)."""
    report = parse_samples_report(reply, len(samples))
    assert report.samples == samples == parse_samples(reply, len(samples))
    assert [(note.line, note.kind) for note in report.notes] == notes
    clipped = sum(kind == "clipped" for _, kind in notes)
    assert report.count_notes() == len(notes) and report.count_notes("clipped") == clipped


def test_parse_samples_reads_a_megabyte_line_at_once() -> None:
    """A reply is untrusted: a 1 MB line of spaces, digits or open brackets, or a reply of stray probability lines,
    is read in well under a second."""
    import time

    for line in (" " * 2**20, "1" * 2**20, "1 " * 2**19, "0." + "7" * 2**20, "(" + " " * 2**20 + "0.7)",
                 "[0.5" * 2**18, "x" + " 0.7" * 2**18, ("1." * 2**10 + "\n") * 2**9, "(0.7)\n" * 2**17,
                 "(p=high)\n" * 2**17, "*" * 2**20, "p: " * 2**18):
        started = time.perf_counter()
        samples = parse_samples(line, 5)
        assert time.perf_counter() - started < 0.1 and len(samples) == 5


def test_the_planner_counts_probabilities_it_could_not_read_and_warns_once_per_kind() -> None:
    from clova_train.envs.hydra.parts import MemoryBank, Planner

    class Reply(ChatBackend):
        def identity(self) -> dict:
            return {"kind": "fixed"}

        def chat(self, messages: list) -> str:
            return "1. (0.7) find the cat\n2. turn (170%)\n3. look (0,7)\n4. zoom"

    planner = Planner(Reply(), 4)
    with pytest.warns(UserWarning) as caught:
        first = planner.propose("How many?", MemoryBank(), 0)
        planner.propose("How many?", MemoryBank(), 1)
    assert first == [("find the cat", 0.7), ("turn", 1.0), ("look (0,7)", 0.0), ("zoom", 0.0)]
    assert planner.note_counts == {"clipped": 2, "unreadable": 2, "missing": 2}
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 3 and "'0,7'" in messages[1] and "counts as 0" in messages[1], messages
