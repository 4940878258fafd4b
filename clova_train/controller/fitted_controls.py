"""Controls that learn from the same data as the controller: fitted on logged episodes of training tasks.

The rules of :mod:`clova_train.controller.evaluation` read the planner's probabilities or nothing; a trained
controller also reads the question and the memory. These controls read them too, and learn from logged play
instead of reinforcement learning, so a gain of the DQN over them is a gain of RL, not of reading the question:

* **question rule** (:class:`QuestionRule`): a table from the *situation* (the question's first two words, how
  many entries the memory holds, and the transition-graph state where there is one) to an action *description*
  (HYDRA: the sample at probability rank k, or re-plan; AVIS, HAMMR: the action itself), choosing the description
  whose logged episodes ended correct most often. It is what a person writes after reading the logs ("for a
  'How many' question, trust the top sample").
* **logistic regression** and an **MLP classifier** (:class:`OutcomeClassifier`) on the controller's own
  observation vector: one output per action, fitted by binary cross-entropy on the action taken to predict
  whether its episode ended correct; they act greedily over the feasible actions. These are the one-step
  supervised learners: they never bootstrap from later steps, so where the right action pays off only later
  (a comparison's first count) they learn what random continuations made of it.

Beside them, :mod:`clova_train.controller.per_sample_controls` fits learners that score each sample (or action) on
its own with one set of weights, on the same log.

Data (:func:`log_episodes`): a uniform random feasible policy plays whole episodes of *training* tasks (the split
the controller trains on; the held-out tasks are never seen) until ``steps`` environment steps are logged,
``train.control_steps`` (by default the controller's own ``total_timesteps``: the same budget). The classifiers'
epochs and weight decay are chosen on a validation split of the logged episodes (a fifth of them), never on the
held-out tasks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clova_train.envs import ReasoningLoopEnv
from clova_train.envs.common.episode import episode_score

REPLAN = "re-plan"
QUESTION_WORDS = 2
VALIDATION_FRACTION = 0.2
WEIGHT_DECAYS = (1e-4, 1e-2)
MLP_HIDDEN = (256,)  # the MLP control's layers when no DQN width is given (the quickstarts' net_arch)


def feasible_actions(env: Any) -> np.ndarray:
    """Booleans over the action space: the environment's action mask, or every action."""
    if hasattr(env, "action_masks"):
        return np.asarray(env.action_masks(), dtype=bool)
    return np.ones(int(env.action_space.n), dtype=bool)


def situation(env: Any) -> tuple[Hashable, ...]:
    """What a rule may key on: the question's first words, the memory's length and the graph state, if any."""
    words = " ".join(env.task.question.lower().split()[:QUESTION_WORDS])
    memory = len(getattr(getattr(env, "memory", None), "entries", ()))
    return words, memory, getattr(env, "state", None)


def _probability_order(env: ReasoningLoopEnv) -> np.ndarray:
    """The current samples' actions from the highest planner probability to the lowest (ties: listing order)."""
    return np.argsort(-env.planner_probabilities(), kind="stable")


def describe_action(env: Any, action: int) -> Hashable:
    """HYDRA: ``"rank k"`` of the sample's planner probability (1 highest) or ``"re-plan"``; others: the action."""
    if not isinstance(env, ReasoningLoopEnv):
        return int(action)
    if action == env.config.num_samples:
        return REPLAN
    return f"rank {int(np.flatnonzero(_probability_order(env) == action)[0]) + 1}"


def action_for(env: Any, description: Hashable) -> int:
    """The action that ``description`` (from :func:`describe_action`) names in the current step."""
    if not isinstance(env, ReasoningLoopEnv):
        return int(description)
    if description == REPLAN:
        return env.config.num_samples
    return int(_probability_order(env)[int(str(description).split()[1]) - 1])


@dataclass
class EpisodeLog:
    """Logged steps of random play: observations, actions, masks, situations, descriptions, episode outcomes."""

    observations: list[np.ndarray] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    situations: list[tuple[Hashable, ...]] = field(default_factory=list)
    descriptions: list[Hashable] = field(default_factory=list)
    success: list[float] = field(default_factory=list)
    episode: list[int] = field(default_factory=list)

    @property
    def episodes(self) -> int:
        return self.episode[-1] + 1 if self.episode else 0


def log_episodes(env: Any, steps: int, seed: int) -> EpisodeLog:
    """Whole episodes of a uniform random feasible policy on ``env``'s tasks until ``steps`` steps are logged,
    each step labelled with whether its episode ended correct."""
    rng = np.random.default_rng(seed)
    log = EpisodeLog()
    episode = 0
    while len(log.actions) < steps:
        obs, _ = env.reset(seed=seed * 1_000_003 + episode)
        start, done, info = len(log.actions), False, {}
        while not done:
            mask = feasible_actions(env)
            action = int(rng.choice(np.flatnonzero(mask)))
            log.observations.append(np.asarray(obs, dtype=np.float32))
            log.actions.append(action)
            log.masks.append(mask)
            log.situations.append(situation(env))
            log.descriptions.append(describe_action(env, action))
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        outcome = episode_score(info)
        log.success.extend([outcome] * (len(log.actions) - start))
        log.episode.extend([episode] * (len(log.actions) - start))
        episode += 1
    return log


