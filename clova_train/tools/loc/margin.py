"""Choosing OWL-ViT LOC's ``detection_margin`` on validation images, so that the images the detector already found
stay found.

Serving a LOC pool by the paper's rule loses some images the unmodified detector finds (on the quickstart, 5.9% of
them over ten seeds; random prompts lose as many): the prompt moves the box or pulls the score under the threshold.
``detection_margin`` (:class:`~clova_train.tools.loc.tool.OwlVitLoc`) serves the prompted detections only where their
best score beats the unmodified detector's by more than the margin. :func:`choose_detection_margin` picks it by the
rule every tool shares (:func:`clova_train.tools.operating_point.choose_operating_point`): the protected group is the
concept's validation images the unmodified detector finds (detected at mean IoU above ``gate_iou``, the evaluation
metric); the share of them the served pool loses must stay within 2% with 95% confidence.

The validation size is fixed by the rule before anything is measured: images until the unmodified detector has found
:func:`~clova_train.tools.operating_point.images_needed` of them (149: the fewest that can show the 2% bound), at most
:data:`MAX_VALIDATION_IMAGES`. With fewer, no margin can show the bound and the pool is never served (margin 1).
Which images the detector finds does not depend on the prompts, so stopping on that count leaves the bound valid.

    python -m clova_train.tools.loc.margin <export> [--validation-annotations FILE [--image-root DIR]]

writes the chosen margin into the export's ``tool.json``; without a validation file, a run on synthetic scenes is
calibrated on new scenes rendered with seeds it never used.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.tools.grounding.instances import GroundedImage
from clova_train.tools.loc.tool import detection_confidence, served_prompted
from clova_train.tools.operating_point import (
    CONFIDENCE, MARGINS, TOLERANCE, choose_operating_point, images_needed, operating_point_record,
    write_operating_point,
)

PARAMETER = "detection_margin"
MAX_VALIDATION_IMAGES = 4_000
SCENES_PER_BATCH = 250  # rendered validation scenes are measured this many at a time
IMAGES_TOGETHER = 32  # validation images detected in one call
NOT_PROMPTED = float("-inf")  # the prompted confidence of an image the pool keeps no prompt for: never served


@dataclass(frozen=True)
class DetectionForwards:
    """Per validation image: found by the unmodified detector, its confidence, found with the pool's prompt and its
    confidence (:data:`NOT_PROMPTED` where the pool keeps no prompt for the image)."""

    plain_found: torch.Tensor
    plain_confidence: torch.Tensor
    prompted_found: torch.Tensor
    prompted_confidence: torch.Tensor

    def served_found(self, margin: float) -> torch.Tensor:
        """Found by the detections served at ``margin`` (:func:`~clova_train.tools.loc.tool.served_prompted`)."""
        prompted = served_prompted(self.prompted_confidence, self.plain_confidence, margin)  # elementwise on tensors
        return torch.where(prompted, self.prompted_found, self.plain_found)

    def __len__(self) -> int:
        return len(self.plain_found)

    @staticmethod
    def join(parts: Sequence[DetectionForwards]) -> DetectionForwards:
        return DetectionForwards(*(torch.cat([getattr(p, name) for p in parts]) for name in
                                   ("plain_found", "plain_confidence", "prompted_found", "prompted_confidence")))


def detection_forwards(server: Any, images: Sequence[GroundedImage], concept: str) -> DetectionForwards:
    """Both forwards of ``server``'s LOC tool (a ``PromptToolServer`` of an OWL-ViT export) on ``images``."""
    tool, rows = server.tool, []
    with torch.no_grad():
        for start in range(0, len(images), IMAGES_TOGETHER):
            batch = images[start:start + IMAGES_TOGETHER]
            for image, (plain, prompted) in zip(batch, tool.both_detections(server, [i.image for i in batch], concept)):
                rows.append((tool.found(plain, image, concept), detection_confidence(plain),
                             False if prompted is None else tool.found(prompted, image, concept),
                             NOT_PROMPTED if prompted is None else detection_confidence(prompted)))
    if not rows:
        return DetectionForwards(torch.zeros(0, dtype=torch.bool), torch.zeros(0), torch.zeros(0, dtype=torch.bool),
                                 torch.zeros(0))
    plain_found, plain_confidence, prompted_found, prompted_confidence = zip(*rows)
    return DetectionForwards(torch.tensor(plain_found), torch.tensor(plain_confidence, dtype=torch.float64),
                             torch.tensor(prompted_found), torch.tensor(prompted_confidence, dtype=torch.float64))


