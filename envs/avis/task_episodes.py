"""Episodes of the information-seeking environments (AVIS, HAMMR) drawn from a benchmark's own task files.

With ``tasks`` in an AVIS or HAMMR config (:class:`~clova_train.envs.tasks.source.BenchmarkTasksConfig`, the section
HYDRA's environment reads too), an episode plays a task of the benchmark's files instead of the offline world:
training draws one at random, evaluation reset with seed ``s`` plays task ``s mod n`` (every policy compared on the
same seeds sees the same tasks); the tools run on the task's image through the model-backed ``ImagePatch`` tools
(:mod:`clova_train.envs.avis.model_tools`), loaded once per process and shared by every environment and every agent
it calls; a final answer scores the benchmark's metric (VQA accuracy, GQA exact match, A-OKVQA's, RefCOCO's), the
reward ``answer_reward * m``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from clova_train.envs.avis.model_tools import ModelSeekingTools
from clova_train.envs.avis.seeking_world import SeekingWorld
from clova_train.envs.common.world import Task, split_name
from clova_train.envs.tasks.metrics import eq3_answer_terms
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.envs.tasks.source import BenchmarkTasksConfig, episode_index, gold_text, task_by_id
from clova_train.sandbox import ToolAPI
from clova_train.tools.image_patch import ImagePatchTools


class TaskFileEpisodes:
    """The tasks of one split of a ``tasks`` section, their tools and their metric (see the module docstring).

    Args:
        tasks: the config's ``tasks`` section.
        split: ``train``, ``val`` or ``test`` (``eval``: ``test``): which tasks the episodes play
            (:meth:`~clova_train.envs.tasks.source.BenchmarkTasksConfig.split_tasks`).
    """

    def __init__(self, tasks: BenchmarkTasksConfig, split: str) -> None:
        self.config, self.split = tasks, split_name(split)
        chosen = tasks.split_tasks(self.split)
        self.files, self.tasks, self.skipped, self._where = chosen.files, chosen.tasks, chosen.skipped, chosen.where
        self.client = tasks.tools.client()  # loaded (or connected) once per process, shared by every environment

    def where(self) -> str:
        return self._where

    def draw(self, seed: int | None, options: dict[str, Any], rng: np.random.Generator) -> BenchmarkTask:
        """The task of an episode: ``options["task_id"]`` if given, else by the seed / the generator."""
        if options.get("task_id") is not None:
            return task_by_id(self.tasks, options["task_id"], self.where())
        return self.tasks[episode_index(len(self.tasks), self.split, seed, rng.integers)]

    def image_tools(self, task: BenchmarkTask, llm: Any = None) -> ImagePatchTools:
        """The model-backed ``ImagePatch`` tools of the task's image (``llm``: answers ``llm_query``)."""
        tools = self.config.tools
        return ImagePatchTools(task.image, self.client, tools.labels, tools.crop_margin, llm=llm)

    def seeking_tools(self, task: BenchmarkTask, world: SeekingWorld) -> ModelSeekingTools:
        """AVIS's actions over the task's image."""
        return ModelSeekingTools(task, self.image_tools(task), world)

    def hydra_tools(self, task: BenchmarkTask) -> ToolAPI:
        """A called ``hydra`` agent's ``ImagePatch`` API over the task's image."""
        return self.image_tools(task)

    def score(self, answer: str | None, task: BenchmarkTask) -> float:
        """The files' metric of a final answer (0.0 for no answer)."""
        if answer is None:
            return 0.0
        return eq3_answer_terms(self.files.metric_name, answer, task)[1]


def episode_terms(task: Task | BenchmarkTask, answer: str | None,
                  episodes: TaskFileEpisodes | None) -> dict[str, Any]:
    """What an information-seeking step reports of its task and answer: ``gold``, ``correct``, ``score`` (the
    benchmark's metric, or 1/0 in the offline world) and ``question_kind``."""
    if isinstance(task, BenchmarkTask):
        score = episodes.score(answer, task) if episodes is not None else 0.0
        return {"gold": gold_text(task), "correct": score >= 1.0, "score": score, "question_kind": task.answer_type}
    correct = answer is not None and answer == task.answer
    return {"gold": task.answer, "correct": correct, "score": float(correct), "question_kind": task.question_type}


def sub_task(task: Task | BenchmarkTask, question: str, make_offline: Any) -> Task | BenchmarkTask:
    """The task a called agent answers: the same image and ground truth, its own question (``make_offline(task_id,
    question)`` builds an offline world's)."""
    if isinstance(task, BenchmarkTask):
        return replace(task, question=question)
    return make_offline(task.task_id, question)
