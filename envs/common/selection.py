"""A controller's greedy action, and where in an observation the rules read what they need.

One module for everyone who turns Q-values into an action: the DQN being trained
(:class:`clova_train.controller.selection.ControllerDQN`), an agent that runs a trained controller
(:func:`clova_train.envs.avis.agents.load_controller_policy`, HAMMR), and the text an export writes for a serving
stack (:data:`ACTION_RULES`, :data:`MASKED_RULE`).

Rules (``ActionSelection``):

* ``argmax_q``: ``argmax_a Q(s, a)``.
* ``eq2``: HYDRA Eq. 2, ``argmax_i F_C(s)_i * P_P(d_i)`` over the N samples, where ``F_C`` is the controller's
  output passed through a softmax over its N+1 actions (the paper's controller is "a trainable MLP layer followed
  by a softmax function with an output size of N+1", HYDRA Sec. 3), so that a negative Q-value cannot flip the
  product's order. Eq. 2 ranges over the samples only; the (N+1)-th action, reject all samples and re-plan, is
  taken when it is the controller's own top choice ("if the RL agent considers them invalid, a request is sent
  to the planner to regenerate new instruction samples", same section). The softmax is monotone, so the reject
  decision is the argmax of the Q-values.

Where they read (:class:`ObservationTail`, which each environment config gives for its observation):

* the planner's N probabilities are the observation's **last N entries** (HYDRA's ``per_part`` layout always
  ends with them, the ``joint`` layout with ``probability_features``);
* the action mask is the observation's **last ``n_actions`` entries**, 1 for a feasible action (AVIS, HAMMR:
  :func:`observation_with_mask` writes it there, :func:`feasible_part` reads it back). With a mask, the greedy
  action is the best feasible one: infeasible Q-values become :data:`MASKED_Q` before the argmax.

The functions that take tensors import torch when called, so that the environments, which only write the
observation, do not load it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

ActionSelection = Literal["argmax_q", "eq2"]
RULES: tuple[str, ...] = ("argmax_q", "eq2")
MASKED_Q = -1e9  # finite: a terminal transition multiplies the target by 0, and -inf * 0 is nan

# What an export's controller.json says of its greedy rule (a serving stack applies it to q_network.pt's output).
MASKED_RULE = "argmax over the feasible actions: those whose entry in the observation's action_mask part is 1"
ACTION_RULES = {
    "argmax_q": "argmax",
    "eq2": "N (reject) if argmax(q) == N, else argmax_i(softmax(q)_i * p_i) over i < N, with p_i the last N "
           "observation entries (HYDRA Eq. 2)",
}


@dataclass(frozen=True)
class ObservationTail:
    """What an environment's observation ends with, for the greedy rules (see the module docstring).

    Args:
        probabilities: N when the last N entries are the planner's probabilities of actions 0..N-1 (what Eq. 2
            weights); 0 when the observation has none.
        mask: whether the last ``n_actions`` entries are the action mask.
    """

    probabilities: int = 0
    mask: bool = False


def part_offsets(parts: list[tuple[str, int]]) -> dict[str, list[int]]:
    """``[start, end)`` of each named part of a concatenated observation, for ``describe()``."""
    offsets, start = {}, 0
    for name, size in parts:
        offsets[name] = [start, start + size]
        start += size
    return offsets


MEMORY_TEXT_HELP = ("the working memory as observation.memory_text(lines, last=8) gives it, one line per tool result: "
                    "'[<label>] <action> -> <output>'")


def observation_with_mask(parts: Sequence[np.ndarray], mask: np.ndarray) -> np.ndarray:
    """The float32 observation ``[*parts, mask]`` in [-1, 1]: the mask (booleans over the actions) last."""
    return np.clip(np.concatenate([*parts, np.asarray(mask, dtype=np.float32)]).astype(np.float32), -1.0, 1.0)


def feasible_part(observations: Any, mask_size: int) -> Any:
    """Booleans ``[B, mask_size]``: which actions the mask at the end of each observation allows (array or tensor)."""
    return observations[:, -mask_size:] > 0.5


def probability_part(observations: Any, num_samples: int) -> Any:
    """``[B, N]``: the planner probabilities at the end of each observation (array or tensor)."""
    return observations[:, -num_samples:]


def eq2_actions(q_values: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
    """HYDRA Eq. 2 (module docstring): ``[B, N + 1]`` Q-values and ``[B, N]`` planner probabilities -> actions ``[B]``."""
    import torch

    reject = q_values.shape[1] - 1
    weighted = torch.softmax(q_values, dim=1)[:, :reject] * probabilities
    return torch.where(q_values.argmax(dim=1) == reject, torch.full_like(weighted[:, 0], reject, dtype=torch.long),
                       weighted.argmax(dim=1))


def mask_q_values(q_values: torch.Tensor, observations: torch.Tensor, mask_size: int) -> torch.Tensor:
    """Q-values with the infeasible actions at ``MASKED_Q``; unchanged when ``mask_size`` is 0."""
    import torch

    if not mask_size:
        return q_values
    feasible = feasible_part(observations, mask_size).to(q_values.device)
    return torch.where(feasible, q_values, torch.full_like(q_values, MASKED_Q))


def select_actions(q_values: torch.Tensor, observations: torch.Tensor, rule: ActionSelection, num_samples: int,
                   mask_size: int = 0) -> torch.Tensor:
    """Greedy actions ``[B]`` by ``rule`` from Q-values ``[B, n_actions]`` and the observations they came from
    (``num_samples``: the probabilities at their end, for ``eq2``; ``mask_size``: the mask at their end, or 0)."""
    q_values = mask_q_values(q_values, observations, mask_size)
    if rule == "argmax_q":
        return q_values.argmax(dim=1)
    return eq2_actions(q_values, probability_part(observations, num_samples).to(q_values))


def random_feasible(observations: np.ndarray, mask_size: int, rng: np.random.Generator) -> np.ndarray:
    """A uniform feasible action per row of a batch of observations."""
    masks = feasible_part(np.asarray(observations), mask_size)
    return np.array([rng.choice(np.flatnonzero(row)) if row.any() else 0 for row in masks])
