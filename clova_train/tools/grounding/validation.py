"""Images a grounding export's serving margin is chosen on: never trained, gated or evaluated on by its run.

Either a COCO / LVIS annotation file the user gives (its images of the concept; none may be one of the run's
evaluation images), or, for a run on synthetic scenes, scenes rendered in batches with seeds the run never used
(:func:`rendered_validation_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_yaml
from clova_train.tools.grounding.coco import GroundingAnnotations, GroundingSplit
from clova_train.tools.grounding.instances import GroundedImage

VALIDATION_SEED_OFFSET = 5_303  # rendered validation scenes: seeds (the run's render seed + this) * 1000 + batch


def run_data_args(export_dir: Path) -> dict[str, Any]:
    """The data arguments of the run that wrote ``export_dir`` (its ``config.yaml``)."""
    config = read_yaml(export_dir / "config.yaml", "run config")["data"]
    args = dict(config.get("init_args", config) or {})
    if args.get("annotations") is None and args.get("root"):  # the synthetic datamodule writes this file
        args["annotations"] = str(Path(args["root"]) / "annotations.json")
    return args


def run_split(export_dir: Path) -> tuple[GroundingAnnotations, GroundingSplit]:
    """The annotation file and the seeded split of the run that wrote ``export_dir``."""
    args = run_data_args(export_dir)
    annotations = GroundingAnnotations(args["annotations"], args.get("image_root"))
    split = GroundingSplit(annotations, args["concept"], max_images=args.get("max_images", 200),
                           num_val_images=args.get("num_val_images", 10), num_eval_images=args.get("num_eval_images", 0),
                           split_seed=args.get("split_seed", 0))
    return annotations, split


def annotated_validation_images(export_dir: Path, annotations_path: Path, image_root: Path | None = None
                                ) -> tuple[str, list[GroundedImage]]:
    """(concept, images of the run's concept in ``annotations_path``); a :class:`DataError` when one of them is an
    image the run evaluates on (the choice must not see the reported test) or when there is none."""
    run_annotations, split = run_split(export_dir)
    test_files = {run_annotations.image_file(i).resolve() for i in split.eval_ids}
    annotations = GroundingAnnotations(annotations_path, image_root)
    ids = annotations.images_of(annotations.category_id(split.concept))
    if not ids:
        raise DataError(f"{annotations_path}: no image of {split.concept!r} to choose the margin on")
    overlap = [annotations.image_file(i) for i in ids if annotations.image_file(i).resolve() in test_files]
    if overlap:
        raise DataError(f"{annotations_path}: {len(overlap)} of its images are the run's evaluation images (first: "
                        f"{overlap[0]}): the margin must be chosen on images the reported test never touches")
    return split.concept, [annotations.grounded_image(i) for i in ids]


def rendered_validation_batches(export_dir: Path, directory: Path, scenes_per_batch: int
                                ) -> tuple[str, Iterator[list[GroundedImage]]]:
    """(concept, batches of new scenes of it): the synthetic run's scene settings (its ``config.yaml``) rendered
    under ``directory`` with seeds the run never used, one batch at a time, without end."""
    from clova_train.tools.grounding.synthetic import write_coco_scenes

    args = run_data_args(export_dir)
    if args.get("root") is None or args.get("images") is None:
        raise DataError(f"{export_dir}: its run did not render synthetic scenes, so there is nothing to render "
                        "validation images from: give a validation annotation file")
    concept = str(args["concept"])

    def batches() -> Iterator[list[GroundedImage]]:
        batch = 0
        while True:
            seed = (int(args.get("render_seed", 0)) + VALIDATION_SEED_OFFSET) * 1000 + batch
            root = write_coco_scenes(directory / f"batch{batch:03d}", [concept], scenes_per_batch,
                                     objects_per_image=int(args.get("objects_per_image", 2)),
                                     image_size=int(args.get("image_size", 64)), seed=seed)
            annotations = GroundingAnnotations(root / "annotations.json")
            yield [annotations.grounded_image(i) for i in annotations.images_of(annotations.category_id(concept))]
            batch += 1

    return concept, batches()
