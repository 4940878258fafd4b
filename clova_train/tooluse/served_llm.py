"""Serving a LoRA tool-LLM export: chat messages in, the next ReAct step out (no Lightning).

>>> llm = ServedToolLLM.from_export("checkpoints/quickstart_lora/export")
>>> llm.chat_batch([ChatRequest([{"role": "user", "content": instruction}])])[0].text
'Thought: Do I need to use a tool? Yes\\nAction: ...\\nObservation:'

The model is the export's ``merged/`` directory when there is one, else its base (``--base-model``, the
export's ``base/`` copy, or the adapter config's base) with ``adapter/`` applied through PEFT. Prompts are
the tokenizer's chat template (the training prompt, token for token); decoding is greedy unless a request
asks for a temperature, and stops at EOS or the first stop string (``serving.json``), which is kept in the
reply as in training.

The export's files are untrusted: before any library reads them they are bounded
(:mod:`clova_train.core.model_file_limits`), and the tokenizer file and chat template are tried once in a limited
child process (:mod:`clova_train.tooluse.template_guard`); every request's prompt is rendered and encoded in such a
child too, and what the model writes decoded there, so a hostile template or tokenizer regex is one error for the
request that meets it, never a hang or a crash of the server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import DataError, ExportError, loading
from clova_train.core.manifest import BASE_DIR
from clova_train.core.safe_files import read_json_object
from clova_train.tooluse.template_guard import ChatTemplateRenderer, guarded_tokenizer, probe_tokenizer_directory

SERVING_FILE = "serving.json"
ROLES = ("system", "user", "assistant")


@dataclass
class ChatRequest:
    """One chat completion request (OpenAI field meanings).

    Args:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        max_tokens: generation budget (default: the export's ``serving.json``).
        stop: extra stop strings (the export's are always applied).
        temperature: 0 for greedy decoding (the default), else sampling at this temperature.
        seed: sampling seed (``temperature > 0`` only).
        top_p: nucleus sampling: the smallest set of tokens whose probabilities add up to ``top_p`` (sampling only).
        abandoned: asked after every decoding step; once it answers True the request's generation stops (its client
            went away: :class:`~clova_train.serving.abandoned.AbandonedRequests`).
    """

    messages: list[dict[str, str]]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    abandoned: Callable[[], bool] | None = None
    context_checked: bool = False  # its length was checked against the model's context (the HTTP server does)
    prompt_ids: list[int] | None = None  # its prompt's token ids, once encoded (kept for the worker that answers it)

    def __post_init__(self) -> None:
        # the one check of the messages, wherever the request comes from (the HTTP server builds it once, in the
        # server process, and hands it to its worker)
        self.messages = check_messages(self.messages)


@dataclass
class ChatReply:
    """The generated step and its token counts."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None  # "stop" (EOS or a stop string) or "length"; None while a streamed reply goes on


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a list of role/content dicts, or a :class:`DataError` naming the bad entry."""
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise DataError(f"messages[{index}] must be {{'role': one of {list(ROLES)}, 'content': a string}}")
    if messages[-1]["role"] != "user":
        raise DataError("the last message must be the user's (the model answers it)")
    return messages


def context_length(config: Any, tokenizer: Any = None) -> int | None:
    """The most positions the model attends to (its config's ``max_position_embeddings`` or ``n_positions``, else
    the tokenizer's ``model_max_length`` when it is a real bound), or None when neither says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None


@dataclass
class ContextBudget:
    """How long a chat may be: its prompt's tokens plus its generation budget within the model's context.

    Args:
        tokenizer: the served tokenizer, with the chat template the model was trained with.
        context: the model's context length (None: unchecked).
        default_max_tokens: the budget of a request that names none (the export's ``serving.json``).
        renderer: renders the chat template, encodes and decodes in a limited child (None, or one without the
            tokenizer: the tokenizer does that in-process, for files this package wrote itself).
    """

    tokenizer: Any
    context: int | None
    default_max_tokens: int
    renderer: ChatTemplateRenderer | None = None

    @classmethod
    def from_export(cls, directory: str | os.PathLike[str], base_model: str | os.PathLike[str] | None = None
                    ) -> ContextBudget:
        """The budget of an export, from its tokenizer and model config alone (no weights: the HTTP server checks
        requests with it before they reach a worker)."""
        from transformers import AutoConfig, AutoTokenizer

        directory = Path(directory)
        base = ServedToolLLM.check_export(directory, base_model)
        source = directory / "merged" if base is None else directory / "adapter"
        with loading("the LoRA export's tokenizer and config", str(directory)):
            tokenizer = AutoTokenizer.from_pretrained(str(source))
            config = AutoConfig.from_pretrained(str(directory / "merged") if base is None else base)
        return cls(tokenizer, context_length(config, tokenizer), serving_defaults(source)[1],
                   template_renderer(tokenizer, source))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of ``messages`` (the chat template, rendered in the limited child when there is one)."""
        if self.renderer is not None and self.renderer.template is not None:
            return self.renderer.render(messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The token ids of ``request``'s prompt (rendered and encoded in the limited child when there is one),
        kept on the request."""
        if request.prompt_ids is None:
            if self._in_child() and self.renderer.template is not None:
                request.prompt_ids = self.renderer.render_ids(request.messages)
            else:
                request.prompt_ids = self.encode([self.render(request.messages)])[0]
        return request.prompt_ids

    def prompt_tokens(self, request: ChatRequest) -> int:
        return len(self.prompt_ids(request))

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, no special tokens added (in the limited child when there is one)."""
        if self._in_child():
            return self.renderer.encode(texts)
        with guarded_tokenizer(self.tokenizer):
            return [list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]

    def decode(self, rows: list[list[int]]) -> list[str]:
        """Each row's text, special tokens skipped, as ``tokenizer.decode(row, skip_special_tokens=True)`` gives it
        (the decoder runs in the limited child when there is one; transformers' clean-up of spaces here)."""
        if not self._in_child():
            with guarded_tokenizer(self.tokenizer):
                return [self.tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        texts = self.renderer.decode(rows, skip_special_tokens=True)
        if _cleans_up_spaces(self.tokenizer):
            texts = [self.tokenizer.clean_up_tokenization(text) for text in texts]
        return texts

    def _in_child(self) -> bool:
        return self.renderer is not None and self.renderer.encodes

    def check(self, request: ChatRequest) -> None:
        """A :class:`DataError` naming both numbers when the prompt plus ``max_tokens`` exceeds the context."""
        if self.context is None:
            return
        prompt = self.prompt_tokens(request)
        budget = request.max_tokens or self.default_max_tokens
        if prompt + budget > self.context:
            raise DataError(f"the prompt is {prompt:,} tokens and max_tokens is {budget:,}: {prompt + budget:,} is "
                            f"more than the model's context of {self.context:,} tokens (shorten the messages or ask "
                            "for fewer tokens)")
        request.context_checked = True


def template_renderer(tokenizer: Any, source: Path) -> ChatTemplateRenderer | None:
    """A limited child for ``tokenizer`` (loaded from ``source``): it renders its chat template and, for a fast
    tokenizer (a ``tokenizers`` backend: every tokenizer transformers 5 loads from a ``tokenizer.json``), encodes
    and decodes with it; None when it has neither."""
    template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
    template = template if isinstance(template, str) else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialized = backend.to_str() if backend is not None and hasattr(backend, "to_str") else None
    if template is None and serialized is None:
        return None
    special = {name: str(value) if not isinstance(value, list) else [str(v) for v in value]
               for name, value in tokenizer.special_tokens_map.items()}
    key = (template, json.dumps(special, sort_keys=True), str(source), hash(serialized))
    if key not in _RENDERERS:  # one child per tokenizer in a process, however many loaders ask for it
        _RENDERERS[key] = ChatTemplateRenderer(template, special, str(source), tokenizer_json=serialized)
    return _RENDERERS[key]


_RENDERERS: dict[tuple[Any, ...], ChatTemplateRenderer] = {}


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` cleans up spaces after its decoder (transformers 5 does for a tokenizer saved
    with ``clean_up_tokenization_spaces``, except for a BPE model unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(model).__name__ != "BPE" or bool(forced)


def default_temperature(directory: str | os.PathLike[str]) -> float:
    """The temperature a chat request that names none is answered at, as the export says (vLLM's rule): its merged
    model's ``generation_config.json`` (``do_sample: false``, as ``clova-train export`` writes it for the greedy
    decoding the run was evaluated with: 0; else its ``temperature``, 1.0 when unset), else its ``serving.json``'s
    ``temperature``, else 1.0."""
    directory = Path(directory)
    generation = directory / "merged" / "generation_config.json"
    if generation.is_file():
        config = read_json_object(generation, "generation config")
        if not config.get("do_sample", False):
            return 0.0
        value = config.get("temperature")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0
    for source in (directory / "merged", directory / "adapter"):
        defaults = serving_defaults(source)[0] if (source / SERVING_FILE).is_file() else {}
        value = defaults.get("temperature")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 1.0


def serving_defaults(source: Path) -> tuple[dict[str, Any], int]:
    """The export's ``serving.json`` (stop strings, temperature, max_tokens) and its generation budget."""
    defaults_file = source / SERVING_FILE
    defaults = read_json_object(defaults_file, "serving defaults") if defaults_file.is_file() else {}
    return defaults, int(defaults.get("max_tokens", 256))


def _cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """``text`` before its first stop string, and that stop string (None when it holds none). As OpenAI and vLLM
    answer, the stop string is not part of the reply."""
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    start, stop = min(found, key=lambda item: (item[0], -len(item[1])))
    return text[:start], stop


def pending_stop(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (a streamed reply holds them
    back until the next tokens say whether the stop string follows, so no part of it is ever sent)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle")


def check_adapter_weights(adapter: Path) -> None:
    """An :class:`ExportError` unless the PEFT adapter directory ``adapter`` holds its weights as safetensors: PEFT
    would unpickle an ``adapter_model.bin`` (a file from someone else), which this package never does."""
    if (adapter / ADAPTER_WEIGHTS).is_file():
        return
    pickled = sorted(p.name for p in adapter.glob("adapter_model*") if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ExportError(f"adapter weights {adapter / pickled[0]} are a pickle, which clova-train does not load: it "
                          f"reads {ADAPTER_WEIGHTS} only (save the adapter with save_pretrained(..., "
                          "safe_serialization=True))")
    raise ExportError(f"adapter directory {adapter} has no {ADAPTER_WEIGHTS}")


def adapter_base_name(adapter: Path) -> str:
    """The base model a PEFT adapter directory names (``base_model_name_or_path`` of its ``adapter_config.json``)."""
    named = read_json_object(adapter / "adapter_config.json", "adapter config").get("base_model_name_or_path")
    if not isinstance(named, str) or not named:
        raise ExportError(f"{adapter / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    return named


def config_digest(model_dir: Path) -> str:
    """SHA-256 of a model directory's ``config.json``: which base a recorded local path held at export time."""
    import hashlib

    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()


def _trained_base(directory: Path) -> str | None:
    """The local base model the export's run was trained from (``export.json``), when it recorded one and that
    directory still holds the same model (its ``config.json`` digest as recorded)."""
    from clova_train.core.manifest import MANIFEST_FILE

    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        return None
    source = read_json_object(manifest, "export manifest").get("source")
    named = source.get("base_model") if isinstance(source, dict) else None
    digest = source.get("base_model_config_sha256") if isinstance(source, dict) else None
    if not (isinstance(named, str) and named.startswith("/") and isinstance(digest, str)):
        return None
    if not (Path(named) / "config.json").is_file() or config_digest(Path(named)) != digest:
        return None
    return named


class ServedToolLLM:
    """A tool-using LLM loaded from a ``clova-train export`` directory of a LoRA run.

    Args:
        model: the causal LM (merged, or a PEFT model with the adapter).
        tokenizer: its tokenizer, with the training chat template.
        defaults: ``serving.json`` (``stop``, ``temperature``, ``max_tokens``).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, defaults: dict[str, Any]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ExportError("the export's tokenizer has no chat_template (export it again with this version)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.stop = [str(s) for s in defaults.get("stop", [])]
        self.max_tokens = int(defaults.get("max_tokens", 256))
        self.budget = ContextBudget(tokenizer, context_length(getattr(model, "config", None), tokenizer), self.max_tokens,
                                    template_renderer(tokenizer, Path(getattr(tokenizer, "name_or_path", "") or ".")))

    @classmethod
    def check_export(cls, directory: str | os.PathLike[str], base_model: str | os.PathLike[str] | None = None
                     ) -> str | None:
        """What can be checked of a LoRA export without loading a model (a server checks this before its workers
        load it): the adapter, and the base it applies to when that is not the export's merged model. Returns that
        base's location (None: the merged model is served); an :class:`ExportError` names what is wrong."""
        from clova_train.core.model_file_limits import check_export_files, check_model_files

        directory = Path(directory)
        adapter = directory / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            raise ExportError(f"{directory} is not a LoRA export (adapter/adapter_config.json missing)")
        check_export_files(directory)
        if (directory / "merged").is_dir() and base_model is None:
            probe_tokenizer_directory(directory / "merged")
            return None
        check_adapter_weights(adapter)
        probe_tokenizer_directory(adapter)
        base = cls._base_location(directory, adapter, base_model)
        if Path(base).is_dir() and Path(base) != directory / BASE_DIR:
            check_model_files(Path(base))
        return base

    @classmethod
    def from_export(
        cls, directory: str | os.PathLike[str], base_model: str | os.PathLike[str] | None = None,
        device: str | torch.device = "cpu",
    ) -> ServedToolLLM:
        """Load an export (``merged/`` if present and no ``base_model`` is given, else base + ``adapter/``)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory = Path(directory)
        adapter, merged = directory / "adapter", directory / "merged"
        base = cls.check_export(directory, base_model)
        with loading("the LoRA export", str(directory)):
            if base is None:
                source = merged
                model = AutoModelForCausalLM.from_pretrained(str(merged))
            else:
                from peft import PeftModel

                source = adapter
                model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        return cls(model.to(device), tokenizer, serving_defaults(source)[0])

    @staticmethod
    def _base_location(directory: Path, adapter: Path, base_model: str | os.PathLike[str] | None) -> str:
        if base_model is not None:
            if not Path(base_model).expanduser().is_dir():
                raise ExportError(f"base model directory not found: {base_model}")
            return str(Path(base_model).expanduser())
        if (directory / BASE_DIR / "config.json").is_file():
            return str(directory / BASE_DIR)
        trained_from = _trained_base(directory)
        if trained_from is not None:  # the local copy it was trained from, still here and unchanged
            return trained_from
        named = adapter_base_name(adapter)
        if named.startswith("/") and not Path(named).is_dir():
            raise ExportError(
                f"the adapter's base model {named} is not on this machine: pass --base-model DIR, "
                "or export with --copy-base"
            )
        return named

    def prompt(self, messages: list[dict[str, str]]) -> str:
        """The text the model sees for ``messages`` (the training prompt format)."""
        return self.budget.render(messages)

    @torch.no_grad()
    def chat_batch(self, requests: list[ChatRequest]) -> list[ChatReply]:
        """Answer requests together: greedy ones in one left-padded batch, sampled ones one by one."""
        self._check_context(requests)
        replies: dict[int, ChatReply] = {}
        greedy = [i for i, r in enumerate(requests) if r.temperature <= 0]
        if greedy:
            for i, reply in zip(greedy, self._generate([requests[i] for i in greedy], sample=False)):
                replies[i] = reply
        for i, request in enumerate(requests):
            if i not in replies:
                torch.manual_seed(request.seed)
                replies[i] = self._generate([request], sample=True)[0]
        return [replies[i] for i in range(len(requests))]

    def _check_context(self, requests: list[ChatRequest]) -> None:
        for request in requests:
            if not request.context_checked:
                self.budget.check(request)

    def _generate(self, requests: list[ChatRequest], sample: bool) -> list[ChatReply]:
        encoded, options = self._inputs(requests, sample)
        output = self.model.generate(**encoded, **options, stopping_criteria=self._row_stops(requests, encoded))
        width = encoded["input_ids"].shape[1]
        return [self._reply(output[row, width:].tolist(), request, int(encoded["attention_mask"][row].sum()), True)
                for row, request in enumerate(requests)]

    def _inputs(self, requests: list[ChatRequest], sample: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The left-padded prompts of ``requests`` and the ``generate`` options that answer them together."""
        rows = [self.budget.prompt_ids(r) for r in requests]
        width, pad = max(len(row) for row in rows), self.tokenizer.pad_token_id
        encoded = {  # left-padded, as the tokenizer pads for generation
            "input_ids": torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long),
            "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long),
        }
        encoded = {k: v.to(self.model.device) for k, v in encoded.items()}
        budget = max(r.max_tokens or self.max_tokens for r in requests)
        options: dict[str, Any] = {"do_sample": sample, "max_new_tokens": budget, "pad_token_id": self.tokenizer.pad_token_id,
                                   "eos_token_id": self.tokenizer.eos_token_id}
        if sample:
            options.update(temperature=requests[0].temperature, top_p=requests[0].top_p, top_k=0)
        else:
            options.update(temperature=None, top_p=None, top_k=None)
        return encoded, options

    def _row_stops(self, requests: list[ChatRequest], encoded: dict[str, torch.Tensor],
                   cancelled: Any = None) -> Any:
        """``generate``'s stopping criteria: a row is done at its own token limit, once its text holds one of its
        stop strings or once its request is ``abandoned``, and every row when ``cancelled`` (a ``threading.Event``) is
        set; so a batch stops as soon as each of its requests is answered or given up, not at the largest budget."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        width = encoded["input_ids"].shape[1]
        limits = [r.max_tokens or self.max_tokens for r in requests]
        stops = [self.stops(r) for r in requests]
        every_stop = sorted({s for row in stops for s in row})
        tail = max((len(ids) for ids in self.budget.encode(every_stop)), default=1) + 2

        gone = [False] * len(requests)  # abandoned requests (the question is asked until it says yes)

        class RowStops(StoppingCriteria):
            def __call__(criteria, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:  # noqa: N805
                done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
                if cancelled is not None and cancelled.is_set():
                    return done | True
                asked = []  # the rows whose last tokens are decoded (together: one round trip) to look for stops
                for row in range(input_ids.shape[0]):
                    new = input_ids[row, width:]
                    check = requests[row].abandoned
                    gone[row] = gone[row] or (check is not None and check())
                    if gone[row] or len(new) >= limits[row]:
                        done[row] = True
                    elif stops[row]:
                        asked.append(row)
                if asked:
                    texts = self.budget.decode([input_ids[row, width:][-tail:].tolist() for row in asked])
                    for row, text in zip(asked, texts):
                        done[row] = any(stop in text for stop in stops[row])
                return done

        return StoppingCriteriaList([RowStops()])

    def _reply(self, new: list[int], request: ChatRequest, prompt_tokens: int, complete: bool) -> ChatReply:
        """The reply to ``request`` from its generated tokens ``new``: cut at EOS, at its token limit and after the
        first stop string. ``complete``: generation is over; else ``finish_reason`` stays None until one of those
        ends the reply (streaming)."""
        limit = request.max_tokens or self.max_tokens
        kept = new[:limit]
        ended = self.tokenizer.eos_token_id in kept
        if ended:
            kept = kept[: kept.index(self.tokenizer.eos_token_id)]
        text, stop = _cut(self.budget.decode([kept])[0], self.stops(request))
        stopped = stop is not None
        if stopped:  # the tokens generated up to the end of the stop string
            count = len(self.budget.encode([text + stop])[0])
        else:
            count = len(kept)
        finish = "stop" if stopped or ended else "length"
        if not (complete or stopped or ended or len(new) >= limit):
            finish = None
        return ChatReply(text, prompt_tokens, count, finish)

    def stops(self, request: ChatRequest) -> list[str]:
        """The stop strings of ``request``: the export's and its own."""
        return self.stop + list(request.stop)

    @torch.no_grad()
    def stream_batch(self, requests: list[ChatRequest], every_step: bool = True) -> Iterator[list[ChatReply]]:
        """Every request's reply so far, after each generated token (``finish_reason`` None while it is still being
        written); the last list equals :meth:`chat_batch`'s replies. Greedy requests are generated together,
        sampled ones one after another. ``every_step=False`` yields only when a run of requests has finished: no
        text is decoded while generating, so the consumer leaves ``generate``'s thread the interpreter (a
        consumer that decodes and hands on every step halves a GPU's decoding speed, which is bound by Python's
        kernel launches), while a closed consumer still stops the generation at the next step."""
        self._check_context(requests)
        replies = [ChatReply("", 0, 0, None) for _ in requests]
        greedy = [i for i, r in enumerate(requests) if r.temperature <= 0]
        runs = ([greedy] if greedy else []) + [[i] for i, r in enumerate(requests) if r.temperature > 0]
        for run in runs:
            if requests[run[0]].temperature > 0:
                torch.manual_seed(requests[run[0]].seed)
            for step in self._stream([requests[i] for i in run], requests[run[0]].temperature > 0, every_step):
                for i, reply in zip(run, step):
                    replies[i] = reply
                yield list(replies)

    def _stream(self, requests: list[ChatRequest], sample: bool, every_step: bool = True) -> Iterator[list[ChatReply]]:
        import threading

        encoded, options = self._inputs(requests, sample)
        prompt_tokens = [int(n) for n in encoded["attention_mask"].sum(1)]
        steps = _TokenSteps()
        failure: list[BaseException] = []
        cancelled = threading.Event()
        stopping = self._row_stops(requests, encoded, cancelled)

        def generate() -> None:
            try:
                with torch.no_grad():
                    self.model.generate(**encoded, **options, streamer=steps, stopping_criteria=stopping)
            except BaseException as err:  # noqa: BLE001 (handed to the consumer, which raises it)
                failure.append(err)
            finally:
                steps.end()

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        tokens: list[list[int]] = [[] for _ in requests]
        try:
            for step in steps:
                for row, token in enumerate(step):
                    tokens[row].append(token)
                if every_step:
                    yield [self._reply(t, r, n, False) for t, r, n in zip(tokens, requests, prompt_tokens)]
        finally:  # the consumer stopped early (an error, a closed stream): stop generating, then wait for it
            cancelled.set()
            worker.join()
        if failure:
            raise failure[0]
        yield [self._reply(t, r, n, True) for t, r, n in zip(tokens, requests, prompt_tokens)]


class _TokenSteps:
    """A ``generate`` streamer that hands over each step's new tokens (one per sequence) as an iterator."""

    def __init__(self) -> None:
        import queue

        self.queue: queue.Queue = queue.Queue()
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompts
            self.prompt_seen = True
            return
        self.queue.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self.queue.put(None)

    def __iter__(self) -> Iterator[list[int]]:
        while (step := self.queue.get()) is not None:
            yield step
