"""A tiny LoRA export (a word-level tokenizer with the training chat template, an adapter config naming a hub base, no
real weights) and the ways issue 53 spoils its files, for the contained CLI cases (``clova-train export`` /
``serve`` on it under :mod:`helpers.contained`). The in-process tests of the same readers are
``tests/tool_llm/test_hostile_lora_files.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def write_tiny_lora_export(export: Path) -> Path:
    """The export directory ``export`` (its ``adapter/`` folder), written in well under a second."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate
    from clova_train.tooluse.served_llm import SERVING_FILE

    adapter = export / "adapter"
    words = ["<unk>", "<s>", "</s>", "hello", "world", "USER:", "ASSISTANT:", "a", "chat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = PromptTemplate().chat_template(bos_token=True)
    tokenizer.save_pretrained(str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": "example/tiny-base", "r": 4, "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"{}")
    (adapter / TEMPLATE_FILE).write_text(json.dumps(PromptTemplate().to_dict()))
    (adapter / SERVING_FILE).write_text(json.dumps({"stop": ["Observation:"], "temperature": 0.0, "max_tokens": 8}))
    return export


def edit_json(file: Path, **changes: object) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def chat_template(text: str) -> Callable[[Path], None]:
    """A spoiler: the export's chat template replaced by ``text``."""
    def spoil(export: Path) -> None:
        (export / "adapter" / "chat_template.jinja").write_text(text)

    return spoil


def huge_template(export: Path) -> None:
    """A 100 MB chat template (sparse: the size alone must refuse it; tokenizers aborted the process on it)."""
    with open(export / "adapter" / "chat_template.jinja", "wb") as handle:
        handle.truncate(100 << 20)


def panicking_regex(export: Path) -> None:
    """A pre-tokenizer regex the tokenizers library panics on (``PanicException`` from Rust)."""
    edit_json(export / "adapter" / "tokenizer.json", pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False})


def replicated_layers(export: Path) -> None:
    """An adapter config asking for 10^6 replicated layers (78 s and an allocation failure in PEFT)."""
    edit_json(export / "adapter" / "adapter_config.json", layer_replication=[[0, 1_000_000]])


HOSTILE_FILES = {  # case: (how the export is spoiled, the words of its one error)
    "a template that loops": (chat_template(LOOP), ("chat template", "did not finish")),
    "a template that recurses": (chat_template("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}"),
                                 ("chat template", "RecursionError")),
    "a template of a 4 GB string": (chat_template("{{ 'x' * 4000000000 }}"), ("chat template", "MemoryError")),
    "a template that raises": (chat_template("{{ raise_exception('never') }}"), ("chat template", "never")),
    "a template that does not parse": (chat_template("{% if %}"), ("chat template", "TemplateSyntaxError")),
    "a template escaping the sandbox": (chat_template("{{ cycler.__init__.__globals__.os.system('true') }}"),
                                        ("chat template", "SecurityError")),
    "a 100 MB template": (huge_template, ("chat_template.jinja", "more than")),
    "a tokenizer regex that panics": (panicking_regex, ("tokenizer.json", "PanicException")),
    "10^6 replicated layers": (replicated_layers, ("adapter_config.json", "layer_replication")),
}
COMMANDS = {  # command: its argv for the spoiled export (or run) directory and a scratch folder
    "export": lambda spoiled, scratch: ["export", str(spoiled), "--output", str(scratch / "out")],
    "serve": lambda spoiled, scratch: ["serve", str(spoiled), "--port", "0"],
}


def cli_with_short_probe(argv: list[str]) -> int | None:
    """``clova-train argv`` with the chat template's probe bounded at 1.5 s instead of 30 s, for
    :func:`helpers.contained.run_cli` (a looping template then costs a case 1.5 s: the bound is what is tested, not
    its length)."""
    from clova_train.cli import main
    from clova_train.tooluse import template_guard

    template_guard.DEFAULT_GUARD = template_guard.GuardLimits(memory_mb=1024, probe_timeout_s=1.5,
                                                              render_timeout_s=0.5)
    return main(argv)


def run_hostile_case(export: Path, scratch: Path, case: str, command: str) -> tuple[object, tuple[str, ...]]:
    """A copy of ``export`` in ``scratch`` spoiled as ``case`` of :data:`HOSTILE_FILES`, and ``command`` run on it in a
    contained child: its :class:`~helpers.contained.CaseOutcome` and the words its one error must hold."""
    import shutil

    from helpers.contained import run_cli

    spoil, words = HOSTILE_FILES[case]
    spoiled = Path(shutil.copytree(export, scratch / "export"))
    spoil(spoiled)
    outcome = run_cli(COMMANDS[command](spoiled, scratch), timeout_s=20, memory_mb=6144, cpu_s=20,
                      entry=cli_with_short_probe)
    return outcome, words
