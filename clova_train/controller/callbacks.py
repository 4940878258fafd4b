"""stable-baselines3 callbacks and logger outputs of a controller run, made safe to kill and to rerun.

* :class:`HeldOutEvalCallback` is SB3's ``EvalCallback`` on the run's validation tasks (``val``: held out of training,
  never reported), measured by accuracy: it writes ``evaluations.npz`` (``timesteps``, ``results``, ``ep_lengths``,
  ``successes``, as SB3 does, plus ``accuracy``) and ``best_model.zip`` (highest validation accuracy, ties by mean
  return), logs the rules without training and the fitted controls on the same tasks next to it, continues the
  arrays of an earlier run when resumed, and measures the final table on the test tasks (:meth:`test_table`).
* :class:`AtomicCheckpointCallback` is SB3's ``CheckpointCallback`` (``controller_<steps>_steps.zip`` and the
  replay buffer) with every file written through :mod:`clova_train.core.atomic`, a ``latest.json`` naming the newest
  complete checkpoint, and older checkpoints pruned.
* :class:`EpisodeStats` logs the accuracy, length, rejects and cache hit rate of finished training episodes.
* :class:`AppendingCSVOutputFormat` is SB3's CSV log continued, not truncated, when a run resumes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback, EvalCallback
from stable_baselines3.common.logger import CSVOutputFormat, KVWriter, Logger, make_output_format
from stable_baselines3.common.vec_env import DummyVecEnv

from clova_train.core.atomic import write_atomic, write_json_atomic
from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json_object
from clova_train.controller.evaluation import (
    TEST, VALIDATION, Policy, baselines, compare, fit_controls, make_env_fn, model_policy, play_controls, run_episodes,
    short_name,
)
from clova_train.controller.fitted_controls import MLP_HIDDEN
from clova_train.envs import EnvConfig
from clova_train.envs.common.episode import episode_score

LATEST = "latest.json"
BEST_MODEL = "best_model.zip"
EVALUATIONS = "evaluations.npz"


def _save_npz(path: Path, **arrays: Any) -> None:
    with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to the temporary name
        np.savez(file, **arrays)


class AppendingCSVOutputFormat(CSVOutputFormat):
    """SB3's ``progress.csv``, reopened and continued when it exists (SB3 opens it with ``w+``)."""

    def __init__(self, filename: str) -> None:
        path = Path(filename)
        existing = path.exists() and path.stat().st_size > 0
        if existing and not path.read_bytes().endswith(b"\n"):  # a row cut short by a kill
            with path.open("ab") as file:
                file.write(b"\n")
        self.file = open(filename, "r+" if existing else "w+")  # noqa: SIM115 (closed by close())
        self.keys: list[str] = []
        self.separator, self.quotechar = ",", '"'
        if existing:
            header = self.file.readline().rstrip("\n")
            self.keys = header.split(self.separator) if header else []
            self.file.seek(0, os.SEEK_END)


def make_logger(folder: Path, formats: list[str]) -> Logger:
    folder.mkdir(parents=True, exist_ok=True)
    outputs: list[KVWriter] = [AppendingCSVOutputFormat(str(folder / "progress.csv")) if name == "csv"
                               else make_output_format(name, str(folder)) for name in formats]
    return Logger(str(folder), outputs)


class EpisodeStats(BaseCallback):
    """Logs accuracy, episode length, rejects and cache hit rate of finished training episodes."""

    def _on_step(self) -> bool:
        for done, info in zip(self.locals["dones"], self.locals["infos"]):
            if done:
                self.logger.record_mean("rollout/accuracy", episode_score(info))
                self.logger.record_mean("rollout/episode_steps", info.get("iteration", 0))
                self.logger.record_mean("rollout/rejects", info.get("rejects", 0))
                if "cache_hit_rate" in info:
                    self.logger.record("rollout/cache_hit_rate", info["cache_hit_rate"])
        return True


class ProgressLines(BaseCallback):
    """SB3's progress bar for output that is not a terminal: a line every 30 seconds with the environment steps done,
    the time spent and the time left (``train.progress_bar`` on, stderr a log file)."""

    def __init__(self, remaining: int) -> None:
        super().__init__()
        self.remaining, self.reported = remaining, 0

    def _on_training_start(self) -> None:
        from clova_train.core.progress import LoggedProgress

        self.bar = LoggedProgress(self.remaining, "controller fit", "steps")
        self.start = self.model.num_timesteps

    def _on_step(self) -> bool:
        done = self.model.num_timesteps - self.start
        self.bar.update(done - self.reported)
        self.reported = done
        return True


