"""CLOVA's demonstration pool D = {D_ps, D_pf, D_cs, D_cf}: correct and incorrect plans and programs.

Each example is the task's instruction with the plan (``kind="plan"``) or program (``kind="program"``) the LLM
wrote for it, whether it solved the task, and for an incorrect one the critique reflection gave. Retrieval
embeds the new instruction and returns the most similar correct examples and, separately, the most similar
incorrect ones of a kind (the paper embeds with BERT; any :class:`~clova_train.llm.backends.EmbeddingBackend`
does: a transformers encoder, an OpenAI-compatible endpoint, or the offline hashing embedder).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from clova_train.core.atomic import write_text_atomic
from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json
from clova_train.llm.backends import EmbeddingBackend

Kind = Literal["plan", "program"]
KINDS: tuple[str, ...] = ("plan", "program")


@dataclass(frozen=True)
class Demonstration:
    """One in-context example: ``text`` is the plan or program written for ``instruction``."""

    kind: str
    correct: bool
    instruction: str
    text: str
    critique: str = ""
    task_id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DataError(f"demonstration kind must be one of {KINDS}, got {self.kind!r}")


class DemonstrationPool:
    """The four sub-pools, with retrieval by instruction similarity.

    Args:
        embedder: embeds instructions for retrieval (each distinct instruction is embedded once).
    """

    def __init__(self, embedder: EmbeddingBackend) -> None:
        self.embedder = embedder
        self.examples: list[Demonstration] = []
        self._vectors: dict[str, np.ndarray] = {}

    def add(self, example: Demonstration) -> bool:
        """Add ``example`` unless the same one is already stored; whether it was added."""
        if example in self.examples:
            return False
        self.examples.append(example)
        return True

    def counts(self) -> dict[str, int]:
        """Sizes of D_ps, D_pf, D_cs, D_cf."""
        return {f"{kind}_{'correct' if ok else 'incorrect'}": sum(e.kind == kind and e.correct == ok for e in self.examples)
                for kind in KINDS for ok in (True, False)}

    def _embed(self, texts: list[str]) -> np.ndarray:
        missing = sorted({t for t in texts if t not in self._vectors})
        if missing:
            vectors = np.asarray(self.embedder.embed(missing), dtype=np.float64)
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            for text, vector in zip(missing, vectors / np.maximum(norms, 1e-12)):
                self._vectors[text] = vector
        return np.stack([self._vectors[t] for t in texts])

    def retrieve(self, kind: str, instruction: str, correct: int, incorrect: int) -> tuple[list[Demonstration], list[Demonstration]]:
        """The ``correct`` most similar correct and ``incorrect`` most similar incorrect examples of ``kind``
        (most similar first; ties keep the order they were added in)."""
        chosen = []
        for ok, k in ((True, correct), (False, incorrect)):
            candidates = [e for e in self.examples if e.kind == kind and e.correct == ok]
            if k <= 0 or not candidates:
                chosen.append([])
                continue
            similarity = self._embed([e.instruction for e in candidates]) @ self._embed([instruction])[0]
            order = np.argsort(-similarity, kind="stable")[:k]
            chosen.append([candidates[i] for i in order])
        return chosen[0], chosen[1]

    def save(self, path: str | Path) -> Path:
        write_text_atomic(path, json.dumps([asdict(e) for e in self.examples], indent=1, ensure_ascii=False))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, embedder: EmbeddingBackend) -> DemonstrationPool:
        """Read a pool written by :meth:`save` (a JSON list of examples); a bad file names itself."""
        pool = cls(embedder)
        try:
            records = read_json(path, "demonstration pool")
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise TypeError("it must be a JSON list of objects")
            for record in records:
                pool.add(Demonstration(**record))
        except TypeError as err:
            raise DataError(f"demonstration pool {path}: {err}") from None
        return pool
