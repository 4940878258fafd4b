"""Worlds as data: the HYDRA reasoning world read from a file, every value checked, and what it changes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from clova_train.core.errors import DataError
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.common.world import make_task
from clova_train.envs.hydra.reasoning_world import ReasoningWorld, load_world, presets, world_from_dict
from clova_train.envs.hydra.scripted import GOOD, ScriptedReasoningLLM
from helpers.common import REPO, run_cli_captured, run_cli_subprocess


def write_world(tmp_path: Path, content: dict | str, name: str = "world.yaml") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_shipped_worlds_load_and_the_default_is_the_built_in_one() -> None:
    assert {"shapes", "shapes-replan"} <= set(presets())
    shapes = load_world("shapes")
    default = ReasoningWorld()
    assert (shapes.questions, shapes.confidence, shapes.has_good, shapes.good_rank, shapes.malformed,
            shapes.guess_right_one_in) == (default.questions, default.confidence, default.has_good,
                                           default.good_rank, default.malformed, default.guess_right_one_in)
    assert load_world("shapes-replan").has_good == (0.25, 1.0)
    assert "phrasings" not in shapes.identity() and "phrasings" not in shapes.as_dict()  # cache keys as before
    # the file form round-trips
    assert world_from_dict(shapes.as_dict(), "again").identity() == shapes.identity()


@pytest.mark.parametrize(("content", "named"), [
    ({"questions": {"count": 1, "weather": 1}}, "unknown key 'weather'"),
    ({"questions": {"count": 0}}, "at least one kind"),
    ({"questions": {"count": -1}}, "questions.count = -1"),
    ({"planner": {"confidence": [0.9, 0.2]}}, "planner.confidence"),
    ({"planner": {"has_good": [0.5, 1.5]}}, "planner.has_good[1] = 1.5"),
    ({"planner": {"has_good": []}}, "at least one probability"),
    ({"planner": {"good_rank": {"count": "top"}}}, "planner.good_rank.count = 'top'"),
    ({"planner": {"good_rank": {"compare-3": 0}}}, "unknown key 'compare-3'"),
    ({"planner": {"malformed": True}}, "planner.malformed = True"),
    ({"tools": {"guess_right_one_in": 0}}, "tools.guess_right_one_in = 0"),
    ({"rewards": {"reject_penalty": -1}}, "rewards.reject_penalty = -1"),
    ({"rewards": {"bonus": 1}}, "unknown key 'bonus'"),
    ('{"rewards": {"r1": ' + "9" * 4000 + "}}", "rewards.r1 = 9999999999"),  # more than a float holds
    ({"rewards": {"alpha": -(10**400)}}, "rewards.alpha = -10000000"),
    ({"questions": {"count": 10**4000 // 10}}, "questions.count = 1000000"),
    ({"questions": {"count": 10**308, "exists": 10**308}}, "questions.exists = 10000000000000000000... (309 digits)"),
    ({"planner": [1, 2]}, "planner must be a mapping"),
    ({"phrasings": {"weather": ["Is it raining?"]}}, "phrasings: unknown key 'weather'"),
    ({"phrasings": {"count": []}}, "phrasings.count must be a list of 1 to 20 wordings"),
    ({"phrasings": {"colour": ["What colour is the leftmost {c} {s}?"]}}, "uses {c}: a colour question takes only {s}"),
    ({"phrasings": {"compare": ["Are there more {c} {s}s than {c2}s?"]}}, "must use {s2} exactly once"),
    ({"phrasings": {"count": ["How many {c} {s}s are there?", "{c} {s}s: how many, {c}?"]}},
     "phrasings.count[1] = '{c} {s}s: how many, {c}?': must use {c} exactly once"),
    ({"phrasings": {"exists": ["Is there a {c} {s}?", "How many {c} {s}s are there?"]}},
     "phrasings.exists[1] = 'How many {c} {s}s are there?': 'How many red circles are there?' reads as a question of "
     "kind 'count'; each wording must read as its own kind only"),
    ({"phrasings": {"exists": ["Is there a {c:>4} {s}?"]}}, "take no format spec or conversion"),
    ("[1, 2]", "must hold a mapping"),
    ("name: a\nname: b\n", "name"),  # a key written twice (the safe reader refuses it)
])
def test_a_bad_world_file_is_refused_naming_the_file_and_key(tmp_path: Path, content, named: str) -> None:
    path = write_world(tmp_path, content)
    with pytest.raises(DataError, match=None) as caught:
        load_world(str(path))
    assert str(path) in str(caught.value) and named in str(caught.value), caught.value
    assert len(str(caught.value)) < len(str(path)) + 200  # a 4,000-digit value is shown cut


@pytest.mark.parametrize(("planner", "named"), [
    ({"good_rank": {"count": 5}}, "planner.good_rank.count = 5: must be a rank among the 5 samples (-5 to 4)"),
    ({"good_rank": {"exists": -6}}, "planner.good_rank.exists = -6"),
    ({"confidence": [0.30, 0.32]}, "holds 3 distinct 2-decimal values, fewer than the 5 samples"),
])
def test_a_world_that_cannot_hold_with_the_sample_count_is_refused(tmp_path: Path, planner: dict, named: str) -> None:
    path = write_world(tmp_path, {"planner": planner})
    problems = ReasoningLoopConfig(world=str(path), num_samples=5).problems("hydra")
    assert any(p.startswith(f"hydra.world: {path}: ") and named in p for p in problems), problems
    # with a sample count it fits (3 samples in 3 values; 7 samples hold ranks 5 and -6) it is fine
    assert not ReasoningLoopConfig(world=str(path), num_samples=3 if "confidence" in planner else 7).problems("hydra")


def test_a_missing_world_names_the_shipped_ones() -> None:
    with pytest.raises(DataError, match="neither a file nor a shipped world .*shapes"):
        load_world("no-such-world")


def test_question_mix_and_tool_behaviour_come_from_the_world(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"questions": {"exists": 2, "colour": 1}, "tools": {"guess_right_one_in": 1}})
    env = ReasoningLoopEnv(ReasoningLoopConfig(world=str(path)))
    kinds = []
    try:
        for seed in range(60):
            env.reset(seed=seed)
            kinds.append(env.task.question_type)
            tools = env.tools_factory(env.task)
            assert tools.llm_query(None, env.task.question) == env.task.answer  # right every time (1 in 1)
    finally:
        env.close()
    assert set(kinds) == {"exists", "colour"} and kinds.count("exists") > kinds.count("colour")
    # the default mix is the built-in one: the same task for the same id
    assert make_task(123, ReasoningWorld().questions) == make_task(123)


def test_the_planner_follows_the_world_good_rank_and_re_plan_chances(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"planner": {"has_good": [0.0, 1.0], "good_rank": {"count": -1},
                                              "malformed": 0.0}})
    world = load_world(str(path))
    llm = ScriptedReasoningLLM(world)
    env = ReasoningLoopEnv(ReasoningLoopConfig(world=str(path), num_samples=5), llm=llm)
    first_lists, replanned = [], []
    try:
        for seed in range(80):
            env.reset(seed=seed)
            if env.task.question_type != "count":
                continue
            kinds = [llm.instruction_kind(text) for text, _ in env.samples]
            first_lists.append(GOOD in kinds)
            env.step(env.config.num_samples)  # re-plan
            probabilities = env.planner_probabilities()
            kinds = [llm.instruction_kind(text) for text, _ in env.samples]
            replanned.append(kinds[int(np.argmin(probabilities))] == GOOD)
    finally:
        env.close()
    assert first_lists and not any(first_lists)  # attempt 0: never a good sample
    assert all(replanned)  # attempt 1: always one, at the lowest probability


def test_rewards_come_from_the_world_unless_the_config_sets_them(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"rewards": {"r1": 50, "reject_penalty": 7}})
    config = ReasoningLoopConfig(world=str(path))
    assert (config.r1, config.alpha, config.error_penalty, config.reject_penalty) == (50.0, 100.0, 10.0, 7.0)
    assert ReasoningLoopConfig(world=str(path), reject_penalty=1.0).reject_penalty == 1.0
    assert ReasoningLoopConfig().reject_penalty == 0.0  # the shapes world: Eq. 3 as published


def test_each_environment_reads_its_world_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building an environment reads and checks its world file once: resolving the config's rewards, its checks and
    the environment share the parsed world (a HYDRA agent inside AVIS/HAMMR likewise)."""
    import clova_train.envs.common.world_file as world_file
    from clova_train.envs import (AgentDispatchConfig, AgentDispatchEnv, AgentSpec, InformationSeekingConfig,
                                  InformationSeekingEnv)

    reads: list[str] = []
    read_yaml = world_file.read_yaml

    def counting(path, *args, **kwargs):
        reads.append(Path(path).name)
        return read_yaml(path, *args, **kwargs)

    monkeypatch.setattr(world_file, "read_yaml", counting)
    hydra_world = write_world(tmp_path, {"name": "mine", "rewards": {"reject_penalty": 5}})
    config = ReasoningLoopConfig(world=str(hydra_world))  # the rewards left null: the world's are read
    assert not config.problems("hydra")
    env = ReasoningLoopEnv(config)
    env.close()
    assert config.reject_penalty == 5 and reads == ["world.yaml"]
    reads.clear()
    ReasoningLoopEnv({"world": str(hydra_world)}).close()  # a dict config, as gymnasium.make passes it
    assert reads == ["world.yaml"]
    reads.clear()
    InformationSeekingEnv(InformationSeekingConfig()).close()
    assert reads.count("seeking.yaml") == 1, reads
    reads.clear()
    hydra_agent = AgentSpec("counter", "counts with programs", environment="hydra", hydra_env={"world": str(hydra_world)})
    dispatcher = AgentDispatchEnv(AgentDispatchConfig(agents=[hydra_agent]))
    dispatcher.agents.prepare_all()  # builds the agent's HYDRA environment
    dispatcher.close()
    assert (reads.count("seeking.yaml"), reads.count("world.yaml")) == (1, 1), reads


