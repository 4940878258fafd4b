"""VQA's real-size smoke-run data (``benchmarks/smoke_real.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's VQA records (``full``: one whole chunk); a request on the first held-out record."""
    from clova_train.core.safe_files import read_text
    from clova_train.tools.vqa.synthetic import write_vqa_records

    root = write_vqa_records(workdir / "data" / "vqa", ["orange"], [], images_per_colour=32 if full else 2,
                             wrong_answers=0, eval_per_colour=1, image_size=128)
    first = json.loads(read_text(root / "eval.jsonl", "VQA records").splitlines()[0])
    return {"image": str(Path("data") / "vqa" / first["image"]), "question": "what colour is the circle?"}
