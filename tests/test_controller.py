"""DQN controller: resume from checkpoint, the quickstart from the CLI (beats HYDRA without RL), export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from clova_train.controller import ControllerConfig, DQNConfig, TrainConfig, fit
from clova_train.envs import ReasoningLoopConfig
from conftest import REPO, run_cli_subprocess


def small_config(run_dir: Path) -> ControllerConfig:
    return ControllerConfig(
        env=ReasoningLoopConfig(),
        dqn=DQNConfig(net_arch=[32], learning_rate=1e-3, batch_size=16, learning_starts=100, train_freq=1,
                      target_update_interval=100, exploration_initial_eps=1.0, exploration_final_eps=0.1,
                      exploration_fraction=0.8, device="cpu"),
        train=TrainConfig(total_timesteps=800, n_envs=2, output_dir=str(run_dir), eval_every=0, eval_episodes=5,
                          checkpoint_every=200, log_formats=["csv"]),
    )


def test_resumed_run_continues_from_its_step_count_and_exploration_rate(tmp_path: Path, capsys) -> None:
    from stable_baselines3.common.callbacks import BaseCallback

    class Trace(BaseCallback):
        def __init__(self, stop_at: int | None = None) -> None:
            super().__init__()
            self.stop_at, self.rates = stop_at, {}

        def _on_step(self) -> bool:
            self.rates[self.num_timesteps] = self.model.exploration_rate
            return self.stop_at is None or self.num_timesteps < self.stop_at

    reference_trace = Trace()
    reference, _ = fit(small_config(tmp_path / "reference"), [reference_trace])

    interrupted, results = fit(small_config(tmp_path / "run"), [Trace(stop_at=400)])
    assert results is None and interrupted.num_timesteps == 400
    saved = json.loads((tmp_path / "run" / "checkpoints" / "last.json").read_text())
    assert saved == {"num_timesteps": 400, "exploration_rate": pytest.approx(reference_trace.rates[400])}

    resumed_trace = Trace()
    resumed, results = fit(small_config(tmp_path / "run"), [resumed_trace])
    assert "at step 400" in capsys.readouterr().out
    assert resumed.num_timesteps == reference.num_timesteps == 800 and results is not None
    first = min(resumed_trace.rates)
    assert first == 402 and resumed_trace.rates[first] == pytest.approx(saved["exploration_rate"])
    for step in range(404, 801, 2):  # from the first update after loading, the schedule is the reference one
        assert resumed_trace.rates[step] == pytest.approx(reference_trace.rates[step]), step
    assert resumed.exploration_rate == pytest.approx(reference.exploration_rate)
    # the replay buffer and the update count came back: only the step the stop callback cut short (SB3 stops
    # before storing its transition and training on it) is missing
    assert resumed.replay_buffer.size() == reference.replay_buffer.size() - 1
    assert resumed._n_updates == reference._n_updates - 1


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("controller-quickstart")
    result = run_cli_subprocess([
        "controller", "fit", "--config", str(REPO / "configs/quickstart/controller_dqn.yaml"),
        f"--train.output_dir={run_dir}", f"--env.cache_path={run_dir / 'cache.sqlite'}",
        "--train.log_formats=[csv,tensorboard]",
    ], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| trained controller |" in result.stdout
    return run_dir


def test_quickstart_beats_the_planner_top_sample(quickstart_run: Path) -> None:
    results = json.loads((quickstart_run / "evaluation.json").read_text())
    ours, top = results["trained controller"], results["planner top-probability (HYDRA without RL)"]
    assert ours["accuracy"] >= top["accuracy"] + 0.10, results
    assert ours["steps"] <= top["steps"], results
    progress = (quickstart_run / "logs" / "progress.csv").read_text()
    for column in ("rollout/accuracy", "rollout/episode_steps", "rollout/rejects", "rollout/cache_hit_rate",
                   "rollout/ep_rew_mean", "eval/accuracy"):
        assert column in progress
    assert list((quickstart_run / "logs").glob("events.out.tfevents.*"))


def test_export_writes_zip_torchscript_and_description(quickstart_run: Path, tmp_path: Path) -> None:
    from stable_baselines3 import DQN

    config = str(REPO / "configs/quickstart/controller_dqn.yaml")
    result = run_cli_subprocess(["controller", "export", "--config", config, f"--train.output_dir={quickstart_run}",
                                 f"--output={tmp_path / 'export'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    description = json.loads((tmp_path / "export" / "controller.json").read_text())
    assert description["num_samples"] == 5 and description["actions"]["5"] == "reject all samples and re-plan"
    assert description["embedder"] == {"kind": "hashing", "dim": 64} and "Samples:" in description["observation_template"]
    q_network = torch.jit.load(str(tmp_path / "export" / "q_network.pt"))
    model = DQN.load(tmp_path / "export" / "controller.zip", device="cpu")
    obs = torch.rand(16, description["observation_dim"]) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(q_network(obs), model.q_net(obs))
    np.testing.assert_array_equal(q_network(obs).argmax(1).numpy(), model.predict(obs.numpy(), deterministic=True)[0])

    evaluation = run_cli_subprocess(["controller", "evaluate", "--config", config,
                                     f"--train.output_dir={quickstart_run}", "--episodes=20"])
    assert evaluation.returncode == 0 and "| random sample |" in evaluation.stdout

    mismatch = run_cli_subprocess(["controller", "export", "--config", config, "--env.embedder.dim=32",
                                   f"--train.output_dir={quickstart_run}", f"--output={tmp_path / 'bad'}"])
    assert mismatch.returncode == 2 and "takes observations of shape (389,)" in mismatch.stderr


def test_a_failing_backend_stops_training_with_a_checkpoint_to_resume_from(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from clova_train.backends import BackendError
    from clova_train.envs.scripted import ScriptedReasoningLLM

    original, calls = ScriptedReasoningLLM.chat, []

    def failing_after_300(self, messages):
        calls.append(1)
        if len(calls) > 300:
            raise BackendError("http://llm.example/v1 failed after 4 attempts; last error: HTTP 503")
        return original(self, messages)

    monkeypatch.setattr(ScriptedReasoningLLM, "chat", failing_after_300)
    with pytest.raises(BackendError, match="HTTP 503"):
        fit(small_config(tmp_path))
    saved = json.loads((tmp_path / "checkpoints" / "last.json").read_text())
    assert saved["num_timesteps"] > 0 and (tmp_path / "checkpoints" / "last_replay_buffer.pkl").is_file()

    monkeypatch.setattr(ScriptedReasoningLLM, "chat", original)
    resumed, results = fit(small_config(tmp_path))
    assert resumed.num_timesteps == 800 and results is not None
