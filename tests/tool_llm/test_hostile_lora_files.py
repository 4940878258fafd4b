"""A LoRA export's own files (chat template, tokenizer, adapter and model configs) from someone else: each hostile
one is one ExportError naming it, in well under two seconds, never a hang, a crash or an abort of the caller.

One tiny export (a word-level tokenizer with the training chat template, an adapter config naming a hub base, no
real weights: nothing here loads a model) is built once; each case copies its small files and spoils one."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from clova_train.core.errors import ExportError
from clova_train.core import model_file_limits
from clova_train.tooluse import template_guard
from clova_train.tooluse.prompt_template import PromptTemplate
from clova_train.tooluse.served_llm import SERVING_FILE, ContextBudget, ServedToolLLM
from clova_train.tooluse.template_guard import ChatTemplateRenderer, GuardLimits

FAST = GuardLimits(memory_mb=1024, probe_timeout_s=1.5, render_timeout_s=0.5)
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
USER = [{"role": "user", "content": "hello world"}]
BOUND_S = 10.0  # a refusal's time in a started child (under 0.6 s on an idle machine; a hang would never end)


@pytest.fixture(autouse=True)
def fast_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_guard, "DEFAULT_GUARD", FAST)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.hostile_lora_export import write_tiny_lora_export

    return write_tiny_lora_export(tmp_path_factory.mktemp("hostile") / "export")


def spoiled(tiny_export: Path, tmp_path: Path) -> Path:
    """A copy of the tiny export to spoil."""
    return Path(shutil.copytree(tiny_export, tmp_path / "export"))


def edit_json(file: Path, **changes: object) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def set_template(export: Path, template: str) -> None:
    adapter = export / "adapter"
    if (adapter / "chat_template.jinja").is_file():
        (adapter / "chat_template.jinja").write_text(template)
    else:
        edit_json(adapter / "tokenizer_config.json", chat_template=template)


def refused(export: Path, *words: str) -> str:
    """The one error ``check_export`` gives, which holds ``words`` (a hang would be stopped by the probe's timeout:
    the test would fail on the message, not hang)."""
    with pytest.raises(ExportError) as caught:
        ServedToolLLM.check_export(export)
    message = str(caught.value)
    assert all(word in message for word in words), message
    return message


def test_the_tiny_export_passes(tiny_export: Path, tmp_path: Path) -> None:
    """As does a real template that refuses a system message (Gemma's): the probe tries a user-only conversation."""
    assert ServedToolLLM.check_export(tiny_export) == "example/tiny-base"
    export = spoiled(tiny_export, tmp_path)
    set_template(export, "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + PromptTemplate().chat_template(bos_token=True))
    assert ServedToolLLM.check_export(export) == "example/tiny-base"


@pytest.mark.parametrize("template, words", [
    (LOOP, ("did not finish",)),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ("SecurityError",)),
    ("{{ raise_exception('never') }}", ("TemplateError: never",)),
])
def test_a_hostile_chat_template_is_one_error_at_load(tiny_export: Path, tmp_path: Path, template: str,
                                                      words: tuple[str, ...]) -> None:
    """The probe render at load, in a limited child: a loop is stopped at its timeout, an escape is refused."""
    export = spoiled(tiny_export, tmp_path)
    set_template(export, template)
    refused(export, f"the chat template of {export / 'adapter'}", *words)


@pytest.fixture(scope="module")
def renderer() -> ChatTemplateRenderer:
    shared = ChatTemplateRenderer("", {"bos_token": "<s>", "eos_token": "</s>"}, "the export", FAST)
    yield shared
    shared.close()


@pytest.mark.parametrize("template, words", [
    ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 'x' * 3000000000 }}", "MemoryError"),
    ("{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}{{ s.x }}",
     "MemoryError|did not finish"),
    ("{% for i in range(30000) %}{{ 'x' * 100 }}{% endfor %}", "more than the"),
    ("{% if %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ cycler.__init__.__globals__.os.system('true') }}", "SecurityError"),
    ("{{ messages.append(1) }}{{ messages.pop() }}", "SecurityError"),
    ("{{ (messages|first).update({'role': 1}) }}", "SecurityError"),
])
def test_a_hostile_template_is_one_error_per_render(renderer: ChatTemplateRenderer, template: str, words: str) -> None:
    renderer.template = template
    start = time.monotonic()
    with pytest.raises(ExportError, match=words):
        renderer.render(USER)
    assert time.monotonic() - start < BOUND_S
    renderer.template = "{{ bos_token }}{{ messages[0]['content'] }}"
    assert renderer.render(USER) == "<s>hello world"  # and the next render is answered


