"""Exports of the random-weight tiny CLIP, OWL-ViT and BLIP VQA (tool.json + an empty pool: the unmodified tool), by
ImagePatch role: what model-backed ImagePatch tools and benchmark environments are tested against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clova_train.core.pool import PromptPool
from clova_train.tools.recipes import tool_recipes
from clova_train.tools.tool_clients import CLASSIFY, LOC, VQA
from helpers.conformance import build_tool

ROLE_TOOLS = ((CLASSIFY, "clip"), (LOC, "loc"), (VQA, "vqa"))


def write_tiny_exports(tiny_models: Any, root: Path) -> dict[str, Path]:
    """One export directory per role under ``root``, built from the session's tiny models."""
    recipes = tool_recipes()
    found = {}
    for role, name in ROLE_TOOLS:
        tool = build_tool(recipes[name], tiny_models(recipes[name].tiny_model))
        directory = root / name
        directory.mkdir()
        PromptPool(tool.pool_spec()).save(directory / "pool.safetensors")
        (directory / "tool.json").write_text(json.dumps(tool.describe()), encoding="utf-8")
        found[role] = directory
    return found
