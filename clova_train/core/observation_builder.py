"""Rebuild a controller's observation without clova-train: a standalone module (Python 3.9+ and numpy only).

``clova-train controller export`` copies this file verbatim into the export as ``observation.py``; the
training environments build their observations through the same functions, so what a serving stack computes
with it is what the DQN was trained on. Keep it free of imports from clova-train.

Use it with the export's ``controller.json`` (``description`` below)::

    import json, numpy as np, observation
    description = json.load(open("export/controller.json"))
    embed = observation.embedder_from_description(description["embedder"])   # or your own embedding function
    samples = observation.parse_samples(planner_reply, description["num_samples"])        # HYDRA
    parts = observation.hydra_parts(description, question, iteration, memory_entries, samples)
    # AVIS / HAMMR: memory entries are observation.agent_memory_line(label, action, tool_output_line(output))
    # parts = {"question": question, "memory": observation.memory_text(entries, last=8),
    #          "state": ..., "excluded": ..., ...}: strings are embedded, lists are used as they are
    x = observation.build_observation(description, parts, embed)        # float32 [observation_dim]
    q = torch.jit.load("export/q_network.pt")(torch.from_numpy(x)[None])  # or DQN.load("export/controller.zip")

``description["observation_parts"]`` gives each part's ``[start, end)`` in the vector, and
``description["text_parts"]`` which of them are texts to embed (with what each text holds).
"""

from __future__ import annotations

import re
import zlib
from typing import Callable, Mapping, Sequence, Union

import numpy as np

Embed = Callable[[Sequence[str]], np.ndarray]
PartValue = Union[str, Sequence[float], np.ndarray]

HYDRA_TASK_DESCRIPTION = (
    "Answer a question about an image by running short Python programs against the ImagePatch API "
    "(find, exists, verify_property, simple_query, crop, compute_depth, llm_query). "
    "Assign final_answer to finish."
)
MEMORY_LINES_SHOWN = 6  # HYDRA's State Memory Bank; AVIS and HAMMR show their working memory's last 8
AGENT_MEMORY_LINES_SHOWN = 8
PLACEHOLDER_INSTRUCTION = "(no instruction)"
MAX_INSTRUCTION_CHARS = 500
MAX_OUTPUT_CHARS = 400
_WORD = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")


