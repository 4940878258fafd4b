"""The replaceable parts of HYDRA's loop: planner, reasoner, textualizer, State Memory Bank, observation.

Each part talks to a :class:`~clova_train.llm.backends.ChatBackend` in plain text, so a served LLM, a local
transformers model or the offline scripted model can stand behind it.

* :class:`Planner`: prompt -> reply -> :func:`parse_samples_report` -> exactly N ``(instruction, probability)``;
  the probabilities it could not read as written are counted (``note_counts``) and each kind is warned about once.
* :class:`Reasoner`: prompt with the chosen instruction and the kept variables -> Python code (the first
  fenced block, or the whole reply).
* :class:`Textualizer`: an execution result -> one line for the memory bank (a template, as in HYDRA).
* :class:`ObservationEncoder`: the documented text template -> float32 vector through an embedder.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from clova_train.core.observation_builder import (  # noqa: F401 (re-exported)
    HYDRA_TASK_DESCRIPTION, MAX_INSTRUCTION_CHARS, MEMORY_LINES_SHOWN, PLACEHOLDER_INSTRUCTION, hydra_context_text,
    hydra_samples_text, memory_text, parse_samples, parse_samples_report,
)
from clova_train.llm.backends import ChatBackend, EmbeddingBackend, ask
from clova_train.sandbox import ExecutionResult

TASK_DESCRIPTION = HYDRA_TASK_DESCRIPTION
SHORT_REPR_CHARS = 200


def short_repr(value: object) -> str:
    """A bounded ``repr``: what a program returned enters prompts and memory at most this large.

    The sandbox already bounds every returned value (its output budget), so the full ``repr`` is bounded too;
    it is cut here so that one value cannot crowd a prompt.
    """
    text = repr(value)
    return text if len(text) <= SHORT_REPR_CHARS else text[:SHORT_REPR_CHARS] + "..."


def variables_text(variables: dict, limit: int = 1500) -> str:
    """``name = value, ...`` for the reasoner's prompt and the memory bank, bounded in total."""
    text = ", ".join(f"{k} = {short_repr(v)}" for k, v in sorted(variables.items())[:50])
    return text if len(text) <= limit else text[:limit] + " ..."

@dataclass
class MemoryBank:
    """HYDRA's State Memory Bank: one text line per step (instruction, what ran, what came out)."""

    entries: list[str] = field(default_factory=list)

    def add(self, entry: str) -> None:
        self.entries.append(entry)

    def text(self, last: int = MEMORY_LINES_SHOWN) -> str:
        return memory_text(self.entries, last)


class Planner:
    """Asks the LLM for N next instructions given the question and the memory.

    Args:
        backend: chat backend.
        num_samples: N.
    """

    SYSTEM = "You are the planner of a visual reasoning agent. Propose short, concrete next instructions."

    def __init__(self, backend: ChatBackend, num_samples: int) -> None:
        self.backend, self.num_samples = backend, num_samples
        self.note_counts: Counter[str] = Counter()  # replies' lines whose probability was not read as written, by kind

    def prompt(self, question: str, memory: MemoryBank, attempt: int) -> str:
        return (
            f"Task: {TASK_DESCRIPTION}\nQuestion: {question}\nMemory:\n{memory.text()}\nAttempt: {attempt}\n"
            f"Samples wanted: {self.num_samples}\n"
            "Reply with one instruction per line as: <number>. [<probability it works>] <instruction>"
        )

    def propose(self, question: str, memory: MemoryBank, attempt: int) -> list[tuple[str, float]]:
        reply = ask(self.backend, [{"role": "system", "content": self.SYSTEM},
                                   {"role": "user", "content": self.prompt(question, memory, attempt)}])
        report = parse_samples_report(reply, self.num_samples)
        for note in report.notes:
            if not self.note_counts[note.kind]:  # once per kind: the planner's LLM writes the same way every time
                warnings.warn(f"the planner's reply line {note.line} ({note.text!r}) is {note.kind}: "
                              f"{PROBABILITY_NOTES[note.kind]} (more of this kind are counted, not repeated)",
                              stacklevel=2)
            self.note_counts[note.kind] += 1
        return report.samples


PROBABILITY_NOTES = {
    "missing": "no probability was written, so it counts as 0",
    "unreadable": "what looks like its probability is not a number in [0, 1] that can be read, so it counts as 0",
    "clipped": "its probability is outside [0, 1] and was clipped to it",
    "unpaired": "a probability on its own line that no instruction took was dropped",
    "cut": "the reply was longer than the lines read for its samples; the rest was not read",
}


