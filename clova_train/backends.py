"""LLM and embedding backends for the reasoning loop: OpenAI-compatible HTTP, local transformers, offline.

* :class:`OpenAIChatBackend` / :class:`OpenAIEmbeddingBackend`: any server speaking the OpenAI REST API
  (vLLM, Ollama, OpenAI). Base URL, model and key come from the config; the key may instead name an
  environment variable. Timeouts, retries with exponential backoff on network errors, 429 and 5xx, and one
  clear :class:`BackendError` for anything else (4xx, malformed JSON, a reply without the expected fields).
* :class:`TransformersChatBackend` / :class:`TransformersEmbeddingBackend`: a local Hugging Face model
  directory (for instance one exported by ``clova-train export --merged`` after LoRA fine-tuning).
* :class:`HashingEmbedder`: signed feature hashing of word uni- and bigrams; offline, deterministic, fast.

Every backend has an ``identity()`` (what it is, never the key): the cache keys calls by it and by the
full request, so a recorded run replays exactly.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
import zlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from clova_train.errors import ClovaTrainError

Message = dict[str, str]


class BackendError(ClovaTrainError):
    """An LLM or embedding backend failed or replied with something unusable."""


class ChatBackend(ABC):
    """Replies to a list of chat messages (``{"role", "content"}``)."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What produces the replies (kind, model, sampling parameters): part of every cache key."""

    @abstractmethod
    def chat(self, messages: list[Message]) -> str:
        """The assistant's reply text."""


class EmbeddingBackend(ABC):
    """Maps texts to float32 vectors of a fixed dimension."""

    dim: int

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What produces the vectors: part of every cache key."""

    @abstractmethod
    def embed(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32."""


# ------------------------------------------------------------------------------------------------ HTTP
class OpenAICompatibleClient:
    """JSON POSTs to an OpenAI-compatible server with timeouts and retries.

    Args:
        base_url: e.g. ``http://localhost:8000/v1``.
        api_key: the key itself; if empty, read from the environment variable ``api_key_env``.
        api_key_env: environment variable holding the key (no key is sent if it is unset).
        timeout_s: per-request timeout.
        max_retries: retries after the first attempt for network errors, timeouts, 429, 5xx, malformed JSON.
        backoff_s: first retry delay; doubled for each further retry.
    """

    RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})

    def __init__(self, base_url: str, api_key: str = "", api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or os.environ.get(api_key_env, "")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.requests = 0

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}/{path.lstrip('/')}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps(payload).encode()
        failure = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.requests += 1
            try:
                with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=self.timeout_s) as r:
                    raw = r.read()
            except urllib.error.HTTPError as err:
                detail = err.read()[:200].decode(errors="replace")
                if err.code not in self.RETRYABLE_STATUS:
                    raise BackendError(f"{url} answered HTTP {err.code}: {detail}") from err
                failure = f"HTTP {err.code}: {detail}"
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                failure = f"timed out after {self.timeout_s:g} s" if "timed out" in str(reason) else f"{reason}"
                continue
            try:
                reply = json.loads(raw)
            except json.JSONDecodeError:
                failure = f"malformed JSON reply: {raw[:80]!r}"
                continue
            if not isinstance(reply, dict):
                failure = f"malformed reply: expected a JSON object, got {type(reply).__name__}"
                continue
            return reply
        raise BackendError(f"{url} failed after {self.max_retries + 1} attempts; last error: {failure}")


class OpenAIChatBackend(ChatBackend):
    """Chat completions from an OpenAI-compatible server.

    Args:
        base_url: server URL including the API prefix, e.g. ``http://localhost:8000/v1``.
        model: model name the server knows.
        temperature: sampling temperature (part of the cache key).
        max_tokens: reply budget.
        api_key, api_key_env, timeout_s, max_retries, backoff_s: see :class:`OpenAICompatibleClient`.
    """

    def __init__(self, base_url: str, model: str, temperature: float = 0.0, max_tokens: int = 512,
                 api_key: str = "", api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 30.0,
                 max_retries: int = 3, backoff_s: float = 0.5) -> None:
        self.client = OpenAICompatibleClient(base_url, api_key, api_key_env, timeout_s, max_retries, backoff_s)
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens

    def identity(self) -> dict[str, Any]:
        return {"kind": "openai-chat", "base_url": self.client.base_url, "model": self.model,
                "temperature": self.temperature, "max_tokens": self.max_tokens}

    def chat(self, messages: list[Message]) -> str:
        reply = self.client.post("/chat/completions", {
            "model": self.model, "messages": messages, "temperature": self.temperature, "max_tokens": self.max_tokens,
        })
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise BackendError(f"{self.client.base_url}: malformed chat reply, no choices[0].message.content: "
                               f"{json.dumps(reply)[:120]}") from err
        if not isinstance(content, str):
            raise BackendError(f"{self.client.base_url}: malformed chat reply, content is {type(content).__name__}")
        return content


