"""LOC's and SEG's shared example request and real-size smoke-run data (their recipes name these)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from clova_train.tools.examples import random_image


def example_request(workdir: Path, instance: Any) -> dict[str, Any]:
    """The instance's concept on a new 64-pixel image (LOC and SEG take the same request)."""
    return {"image": random_image(workdir / "query.png", 64), "concept": instance.concept}


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """Synthetic scenes at the paper configs' LVIS and COCO paths (LOC and SEG read the same files); a request on
    the first image."""
    from clova_train.tools.grounding.synthetic import write_coco_scenes

    scenes = write_coco_scenes(workdir / "data" / "scenes", ["purple circle"], 34 if full else 4,
                               distractor_colours=["red", "green"], objects_per_image=2, image_size=128, seed=1)
    (workdir / "data" / "lvis").mkdir(parents=True, exist_ok=True)
    (workdir / "data" / "coco").mkdir(parents=True, exist_ok=True)
    os.symlink(scenes / "annotations.json", workdir / "data" / "lvis" / "lvis_v1_train.json")
    os.symlink(scenes / "images", workdir / "data" / "coco" / "train2017")
    return {"image": "data/coco/train2017/00001.png", "concept": "purple circle"}