def test_a_huge_chat_template_is_refused_before_any_parser_reads_it(tiny_export: Path, tmp_path: Path) -> None:
    export = spoiled(tiny_export, tmp_path)
    set_template(export, "{{ 'x' }}" + " " * (300 << 10))
    refused(export, "chat", "more than")
    big = export / "adapter" / "chat_template.jinja"
    with open(big, "wb") as handle:  # 100 MB, sparse: the size alone refuses it
        handle.truncate(100 << 20)
    refused(export, "chat_template.jinja", "more than")


def test_a_tokenizer_whose_regex_panics_is_one_error_naming_it(tiny_export: Path, tmp_path: Path) -> None:
    export = spoiled(tiny_export, tmp_path)
    file = export / "adapter" / "tokenizer.json"
    edit_json(file, pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated",
                                   "invert": False})
    refused(export, str(file), "PanicException")


def test_tokenizer_file_shapes_are_bounded(tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    export = spoiled(tiny_export, tmp_path)
    file = export / "adapter" / "tokenizer.json"
    original = file.read_text()
    nested: dict = {"type": "Lowercase"}
    for _ in range(12):
        nested = {"type": "Sequence", "normalizers": [nested]}
    edit_json(file, normalizer=nested)
    refused(export, "tokenizer.json", "normalizer", "deep")
    file.write_text(original)
    monkeypatch.setattr(model_file_limits, "MAX_VOCAB", 5)  # a vocabulary larger than any model's, in small
    refused(export, "tokenizer.json", "model.vocab")


@pytest.mark.parametrize("changes, words", [
    ({"layer_replication": [[0, 1_000_000]]}, ("layer_replication",)),
    ({"layer_replication": [[0, 20]] * 100}, ("layer_replication", "2,000 layers")),
    ({"r": 10**9}, ("r is",)),
    ({"lora_alpha": 1e300}, ("lora_alpha",)),
    ({"layers_to_transform": list(range(5000))}, ("layers_to_transform",)),
    ({"layers_to_transform": 10**7}, ("layers_to_transform",)),
    ({"target_modules": "(a+)+$"}, ("target_modules", "repeats a repetition")),
    ({"target_modules": ["q_proj"] * 5000}, ("target_modules",)),
    ({"rank_pattern": {"q_proj": 10**8}}, ("rank_pattern",)),
    ({"rank_pattern": {"(x*)*y": 4}}, ("rank_pattern key",)),
])
def test_adapter_config_magnitudes_are_bounded(tiny_export: Path, tmp_path: Path, changes: dict, words: tuple) -> None:
    export = spoiled(tiny_export, tmp_path)
    edit_json(export / "adapter" / "adapter_config.json", **changes)
    refused(export, "adapter_config.json", *words)


@pytest.mark.parametrize("changes, words", [
    ({"vocab_size": 10**12}, ("vocab_size",)),
    ({"num_hidden_layers": 10**6}, ("num_hidden_layers",)),
    ({"max_position_embeddings": 10**10}, ("max_position_embeddings",)),
    ({"text_config": {"hidden_size": 10**7}}, ("hidden_size",)),
    ({"hidden_size": 65_536, "intermediate_size": 1 << 19, "num_hidden_layers": 1_024}, ("parameters",)),
    ({"vocab_size": 1 << 20, "hidden_size": 8_192}, ("weight files",)),
])
def test_model_config_magnitudes_are_bounded(tiny_export: Path, tmp_path: Path, changes: dict, words: tuple) -> None:
    export = spoiled(tiny_export, tmp_path)
    merged = export / "merged"
    shutil.copytree(export / "adapter", merged)
    (merged / "model.safetensors").write_bytes(b"x" * 1024)
    (merged / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 9, "hidden_size": 16,
                                                    "num_hidden_layers": 2, **changes}))
    refused(export, "config.json", *words)


def test_generation_and_serving_settings_are_bounded(tiny_export: Path, tmp_path: Path) -> None:
    export = spoiled(tiny_export, tmp_path)
    edit_json(export / "adapter" / SERVING_FILE, stop=["x"] * 10_000)
    refused(export, SERVING_FILE, "stop")
    edit_json(export / "adapter" / SERVING_FILE, stop=["x"], max_tokens=10**15)
    refused(export, SERVING_FILE, "max_tokens")


def test_a_template_that_refuses_a_conversation_is_the_clients_error(renderer: ChatTemplateRenderer) -> None:
    """A template's own refusal (``raise_exception``: roles out of order, say) is a DataError (a 400 from the server)."""
    from clova_train.core.errors import DataError

    renderer.template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system message') }}{% endif %}"
    with pytest.raises(DataError, match="refuses this conversation: no system message"):
        renderer.render(USER)


