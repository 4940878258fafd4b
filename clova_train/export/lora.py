"""Export of a LoRA fine-tuning run: the PEFT adapter and, on request, the merged model.

Layout::

    adapter/    adapter_config.json, adapter_model.safetensors (what vLLM's --enable-lora loads), tokenizer
                (with the chat template), prompt_template.json, serving.json
    merged/     (with --merged) config.json, model.safetensors, generation_config.json, tokenizer (with the
                chat template), prompt_template.json, serving.json: a plain Hugging Face model directory
    base/       (with --copy-base) the base model the adapter applies to
    export.json, versions.json

Both load with no clova-train code: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
"adapter")`` or ``AutoModelForCausalLM.from_pretrained("merged")``. ``adapter_config.json`` names the base by
its absolute path (or hub id); with ``--copy-base``, load ``base/`` instead when the export has moved.

Stopping: training ends every response with the EOS token, right after the step's stop string
(``Observation:``), so plain ``generate()`` and ``pipeline("text-generation")`` stop at the step boundary
by EOS; ``generation_config.json`` holds no ``stop_strings`` (they would make ``generate`` demand a
tokenizer argument). The stop strings and recommended sampling are in ``serving.json``
(``{"stop": [...], "temperature": 0.0, ...}``), the fields an OpenAI-compatible request takes.
The tokenizer's ``chat_template`` renders a user message exactly as training formatted the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError
from clova_train.core.safe_files import read_json_object
from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate
from clova_train.tooluse.served_llm import SERVING_FILE, adapter_base_name  # stop strings and recommended sampling, beside the tokenizer

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


def serving_defaults(template: PromptTemplate) -> dict[str, Any]:
    """What a server should send with every request to reproduce training's decoding (OpenAI field names)."""
    return {"stop": list(template.stop_strings), "temperature": 0.0, "top_p": 1.0, "max_tokens": 256}


def with_chat_template(tokenizer: Any, template: PromptTemplate) -> Any:
    """``tokenizer`` with a ``chat_template`` that renders the training prompt (BOS included if it adds one)."""
    probe = tokenizer("x")["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and bool(probe) and probe[0] == tokenizer.bos_token_id
    tokenizer.chat_template = template.chat_template(bos_token=adds_bos)
    return tokenizer


def write_llm_files(directory: Path, tokenizer: Any, template: PromptTemplate) -> None:
    """Tokenizer (with chat template), prompt template and serving defaults into a model directory."""
    tokenizer.save_pretrained(str(directory))
    write_json_atomic(directory / TEMPLATE_FILE, template.to_dict())
    write_json_atomic(directory / SERVING_FILE, serving_defaults(template))


def _point_adapter_at(adapter: Path, base_name: str) -> None:
    config_file = adapter / "adapter_config.json"
    config = read_json_object(config_file, "adapter config")
    config["base_model_name_or_path"] = base_name
    write_json_atomic(config_file, config)


def export_lora_run(
    source: Path, staging: Path, merged: bool, checkpoint: dict[str, Any] | None = None, copy_base: bool = False
) -> dict[str, Any]:
    """Fill ``staging`` with the adapter (and merged model, and base); returns the origin description.

    ``source`` is a run directory, or a checkpoint (a file, or a sharded checkpoint directory) whose loaded
    contents are ``checkpoint``.
    """
    from transformers import AutoTokenizer

    from clova_train.export.common import copy_base_model, copy_tree
    from clova_train.tools.pretrained import absolute_model_name

    if checkpoint is None:
        adapter = source / "adapter"
        copy_tree(adapter, staging / "adapter")
        base_name = adapter_base_name(adapter)
        template = PromptTemplate.from_dict(read_json_object(adapter / TEMPLATE_FILE, "prompt template"))
        tokenizer_name = str(adapter) if (adapter / "tokenizer_config.json").is_file() else base_name
        origin = {"kind": "lora_run_dir", "path": str(source.resolve())}
    else:
        base_name, tokenizer_name, template = _adapter_from_checkpoint(source, checkpoint, staging)
        tokenizer_name = tokenizer_name or base_name
        origin = {"kind": "lora_checkpoint", "path": str(source.resolve())}
    base_name = absolute_model_name(base_name)
    _point_adapter_at(staging / "adapter", base_name)
    if copy_base:
        copy_base_model(base_name, staging)
    tokenizer = with_chat_template(AutoTokenizer.from_pretrained(tokenizer_name), template)
    write_llm_files(staging / "adapter", tokenizer, template)
    if merged:
        write_merged(base_name, staging / "adapter", staging / "merged", tokenizer, template)
    return origin


def write_merged(base_name: str, adapter: Path, out: Path, tokenizer: Any, template: PromptTemplate) -> Path:
    """``merge_and_unload`` the adapter into its base model and save a plain model directory."""
    from peft import PeftModel

    from clova_train.models.lora_tool_llm import load_causal_lm

    merged = PeftModel.from_pretrained(load_causal_lm(base_name), str(adapter)).merge_and_unload()
    generation = merged.generation_config
    generation.stop_strings = None
    generation.do_sample = False
    generation.eos_token_id = tokenizer.eos_token_id
    generation.max_new_tokens = serving_defaults(template)["max_tokens"]
    for name in ("temperature", "top_p", "top_k"):  # greedy: sampling settings would only draw warnings
        setattr(generation, name, None)
    if tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(str(out), safe_serialization=True)
    write_llm_files(out, tokenizer, template)
    return out
