"""Settings every environment of the reasoning-loop family shares, and their checks.

Each environment config (:class:`~clova_train.envs.hydra.reasoning_loop.ReasoningLoopConfig`,
:class:`~clova_train.envs.avis.information_seeking.InformationSeekingConfig`,
:class:`~clova_train.envs.hammr.dispatch.AgentDispatchConfig`) has an ``llm``, an ``embedder``, a call cache and a
task split (``train``, ``val`` or ``test``; ``eval`` is read as ``test``,
:func:`clova_train.envs.common.world.split_name`); :func:`coerce_models` turns their dict forms (``gymnasium.make`` keyword arguments) into configs and
:func:`shared_problems` checks them. The observation embedder defaults to 64-d hashing here, smaller than the
closed loop's retrieval embedder: the vector is a DQN's input.
"""

from __future__ import annotations

from typing import Any, get_args

from clova_train.core.checks import Problems
from clova_train.envs.common.world import ACCEPTED_SPLITS
from clova_train.llm.cache import CacheMode
from clova_train.llm.config import EmbedderConfig, LLMConfig

OBSERVATION_EMBEDDING_DIM = 64


def observation_embedder(**fields: Any) -> EmbedderConfig:
    """The environments' embedder config: ``fields`` over the default, 64-d hashing."""
    return EmbedderConfig(**{"dim": OBSERVATION_EMBEDDING_DIM, **fields})


def coerce_models(config: Any) -> None:
    """``config.llm`` / ``config.embedder`` given as plain dicts (YAML, ``gymnasium.make`` kwargs) made configs."""
    if isinstance(config.llm, dict):
        config.llm = LLMConfig(**config.llm)
    if isinstance(config.embedder, dict):
        config.embedder = observation_embedder(**config.embedder)


def shared_problems(config: Any, prefix: str) -> list[str]:
    """The checks of what every environment config has: ``llm``, ``embedder``, ``cache_mode`` and ``split``."""
    found = Problems(prefix)
    found.one_of("split", config.split, ACCEPTED_SPLITS)
    found.need(config.cache_mode in get_args(CacheMode), "cache_mode", config.cache_mode,
               f"must be one of {', '.join(get_args(CacheMode))}")
    return [*found.messages, *config.llm.problems(found.key("llm")), *config.embedder.problems(found.key("embedder"))]