def hashing_embedding(texts: Sequence[str], dim: int) -> np.ndarray:
    """``[len(texts), dim]`` float32: signed CRC32 feature hashing of lower-cased word unigrams and bigrams,
    L2-normalised (the offline ``hashing`` embedder; deterministic across processes and machines)."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for row, text in enumerate(texts):
        words = _WORD.findall(text.lower())
        for feature in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
            try:
                h = zlib.crc32(feature.encode())
            except UnicodeEncodeError:  # a lone surrogate: hashed as its raw code units
                h = zlib.crc32(feature.encode("utf-8", "surrogatepass"))
            out[row, h % dim] += 1.0 if (h >> 31) & 1 else -1.0
        norm = np.linalg.norm(out[row])
        if norm > 0:
            out[row] /= norm
    return out


def embedder_from_description(identity: Mapping[str, object]) -> Embed:
    """The embedding function ``controller.json``'s ``embedder`` entry names, for the offline ``hashing`` kind.

    Other kinds (an OpenAI-compatible endpoint, a transformers encoder) name their model in the entry; embed with
    that model (mean-pooled, L2-normalised, as its ``kind`` says) and pass your function instead.
    """
    if identity.get("kind") == "hashing":
        dim = int(identity["dim"])  # type: ignore[call-overload]
        return lambda texts: hashing_embedding(texts, dim)
    raise ValueError(f"embedder kind {identity.get('kind')!r} needs its model: embed with {dict(identity)} and "
                     "pass that function as embed")


_PROBABILITY = r"(?:p\s*=\s*)?(?P<{name}>[0-9]*\.?[0-9]+)"
_SAMPLE_LINE = re.compile(
    r"^\s*(?:(?:[-*]|\d+[.):]|\(\d+\))(?=\s))?\s*"  # optional list marker ("1." only before a space: not "0.7")
    r"(?:\[\s*" + _PROBABILITY.format(name="p1") + r"\s*\]\s*:?"  # [0.8] or [p=0.8]
    r"|\(\s*" + _PROBABILITY.format(name="p2") + r"\s*\)\s*:?"  # (0.8) or (p=0.8)
    r"|(?P<p3>[01]?\.[0-9]+)\s*[:\-]?(?=\s))?"  # a bare decimal 0.8, 0.8: or 0.8 - before the text
    r"\s*(?P<text>.*?)"
    r"(?:\s*(?:\[\s*" + _PROBABILITY.format(name="p4") + r"\s*\]|\(\s*" + _PROBABILITY.format(name="p5")
    + r"\s*\)))?\s*$",  # or after it: "find the cat (0.8)"
    re.IGNORECASE,
)


def parse_samples(reply: str, n: int) -> list[tuple[str, float]]:
    """Exactly ``n`` ``(instruction, probability)`` pairs from a planner reply.

    One sample per non-empty line; a probability in ``[0.83]``, ``(0.83)``, ``(p=0.83)`` or a bare ``0.83``
    (``0.83:``) before the text, or ``[0.83]`` / ``(0.83)`` after it, is read and clipped to [0, 1] (a line without
    one gets 0); an instruction is cut at ``MAX_INSTRUCTION_CHARS`` (a reply
    is untrusted: its size must not grow prompts and memory). Lines beyond ``n`` are dropped (the reply's order
    is kept); a short reply is padded with ``(no instruction)`` at probability 0, which the reasoner turns into a
    no-op step. The action index therefore always means the same slot.
    """
    samples: list[tuple[str, float]] = []
    for line in reply.splitlines():
        line = line[:MAX_INSTRUCTION_CHARS * 2]  # bounded before the regex: long space runs backtrack quadratically
        match = _SAMPLE_LINE.match(line)
        text = match.group("text") if match else line.strip()
        if not text or text.startswith("```"):
            continue
        raw = next((match.group(g) for g in ("p1", "p2", "p3", "p4", "p5") if match.group(g)), None) if match else None
        probability = min(max(float(raw), 0.0), 1.0) if raw else 0.0
        samples.append((text[:MAX_INSTRUCTION_CHARS], probability))
        if len(samples) == n:
            break
    return samples[:n] + [(PLACEHOLDER_INSTRUCTION, 0.0)] * max(0, n - len(samples))


def tool_output_line(text: str) -> str:
    """A tool's or an agent's output as AVIS and HAMMR put it in prompts and memory: one line, whitespace
    collapsed, cut at ``MAX_OUTPUT_CHARS`` with ``...``."""
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_OUTPUT_CHARS else text[:MAX_OUTPUT_CHARS] + "..."


def agent_memory_line(label: str, action: str, output: str) -> str:
    """One AVIS / HAMMR working-memory line: ``[<label>] <action> -> <output>`` (the output as
    :func:`tool_output_line` gives it; the label is the reasoner's: informative, uninformative or answer)."""
    return f"[{label}] {action} -> {output}"


def memory_text(lines: Sequence[str], last: int = MEMORY_LINES_SHOWN) -> str:
    """The memory as the observation shows it: its last ``last`` entries joined with newlines, or ``(empty)``
    (HYDRA: ``last=6``, its memory bank's entries; AVIS and HAMMR: ``last=AGENT_MEMORY_LINES_SHOWN``, 8, each
    entry an :func:`agent_memory_line`)."""
    return "\n".join(lines[-last:]) if lines else "(empty)"


def hydra_context_text(question: str, iteration: int, max_iterations: int, memory_lines: Sequence[str]) -> str:
    """HYDRA's context: task, question, ``Iteration: t of max`` (1-based) and the memory."""
    return (f"Task: {HYDRA_TASK_DESCRIPTION}\nQuestion: {question}\nIteration: {iteration} of {max_iterations}\n"
            f"Memory:\n{memory_text(memory_lines)}")


def hydra_samples_text(context: str, samples: Sequence[tuple[str, float]]) -> str:
    """The ``joint`` layout's one text: the context, then ``Samples:`` and ``i. (p=0.83) <instruction>`` lines."""
    lines = "\n".join(f"{i + 1}. (p={p:.2f}) {s}" for i, (s, p) in enumerate(samples))
    return f"{context}\nSamples:\n{lines}"


def hydra_parts(description: Mapping[str, object], question: str, iteration: int, memory_lines: Sequence[str],
                samples: Sequence[tuple[str, float]]) -> dict[str, PartValue]:
    """The named parts of a HYDRA observation for ``build_observation``: ``iteration`` is 1-based, ``memory_lines``
    the State Memory Bank's entries, ``samples`` the planner's N ``(instruction, probability)`` pairs in action
    order, as :func:`parse_samples` reads them from its reply."""
    n = int(description["num_samples"])  # type: ignore[call-overload]
    if len(samples) != n:
        raise ValueError(f"HYDRA observations take exactly {n} samples (parse_samples pads a short reply), "
                         f"got {len(samples)}")
    config = description["config"]
    context = hydra_context_text(question, iteration, int(config["max_iterations"]), memory_lines)  # type: ignore[index]
    parts: dict[str, PartValue] = (
        {"text": hydra_samples_text(context, samples)} if description["layout"] == "joint"
        else {"context": context, **{f"sample_{i + 1}": s for i, (s, _) in enumerate(samples)}})
    if "probabilities" in description["observation_parts"]:  # type: ignore[operator]
        parts["probabilities"] = [float(p) for _, p in samples]
    return parts


def one_hot(names: Sequence[str], chosen: Sequence[str] | str) -> list[float]:
    """``1.0`` where ``names[i]`` is (one of) ``chosen``: the state, mask and flag parts of AVIS and HAMMR."""
    picked = {chosen} if isinstance(chosen, str) else set(chosen)
    return [1.0 if name in picked else 0.0 for name in names]


def build_observation(description: Mapping[str, object], parts: Mapping[str, PartValue],
                      embed: Embed | None = None) -> np.ndarray:
    """The float32 observation: ``parts`` in ``description["observation_parts"]`` order, strings embedded with
    ``embed`` (default: ``embedder_from_description``), clipped to [-1, 1] as the environments clip it."""
    offsets: Mapping[str, Sequence[int]] = description["observation_parts"]  # type: ignore[assignment]
    layout = dict(sorted(offsets.items(), key=lambda item: item[1][0]))  # JSON files may hold them in any order
    unknown = set(parts) - set(layout)
    missing = [name for name in layout if name not in parts]
    if unknown or missing:
        raise ValueError(f"observation parts: missing {missing}, unknown {sorted(unknown)}; "
                         f"expected {list(layout)}")
    embed = embed or embedder_from_description(description["embedder"])  # type: ignore[arg-type]
    texts = [name for name in layout if isinstance(parts[name], str)]
    vectors = dict(zip(texts, embed([parts[name] for name in texts]))) if texts else {}  # type: ignore[misc]
    pieces = []
    for name, (start, end) in layout.items():
        value = np.asarray(vectors[name] if name in vectors else parts[name], dtype=np.float32).reshape(-1)
        if value.shape[0] != end - start:
            raise ValueError(f"observation part {name!r} has {value.shape[0]} entries, expected {end - start}")
        pieces.append(value)
    return np.clip(np.concatenate(pieces), -1.0, 1.0).astype(np.float32)
