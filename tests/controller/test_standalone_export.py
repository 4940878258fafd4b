"""A controller export used as a plain-SB3 user would: no clova-train importable, the observation rebuilt from the
planner's raw output with the export's own ``observation.py``, and the action taken from its networks."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from clova_train.controller.trainer import ControllerConfig, DQNConfig, TrainConfig, build_model
from clova_train.envs import AgentDispatchConfig, InformationSeekingConfig, ReasoningLoopConfig, make_env
from clova_train.export.controller import export_controller
from helpers.standalone import run_without_package

CONFIGS = {
    "hydra-per-part": ControllerConfig(environment="hydra", hydra=ReasoningLoopConfig()),
    "hydra-joint": ControllerConfig(environment="hydra", hydra=ReasoningLoopConfig(layout="joint")),
    "hydra-joint-probabilities": ControllerConfig(
        environment="hydra", hydra=ReasoningLoopConfig(layout="joint", probability_features=True),
        dqn=DQNConfig(action_selection="eq2")),
    "avis": ControllerConfig(environment="avis", avis=InformationSeekingConfig()),
    "hammr": ControllerConfig(environment="hammr", hammr=AgentDispatchConfig()),
}


def raw_inputs(env, environment: str) -> dict:
    """What a serving stack has in hand at this step, before any embedding."""
    if environment == "hydra":
        return {"question": env.task.question, "iteration": env.iteration + 1, "memory": list(env.memory.entries),
                "samples": [list(sample) for sample in env.samples]}
    mask = env.action_masks()
    lines = [entry.line() for entry in env.memory.entries]
    if environment == "avis":
        actions = list(env.graph.actions)
        return {"question": env.task.question, "memory": lines, "state": env.state,
                "excluded": list(env.excluded.get(env.state, ())), "suggested": env.suggestion[0],
                "feasible": [a for a, ok in zip(actions, mask) if ok]}
    return {"question": env.task.question, "memory": lines, "called": sorted(env.called), "choice": env.choice,
            "feasible": [a for a, ok in zip(env.names, mask) if ok]}


def test_the_standalone_memory_and_sample_readers_are_the_environments() -> None:
    """Past the memory windows (HYDRA 6, AVIS/HAMMR 8 entries) and a short, messy planner reply."""
    from clova_train.core import observation_builder as observation
    from clova_train.envs.avis.parts import MemoryEntry, WorkingMemory
    from clova_train.envs.hydra.parts import MemoryBank, parse_samples

    bank, memory = MemoryBank(), WorkingMemory()
    for i in range(12):
        bank.add(f"Step {i}: line\nwith a newline")
        memory.add(MemoryEntry(f"tool{i}", "q", observation.tool_output_line("out  " * 200), "informative"))
    assert observation.memory_text(bank.entries) == bank.text()
    lines = [observation.agent_memory_line("informative", f"tool{i}", observation.tool_output_line("out  " * 200))
             for i in range(12)]
    assert observation.memory_text(lines, last=observation.AGENT_MEMORY_LINES_SHOWN) == memory.text()
    reply = "1. [0.9] find the cup\n\n(p=1.7) " + "x" * 900 + "\n```"
    assert observation.parse_samples(reply, 5) == parse_samples(reply, 5)
    assert len(parse_samples(reply, 5)) == 5 and parse_samples(reply, 5)[1][1] == 1.0


STANDALONE = """
import json, sys
import numpy as np, torch
from stable_baselines3 import DQN
sys.path.insert(0, "export")
import observation
description = json.load(open("export/controller.json"))
steps = json.load(open("steps.json"))
embed = observation.embedder_from_description(description["embedder"])
rebuilt = []
for raw in steps:
    if description["environment"] == "hydra":
        parts = observation.hydra_parts(description, raw["question"], raw["iteration"], raw["memory"],
                                        [tuple(s) for s in raw["samples"]])
    elif description["environment"] == "avis":
        actions = [description["actions"][str(i)] for i in range(len(description["actions"]))]
        parts = {"question": raw["question"], "memory": observation.memory_text(raw["memory"], last=8),
                 "state": observation.one_hot(description["states"], raw["state"]),
                 "excluded": observation.one_hot(actions, raw["excluded"]),
                 "suggested": observation.one_hot(actions, raw["suggested"]),
                 "action_mask": observation.one_hot(actions, raw["feasible"])}
    else:
        agents = description["agent_names"]
        parts = {"question": raw["question"], "memory": observation.memory_text(raw["memory"], last=8),
                 "called": observation.one_hot(agents, raw["called"]),
                 "llm_choice": observation.one_hot(agents, raw["choice"]),
                 "action_mask": observation.one_hot(agents, raw["feasible"])}
    rebuilt.append(observation.build_observation(description, parts, embed))
x = torch.from_numpy(np.stack(rebuilt))
q_script = torch.jit.load("export/q_network.pt")(x)
model = DQN.load("export/controller.zip", device="cpu")
with torch.no_grad():
    q_sb3 = model.q_net(x)
print(json.dumps({"observations": x.tolist(), "q_script": q_script.tolist(), "q_sb3": q_sb3.tolist(),
                  "predicted": model.predict(x.numpy(), deterministic=True)[0].tolist()}))
"""


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_builds_observations_and_actions_without_clova_train(name: str, tmp_path: Path) -> None:
    config = replace(CONFIGS[name], train=TrainConfig(output_dir=str(tmp_path / "run"), n_envs=1, progress_bar=False),
                     dqn=replace(CONFIGS[name].dqn, net_arch=[16], device="cpu"))
    env = make_env(replace(config.env_config(), cache_path=None))
    model = build_model(config, env)
    model.save(tmp_path / "controller.zip")
    export_controller(tmp_path / "controller.zip", tmp_path / "export", config)

    steps, observations = [], []
    rng = np.random.default_rng(0)
    for task_id in (0, 7, 23):  # whole episodes (up to 12 steps: past the memory windows where they last so long)
        obs, _ = env.reset(options={"task_id": task_id})
        for _ in range(12):
            steps.append(raw_inputs(env, config.environment))
            observations.append(obs)
            mask = env.action_masks() if hasattr(env, "action_masks") else np.ones(env.action_space.n, bool)
            obs, _, terminated, truncated, _ = env.step(int(rng.choice(np.flatnonzero(mask))))
            if terminated or truncated:
                break
    env.close()
    (tmp_path / "steps.json").write_text(json.dumps(steps))

    got = run_without_package(STANDALONE, cwd=tmp_path)
    np.testing.assert_allclose(np.asarray(got["observations"]), np.stack(observations), atol=1e-6)
    np.testing.assert_allclose(got["q_script"], got["q_sb3"], atol=1e-5)
    assert got["predicted"] == np.asarray(got["q_sb3"]).argmax(1).tolist()
    card = (tmp_path / "export" / "README.md").read_text()
    assert "observation.build_observation" in card and "Action rule" in card
    if config.environment == "hydra":  # the card's example reply reads as its table says, with the exported reader
        example = card.split("The planner's reply")[1].split("```text\n")[1].split("```")[0]
        table = card.split("is read as:")[1].split("| --- | --- | --- |\n")[1].split("\n\n")[0]
        rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in table.splitlines()]
        assert [int(index) for index, _, _ in rows] == list(range(len(rows))) and len(rows) >= 4, rows
        spec = importlib.util.spec_from_file_location("exported_observation", tmp_path / "export" / "observation.py")
        exported = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(exported)  # the export's own copy of the reader
        assert exported.parse_samples(example, len(rows)) == [(text, float(p)) for _, text, p in rows]
        assert exported.parse_samples_report(example, len(rows)).notes == []
