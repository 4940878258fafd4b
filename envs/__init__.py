"""Gymnasium environments of clova-train (installed as ``clova_train.envs``): the reasoning-loop family.

* ``clova_train/ReasoningLoop-v0`` (HYDRA): planner -> controller -> reasoner -> textualizer; the controller picks
  one of the planner's N instruction samples or asks for new ones (:class:`ReasoningLoopEnv`).
* ``clova_train/InformationSeeking-v0`` (AVIS): the controller picks the next tool among those a transition
  graph allows in the current state (``action_masks()``); a reasoner labels each result, uninformative ones
  backtrack; results go into a working memory (:class:`InformationSeekingEnv`).
* ``clova_train/AgentDispatch-v0`` (HAMMR): the controller picks which agent answers a question; agents are
  environments plus policies, callable as tools by other agents, with a depth limit and an LLM-call budget
  (:class:`AgentDispatchEnv`).

``gymnasium.make(ENV_ID, config=...)`` builds each; :func:`make_env` builds the one a config object names. Each
config checks its own values (``problems()``) and says what its observation ends with for a controller's greedy
rules (``observation_tail()``, :mod:`clova_train.envs.common.selection`).

The family folders depend one way: ``common`` <- ``hydra`` <- ``avis`` (agents as tools: an agent is an AVIS or a
HYDRA environment plus a policy) <- ``hammr`` (the dispatcher over agents).
"""

from typing import Any

import gymnasium

from clova_train.envs.avis.agents import AgentSpec
from clova_train.envs.avis.information_seeking import InformationSeekingConfig, InformationSeekingEnv
from clova_train.envs.avis.transition_graph import GraphError, TransitionGraph, load_graph
from clova_train.envs.hammr.dispatch import AgentDispatchConfig, AgentDispatchEnv
from clova_train.envs.hydra.reasoning_loop import ReasoningLoopConfig, ReasoningLoopEnv, eq3_step_reward
from clova_train.llm.config import EmbedderConfig, LLMConfig

ENV_ID = "clova_train/ReasoningLoop-v0"
AVIS_ENV_ID = "clova_train/InformationSeeking-v0"
HAMMR_ENV_ID = "clova_train/AgentDispatch-v0"

for _id, _entry in ((ENV_ID, "hydra.reasoning_loop:ReasoningLoopEnv"), (AVIS_ENV_ID, "avis.information_seeking:InformationSeekingEnv"),
                    (HAMMR_ENV_ID, "hammr.dispatch:AgentDispatchEnv")):
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=f"clova_train.envs.{_entry}")

EnvConfig = ReasoningLoopConfig | InformationSeekingConfig | AgentDispatchConfig


def make_env(config: Any) -> ReasoningLoopEnv | InformationSeekingEnv | AgentDispatchEnv:
    """The environment of a config object of this family."""
    if isinstance(config, InformationSeekingConfig):
        return InformationSeekingEnv(config)
    if isinstance(config, AgentDispatchConfig):
        return AgentDispatchEnv(config)
    return ReasoningLoopEnv(config)


__all__ = ["AVIS_ENV_ID", "AgentDispatchConfig", "AgentDispatchEnv", "AgentSpec", "ENV_ID", "EmbedderConfig",
           "EnvConfig", "GraphError", "HAMMR_ENV_ID", "InformationSeekingConfig", "InformationSeekingEnv", "LLMConfig",
           "ReasoningLoopConfig", "ReasoningLoopEnv", "TransitionGraph", "eq3_step_reward", "load_graph", "make_env"]
