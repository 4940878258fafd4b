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
from typing import Callable, Mapping, NamedTuple, Sequence, Union

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


# --- Planner replies -------------------------------------------------------------------------------------------
# A reply is untrusted text: every regex below runs on a window of at most _WINDOW characters of one line (the
# line's start or its end), so none of them can take longer than a constant, whatever the reply holds.
_WINDOW = 120
_NUMBER = r"(?:[~\u2248]\s?)?[-+]?(?:\d{1,6}(?:[.,]\d{1,12})?|[.,]\d{1,12})(?:e[-+]?\d{1,4})?"  # "~0.7" is 0.7
_LABEL = (r"(?:(?:probability|prob|p|confidence|conf|likelihood|certainty|chance|score)\b|p\s?\(\s?[a-z ]{1,20}\))"
          r"\s*(?:of\s+success\s*)?")  # "P(success) = 0.7" too
_ASSIGN = r"\s*(?:[:=\u2248~]|\bis\b)\s*"  # "p = 0.7", "probability is 0.7"
_WORD_AFTER = r"\s+(?:probability|confidence|confident|chance|likely|likelihood|certainty|certain|sure)"  # "70% sure"
_LABELLED = (rf"(?:probability|confidence|likelihood|chance|certainty)\s+is\s+{_NUMBER}(?:\s?%)?"
             rf"|{_LABEL}(?:[:=\u2248~]\s*(?:{_NUMBER}(?:\s?%)?|[^\s\[\](){{}}<>]{{1,20}})|{_NUMBER}(?:\s?%)?)"
             rf"|{_NUMBER}(?:\s?%)?{_WORD_AFTER}")
_EMPHASIS = r"(?:\*{1,2}|_{1,2})?"  # markdown **0.7**
_BRACKETED = rf"{_EMPHASIS}[\[({{<]\s*{_EMPHASIS}(?P<body>[^\[\](){{}}<>*]{{1,60}}?){_EMPHASIS}\s*[\])}}>]{_EMPHASIS}"
_BARE = rf"{_EMPHASIS}(?P<bare>(?:[~\u2248]\s?)?(?:[01]?\.\d{{1,12}}|\d{{1,3}}(?:\.\d{{1,6}})?\s?%)){_EMPHASIS}"
_VALUE = re.compile(rf"(?:(?P<label>{_LABEL})(?:{_ASSIGN})?)?(?P<number>{_NUMBER})(?:\s?(?P<percent>%))?"
                    rf"(?P<word>{_WORD_AFTER})?", re.IGNORECASE)
_LABEL_START = re.compile(rf"{_LABEL}[:=\u2248~]", re.IGNORECASE)
_LIST_MARKER = re.compile(
    r"(?:[-*+\u2022]|\d{1,3}[.):]|[(\[]\d{1,3}[)\]]|[a-z]\)"
    r"|(?:step|sample|instruction|option|idea)(?:\s?\d{1,3}[.):]?|:))\s+",
    re.IGNORECASE)
_PREFIX = re.compile(rf"(?:{_BRACKETED}|{_EMPHASIS}(?P<labelled>{_LABELLED}){_EMPHASIS}|{_BARE})"
                     r"(?=[\s:|,\-\u2013\u2014]|$)", re.IGNORECASE)
_SUFFIX = re.compile(
    rf"(?P<sep>\s*[:|,;\-\u2013\u2014]\s*|\s+|^)"
    rf"(?:{_BRACKETED}|{_EMPHASIS}(?P<labelled>{_LABELLED}){_EMPHASIS}|{_BARE}|(?P<comma>[01],\d{{1,12}}))"
    r"[.;!]?\s*$", re.IGNORECASE)
_SEPARATORS = " \t:|,;-\u2013\u2014"
# A bare trailing number after one of these words is the instruction's own quantity ("scale by 0.5"), not a probability.
QUANTITY_WORDS = frozenset((
    "by", "to", "of", "at", "from", "than", "and", "or", "is", "are", "equals", "equal", "about", "around", "above",
    "below", "under", "over", "near", "within", "exactly", "times", "top", "bottom", "first", "last", "factor",
    "ratio", "threshold", "scale", "zoom", "resize", "opacity", "alpha"))
NOTE_KINDS = ("missing", "clipped", "unreadable", "unpaired", "cut")


def max_reply_lines(n: int) -> int:
    """How many non-empty lines of a reply :func:`parse_samples` reads for ``n`` samples: room for a heading, a
    probability line under each instruction and some chatter, and a bound on the time a hostile reply takes."""
    return 64 + 4 * n


