"""A toy prompt tool written the way docs/prompt-tools.md's "Adding a tool" says a user writes one, outside the package.

The frozen network is a linear classifier over small vectors; a prompt is a per-feature gain on the input vector
(``x * (1 + p)``: zero is the unmodified classifier). It has every piece a real tool has, each a few lines:

* the tool class (:class:`ToyPromptClassifier`, a :class:`~clova_train.tools.base.PromptTool`) and its training
  instance (:class:`ToyInstance`);
* its datamodules: :class:`ToyVectorDataModule` reads a vector file, :class:`SyntheticToyDataModule` writes one
  first (both :class:`~clova_train.datamodules.PromptTuningDataModule`);
* its "tiny model": :func:`build_toy_model` writes the frozen classifier's weights to a directory;
* its registry entry (:data:`TOY_TINY_MODEL`, :func:`toy_recipe`) and its configs (:func:`write_toy_configs`).

Concept vectors are a fixed centroid per concept name plus noise, so the data and the model agree whatever their
seeds. The pretrained toy classifier learns every concept but ``purple``, whose vectors it was taught to call
``blue``: the misconception a prompt fixes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from clova_train.core.errors import DataError, ModelError
from clova_train.core.safe_files import read_json
from clova_train.datamodules import PromptTuningDataModule
from clova_train.quickstart.registry import TinyModel, ToolRecipe
from clova_train.tools.tiny_common import torch_threads
from clova_train.tools.base import PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance

MODULE = __name__  # "helpers.toy_tool": how configs and the registry name these classes
CONFIG_FILE = "toy_classifier.json"
WEIGHT_FILE = "toy_classifier.safetensors"
VECTOR_FILE = "vectors.json"
TOY_CLASSES = ("red", "green", "blue", "purple")
TOY_DIM = 8
TOY_NOISE = 0.15  # scale of the noise around a concept's centroid (its norm is about 3)
# What the pretrained toy gets wrong: ``purple`` vectors labelled ``blue`` (the concept its quickstart learns).
TOY_MISCONCEPTIONS = {"purple": "blue"}


# ---------------------------------------------------------------------- synthetic vectors
def concept_centroid(concept: str, dim: int) -> torch.Tensor:
    """The centroid of ``concept``'s vectors: seeded by its name only (data and model builders agree)."""
    seed = int.from_bytes(hashlib.sha256(concept.encode()).digest()[:8], "little")
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def concept_vectors(concept: str, count: int, dim: int, noise: float, seed: int) -> torch.Tensor:
    """``[count, dim]`` vectors of ``concept``: its centroid plus Gaussian noise of scale ``noise``."""
    generator = torch.Generator().manual_seed(seed)
    return concept_centroid(concept, dim) + noise * torch.randn(count, dim, generator=generator)


# ---------------------------------------------------------------------- the "tiny model"
def build_toy_model(directory: str | Path, seed: int = 0, pretrain_steps: int = 50) -> Path:
    """Write a toy classifier into ``directory`` (config JSON and safetensors weights), the way a tiny-model
    builder of the registry does: random weights, then ``pretrain_steps`` of full-batch Adam on synthetic vectors
    of :data:`TOY_CLASSES` with :data:`TOY_MISCONCEPTIONS` as their labels (0 keeps the random weights)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    classifier = nn.Linear(TOY_DIM, len(TOY_CLASSES))
    vectors = torch.cat([concept_vectors(c, 32, TOY_DIM, TOY_NOISE, seed + k) for k, c in enumerate(TOY_CLASSES)])
    labels = torch.tensor([TOY_CLASSES.index(TOY_MISCONCEPTIONS.get(c, c)) for c in TOY_CLASSES for _ in range(32)])
    optimizer = torch.optim.Adam(classifier.parameters(), lr=0.1)
    # one thread, as the package's tiny-model builders: the same model on every host (and no thread hand-offs,
    # which cost more than these tiny steps)
    with torch_threads(1):
        for _ in range(pretrain_steps):
            optimizer.zero_grad()
            F.cross_entropy(classifier(vectors), labels).backward()
            optimizer.step()
    (directory / CONFIG_FILE).write_text(json.dumps({"dim": TOY_DIM, "classes": list(TOY_CLASSES)}), encoding="utf-8")
    save_file({k: v.detach().contiguous() for k, v in classifier.state_dict().items()}, str(directory / WEIGHT_FILE))
    return directory


def load_toy_model(directory: str | Path) -> tuple[nn.Linear, list[str]]:
    """The classifier and its class names from a :func:`build_toy_model` directory (errors name the directory)."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHT_FILE).is_file():
        raise ModelError(f"toy classifier directory {directory} needs {CONFIG_FILE} and {WEIGHT_FILE}")
    config = read_json(directory / CONFIG_FILE, "toy classifier config")
    classifier = nn.Linear(int(config["dim"]), len(config["classes"]))
    classifier.load_state_dict(load_file(str(directory / WEIGHT_FILE)))
    return classifier, [str(c) for c in config["classes"]]


