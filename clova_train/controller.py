"""Training and evaluating HYDRA's controller: stable-baselines3 DQN on the reasoning-loop environment.

Read top to bottom:

* :class:`DQNConfig`, :class:`TrainConfig`, :class:`ControllerConfig`: what ``controller fit`` reads from YAML
  (every field documented; ``--help`` shows them);
* :func:`fit`: n environments (``DummyVecEnv`` or ``SubprocVecEnv``), SB3 DQN with an MLP Q-network, logging
  (CSV / TensorBoard / stdout) of reward, accuracy, episode length, rejects and cache hit rate, evaluation on
  held-out tasks every ``eval_every`` steps, and atomic checkpoints (model with optimizer state + replay
  buffer) from which a rerun of the same command resumes at the saved step count and exploration rate;
* :func:`evaluate`: the trained controller against HYDRA without RL (the planner's top-probability sample)
  and a random choice, on the same held-out tasks, as a table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clova_train.atomic import write_json_atomic, write_text_atomic
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.errors import ClovaTrainError

CHECKPOINT = "last.zip"
REPLAY = "last_replay_buffer.pkl"
FINAL = "controller.zip"


@dataclass
class DQNConfig:
    """stable-baselines3 DQN settings (defaults: HYDRA supplementary B).

    Args:
        net_arch: hidden layer sizes of the Q-network (paper: [512], on a 1536-d observation).
        learning_rate: Adam learning rate (paper: 1e-4).
        batch_size: replay minibatch size (paper: 128).
        buffer_size: replay buffer capacity in transitions.
        learning_starts: transitions collected with random actions before learning (paper: 1000).
        gamma: discount factor.
        train_freq: environment steps (per environment) between gradient updates.
        gradient_steps: gradient updates each time.
        target_update_interval: environment steps between target-network copies.
        exploration_initial_eps: starting epsilon (paper: 0.2).
        exploration_final_eps: epsilon floor (the paper's schedule decays to 0; a floor keeps exploring).
        exploration_fraction: fraction of training over which epsilon decays linearly to the floor.
        max_grad_norm: gradient clipping.
        device: torch device (``auto`` picks CUDA when present).
    """

    net_arch: list[int] = field(default_factory=lambda: [512])
    learning_rate: float = 1e-4
    batch_size: int = 128
    buffer_size: int = 100_000
    learning_starts: int = 1000
    gamma: float = 0.99
    train_freq: int = 4
    gradient_steps: int = 1
    target_update_interval: int = 1000
    exploration_initial_eps: float = 0.2
    exploration_final_eps: float = 0.02
    exploration_fraction: float = 0.5
    max_grad_norm: float = 10.0
    device: str = "auto"


@dataclass
class TrainConfig:
    """How long and where to train.

    Args:
        total_timesteps: environment steps over all environments.
        n_envs: parallel environments.
        vec_env: ``dummy`` (one process) or ``subproc`` (one process per environment).
        seed: seed of the agent and the environments.
        output_dir: run directory: logs/, checkpoints/, controller.zip, evaluation.md.
        eval_every: environment steps between held-out evaluations (0: only at the end).
        eval_episodes: held-out tasks per evaluation.
        eval_seed: seed of the held-out task sequence.
        checkpoint_every: environment steps between checkpoints (model, optimizer, replay buffer).
        log_formats: SB3 logger outputs (``stdout``, ``csv``, ``tensorboard``, ``log``, ``json``).
        target_accuracy: evaluation accuracy whose first crossing is recorded (wall time and steps).
    """

    total_timesteps: int = 20_000
    n_envs: int = 4
    vec_env: Literal["dummy", "subproc"] = "dummy"
    seed: int = 0
    output_dir: str = "checkpoints/controller"
    eval_every: int = 5000
    eval_episodes: int = 200
    eval_seed: int = 10_000
    checkpoint_every: int = 5000
    log_formats: list[str] = field(default_factory=lambda: ["csv", "tensorboard"])
    target_accuracy: float = 0.0


@dataclass
class ControllerConfig:
    """A controller run: the environment, the DQN agent and the training loop.

    Args:
        env: the reasoning-loop environment.
        dqn: the DQN agent.
        train: the training loop.
    """

    env: ReasoningLoopConfig = field(default_factory=ReasoningLoopConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# ---------------------------------------------------------------------------------------------- environments
def make_env_fn(config: ReasoningLoopConfig, split: str | None = None) -> Callable[[], ReasoningLoopEnv]:
    env_config = config if split is None else replace(config, split=split)

    def build() -> ReasoningLoopEnv:
        return ReasoningLoopEnv(env_config)

    return build


def make_vec_env(config: ControllerConfig):
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    vec_cls = SubprocVecEnv if config.train.vec_env == "subproc" else DummyVecEnv
    return sb3_make_vec_env(make_env_fn(config.env, "train"), n_envs=config.train.n_envs, seed=config.train.seed,
                            vec_env_cls=vec_cls)


# ---------------------------------------------------------------------------------------------- evaluation
Policy = Callable[[np.ndarray, ReasoningLoopEnv], int]


def run_episodes(env: ReasoningLoopEnv, policy: Policy, episodes: int, seed: int) -> dict[str, float]:
    """Mean accuracy, steps, rejects and return of ``policy`` over held-out tasks ``seed .. seed+episodes-1``."""
    correct, steps, rejects, returns = [], [], [], []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        total, done, n, info = 0.0, False, 0, {}
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy(obs, env))
            total, n, done = total + reward, n + 1, terminated or truncated
        correct.append(float(info.get("correct", False)))
        steps.append(n)
        rejects.append(info.get("rejects", 0))
        returns.append(total)
    return {"accuracy": float(np.mean(correct)), "steps": float(np.mean(steps)),
            "rejects": float(np.mean(rejects)), "return": float(np.mean(returns)), "episodes": episodes}


def model_policy(model: Any) -> Policy:
    return lambda obs, env: int(model.predict(obs, deterministic=True)[0])


def planner_top_policy(obs: np.ndarray, env: ReasoningLoopEnv) -> int:
    """HYDRA without RL: the planner's highest-probability sample (never rejects)."""
    return int(np.argmax(env.planner_probabilities()))


def random_policy(seed: int) -> Policy:
    rng = np.random.default_rng(seed)
    return lambda obs, env: int(rng.integers(env.config.num_samples))


def evaluate(config: ControllerConfig, model: Any, episodes: int | None = None) -> dict[str, dict[str, float]]:
    """The controller, the planner's top sample and a random sample on the same held-out tasks."""
    episodes = episodes or config.train.eval_episodes
    env = make_env_fn(config.env, "eval")()
    try:
        return {
            "trained controller": run_episodes(env, model_policy(model), episodes, config.train.eval_seed),
            "planner top-probability (HYDRA without RL)": run_episodes(env, planner_top_policy, episodes,
                                                                        config.train.eval_seed),
            "random sample": run_episodes(env, random_policy(config.train.seed), episodes, config.train.eval_seed),
        }
    finally:
        env.close()


def format_table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| policy | accuracy | steps / episode | rejects / episode | return |", "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['accuracy']:.3f} | {r['steps']:.2f} | {r['rejects']:.2f} | {r['return']:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- callbacks
def _callbacks(config: ControllerConfig, run_dir: Path, started: float):
    from stable_baselines3.common.callbacks import BaseCallback

    class EpisodeStats(BaseCallback):
        """Logs accuracy, episode length, rejects and cache hit rate of finished training episodes."""

        def _on_step(self) -> bool:
            for done, info in zip(self.locals["dones"], self.locals["infos"]):
                if done:
                    self.logger.record_mean("rollout/accuracy", float(info.get("correct", False)))
                    self.logger.record_mean("rollout/episode_steps", info.get("iteration", 0))
                    self.logger.record_mean("rollout/rejects", info.get("rejects", 0))
                    if "cache_hit_rate" in info:
                        self.logger.record("rollout/cache_hit_rate", info["cache_hit_rate"])
            return True

    class EveryNSteps(BaseCallback):
        """Calls ``run()`` each time ``every`` more environment steps have passed (0: never)."""

        def __init__(self, every: int) -> None:
            super().__init__()
            self.every, self.last = every, 0

        def _on_step(self) -> bool:
            if self.every and self.num_timesteps - self.last >= self.every:
                self.last = self.num_timesteps
                self.run()
            return True

    class Checkpoint(EveryNSteps):
        """Model (with optimizer state and step count) and replay buffer, written atomically."""

        def run(self) -> None:
            save_checkpoint(self.model, run_dir / "checkpoints")

    class HeldOutEvaluation(EveryNSteps):
        """Accuracy on held-out tasks every ``eval_every`` steps; records when the target is first reached."""

        def run(self) -> dict[str, float]:
            env = make_env_fn(config.env, "eval")()
            try:
                result = run_episodes(env, model_policy(self.model), config.train.eval_episodes, config.train.eval_seed)
            finally:
                env.close()
            for key, value in result.items():
                self.logger.record(f"eval/{key}", value)
            self.logger.dump(self.num_timesteps)
            target = config.train.target_accuracy
            progress = run_dir / "target_reached.json"
            if target and result["accuracy"] >= target and not progress.exists():
                write_json_atomic(progress, {"target_accuracy": target, "accuracy": result["accuracy"],
                                             "timesteps": self.num_timesteps,
                                             "wall_seconds": time.perf_counter() - started})
            return result

    return EpisodeStats(), Checkpoint(config.train.checkpoint_every), HeldOutEvaluation(config.train.eval_every)


def save_checkpoint(model: Any, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_replay_buffer(directory / "last_replay_buffer.tmp.pkl")
    os.replace(directory / "last_replay_buffer.tmp.pkl", directory / REPLAY)
    model.save(directory / "last.tmp.zip")
    os.replace(directory / "last.tmp.zip", directory / CHECKPOINT)
    write_json_atomic(directory / "last.json", {"num_timesteps": int(model.num_timesteps),
                                                "exploration_rate": float(model.exploration_rate)})


# ---------------------------------------------------------------------------------------------- fit
def build_model(config: ControllerConfig, env: Any) -> Any:
    from stable_baselines3 import DQN

    d = config.dqn
    return DQN(
        "MlpPolicy", env, learning_rate=d.learning_rate, buffer_size=d.buffer_size, learning_starts=d.learning_starts,
        batch_size=d.batch_size, gamma=d.gamma, train_freq=d.train_freq, gradient_steps=d.gradient_steps,
        target_update_interval=d.target_update_interval, exploration_initial_eps=d.exploration_initial_eps,
        exploration_final_eps=d.exploration_final_eps, exploration_fraction=d.exploration_fraction,
        max_grad_norm=d.max_grad_norm, policy_kwargs={"net_arch": list(d.net_arch)}, seed=config.train.seed,
        device=d.device, verbose=0,
    )


def fit(config: ControllerConfig, extra_callbacks: list | None = None) -> tuple[Any, dict[str, dict[str, float]] | None]:
    """Train (or resume) the controller; returns the model and, if training finished, the evaluation table."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.logger import configure

    run_dir = Path(config.train.output_dir)
    checkpoints = run_dir / "checkpoints"
    started = time.perf_counter()
    env = make_vec_env(config)
    try:
        if (checkpoints / CHECKPOINT).exists():
            model = DQN.load(checkpoints / CHECKPOINT, env=env, device=config.dqn.device)
            if model.observation_space.shape != env.observation_space.shape:
                raise ClovaTrainError(f"checkpoint {checkpoints / CHECKPOINT} expects observations of shape "
                                      f"{model.observation_space.shape}, the configured environment gives "
                                      f"{env.observation_space.shape}")
            if (checkpoints / REPLAY).exists():
                model.load_replay_buffer(checkpoints / REPLAY)
            print(f"Resuming {checkpoints / CHECKPOINT} at step {model.num_timesteps} "
                  f"(exploration rate {model.exploration_rate:.4f})", flush=True)
        else:
            model = build_model(config, env)
        model.set_logger(configure(str(run_dir / "logs"), list(config.train.log_formats)))
        write_json_atomic(run_dir / "config.json", asdict(config))
        stats, checkpoint, held_out = _callbacks(config, run_dir, started)
        checkpoint.last = held_out.last = model.num_timesteps
        remaining = config.train.total_timesteps - model.num_timesteps
        if remaining > 0:
            try:
                model.learn(remaining, callback=[stats, checkpoint, held_out, *(extra_callbacks or [])],
                            reset_num_timesteps=False, log_interval=10)
            except (ClovaTrainError, KeyboardInterrupt):  # a failed backend or Ctrl-C: keep what was learned
                if model.num_timesteps > 0:
                    save_checkpoint(model, checkpoints)
                raise
        save_checkpoint(model, checkpoints)
        if model.num_timesteps < config.train.total_timesteps:
            return model, None  # stopped early by a callback
        model.save(run_dir / "controller.tmp.zip")
        os.replace(run_dir / "controller.tmp.zip", run_dir / FINAL)
        if config.train.target_accuracy:
            held_out.run()
    finally:
        env.close()
    results = evaluate(config, model)
    table = format_table(results)
    write_text_atomic(run_dir / "evaluation.md", f"# Held-out evaluation ({config.train.eval_episodes} tasks)\n\n"
                      f"{table}\n")
    write_json_atomic(run_dir / "evaluation.json", results)
    return model, results
