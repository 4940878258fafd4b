"""Export of a LoRA fine-tuning run: the PEFT adapter and, on request, the merged model.

Layout::

    adapter/    adapter_config.json, adapter_model.safetensors, tokenizer, prompt_template.json
    merged/     (with --merged) config.json, model.safetensors, generation_config.json (stop strings),
                tokenizer, prompt_template.json: a plain Hugging Face model directory
    export.json, versions.json

Both load with no clova-train code: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
"adapter")`` or ``AutoModelForCausalLM.from_pretrained("merged")``; generation should pass the stop strings
of ``generation_config.json`` (``stop_strings`` needs ``tokenizer=`` in ``generate``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError
from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate

from clova_train.models.lora_tool_llm import LORA_CHECKPOINT_KEY


def is_lora_run_dir(source: Path) -> bool:
    return (source / "adapter" / "adapter_config.json").is_file()


def _adapter_from_checkpoint(
    ckpt: Path, checkpoint: dict[str, Any], staging: Path
) -> tuple[str, str | None, PromptTemplate]:
    from peft import LoraConfig, get_peft_model

    from clova_train.models.lora_tool_llm import check_lora_targets, load_causal_lm

    hparams, state = checkpoint["hyper_parameters"], checkpoint[LORA_CHECKPOINT_KEY]
    base = load_causal_lm(hparams["model_name_or_path"])
    check_lora_targets(base, list(hparams["target_modules"]))
    config = LoraConfig(
        r=hparams["lora_r"], lora_alpha=hparams["lora_alpha"], lora_dropout=hparams["lora_dropout"],
        target_modules=list(hparams["target_modules"]), task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    # The module's checkpoint keys are "model." + the PEFT model's own parameter names.
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    result = model.load_state_dict(weights, strict=False)
    missing_lora = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing_lora:
        raise ExportError(
            f"checkpoint {ckpt} does not fit {hparams['model_name_or_path']} with this LoRA config: "
            f"unexpected {result.unexpected_keys[:3]}, missing {missing_lora[:3]}"
        )
    model.save_pretrained(str(staging / "adapter"), safe_serialization=True)
    return hparams["model_name_or_path"], state.get("tokenizer"), PromptTemplate.from_dict(state["template"])


def export_lora_run(
    source: Path, staging: Path, merged: bool, checkpoint: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Fill ``staging`` with the adapter (and merged model); returns the origin description.

    ``source`` is a run directory, or a checkpoint file whose loaded contents are ``checkpoint``.
    """
    from transformers import AutoTokenizer

    if source.is_dir():
        adapter = source / "adapter"
        shutil.copytree(adapter, staging / "adapter")
        config = json.loads((adapter / "adapter_config.json").read_text())
        base_name = config["base_model_name_or_path"]
        template = PromptTemplate.from_dict(json.loads((adapter / TEMPLATE_FILE).read_text()))
        tokenizer_name = str(adapter) if (adapter / "tokenizer_config.json").is_file() else base_name
        origin = {"kind": "lora_run_dir", "path": str(source.resolve())}
    else:
        assert checkpoint is not None, "pass the loaded checkpoint"
        base_name, tokenizer_name, template = _adapter_from_checkpoint(source, checkpoint, staging)
        tokenizer_name = tokenizer_name or base_name
        origin = {"kind": "lora_checkpoint", "path": str(source.resolve())}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    tokenizer.save_pretrained(str(staging / "adapter"))
    write_json_atomic(staging / "adapter" / TEMPLATE_FILE, template.to_dict())
    if merged:
        write_merged(base_name, staging / "adapter", staging / "merged", tokenizer, template)
    return origin


def write_merged(base_name: str, adapter: Path, out: Path, tokenizer: Any, template: PromptTemplate) -> Path:
    """``merge_and_unload`` the adapter into its base model and save a plain model directory."""
    from peft import PeftModel

    from clova_train.models.lora_tool_llm import load_causal_lm

    merged = PeftModel.from_pretrained(load_causal_lm(base_name), str(adapter)).merge_and_unload()
    merged.generation_config.stop_strings = list(template.stop_strings)
    merged.generation_config.do_sample = False
    if tokenizer.pad_token_id is not None:
        merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    write_json_atomic(out / TEMPLATE_FILE, template.to_dict())
    return out
