"""Validation of a pool as it is served, before a fit's prompts join it.

The fit's gate validates each tuned prompt on its own. Serving does something else: CLASSIFY ensembles the
``top_k`` stored prompts most similar to the query (a similarity-weighted average of prompts) for each label
that has any, and compares labels scored with different prompts. An ensemble of prompts that each passed can
still move held-out images the wrong way: on the offline world, five accepted purple prompts took purple
objects from 92 to 17 correct of 195 (seed 1), and purple prompts pulled blue objects to purple (seed 0).

So, before merging, the loop classifies the tool's held-out images (every label's ``val/`` folder of every
collection so far, each distinct image once: the concepts learned earlier are checked too) with the served pool
as it is and with the fit's prompts merged in, and merges only if the merged pool makes fewer errors, the
criterion the fit's gate applies per prompt (``gate_criterion: fewer_errors``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from clova_train.closedloop.collectors import concept_folder
from clova_train.closedloop.toolapi import to_input_size
from clova_train.core.errors import DataError
from clova_train.tools.images import list_images, load_image_uint8
from clova_train.tools.prompt_server import PromptToolServer


@dataclass(frozen=True)
class HeldOutErrors:
    """How a served pool did on a collection's held-out images: ``errors`` of ``images``, and which."""

    errors: int
    images: int
    wrong: tuple[str, ...] = ()


class PoolCheck(Protocol):
    """Counts a served pool's errors on the held-out part of collection folders."""

    def errors(self, server: PromptToolServer, directories: list[Path]) -> HeldOutErrors: ...


class HeldOutClassification:
    """Pool check for CLASSIFY: each label's ``val/`` images of the collections, classified over ``labels``.

    Args:
        labels: the labels CLASSIFY chooses among (the loop's).
        batch_size: images per classification call.
    """

    def __init__(self, labels: list[str], batch_size: int = 32) -> None:
        self.labels, self.batch_size = list(labels), batch_size

    def _held_out(self, directories: list[Path], size: tuple[int, int]) -> tuple[torch.Tensor, list[str], list[str]]:
        images, truths, names, seen = [], [], [], set()
        for directory, label in ((Path(d), label) for d in directories for label in self.labels):
            folder = directory / concept_folder(label) / "val"
            for path in list_images(folder) if folder.is_dir() else []:
                digest = hashlib.sha256(path.read_bytes()).digest()
                if (label, digest) in seen:  # negatives repeat from one collection to the next
                    continue
                seen.add((label, digest))
                try:
                    pixels = load_image_uint8(path).float()[None] / 255.0
                except (OSError, ValueError) as err:
                    raise DataError(f"held-out image {path}: cannot be read ({err})") from None
                images.append(to_input_size(pixels, size))
                truths.append(label)
                names.append(f"{directory.name}/{concept_folder(label)}/val/{path.name}")
        return (torch.cat(images) if images else torch.empty(0, 3, *size)), truths, names

    def errors(self, server: PromptToolServer, directories: list[Path]) -> HeldOutErrors:
        images, truths, names = self._held_out(directories, server.tool.image_size)
        predicted: list[str] = []
        for start in range(0, len(images), self.batch_size):
            labels, _ = server.classify(images[start:start + self.batch_size], self.labels)
            predicted += labels
        wrong = tuple(f"{name} as {guess}" for name, truth, guess in zip(names, truths, predicted) if guess != truth)
        return HeldOutErrors(len(wrong), len(names), wrong)