# ---------------------------------------------------------------------- the tool
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
        model_name: a directory written by :func:`build_toy_model`.
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


# ---------------------------------------------------------------------- the datamodules
class ToyInstances:
    """Map-style dataset of :class:`ToyInstance`: one per training vector of a learned concept."""

    def __init__(self, items: list[ToyInstance]) -> None:
        self.items = items
        self.instance_ids = [item.instance_id for item in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ToyInstance:
        return self.items[index]


class ToyVectorDataModule(PromptTuningDataModule):
    """A vector file (``{"vectors": [{"concept": c, "vector": [...]}, ...]}``) -> per-instance chunks.

    The first ``val_per_concept`` vectors of each concept validate; every other vector of a learned concept is one
    instance, tuned with ``negatives_per_instance`` vectors of other concepts and gated on the concept's held-out
    vectors and as many held-out negatives.

    Args:
        records: the vector file.
        concepts: concepts to learn (default: all); the others are negatives only.
        val_per_concept: held-out vectors per concept.
        negatives_per_instance: negative training vectors per instance.
        seed: seed of the choice of negatives.
        chunk_size: instances tuned together in one training step.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, records: str, concepts: list[str] | None = None, val_per_concept: int = 2,
                 negatives_per_instance: int = 2, seed: int = 0, chunk_size: int = 32, num_workers: int = 0) -> None:
        super().__init__(chunk_size, num_workers)
        self.records = Path(records)
        self.concepts = concepts
        self.val_per_concept = val_per_concept
        self.negatives_per_instance = negatives_per_instance
        self.seed = seed

    def build_instances(self) -> ToyInstances:
        if not self.records.is_file():
            raise DataError(f"toy vector file not found: {self.records}")
        by_concept: dict[str, list[torch.Tensor]] = {}
        for row in read_json(self.records, "toy vector file")["vectors"]:
            by_concept.setdefault(str(row["concept"]), []).append(torch.tensor(row["vector"], dtype=torch.float32))
        learned = self.concepts if self.concepts is not None else sorted(by_concept)
        val = {c: v[: self.val_per_concept] for c, v in by_concept.items()}
        train = {c: v[self.val_per_concept :] for c, v in by_concept.items()}
        items = []
        for concept in learned:
            if not train.get(concept):
                raise DataError(f"{self.records}: concept {concept!r} has no vectors left to train on")
            others = [(v, c) for c in sorted(by_concept) if c != concept for v in train[c]]
            val_others = [(v, c) for c in sorted(by_concept) if c != concept for v in val[c]]
            for k, vector in enumerate(train[concept]):
                rng = random.Random(f"{self.seed}:{concept}:{k}")
                negatives = rng.sample(others, min(self.negatives_per_instance, len(others)))
                val_negatives = rng.sample(val_others, min(self.val_per_concept, len(val_others)))
                items.append(ToyInstance(
                    instance_id=f"{concept}/{k:03d}", concept=concept,
                    vectors=torch.stack([vector, *(v for v, _ in negatives)]),
                    labels=[concept, *(c for _, c in negatives)],
                    val_vectors=torch.stack([*val[concept], *(v for v, _ in val_negatives)]),
                    val_labels=[concept] * len(val[concept]) + [c for _, c in val_negatives],
                ))
        return ToyInstances(items)


class SyntheticToyDataModule(ToyVectorDataModule):
    """:class:`ToyVectorDataModule` over synthetic concept vectors, written to ``root/vectors.json`` if missing.

    Args:
        root: where the vector file is (or will be) written.
        synthetic_concepts: concepts to write vectors of.
        vectors_per_concept: vectors per concept (``val_per_concept`` of them validate).
        dim: vector size (the toy classifier's input size).
        noise: scale of the noise around each concept's centroid.
        render_seed: seed of the noise.
        **kwargs: the arguments of :class:`ToyVectorDataModule` but ``records``.
    """

    def __init__(self, root: str = "checkpoints/data/synthetic_toy",
                 synthetic_concepts: list[str] = list(TOY_CLASSES),  # noqa: B006 (shown in --help)
                 vectors_per_concept: int = 6, dim: int = TOY_DIM, noise: float = TOY_NOISE, render_seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(str(Path(root) / VECTOR_FILE), **kwargs)
        self.root = Path(root)
        self.synthetic_concepts = list(synthetic_concepts)
        self.vectors_per_concept, self.dim, self.noise, self.render_seed = vectors_per_concept, dim, noise, render_seed

    def prepare_data(self) -> None:
        if self.records.is_file():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        rows = [
            {"concept": concept, "vector": vector.tolist()}
            for k, concept in enumerate(self.synthetic_concepts)
            for vector in concept_vectors(concept, self.vectors_per_concept, self.dim, self.noise, self.render_seed + k)
        ]
        self.records.write_text(json.dumps({"vectors": rows}), encoding="utf-8")


# ---------------------------------------------------------------------- registry entry and configs
TOY_TINY_MODEL = TinyModel("toy", f"{MODULE}:build_toy_model", 50,
                           "a linear classifier over 8-dimensional concept vectors, purple taught as blue")


def toy_recipe(quickstart_config: Path, paper_config: Path) -> ToolRecipe:
    """The toy's registry entry (its configs are written per test, so their paths are arguments)."""
    return ToolRecipe("toy", "CLASSIFY (toy)", f"{MODULE}.ToyPromptClassifier", f"{MODULE}.ToyVectorDataModule",
                      f"{MODULE}.SyntheticToyDataModule", TOY_TINY_MODEL.kind, str(quickstart_config),
                      str(paper_config))


QUICKSTART_CONFIG = """\
# Quickstart of the toy prompt tool: the toy classifier calls purple vectors blue; a prompt per purple vector.
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  default_root_dir: {run_dir}
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: clova_train.models.PromptTuning
  init_args:
    tool:
      class_path: {module}.ToyPromptClassifier
      init_args:
        model_name: {model_dir}
    lr: 0.1
    steps: 60
data:
  class_path: {module}.SyntheticToyDataModule
  init_args:
    root: {data_root}
    concepts: [purple]
    vectors_per_concept: 6
    val_per_concept: 2
    chunk_size: 8
"""

PAPER_CONFIG = """\
# The toy tool on your own vector file (the shape of a paper config: real data, the tool's default steps).
seed_everything: 0
trainer:
  accelerator: auto
  devices: auto
  max_epochs: 1
  default_root_dir: checkpoints/toy
model:
  class_path: clova_train.models.PromptTuning
  init_args:
    tool:
      class_path: {module}.ToyPromptClassifier
      init_args:
        model_name: checkpoints/models/toy
data:
  class_path: {module}.ToyVectorDataModule
  init_args:
    records: data/toy/vectors.json
    chunk_size: 32
"""


def write_toy_configs(directory: Path, model_dir: Path, data_root: Path, run_dir: Path) -> tuple[Path, Path]:
    """Write the toy's quickstart config (this model, data and run directory) and paper config into ``directory``;
    returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    quickstart, paper = directory / "toy_prompt.yaml", directory / "toy_prompt_paper.yaml"
    quickstart.write_text(QUICKSTART_CONFIG.format(module=MODULE, model_dir=json.dumps(str(model_dir)),
                                                   data_root=json.dumps(str(data_root)),
                                                   run_dir=json.dumps(str(run_dir))), encoding="utf-8")
    paper.write_text(PAPER_CONFIG.format(module=MODULE), encoding="utf-8")
    return quickstart, paper
