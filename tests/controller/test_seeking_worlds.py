"""Worlds as data for AVIS and HAMMR: the information-seeking world read from a file, checked, and what it changes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from clova_train.core.errors import DataError
from clova_train.envs.avis.information_seeking import InformationSeekingConfig, InformationSeekingEnv
from clova_train.envs.avis.scripted import ScriptedSeekingLLM
from clova_train.envs.avis.seeking_world import (
    TEMPLATES, SeekingWorld, load_seeking_world, presets, world_from_dict,
)
from clova_train.envs.avis.world import SeekingTools, make_seeking_task
from clova_train.envs.hammr.dispatch import AgentDispatchConfig, AgentDispatchEnv
from helpers.common import REPO, run_cli_captured, run_cli_subprocess

FACT_PARAPHRASE = "When did the guild whose emblem is the leftmost {s} start?"


def write_world(tmp_path: Path, content: dict | str) -> Path:
    path = tmp_path / "world.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_shipped_worlds_load_and_the_default_is_the_built_in_one() -> None:
    assert {"seeking", "seeking-paraphrased"} <= set(presets())
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
