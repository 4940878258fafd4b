"""``clova-train export``: a self-describing serving directory from a prompt-tuning run or checkpoint.

Export layout (``export.json`` describes it)::

    pool.safetensors   prompt pool (safetensors, JSON metadata in the header)
    tool.json          how to rebuild the frozen tool (model source, prompt layout, identity)
    summary.json       tried / accepted / rejected counts and reasons (when the run wrote one)
    config.yaml        the resolved LightningCLI config of the run (when found)
    textual_inversion/ REPLACE only: each concept's token in diffusers' textual-inversion format
    base/              with --copy-base: the frozen base model itself
    versions.json      python, torch, open_clip, lightning and clova-train versions
    export.json        format version, source, file list

Paths are portable: ``tool.json`` names the frozen model by hub id or *absolute* path, or, with
``--copy-base``, by ``base/`` inside the export (``base_in_export``), so the export can be moved or copied
to another machine. Every loader also takes an override (``--base-model``). The serving loader checks the
weights' identity against the one the prompts were trained on. Entries get normal modes (umask applies).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ClovaTrainError, ExportError, ModelError
from clova_train.core.manifest import BASE_DIR, staged_directory, write_manifest
from clova_train.core.pool import PoolSpec, PromptPool
from clova_train.core.safe_files import read_json_object


def _find_config(run_dir: Path) -> Path | None:
    candidates = sorted(run_dir.rglob("config.yaml"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def portable_tool_description(tool: dict[str, Any], staging: Path, copy_base: bool) -> dict[str, Any]:
    """``tool.json`` for an export: the model path absolute, or (``copy_base``) the model copied into the
    export as ``base/`` and named relative to it, so the export loads from any working directory."""
    from clova_train.tools.pretrained import absolute_model_name
    from clova_train.tools.serving import BASE_IN_EXPORT

    init_args = dict(tool.get("init_args") or {})
    name = init_args.get("model_name")
    if not isinstance(name, str):
        if copy_base:
            raise ExportError(f"--copy-base: the {tool.get('tool')} tool description names no model to copy")
        return tool
    init_args["model_name"] = absolute_model_name(name)
    tool = {**tool, "init_args": init_args}
    if copy_base:
        copy_base_model(init_args["model_name"], staging)
        tool[BASE_IN_EXPORT] = BASE_DIR
    return tool


def copy_base_model(name: str, staging: Path) -> None:
    """``--copy-base``: the local model directory ``name`` copied to ``staging/base``, or an :class:`ExportError`."""
    from clova_train.tools.pretrained import local_model_path

    base = local_model_path(name)
    if base is None or not base.is_dir():
        raise ExportError(
            f"--copy-base needs the base model on disk, but {name!r} is not a local directory "
            "(download it, fit from that directory, or export without --copy-base)"
        )
    copy_tree(base, staging / BASE_DIR)


def copy_tree(source: Path, target: Path) -> None:
    """Copy a model directory; entries get the normal modes of this process's umask, not the source's
    (``shutil.copytree`` would carry over a private source's 0700 directories)."""
    from tqdm import tqdm

    files = [Path(folder) / name for folder, _, names in os.walk(source, followlinks=True) for name in names]
    sizes = [path.stat().st_size for path in files]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"copying {source.name}", disable=None, leave=False) as bar:
        for path, size in zip(files, sizes):
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
            bar.update(size)
    target.mkdir(parents=True, exist_ok=True)  # an empty model directory still gives an (empty) copy


def _from_run_dir(run_dir: Path, staging: Path, copy_base: bool = False) -> dict[str, Any]:
    pool_file, tool_file = run_dir / "pool.safetensors", run_dir / "tool.json"
    if not pool_file.is_file() or not tool_file.is_file():
        summary = run_dir / "summary.json"
        hint = ""
        if summary.is_file() and not read_json_object(summary, "run summary").get("complete", True):
            hint = " (the run did not finish: resume it with --ckpt_path last, or export its checkpoint)"
        raise ExportError(f"{run_dir} holds no finished prompt-tuning run: pool.safetensors/tool.json missing{hint}")
    tool = portable_tool_description(read_json_object(tool_file, "tool description"), staging, copy_base)
    pool = PromptPool.load(pool_file, expected=PoolSpec.from_tool_description(tool))
    pool.save(staging / "pool.safetensors")
    write_json_atomic(staging / "tool.json", tool)
    _write_tool_formats(pool, tool, staging)
    if (run_dir / "summary.json").is_file():
        shutil.copyfile(run_dir / "summary.json", staging / "summary.json")
    config = _find_config(run_dir)
    if config is not None:
        shutil.copyfile(config, staging / "config.yaml")
    return {"kind": "run_dir", "path": str(run_dir.resolve())}


