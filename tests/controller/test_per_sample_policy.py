"""``dqn.q_network: per_sample``: the Q-network that scores each HYDRA instruction sample with shared weights
(clova_train.controller.per_sample_policy): equivariance, the plain SB3 round trip, the export, the config check and
a tiny ``controller fit``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from clova_train.controller.per_sample_policy import PerSampleDQNPolicy, per_sample_layout
from clova_train.controller.trainer import ControllerConfig, DQNConfig, TrainConfig, build_model, fit, validate
from clova_train.core.errors import ClovaTrainError
from clova_train.envs import InformationSeekingConfig, ReasoningLoopConfig, make_env

N, DIM = 3, 8  # a small layout: 3 samples of 8-d hashing embeddings


def small_config(run_dir: Path, **dqn: object) -> ControllerConfig:
    hydra = ReasoningLoopConfig(num_samples=N, embedder={"kind": "hashing", "dim": DIM})
    return ControllerConfig(
        hydra=hydra,
        dqn=DQNConfig(q_network="per_sample", net_arch=[16], learning_rate=1e-3, batch_size=16, learning_starts=30,
                      train_freq=1, target_update_interval=20, exploration_initial_eps=1.0, device="cpu", **dqn),
        train=TrainConfig(total_timesteps=50, n_envs=1, output_dir=str(run_dir), eval_every=0, eval_episodes=2,
                          checkpoint_every=0, log_formats=["csv"], progress_bar=False, control_steps=0),
    )


@pytest.fixture(scope="module")
def env_and_model():
    config = small_config(Path("unused"))
    env = make_env(replace(config.hydra, cache_path=None))
    model = build_model(config, env)
    yield config, env, model
    env.close()


def observations(env, count: int = 6) -> np.ndarray:
    """Real observations from a few random steps."""
    rng = np.random.default_rng(0)
    found = []
    obs, _ = env.reset(options={"task_id": 0})
    while len(found) < count:
        found.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(N + 1)))
        if terminated or truncated:
            obs, _ = env.reset(options={"task_id": len(found)})
    return np.stack(found)


def permuted(batch: np.ndarray, order: list[int]) -> np.ndarray:
    """The observations with their N samples (embedding and probability) in ``order``."""
    out = batch.copy()
    for slot, source in enumerate(order):
        out[:, DIM * (slot + 1):DIM * (slot + 2)] = batch[:, DIM * (source + 1):DIM * (source + 2)]
        out[:, DIM * (N + 1) + slot] = batch[:, DIM * (N + 1) + source]
    return out


def test_layout_comes_from_describe_and_permuting_samples_permutes_q_values(env_and_model) -> None:
    _, env, model = env_and_model
    assert per_sample_layout(env.describe()) == (N, DIM)
    assert isinstance(model.policy, PerSampleDQNPolicy) and model.q_net.num_samples == N
    batch = observations(env)
    batch[1, DIM * (N + 1):] = [0.5, 0.5, 0.2]  # tied probabilities share a rank
    order = [2, 0, 1]
    with torch.no_grad():
        q = model.q_net(torch.from_numpy(batch))
        q_permuted = model.q_net(torch.from_numpy(permuted(batch, order)))
    torch.testing.assert_close(q_permuted[:, :N], q[:, order], atol=1e-6, rtol=0)
    torch.testing.assert_close(q_permuted[:, N], q[:, N], atol=1e-6, rtol=0)
    assert not torch.allclose(q[:, 0], q[:, 1])  # the slots are scored from their own sample


def test_plain_dqn_load_round_trip_and_export_serves_the_same_actions(env_and_model, tmp_path: Path) -> None:
    from stable_baselines3 import DQN

    from clova_train.export.controller import export_controller

    config, env, model = env_and_model
    model.save(tmp_path / "controller.zip")
    loaded = DQN.load(tmp_path / "controller.zip", device="cpu")  # plain SB3, the class importable
    assert isinstance(loaded.policy, PerSampleDQNPolicy)
    batch = observations(env)
    with torch.no_grad():
        torch.testing.assert_close(loaded.q_net(torch.from_numpy(batch)), model.q_net(torch.from_numpy(batch)))
    export_controller(tmp_path / "controller.zip", tmp_path / "export", config)
    description = json.loads((tmp_path / "export" / "controller.json").read_text())
    assert description["q_network"]["architecture"] == "per_sample"
    assert "per_sample" in (tmp_path / "export" / "README.md").read_text()
    served = torch.jit.load(str(tmp_path / "export" / "q_network.pt"))(torch.from_numpy(batch))
    sb3_actions = model.predict(batch, deterministic=True)[0]
    np.testing.assert_array_equal(served.argmax(1).numpy(), sb3_actions)
    with torch.no_grad():
        torch.testing.assert_close(served, model.q_net(torch.from_numpy(batch)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config, fragment", [
    (ControllerConfig(environment="avis", avis=InformationSeekingConfig(), dqn=DQNConfig(q_network="per_sample")),
     "dqn.q_network = 'per_sample': scores HYDRA's instruction samples one by one, so it needs environment: hydra"),
    (ControllerConfig(hydra=ReasoningLoopConfig(layout="joint"), dqn=DQNConfig(q_network="per_sample")),
     "dqn.q_network = 'per_sample': needs hydra.layout: per_part"),
    (ControllerConfig(dqn=DQNConfig(q_network="transformer")), "dqn.q_network = 'transformer'"),
])
def test_config_refuses_a_per_sample_network_it_cannot_feed(config: ControllerConfig, fragment: str) -> None:
    with pytest.raises(ClovaTrainError) as caught:
        validate(config)
    assert fragment in str(caught.value)
    assert str(caught.value).count("dqn.q_network =") == 1  # one message, naming the field


def test_per_sample_layout_refuses_other_observations() -> None:
    joint = {"environment": "hydra", "num_samples": 2, "observation_parts": {"text": [0, 8], "probabilities": [8, 10]}}
    with pytest.raises(ValueError, match=r"gives \['text', 'probabilities'\]"):
        per_sample_layout(joint)
    gap = {"environment": "hydra", "num_samples": 1,
           "observation_parts": {"context": [0, 4], "sample_1": [4, 9], "probabilities": [9, 10]}}
    with pytest.raises(ValueError, match="'sample_1' spans"):
        per_sample_layout(gap)


@pytest.mark.learning  # a whole ``controller fit`` (env steps, held-out comparison): 3-10 s on 2 shared cores
def test_controller_fit_trains_with_the_per_sample_network(tmp_path: Path) -> None:
    model, results = fit(small_config(tmp_path / "run"))
    assert isinstance(model.policy, PerSampleDQNPolicy) and model.num_timesteps == 50
    assert results is not None and "trained controller" in results
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dqn"]["q_network"] == "per_sample"


def test_a_run_resumes_only_with_the_network_it_was_trained_with(env_and_model, tmp_path: Path) -> None:
    _, _, model = env_and_model
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    model.save(checkpoints / "controller_10_steps.zip")
    (checkpoints / "latest.json").write_text(json.dumps({"num_timesteps": 10, "exploration_rate": 0.5,
                                                         "model": "controller_10_steps.zip", "replay_buffer": None}))
    config = small_config(tmp_path / "run")
    config = replace(config, dqn=replace(config.dqn, q_network="mlp"))
    with pytest.raises(ClovaTrainError, match="has a per_sample Q-network, the config asks for dqn.q_network = mlp"):
        fit(config)


def test_a_zip_whose_layout_does_not_fit_its_spaces_is_one_clear_error(env_and_model, tmp_path: Path) -> None:
    import zipfile

    from clova_train.controller.trainer import load_controller

    config, _, model = env_and_model
    model.save(tmp_path / "controller.zip")
    with zipfile.ZipFile(tmp_path / "controller.zip") as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    data = json.loads(entries["data"])
    data["policy_kwargs"]["embedding_dim"] = DIM - 1  # edited by someone: the network no longer fits the observation
    entries["data"] = json.dumps(data).encode()
    with zipfile.ZipFile(tmp_path / "edited.zip", "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    with pytest.raises(ClovaTrainError, match=r"edited.zip cannot be loaded: a per-sample Q-network over 3 samples"):
        load_controller(tmp_path / "edited.zip", config)
