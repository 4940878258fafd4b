"""AVIS and HAMMR options of the reasoning-loop family: checkers, vector envs, masks honoured by MaskablePPO and
the masked DQN, backtracking, nested agent calls with their depth limit and budget, graph files, the CLI."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import yaml

from clova_train.envs import (
    AVIS_ENV_ID, HAMMR_ENV_ID, AgentDispatchConfig, AgentDispatchEnv, AgentSpec, GraphError, InformationSeekingConfig,
    InformationSeekingEnv, load_graph,
)
from clova_train.envs.avis.world import make_seeking_task
from helpers.common import REPO, run_cli_captured, run_cli_subprocess

HAMMR_QUICKSTART = REPO / "configs/quickstart/controller_hammr.yaml"


def hammr_config(**overrides) -> AgentDispatchConfig:
    raw = yaml.safe_load(HAMMR_QUICKSTART.read_text())["hammr"]
    raw.update(overrides)
    return AgentDispatchConfig(**{**raw, "agents": [AgentSpec(**a) for a in raw["agents"]]})


def task_of_kind(kind: str, start: int = 0) -> int:
    return next(i for i in range(start, start + 10_000) if make_seeking_task(i).question_type == kind)


def step_named(env: InformationSeekingEnv, name: str):
    return env.step(env.graph.index(name))


# ------------------------------------------------------------------------------------------ checkers, vector envs
@pytest.mark.parametrize("env_id", [AVIS_ENV_ID, HAMMR_ENV_ID])
def test_environments_pass_gymnasium_and_sb3_checkers(env_id: str) -> None:
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = gymnasium.make(env_id)  # the defaults: the Figure 3 graph; the quickstart's agents
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker's warning is a failure, not a line in the log
            check_env(env.unwrapped, skip_render_check=True)
            sb3_check_env(env.unwrapped)
    finally:
        env.close()


def test_the_default_agents_are_the_quickstart_ones() -> None:
    from dataclasses import asdict

    assert [asdict(a) for a in AgentDispatchConfig().agents] == [asdict(a) for a in hammr_config().agents]


def _avis() -> InformationSeekingEnv:
    return InformationSeekingEnv(InformationSeekingConfig())


def _hammr() -> AgentDispatchEnv:
    return AgentDispatchEnv(hammr_config())


@pytest.mark.parametrize("factory", [_avis, _hammr], ids=["avis", "hammr"])
def test_environments_run_under_sync_dummy_and_subproc_vector_envs(factory) -> None:
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    sync = gymnasium.vector.SyncVectorEnv([factory, factory])
    obs, infos = sync.reset(seed=0)
    assert obs.shape[0] == 2 and infos["action_mask"].shape[0] == 2
    for _ in range(3):
        masks = infos["action_mask"]
        obs, _, _, _, infos = sync.step(np.array([int(np.flatnonzero(m)[0]) for m in masks]))
    sync.close()
    for vec_cls in (DummyVecEnv, SubprocVecEnv):
        vec = vec_cls([factory, factory])
        obs = vec.reset()
        for _ in range(3):
            masks = np.stack(vec.env_method("action_masks"))
            assert np.array_equal(masks.astype(np.float32), obs[:, -masks.shape[1]:])  # the mask is the obs tail
            obs, _, _, _ = vec.step(np.array([int(np.flatnonzero(m)[0]) for m in masks]))
        vec.close()


# ------------------------------------------------------------------------------------------ masks
class RecordFeasibility(gymnasium.Wrapper):
    """Records, for every action taken, whether the mask allowed it."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self.taken: list[bool] = []

    def action_masks(self) -> np.ndarray:
        return self.env.unwrapped.action_masks()

    def step(self, action):
        self.taken.append(bool(self.env.unwrapped.action_masks()[int(action)]))
        return self.env.step(action)


@pytest.mark.parametrize("factory", [_avis, _hammr], ids=["avis", "hammr"])
def test_maskable_ppo_trains_unchanged_and_never_takes_a_masked_action(factory) -> None:
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.maskable.utils import get_action_masks

    env = RecordFeasibility(factory())
    model = MaskablePPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=2, seed=0, device="cpu")
    model.learn(256)
    assert len(env.taken) >= 256 and all(env.taken)
    obs, _ = env.reset(seed=1)
    action, _ = model.predict(obs, action_masks=get_action_masks(env), deterministic=True)
    assert env.action_masks()[int(action)]