def test_each_request_is_rendered_under_a_time_and_size_bound(tiny_export: Path, tmp_path: Path) -> None:
    """A template that is fine for the probe conversation but loops, or writes megabytes, on another one: that
    request gets one error in well under two seconds, and the next is answered."""
    from transformers import AutoTokenizer

    export = spoiled(tiny_export, tmp_path)
    trained = PromptTemplate().chat_template(bos_token=True)
    set_template(export, "{% if messages[-1]['content'] == 'loop' %}" + LOOP + "{% endif %}"
                 "{% if messages[-1]['content'] == 'big' %}{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}"
                 "{% endif %}" + trained)
    tokenizer = AutoTokenizer.from_pretrained(str(export / "adapter"))
    from clova_train.tooluse.served_llm import ChatRequest, template_renderer

    budget = ContextBudget(tokenizer, 64, 8, template_renderer(tokenizer, export / "adapter"))
    try:
        assert budget.render(USER) == tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
        for content, words in (("big", "characters"), ("loop", "did not finish")):
            start = time.monotonic()
            with pytest.raises(ExportError, match=words):
                budget.check(ChatRequest([{"role": "user", "content": content}]))
            assert time.monotonic() - start < BOUND_S
        assert budget.prompt_tokens(ChatRequest(USER)) > 0
    finally:
        budget.renderer.close()


@pytest.mark.parametrize("spoil, words", [
    (lambda adapter: edit_json(adapter / "adapter_config.json", layer_replication=[[0, 1_000_000]]),
     "layer_replication"),
    (lambda adapter: set_template(adapter.parent, "{{ raise_exception('x') }}"), "chat template"),
])
def test_export_reads_a_runs_adapter_files_within_bounds(tiny_export: Path, tmp_path: Path, spoil, words: str) -> None:
    """``clova-train export`` of a run whose adapter files are hostile: one error before PEFT or tokenizers read them."""
    from clova_train.export.lora import export_lora_run

    run = tmp_path / "run"
    shutil.copytree(tiny_export / "adapter", run / "adapter")
    spoil(run / "adapter")
    with pytest.raises(ExportError, match=words):
        export_lora_run(run, tmp_path / "staging", merged=False)


REAL_CONFIGS = [  # the shapes of the largest public models' files (sizes from their config.json)
    {"model_type": "llama", "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
     "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0}},
    {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192, "sliding_window": 131072,
     "use_sliding_window": False, "num_hidden_layers": 80, "intermediate_size": 29568},
    {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_local_experts": 8,
     "intermediate_size": 14336, "num_hidden_layers": 32, "sliding_window": None},
    {"model_type": "gemma3", "text_config": {"vocab_size": 262208, "hidden_size": 5376, "num_hidden_layers": 62,
                                             "intermediate_size": 21504}, "vision_config": {"hidden_size": 1152}},
    {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "n_routed_experts": 256,
     "moe_intermediate_size": 2048, "intermediate_size": 18432, "num_hidden_layers": 61},
]


@pytest.mark.parametrize("config", REAL_CONFIGS, ids=[c["model_type"] for c in REAL_CONFIGS])
def test_the_bounds_pass_the_largest_real_configs(tmp_path: Path, config: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_file_limits.check_model_config(tmp_path / "config.json")
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "r": 256, "lora_alpha": 512, "target_modules": r".*\.(q_proj|v_proj)$", "layers_to_transform": [0, 1, 2],
        "rank_pattern": {"model.layers.0.self_attn.q_proj": 8}, "layer_replication": [[0, 16], [8, 24], [16, 32]]}))
    model_file_limits.check_adapter_config(tmp_path / "adapter_config.json")


SLOW_REGEX = "(q|qq)+b"  # fine on every probe text; about 4 ms per run of 24 q's without a b (Fibonacci backtracking)
SLOW_TEXT = ("q" * 24 + " ") * 400  # about 1.7 s to encode with it on this machine: past the render timeout


def _budget(export: Path) -> ContextBudget:
    from transformers import AutoTokenizer

    from clova_train.tooluse.served_llm import template_renderer

    tokenizer = AutoTokenizer.from_pretrained(str(export / "adapter"))
    return ContextBudget(tokenizer, 1 << 20, 8, template_renderer(tokenizer, export / "adapter"))


