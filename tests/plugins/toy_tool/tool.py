"""The toy tool's class: a frozen linear classifier over small vectors whose prompt is a per-feature gain on the input
(``x * (1 + p)``: zero is the unmodified classifier), and its training instance.

Written the way docs/architecture.md ("A tool is a folder") says a user writes a tool class: one
:class:`~clova_train.tools.base.PromptTool` subclass with its :class:`~clova_train.tools.contracts.TrainingInstance`.
The configs name it ``toy_tool.tool.ToyPromptClassifier``; ``clova-train export`` and ``serve``, fresh processes that
import no module a file names, find it through the recipe the package declares (:mod:`toy_tool.recipe`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from clova_train.core.errors import DataError, ModelError
from clova_train.core.safe_files import read_json
from clova_train.tools.base import PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance

CONFIG_FILE = "toy_classifier.json"
WEIGHT_FILE = "toy_classifier.safetensors"


def load_toy_model(directory: str | Path) -> tuple[nn.Linear, list[str]]:
    """The classifier and its class names from a :func:`toy_tool.tiny.build_toy_model` directory (errors name the
    directory)."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHT_FILE).is_file():
        raise ModelError(f"toy classifier directory {directory} needs {CONFIG_FILE} and {WEIGHT_FILE}")
    config = read_json(directory / CONFIG_FILE, "toy classifier config")
    classifier = nn.Linear(int(config["dim"]), len(config["classes"]))
    classifier.load_state_dict(load_file(str(directory / WEIGHT_FILE)))
    return classifier, [str(c) for c in config["classes"]]


@dataclass(kw_only=True)
class ToyInstance(TrainingInstance):
    """One vector of ``concept`` to tune a prompt for.

    Args:
        vectors: ``[1 + K, dim]``: the instance's vector, then ``K`` negative training vectors.
        labels: the concept of each training vector.
        val_vectors: ``[V, dim]`` held-out vectors (positives of the concept and negatives).
        val_labels: the concept of each held-out vector.
    """

    vectors: torch.Tensor
    labels: list[str]
    val_vectors: torch.Tensor
    val_labels: list[str]


@dataclass
class ToyChunk:
    """Prompt-independent tensors of a chunk: every vector, which instance it belongs to and its class index."""

    vectors: torch.Tensor
    owner: torch.Tensor
    labels: torch.Tensor
    first: torch.Tensor
    val_vectors: torch.Tensor
    val_owner: torch.Tensor
    val_labels: torch.Tensor
    concepts: list[str]