def validation_episodes(log: EpisodeLog, seed: int) -> np.ndarray:
    """The logged episodes held out of every fitted control's fit to choose its settings on: a fifth of them (at
    least one), drawn by ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.permutation(log.episodes)[:max(1, int(VALIDATION_FRACTION * log.episodes))]


class QuestionRule:
    """The situation -> action-description table of the module docstring (Laplace-smoothed success rates; a
    situation never logged falls back to the description with the best rate over all situations)."""

    def __init__(self, log: EpisodeLog) -> None:
        counts: dict[tuple[Hashable, ...], dict[Hashable, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
        overall: dict[Hashable, list[float]] = defaultdict(lambda: [0.0, 0])
        for key, description, success in zip(log.situations, log.descriptions, log.success):
            for table in (counts[key][description], overall[description]):
                table[0] += success
                table[1] += 1
        self.table = {key: self._ranked(stats) for key, stats in counts.items()}
        self.fallback = self._ranked(overall)

    @staticmethod
    def _ranked(stats: dict[Hashable, list[float]]) -> list[Hashable]:
        return sorted(stats, key=lambda d: -(stats[d][0] + 1) / (stats[d][1] + 2))

    def __call__(self, obs: np.ndarray, env: Any) -> int:
        mask = feasible_actions(env)
        for description in [*self.table.get(situation(env), []), *self.fallback]:
            action = action_for(env, description)
            if mask[action]:
                return action
        return int(np.flatnonzero(mask)[0])


class OutcomeClassifier:
    """P(episode ends correct | observation, action) by a network with one output per action (no hidden layer:
    logistic regression), fitted on the logged steps (module docstring); acts by the highest feasible output.

    Args:
        hidden: hidden layer sizes (``[]``: logistic regression).
        seed: seed of the initialisation, the validation split and the batches.
        max_epochs: passes over the training part at most (the best epoch on the validation part is kept).
        batch_size: steps per gradient step.
        learning_rate: Adam's.
    """

    def __init__(self, hidden: Sequence[int] = (), seed: int = 0, max_epochs: int = 40, batch_size: int = 256,
                 learning_rate: float = 3e-3) -> None:
        self.hidden, self.seed, self.max_epochs = list(hidden), seed, max_epochs
        self.batch_size, self.learning_rate = batch_size, learning_rate
        self.network: Any = None
        self.chosen: dict[str, float] = {}

    def _build(self, inputs: int, outputs: int) -> Any:
        import torch

        layers: list[Any] = []
        for width in self.hidden:
            layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
            inputs = width
        return torch.nn.Sequential(*layers, torch.nn.Linear(inputs, outputs))

    def fit(self, log: EpisodeLog) -> OutcomeClassifier:
        import torch

        torch.manual_seed(self.seed)
        observations = torch.as_tensor(np.stack(log.observations))
        actions = torch.as_tensor(log.actions)
        success = torch.as_tensor(log.success, dtype=torch.float32)
        is_validation = torch.as_tensor(np.isin(log.episode, validation_episodes(log, self.seed)))
        train, valid = torch.nonzero(~is_validation)[:, 0], torch.nonzero(is_validation)[:, 0]
        if len(train) == 0:  # one episode logged: validate on what was fitted
            train = valid
        outputs = len(log.masks[0])
        best: tuple[float, Any, dict[str, float]] | None = None
        for weight_decay in WEIGHT_DECAYS:
            network = self._build(observations.shape[1], outputs)
            optimiser = torch.optim.Adam(network.parameters(), lr=self.learning_rate, weight_decay=weight_decay)
            stale = 0
            for epoch in range(self.max_epochs):
                order = train[torch.randperm(len(train))]
                for start in range(0, len(order), self.batch_size):
                    rows = order[start:start + self.batch_size]
                    loss = self._loss(network, observations[rows], actions[rows], success[rows])
                    optimiser.zero_grad()
                    loss.backward()
                    optimiser.step()
                with torch.no_grad():
                    validation_loss = float(self._loss(network, observations[valid], actions[valid], success[valid]))
                if best is None or validation_loss < best[0]:
                    state = {k: v.clone() for k, v in network.state_dict().items()}
                    best, stale = (validation_loss, state,
                                   {"weight_decay": weight_decay, "epochs": epoch + 1,
                                    "validation_loss": validation_loss}), 0
                else:
                    stale += 1
                    if stale >= 5:
                        break
        assert best is not None
        self.network = self._build(observations.shape[1], outputs)
        self.network.load_state_dict(best[1])
        self.network.eval()
        self.chosen = best[2]
        return self

    @staticmethod
    def _loss(network: Any, observations: Any, actions: Any, success: Any) -> Any:
        import torch

        logits = network(observations).gather(1, actions[:, None]).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, success)

    def __call__(self, obs: np.ndarray, env: Any) -> int:
        import torch

        with torch.no_grad():
            scores = self.network(torch.as_tensor(np.asarray(obs, dtype=np.float32))[None])[0].numpy()
        scores = np.where(feasible_actions(env), scores, -np.inf)
        return int(np.argmax(scores))


def log_budget(steps: int) -> str:
    """How the fitted controls' names say what they learned from."""
    return f"{steps} steps of random play on training tasks"


def fitted_controls(train_env: Any, steps: int, seed: int, hidden: Sequence[int],
                    log: EpisodeLog | None = None) -> dict[str, Any]:
    """The three controls of the module docstring, fitted on ``steps`` logged steps of ``train_env``'s tasks (``log``:
    those steps, logged by :func:`log_episodes` already)."""
    import torch

    log = log_episodes(train_env, steps, seed) if log is None else log
    with torch.random.fork_rng():
        logistic = OutcomeClassifier((), seed).fit(log)
        mlp = OutcomeClassifier(hidden, seed).fit(log)
    budget = log_budget(steps)
    return {f"question rule fitted on logs ({budget})": QuestionRule(log),
            f"logistic regression on logs ({budget})": logistic,
            f"MLP {list(hidden)} on logs ({budget})": mlp}
