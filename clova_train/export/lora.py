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
its hub id (``--base-model-id``, or the hub id it was trained from) or else by its absolute path; with
``--copy-base``, load ``base/`` instead when the export has moved. Each directory's ``README.md`` is its model
card (base, data, settings, last validation metrics, how to load). The merged model is saved in bfloat16 by
default (``--dtype``), merged in float32 first; tokenizers carry the base's real context length.

Stopping: training ends every response with the EOS token, right after the step's stop string
(``Observation:``), so plain ``generate()`` and ``pipeline("text-generation")`` stop at the step boundary
by EOS; ``generation_config.json`` holds no ``stop_strings`` (they would make ``generate`` demand a
tokenizer argument). The stop strings and recommended sampling are in ``serving.json``
(``{"stop": [...], "temperature": 0.0, ...}``), the fields an OpenAI-compatible request takes.
The tokenizer's ``chat_template`` renders a user message exactly as training formatted the prompt, and a
conversation with ``tools`` exactly as ``clova-train serve`` prompts the model (``PromptTemplate.chat_template``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError
from clova_train.core.safe_files import read_json_object
from clova_train.core.model_file_limits import check_model_files
from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate
from clova_train.tooluse.template_guard import probe_tokenizer_directory
from clova_train.tooluse.served_llm import SERVING_FILE, adapter_base_name, check_adapter_weights, config_digest  # stop strings and recommended sampling, beside the tokenizer

from clova_train.models.lora_tool_llm import LORA_CHECKPOINT_KEY


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


MERGED_DTYPES = ("bfloat16", "float16", "float32")


def adapter_base_note(export: Path) -> str | None:
    """A note for a LoRA export whose adapter names its base by a path on this machine only, else ``None``."""
    from clova_train.core.manifest import BASE_DIR
    from clova_train.tools.pretrained import local_model_path

    config = export / "adapter" / "adapter_config.json"
    if not config.is_file() or (export / BASE_DIR).is_dir():
        return None
    base = str(read_json_object(config, "adapter config").get("base_model_name_or_path", ""))
    if local_model_path(base) is None:
        return None
    return (f"note: the adapter names its base by the local path {base}; on another machine pass "
            "--base-model-id <hub id> or --copy-base when exporting, or load the base from where you copied it")


def run_hyperparameters(source: Path, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The LoRA module's settings: the checkpoint's hyperparameters, or the run's ``config.yaml`` model arguments."""
    from clova_train.export.common import run_config_section
    from clova_train.export.model_card import run_directory

    if checkpoint is not None:
        return dict(checkpoint.get("hyper_parameters") or {})
    init_args = run_config_section(run_directory(source), "model").get("init_args")
    return dict(init_args) if isinstance(init_args, dict) else {}


def with_real_max_length(tokenizer: Any, base_name: str) -> Any:
    """``tokenizer`` whose ``model_max_length`` is at most the base model's context length (tokenizers saved
    without one report 1e30, which servers read as "no limit")."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(base_name)
    except (OSError, ValueError):
        return tokenizer
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0 and (tokenizer.model_max_length or 0) > context:
        tokenizer.model_max_length = context
    return tokenizer


def export_lora_run(
    source: Path, staging: Path, merged: bool, checkpoint: dict[str, Any] | None = None, copy_base: bool = False,
    base_model_id: str | None = None, dtype: str = "bfloat16",
) -> dict[str, Any]:
    """Fill ``staging`` with the adapter (and merged model, and base); returns the origin description.

    ``source`` is a run directory, or a checkpoint (a file, or a sharded checkpoint directory) whose loaded
    contents are ``checkpoint``. ``base_model_id`` (a hub id) is what the adapter names as its base instead of the
    local path it was trained from; ``dtype`` is the merged model's.
    """
    from transformers import AutoTokenizer

    from clova_train.export.common import copy_base_model, copy_tree
    from clova_train.export.model_card import lora_model_card
    from clova_train.tools.pretrained import absolute_model_name

    from clova_train.tools.pretrained import local_model_path

    if dtype not in MERGED_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(MERGED_DTYPES)}, got {dtype!r}")
    if base_model_id is not None and (not base_model_id.strip() or local_model_path(base_model_id) is not None):
        raise ExportError(f"--base-model-id takes a hub id such as lmsys/vicuna-13b-v1.5, not a local path "
                          f"({base_model_id!r}); to carry a local base, export with --copy-base")
    if checkpoint is None:
        adapter = source / "adapter"
        check_model_files(adapter)  # the run's files may come from someone else: bounded before PEFT reads them
        check_adapter_weights(adapter)
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
    named_base = base_model_id or base_name
    origin["base_model"] = base_name  # where this machine has it: serving prefers it to a hub download, if the same
    local_base = local_model_path(base_name)
    if local_base is not None and local_base.is_dir():
        check_model_files(local_base)
    tokenizer_dir = local_model_path(tokenizer_name)
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        check_model_files(tokenizer_dir)
        probe_tokenizer_directory(tokenizer_dir)  # its native parser and chat template, in a limited child first
    if local_base is not None and (local_base / "config.json").is_file():
        origin["base_model_config_sha256"] = config_digest(local_base)
    _point_adapter_at(staging / "adapter", named_base)
    if copy_base:
        copy_base_model(base_name, staging)
    tokenizer = with_real_max_length(with_chat_template(AutoTokenizer.from_pretrained(tokenizer_name), template),
                                     base_name)
    write_llm_files(staging / "adapter", tokenizer, template)
    hparams = run_hyperparameters(source, checkpoint)
    card = {"base_name": named_base, "base_copied": copy_base, "source": source.resolve(), "hparams": hparams,
            "adapter_config": read_json_object(staging / "adapter" / "adapter_config.json", "adapter config")}
    (staging / "adapter" / "README.md").write_text(lora_model_card(kind="adapter", **card))
    if merged:
        write_merged(base_name, staging / "adapter", staging / "merged", tokenizer, template, dtype)
        (staging / "merged" / "README.md").write_text(lora_model_card(kind="merged", dtype=dtype, **card))
    return origin


def write_merged(base_name: str, adapter: Path, out: Path, tokenizer: Any, template: PromptTemplate,
                 dtype: str = "bfloat16") -> Path:
    """``merge_and_unload`` the adapter into its base model (in float32) and save a plain model directory in
    ``dtype``."""
    import torch
    from peft import PeftModel

    from clova_train.models.lora_tool_llm import load_causal_lm

    base = load_causal_lm(base_name, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().to(getattr(torch, dtype))
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