def _dqn(env, mask_size: int, seed: int = 0):
    from clova_train.controller.selection import ControllerDQN

    return ControllerDQN("MlpPolicy", env, learning_starts=200, batch_size=32, train_freq=1, target_update_interval=100,
                    exploration_initial_eps=1.0, exploration_final_eps=0.2, exploration_fraction=0.5, seed=seed,
                    policy_kwargs={"net_arch": [32]}, device="cpu", mask_size=mask_size)


def test_masked_dqn_never_takes_a_masked_action_while_the_unmasked_one_does() -> None:
    masked_env, unmasked_env = RecordFeasibility(_avis()), RecordFeasibility(_avis())
    n = masked_env.action_space.n
    masked = _dqn(masked_env, n)
    masked.learn(600)  # warm-up (random), exploration and greedy steps
    assert len(masked_env.taken) >= 600 and all(masked_env.taken)
    unmasked = _dqn(unmasked_env, 0)
    unmasked.learn(600)
    assert not all(unmasked_env.taken)  # the control: without the mask the same agent does take them
    # greedy: whatever the Q-values say, an infeasible action is never the argmax
    obs = np.stack([masked_env.observation_space.sample() for _ in range(64)])
    obs[:, -n:] = np.random.default_rng(0).integers(0, 2, size=(64, n))
    obs[:, -n] = np.where(obs[:, -n:].sum(1) == 0, 1.0, obs[:, -n])
    actions = masked.predict(obs, deterministic=True)[0]
    assert all(obs[i, -n + a] == 1.0 for i, a in enumerate(actions))


def test_masked_dqn_bootstraps_from_feasible_actions_only() -> None:
    import torch

    from clova_train.envs.common.selection import MASKED_Q

    env = _avis()
    n = env.action_space.n
    model = _dqn(env, n)
    obs = torch.zeros(2, env.observation_space.shape[0])
    obs[0, -n:] = torch.tensor([1.0] + [0.0] * (n - 1))
    obs[1, -n:] = 1.0
    target = model.q_net_target(obs)
    assert torch.all(target[0, 1:] == MASKED_Q) and target[0, 0] != MASKED_Q
    assert torch.all(target[1] != MASKED_Q)
    assert torch.all(model.q_net(obs) != MASKED_Q)  # the online network is not masked: only selection is


# ------------------------------------------------------------------------------------------ AVIS loop
def test_an_infeasible_action_is_a_penalty_and_changes_nothing() -> None:
    env = _avis()
    obs, info = env.reset(options={"task_id": task_of_kind("fact")})
    assert not info["action_mask"][env.graph.index("text_search")]
    obs2, reward, terminated, truncated, info = step_named(env, "text_search")
    assert reward == -(env.config.step_cost + env.config.infeasible_penalty)
    assert info["infeasible"] and info["state"] == "START" and not env.memory.entries
    assert not (terminated or truncated) and info["path"][-1]["result"] == "infeasible"
    assert np.array_equal(obs2[-env.action_space.n:], obs[-env.action_space.n:])


def test_an_uninformative_result_backtracks_and_excludes_that_action_there() -> None:
    env = _avis()
    env.reset(options={"task_id": task_of_kind("colour")})
    _, _, _, _, info = step_named(env, "caption")  # a caption never says enough
    assert info["state"] == "START" and not info["action_mask"][env.graph.index("caption")]
    assert info["path"][-1] == {**info["path"][-1], "result": "uninformative", "backtrack_to": "START"}
    step_named(env, "detect")
    _, _, _, _, info = step_named(env, "select")
    assert info["state"] == "select"
    _, _, _, _, info = step_named(env, "image_search")  # a guild is no answer to a colour question
    assert info["state"] == "select" and info["path"][-1]["backtrack_to"] == "select"
    assert not info["action_mask"][env.graph.index("image_search")] and info["action_mask"][env.graph.index("classify")]
    _, _, terminated, _, info = step_named(env, "classify")
    assert terminated and info["correct"] and info["answer"] == env.task.answer
    assert [e["action"] for e in info["path"]] == ["caption", "detect", "select", "image_search", "classify"]
    assert "[uninformative] caption" in env.memory.text()


def test_a_dead_end_backs_up_the_search_and_an_exhausted_start_truncates() -> None:
    env = InformationSeekingEnv(InformationSeekingConfig(tools=["detect"]))  # a counter's tools on a colour question
    env.reset(options={"task_id": task_of_kind("colour")})
    _, _, terminated, truncated, info = step_named(env, "detect")
    assert info["path"][-1]["result"] == "informative" and info["path"][-1]["dead_ends"] == ["detect"]
    assert info["state"] == "START" and not info["action_mask"].any()
    assert truncated and not terminated and info["answer"] is None


