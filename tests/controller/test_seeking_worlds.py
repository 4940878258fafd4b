"""Worlds as data for AVIS and HAMMR: the information-seeking world read from a file, checked, and what it changes."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from clova_train.core.errors import DataError
from clova_train.envs.avis.information_seeking import InformationSeekingConfig, InformationSeekingEnv
from clova_train.envs.avis.scripted import ScriptedSeekingLLM
from clova_train.envs.avis.seeking_world import (
    TEMPLATES, SeekingWorld, load_seeking_world, presets, world_from_dict,
)
from clova_train.envs.avis.world import SeekingTools, make_seeking_task
from clova_train.envs.common.random_worlds import random_hydra_world, random_seeking_world, write_random_world
from clova_train.envs.hydra.reasoning_world import load_world
from clova_train.envs.hammr.dispatch import AgentDispatchConfig, AgentDispatchEnv
from helpers.common import REPO, run_cli_captured, run_cli_subprocess

FACT_PARAPHRASE = "When did the guild whose emblem is the leftmost {s} start?"


def write_world(tmp_path: Path, content: dict | str) -> Path:
    path = tmp_path / "world.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_shipped_worlds_load_and_the_default_is_the_built_in_one() -> None:
    assert {"seeking", "seeking-paraphrased", "seeking-delayed"} <= set(presets())
    assert load_seeking_world("seeking-delayed").requires == {"text_search": "caption", "image_search": "classify"}
    assert load_seeking_world("seeking") == SeekingWorld()
    assert [make_seeking_task(i).question for i in range(50)] == \
        [make_seeking_task(i, world=load_seeking_world("seeking")).question for i in range(50)]
    paraphrased = load_seeking_world("seeking-paraphrased")
    assert all(paraphrased.phrasings[k][0] == TEMPLATES[k] for k in TEMPLATES)
    # every wording of it reaches the tasks, the kinds stay as in the default world
    asked = Counter(make_seeking_task(i, world=paraphrased).question.split()[0] for i in range(400))
    assert {"When", "The", "Can"} <= set(asked)
    assert [make_seeking_task(i, world=paraphrased).question_type for i in range(50)] == \
        [make_seeking_task(i).question_type for i in range(50)]


@pytest.mark.parametrize(("content", "named"), [
    ({"questions": {"weather": 1}}, "questions: unknown key 'weather'"),
    ({"questions": {"count": 0}}, "at least one kind"),
    ({"questions": {"fact": -2}}, "questions.fact = -2"),
    ({"phrasings": {"count": []}}, "phrasings.count must be a list of 1 to 20 wordings"),
    ({"phrasings": {"fact": ["When was the {c} guild founded?"]}}, "uses {c}: a fact question takes only {s}"),
    ({"phrasings": {"count": ["How many {s}s are there?"]}}, "must use {c} exactly once"),
    ({"phrasings": {"entity": ["Whose emblem is the {s} {s}?"]}}, "must use {s} exactly once"),
    ({"phrasings": {"colour": ["What colour is the {s.__class__}?"]}}, "uses {s.__class__}"),
    ({"phrasings": {"colour": ["What colour is the leftmost {s"]}}, "is not a valid template"),
    ({"phrasings": {"colour": ["Is there a red {s}?"]}}, "reads as a question of kind 'exists'; each wording must"),
    ({"phrasings": {"exists": ["Is there a {c} {s}?", "How many {c} {s}s are there?"]}},
     "phrasings.exists[1] = 'How many {c} {s}s are there?': 'How many red circles are there?' reads as a question of "
     "kind 'count'"),
    ({"phrasings": {"colour": ["What colour is the leftmost {s:d}?"]}}, "take no format spec or conversion"),
    ({"phrasings": {"colour": ["What colour is the leftmost {s!r}?"]}}, "take no format spec or conversion"),
    ({"phrasings": {"colour": ["What colour is the leftmost {s:{s}}?"]}}, "take no format spec or conversion"),
    ({"phrasings": {"colour": ["What colour is the\nleftmost {s}?"]}}, "one line of printable text"),
    ({"phrasings": {"colour": [f"What colour is the leftmost {{s}} number {k}?" for k in range(21)]}},
     "a list of 1 to 20 wordings"),
    ({"questions": {"count": 1e308, "exists": 1e308}}, "questions.count = 1e+308: must be a number from 0 to 1e+06"),
    ({"tools": {"guess_right_one_in": 0}}, "tools.guess_right_one_in = 0"),
    ({"tools": {"oracle": True}}, "tools: unknown key 'oracle'"),
    ({"planner": {}}, "unknown key 'planner'"),
    ({"tools": {"call_costs": [1]}}, "tools: call_costs must be a mapping"),
    ({"tools": {"call_costs": {"telescope": 1}}}, "tools.call_costs: key 'telescope' must be a tool"),
    ({"tools": {"call_costs": {"agent:": 1}}}, "key 'agent:' must be a tool (caption"),
    ({"tools": {"call_costs": {"agent:a b": 1}}}, "or agent:<name>"),
    ({"tools": {"call_costs": {"caption": -0.5}}}, "tools.call_costs.caption = -0.5: must be a number from 0 to 100"),
    ({"tools": {"call_costs": {"caption": 1e300}}}, "tools.call_costs.caption = 1e+300"),
    ({"tools": {"call_costs": {"caption": ".nan"}}}, "tools.call_costs.caption = '.nan'"),
    ("tools: {call_costs: {caption: .nan}}", "tools.call_costs.caption = nan: must be a finite number"),
    ("tools: {call_costs: {1: 1}}", "tools.call_costs: key 1 must be a tool"),
    ({"tools": {"call_costs": {"vqa": True}}}, "tools.call_costs.vqa = True"),
    ({"tools": {"requires": "caption"}}, "tools: requires must be a mapping"),
    ({"tools": {"requires": {"oracle": "caption"}}}, "tools.requires: key 'oracle' must be a tool"),
    ({"tools": {"requires": {"text_search": "text_search"}}}, "tools.requires.text_search = 'text_search': must be "
                                                               "another tool"),
    ({"tools": {"requires": {"text_search": ["caption"]}}}, "tools.requires.text_search = ['caption']"),
    ({"tools": {"requires": {"text_search": "caption", "caption": "select", "select": "text_search"}}},
     "tools.requires: a cycle (caption needs select needs text_search needs caption)"),
    ("[1, 2]", "must hold a mapping"),
])
def test_a_bad_world_file_is_refused_naming_the_file_and_key(tmp_path: Path, content, named: str) -> None:
    path = write_world(tmp_path, content)
    with pytest.raises(DataError) as caught:
        load_seeking_world(str(path))
    assert str(path) in str(caught.value) and named in str(caught.value), caught.value


def test_a_missing_world_names_the_shipped_ones() -> None:
    with pytest.raises(DataError, match="neither a file nor a shipped information-seeking world .*seeking"):
        load_seeking_world("no-such-world")


def test_question_mix_wordings_and_guessing_come_from_the_world(tmp_path: Path) -> None:
    world = world_from_dict({"questions": {"fact": 1, "count": 0}, "phrasings": {"fact": [FACT_PARAPHRASE]},
                             "tools": {"guess_right_one_in": 1}}, "mine")
    tasks = [make_seeking_task(i, world=world) for i in range(30)]
    assert {t.question_type for t in tasks} == {"fact"}
    assert all(t.question.startswith("When did the guild") for t in tasks)
    # a guesser right once in 1 questions is always right
    assert all(SeekingTools(t, world).vqa(t.question) == f"answer: {t.answer}" for t in tasks)
    # the offline LLM reads every wording; its cache key knows the world
    assert ScriptedSeekingLLM(world=world).identity() != ScriptedSeekingLLM().identity()
    assert ScriptedSeekingLLM().identity() == {"kind": "scripted-seeking", "context_examples": None}


def test_a_world_where_the_prompted_llm_misroutes_paraphrases(tmp_path: Path) -> None:
    """The fact question in its example's wording goes to the fact agent; in a wording unlike the examples, often to
    another (the agent whose example shares the shape's word). A config whose kinds the world never asks is refused."""
    path = write_world(tmp_path, {"questions": {"fact": 1}, "phrasings": {"fact": [TEMPLATES["fact"], FACT_PARAPHRASE]}})
    env = AgentDispatchEnv(AgentDispatchConfig(world=str(path), split="eval"))
    try:
        chosen = Counter()
        for seed in range(40):
            env.reset(seed=seed)
            wording = "paraphrase" if env.task.question.startswith("When") else "example's"
            chosen[wording, env.names[env.suggested_index()]] += 1
        assert env.describe()["world"]["phrasings"]["fact"][1] == FACT_PARAPHRASE
    finally:
        env.close()
    assert {agent for wording, agent in chosen if wording == "example's"} == {"fact"}, chosen
    misrouted = sum(n for (wording, agent), n in chosen.items() if wording == "paraphrase" and agent != "fact")
    assert misrouted >= 5, chosen
    problems = InformationSeekingConfig(world=str(path), kinds=["count"]).problems("avis")
    assert any("gives none of them a question weight above 0" in p for p in problems), problems


def test_a_paraphrased_world_is_harder_for_the_untrained_planner() -> None:
    accuracy = {}
    for world in ("seeking", "seeking-paraphrased"):
        env = InformationSeekingEnv(InformationSeekingConfig(world=world, split="eval"))
        right = 0
        try:
            for seed in range(60):
                env.reset(seed=seed)
                done, info = False, {}
                while not done:
                    _, _, terminated, truncated, info = env.step(env.suggested_index())
                    done = terminated or truncated
                right += bool(info.get("correct"))
        finally:
            env.close()
        accuracy[world] = right / 60
    assert accuracy["seeking"] == 1.0 and accuracy["seeking-paraphrased"] < 1.0, accuracy


def test_a_bad_world_is_one_line_from_the_cli(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"phrasings": {"fact": ["When?"]}})
    result = run_cli_captured(["controller", "fit", "--config", str(REPO / "configs/quickstart/controller_hammr.yaml"),
                                 f"--hammr.world={path}", f"--train.output_dir={tmp_path / 'run'}"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "hammr" in result.stderr and f"{path}: phrasings.fact[0] = 'When?': must use {{s}} exactly once" \
        in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_world_file_trains_from_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "questions": {"count": 1, "fact": 1},
                                "phrasings": {"fact": [TEMPLATES["fact"], FACT_PARAPHRASE]}}))
    run = tmp_path / "run"
    result = run_cli_subprocess([
        "controller", "fit", "--config", str(REPO / "configs/quickstart/controller_avis.yaml"), f"--avis.world={path}",
        f"--train.output_dir={run}", "--avis.cache_path=null", "--train.progress_bar=false",
        "--train.total_timesteps=400", "--train.eval_every=0", "--train.eval_episodes=10", "--train.n_envs=1",
        "--dqn.learning_starts=100", "--train.log_formats=[csv]"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "question rule fitted on logs (400 steps" in " ".join(json.loads((run / "evaluation.json").read_text()))
    assert json.loads((run / "config.json").read_text())["avis"]["world"] == str(path)


def _accuracy(env: InformationSeekingEnv, policy, episodes: int) -> tuple[float, float]:
    """(accuracy, mean return) of ``policy(obs, env)`` over ``episodes`` seeded episodes."""
    right, total = 0, 0.0
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        done, info = False, {}
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy(obs, env))
            total, done = total + reward, terminated or truncated
        right += bool(info.get("correct"))
    return right / episodes, total / episodes


def _oracle(env: InformationSeekingEnv):
    return next(p for name, p in env.reference_policies(0).items() if name.startswith("oracle"))


def test_a_tool_that_needs_another_result_first_and_costs_per_call() -> None:
    """text_search answers only once a caption is in memory; each call pays the world's cost; the scripted planner
    reads the output's "needs a caption result first" and calls the caption when the graph lets it."""
    world = world_from_dict({"questions": {"fact": 1}, "tools": {"requires": {"text_search": "caption"},
                                                                 "call_costs": {"caption": 1.5, "agent:web": 2}}}, "t")
    assert world.identity()["requires"] == {"text_search": "caption"} and world_from_dict(world.to_dict(), "x") == world
    assert world.with_prerequisites(("detect", "select", "image_search", "text_search"))[0] == "caption"
    env = InformationSeekingEnv(InformationSeekingConfig(split="eval", step_cost=0.5), world=world)
    try:
        env.reset(seed=3)
        for tool in ("detect", "select", "image_search", "text_search"):
            _, reward, terminated, _, info = env.step(env.graph.index(tool))
        assert not terminated and "needs a caption result first" in info["path"][-1]["output"]
        assert info["path"][-1]["result"] == "uninformative"
        env.reset(seed=3)
        _, reward, *_ = env.step(env.graph.index("caption"))
        assert reward == -0.5 - 1.5  # the step's cost and the caption's
        for tool in ("detect", "select", "image_search", "text_search"):
            _, reward, terminated, _, info = env.step(env.graph.index(tool))
        assert terminated and info["correct"] and reward == 10 - 0.5
        assert _accuracy(env, _oracle(env), 20)[0] == 1.0
    finally:
        env.close()
    memory = ["[uninformative] text_search -> text_search: no results (needs a caption result first)"]
    assert ScriptedSeekingLLM._missing_tool(["caption", "detect"], memory) == "caption"
    assert ScriptedSeekingLLM._missing_tool(["detect"], memory) == ""
    assert ScriptedSeekingLLM._missing_tool(["caption"], [*memory, "[uninformative] caption -> caption: x"]) == ""


def test_random_worlds_are_deterministic_and_load(tmp_path: Path) -> None:
    for seed in (0, 1, 1000, 2**40):
        drawn = random_seeking_world(seed)
        assert drawn == random_seeking_world(seed) and drawn != random_seeking_world(seed + 1)
        world = world_from_dict(drawn, f"random {seed}")  # every wording unambiguous, every value in bounds
        assert world.requires and all(world.phrasings[k][0] == TEMPLATES[k] for k in TEMPLATES)
        assert random_hydra_world(seed) == random_hydra_world(seed)
    assert load_seeking_world(str(write_random_world("seeking", 7, tmp_path / "s.yaml"))).name == "random-seeking-7"
    assert load_world(str(write_random_world("hydra", 7, tmp_path / "h.yaml"))).name == "random-7"


def test_on_a_drawn_world_with_delayed_payoff_the_greedy_one_step_rule_is_below_the_oracle() -> None:
    """A rule that knows each action's immediate reward (it tries every feasible one on a copy) and takes the best
    never pays for a call that earns nothing now, so it misses what that call enables."""
    drawn = random_seeking_world(1)
    drawn["questions"] = {"fact": 1}
    drawn["tools"]["requires"] = {"text_search": "caption"}
    drawn["tools"]["call_costs"] = {"caption": 1.0}
    env = InformationSeekingEnv(InformationSeekingConfig(split="eval"), world=world_from_dict(drawn, "drawn"))
    oracle = _oracle(env)

    def greedy(obs: np.ndarray, env: InformationSeekingEnv) -> int:
        options = [oracle(obs, env), *map(int, np.flatnonzero(env.action_masks()))]
        return max(options, key=lambda action: copy.deepcopy(env).step(action)[1])

    try:
        best, greedy_accuracy = _accuracy(env, oracle, 15)[0], _accuracy(env, greedy, 15)[0]
        planner = _accuracy(env, lambda obs, env: env.suggested_index(), 15)[0]
    finally:
        env.close()
    assert best == 1.0 and greedy_accuracy < 0.6 and planner < 1.0, (best, greedy_accuracy, planner)