class SampleNote(NamedTuple):
    """Why one line's probability is not simply the number written: ``kind`` is ``missing`` (no probability: read
    as 0), ``clipped`` (outside [0, 1]: clipped to it), ``unreadable`` (looks like a probability but is not a
    number, or is ambiguous such as ``(0,7)``: the line gets 0), ``unpaired`` (a line holding only a probability
    that no instruction took: dropped) or ``cut`` (the reply had more than :func:`max_reply_lines` non-empty lines
    before its ``n`` samples: this line and the rest were not read). ``line`` is 1-based in the reply; ``text``
    the piece at fault, cut short."""

    line: int
    kind: str
    text: str


class SampleReport(NamedTuple):
    """:func:`parse_samples_report`'s result: the ``samples`` :func:`parse_samples` returns, and a note per line
    whose probability was not read as written (see :class:`SampleNote`), in reply order."""

    samples: list[tuple[str, float]]
    notes: list[SampleNote]

    def count_notes(self, *kinds: str) -> int:
        """How many notes are of ``kinds`` (all notes when none is named)."""
        return sum(1 for note in self.notes if not kinds or note.kind in kinds)


def _read_probability(token: str, bare: bool) -> tuple[float | None, str | None, bool]:
    """``(value, note kind, looks like a probability)`` for one bracket body, labelled value or bare number.

    A labelled or bracketed value outside [0, 1] is clipped (noted ``clipped``); a bare one is the instruction's own
    number (``zoom 1.5``), not a probability. A decimal comma (``0,7``) is read after a label only: in brackets or
    bare it is as likely a pair (``(0,7)``, coordinates) as a probability, so it is noted ``unreadable``.
    """
    match = _VALUE.fullmatch(token.strip())
    if match is None:
        looks = _LABEL_START.match(token.strip()) is not None
        return None, ("unreadable" if looks else None), looks
    label, number, percent = match.group("label"), match.group("number"), match.group("percent")
    if "," in number:
        if not label:
            looks = re.fullmatch(r"(?:[~\u2248]\s?)?[-+]?[01]?,\d+", number) is not None
            return None, ("unreadable" if looks else None), looks
        number = number.replace(",", ".")
    if not (label or percent or match.group("word") or "." in number or "e" in number.lower()):
        return None, None, False  # "(2)", "[7]": a count or a reference, not a probability
    value = float(number.lstrip("~\u2248 ")) / (100.0 if percent else 1.0)
    if 0.0 <= value <= 1.0:
        return value, None, True
    if bare:
        return None, None, False
    return (1.0 if value > 1.0 else 0.0), "clipped", True  # 1e309 (inf) -> 1, -3 -> 0


def _split_probability(line: str) -> tuple[str, float | None, list[tuple[str, str]]]:
    """One stripped reply line -> ``(instruction, probability or None, [(note kind, piece)])``; the instruction is
    ``""`` for a line that holds only a probability (or only something that looks like one)."""
    rest, notes = line, []
    for _ in range(2):  # "- 1. [0.8] find": up to two list markers
        marker = _LIST_MARKER.match(rest[:_WINDOW])
        if marker is None:
            break
        rest = rest[marker.end():]
    prefix = _PREFIX.match(rest[:_WINDOW])
    if prefix is not None:
        token = prefix.group("body") or prefix.group("labelled") or prefix.group("bare")
        value, note, looks = _read_probability(token, bare=prefix.group("bare") is not None)
        after = rest[prefix.end():].strip(_SEPARATORS)
        if note:
            notes.append((note, token))
        if value is not None or (looks and not after):
            return after, value, notes
    text = rest.rstrip()
    start = max(0, len(text) - _WINDOW)
    suffix = _SUFFIX.search(text, start)
    if suffix is None or (suffix.start() == start > 0 and not suffix.group("sep")):  # the window cut a word
        return text, None, notes
    before = text[:suffix.start()].rstrip(_SEPARATORS)
    if suffix.group("comma"):
        return text, None, notes + [("unreadable", suffix.group("comma"))]
    bare = suffix.group("bare")
    if bare and not suffix.group("sep").strip() and before.split()[-1:] in ([w] for w in QUANTITY_WORDS):
        return text, None, notes  # "scale by 0.5": the instruction's quantity
    token = suffix.group("body") or suffix.group("labelled") or bare
    value, note, looks = _read_probability(token, bare=bare is not None)
    if note:
        notes.append((note, token))
    return (before, value, notes) if value is not None or (looks and not before) else (text, None, notes)


