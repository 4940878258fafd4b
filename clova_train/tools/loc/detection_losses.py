"""OWL-ViT's training losses: Hungarian matching, sigmoid focal classification loss, L1 and GIoU box losses.

OWL-ViT (Minderer et al. 2022) trains like DETR with a sigmoid focal loss: every image-patch prediction
is matched one-to-one to a ground-truth box (scipy's ``linear_sum_assignment`` on a cost of class, L1
and GIoU terms); matched predictions learn their box and their query, all others learn "no query". Box
operations are torchvision's. Losses are per image (entry i depends only on image i's predictions), which
per-instance prompt tuning needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.optimize import linear_sum_assignment
from torchvision.ops import box_convert, generalized_box_iou, generalized_box_iou_loss, sigmoid_focal_loss

CLASS_WEIGHT, L1_WEIGHT, GIOU_WEIGHT = 1.0, 5.0, 2.0  # DETR's / OWL-ViT's loss and matching weights
FOCAL_ALPHA, FOCAL_GAMMA = 0.25, 2.0


@dataclass
class BoxTargets:
    """Ground truth of one image: query index and normalised ``cx, cy, w, h`` box of each object."""

    labels: torch.Tensor  # [T] long, index into the image's queries
    boxes: torch.Tensor  # [T, 4] cxcywh in [0, 1]


@torch.no_grad()
def hungarian_match(logits: torch.Tensor, boxes: torch.Tensor, target: BoxTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction indices, target indices) of the minimum-cost one-to-one matching of one image.

    ``logits`` ``[P, Q]`` (patch x query), ``boxes`` ``[P, 4]`` cxcywh. The class cost is the focal-loss
    difference of predicting the target's query (as in Deformable DETR / OWL-ViT).
    """
    if target.labels.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    prob = logits.float().sigmoid()[:, target.labels]  # [P, T]
    positive = FOCAL_ALPHA * (1 - prob) ** FOCAL_GAMMA * -(prob + 1e-8).log()
    negative = (1 - FOCAL_ALPHA) * prob**FOCAL_GAMMA * -(1 - prob + 1e-8).log()
    cost_class = positive - negative
    cost_l1 = torch.cdist(boxes.float(), target.boxes.float(), p=1)
    cost_giou = -generalized_box_iou(box_convert(boxes.float(), "cxcywh", "xyxy"),
                                     box_convert(target.boxes.float(), "cxcywh", "xyxy"))
    cost = CLASS_WEIGHT * cost_class + L1_WEIGHT * cost_l1 + GIOU_WEIGHT * cost_giou
    cost = torch.nan_to_num(cost, nan=1e9, posinf=1e9, neginf=-1e9)
    rows, cols = linear_sum_assignment(cost.cpu().numpy())
    return torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)


def detection_losses(
    logits: torch.Tensor, boxes: torch.Tensor, query_mask: torch.Tensor, targets: list[BoxTargets]
) -> torch.Tensor:
    """``[n]`` OWL-ViT losses of ``n`` images: focal (all patches x valid queries) + L1 + GIoU (matched).

    Args:
        logits: ``[n, P, Q]`` class logits (padded queries are ignored through ``query_mask``).
        boxes: ``[n, P, 4]`` predicted cxcywh boxes.
        query_mask: ``[n, Q]`` True for real queries.
        targets: the ground truth of each image.

    Each image's loss is normalised by its own number of boxes (at least 1).
    """
    with torch.autocast(logits.device.type, enabled=False):  # matching and losses in float32 under any autocast
        return _detection_losses(logits.float(), boxes.float(), query_mask, targets)


def _detection_losses(
    logits: torch.Tensor, boxes: torch.Tensor, query_mask: torch.Tensor, targets: list[BoxTargets]
) -> torch.Tensor:
    n, patches, queries = logits.shape
    device = logits.device
    class_targets = torch.zeros(n, patches, queries, device=device, dtype=logits.dtype)
    matched_boxes, wanted_boxes, owners = [], [], []
    for i, target in enumerate(targets):
        rows, cols = hungarian_match(logits[i].detach(), boxes[i].detach(), target)
        rows, cols = rows.to(device), cols.to(device)
        class_targets[i, rows, target.labels.to(device)[cols]] = 1.0
        matched_boxes.append(boxes[i, rows])
        wanted_boxes.append(target.boxes.to(device, boxes.dtype)[cols])
        owners.append(torch.full((len(rows),), i, device=device, dtype=torch.long))
    focal = sigmoid_focal_loss(logits.float(), class_targets.float(), alpha=FOCAL_ALPHA, gamma=FOCAL_GAMMA, reduction="none")
    focal = (focal * query_mask[:, None, :].float()).sum((1, 2))
    counts = torch.tensor([max(len(t.labels), 1) for t in targets], device=device, dtype=torch.float)
    predicted, wanted, owner = torch.cat(matched_boxes), torch.cat(wanted_boxes), torch.cat(owners)
    l1 = torch.zeros(n, device=device).index_add(0, owner, (predicted - wanted).abs().sum(-1))
    giou_pairs = generalized_box_iou_loss(box_convert(predicted, "cxcywh", "xyxy"),
                                          box_convert(wanted, "cxcywh", "xyxy"), reduction="none")
    giou = torch.zeros(n, device=device).index_add(0, owner, giou_pairs)
    return (CLASS_WEIGHT * focal + L1_WEIGHT * l1 + GIOU_WEIGHT * giou) / counts
