"""The toy tool's datamodules: a vector file read into per-instance chunks, and a synthetic one that writes the file
first (the quickstart's and the tests').

Written the way docs/architecture.md ("A tool is a folder") says a user writes a tool's datamodules: subclasses of
:class:`~clova_train.datamodules.PromptTuningDataModule` whose ``build_instances`` returns the tool's training
instances (:class:`~toy_tool.tool.ToyInstance`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json
from clova_train.datamodules import PromptTuningDataModule
from .synthetic import TOY_CLASSES, TOY_DIM, TOY_NOISE, VECTOR_FILE, write_vector_file
from .tool import ToyInstance


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
        if not self.records.is_file():
            write_vector_file(self.records, self.synthetic_concepts, self.vectors_per_concept, self.dim, self.noise,
                              self.render_seed)