class ToyPromptClassifier(PromptTool):
    """A frozen linear classifier whose input features get learned gains: ``logits = W (x * (1 + p)) + b``.

    A gain rather than an offset: an offset adds the same ``W p`` to every input's logits, so a prompt that turns
    one concept's vectors to it turns its look-alikes as well, and the gate (held-out negatives) refuses it.

    Args:
        model_name: a directory written by :func:`toy_tool.tiny.build_toy_model`.
        gate_negatives: the gate also refuses a prompt that pulls a held-out negative to the concept.
    """

    name: ClassVar[str] = "toy_classifier"
    default_lr: ClassVar[float] = 0.1
    default_steps: ClassVar[int] = 60
    served_operations: ClassVar[tuple[str, ...]] = ("classify",)
    request_image_field: ClassVar[str] = "vectors"  # what `clova-train predict` fills from a folder input
    request_path_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model_name: str, gate_negatives: bool = True) -> None:
        super().__init__()
        self.model_name = model_name
        self.gate_negatives = gate_negatives
        classifier, self.classes = load_toy_model(model_name)
        self.classifier = self.freeze(classifier)
        digest = hashlib.sha256()
        for key, value in sorted(self.classifier.state_dict().items()):
            digest.update(key.encode() + value.numpy().tobytes())
        self.identity = f"toy:{digest.hexdigest()[:16]}"

    @property
    def prompt_shape(self) -> tuple[int]:
        return (self.classifier.in_features,)

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    def init_args(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "gate_negatives": self.gate_negatives}

    def init_scale(self) -> float:
        return 0.01

    def logits(self, vectors: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """The prompted path: ``(x * (1 + p)) W^T + b`` per row (``prompts`` one row per vector, or ``None``)."""
        inputs = vectors if prompts is None else vectors * (1 + prompts)
        return inputs @ self.classifier.weight.T + self.classifier.bias

    # ------------------------------------------------------------------ training hooks
    def class_index(self, concept: str) -> int:
        if concept not in self.classes:
            raise DataError(f"concept {concept!r} is not a class of the toy classifier ({', '.join(self.classes)})")
        return self.classes.index(concept)

    def check_instance(self, instance: ToyInstance) -> None:
        for concept in {str(instance.concept), *instance.labels, *instance.val_labels}:
            self.class_index(concept)

    def prepare(self, instances: Sequence[ToyInstance]) -> ToyChunk:
        def stacked(vectors: list[torch.Tensor], labels: list[list[str]]) -> tuple[torch.Tensor, ...]:
            owner = torch.cat([torch.full((len(v),), i) for i, v in enumerate(vectors)])
            index = torch.tensor([self.class_index(c) for group in labels for c in group])
            return torch.cat(vectors).to(self.device), owner.to(self.device), index.to(self.device)

        vectors, owner, labels = stacked([x.vectors for x in instances], [x.labels for x in instances])
        val_vectors, val_owner, val_labels = stacked([x.val_vectors for x in instances],
                                                     [x.val_labels for x in instances])
        sizes = torch.tensor([len(x.vectors) for x in instances])
        first = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]).to(self.device)
        return ToyChunk(vectors, owner, labels, first, val_vectors, val_owner, val_labels,
                        [str(x.concept) for x in instances])

    def instance_losses(self, ctx: ToyChunk, prompts: torch.Tensor) -> torch.Tensor:
        per_vector = F.cross_entropy(self.logits(ctx.vectors, prompts[ctx.owner]), ctx.labels, reduction="none")
        n = prompts.shape[0]
        total = torch.zeros(n, dtype=per_vector.dtype, device=per_vector.device).index_add(0, ctx.owner, per_vector)
        return total / torch.bincount(ctx.owner, minlength=n).to(per_vector.dtype)

    def gate(self, ctx: ToyChunk, prompts: torch.Tensor) -> list[GateResult]:
        predicted = self.logits(ctx.val_vectors, prompts[ctx.val_owner]).argmax(-1).tolist()
        rejections: list[list[Rejection]] = [[] for _ in ctx.concepts]
        for i, label, pred in zip(ctx.val_owner.tolist(), ctx.val_labels.tolist(), predicted):
            concept, truth, answer = ctx.concepts[i], self.classes[label], self.classes[pred]
            if truth == concept and answer != concept:
                rejections[i].append(Rejection("held-out positive", f"a {truth} vector classified as {answer!r}"))
            elif self.gate_negatives and truth != concept and answer == concept:
                rejections[i].append(Rejection("held-out negative", f"a {truth} vector classified as {concept!r}"))
        return [GateResult(tuple(r)) for r in rejections]

    def pool_features(self, ctx: ToyChunk) -> torch.Tensor:
        return F.normalize(ctx.vectors[ctx.first], dim=-1)

    def unmodified_outputs(self, ctx: ToyChunk) -> torch.Tensor:
        return self.classifier(ctx.vectors)

    def prompted_outputs(self, ctx: ToyChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        return self.logits(ctx.vectors, None if prompts is None else prompts[ctx.owner])

    # ------------------------------------------------------------------ serving
    def classify(self, lookup: PromptLookup, vectors: torch.Tensor,
                 concept: str | None = None) -> tuple[list[str], bool]:
        """The class of each of ``vectors`` ``[q, dim]``, through ``concept``'s ensembled prompt when the pool has
        one (else the unmodified classifier); also whether a prompt was used."""
        prompts = None if concept is None else lookup.prompts_for(concept, F.normalize(vectors, dim=-1))
        predicted = self.logits(vectors, prompts).argmax(-1).tolist()
        return [self.classes[i] for i in predicted], prompts is not None

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"vectors": [[floats]], "concept": c}`` (``concept`` optional) -> ``{"labels": [...], "prompted": b}``."""
        vectors = request.get("vectors")
        if not isinstance(vectors, list) or not vectors or not all(
            isinstance(row, list) and len(row) == self.feature_dim and all(isinstance(v, (int, float)) for v in row)
            for row in vectors
        ):
            raise DataError(f"a toy request needs 'vectors': a non-empty list of lists of {self.feature_dim} numbers")
        concept = request.get("concept")
        if concept is not None and not isinstance(concept, str):
            raise DataError("request field 'concept' must be a string")
        queries = torch.tensor(vectors, dtype=torch.float32, device=self.device)
        labels, prompted = self.classify(lookup, queries, concept)
        return {"labels": labels, "prompted": prompted}