def test_the_world_is_part_of_the_llm_cache_key_and_the_export_description(tmp_path: Path) -> None:
    other = write_world(tmp_path, {"planner": {"has_good": [0.5]}})
    assert ScriptedReasoningLLM(load_world("shapes")).identity() != ScriptedReasoningLLM(load_world(str(other))).identity()
    env = ReasoningLoopEnv(ReasoningLoopConfig(world=str(other)))
    try:
        assert env.describe()["world"]["planner"]["has_good"] == [0.5]
    finally:
        env.close()


def test_a_bad_world_is_one_line_from_the_cli(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"planner": {"has_good": 2}})
    result = run_cli_captured(["controller", "fit", "--config", str(REPO / "configs/quickstart/controller_dqn.yaml"),
                                 f"--hydra.world={path}", f"--train.output_dir={tmp_path / 'run'}"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"hydra.world: {path}: planner.has_good[0] = 2" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_world_file_trains_from_the_cli(tmp_path: Path) -> None:
    """Anyone's world runs through the same command: a short fit on a JSON world, evaluated with every control."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "questions": {"count": 1, "exists": 1},
                                "planner": {"good_rank": {"count": 2, "exists": "random"}}}))
    run = tmp_path / "run"
    result = run_cli_subprocess([
        "controller", "fit", "--config", str(REPO / "configs/quickstart/controller_dqn.yaml"), f"--hydra.world={path}",
        f"--train.output_dir={run}", "--hydra.cache_path=null", "--train.progress_bar=false",
        "--train.total_timesteps=600", "--train.eval_every=0", "--train.eval_episodes=20",
        "--dqn.learning_starts=200", "--train.log_formats=[csv]"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert any(name.startswith("question rule fitted on logs (600 steps") for name in evaluation)
    assert json.loads((run / "config.json").read_text())["hydra"]["world"] == str(path)


def test_a_world_can_hold_a_wording_out_for_test_tasks_only() -> None:
    """``shapes-paraphrased``: three wordings per kind, the last asked only in test tasks; a task differs from the
    default world's only in its question text, and the planner reads every wording as the canonical one."""
    from clova_train.envs.common.world import QUESTION_TEMPLATES, task_split

    world = load_world("shapes-paraphrased")
    assert all(len(w) == 3 and w[0] == QUESTION_TEMPLATES[k] for k, w in world.phrasings.items())
    assert world_from_dict(world.as_dict(), "again").identity() == world.identity()
    llm = ScriptedReasoningLLM(world)
    held_out_by_split = {"train": 0, "val": 0, "test": 0}
    for task_id in range(0, 3000, 3):
        task, plain = make_task(task_id, world.questions, world.phrasings), make_task(task_id)
        assert (task.objects, task.question_type, task.answer, task.groups) == \
            (plain.objects, plain.question_type, plain.answer, plain.groups)
        kind, groups = world.parse_question(task.question)
        assert kind == task.question_type and world.parse_question(plain.question) == (kind, groups)
        held_out_by_split[task_split(task_id)] += task.question == world.phrasings[kind][-1].format(**groups)
        if task_id % 30 == 0:  # the planner lists instructions for the question's groups, not a blind guess
            reply = llm.chat([{"role": "user", "content": f"Question: {task.question}\nSamples wanted: 5"}])
            assert len(reply.splitlines()) >= 4  # (a question it cannot read gets one line: a blind guess)
            assert groups["s"] in reply or kind == "compare"
    assert held_out_by_split["train"] == held_out_by_split["val"] == 0 < held_out_by_split["test"]


def test_a_world_with_two_wordings_holds_none_out(tmp_path: Path) -> None:
    path = write_world(tmp_path, {"phrasings": {"exists": ["Is there a {c} {s}?", "Does the picture show a {c} {s}?"]}})
    world = load_world(str(path))
    asked = {make_task(i, world.questions, world.phrasings).question.split(" ")[0] for i in range(400)
             if make_task(i).question_type == "exists"}
    assert asked == {"Is", "Does"}  # both wordings in every split


def test_the_evaluation_reports_the_accuracy_on_held_out_wordings() -> None:
    from clova_train.controller.evaluation import format_table, planner_top_policy, run_episodes

    results = {}
    for split in ("train", "test"):
        env = ReasoningLoopEnv(ReasoningLoopConfig(world="shapes-paraphrased", split=split))
        try:
            results[split] = run_episodes(env, planner_top_policy, 30, seed=0)
        finally:
            env.close()
    assert "held_out_wording_accuracy" not in results["train"]  # training tasks never get the held-out wording
    test = results["test"]
    assert 0 < test["held_out_wording_episodes"] < 30 and 0 <= test["held_out_wording_accuracy"] <= 1
    table = format_table({"planner top-probability": {**test, "tasks": "test"}})
    assert "accuracy on held-out wordings" in table and f"({test['held_out_wording_episodes']} tasks)" in table
    env = ReasoningLoopEnv(ReasoningLoopConfig(split="test"))  # the default world: no wording held out
    try:
        assert "held_out_wording_accuracy" not in run_episodes(env, planner_top_policy, 5, seed=0)
    finally:
        env.close()
