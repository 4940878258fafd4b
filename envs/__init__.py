"""Gymnasium environments of clova-train (installed as ``clova_train.envs``).

``gymnasium.make("clova_train/ReasoningLoop-v0", config=ReasoningLoopConfig(...))`` builds HYDRA's
planner -> controller -> reasoner -> textualizer loop (:class:`ReasoningLoopEnv`).
"""

import gymnasium

from clova_train.envs.reasoning_loop import (
    EmbedderConfig,
    LLMConfig,
    ReasoningLoopConfig,
    ReasoningLoopEnv,
    eq3_step_reward,
)

ENV_ID = "clova_train/ReasoningLoop-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="clova_train.envs.reasoning_loop:ReasoningLoopEnv")

__all__ = ["ENV_ID", "EmbedderConfig", "LLMConfig", "ReasoningLoopConfig", "ReasoningLoopEnv", "eq3_step_reward"]
