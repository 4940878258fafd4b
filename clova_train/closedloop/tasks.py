"""Task files of the closed loop: one JSON object per line.

``{"id": "t1", "instruction": "What colour is the circle?", "image": "images/t1.png",
"feedback": {"answer": "purple"}}`` for a task with a gold answer, or ``"feedback": {"comment": "It hid the wrong
face."}`` for an editing task judged by a person (such a task counts as failed; its comment goes to reflection).
Image paths are relative to the task file unless absolute. Any other fields (``objects`` of the offline world,
for instance) are kept in :attr:`LoopTask.extra` for the tools that read them. Every line is checked when the
file is read; a bad one stops the loop with a message naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json_lines


@dataclass(frozen=True)
class LoopTask:
    """One task: an instruction about an image, and the feedback that judges the result."""

    task_id: str
    instruction: str
    image: Path
    answer: str | None = None
    comment: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def feedback(self) -> str:
        """The feedback as reflection reads it."""
        return f"The correct answer is {self.answer}" if self.answer is not None else str(self.comment)


def normalise_answer(answer: object) -> str:
    text = str(answer).strip().lower().rstrip(".")
    return {"true": "yes", "false": "no"}.get(text, text)


def is_correct(task: LoopTask, answer: object) -> bool:
    """A task with a gold answer is solved when the normalised answers agree; a comment task never is."""
    return task.answer is not None and normalise_answer(answer) == normalise_answer(task.answer)


def read_tasks(path: str | Path) -> list[LoopTask]:
    """Read and check a task file (see the module docstring)."""
    path = Path(path)
    tasks, seen = [], set()
    for number, record in read_json_lines(path, "task file"):
        where = f"{path}:{number}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: a task is a JSON object")
        for key in ("id", "instruction", "image", "feedback"):
            if key not in record:
                raise DataError(f"{where}: missing field {key!r}")
        if isinstance(record["id"], bool) or not isinstance(record["id"], (str, int)):
            raise DataError(f"{where}: id must be a string or an integer, not {type(record['id']).__name__}")
        if not isinstance(record["image"], str) or not record["image"].strip():
            raise DataError(f"{where}: image must be a file path (a non-empty string), not {record['image']!r:.60}")
        task_id, instruction, feedback = str(record["id"]), record["instruction"], record["feedback"]
        if task_id in seen:
            raise DataError(f"{where}: task id {task_id!r} is used twice")
        seen.add(task_id)
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError(f"{where}: instruction must be a non-empty string")
        if not isinstance(feedback, dict) or not (isinstance(feedback.get("answer"), str) or isinstance(feedback.get("comment"), str)):
            raise DataError(f"{where}: feedback must be {{\"answer\": ...}} or {{\"comment\": ...}} with a string")
        image = Path(record["image"])
        image = image if image.is_absolute() else path.parent / image
        if not image.is_file():
            raise DataError(f"{where}: image not found: {image}")
        extra = {k: v for k, v in record.items() if k not in ("id", "instruction", "image", "feedback")}
        tasks.append(LoopTask(task_id, instruction.strip(), image, feedback.get("answer"), feedback.get("comment"), extra))
    if not tasks:
        raise DataError(f"task file {path} holds no tasks")
    return tasks
