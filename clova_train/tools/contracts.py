"""Typed contracts of per-instance prompt tuning, shared by the tools, the engine and the datamodules.

* :class:`TrainingInstance`: one instance to tune a prompt for (each tool subclasses it with its payload);
* :class:`Rejection` / :class:`GateResult`: why the validation gate refused an instance (kind + detail);
* :class:`InstanceRecord`: what the engine keeps of a finished instance (checkpoints, summary, pool);
* :class:`ChunkPlan` / :class:`ChunkSource`: the one hand-off between a prompt-tuning module and its
  datamodule (chunk size, the instances, which of them are finished, how many chunks were trained).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(kw_only=True)
class TrainingInstance:
    """One training instance: it gets its own prompt, tuned alone and gated on its own validation data.

    Args:
        instance_id: unique, stable id (it seeds the prompt's initialisation and names it in the pool).
        concept: the visual concept the prompt is stored under; ``None`` for tools without concepts (VQA).
        keep_unchanged: store a zero prompt without tuning (an example the tool already gets right; the
            paper stores those so that retrieval near them leaves the tool as it is).
    """

    instance_id: str
    concept: str | None = None
    keep_unchanged: bool = False


@dataclass(frozen=True)
class Rejection:
    """One reason the gate refused an instance: a fixed ``kind`` (counted in summaries) and a free ``detail``."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


@dataclass(frozen=True)
class GateResult:
    """Outcome of the validation gate for one instance: it passed iff there is no rejection."""

    rejections: tuple[Rejection, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.rejections

    @classmethod
    def failed(cls, kind: str, detail: str = "") -> GateResult:
        return cls((Rejection(kind, detail),))


@dataclass
class InstanceRecord:
    """A finished instance (accepted or rejected), as kept in checkpoints and written to the summary.

    ``feature`` and ``prompt`` are set for accepted instances (and for rejected ones when the run keeps
    them for analysis); only accepted ones enter the pool. ``loss_curve`` is the instance's loss at each inner
    step it took (its learning curve; ``clova-train report`` draws them).
    """

    instance_id: str
    concept: str | None
    accepted: bool
    rejections: list[Rejection] = field(default_factory=list)
    loss: float = float("nan")
    steps: int = 0
    feature: torch.Tensor | None = None
    prompt: torch.Tensor | None = None
    loss_curve: list[float] = field(default_factory=list)

    def to_state(self) -> dict[str, Any]:
        """Plain types and tensors only, so checkpoints load with ``torch.load(weights_only=True)``."""
        return {
            "instance_id": self.instance_id,
            "concept": self.concept,
            "accepted": self.accepted,
            "rejections": [[r.kind, r.detail] for r in self.rejections],
            "loss": self.loss,
            "steps": self.steps,
            "feature": self.feature,
            "prompt": self.prompt,
            "loss_curve": list(self.loss_curve),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InstanceRecord:
        return cls(
            state["instance_id"], state["concept"], bool(state["accepted"]),
            [Rejection(kind, detail) for kind, detail in state.get("rejections", [])],
            float(state.get("loss", float("nan"))), int(state.get("steps", 0)), state.get("feature"),
            state.get("prompt"), [float(v) for v in state.get("loss_curve", [])],
        )

    def summary(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "concept": self.concept,
            "accepted": self.accepted,
            "rejections": [{"kind": r.kind, "detail": r.detail} for r in self.rejections],
            "loss": self.loss,
            "steps": self.steps,
            "loss_curve": [float(f"{v:.5g}") for v in self.loss_curve],
        }


@dataclass(frozen=True)
class ChunkPlan:
    """What a prompt-tuning datamodule tells its module when they connect.

    Args:
        chunk_size: instances tuned together in one training step (the only chunk-size setting).
        instance_ids: every instance of the run, finished or not (the module counts what is pending).
        instances: the instances themselves (the module has the tool check them before training).
    """

    chunk_size: int
    instance_ids: tuple[str, ...]
    instances: InstanceDataset


@runtime_checkable
class ChunkSource(Protocol):
    """A datamodule that feeds per-instance prompt tuning (see ``clova_train.datamodules.prompt_tuning.chunks``)."""

    def connect(self, finished: Callable[[], set[str]], chunks_done: Callable[[], int] = int) -> ChunkPlan:
        """Learn which instances are finished (asked when a pass over the data starts) and how many chunks of
        the current epoch were trained (a resumed run's stream counts them in its length); describe the run."""
        ...


class InstanceDataset(Protocol):
    """Map-style dataset of :class:`TrainingInstance` with their ids in order."""

    instance_ids: Sequence[str]

    def __getitem__(self, index: int) -> TrainingInstance: ...

    def __len__(self) -> int: ...
