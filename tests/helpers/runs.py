"""Reading a prompt-tuning run's results and comparing pools."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clova_train.core.pool import PromptPool


def load_run(run_dir: Path) -> tuple[PromptPool, dict]:
    """A finished run's pool and summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return PromptPool.load(run_dir / "pool.safetensors"), summary


def assert_same_pools(a: PromptPool, b: PromptPool, atol: float = 1e-5) -> None:
    """Same concepts, instance ids, features and prompts (to ``atol``)."""
    assert a.concepts == b.concepts
    for concept in a.concepts:
        fa, pa, ia = a.entry(concept)
        fb, pb, ib = b.entry(concept)
        assert ia == ib
        torch.testing.assert_close(fa, fb, atol=atol, rtol=0)
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0)
