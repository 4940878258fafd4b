"""Training and evaluating a controller (HYDRA, AVIS or HAMMR): stable-baselines3 DQN on its environment.

Read top to bottom:

* :class:`DQNConfig`, :class:`TrainConfig`, :class:`ControllerConfig`: what ``controller fit`` reads from YAML
  (every field documented; ``--help`` shows them);
* :func:`validate`: every value checked before anything starts, one message naming each bad key;
* :func:`fit`: n environments (``DummyVecEnv`` or ``SubprocVecEnv``), SB3 DQN with an MLP Q-network (or, with
  ``dqn.q_network: per_sample``, :mod:`clova_train.controller.per_sample_policy`'s shared per-sample scorer), a progress
  bar, logs (CSV continued on resume, TensorBoard) of reward, accuracy, episode length, rejects and cache hit
  rate, SB3's evaluation and checkpoint callbacks (:mod:`clova_train.controller.callbacks`: ``evaluations.npz``,
  ``best_model.zip``, atomic ``checkpoints/controller_<steps>_steps.zip``, with the replay buffer on request). A rerun of
  the same command resumes at the saved step count and exploration rate; a rerun of a finished run says so
  and changes nothing (``force=True`` starts afresh);
* :func:`evaluate`: the trained controller against HYDRA without RL (the planner's top-probability sample),
  the other rules without training and the fitted controls, on the same test tasks (or another split), as a table.

Splits (:mod:`clova_train.envs.common.world`, :mod:`clova_train.envs.tasks.source`): training draws ``train`` tasks;
every choice of a run (its evaluation during training, ``best_model.zip``) reads ``val`` tasks; the final table
(``evaluation.md``, ``evaluation.json``) and ``controller evaluate`` read ``test`` tasks, each row naming its split.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from clova_train.controller.evaluation import TEST, compare, format_table, make_env_fn
from clova_train.core.atomic import write_atomic, write_json_atomic, write_text_atomic
from clova_train.core.checks import Problems, is_number
from clova_train.core.errors import ClovaTrainError
from clova_train.core.run_manifest import write_run_manifest
from clova_train.core.safe_files import read_json_object
from clova_train.envs import AgentDispatchConfig, InformationSeekingConfig, ReasoningLoopConfig
from clova_train.envs.common.selection import RULES, ActionSelection

FINAL = "controller.zip"
CHECKPOINTS = "checkpoints"
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")
LOG_FORMATS = ("stdout", "csv", "tensorboard", "log", "json")
ENVIRONMENTS = ("hydra", "avis", "hammr")  # each configured by the section of its name
ExplorationSchedule = Literal["linear", "hydra_step"]
QNetworkKind = Literal["mlp", "per_sample"]
__all__ = ["ControllerConfig", "DQNConfig", "TrainConfig", "evaluate", "fit", "format_table", "validate"]


@dataclass
class DQNConfig:
    """stable-baselines3 DQN settings (defaults: HYDRA supplementary B).

    Args:
        q_network: ``mlp`` (HYDRA's: one MLP over the whole observation, paper layout) or ``per_sample`` (HYDRA's
            ``per_part`` layout only: one MLP with shared weights scores each instruction sample from the context,
            the sample, its probability and rank, and a separate one scores re-plan; permuting the planner's list
            permutes the Q-values; ``clova_train.controller.per_sample_policy``).
        net_arch: hidden layer sizes of the Q-network (paper: [512], on a 1536-d observation); ``per_sample``: of
            each of its two heads.
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
        exploration_fraction: ``linear`` schedule: fraction of training over which epsilon decays to the floor.
        exploration_schedule: ``linear`` (SB3's) or ``hydra_step`` (the paper's: ``exploration_decay`` off epsilon
            every ``exploration_decay_every`` environment steps, down to the floor).
        exploration_decay: ``hydra_step``: epsilon removed at each decay (paper: 0.02).
        exploration_decay_every: ``hydra_step``: environment steps between decays (paper: 200).
        action_selection: ``argmax_q`` (SB3's greedy action) or ``eq2`` (HYDRA Eq. 2: Q-value times the planner's
            probability, the reject action weighted by their mean; needs the probabilities in the observation).
        mask_actions: AVIS/HAMMR: honour the environment's action mask (never pick an infeasible action, in
            exploration or greedily, and bootstrap from feasible actions only); false: an unmasked agent that
            learns from the infeasible-action penalty (the ablation).
        max_grad_norm: gradient clipping.
        device: torch device (``auto`` picks CUDA when present).
    """

    q_network: QNetworkKind = "mlp"
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
    exploration_schedule: ExplorationSchedule = "linear"
    exploration_decay: float = 0.02
    exploration_decay_every: int = 200
    action_selection: ActionSelection = "argmax_q"
    mask_actions: bool = True
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
        eval_every: environment steps between evaluations on the validation tasks (0: only at the end), which
            choose ``best_model.zip``.
        eval_episodes: validation tasks per evaluation, and test tasks of the final table.
        eval_seed: seed of the validation and of the test task sequence.
        checkpoint_every: environment steps between checkpoints (model and optimizer; the replay buffer too with
            ``save_replay_buffer``).
        save_replay_buffer: save the replay buffer's filled part with each checkpoint (plain arrays; up to
            ``dqn.buffer_size`` x observation size x 8 bytes: 1.2 GB at the paper's settings), so a resumed run
            continues with the transitions it had; off, a resumed run starts with an empty buffer.
        log_formats: SB3 logger outputs (``csv``, ``tensorboard``, ``json``, ``log``; ``stdout`` prints every table).
        target_accuracy: evaluation accuracy whose first crossing is recorded (wall time and steps).
        progress_bar: show SB3's progress bar (steps, elapsed, remaining) while training.
        control_steps: environment steps of random play on training tasks logged for the fitted controls reported
            beside the controller (a question rule, logistic regression and an MLP of ``dqn.net_arch``, see
            ``clova_train.controller.fitted_controls``); null: ``total_timesteps``, the controller's own budget;
            0: none.
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
    progress_bar: bool = True
    control_steps: int | None = None
    save_replay_buffer: bool = False

    def resolved_control_steps(self) -> int:
        """``control_steps``, with null read as ``total_timesteps``."""
        return self.total_timesteps if self.control_steps is None else self.control_steps


@dataclass
class ControllerConfig:
    """A controller run: the environment, the DQN agent and the training loop.

    Args:
        environment: which environment of the reasoning-loop family, configured by the section of its name:
            ``hydra`` (pick one of the planner's samples), ``avis`` (pick the next tool within a transition graph)
            or ``hammr`` (pick the agent that answers).
        hydra: the HYDRA reasoning-loop environment.
        avis: the AVIS information-seeking environment.
        hammr: the HAMMR dispatcher environment.
        dqn: the DQN agent.
        train: the training loop.
    """

    environment: Literal["hydra", "avis", "hammr"] = "hydra"
    hydra: ReasoningLoopConfig = field(default_factory=ReasoningLoopConfig)
    avis: InformationSeekingConfig = field(default_factory=InformationSeekingConfig)
    hammr: AgentDispatchConfig = field(default_factory=AgentDispatchConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def env_config(self) -> ReasoningLoopConfig | InformationSeekingConfig | AgentDispatchConfig:
        """The configuration of the environment this run trains on (the section named as the environment)."""
        return getattr(self, self.environment)

    def masks_actions(self) -> bool:
        """Whether the agent honours an action mask (when the environment's observation ends with one)."""
        return self.env_config().observation_tail().mask and self.dqn.mask_actions


# ---------------------------------------------------------------------------------------------- validation
def _problems(config: ControllerConfig) -> list[str]:
    """The agent's and the loop's values, and the environment's (its config checks itself)."""
    dqn, train = config.dqn, config.train
    found = Problems()
    found.one_of("environment", config.environment, ENVIRONMENTS)
    if config.environment in ENVIRONMENTS:
        section, env = config.environment, config.env_config()
        found.messages += env.problems(section)
        tasks = getattr(env, "tasks", None)
        if tasks is not None and tasks.given and tasks.test is None:  # trained on one split, reported on another
            found.add(f"{section}.tasks.test: give the task files the controller is reported on (format, questions, "
                      "images, ...; without tasks.val, half of them are its validation tasks)")
        reason = env.selection_problem(dqn.action_selection, section)
        found.need(not reason, "dqn.action_selection", dqn.action_selection, reason)
    d = Problems("dqn")
    d.one_of("q_network", dqn.q_network, get_args(QNetworkKind))
    if dqn.q_network == "per_sample" and config.environment in ENVIRONMENTS:
        reason = per_sample_problem(config)
        d.need(not reason, "q_network", dqn.q_network, reason)
    d.need(bool(dqn.net_arch) and all(isinstance(n, int) and n >= 1 for n in dqn.net_arch), "net_arch",
           dqn.net_arch, "must be a non-empty list of layer sizes >= 1")
    d.positive("learning_rate", dqn.learning_rate)
    d.at_least("batch_size", dqn.batch_size, 1)
    d.at_least("buffer_size", dqn.buffer_size, max(1, dqn.batch_size if is_number(dqn.batch_size) else 1))
    d.at_least("learning_starts", dqn.learning_starts, 0)
    d.within("gamma", dqn.gamma, 0, 1)
    d.at_least("train_freq", dqn.train_freq, 1)
    d.need(dqn.gradient_steps == -1 or is_number(dqn.gradient_steps) and dqn.gradient_steps >= 1, "gradient_steps",
           dqn.gradient_steps, "must be >= 1 (or -1: as many as environment steps)")
    d.at_least("target_update_interval", dqn.target_update_interval, 1)
    d.within("exploration_initial_eps", dqn.exploration_initial_eps, 0, 1)
    d.within("exploration_final_eps", dqn.exploration_final_eps, 0, 1)
    d.need(is_number(dqn.exploration_fraction) and 0 < dqn.exploration_fraction <= 1, "exploration_fraction",
           dqn.exploration_fraction, "must be in (0, 1]")
    d.one_of("exploration_schedule", dqn.exploration_schedule, get_args(ExplorationSchedule))
    d.within("exploration_decay", dqn.exploration_decay, 0, 1)
    d.at_least("exploration_decay_every", dqn.exploration_decay_every, 1)
    d.one_of("action_selection", dqn.action_selection, RULES)
    d.positive("max_grad_norm", dqn.max_grad_norm)
    t = Problems("train")
    t.at_least("total_timesteps", train.total_timesteps, 1)
    t.at_least("n_envs", train.n_envs, 1)
    t.one_of("vec_env", train.vec_env, ("dummy", "subproc"))
    for key in ("eval_every", "checkpoint_every"):
        t.at_least(key, getattr(train, key), 0)
    t.at_least("eval_episodes", train.eval_episodes, 1)
    t.need(bool(train.output_dir), "output_dir", train.output_dir, "must name a directory")
    unknown = [f for f in train.log_formats if f not in LOG_FORMATS]
    t.need(not unknown, "log_formats", train.log_formats, f"formats must be among {', '.join(LOG_FORMATS)}")
    t.within("target_accuracy", train.target_accuracy, 0, 1)
    if train.control_steps is not None:
        t.at_least("control_steps", train.control_steps, 0)
    return [*found.messages, *d.messages, *t.messages]


def per_sample_problem(config: ControllerConfig) -> str:
    """Why ``dqn.q_network: per_sample`` cannot read this run's observation ("" when it can)."""
    if config.environment != "hydra":
        return (f"scores HYDRA's instruction samples one by one, so it needs environment: hydra with hydra.layout: "
                f"per_part (environment is {config.environment}; use q_network: mlp)")
    if config.hydra.layout != "per_part":
        return (f"needs hydra.layout: per_part (each sample embedded on its own), hydra.layout is "
                f"{config.hydra.layout!r}; use q_network: mlp with the joint layout")
    return ""


def validate(config: ControllerConfig) -> None:
    """Raise one :class:`ClovaTrainError` listing every invalid value (key, value, rule), or return."""
    problems = _problems(config)
    if problems:
        raise ClovaTrainError("invalid controller config:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate(config: ControllerConfig, model: Any, episodes: int | None = None,
             split: str = TEST) -> dict[str, dict[str, Any]]:
    """The controller, every rule without training and the fitted controls on the same tasks of ``split`` (default:
    the test tasks; ``val``: the tasks the run chose on)."""
    return compare(config.env_config(), model, episodes or config.train.eval_episodes, config.train.eval_seed,
                   config.train.seed, config.train.resolved_control_steps(), list(config.dqn.net_arch), split)


def evaluation_page(results: dict[str, dict[str, Any]], episodes: int) -> str:
    """``evaluation.md``: the final table and where its tasks came from."""
    return (f"# Test evaluation ({episodes} test tasks)\n\n"
            "Every row is measured on the test tasks (column `tasks`), which no choice of the run read: training "
            "draws train tasks, and the evaluations during training and `best_model.zip` read the validation (val) "
            "tasks (`evaluations.npz`, the `eval/` entries of the logs). The controller row is the final "
            "`controller.zip`.\n\n"
            f"{format_table(results)}\n")


# ---------------------------------------------------------------------------------------------- fit
def make_vec_env(config: ControllerConfig):
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    vec_cls = SubprocVecEnv if config.train.vec_env == "subproc" else DummyVecEnv
    return sb3_make_vec_env(make_env_fn(config.env_config(), "train"), n_envs=config.train.n_envs, seed=config.train.seed,
                            vec_env_cls=vec_cls)


def describe_env(env: Any) -> dict[str, Any]:
    """The ``describe()`` of a (vectorised) environment's first copy."""
    return env.env_method("describe", indices=[0])[0] if hasattr(env, "env_method") else env.describe()


def q_network_policy(config: ControllerConfig, env: Any) -> tuple[Any, dict[str, Any]]:
    """The SB3 policy (name or class) and its ``policy_kwargs`` for ``dqn.q_network``."""
    kwargs: dict[str, Any] = {"net_arch": list(config.dqn.net_arch)}
    if config.dqn.q_network != "per_sample":
        return "MlpPolicy", kwargs
    from clova_train.controller.per_sample_policy import PerSampleDQNPolicy, per_sample_layout

    try:
        num_samples, embedding_dim = per_sample_layout(describe_env(env))
    except ValueError as err:
        raise ClovaTrainError(f"dqn.q_network = per_sample: {err}") from None
    return PerSampleDQNPolicy, kwargs | {"num_samples": num_samples, "embedding_dim": embedding_dim}


def q_network_kind(model: Any) -> str:
    """``per_sample`` or ``mlp``: which ``dqn.q_network`` a loaded model has."""
    from clova_train.controller.per_sample_policy import PerSampleDQNPolicy

    return "per_sample" if isinstance(model.policy, PerSampleDQNPolicy) else "mlp"


def build_model(config: ControllerConfig, env: Any) -> Any:
    from clova_train.controller.selection import ControllerDQN

    d = config.dqn
    policy, policy_kwargs = q_network_policy(config, env)
    return ControllerDQN(
        policy, env, learning_rate=d.learning_rate, buffer_size=d.buffer_size, learning_starts=d.learning_starts,
        batch_size=d.batch_size, gamma=d.gamma, train_freq=d.train_freq, gradient_steps=d.gradient_steps,
        target_update_interval=d.target_update_interval, exploration_initial_eps=d.exploration_initial_eps,
        exploration_final_eps=d.exploration_final_eps, exploration_fraction=d.exploration_fraction,
        max_grad_norm=d.max_grad_norm, policy_kwargs=policy_kwargs, seed=config.train.seed,
        device=d.device, verbose=0, action_selection=d.action_selection,
        num_samples=config.env_config().observation_tail().probabilities,
        exploration_schedule=d.exploration_schedule, exploration_decay=d.exploration_decay,
        exploration_decay_every=d.exploration_decay_every,
        mask_size=int(env.action_space.n) if config.masks_actions() else 0,
    )


def load_controller(path: str | Path, config: ControllerConfig, env: Any = None, device: str = "cpu") -> Any:
    """A saved controller with the configured selection rule and exploration schedule (its action mask, if it
    honours one, comes with the zip: ``mask_size`` is saved with the model)."""
    from clova_train.controller.selection import ControllerDQN
    from clova_train.sb3.files import zip_custom_objects

    d = config.dqn
    # ``load`` sets these keyword arguments as attributes (the names ControllerDQN keeps them under); the zip's
    # pickled fields come in through the allowlist (custom_objects), so SB3 unpickles nothing.
    custom_objects = zip_custom_objects(path)
    try:
        return ControllerDQN.load(path, env=env, device=device, custom_objects=custom_objects,
                                  action_selection=d.action_selection,
                                  num_samples=config.env_config().observation_tail().probabilities,
                                  exploration_schedule_kind=d.exploration_schedule, exploration_decay=d.exploration_decay,
                                  exploration_decay_every=d.exploration_decay_every)
    except ValueError as err:  # a Q-network its own fields cannot build, or spaces that do not match the environment
        raise ClovaTrainError(f"controller {path} cannot be loaded: {err}") from None


def finished_steps(run_dir: Path) -> int | None:
    """The step count of a finished run in ``run_dir`` (its ``controller.zip`` is written), else None."""
    from clova_train.controller.callbacks import latest_checkpoint

    found = latest_checkpoint(run_dir / CHECKPOINTS)
    if not (run_dir / FINAL).is_file() or found is None:
        return None
    return int(found[2]["num_timesteps"])


def clear_run(run_dir: Path, keep: str | None) -> None:
    """Delete what a controller run wrote in ``run_dir``, except the file ``keep`` (the LLM call cache)."""
    keep_path = Path(keep).resolve() if keep else None

    def kept(entry: Path) -> bool:  # the cache, its SQLite side files (-wal, -shm), or a folder holding them
        where = entry.resolve()
        if keep_path is None:
            return False
        side_files = {keep_path.name + suffix for suffix in SQLITE_SIDE_FILES}
        return keep_path.is_relative_to(where) or (where.parent == keep_path.parent and where.name in side_files)

    for entry in run_dir.iterdir() if run_dir.is_dir() else ():
        if not kept(entry):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _load(config: ControllerConfig, env: Any, checkpoints: Path) -> Any:
    from clova_train.controller.callbacks import latest_checkpoint
    from clova_train.sb3.files import load_replay_arrays, load_replay_buffer

    found = latest_checkpoint(checkpoints)
    if found is None:
        return build_model(config, env)
    model_path, replay_path, _ = found
    model = load_controller(model_path, config, env, config.dqn.device)
    if q_network_kind(model) != config.dqn.q_network:
        raise ClovaTrainError(f"checkpoint {model_path} has a {q_network_kind(model)} Q-network, the config asks for "
                              f"dqn.q_network = {config.dqn.q_network}: resume with the setting it was trained with, "
                              "or pass --force to train afresh")
    if model.observation_space.shape != env.observation_space.shape:
        raise ClovaTrainError(f"checkpoint {model_path} expects observations of shape {model.observation_space.shape}"
                              f", the configured environment gives {env.observation_space.shape}")
    if replay_path is not None and replay_path.exists():
        if replay_path.suffix == ".npz":
            load_replay_arrays(model, replay_path)
        else:  # a checkpoint written before replay buffers were saved as arrays
            load_replay_buffer(model, replay_path)
    buffer = f"{model.replay_buffer.size()} stored transitions" if replay_path is not None else \
        "an empty replay buffer (train.save_replay_buffer was off)"
    print(f"Resuming {model_path} at step {model.num_timesteps} (exploration rate {model.exploration_rate:.4f}, "
          f"{buffer})", flush=True)
    return model


def _calls(every_steps: int, n_envs: int) -> int:
    """SB3 callbacks count calls (one step of every environment): ``every_steps`` in calls, 0 staying 0."""
    return max(1, every_steps // n_envs) if every_steps else 0


def fit(config: ControllerConfig, extra_callbacks: list | None = None,
        force: bool = False) -> tuple[Any, dict[str, dict[str, float]] | None]:
    """Train (or resume) the controller; returns the model and, if training finished, the evaluation table.

    A run whose ``controller.zip`` is written at ``train.total_timesteps`` or more is finished: it is left
    exactly as it is, and the stored evaluation is returned with no model. ``force`` deletes the run's outputs
    (not its LLM call cache) and starts afresh.
    """
    from clova_train.controller.callbacks import (
        AtomicCheckpointCallback,
        EpisodeStats,
        ProgressLines,
        HeldOutEvalCallback,
        make_logger,
    )

    validate(config)
    run_dir = Path(config.train.output_dir)
    checkpoints = run_dir / CHECKPOINTS
    if force:
        clear_run(run_dir, config.env_config().cache_path)
    done = finished_steps(run_dir)
    if done is not None and done >= config.train.total_timesteps:
        print(f"{run_dir} is already finished ({done} of {config.train.total_timesteps} steps): nothing changed. "
              "Pass --force (or set a new train.output_dir) to train afresh.", flush=True)
        stored = run_dir / "evaluation.json"
        return None, read_json_object(stored, "evaluation") if stored.is_file() else None
    started = time.perf_counter()
    n_envs = config.train.n_envs
    env = make_vec_env(config)
    held_out = None
    try:
        model = _load(config, env, checkpoints)
        model.set_logger(make_logger(run_dir / "logs", list(config.train.log_formats)))
        write_json_atomic(run_dir / "config.json", asdict(config))
        write_run_manifest(run_dir, "controller", learner=f"{type(model).__module__}.{type(model).__qualname__}",
                           config=asdict(config))
        checkpoint = AtomicCheckpointCallback(_calls(config.train.checkpoint_every, n_envs), str(checkpoints),
                                              replay_buffer=config.train.save_replay_buffer)
        held_out = HeldOutEvalCallback(config.env_config(), run_dir, _calls(config.train.eval_every, n_envs),
                                       config.train.eval_episodes, config.train.eval_seed, config.train.seed,
                                       config.train.target_accuracy, started,
                                       config.train.resolved_control_steps(), list(config.dqn.net_arch))
        for callback in (checkpoint, held_out):  # also used below when ``learn`` has nothing left to run
            callback.init_callback(model)
        remaining = config.train.total_timesteps - model.num_timesteps
        if remaining > 0:
            bar_on_terminal = config.train.progress_bar and sys.stderr.isatty()
            lines = [ProgressLines(remaining)] if config.train.progress_bar and not bar_on_terminal else []
            try:
                model.learn(remaining, callback=[EpisodeStats(), checkpoint, held_out, *lines, *(extra_callbacks or [])],
                            reset_num_timesteps=False, log_interval=10, progress_bar=bar_on_terminal)
            except (ClovaTrainError, KeyboardInterrupt):  # a failed backend or Ctrl-C: keep what was learned
                if model.num_timesteps > 0:
                    checkpoint.save()
                raise
        checkpoint.save()
        if model.num_timesteps < config.train.total_timesteps:
            return model, None  # stopped early by a callback
        if config.train.target_accuracy or not held_out.evaluations_timesteps:
            held_out.evaluate_now()
        results = held_out.test_table()  # what ``evaluate`` gives, the controls not fitted twice
    finally:
        env.close()
        if held_out is not None:
            held_out.close()
    write_text_atomic(run_dir / "evaluation.md", evaluation_page(results, config.train.eval_episodes))
    write_json_atomic(run_dir / "evaluation.json", results)
    write_atomic(run_dir / FINAL, model.save)  # last: its presence marks the run finished
    return model, results
