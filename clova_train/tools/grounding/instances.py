"""Open-vocabulary grounding instances, shared by the LOC (OWL-ViT) and SEG (MaskFormer) prompt tools.

A :class:`GroundingInstance` is one training image of a concept with the boxes and masks of its objects,
plus held-out validation images of the same concept (never trained on) for the gate. The grounding
datamodule (``clova_train.datamodules.prompt_tuning.grounding``) builds them from COCO / LVIS annotation files; the
tools only see these tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torchvision.ops import box_iou

from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance


@dataclass
class GroundedImage:
    """An image with its annotated objects.

    Args:
        image: ``[3, H, W]`` uint8.
        labels: category name of each object.
        boxes: ``[k, 4]`` float ``x0, y0, x1, y1`` in pixels.
        masks: ``[k, H, W]`` bool (all False for an object annotated with a box only).
        absent: category names known not to be in the image (query negatives): every category without an
            annotation in an exhaustively annotated image (COCO), LVIS' verified ``neg_category_ids``.
        source: file and image id, named in errors and rejections.
    """

    image: torch.Tensor
    labels: list[str]
    boxes: torch.Tensor
    masks: torch.Tensor
    absent: list[str] = field(default_factory=list)
    source: str = ""

    @property
    def size(self) -> tuple[int, int]:
        return int(self.image.shape[1]), int(self.image.shape[2])

    def objects_of(self, concept: str) -> torch.Tensor:
        """Indices of the objects labelled ``concept``."""
        return torch.tensor([i for i, label in enumerate(self.labels) if label == concept], dtype=torch.long)


@dataclass(kw_only=True)
class GroundingInstance(TrainingInstance):
    """A training image of ``concept`` and held-out images of it.

    Args:
        train: the image the prompt is tuned on (it holds at least one object of ``concept``).
        val: held-out images of ``concept`` the tuned prompt must also pass the gate on.
    """

    train: GroundedImage
    val: list[GroundedImage] = field(default_factory=list)


def instance_rng(instance_id: str, purpose: str) -> np.random.Generator:
    """A generator seeded by the instance id: the same choices in every chunk, rank and rerun."""
    digest = hashlib.sha256(f"{purpose}:{instance_id}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def queries_for(image: GroundedImage, concept: str, num_negatives: int, rng: np.random.Generator) -> tuple[list[str], int]:
    """(queries, number of positive queries) for one image (CLOVA supp. 9.2).

    The concept, one other category present in the image (when there is one), then ``num_negatives``
    category names known to be absent (fewer if the image has fewer).
    """
    others = sorted({label for label in image.labels if label != concept})
    positives = [concept] + ([others[int(rng.integers(len(others)))]] if others else [])
    pool = sorted(set(image.absent) - set(positives) - set(image.labels))
    chosen = rng.choice(len(pool), size=min(num_negatives, len(pool)), replace=False) if pool else []
    return positives + [pool[int(i)] for i in chosen], len(positives)


def best_box_iou(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """For each target box ``[t, 4]``, the best IoU with any predicted box ``[p, 4]`` (0 without predictions), on the
    CPU: the targets may come from a batch Lightning moved to the GPU, the predictions from a list of floats."""
    if predicted.numel() == 0:
        return torch.zeros(len(target))
    return box_iou(target.detach().float().cpu(), predicted.detach().float().cpu()).max(1).values


def prompts_of_views(owner: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor | None:
    """Each view's prompt row: ``prompts[owner]`` (a chunk has one prompt per instance, several views each)."""
    return None if prompts is None else prompts[owner.to(prompts.device)]


def gate_results(train: list[list[Rejection]], held_out: list[list[Rejection]] | None,
                 owner: torch.Tensor | None) -> list[GateResult]:
    """One result per instance: its training view's rejections plus those of its held-out views (``owner``)."""
    problems = [list(found) for found in train]
    for v, found in enumerate(held_out or []):
        problems[int(owner[v])].extend(found)
    return [GateResult(tuple(p)) for p in problems]
