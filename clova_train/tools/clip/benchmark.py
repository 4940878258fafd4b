"""CLIP's real-size smoke-run data (``benchmarks/smoke_real.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's concept folders (``full``: one whole chunk of 16 instances); a request on one image."""
    from clova_train.tools.clip.synthetic import write_concept_folders

    write_concept_folders(workdir / "data" / "concepts", ["red", "purple"], images_per_concept=17 if full else 2,
                          image_size=224)
    return {"images": ["data/concepts/purple/purple_001.png"], "labels": ["purple", "red"]}
