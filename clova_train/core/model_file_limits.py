"""Bounds on the files of a model export, checked before transformers, PEFT or tokenizers read them.

An export directory (``adapter/``, ``merged/``, ``base/``, or a run's ``adapter/``) holds files that other
libraries parse and act on: a ``config.json`` asking for a vocabulary of 10^12 rows, or an ``adapter_config.json``
asking for 10^6 replicated layers, makes them allocate until the machine gives up; a 100 MB chat template aborts the
Rust tokenizer loader. :func:`check_model_files` reads each known file with the package's bounded JSON reader
(:mod:`clova_train.core.safe_files`) and checks its sizes, counts and magnitudes against what a real file of that
kind holds; the first file out of bounds is one :class:`ExportError` naming it, the field and the bound.

The bounds (generous: the largest public models are well inside them):

=====================  =========================================================================================
file                   bounds
=====================  =========================================================================================
any JSON file          at most :data:`FILE_BYTES` bytes for its name, nested at most 32 levels (tokenizer.json) or
                       16 (the others); every number finite and at most 10^12 in size (tokenizer_config.json's
                       ``model_max_length`` excepted: real files write 1e30 for "no limit")
config.json            ``vocab_size`` <= 2^21 (largest real: 262,144); hidden sizes <= 65,536; intermediate sizes
                       <= 2^19; layers, heads <= 1,024; positions <= 2^24; experts <= 4,096; and the parameters
                       these imply <= 2 * 10^12, and, when the directory holds its weights, at most four times what
                       those files hold at two bytes a parameter (plus 1 GB)
adapter_config.json    ``r`` and ``rank_pattern`` values 1..16,384; ``lora_alpha`` finite; layer indices
                       0..1,023; ``layer_replication`` at most 1,024 layers in all; at most 1,024 module names of at
                       most 256 characters; module-name regexes without nested repetition (Python's ``re`` would
                       backtrack for hours)
tokenizer.json         at most 2^21 vocabulary entries and merges, 2^20 added tokens; normalizer, pre-tokenizer,
                       post-processor and decoder at most 256 parts, nested at most 8 deep; regex patterns at
                       most 4,096 characters
chat templates         at most 256 Ki characters (bytes, in a .jinja file) each (real ones: a few KiB), at most 32
                       named ones
generation_config      ``max_length``/``max_new_tokens`` <= 2^24; beams and returned sequences <= 256
serving.json           at most 64 stop strings of at most 1,024 characters; ``max_tokens`` 1..2^24
=====================  =========================================================================================
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError, ExportError
from clova_train.core.safe_files import ReadLimits, printable, read_json

KIB, MIB = 1 << 10, 1 << 20
FILE_BYTES = {  # the largest file accepted under each name
    "adapter_config.json": 1 * MIB, "config.json": 4 * MIB, "generation_config.json": 1 * MIB,
    "serving.json": 64 * KIB, "prompt_template.json": 1 * MIB, "tokenizer_config.json": 32 * MIB,
    "special_tokens_map.json": 8 * MIB, "added_tokens.json": 32 * MIB, "tokenizer.json": 64 * MIB,
    "chat_template.json": 1 * MIB, "preprocessor_config.json": 1 * MIB, "export.json": 1 * MIB,
}
OTHER_FILE_BYTES = {"vocab.json": 64 * MIB, "merges.txt": 64 * MIB, "tokenizer.model": 64 * MIB,
                    "vocab.txt": 64 * MIB, "spiece.model": 64 * MIB, "sentencepiece.bpe.model": 64 * MIB}
MAX_TEMPLATE_CHARS = 256 * KIB
MAX_TEMPLATES = 32
MAX_NUMBER = 1e12
MAX_RANK = 16_384
MAX_LAYERS = 1_024
MAX_MODULE_NAMES = 1_024
MAX_MODULE_NAME_CHARS = 256
MAX_VOCAB = 1 << 21
MAX_ADDED_TOKENS = 1 << 20
MAX_TOKEN_CHARS = 4_096
MAX_COMPONENT_PARTS = 256
MAX_COMPONENT_DEPTH = 8
MAX_REGEX_CHARS = 4_096
MAX_PARAMETERS = 2e12
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1_024
MAX_SEQUENCE = 1 << 24

# config.json (and any nested text_config / vision_config ...): the largest value accepted under each name
CONFIG_BOUNDS = {
    **dict.fromkeys(("vocab_size",), MAX_VOCAB),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "projection_dim",
                     "kv_lora_rank", "q_lora_rank"), 65_536),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "moe_intermediate_size",
                     "shared_expert_intermediate_size"), 1 << 19),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
                     "num_encoder_layers"), MAX_LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "n_head_kv",
                     "num_kv_heads"), 1_024),
    **dict.fromkeys(("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), 4_096),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                     "sliding_window", "max_seq_len"), MAX_SEQUENCE),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts"), 4_096),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk"), 256),
}
GENERATION_BOUNDS = {"max_length": MAX_SEQUENCE, "max_new_tokens": MAX_SEQUENCE, "min_length": MAX_SEQUENCE,
                     "min_new_tokens": MAX_SEQUENCE, "num_beams": 256, "num_beam_groups": 256,
                     "num_return_sequences": 256, "top_k": MAX_VOCAB, "no_repeat_ngram_size": 1_024,
                     "encoder_no_repeat_ngram_size": 1_024}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _fail(file: Path, problem: str) -> ExportError:
    return ExportError(f"{printable(file)} is not a file a real model has: {problem}")


def _read(file: Path, what: str, max_depth: int = 16) -> Any:
    limits = ReadLimits(max_bytes=FILE_BYTES.get(file.name, 1 * MIB), max_depth=max_depth)
    try:
        return read_json(file, what, limits)
    except DataError as err:
        raise ExportError(str(err)) from None


def _numbers(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, number)`` of every number in ``value`` (iteratively: the reader bounded the depth)."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{where}.{key}" if where else str(key), child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            yield where, item


def _check_numbers(file: Path, value: Any, exempt: tuple[str, ...] = ()) -> None:
    for where, number in _numbers(value):
        if where in exempt:
            continue
        if not math.isfinite(number) or abs(number) > MAX_NUMBER:
            raise _fail(file, f"{where} is {number!r}, more than the {MAX_NUMBER:.0e} any model setting needs")


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _int_in(file: Path, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(file, f"{name} is {value!r}, not a whole number from {low:,} to {high:,}")
    return value


def _bounded(file: Path, name: str, value: Any, high: int) -> None:
    """``value`` (a size setting) at most ``high``; unset (None, False) and -1 ("none", as some configs write) pass."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    _int_in(file, name, value, -1, high)


