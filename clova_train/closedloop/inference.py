"""Inference: a plan and a program from the LLM with retrieved demonstrations, run in the sandbox, every tool
call recorded.

The program is Python against ViperGPT's ``image_patch`` API, run by :class:`~clova_train.sandbox.Sandbox`
(untrusted code never runs in the loop's process). Each tool call the program makes goes through
:class:`RecordingTools`, which names the visual tool behind the method (``verify_property`` is CLASSIFY,
``find`` / ``exists`` are LOC, ``simple_query`` is VQA) and keeps its arguments and result: the steps that
reflection reads.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from PIL import Image

from clova_train.closedloop.demonstrations import Demonstration, DemonstrationPool
from clova_train.closedloop.reflection import Templates
from clova_train.closedloop.tasks import LoopTask, is_correct
from clova_train.llm.backends import ChatBackend, ask
from clova_train.sandbox import PatchRef, Sandbox, ToolAPI

METHOD_TOOLS = {"find": "LOC", "exists": "LOC", "verify_property": "CLASSIFY", "simple_query": "VQA",
                "compute_depth": "DEPTH", "llm_query": "LLM"}
_FENCE = re.compile(r"```(?:python)?\s*\n(.*?)```", re.DOTALL)


@dataclass
class ToolCall:
    """One call the program made: the visual tool, the method, its arguments and what it returned."""

    tool: str
    method: str
    arguments: list[Any]
    result: Any
    patch: list[int]

    def text(self, index: int) -> str:
        arguments = ", ".join(repr(a) for a in self.arguments)
        return f"Step{index} {self.tool}: {self.method}({arguments}) on region {self.patch} -> {self.result!r}"


@dataclass
class Trace:
    """Everything one attempt at a task produced."""

    task_id: str
    instruction: str
    plan: str
    program: str
    status: str
    error: str
    answer: str
    correct: bool
    calls: list[ToolCall] = field(default_factory=list)

    def steps_text(self) -> str:
        if not self.calls:
            return "(no tool calls)" + (f" The program stopped: {self.error}" if self.error else "")
        text = "\n".join(call.text(i) for i, call in enumerate(self.calls, 1))
        return text + (f"\nThe program stopped: {self.error}" if self.error else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trace:
        return cls(**{**data, "calls": [ToolCall(**c) for c in data.get("calls", [])]})


class RecordingTools:
    """A :class:`~clova_train.sandbox.ToolAPI` that records every call to the wrapped one."""

    def __init__(self, tools: ToolAPI) -> None:
        self.tools, self.calls = tools, []

    def _record(self, method: str, patch: PatchRef | None, arguments: list[Any], result: Any) -> Any:
        box = [patch.left, patch.lower, patch.right, patch.upper] if patch is not None else []
        shown = [list(b) for b in result] if method == "find" else result
        self.calls.append(ToolCall(METHOD_TOOLS[method], method, arguments, shown, box))
        return result

    def find(self, patch: PatchRef, object_name: str) -> list[tuple[int, int, int, int]]:
        return self._record("find", patch, [object_name], self.tools.find(patch, object_name))

    def exists(self, patch: PatchRef, object_name: str) -> bool:
        return self._record("exists", patch, [object_name], self.tools.exists(patch, object_name))

    def verify_property(self, patch: PatchRef, object_name: str, attribute: str) -> bool:
        return self._record("verify_property", patch, [object_name, attribute],
                            self.tools.verify_property(patch, object_name, attribute))

    def simple_query(self, patch: PatchRef, question: str) -> str:
        return self._record("simple_query", patch, [question], self.tools.simple_query(patch, question))

    def compute_depth(self, patch: PatchRef) -> float:
        return self._record("compute_depth", patch, [], self.tools.compute_depth(patch))

    def llm_query(self, patch: PatchRef | None, question: str) -> str:
        return self._record("llm_query", patch, [question], self.tools.llm_query(patch, question))


def extract_program(reply: str) -> str:
    """The code of a reply: its first ```python block, else the whole reply."""
    match = _FENCE.search(reply)
    return (match.group(1) if match else reply).strip()


def format_examples(examples: list[Demonstration]) -> str:
    if not examples:
        return "(none)\n"
    parts = []
    for e in examples:
        text = f"Instruction: {e.instruction}\n{e.kind.capitalize()}:\n{e.text}"
        parts.append(text + (f"\nWhat went wrong: {e.critique}" if e.critique else ""))
    return "\n\n".join(parts) + "\n"


@dataclass
class InferenceSettings:
    """How many demonstrations each prompt gets.

    Args:
        correct_examples: most similar correct examples per prompt (D_ps for plans, D_cs for programs).
        incorrect_examples: most similar incorrect examples with their critiques (D_pf, D_cf).
    """

    correct_examples: int = 3
    incorrect_examples: int = 2


class Inference:
    """Plan, program and run one task (CLOVA Sec. 3.2).

    Args:
        llm: the chat backend (OpenAI-compatible, transformers or scripted), ideally behind the call cache.
        demonstrations: the demonstration pool examples are retrieved from.
        templates: the prompt templates.
        sandbox: where programs run.
        labels: the labels CLASSIFY chooses among (shown to the LLM in the program prompt).
        settings: numbers of retrieved examples.
    """

    def __init__(self, llm: ChatBackend, demonstrations: DemonstrationPool, templates: Templates, sandbox: Sandbox,
                 labels: list[str], settings: InferenceSettings | None = None) -> None:
        self.llm, self.demonstrations, self.templates, self.sandbox = llm, demonstrations, templates, sandbox
        self.labels, self.settings = labels, settings or InferenceSettings()

    def _examples(self, kind: str, instruction: str) -> dict[str, str]:
        good, bad = self.demonstrations.retrieve(kind, instruction, self.settings.correct_examples,
                                                 self.settings.incorrect_examples)
        return {"correct_examples": format_examples(good), "incorrect_examples": format_examples(bad)}

    def run(self, task: LoopTask, tools: ToolAPI) -> Trace:
        """One attempt: the backend's errors propagate (the loop pauses on them); the program's never do."""
        plan_prompt = self.templates.render("plan", instruction=task.instruction, **self._examples("plan", task.instruction))
        plan = ask(self.llm, [{"role": "user", "content": plan_prompt}]).strip()
        program_prompt = self.templates.render("program", instruction=task.instruction, plan=plan,
                                               labels=", ".join(self.labels), **self._examples("program", task.instruction))
        program = extract_program(ask(self.llm, [{"role": "user", "content": program_prompt}]))
        recording = RecordingTools(tools)
        with Image.open(task.image) as image:
            size = image.size
        result = self.sandbox.run(program, {}, recording, task.task_id, size)
        answer = result.variables.get("final_answer") if result.ok else None
        answer_text = "" if answer is None else str(answer)
        error = result.error if not result.ok else ("" if answer is not None else "the program set no final_answer")
        return Trace(task.task_id, task.instruction, plan, program, result.status, error, answer_text,
                     answer is not None and is_correct(task, answer_text), recording.calls)
