"""REPLACE's real-size smoke-run data (``benchmarks/smoke_real.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's masked shapes; a request repainting the first one."""
    from clova_train.tools.replace.synthetic import write_masked_concepts

    write_masked_concepts(workdir / "data" / "replace_concepts", ["orange_circle"], images_per_concept=10 if full else 4,
                          image_size=64)
    return {"image": "data/replace_concepts/orange_circle/orange_circle_000.png",
            "mask": "data/replace_concepts/orange_circle/masks/orange_circle_000.png",
            "concept": "orange_circle", "output": "served.png", "seed": 0}
