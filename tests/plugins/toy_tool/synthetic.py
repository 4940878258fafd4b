"""The toy tool's synthetic data: concept vectors, a fixed centroid per concept name plus noise.

Written the way docs/architecture.md ("A tool is a folder") says a user writes a tool's synthetic data writer. The
centroids are seeded by the concept's name alone, so the data and the tiny model (:mod:`toy_tool.tiny`) agree
whatever their seeds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

TOY_CLASSES = ("red", "green", "blue", "purple")
TOY_DIM = 8
TOY_NOISE = 0.15  # scale of the noise around a concept's centroid (its norm is about 3)
# What the pretrained toy gets wrong: ``purple`` vectors labelled ``blue`` (the concept its quickstart learns).
TOY_MISCONCEPTIONS = {"purple": "blue"}
HELD_OUT_SEED = 1_000  # noise seed of vectors no data file holds (the demo's and the tests' queries)
VECTOR_FILE = "vectors.json"


def concept_centroid(concept: str, dim: int = TOY_DIM) -> torch.Tensor:
    """The centroid of ``concept``'s vectors: seeded by its name only (data and model builders agree)."""
    seed = int.from_bytes(hashlib.sha256(concept.encode()).digest()[:8], "little")
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def concept_vectors(concept: str, count: int, dim: int = TOY_DIM, noise: float = TOY_NOISE,
                    seed: int = 0) -> torch.Tensor:
    """``[count, dim]`` vectors of ``concept``: its centroid plus Gaussian noise of scale ``noise``."""
    generator = torch.Generator().manual_seed(seed)
    return concept_centroid(concept, dim) + noise * torch.randn(count, dim, generator=generator)


def held_out(concept: str, count: int = 5) -> list[list[float]]:
    """``count`` vectors of ``concept`` that no data file holds (another noise seed), as JSON lists."""
    return concept_vectors(concept, count, seed=HELD_OUT_SEED).tolist()


def write_vector_file(path: Path, concepts: Sequence[str], vectors_per_concept: int, dim: int = TOY_DIM,
                      noise: float = TOY_NOISE, seed: int = 0) -> Path:
    """Write ``{"vectors": [{"concept": c, "vector": [...]}, ...]}`` to ``path``: ``vectors_per_concept`` vectors
    of each concept (concept ``k``'s noise seeded ``seed + k``); returns ``path``."""
    rows = [{"concept": concept, "vector": vector.tolist()}
            for k, concept in enumerate(concepts)
            for vector in concept_vectors(concept, vectors_per_concept, dim, noise, seed + k)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"vectors": rows}), encoding="utf-8")
    return path