def test_the_trained_policy_is_not_needed_for_the_good_path_oracle() -> None:
    env = _avis()
    oracle = env.reference_policies(0)["oracle (the good path of the question's kind; a ceiling)"]
    for task_id in range(0, 100, 5):
        obs, _ = env.reset(options={"task_id": task_id})
        done = False
        while not done:
            obs, _, terminated, truncated, info = env.step(oracle(obs, env))
            done = terminated or truncated
        assert info["correct"], (env.task.question, info["path"])


def _own_choice_accuracy(env, name: str, tasks: range) -> float:
    policy = env.reference_policies(0)[name]
    correct = []
    for task_id in tasks:
        obs, _ = env.reset(options={"task_id": task_id})
        done, info = False, {}
        while not done:
            obs, _, terminated, truncated, info = env.step(policy(obs, env))
            done = terminated or truncated
        correct.append(info["correct"])
    return float(np.mean(correct))


def test_the_untrained_planner_reads_every_example_and_the_cut_off_is_an_explicit_ablation() -> None:
    """The papers' untrained baselines see all their in-context examples; ``context_examples: 2`` (the planner reads
    only its last two) handicaps them, and a learner's gain over that measures the handicap."""
    own = "planner's own choice (AVIS without a trained controller)"
    full = InformationSeekingEnv(InformationSeekingConfig(split="eval"))
    cut = InformationSeekingEnv(InformationSeekingConfig(split="eval", context_examples=2))
    assert full.config.context_examples is None
    assert _own_choice_accuracy(full, own, range(0, 200, 5)) == 1.0
    assert _own_choice_accuracy(cut, own, range(0, 200, 5)) < 0.9


# ------------------------------------------------------------------------------------------ HAMMR
def test_the_prompted_dispatcher_sees_each_agent_description_and_example_questions() -> None:
    env = _hammr()
    env.reset(options={"task_id": task_of_kind("fact")})
    prompt = env.dispatcher.prompt(env.task.question, env.memory)
    assert "- entity: Knows which guild an emblem belongs to. Examples: Which guild has the leftmost" in prompt
    # routed by the most alike example: every kind reaches its specialist at the first call
    for kind in ("count", "exists", "colour", "entity", "fact"):
        env.reset(options={"task_id": task_of_kind(kind)})
        assert env.names[env.suggested_index()] == {"count": "counter", "exists": "existence"}.get(kind, kind)


def test_the_dispatcher_calls_a_specialist_that_calls_another_agent() -> None:
    env = _hammr()
    env.reset(options={"task_id": task_of_kind("fact")})
    _, reward, terminated, _, info = env.step(env.names.index("fact"))
    assert terminated and info["correct"]
    assert [(c["agent"], c["depth"], c["ok"]) for c in info["nested_calls"]] == [("fact", 1, True), ("entity", 2, True)]
    assert info["max_depth_reached"] == 2 and info["costs"]["llm_calls"] > 0


def test_a_specialist_failure_is_an_observation_for_its_caller() -> None:
    env = _hammr()
    obs, _ = env.reset(options={"task_id": task_of_kind("colour")})
    obs2, _, terminated, truncated, info = env.step(env.names.index("entity"))  # no colour tool
    assert not (terminated or truncated) and not info["action_mask"][env.names.index("entity")]
    assert info["nested_calls"][0]["ok"] is False and "failed:" in env.memory.text()
    assert not np.array_equal(obs, obs2)
    _, _, terminated, _, info = env.step(env.names.index("colour"))
    assert terminated and info["correct"]


def test_a_nested_call_past_the_depth_limit_is_stopped_and_reported() -> None:
    env = _hammr()
    env.config.max_depth = 1  # the fact agent's own call to entity would be depth 2
    env.reset(options={"task_id": task_of_kind("fact")})
    _, _, terminated, truncated, info = env.step(env.names.index("fact"))
    calls = info["nested_calls"]
    assert calls[1] == {**calls[1], "agent": "entity", "depth": 2, "ok": False, "reason": "stopped: depth limit 1 reached"}
    assert calls[0]["ok"] is False and info["max_depth_reached"] == 1 and not terminated


