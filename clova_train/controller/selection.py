"""The controllers' DQN (HYDRA, AVIS and HAMMR alike): stable-baselines3's DQN with the greedy rules of
:mod:`clova_train.envs.common.selection`, HYDRA's exploration schedule and AVIS/HAMMR's action masks.

* selection: ``argmax_q`` (SB3's rule) or ``eq2`` (HYDRA Eq. 2); the rules, and where in the observation they read
  the planner probabilities and the action mask, are :mod:`clova_train.envs.common.selection`'s (an agent that
  runs a trained controller uses the same). Only the selection changes: the Q-learning target is still
  ``max_a Q_target``.
* exploration ``linear`` is SB3's (``exploration_initial_eps`` down to ``exploration_final_eps`` over
  ``exploration_fraction`` of training); ``hydra_step`` is the paper's: ``initial_eps - decay * floor(t /
  every)`` environment steps, at least ``exploration_final_eps`` (paper: 0.2, 0.02 every 200 steps).

:class:`ControllerDQN` is an SB3 ``DQN``; its zip is a plain DQN zip (``DQN.load`` reads it, and then selects by
``argmax_q``; ``ControllerDQN.load`` restores the rule). The zip's fields keep the rule (``action_selection``),
N (``num_samples``) and ``mask_size``; exports also record the rule in ``controller.json``.

Action masks (the AVIS and HAMMR environments): with ``mask_size`` > 0 the masked DQN never picks an infeasible
action: not in the random warm-up, not when exploring (a uniform feasible action), not greedily (the argmax over
feasible actions); and its Q-learning target is the max over the next state's feasible actions (a forward hook on
the target network, so SB3's ``train`` is unchanged and the zip stays a plain DQN zip).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from stable_baselines3 import DQN

from clova_train.envs.common.selection import ActionSelection, mask_q_values, random_feasible, select_actions

ExplorationSchedule = Literal["linear", "hydra_step"]


def hydra_step_epsilon(timesteps: int, initial: float, decay: float, every: int, final: float) -> float:
    """The paper's step-wise epsilon after ``timesteps`` environment steps."""
    return max(final, initial - decay * math.floor(timesteps / every))


class ControllerDQN(DQN):
    """SB3 DQN for every environment's controller: HYDRA's action selection and exploration schedule as options,
    and the action mask of AVIS and HAMMR.

    Args:
        action_selection: ``argmax_q`` or ``eq2`` (see the module docstring).
        num_samples: N, the planner's samples per step (the observation's last N entries are their probabilities).
        exploration_schedule: ``linear`` (SB3) or ``hydra_step``.
        exploration_decay: ``hydra_step``: epsilon removed every ``exploration_decay_every`` steps.
        exploration_decay_every: ``hydra_step``: environment steps between decays.
        mask_size: trailing observation entries that are the action mask (0: every action always feasible).
        **kwargs: ``stable_baselines3.DQN`` arguments.
    """

    def __init__(self, *args: Any, action_selection: ActionSelection = "argmax_q", num_samples: int = 5,
                 exploration_schedule: ExplorationSchedule = "linear", exploration_decay: float = 0.02,
                 exploration_decay_every: int = 200, mask_size: int = 0, **kwargs: Any) -> None:
        self.action_selection = action_selection
        self.mask_size = mask_size
        self.num_samples = num_samples
        self.exploration_schedule_kind = exploration_schedule
        self.exploration_decay = exploration_decay
        self.exploration_decay_every = exploration_decay_every
        super().__init__(*args, **kwargs)

    def q_values(self, observation: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(Q-values ``[B, N + 1]``, observations as a tensor, whether the input was a batch)."""
        tensor, vectorized = self.policy.obs_to_tensor(observation)
        with torch.no_grad():
            return self.q_net(tensor), tensor, vectorized

    def greedy_actions(self, observation: np.ndarray, rule: ActionSelection | None = None) -> np.ndarray:
        """Greedy actions by ``rule`` (default: this model's), batch or single observation like ``predict``."""
        q, tensor, vectorized = self.q_values(observation)
        actions = select_actions(q, tensor, rule or self.action_selection, self.num_samples,
                                 self.mask_size).cpu().numpy()
        return actions if vectorized else actions[0]

    def _random_actions(self, observation: np.ndarray) -> np.ndarray:
        vectorized = self.policy.is_vectorized_observation(observation)
        batch = np.asarray(observation) if vectorized else np.asarray(observation)[None]
        if self.mask_size:
            actions = random_feasible(batch, self.mask_size, self._mask_rng)
        else:
            actions = np.array([self.action_space.sample() for _ in range(len(batch))])
        return actions if vectorized else actions[0]

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = False) -> tuple[np.ndarray, Any]:
        if self.action_selection == "argmax_q" and not self.mask_size:
            return super().predict(observation, state, episode_start, deterministic)
        if not deterministic and np.random.rand() < self.exploration_rate:  # SB3's epsilon-greedy draw
            return self._random_actions(observation), state
        return self.greedy_actions(observation), state

    def _sample_action(self, learning_starts: int, action_noise: Any = None, n_envs: int = 1) -> tuple[np.ndarray, np.ndarray]:
        if self.mask_size and self.num_timesteps < learning_starts:  # SB3's warm-up ignores masks
            actions = self._random_actions(self._last_obs)
            return actions, actions
        return super()._sample_action(learning_starts, action_noise, n_envs)

    def _setup_model(self) -> None:
        super()._setup_model()
        self._mask_rng = np.random.default_rng(self.seed)
        if self.mask_size:
            size = self.mask_size
            self.q_net_target.register_forward_hook(
                lambda module, inputs, output: mask_q_values(output, inputs[0], size))

    def _on_step(self) -> None:
        super()._on_step()
        if self.exploration_schedule_kind == "hydra_step":
            self.exploration_rate = hydra_step_epsilon(
                self.num_timesteps, self.exploration_initial_eps, self.exploration_decay, self.exploration_decay_every,
                self.exploration_final_eps)
            self.logger.record("rollout/exploration_rate", self.exploration_rate)