_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
    """The first fenced code block of ``reply``, or the whole reply if it has none."""
    match = _FENCED.search(reply)
    return (match.group(1) if match else reply).strip("\n")


class Reasoner:
    """Asks the LLM for Python code that carries out one instruction.

    Args:
        backend: chat backend.
    """

    SYSTEM = "You write Python against the ImagePatch API. Reply with one fenced python code block."

    def __init__(self, backend: ChatBackend) -> None:
        self.backend = backend

    def prompt(self, question: str, instruction: str, variables: dict, memory: MemoryBank) -> str:
        names = variables_text(variables) or "(none)"
        return (
            f"Question: {question}\nInstruction: {instruction}\nVariables: {names}\nMemory:\n{memory.text()}\n"
            "Write Python code for the instruction. `image_patch` is the whole image. Assign final_answer "
            "when the question is answered."
        )

    def write_code(self, question: str, instruction: str, variables: dict, memory: MemoryBank) -> str:
        if instruction == PLACEHOLDER_INSTRUCTION:
            return "pass"
        reply = ask(self.backend, [{"role": "system", "content": self.SYSTEM},
                                   {"role": "user", "content": self.prompt(question, instruction, variables, memory)}])
        return extract_code(reply)


class Textualizer:
    """Turns a step's outcome into one memory line (template-based, as HYDRA's textualizer)."""

    def describe(self, iteration: int, instruction: str, result: ExecutionResult) -> str:
        if result.ok:
            shown = variables_text({k: v for k, v in result.variables.items() if not k.startswith("final")}, 300)
            printed = f"; printed: {result.stdout.strip()[:200]}" if result.stdout.strip() else ""
            return f"Step {iteration}: {instruction} -> ok; variables: {shown or '(none)'}{printed}"
        return f"Step {iteration}: {instruction} -> {result.status}: {result.error[:200]}"


class ObservationEncoder:
    """Embeds the observation text template into a float32 vector.

    The template (``layout="joint"``, HYDRA: one embedding of everything)::

        Task: <task description>
        Question: <question>
        Iteration: <t> of <max>
        Memory:
        <memory lines or (empty)>
        Samples:
        1. (p=0.83) <instruction 1>
        ...

    ``layout="per_part"`` embeds the context (everything above ``Samples:``) and each sample text
    separately and concatenates ``[context, sample_1, ..., sample_N, p_1, ..., p_N]``: the vector keeps which
    instruction sits in which slot, which the action index refers to. With ``probability_features`` the joint
    embedding is followed by ``p_1, ..., p_N`` too.

    Args:
        embedder: embedding backend.
        num_samples: N.
        layout: ``per_part`` or ``joint``.
        probability_features: ``joint``: append the N probabilities.
    """

    def __init__(self, embedder: EmbeddingBackend, num_samples: int, layout: str = "per_part",
                 probability_features: bool = False) -> None:
        if layout not in ("per_part", "joint"):
            raise ValueError(f"observation layout must be 'per_part' or 'joint', got {layout!r}")
        self.embedder, self.num_samples, self.layout = embedder, num_samples, layout
        self.has_probabilities = layout == "per_part" or probability_features
        d = embedder.dim
        if layout == "joint":
            self.dim = d + (num_samples if probability_features else 0)
        else:
            self.dim = (num_samples + 1) * d + num_samples

    def parts(self) -> list[tuple[str, int]]:
        """The observation's named parts and their sizes, in order (``controller.json``'s ``observation_parts``)."""
        d, n = self.embedder.dim, self.num_samples
        if self.layout == "joint":
            return [("text", d)] + ([("probabilities", n)] if self.has_probabilities else [])
        return [("context", d)] + [(f"sample_{i + 1}", d) for i in range(n)] + [("probabilities", n)]

    @staticmethod
    def context_text(question: str, iteration: int, max_iterations: int, memory: MemoryBank) -> str:
        return hydra_context_text(question, iteration, max_iterations, memory.entries)

    def text(self, context: str, samples: list[tuple[str, float]]) -> str:
        return hydra_samples_text(context, samples)

    def encode(self, context: str, samples: list[tuple[str, float]]) -> np.ndarray:
        probabilities = np.asarray([p for _, p in samples], dtype=np.float32)
        if self.layout == "joint":
            joint = self.embedder.embed([self.text(context, samples)])[0].astype(np.float32)
            return np.concatenate([joint, probabilities]).astype(np.float32) if self.has_probabilities else joint
        vectors = self.embedder.embed([context] + [s for s, _ in samples])
        return np.concatenate([vectors.reshape(-1), probabilities]).astype(np.float32)
