"""What a config file says of a chat model and a text embedder, and the backends it builds.

:class:`LLMConfig` and :class:`EmbedderConfig` are the ``llm`` / ``embedder`` sections of every config that talks
to a model: the closed loop (``clova-train loop``) and the reasoning-loop environments (HYDRA, AVIS, HAMMR) of
``clova-train controller``. Each ``build()`` returns a backend of :mod:`clova_train.llm.backends`; each
``problems()`` checks the values first (see :class:`clova_train.core.checks.Problems`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from clova_train.core.checks import Problems, is_integer, is_number
from clova_train.llm.backends import (
    ChatBackend,
    EmbeddingBackend,
    HashingEmbedder,
    OpenAIChatBackend,
    OpenAIEmbeddingBackend,
    TransformersChatBackend,
    TransformersEmbeddingBackend,
)

LLMKind = Literal["scripted", "openai", "transformers"]
EmbedderKind = Literal["hashing", "openai", "transformers"]
DEFAULT_DIMS = {"hashing": 256, "openai": 1536}  # ``dim: null``: text-embedding-3-small's size for openai


@dataclass
class LLMConfig:
    """The chat model: planner, coder, reasoner, reflection, dispatcher (whichever prompts a config's loop writes).

    The default ``timeout_s`` is 60 s: it bounds each network read, and a chat completion that is not streamed
    sends nothing until the whole reply is written, which on a busy server (a 13B model writing 512 tokens for
    several clients) takes more than the 30 s an OpenAI client allows by default; a read cut short is retried
    from the start, so a tighter bound wastes the work and then fails the call. A dead server is still reported
    within ``deadline_s``.

    Args:
        kind: ``scripted`` (the offline world's stand-in, a deterministic function of the prompt), ``openai``
            (any OpenAI-compatible server: vLLM, Ollama, OpenAI) or ``transformers`` (a local causal LM).
        model: ``openai``: the model name the server knows; ``transformers``: a local model directory or hub id.
        base_url: ``openai``: the server's URL with its API prefix.
        api_key_env: ``openai``: the environment variable holding the API key.
        temperature: sampling temperature (0: greedy, reproducible).
        max_tokens: longest reply, in tokens.
        timeout_s: ``openai``: limit of each network operation of a request (connect, each read, each write).
        max_retries: ``openai``: retries on network errors, timeouts, 408/409/429, 5xx and malformed replies.
        deadline_s: ``openai``: total time of one call, retries and Retry-After waits included (none:
            ``timeout_s * (max_retries + 1)``).
    """

    kind: LLMKind = "scripted"
    model: str = ""
    base_url: str = "http://localhost:8000/v1"
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    max_tokens: int = 512
    timeout_s: float = 60.0
    max_retries: int = 3
    deadline_s: float | None = None

    def build(self, scripted: Callable[[], ChatBackend]) -> ChatBackend:
        """The chat backend; ``scripted`` makes the offline stand-in (each offline world has its own)."""
        if self.kind == "scripted":
            return scripted()
        if self.kind == "openai":
            return OpenAIChatBackend(self.base_url, self.model, self.temperature, max_tokens=self.max_tokens,
                                     api_key_env=self.api_key_env, timeout_s=self.timeout_s,
                                     max_retries=self.max_retries, deadline_s=self.deadline_s)
        return TransformersChatBackend(self.model, max_new_tokens=self.max_tokens)

    def problems(self, prefix: str = "llm") -> list[str]:
        """Every bad value, as ``<prefix>.<field> = <value>: <rule>``."""
        found = Problems(prefix)
        found.one_of("kind", self.kind, get_args(LLMKind))
        found.at_least("temperature", self.temperature, 0)
        found.at_least("max_tokens", self.max_tokens, 1)
        found.positive("timeout_s", self.timeout_s)
        found.at_least("max_retries", self.max_retries, 0)
        found.need(self.deadline_s is None or is_number(self.deadline_s) and self.deadline_s > 0, "deadline_s",
                   self.deadline_s, "must be a number > 0 (or null: timeout_s * (max_retries + 1))")
        return found.messages


@dataclass
class EmbedderConfig:
    """The text embedder (the controller's observation; the closed loop's demonstration retrieval).

    Args:
        kind: ``hashing`` (offline bag of words), ``openai`` (an embeddings endpoint; HYDRA: text-embedding-3-small,
            1536-d) or ``transformers`` (a local encoder, mean-pooled: BERT).
        model: ``openai``: the model name; ``transformers``: a local model directory or hub id.
        base_url: ``openai``: the server's URL with its API prefix.
        api_key_env: ``openai``: the environment variable holding the API key.
        dim: vector size (``hashing``: chosen; ``openai``: checked against the replies; ``transformers``: the
            model's, this is ignored); none: 256 for ``hashing``, 1536 for ``openai``.
    """

    kind: EmbedderKind = "hashing"
    model: str = "text-embedding-3-small"
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str = "OPENAI_API_KEY"
    dim: int | None = None

    def build(self) -> EmbeddingBackend:
        """The embedding backend."""
        if self.kind == "hashing":
            return HashingEmbedder(self.dim or DEFAULT_DIMS["hashing"])
        if self.kind == "openai":
            return OpenAIEmbeddingBackend(self.base_url, self.model, self.dim or DEFAULT_DIMS["openai"],
                                          api_key_env=self.api_key_env)
        return TransformersEmbeddingBackend(self.model)

    def problems(self, prefix: str = "embedder") -> list[str]:
        """Every bad value, as ``<prefix>.<field> = <value>: <rule>``."""
        found = Problems(prefix)
        found.one_of("kind", self.kind, get_args(EmbedderKind))
        found.need(self.dim is None or is_integer(self.dim) and self.dim >= 1, "dim", self.dim,
                   "must be a number >= 1")
        return found.messages