def test_a_self_calling_agent_stops_at_the_depth_limit(tmp_path: Path) -> None:
    graph = tmp_path / "loop.yaml"
    graph.write_text(yaml.safe_dump({"start": "START", "actions": ["agent:echo", "vqa"], "answers": ["vqa"],
                                     "states": {"START": ["agent:echo", "vqa"], "agent:echo": ["vqa"], "vqa": []}}))
    echo = AgentSpec("echo", "calls itself", graph=str(graph), policy="scripted", path=["agent:echo", "vqa"])
    env = AgentDispatchEnv(AgentDispatchConfig(agents=[echo], max_depth=3))
    env.reset(options={"task_id": task_of_kind("exists")})
    _, _, _, _, info = env.step(0)
    depths = [(c["depth"], c["ok"], c["reason"]) for c in info["nested_calls"]]
    assert (4, False, "stopped: depth limit 3 reached") in depths and info["max_depth_reached"] == 3
    assert info["correct"]  # the deepest agent fell back to VQA, which answers existence questions


def test_the_llm_call_budget_covers_nested_calls_and_stops_them() -> None:
    env = AgentDispatchEnv(hammr_config(max_llm_calls=4))
    env.reset(options={"task_id": task_of_kind("fact")})
    _, _, terminated, truncated, info = env.step(env.names.index("fact"))
    assert truncated and not terminated and "budget of 4 LLM calls" in info["stopped"]
    assert env.llm.budget.llm_calls == 4
    assert any("budget" in c["reason"] for c in info["nested_calls"])


def test_the_call_cache_records_nested_calls_and_replays_them(tmp_path: Path) -> None:
    cache = str(tmp_path / "calls.sqlite")
    recorded = AgentDispatchEnv(hammr_config(cache_path=cache, cache_mode="record"))
    answers = []
    for task_id in (task_of_kind("fact"), task_of_kind("colour")):
        recorded.reset(options={"task_id": task_id})
        answers.append(recorded.step(recorded.names.index("fact"))[4]["nested_calls"])
    assert recorded.cache.stats.backend_calls > 0
    recorded.close()
    replayed = AgentDispatchEnv(hammr_config(cache_path=cache, cache_mode="replay"))
    for task_id, expected in zip((task_of_kind("fact"), task_of_kind("colour")), answers):
        replayed.reset(options={"task_id": task_id})
        assert replayed.step(replayed.names.index("fact"))[4]["nested_calls"] == expected
    assert replayed.cache.stats.backend_calls == 0  # every call, nested ones included, came from the cache
    replayed.close()


# ------------------------------------------------------------------------------------------ graph files
@pytest.mark.parametrize("change, message", [
    ({"states": {"START": ["detect"], "detect": [], "elsewhere": []}}, "unknown state 'elsewhere'"),
    ({"states": {"START": ["detect", "select"], "detect": []}}, "edge START -> select leads nowhere"),
    ({"states": {"START": ["detect", "zoom"], "detect": []}}, "edge START -> zoom: 'zoom' is not an action"),
    ({"answers": ["select"], "states": {"START": ["detect"], "detect": []}}, "no path from START reaches an answer"),
    ({"answers": ["teleport"]}, "answer action 'teleport' is not in actions"),
    ({"states": {"detect": []}}, "no entry for the start state 'START'"),
])
def test_a_bad_graph_file_is_rejected_naming_the_fault(tmp_path: Path, change: dict, message: str) -> None:
    raw = {"name": "bad", "start": "START", "actions": ["detect", "select"], "answers": ["detect"],
           "states": {"START": ["detect"], "detect": ["select"], "select": []}}
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump({**raw, **change}))
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        load_graph(str(path))
    assert str(path) in str(caught.value)


