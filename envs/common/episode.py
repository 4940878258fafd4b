"""What a finished episode scored, read from its last ``info`` the same way by every learner, rule and log."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def episode_score(info: Mapping[str, Any]) -> float:
    """The final answer's metric in [0, 1]: ``info["score"]`` (a benchmark's metric, e.g. VQA accuracy's 0.3 steps),
    or 1.0 / 0.0 by ``info["correct"]`` for environments that only say right or wrong."""
    if "score" in info:
        return float(info["score"])
    return float(bool(info.get("correct", False)))