class AtomicCheckpointCallback(CheckpointCallback):
    """Checkpoints every ``save_freq`` calls (one call = one step of every environment), written atomically.

    Args:
        save_freq: calls between checkpoints.
        save_path: checkpoint directory.
        keep: newest model checkpoints kept (older ones are deleted once a newer one is complete); only the newest
            replay buffer is kept, since each is as large as the buffer's filled part.
        replay_buffer: also save the replay buffer's filled part (plain arrays, ``.npz``) with each checkpoint.
    """

    def __init__(self, save_freq: int, save_path: str, keep: int = 2, replay_buffer: bool = False) -> None:
        super().__init__(save_freq, save_path, name_prefix="controller", save_replay_buffer=replay_buffer)
        self.keep = keep

    def _on_step(self) -> bool:
        if self.save_freq > 0 and self.n_calls % self.save_freq == 0:
            self.save()
        return True

    def save(self) -> None:
        os.makedirs(self.save_path, exist_ok=True)
        from clova_train.sb3.files import save_replay_arrays

        model = Path(self._checkpoint_path(extension="zip"))
        replay = Path(self._checkpoint_path("replay_buffer_", extension="npz")) if self.save_replay_buffer else None
        if replay is not None:
            def write(temporary: Path) -> None:
                with open(temporary, "wb") as handle:
                    save_replay_arrays(self.model, handle)

            write_atomic(replay, write)
        write_atomic(model, self.model.save)
        write_json_atomic(Path(self.save_path) / LATEST, {
            "num_timesteps": int(self.model.num_timesteps), "exploration_rate": float(self.model.exploration_rate),
            "model": model.name, "replay_buffer": replay.name if replay is not None else None})
        self._prune()

    def _prune(self) -> None:
        def steps(path: Path) -> int:
            return int(path.stem.rsplit("_", 2)[-2])

        folder = Path(self.save_path)
        for old in sorted(folder.glob("controller_*_steps.zip"), key=steps)[:-self.keep]:
            old.unlink(missing_ok=True)
        buffers = [*folder.glob("controller_replay_buffer_*_steps.npz"), *folder.glob("controller_replay_buffer_*_steps.pkl")]
        keep = 1 if self.save_replay_buffer else 0  # a run that stops saving them drops the old ones
        for old in sorted(buffers, key=steps)[: len(buffers) - keep]:
            old.unlink(missing_ok=True)


def latest_checkpoint(directory: Path) -> tuple[Path, Path | None, dict[str, Any]] | None:
    """The newest complete checkpoint named by ``latest.json``: model, replay buffer (``None`` when not saved), and
    the record."""
    record_path = directory / LATEST
    if not record_path.is_file():
        return None
    record = read_json_object(record_path, "checkpoint record")
    model, replay = record.get("model"), record.get("replay_buffer")
    if not all(isinstance(n, str) and n and Path(n).name == n for n in [model, *([replay] if replay is not None else [])]):
        raise DataError(f"checkpoint record {record_path} must name its model (and any replay buffer) file in {directory}")
    return directory / model, directory / replay if replay is not None else None, record


