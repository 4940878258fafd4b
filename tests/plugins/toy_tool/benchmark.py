"""The toy tool's benchmark settings: the data of its real-size smoke run (``benchmarks/smoke_real.py --configs toy``).

Written the way docs/architecture.md ("A tool is a folder") says a user writes them. The toy names no ``benchmark``
module in its recipe, so ``benchmarks/prompt_tuning.py --tool toy`` times the engine against the plain per-instance
loop on its tiny model and synthetic data; only the smoke run needs a writer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .synthetic import TOY_CLASSES, held_out, write_vector_file


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's vector file at ``workdir/data/toy/vectors.json`` (``full``: one whole chunk of 32 purple
    instances besides the 2 held out; else 2); a request classifying held-out purple vectors through the pool."""
    write_vector_file(workdir / "data" / "toy" / "vectors.json", TOY_CLASSES, 34 if full else 4)
    return {"vectors": held_out("purple", 3), "concept": "purple"}