def test_graph_presets_load_and_unreadable_files_are_named(tmp_path: Path) -> None:
    graph = load_graph("avis")
    assert graph.feasible("START") == ("caption", "vqa", "detect") and "text_search" in graph.answers
    with pytest.raises(GraphError, match="neither a file nor a preset"):
        load_graph(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(GraphError, match="broken.json: cannot be read"):
        load_graph(str(broken))
    with pytest.raises(ValueError, match="'zoom' is neither a tool"):
        spec = tmp_path / "zoom.yaml"
        spec.write_text(yaml.safe_dump({"actions": ["zoom"], "answers": ["zoom"], "states": {"START": ["zoom"], "zoom": []}}))
        InformationSeekingEnv(InformationSeekingConfig(graph=str(spec)))


# ------------------------------------------------------------------------------------------ CLI
@pytest.mark.slow
def test_controller_cli_fits_avis_exports_and_the_export_serves_as_an_agent(tmp_path: Path) -> None:
    from stable_baselines3 import DQN

    run = tmp_path / "avis"
    config = str(REPO / "configs/quickstart/controller_avis.yaml")
    common = [f"--train.output_dir={run}", "--train.progress_bar=false"]
    result = run_cli_subprocess(["controller", "fit", "--config", config, *common, "--train.total_timesteps=3000",
                                 "--train.control_steps=300",  # the controls are not what this test reads
                                 "--train.eval_every=0", "--train.eval_episodes=60", "--train.log_formats=[csv]"],
                                timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((run / "evaluation.json").read_text())
    # the planner reading all its examples is already right on this world (docs/controllers.md, AVIS): the controller learns to
    # match it, and never picks an action the graph forbids
    ours = results["trained controller"]
    assert ours["accuracy"] >= 0.9 and ours["rejects"] == 0.0, results
    assert results["planner's own choice (AVIS without a trained controller)"]["accuracy"] >= 0.95, results
    result = run_cli_subprocess(["controller", "export", "--config", config, *common, f"--output={tmp_path / 'export'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    description = json.loads((tmp_path / "export" / "controller.json").read_text())
    assert description["environment"] == "avis" and "feasible" in description["q_network"]["action"]
    assert DQN.load(tmp_path / "export" / "controller.zip", device="cpu").action_space.n == 7  # plain SB3 loads it
    # HAMMR: the exported controller is an agent another agent calls
    agent = AgentSpec("seeker", "answers anything", policy="controller", controller=str(tmp_path / "export/controller.zip"))
    env = AgentDispatchEnv(AgentDispatchConfig(agents=[agent]))
    correct = 0
    for task_id in range(0, 100, 5):
        env.reset(options={"task_id": task_id})
        correct += env.step(0)[4]["correct"]
    assert correct >= 17


def test_bad_avis_and_hammr_configs_get_one_message_each(tmp_path: Path) -> None:
    """Refused before any work, in this process (the CLI's own exit code and stderr; a fresh interpreter per case only
    repeated the imports)."""
    config = str(REPO / "configs/quickstart/controller_avis.yaml")
    out = [f"--train.output_dir={tmp_path / 'run'}"]
    for extra, message in (
        (["--avis.graph", str(tmp_path / "nope.yaml")], "nope.yaml' is neither a file nor a preset"),
        (["--avis.kinds=[count,weather]"], "avis.kinds"),
        (["--avis.tools=[detect,zoom]"], "tool 'zoom' is not an action"),
        (["--dqn.action_selection=eq2"], "only the hydra environment"),
    ):
        result = run_cli_captured(["controller", "fit", "--config", config, *out, *extra])
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
    hammr = yaml.safe_load(HAMMR_QUICKSTART.read_text())
    hammr["hammr"]["agents"][1]["name"] = "counter"
    hammr["hammr"]["agents"][2].update(policy="controller", controller=str(tmp_path / "missing.zip"))
    bad = tmp_path / "hammr.yaml"
    bad.write_text(yaml.safe_dump(hammr))
    result = run_cli_captured(["controller", "fit", "--config", str(bad), *out])
    assert result.returncode == 2 and "the name 'counter' is used twice" in result.stderr, result.stderr


def test_an_agent_controller_of_another_environment_is_refused_naming_it(tmp_path: Path) -> None:
    from stable_baselines3 import DQN

    from clova_train.controller.trainer import ControllerConfig, validate
    from clova_train.core.errors import ClovaTrainError

    zip_path = tmp_path / "hydra.zip"
    DQN("MlpPolicy", gymnasium.make("CartPole-v1"), device="cpu").save(zip_path)
    agent = AgentSpec("seeker", "answers anything", policy="controller", controller=str(zip_path))
    with pytest.raises(ClovaTrainError, match=r"agent seeker: controller .*hydra.zip takes observations \(4,\)"):
        validate(ControllerConfig(environment="hammr", hammr=AgentDispatchConfig(agents=[agent])))
    with pytest.raises(ClovaTrainError, match="agent name 'two words'"):
        validate(ControllerConfig(environment="hammr", hammr=AgentDispatchConfig(agents=[AgentSpec("two words")])))


def test_a_nested_hydra_agent_runs_its_programs_in_the_sandbox() -> None:
    hydra = AgentSpec("counter", "counts with programs", environment="hydra", max_iterations=5)
    env = AgentDispatchEnv(AgentDispatchConfig(agents=[hydra]))
    statuses, answered = set(), 0
    for task_id in range(0, 400, 5):
        if make_seeking_task(task_id).question_type not in ("count", "exists", "colour"):
            continue
        env.reset(options={"task_id": task_id})
        _, _, terminated, _, info = env.step(0)
        call = info["nested_calls"][0]
        statuses |= {step["status"] for step in call["path"]}
        answered += terminated
    env.close()
    assert "ok" in statuses and statuses - {"ok"}  # failing programs (a tool the API lacks) ended in the sandbox
    assert answered > 0
