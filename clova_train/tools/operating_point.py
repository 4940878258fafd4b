"""The operating point a prompt pool is served at: one margin, chosen on validation data by one fixed rule.

Applying a prompt can cost answers the unmodified tool already gave right (CLASSIFY: purple prompts pulling blue
images to purple; VQA: orange prompts retrieved for yellow images). Each such tool serves its pool through a margin
(CLIP's ``classify_margin``, BLIP VQA's ``answer_margin``): the prompted forward replaces the unmodified one only where
it is surer by more than the margin. The margin is chosen the same way for every tool (:func:`choose_operating_point`)
on labelled validation data the reported test never touches: the most accurate margin of :data:`MARGINS` under which,
for every protected group (a label without prompts, an answer the unmodified tool gives), the share of the group's
items that the unmodified tool gets right and the served pool gets wrong stays within :data:`TOLERANCE` *with
:data:`CONFIDENCE` for all groups together* (one-sided Clopper-Pearson upper bounds at ``1 - 0.05 / G`` each for
``G`` groups, Bonferroni; scipy). When no margin qualifies, :data:`NEVER` is chosen: prompts never override the
unmodified tool. Ties go to the larger (safer) margin.

The chosen margin travels with the export: :func:`operating_point_record` is what the calibration step writes into
``tool.json`` beside the margin itself (``init_args``), and ``PromptToolServer.from_export`` serves with it unless
its caller overrides it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from scipy import stats

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ModelError
from clova_train.core.run_manifest import TOOL_FILE

NEVER = 1.0  # confidences differ by less than 1: at this margin the prompted forward never takes an item
MARGINS = (*(round(0.025 * k, 3) for k in range(21)), NEVER)  # 0.0, 0.025, ..., 0.5, never
TOLERANCE = 0.02
CONFIDENCE = 0.95
RECORD_KEY = "operating_point"  # tool.json: how the served margin was chosen


def check_margin(name: str, value: Any, optional: bool = False) -> float | None:
    """``value`` as the float margin a tool is served at; ``ModelError`` naming ``name`` unless it is a number in
    [0, 1] (or, when ``optional``, ``None``: no margin, prompts applied as trained)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        allowed = "null or a number in [0, 1]" if optional else "a number in [0, 1]"
        raise ModelError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def label_confidence(groups: int, confidence: float = CONFIDENCE) -> float:
    """The confidence each group's bound needs so that all hold together with ``confidence`` (Bonferroni)."""
    return 1 - (1 - confidence) / max(1, groups)


def taken_share_bound(taken: int, items: int, confidence: float = CONFIDENCE) -> float:
    """One-sided upper confidence bound on the share of a group's items the pool takes away (``taken`` of
    ``items``, Clopper-Pearson)."""
    if taken >= items:
        return 1.0
    return float(stats.beta.ppf(confidence, taken + 1, items - taken))


def images_needed(groups: int = 1, tolerance: float = TOLERANCE, confidence: float = CONFIDENCE) -> int:
    """The fewest validation items per group that can show ``tolerance`` for ``groups`` groups together (none of
    their items taken)."""
    each, items = label_confidence(groups, confidence), 1
    while taken_share_bound(0, items, each) > tolerance:
        items += 1
    return items


def choose_operating_point(
    unmodified_right: torch.Tensor, groups: Mapping[str, torch.Tensor],
    served_right_at: Callable[[float], torch.Tensor], margins: Sequence[float] = MARGINS,
    tolerance: float = TOLERANCE, confidence: float = CONFIDENCE,
) -> tuple[float, dict[float, dict[str, Any]]]:
    """The margin chosen by the module's rule, and per margin (``NEVER`` included) the validation accuracy and each
    protected group's bound on the share taken away.

    Args:
        unmodified_right: ``[N]`` booleans, the unmodified tool right on each validation item.
        groups: protected group name -> ``[N]`` boolean mask of its items.
        served_right_at: margin -> ``[N]`` booleans, the served pool right on each item at that margin.
    """
    each = label_confidence(len(groups), confidence)
    table: dict[float, dict[str, Any]] = {}
    best: tuple[float, float] | None = None
    for margin in sorted({*margins, NEVER}):
        served = served_right_at(margin)
        bounds = {name: taken_share_bound(int((mask & unmodified_right & ~served).sum()), int(mask.sum()), each)
                  for name, mask in groups.items()}
        accuracy = float(served.float().mean())
        table[margin] = {"accuracy": accuracy, "taken_bound": bounds}
        if all(b <= tolerance for b in bounds.values()) and (best is None or accuracy >= best[0]):
            best = (accuracy, margin)
    return (best[1] if best is not None else NEVER), table


def operating_point_record(parameter: str, margin: float, validation: str, items: int,
                           tolerance: float = TOLERANCE, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """What ``tool.json`` records beside the served margin: which parameter, the value, the rule and the validation
    data it was chosen on."""
    return {
        "parameter": parameter, "value": margin, "tolerance": tolerance, "confidence": confidence,
        "margins": [m for m in MARGINS], "validation": validation, "validation_items": items,
        "rule": (f"the most accurate margin under which, with {confidence:.0%} confidence for all protected groups "
                 f"together, the served pool takes at most {tolerance:.0%} of each group's items the unmodified "
                 f"tool gets right; {NEVER:g} (never) when none qualifies"),
        "chosen": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_operating_point(export_dir: str | Path, parameter: str, margin: float, record: dict[str, Any]) -> Path:
    """Make the export in ``export_dir`` serve at ``margin``: its ``tool.json`` gets ``init_args[parameter] = margin``
    and, under ``operating_point``, ``record`` (:func:`operating_point_record`). The tool must take ``parameter``;
    the file is replaced atomically. Returns the ``tool.json`` path."""
    from clova_train.tools.prompt_server import read_tool_description, with_served_margins

    export_dir = Path(export_dir)
    description = with_served_margins(read_tool_description(export_dir), export_dir, {parameter: float(margin)})
    path = export_dir / TOOL_FILE
    write_json_atomic(path, {**description, RECORD_KEY: record})
    return path
