"""``clova-train export``: one dispatch for every learner's run. A prompt-tuning run or checkpoint becomes a prompt-tool
export (``prompt_tool``), a LoRA run an adapter export (``lora``); controllers export through
``clova-train controller export`` (``controller``). Every export is staged and swapped in atomically with the same
``export.json`` / ``versions.json`` manifest."""

from __future__ import annotations

import os
from pathlib import Path

from clova_train.core.errors import ExportError
from clova_train.core.manifest import staged_directory, write_manifest
from clova_train.core.run_manifest import TOOL_FILE, export_manifest_fields, read_run_manifest
from clova_train.core.safe_files import read_json_object
from clova_train.export.common import is_distributed_checkpoint, load_checkpoint
from clova_train.export.prompt_tool import export_prompt_tool_run


def export_run(
    source: str | os.PathLike[str], output: str | os.PathLike[str], merged: bool = False, copy_base: bool = False,
    base_model_id: str | None = None, dtype: str = "bfloat16",
) -> Path:
    """Export a prompt-tuning or LoRA run (directory or checkpoint) to ``output`` (replaced atomically).

    ``merged`` (LoRA runs only) also writes the adapter merged into its base model. ``copy_base`` copies the
    frozen base model into the export (``base/``), which then loads with nothing outside it. LoRA runs:
    ``base_model_id`` is the hub id the adapter names as its base (instead of a local path), ``dtype`` the merged
    model's.
    """
    source = Path(source)
    if not source.exists():
        raise ExportError(f"export source not found: {source}")
    from clova_train.export.lora import LORA_CHECKPOINT_KEY, export_lora_run  # peft and transformers

    run = None
    if source.is_dir() and not is_distributed_checkpoint(source):
        run = read_run_manifest(source)
        if run.kind not in ("lora", "prompt_tuning"):
            raise ExportError(f"{source} holds a {run.kind} run: 'clova-train export' writes prompt-tool and LoRA "
                              "runs" + (" ('clova-train controller export' writes controllers)"
                                        if run.kind == "controller" else ""))
    with staged_directory(output) as staging:
        if run is not None:
            lora = run.kind == "lora"
            if lora:
                origin = export_lora_run(source, staging, merged, copy_base=copy_base, base_model_id=base_model_id,
                                         dtype=dtype)
            else:
                origin = export_prompt_tool_run(source, staging, copy_base=copy_base)
        else:
            checkpoint = load_checkpoint(source)
            lora = LORA_CHECKPOINT_KEY in checkpoint
            if lora:
                origin = export_lora_run(source, staging, merged, checkpoint, copy_base=copy_base,
                                         base_model_id=base_model_id, dtype=dtype)
            else:
                origin = export_prompt_tool_run(source, staging, checkpoint, copy_base)
        if not lora and base_model_id is not None:
            raise ExportError("--base-model-id applies to LoRA runs; a prompt tool names its base in tool.json "
                              "(serve it with --base-model to override)")
        tool = None if lora else read_json_object(staging / TOOL_FILE, "tool description").get("tool")
        write_manifest(staging, "lora_tool_llm" if lora else "prompt_tool", origin,
                       **export_manifest_fields("lora" if lora else "prompt_tuning", tool, run),
                       merged=merged, base_copied=copy_base, **({"merged_dtype": dtype} if lora and merged else {}))
    return Path(output)