@pytest.mark.parametrize("part, spoil", [
    ("pre-tokenizer", {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": SLOW_REGEX}, "behavior": "Isolated",
                                         "invert": False}}),
    ("normalizer", {"normalizer": {"type": "Replace", "pattern": {"Regex": SLOW_REGEX}, "content": ""}}),
])
def test_a_tokenizer_regex_slow_on_one_clients_text_costs_that_request_only(tiny_export: Path, tmp_path: Path,
                                                                             part: str, spoil: dict) -> None:
    """A regex that passes the probe but backtracks on a text some client sends: the server process never runs it
    (the prompt is encoded in the limited child), so that request gets one error after the render timeout and the
    next request is answered."""
    from clova_train.tooluse.served_llm import ChatRequest

    export = spoiled(tiny_export, tmp_path)
    edit_json(export / "adapter" / "tokenizer.json", **spoil)
    assert ServedToolLLM.check_export(export) == "example/tiny-base"  # the probe does not see it
    budget = _budget(export)
    try:
        start = time.monotonic()
        with pytest.raises(ExportError, match="did not finish within"):
            budget.check(ChatRequest([{"role": "user", "content": SLOW_TEXT}]))
        assert time.monotonic() - start < BOUND_S
        assert budget.prompt_tokens(ChatRequest(USER)) > 0
        with pytest.raises(ExportError, match="the tokenizer of .* cannot encode this text"):
            budget.encode([SLOW_TEXT])  # a client's stop string goes the same way
    finally:
        budget.renderer.close()


def test_a_decoder_regex_slow_on_what_the_model_wrote_costs_that_request_only(tiny_export: Path, tmp_path: Path) -> None:
    export = spoiled(tiny_export, tmp_path)
    file = export / "adapter" / "tokenizer.json"
    tokenizer_json = json.loads(file.read_text())
    tokenizer_json["model"]["vocab"]["q" * 24] = len(tokenizer_json["model"]["vocab"])
    tokenizer_json["decoder"] = {"type": "Replace", "pattern": {"Regex": SLOW_REGEX}, "content": ""}
    file.write_text(json.dumps(tokenizer_json))
    budget = _budget(export)
    try:
        start = time.monotonic()
        with pytest.raises(ExportError, match="cannot decode these tokens: it did not finish"):
            budget.decode([[tokenizer_json["model"]["vocab"]["q" * 24]] * 400])
        assert time.monotonic() - start < BOUND_S
        assert budget.decode([[3, 4]]) == [budget.tokenizer.decode([3, 4], skip_special_tokens=True)]  # answered
    finally:
        budget.renderer.close()


def _word_piece(directory: Path) -> Path:
    """A WordPiece tokenizer saved to clean up spaces when decoding (transformers applies that after the decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["[UNK]", "[PAD]", "[CLS]", "hello", "world", ",", "!", "'", "s", "don", "t", "##s", "wor", "##ld", "?"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", clean_up_tokenization_spaces=True)
    tokenizer.chat_template = "{% for m in messages %}[CLS]{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(directory))
    return directory


def _byte_level_bpe(directory: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2's kind), trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["Thought: Do I need to use a tool? Yes", "Action: Detect, it's 日本語 🙂!"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>", clean_up_tokenization_spaces=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"
    tokenizer.save_pretrained(str(directory))
    return directory


PARITY_TEXTS = ["hello world", "Hello, world! It's don't?", "hello  world ,  ! ' s", "", "日本語 🙂 Thought: <|end|>",
                "[CLS] hello [PAD] world", "<s>hello</s> chat a"]


@pytest.mark.parametrize("kind", ["word-level", "word-piece", "byte-level-bpe"])
def test_the_child_encodes_and_decodes_as_the_tokenizer_does(tiny_export: Path, tmp_path: Path, kind: str) -> None:
    """The served ids and texts are the tokenizer's own, special tokens, unknown words and transformers' clean-up of
    spaces included."""
    from transformers import AutoTokenizer

    from clova_train.tooluse.served_llm import ChatRequest, template_renderer

    directory = (tiny_export / "adapter" if kind == "word-level" else
                 _word_piece(tmp_path / "tok") if kind == "word-piece" else _byte_level_bpe(tmp_path / "tok"))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    budget = ContextBudget(tokenizer, 1 << 20, 8, template_renderer(tokenizer, directory))
    assert budget.renderer is not None and budget.renderer.encodes
    try:
        expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PARITY_TEXTS]
        assert budget.encode(PARITY_TEXTS) == expected
        rows = [*expected, list(range(min(len(tokenizer), 40)))]
        assert budget.decode(rows) == [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        request = ChatRequest([{"role": "user", "content": "Hello, world!"}])
        text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        assert budget.prompt_ids(request) == tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        budget.renderer.close()
