"""Export of a prompt-tuning run or checkpoint: a self-describing serving directory.

Export layout (``export.json`` describes it)::

    pool.safetensors   prompt pool (safetensors, JSON metadata in the header)
    tool.json          how to rebuild the frozen tool (model source, prompt layout, identity)
    summary.json       tried / accepted / rejected counts and reasons (when the run wrote one)
    config.yaml        the resolved LightningCLI config of the run (when found)
    textual_inversion/ REPLACE only: each concept's token in diffusers' textual-inversion format
    base/              with --copy-base: the frozen base model itself
    README.md          what the pool holds, how to serve it, and how to read and ensemble it without clova-train
    versions.json      python, torch, open_clip, lightning and clova-train versions
    export.json        format version, source, file list

Paths are portable: ``tool.json`` names the frozen model by hub id or *absolute* path, or, with
``--copy-base``, by ``base/`` inside the export (``base_in_export``), so the export can be moved or copied
to another machine. Every loader also takes an override (``--base-model``). The serving loader checks the
weights' identity against the one the prompts were trained on. Entries get normal modes (umask applies).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError, ModelError
from clova_train.core.manifest import BASE_DIR
from clova_train.core.pool import PoolSpec, PromptPool
from clova_train.core.run_manifest import POOL_FILE, SUMMARY_FILE, TOOL_FILE
from clova_train.core.safe_files import read_json_object
from clova_train.export.common import copy_base_model, newest_run_config


def portable_tool_description(tool: dict[str, Any], staging: Path, copy_base: bool) -> dict[str, Any]:
    """``tool.json`` for an export: the model path absolute, or (``copy_base``) the model copied into the
    export as ``base/`` and named relative to it, so the export loads from any working directory."""
    from clova_train.tools.pretrained import absolute_model_name
    from clova_train.tools.prompt_server import BASE_IN_EXPORT

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


def _from_run_dir(run_dir: Path, staging: Path, copy_base: bool = False) -> dict[str, Any]:
    pool_file, tool_file = run_dir / POOL_FILE, run_dir / TOOL_FILE
    if not pool_file.is_file() or not tool_file.is_file():
        summary = run_dir / SUMMARY_FILE
        hint = ""
        if summary.is_file() and not read_json_object(summary, "run summary").get("complete", True):
            hint = " (the run did not finish: resume it with --ckpt_path last, or export its checkpoint)"
        raise ExportError(f"{run_dir} holds no finished prompt-tuning run: pool.safetensors/tool.json missing{hint}")
    tool = portable_tool_description(read_json_object(tool_file, "tool description"), staging, copy_base)
    pool = PromptPool.load(pool_file, expected=PoolSpec.from_tool_description(tool))
    pool.save(staging / POOL_FILE)
    write_json_atomic(staging / TOOL_FILE, tool)
    _write_tool_formats(pool, tool, staging)
    write_pool_card(pool, tool, staging)
    if (run_dir / SUMMARY_FILE).is_file():
        shutil.copyfile(run_dir / SUMMARY_FILE, staging / SUMMARY_FILE)
    config = newest_run_config(run_dir)
    if config is not None:
        shutil.copyfile(config, staging / "config.yaml")
    return {"kind": "run_dir", "path": str(run_dir.resolve())}


def write_pool_card(pool: PromptPool, tool: dict[str, Any], staging: Path) -> None:
    """The export's ``README.md`` (see :mod:`clova_train.export.pool_card`)."""
    from clova_train.export.pool_card import pool_card

    (staging / "README.md").write_text(pool_card(pool, tool))


def _write_tool_formats(pool: PromptPool, tool: dict[str, Any], staging: Path) -> None:
    """The tool's own serving formats beside the pool (REPLACE: diffusers textual-inversion files)."""
    from clova_train.tools.base import tool_class

    try:
        tool_class(tool).write_export_files(pool, tool, staging)
    except ModelError as err:
        raise ExportError(f"cannot write the {tool.get('tool')} export files: {err}") from err


def _from_checkpoint(ckpt: Path, checkpoint: dict[str, Any], staging: Path, copy_base: bool = False) -> dict[str, Any]:
    from clova_train.models.prompt_tuning import CHECKPOINT_KEY, pool_from_records
    from clova_train.tools.contracts import InstanceRecord

    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        raise ExportError(f"checkpoint {ckpt} holds no prompt-tuning state")
    tool = portable_tool_description(state["tool"], staging, copy_base)
    records = [InstanceRecord.from_state(r) for r in state["records"].values()]
    pool = pool_from_records(PoolSpec.from_tool_description(tool), records)
    pool.save(staging / POOL_FILE)
    write_json_atomic(staging / TOOL_FILE, tool)
    _write_tool_formats(pool, tool, staging)
    write_pool_card(pool, tool, staging)
    write_json_atomic(
        staging / SUMMARY_FILE,
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


def export_prompt_tool_run(source: Path, staging: Path, checkpoint: dict[str, Any] | None = None,
                           copy_base: bool = False) -> dict[str, Any]:
    """Write a prompt-tool export of ``source`` (a run directory, or a checkpoint whose contents are ``checkpoint``)
    into ``staging``; returns the manifest's ``source`` entry."""
    if checkpoint is None:
        return _from_run_dir(source, staging, copy_base)
    return _from_checkpoint(source, checkpoint, staging, copy_base)