class HeldOutEvalCallback(EvalCallback):
    """SB3's ``EvalCallback`` on the validation tasks with accuracy as its metric and baselines beside it.

    Args:
        env_config: the environment of the run (played on its ``val`` tasks here, on its ``test`` tasks by
            :meth:`test_table`).
        run_dir: where ``evaluations.npz``, ``best_model.zip`` and ``target_reached.json`` go.
        eval_freq: calls (one step of every environment) between evaluations; 0: only when asked.
        episodes: validation (and test) tasks per evaluation.
        seed: first task seed (the same tasks every time).
        random_seed: seed of the random-choice baseline.
        target_accuracy: accuracy whose first crossing is recorded with wall time and steps (0: none).
        started: ``time.perf_counter()`` at the start of the run.
        control_steps: logged steps of training tasks for the fitted controls (0: none).
        hidden: the MLP control's hidden layers.
    """

    def __init__(self, env_config: EnvConfig, run_dir: Path, eval_freq: int, episodes: int, seed: int,
                 random_seed: int, target_accuracy: float = 0.0, started: float | None = None,
                 control_steps: int = 0, hidden: Sequence[int] = MLP_HIDDEN) -> None:
        super().__init__(DummyVecEnv([make_env_fn(env_config, VALIDATION)]), n_eval_episodes=episodes,
                         eval_freq=eval_freq, log_path=str(run_dir), best_model_save_path=str(run_dir), verbose=0)
        self.run_dir, self.seed, self.random_seed = run_dir, seed, random_seed
        self.env_config, self.control_steps, self.hidden = env_config, control_steps, hidden
        self.target_accuracy = target_accuracy
        self.started = time.perf_counter() if started is None else started
        self.evaluations_accuracy: list[float] = []
        self.best_accuracy = -np.inf
        self.baseline_results: dict[str, dict[str, Any]] | None = None
        self.controls: dict[str, Policy] | None = None  # the fitted controls, fitted once per run
        self.last_result: tuple[int, dict[str, Any]] | None = None  # (step, result) of the newest evaluation
        self._restore()

    def _restore(self) -> None:
        """Continue the arrays of an earlier run of the same directory."""
        path = self.run_dir / EVALUATIONS
        if not path.is_file():
            return
        with np.load(path) as saved:
            self.evaluations_timesteps = saved["timesteps"].tolist()
            self.evaluations_results = saved["results"].tolist()
            self.evaluations_length = saved["ep_lengths"].tolist()
            self.evaluations_successes = saved["successes"].tolist()
            self.evaluations_accuracy = saved["accuracy"].tolist()
        if self.evaluations_accuracy:
            best = int(np.argmax(self.evaluations_accuracy))
            self.best_accuracy = self.evaluations_accuracy[best]
            self.best_mean_reward = float(np.mean(self.evaluations_results[best]))

    def _init_callback(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _on_step(self) -> bool:
        if self.eval_freq > 0 and self.n_calls % self.eval_freq == 0:
            self.evaluate_now()
        return True

    def fitted_controls(self) -> dict[str, Policy]:
        """The fitted controls of the run, fitted on logs of training tasks the first time they are asked for."""
        if self.controls is None:
            self.controls = fit_controls(self.env_config, self.control_steps, self.random_seed, self.hidden)
        return self.controls

    def _baselines(self) -> dict[str, dict[str, Any]]:
        if self.baseline_results is None:  # they do not learn: once per run is enough
            env = self.eval_env.envs[0]
            self.baseline_results = {
                **baselines(env, self.n_eval_episodes, self.seed, self.random_seed),
                **play_controls(self.fitted_controls(), env, self.n_eval_episodes, self.seed)}
        return self.baseline_results

    def evaluate_now(self) -> dict[str, Any]:
        result = run_episodes(self.eval_env.envs[0], model_policy(self.model), self.n_eval_episodes, self.seed)
        self.last_result = (int(self.model.num_timesteps), result)
        self.num_timesteps = self.model.num_timesteps  # also right when called outside ``learn``
        self._baselines()
        self.evaluations_timesteps.append(int(self.num_timesteps))
        self.evaluations_results.append(result["returns"])
        self.evaluations_length.append(result["lengths"])
        self.evaluations_successes.append(result["correct"])
        self.evaluations_accuracy.append(result["accuracy"])
        write_atomic(self.run_dir / EVALUATIONS, lambda tmp: _save_npz(
            tmp, timesteps=self.evaluations_timesteps, results=self.evaluations_results,
            ep_lengths=self.evaluations_length, successes=self.evaluations_successes,
            accuracy=self.evaluations_accuracy))
        self.last_mean_reward = result["return"]
        for key, value in (("mean_reward", result["return"]), ("mean_ep_length", result["steps"]),
                           ("success_rate", result["accuracy"]), ("accuracy", result["accuracy"]),
                           ("rejects", result["rejects"])):
            self.logger.record(f"eval/{key}", value)
        for name, baseline in self.baseline_results.items():
            self.logger.record(f"eval/baseline_{short_name(name)}_accuracy", baseline["accuracy"])
        self.logger.record("time/total_timesteps", self.num_timesteps, exclude="tensorboard")
        self.logger.dump(self.num_timesteps)
        if (result["accuracy"], result["return"]) > (self.best_accuracy, self.best_mean_reward):
            self.best_accuracy, self.best_mean_reward = result["accuracy"], result["return"]
            write_atomic(self.run_dir / BEST_MODEL, self.model.save)
        reached = self.run_dir / "target_reached.json"
        if self.target_accuracy and result["accuracy"] >= self.target_accuracy and not reached.exists():
            write_json_atomic(reached, {"target_accuracy": self.target_accuracy, "accuracy": result["accuracy"],
                                        "timesteps": int(self.num_timesteps),
                                        "wall_seconds": time.perf_counter() - self.started})
        return result

    def test_table(self) -> dict[str, dict[str, Any]]:
        """The final table: the controller at its current step, every rule without training and the fitted controls
        (fitted once, on training logs) on the run's test tasks, as
        :func:`~clova_train.controller.evaluation.compare` gives them; each row names its split (``tasks``)."""
        return compare(self.env_config, self.model, self.n_eval_episodes, self.seed, self.random_seed,
                       hidden=self.hidden, split=TEST, controls=self.fitted_controls())

    def close(self) -> None:
        self.eval_env.close()
