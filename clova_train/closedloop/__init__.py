"""CLOVA's closed loop: inference -> reflection -> data collection -> prompt tuning (``clova-train loop``).

Runtime parts only (no Lightning): the loop drives prompt-tuning fits through a ``Learner`` that the entry
point supplies (:mod:`clova_train.closedloop.runner` runs ``clova-train fit`` for each).
"""

from clova_train.closedloop.collectors import (
    Collected, CollectionRequest, FolderImageSource, GroundingCollector, HttpImageSource, ImageCollector,
    SourceUnavailable, VqaCollector,
)
from clova_train.closedloop.demonstrations import Demonstration, DemonstrationPool
from clova_train.closedloop.inference import Inference, InferenceSettings, Trace
from clova_train.closedloop.journal import Journal
from clova_train.closedloop.loop import ClosedLoop, FitResult, LoopPaused, LoopSettings, LoopTool
from clova_train.closedloop.reflection import Critique, Templates, parse_local_verdict, parse_reflection
from clova_train.closedloop.tasks import LoopTask, read_tasks

__all__ = [
    "ClosedLoop", "Collected", "CollectionRequest", "Critique", "Demonstration", "DemonstrationPool", "FitResult",
    "FolderImageSource", "GroundingCollector", "HttpImageSource", "ImageCollector", "Inference", "InferenceSettings",
    "Journal", "LoopPaused", "LoopSettings", "LoopTask", "LoopTool", "SourceUnavailable", "Templates", "Trace", "VqaCollector",
    "parse_local_verdict", "parse_reflection", "read_tasks",
]