def _write_tool_formats(pool: PromptPool, tool: dict[str, Any], staging: Path) -> None:
    """The tool's own serving formats beside the pool (REPLACE: diffusers textual-inversion files)."""
    from clova_train.tools.base import tool_class

    try:
        tool_class(tool).write_export_files(pool, tool, staging)
    except ModelError as err:
        raise ExportError(f"cannot write the {tool.get('tool')} export files: {err}") from err


def is_distributed_checkpoint(path: Path) -> bool:
    """A checkpoint directory written by ``torch.distributed.checkpoint`` (a sharded run: ModelParallelStrategy)."""
    return path.is_dir() and (path / ".metadata").is_file()


def load_distributed_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A sharded checkpoint directory as one checkpoint dict: the shards consolidated on the CPU (no process
    group needed; nothing unpickled outside an allowlist, see ``distributed_checkpoint``) and Lightning's
    ``meta.pt`` (everything but the tensors) merged in."""
    from clova_train.export.distributed_checkpoint import read_distributed_checkpoint

    try:
        checkpoint = read_distributed_checkpoint(ckpt)
        meta = ckpt / "meta.pt"
        if meta.is_file():
            checkpoint.update(torch.load(meta, map_location="cpu", weights_only=True))
    except ClovaTrainError:
        raise
    except Exception as err:  # torch raises many types for a truncated or foreign directory
        raise ExportError(f"cannot read sharded checkpoint {ckpt}: {err}") from err
    return checkpoint


def load_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A Lightning checkpoint's contents (tensors and plain data only: no pickled code runs); a sharded
    checkpoint directory is consolidated first."""
    if is_distributed_checkpoint(ckpt):
        return load_distributed_checkpoint(ckpt)
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a truncated or foreign file
        raise ExportError(f"cannot read checkpoint {ckpt}: {err}") from err
    if not isinstance(checkpoint, dict):
        raise ExportError(f"{ckpt} is not a Lightning checkpoint")
    return checkpoint


def _from_checkpoint(ckpt: Path, checkpoint: dict[str, Any], staging: Path, copy_base: bool = False) -> dict[str, Any]:
    from clova_train.models.prompt_tuning import CHECKPOINT_KEY, pool_from_records
    from clova_train.tools.contracts import InstanceRecord

    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        raise ExportError(f"checkpoint {ckpt} holds no prompt-tuning state")
    tool = portable_tool_description(state["tool"], staging, copy_base)
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


def export_run(
    source: str | os.PathLike[str], output: str | os.PathLike[str], merged: bool = False, copy_base: bool = False
) -> Path:
    """Export a prompt-tuning or LoRA run (directory or checkpoint) to ``output`` (replaced atomically).

    ``merged`` (LoRA runs only) also writes the adapter merged into its base model. ``copy_base`` copies the
    frozen base model into the export (``base/``), which then loads with nothing outside it.
    """
    source = Path(source)
    if not source.exists():
        raise ExportError(f"export source not found: {source}")
    from clova_train.export.lora import LORA_CHECKPOINT_KEY, export_lora_run, is_lora_run_dir

    with staged_directory(output) as staging:
        if source.is_dir() and not is_distributed_checkpoint(source):
            lora = is_lora_run_dir(source)
            if lora:
                origin = export_lora_run(source, staging, merged, copy_base=copy_base)
            else:
                origin = _from_run_dir(source, staging, copy_base)
        else:
            checkpoint = load_checkpoint(source)
            lora = LORA_CHECKPOINT_KEY in checkpoint
            if lora:
                origin = export_lora_run(source, staging, merged, checkpoint, copy_base=copy_base)
            else:
                origin = _from_checkpoint(source, checkpoint, staging, copy_base)
        write_manifest(staging, "lora_tool_llm" if lora else "prompt_tool", origin, merged=merged, base_copied=copy_base)
    return Path(output)