def gather_forwards(server: Any, concept: str, batches: Iterable[Sequence[GroundedImage]],
                    needed: int | None = None, max_images: int = MAX_VALIDATION_IMAGES) -> DetectionForwards:
    """Forwards on ``batches`` of validation images until the unmodified detector has found ``needed`` (default:
    :func:`~clova_train.tools.operating_point.images_needed` for one group), the batches end, or ``max_images``."""
    needed = images_needed(1) if needed is None else needed
    parts: list[DetectionForwards] = []
    seen = found = 0
    for batch in batches:
        part = detection_forwards(server, list(batch)[:max_images - seen], concept)
        parts.append(part)
        seen, found = seen + len(part), found + int(part.plain_found.sum())
        if found >= needed or seen >= max_images:
            break
    return DetectionForwards.join(parts) if parts else detection_forwards(server, [], concept)


def choose_detection_margin(forwards: DetectionForwards, concept: str, margins: Sequence[float] = MARGINS,
                            tolerance: float = TOLERANCE, confidence: float = CONFIDENCE) -> tuple[float, dict]:
    """The margin chosen on these validation forwards (module docstring) and the table of every margin's share found
    and bound (:func:`~clova_train.tools.operating_point.choose_operating_point`)."""
    groups = {f"{concept}, found without prompts": forwards.plain_found}
    return choose_operating_point(forwards.plain_found, groups, forwards.served_found, margins, tolerance, confidence)


def calibrate_export(export_dir: str | Path, forwards: DetectionForwards, concept: str, validation: str
                     ) -> tuple[float, dict]:
    """Choose ``detection_margin`` on ``forwards`` (of validation images described by ``validation``) and write it
    into the export's ``tool.json``, where serving reads it."""
    margin, table = choose_detection_margin(forwards, concept)
    write_operating_point(export_dir, PARAMETER, margin,
                          operating_point_record(PARAMETER, margin, validation, len(forwards)))
    return margin, table


def calibrate(export_dir: Path, annotations: Path | None = None, image_root: Path | None = None,
              scratch: Path | None = None) -> tuple[float, dict, DetectionForwards, str]:
    """Choose and write the export's margin on ``annotations`` (a COCO / LVIS file: its images of the run's concept),
    or on scenes rendered under ``scratch`` for a synthetic run; (margin, table, forwards, description)."""
    from clova_train.tools.grounding.validation import annotated_validation_images, rendered_validation_batches
    from clova_train.tools.prompt_server import PromptToolServer

    server = PromptToolServer.from_export(export_dir)
    if getattr(server.tool, "detection_margin", False) is False:
        raise DataError(f"{export_dir}: its {server.tool.name} tool takes no {PARAMETER} (OWL-ViT LOC exports do)")
    if annotations is not None:
        concept, images = annotated_validation_images(export_dir, annotations, image_root)
        forwards = gather_forwards(server, concept, [images])
        described = f"{len(forwards)} images of {concept!r} in {annotations}"
    else:
        if scratch is None:
            raise ValueError("rendered validation scenes need a scratch directory")
        concept, batches = rendered_validation_batches(export_dir, scratch, SCENES_PER_BATCH)
        forwards = gather_forwards(server, concept, batches)
        described = (f"{len(forwards)} scenes of {concept!r} rendered with seeds the run never used, until "
                     f"{images_needed(1)} were found without prompts (at most {MAX_VALIDATION_IMAGES})")
    margin, table = calibrate_export(export_dir, forwards, concept, described)
    return margin, table, forwards, described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.loc.margin", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export (an OWL-ViT LOC pool)")
    parser.add_argument("--validation-annotations", type=Path, default=None,
                        help="COCO / LVIS annotation file whose images of the run's concept the margin is chosen on "
                             "(none of them the run's evaluation images); default: new scenes for a synthetic run")
    parser.add_argument("--image-root", type=Path, default=None, help="folder of the validation file's images")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            margin, table, forwards, described = calibrate(args.export, args.validation_annotations, args.image_root,
                                                           Path(scratch))
    except ClovaTrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    found = int(forwards.plain_found.sum())
    print(f"{PARAMETER} {margin:g}, chosen on {described}; {found} found without prompts")
    print(f"{'margin':>8}{'found':>8}{'loss bound':>12}")
    for value, row in table.items():
        print(f"{value:>8g}{row['accuracy']:>8.3f}{max(row['taken_bound'].values()):>12.3f}")
    print(f"written to {args.export / 'tool.json'}: the export serves at {margin:g} from now on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