def parse_samples_report(reply: str, n: int) -> SampleReport:
    """:func:`parse_samples`'s ``n`` samples, with a :class:`SampleNote` for each probability read as 0 because a
    line had none (``missing``) or held one that could not be read (``unreadable``), clipped to [0, 1]
    (``clipped``) or left without an instruction (``unpaired``), and where a reply too long to read was ``cut``:
    what a caller counts and reports (``report.count_notes("missing", "unreadable")``)."""
    samples: list[list] = []  # [instruction, probability or None, line number]
    notes: list[SampleNote] = []
    pending: tuple[float, int, str] | None = None  # a probability on a line of its own, waiting for the next line

    def note(line: int, kind: str, text: str) -> None:
        notes.append(SampleNote(line, kind, text[:40]))

    budget = max_reply_lines(n)
    for number, line in enumerate(reply.splitlines(), start=1):
        line = line[:MAX_INSTRUCTION_CHARS * 2].strip()  # bounded before any regex
        if not line:
            continue
        if budget == 0:  # a reply of stray probabilities or chatter: the rest is not read
            if len(samples) < n:
                note(number, "cut", line)
            break
        budget -= 1
        if line.startswith("```"):
            continue
        text, probability, line_notes = _split_probability(line)
        for kind, piece in line_notes:
            note(number, kind, piece)
        if not text:  # a line holding only a probability: never a sample of its own (it would shift the slots)
            if probability is None:
                continue
            previous = samples[-1] if samples else None
            if pending is None and previous is not None and previous[1] is None and not previous[0].endswith(":"):
                previous[1] = probability
                continue
            if pending is not None:
                note(pending[1], "unpaired", pending[2])
            pending = (probability, number, line)
            continue
        if len(samples) == n:
            break
        if pending is not None:
            if probability is None:
                probability = pending[0]
            else:
                note(pending[1], "unpaired", pending[2])
            pending = None
        samples.append([text[:MAX_INSTRUCTION_CHARS], probability, number])
    if pending is not None:
        note(pending[1], "unpaired", pending[2])
    noted = {item.line for item in notes}
    for text, probability, number in samples:
        if probability is None and number not in noted:  # an unreadable one is noted already: one note a line
            note(number, "missing", text)
    read = [(text, 0.0 if probability is None else probability) for text, probability, _ in samples]
    return SampleReport(read + [(PLACEHOLDER_INSTRUCTION, 0.0)] * max(0, n - len(read)),
                        sorted(notes, key=lambda item: item.line))


def parse_samples(reply: str, n: int) -> list[tuple[str, float]]:
    """Exactly ``n`` ``(instruction, probability)`` pairs from a planner reply.

    One sample per non-empty line, after a list marker (``1.``, ``2)``, ``(3)``, ``[4]``, ``-``, ``*``, ``a)``,
    ``Step 5:``), which is never read as a probability. The probability may stand before or after the
    instruction: in brackets (``[0.83]``, ``(p=0.83)``, ``{83%}``, ``<0.83>``, ``(confidence: 0.83)``), after a
    label (``p: 0.83``, ``probability 0.83``, ``P(success) = 0.83``, ``83% sure``) or bare (``0.83``, ``.83``,
    ``~0.83``, ``83%``, ``**0.83**``, set off from the text by a space or ``:``/``-``/``|``; ``0.83.`` at the end of
    a sentence too). A number inside the
    instruction (``pick the 2 red cubes``, ``zoom 1.5x``) is not one, nor is a bare number above 1 (``zoom 1.5``),
    a bracketed integer (``(2)``), or a bare trailing number after a word that takes a quantity (``scale by 0.5``,
    ``QUANTITY_WORDS``). Bracketed or labelled values outside [0, 1] are clipped to it (``[1.5]`` -> 1,
    ``(p=-3)`` -> 0); a decimal comma is read after a label only (``p=0,7``: ``(0,7)`` may be a pair). A line
    without a readable probability gets 0; :func:`parse_samples_report` returns the same samples with a note for
    each such line, clipped value and stray probability, for callers to count and report.

    A line holding only a probability (``(0.7)``, ``Probability: 0.7``) is never a sample of its own (it would
    shift every later slot): it belongs to the instruction just above it when that one has none (the usual
    ``1. find the cat`` / ``Probability: 0.7`` layout), else (at the start of the reply, below a heading ending
    in ``:`` or below an instruction that has its own) to the next instruction line if that one has none; one
    that neither takes is dropped and noted ``unpaired``.

    An instruction is cut at ``MAX_INSTRUCTION_CHARS``, a line is read from its first ``2 * MAX_INSTRUCTION_CHARS``
    characters (the probability from its first or last 120) and at most :func:`max_reply_lines` non-empty lines
    are read (a reply is untrusted: its size must not grow prompts and memory, nor the time spent reading it).
    Lines beyond ``n`` are dropped (the reply's order is kept); a short reply is padded with ``(no instruction)``
    at probability 0, which the reasoner turns into a no-op step. The action index therefore always means the
    same slot.
    """
    return parse_samples_report(reply, n).samples


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