def check_regex(file: Path, name: str, pattern: str) -> None:
    """A :class:`ExportError` unless ``pattern`` is a short regex without a repetition inside a repetition (the
    patterns that make Python's backtracking ``re`` run for hours on a short module name)."""
    import re._parser as parser  # the standard library's own regex parser

    if len(pattern) > MAX_MODULE_NAME_CHARS:
        raise _fail(file, f"{name} is a pattern of {len(pattern):,} characters, more than {MAX_MODULE_NAME_CHARS}")
    try:
        parsed = parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise _fail(file, f"{name} is not a regular expression ({err})") from None
    repeats = {parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", parser.MAX_REPEAT)}
    stack: list[tuple[Any, int]] = [(parsed, 0)]
    while stack:
        items, inside = stack.pop()
        for op, argument in items:
            repeated = inside + (op in repeats and argument[1] > 1)
            if repeated > 1:
                raise _fail(file, f"{name} {pattern!r} repeats a repetition (it can backtrack for hours)")
            for child in argument if isinstance(argument, (list, tuple)) else ():
                if isinstance(child, parser.SubPattern):
                    stack.append((child, repeated))
                elif isinstance(child, (list, tuple)):
                    stack.extend((part, repeated) for part in child if isinstance(part, parser.SubPattern))


def _check_module_names(file: Path, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        check_regex(file, name, value)  # PEFT matches a string as a regex
        return
    if not isinstance(value, list) or len(value) > MAX_MODULE_NAMES:
        raise _fail(file, f"{name} must be a list of at most {MAX_MODULE_NAMES:,} module names or one pattern")
    for item in value:
        if not isinstance(item, str) or len(item) > MAX_MODULE_NAME_CHARS:
            raise _fail(file, f"{name} holds {str(item)[:40]!r}..., not a module name of at most "
                              f"{MAX_MODULE_NAME_CHARS} characters")


def check_adapter_config(file: Path) -> dict[str, Any]:
    """``adapter_config.json`` (PEFT) within bounds (see the module docstring); its contents."""
    config = _read(file, "adapter config")
    if not isinstance(config, dict):
        raise _fail(file, "it must hold a JSON object")
    _check_numbers(file, config)
    if "r" in config:
        _int_in(file, "r", config["r"], 1, MAX_RANK)
    for name in ("target_modules", "exclude_modules", "modules_to_save"):
        _check_module_names(file, name, config.get(name))
    layers = config.get("layers_to_transform")
    if layers is not None:
        layers = [layers] if isinstance(layers, int) else layers
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            raise _fail(file, f"layers_to_transform must be a layer index or a list of at most {MAX_LAYERS} of them")
        for index in layers:
            _int_in(file, "a layers_to_transform entry", index, 0, MAX_LAYERS - 1)
    if config.get("layers_pattern") is not None:
        patterns = config["layers_pattern"]
        for pattern in [patterns] if isinstance(patterns, str) else patterns if isinstance(patterns, list) else [None]:
            if not isinstance(pattern, str):
                raise _fail(file, "layers_pattern must be a pattern or a list of patterns")
            check_regex(file, "layers_pattern", pattern)
    replication = config.get("layer_replication")
    if replication is not None:
        if not isinstance(replication, list) or len(replication) > MAX_LAYERS:
            raise _fail(file, f"layer_replication must be a list of at most {MAX_LAYERS} [start, end] ranges")
        total = 0
        for item in replication:
            if not (isinstance(item, list) and len(item) == 2):
                raise _fail(file, f"layer_replication holds {str(item)[:40]}, not a [start, end] range")
            start = _int_in(file, "a layer_replication start", item[0], 0, MAX_LAYERS - 1)
            end = _int_in(file, "a layer_replication end", item[1], start + 1, MAX_LAYERS)
            total += end - start
        if total > MAX_LAYERS:
            raise _fail(file, f"layer_replication asks for {total:,} layers, more than {MAX_LAYERS:,}")
    for name, pattern_values in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(name)
        if patterns is None:
            continue
        if not isinstance(patterns, dict) or len(patterns) > MAX_MODULE_NAMES:
            raise _fail(file, f"{name} must map at most {MAX_MODULE_NAMES:,} module patterns to numbers")
        for key, value in patterns.items():
            check_regex(file, f"{name} key", key)
            if pattern_values:
                _int_in(file, f"{name}[{key!r}]", value, 1, MAX_RANK)
    indices = config.get("trainable_token_indices")
    if indices is not None:
        values = [v for group in (indices.values() if isinstance(indices, dict) else [indices]) for v in
                  (group if isinstance(group, list) else [group])]
        if len(values) > MAX_ADDED_TOKENS:
            raise _fail(file, f"trainable_token_indices names {len(values):,} tokens, more than {MAX_ADDED_TOKENS:,}")
        for value in values:
            _int_in(file, "a trainable_token_indices entry", value, 0, MAX_VOCAB - 1)
    return config


def _parameters(config: dict[str, Any]) -> float:
    """A rough count of the parameters a (text) model config implies."""
    def first(*names: str, default: float = 0) -> float:
        for name in names:
            value = config.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return default

    hidden = first("hidden_size", "d_model", "n_embd")
    inner = first("intermediate_size", "ffn_dim", "n_inner", "d_ff", default=4 * hidden)
    experts = max(1.0, first("num_local_experts", "num_experts", "n_routed_experts", default=1))
    expert_inner = first("moe_intermediate_size", default=0)  # experts of their own size beside a dense MLP
    layers = first("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    vocab = first("vocab_size")
    mlp = 3 * hidden * (inner + expert_inner * experts if expert_inner else inner * experts)
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + mlp)


def check_model_config(file: Path) -> dict[str, Any]:
    """A model ``config.json`` within bounds (see the module docstring); its contents."""
    config = _read(file, "model config")
    if not isinstance(config, dict):
        raise _fail(file, "it must hold a JSON object")
    _check_numbers(file, config)
    for section in _dicts(config):
        for name, high in CONFIG_BOUNDS.items():
            _bounded(file, name, section.get(name), high)
    parameters = max(_parameters(section) for section in _dicts(config))
    if parameters > MAX_PARAMETERS:
        raise _fail(file, f"its sizes make about {parameters:.2g} parameters, more than any model has")
    weights = sum(p.stat().st_size for p in file.parent.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if weights and 2 * parameters > 4 * weights + (1 << 30):
        raise _fail(file, f"its sizes make about {parameters:.2g} parameters, far more than its weight files "
                          f"({weights:,} bytes) hold")
    return config


def check_generation_config(file: Path) -> None:
    config = _read(file, "generation config")
    if not isinstance(config, dict):
        raise _fail(file, "it must hold a JSON object")
    _check_numbers(file, config)
    for name, high in GENERATION_BOUNDS.items():
        _bounded(file, name, config.get(name), high)
    _check_strings(file, "stop_strings", config.get("stop_strings"))


def _check_strings(file: Path, name: str, value: Any) -> None:
    if value is None:
        return
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in value):
        raise _fail(file, f"{name} must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS:,} characters")


def check_serving_defaults(file: Path) -> None:
    defaults = _read(file, "serving defaults")
    if not isinstance(defaults, dict):
        raise _fail(file, "it must hold a JSON object")
    _check_numbers(file, defaults)
    _check_strings(file, "stop", defaults.get("stop"))
    if "max_tokens" in defaults:
        _int_in(file, "max_tokens", defaults["max_tokens"], 1, MAX_SEQUENCE)


def _check_template_text(file: Path, name: str, template: Any) -> None:
    if not isinstance(template, str):
        raise _fail(file, f"{name} must be a string")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise _fail(file, f"{name} is {len(template):,} characters long, more than the {MAX_TEMPLATE_CHARS:,} a chat "
                          "template needs")


def check_tokenizer_config(file: Path) -> dict[str, Any]:
    config = _read(file, "tokenizer config")
    if not isinstance(config, dict):
        raise _fail(file, "it must hold a JSON object")
    _check_numbers(file, {k: v for k, v in config.items() if k != "added_tokens_decoder"}, exempt=("model_max_length",))
    templates = config.get("chat_template")
    if isinstance(templates, list):
        if len(templates) > MAX_TEMPLATES:
            raise _fail(file, f"it holds {len(templates)} chat templates, more than {MAX_TEMPLATES}")
        for entry in templates:
            if not isinstance(entry, dict):
                raise _fail(file, "chat_template must be a string or a list of {name, template} objects")
            _check_template_text(file, f"chat template {str(entry.get('name'))[:40]!r}", entry.get("template"))
    elif templates is not None:
        _check_template_text(file, "chat_template", templates)
    decoder = config.get("added_tokens_decoder")
    if decoder is not None and (not isinstance(decoder, dict) or len(decoder) > MAX_ADDED_TOKENS):
        raise _fail(file, f"added_tokens_decoder must map at most {MAX_ADDED_TOKENS:,} ids to tokens")
    return config


def _component_parts(component: Any) -> tuple[int, int]:
    """Parts (objects) and nesting depth (objects in objects) of a tokenizer pipeline component."""
    parts, deepest, stack = 0, 0, [(component, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            parts, deepest = parts + 1, max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth) for child in item)
    return parts, deepest


def check_tokenizer_file(file: Path) -> None:
    """``tokenizer.json`` (the ``tokenizers`` library's file) within bounds (see the module docstring)."""
    data = _read(file, "tokenizer file", max_depth=32)
    if not isinstance(data, dict):
        raise _fail(file, "it must hold a JSON object")
    model = data.get("model")
    if isinstance(model, dict):
        for name in ("vocab", "merges"):
            entries = model.get(name)
            if isinstance(entries, (dict, list)) and len(entries) > MAX_VOCAB:
                raise _fail(file, f"model.{name} has {len(entries):,} entries, more than {MAX_VOCAB:,}")
        vocab = model.get("vocab")
        pieces = vocab.keys() if isinstance(vocab, dict) else (
            entry[0] for entry in vocab if isinstance(entry, list) and entry) if isinstance(vocab, list) else ()
        if any(isinstance(piece, str) and len(piece) > MAX_TOKEN_CHARS for piece in pieces):
            raise _fail(file, f"model.vocab holds a token longer than {MAX_TOKEN_CHARS:,} characters")
    added = data.get("added_tokens")
    if isinstance(added, list):
        if len(added) > MAX_ADDED_TOKENS:
            raise _fail(file, f"added_tokens has {len(added):,} entries, more than {MAX_ADDED_TOKENS:,}")
        if any(isinstance(t, dict) and len(str(t.get("content", ""))) > MAX_TOKEN_CHARS for t in added):
            raise _fail(file, f"added_tokens holds a token longer than {MAX_TOKEN_CHARS:,} characters")
    for name in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        parts, depth = _component_parts(data.get(name))
        if parts > MAX_COMPONENT_PARTS or depth > MAX_COMPONENT_DEPTH:
            raise _fail(file, f"its {name} has {parts:,} parts nested {depth} deep (at most {MAX_COMPONENT_PARTS} "
                              f"parts, {MAX_COMPONENT_DEPTH} deep)")
        for section in _dicts(data.get(name)):
            pattern = section.get("pattern")
            text = pattern.get("Regex", pattern.get("String")) if isinstance(pattern, dict) else None
            if isinstance(text, str) and len(text) > MAX_REGEX_CHARS:
                raise _fail(file, f"its {name} has a pattern of {len(text):,} characters, more than {MAX_REGEX_CHARS:,}")
    for section in ("truncation", "padding"):
        _check_numbers(file, data.get(section))


def check_prompt_template(file: Path) -> None:
    template = _read(file, "prompt template")
    if not isinstance(template, dict):
        raise _fail(file, "it must hold a JSON object")
    for name, value in template.items():
        if isinstance(value, str) and len(value) > 64 * KIB:
            raise _fail(file, f"{name} is {len(value):,} characters, more than 65,536")
    _check_strings(file, "stop_strings", template.get("stop_strings"))


CHECKS = {
    "adapter_config.json": check_adapter_config, "config.json": check_model_config,
    "generation_config.json": check_generation_config, "serving.json": check_serving_defaults,
    "tokenizer_config.json": check_tokenizer_config, "tokenizer.json": check_tokenizer_file,
    "prompt_template.json": check_prompt_template,
}


def check_model_files(directory: Path) -> None:
    """Every known file of the model or adapter ``directory`` within bounds; the first that is not is one
    :class:`ExportError` naming it."""
    for name, check in CHECKS.items():
        if (directory / name).exists():
            check(directory / name)
    for name in ("special_tokens_map.json", "added_tokens.json", "chat_template.json", "preprocessor_config.json"):
        if (directory / name).exists():
            _read(directory / name, name, max_depth=16)
    for name, limit in OTHER_FILE_BYTES.items():
        _size_at_most(directory / name, limit)
    templates = [directory / "chat_template.jinja"]
    if (directory / "additional_chat_templates").is_dir():
        extra = sorted((directory / "additional_chat_templates").iterdir())
        if len(extra) > MAX_TEMPLATES:
            raise _fail(directory / "additional_chat_templates", f"it holds {len(extra)} templates, more than {MAX_TEMPLATES}")
        templates += extra
    for template in templates:
        _size_at_most(template, MAX_TEMPLATE_CHARS)
    chat_template_file = directory / "chat_template.json"
    if chat_template_file.is_file():
        held = _read(chat_template_file, "chat template file")
        if isinstance(held, dict) and "chat_template" in held:
            _check_template_text(chat_template_file, "chat_template", held["chat_template"])


def _size_at_most(file: Path, limit: int) -> None:
    if file.exists():
        if not file.is_file():
            raise _fail(file, "it is not a regular file")
        if file.stat().st_size > limit:
            raise _fail(file, f"it is {file.stat().st_size:,} bytes, more than the {limit:,} accepted")


def check_export_files(export: Path) -> None:
    """:func:`check_model_files` for each model directory of a LoRA export (``adapter/``, ``merged/``, ``base/``)."""
    for name in ("adapter", "merged", "base"):
        if (export / name).is_dir():
            check_model_files(export / name)
