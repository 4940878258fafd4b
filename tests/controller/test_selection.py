"""A trained controller picks the same actions wherever it runs: alone (ControllerDQN) and as a HAMMR agent's policy,
by the greedy rule it was trained with (read from its zip)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clova_train.envs import AgentDispatchConfig, AgentDispatchEnv, AgentSpec, ReasoningLoopConfig, ReasoningLoopEnv


def eq2_controller(path: Path):
    """An Eq. 2 controller of the default HYDRA environment, saved to ``path`` (its weights are its seed's: what
    matters here is the rule the zip keeps)."""
    from clova_train.controller.selection import ControllerDQN

    env = ReasoningLoopEnv(ReasoningLoopConfig())
    try:
        model = ControllerDQN("MlpPolicy", env, action_selection="eq2", num_samples=env.config.num_samples, seed=0,
                         policy_kwargs={"net_arch": [32]}, device="cpu")
    finally:
        env.close()
    model.save(path)
    return model


def test_a_hammr_agent_runs_an_eq2_controller_by_eq2(tmp_path: Path) -> None:
    model = eq2_controller(tmp_path / "eq2.zip")
    agent = AgentSpec("counter", "counts with programs", environment="hydra", policy="controller",
                      controller=str(tmp_path / "eq2.zip"))
    dispatcher = AgentDispatchEnv(AgentDispatchConfig(agents=[agent]))
    try:
        env, policy = dispatcher.agents.resolve("counter")
        observations = np.stack([env.reset(seed=seed)[0] for seed in range(24)])
        inside = [policy(obs, env) for obs in observations]
    finally:
        dispatcher.close()
    alone = model.predict(observations, deterministic=True)[0]
    assert inside == alone.tolist()
    # not vacuous: argmax Q (what an agent ran before it read the rule) picks otherwise on some of them
    assert (model.greedy_actions(observations, "argmax_q") != alone).any()


def test_an_eq2_controller_is_refused_where_the_observation_has_no_planner_probabilities(tmp_path: Path) -> None:
    eq2_controller(tmp_path / "eq2.zip")
    # a joint embedding of the per-part observation's size: the shapes agree, but no probabilities end it
    env = ReasoningLoopEnv(ReasoningLoopConfig())
    per_part_dim = env.observation_space.shape[0]
    env.close()
    agent = AgentSpec("counter", "counts with programs", environment="hydra", policy="controller",
                      controller=str(tmp_path / "eq2.zip"),
                      hydra_env={"layout": "joint", "embedder": {"dim": per_part_dim}})
    problems = AgentDispatchConfig(agents=[agent]).problems("hammr")
    assert any("agent counter: controller" in p and "selects by HYDRA Eq. 2 over 5 planner probabilities" in p
               and "ends with none" in p for p in problems), problems


@pytest.mark.parametrize("rule", ["argmax_q", "eq2"])
def test_the_dqn_and_the_shared_rule_agree(rule: str, tmp_path: Path) -> None:
    import torch

    from clova_train.envs.common.selection import select_actions

    model = eq2_controller(tmp_path / "eq2.zip")
    observations = np.random.default_rng(0).uniform(0, 1, size=(32, model.observation_space.shape[0]))
    observations = observations.astype(np.float32)
    tensor = torch.as_tensor(observations)
    expected = select_actions(model.q_net(tensor), tensor, rule, 5).numpy()
    assert np.array_equal(model.greedy_actions(observations, rule), expected)
