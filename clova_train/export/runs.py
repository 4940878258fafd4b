"""``clova-train export``: a self-describing serving directory from a prompt-tuning run or checkpoint.

Export layout (``export.json`` describes it)::

    pool.safetensors   prompt pool (safetensors, JSON metadata in the header)
    tool.json          how to rebuild the frozen tool (model source, prompt layout, identity)
    summary.json       tried / accepted / rejected counts and reasons (when the run wrote one)
    config.yaml        the resolved LightningCLI config of the run (when found)
    textual_inversion/ REPLACE only: each concept's token in diffusers' textual-inversion format
    versions.json      python, torch, open_clip, lightning and clova-train versions
    export.json        format version, source, file list

The frozen weights are referenced by ``tool.json`` (hub name or local directory), not copied; the
serving loader checks their identity against the one the prompts were trained on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError, ModelError
from clova_train.core.manifest import staged_directory, write_manifest
from clova_train.core.pool import PoolSpec, PromptPool


def _find_config(run_dir: Path) -> Path | None:
    candidates = sorted(run_dir.rglob("config.yaml"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def _from_run_dir(run_dir: Path, staging: Path) -> dict[str, Any]:
    pool_file, tool_file = run_dir / "pool.safetensors", run_dir / "tool.json"
    if not pool_file.is_file() or not tool_file.is_file():
        summary = run_dir / "summary.json"
        hint = ""
        if summary.is_file() and not json.loads(summary.read_text()).get("complete", True):
            hint = " (the run did not finish: resume it with --ckpt_path last, or export its checkpoint)"
        raise ExportError(f"{run_dir} holds no finished prompt-tuning run: pool.safetensors/tool.json missing{hint}")
    tool = json.loads(tool_file.read_text())
    pool = PromptPool.load(pool_file, expected=PoolSpec.from_tool_description(tool))
    pool.save(staging / "pool.safetensors")
    shutil.copy2(tool_file, staging / "tool.json")
    _write_tool_formats(pool, tool, staging)
    if (run_dir / "summary.json").is_file():
        shutil.copy2(run_dir / "summary.json", staging / "summary.json")
    config = _find_config(run_dir)
    if config is not None:
        shutil.copy2(config, staging / "config.yaml")
    return {"kind": "run_dir", "path": str(run_dir.resolve())}


def _write_tool_formats(pool: PromptPool, tool: dict[str, Any], staging: Path) -> None:
    """The tool's own serving formats beside the pool (REPLACE: diffusers textual-inversion files)."""
    from clova_train.tools.base import tool_class

    try:
        tool_class(tool).write_export_files(pool, tool, staging)
    except ModelError as err:
        raise ExportError(f"cannot write the {tool.get('tool')} export files: {err}") from err


def load_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A Lightning checkpoint's contents (tensors and plain data only: no pickled code runs)."""
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a truncated or foreign file
        raise ExportError(f"cannot read checkpoint {ckpt}: {err}") from err
    if not isinstance(checkpoint, dict):
        raise ExportError(f"{ckpt} is not a Lightning checkpoint")
    return checkpoint


def _from_checkpoint(ckpt: Path, checkpoint: dict[str, Any], staging: Path) -> dict[str, Any]:
    from clova_train.models.prompt_tuning import CHECKPOINT_KEY, pool_from_records
    from clova_train.tools.contracts import InstanceRecord

    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        raise ExportError(f"checkpoint {ckpt} holds no prompt-tuning state")
    tool = state["tool"]
    records = [InstanceRecord.from_state(r) for r in state["records"].values()]
    pool = pool_from_records(PoolSpec.from_tool_description(tool), records)
    pool.save(staging / "pool.safetensors")
    write_json_atomic(staging / "tool.json", tool)
    _write_tool_formats(pool, tool, staging)
    write_json_atomic(
        staging / "summary.json",
        {
            "complete": None,
            "tried": len(records),
            "accepted": sum(r.accepted for r in records),
            "rejected": sum(not r.accepted for r in records),
        },
    )
    hparams = checkpoint.get("hyper_parameters")
    if hparams:
        write_json_atomic(staging / "hparams.json", {k: v for k, v in hparams.items() if not k.startswith("_")})
    return {"kind": "checkpoint", "path": str(ckpt.resolve()), "global_step": checkpoint.get("global_step")}


def export_run(source: str | os.PathLike[str], output: str | os.PathLike[str], merged: bool = False) -> Path:
    """Export a prompt-tuning or LoRA run (directory or checkpoint) to ``output`` (replaced atomically).

    ``merged`` (LoRA runs only) also writes the adapter merged into its base model.
    """
    source = Path(source)
    if not source.exists():
        raise ExportError(f"export source not found: {source}")
    from clova_train.export.lora import LORA_CHECKPOINT_KEY, export_lora_run, is_lora_run_dir

    with staged_directory(output) as staging:
        if source.is_dir():
            lora = is_lora_run_dir(source)
            origin = export_lora_run(source, staging, merged) if lora else _from_run_dir(source, staging)
        else:
            checkpoint = load_checkpoint(source)
            lora = LORA_CHECKPOINT_KEY in checkpoint
            if lora:
                origin = export_lora_run(source, staging, merged, checkpoint)
            else:
                origin = _from_checkpoint(source, checkpoint, staging)
        write_manifest(staging, "lora_tool_llm" if lora else "prompt_tool", origin, merged=merged)
    return Path(output)