class OpenAIEmbeddingBackend(EmbeddingBackend):
    """Embeddings from an OpenAI-compatible server (HYDRA: ``text-embedding-3-small``, 1536-d).

    Args:
        base_url: server URL including the API prefix.
        model: embedding model name.
        dim: expected vector size (checked on every reply).
        api_key, api_key_env, timeout_s, max_retries, backoff_s: see :class:`OpenAICompatibleClient`.
    """

    def __init__(self, base_url: str, model: str = "text-embedding-3-small", dim: int = 1536, api_key: str = "",
                 api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 30.0, max_retries: int = 3,
                 backoff_s: float = 0.5) -> None:
        self.client = OpenAICompatibleClient(base_url, api_key, api_key_env, timeout_s, max_retries, backoff_s)
        self.model, self.dim = model, dim

    def identity(self) -> dict[str, Any]:
        return {"kind": "openai-embedding", "base_url": self.client.base_url, "model": self.model, "dim": self.dim}

    def embed(self, texts: list[str]) -> np.ndarray:
        reply = self.client.post("/embeddings", {"model": self.model, "input": texts})
        try:
            rows = sorted(reply["data"], key=lambda row: row["index"])
            vectors = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as err:
            raise BackendError(f"{self.client.base_url}: malformed embedding reply: {json.dumps(reply)[:120]}") from err
        if vectors.shape != (len(texts), self.dim):
            raise BackendError(f"{self.client.base_url}: expected {len(texts)} embeddings of size {self.dim}, "
                               f"got shape {vectors.shape}")
        return vectors


# ------------------------------------------------------------------------------------------------ local
class TransformersChatBackend(ChatBackend):
    """Greedy chat replies from a local causal LM directory (with its tokenizer's chat template if it has one).

    Args:
        model_path: Hugging Face model directory or hub id (e.g. a ``clova-train export --merged`` output).
        max_new_tokens: reply budget.
        device: torch device string.
    """

    def __init__(self, model_path: str, max_new_tokens: int = 256, device: str = "cpu") -> None:
        self.model_path, self.max_new_tokens, self.device = model_path, max_new_tokens, device
        self._model = self._tokenizer = None

    def identity(self) -> dict[str, Any]:
        return {"kind": "transformers-chat", "model": self.model_path, "max_new_tokens": self.max_new_tokens}

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._model = AutoModelForCausalLM.from_pretrained(self.model_path).to(self.device).eval()
        except (OSError, ValueError) as err:
            raise BackendError(f"cannot load chat model {self.model_path!r}: {err}") from err

    def chat(self, messages: list[Message]) -> str:
        import torch

        if self._model is None:
            self._load()
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages) + "\nASSISTANT:"
        inputs = tokenizer(prompt, return_tensors="pt").to(self.device)
        with torch.no_grad():
            output = self._model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class TransformersEmbeddingBackend(EmbeddingBackend):
    """Mean-pooled, L2-normalised last hidden states of a local Hugging Face encoder or decoder.

    Args:
        model_path: model directory or hub id.
        device: torch device string.
    """

    def __init__(self, model_path: str, device: str = "cpu") -> None:
        from transformers import AutoConfig

        self.model_path, self.device = model_path, device
        try:
            self.dim = int(AutoConfig.from_pretrained(model_path).hidden_size)
        except (OSError, ValueError) as err:
            raise BackendError(f"cannot load embedding model {model_path!r}: {err}") from err
        self._model = self._tokenizer = None

    def identity(self) -> dict[str, Any]:
        return {"kind": "transformers-embedding", "model": self.model_path}

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self._model is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            if self._tokenizer.pad_token is None:
                self._tokenizer.pad_token = self._tokenizer.eos_token
            self._model = AutoModel.from_pretrained(self.model_path).to(self.device).eval()
        batch = self._tokenizer(texts, return_tensors="pt", padding=True, truncation=True).to(self.device)
        with torch.no_grad():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


# ------------------------------------------------------------------------------------------------ offline
_WORD = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")


class HashingEmbedder(EmbeddingBackend):
    """Signed feature hashing of lower-cased word unigrams and bigrams, L2-normalised.

    Deterministic across processes and machines (CRC32, not Python's salted ``hash``). A bag of words keeps
    which words a text uses, not their meaning; enough for the offline world, where what makes an
    instruction good or bad shows in its wording.

    Args:
        dim: vector size.
    """

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim

    def identity(self) -> dict[str, Any]:
        return {"kind": "hashing", "dim": self.dim}

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())
            for feature in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
                h = zlib.crc32(feature.encode())
                out[row, h % self.dim] += 1.0 if (h >> 31) & 1 else -1.0
            norm = np.linalg.norm(out[row])
            if norm > 0:
                out[row] /= norm
        return out
