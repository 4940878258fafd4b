"""One task of a visual-reasoning benchmark, whatever file it came from, and what reading a task file skipped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ANSWER_TYPES = ("yes/no", "number", "other", "box")


@dataclass(frozen=True)
class BenchmarkTask:
    """A question (or referring expression) about one image, with the benchmark's ground truth.

    Args:
        task_id: the benchmark's own id (question id, or ``<ref_id>:<sentence index>`` for RefCOCO).
        benchmark: the format it was read from (``vqav2``, ``okvqa``, ``aokvqa``, ``gqa``, ``refcoco``...).
        image: the image file, resolved by the benchmark's naming.
        question: the question, or the referring expression.
        answers: the ground-truth answers as the benchmark lists them (VQAv2 / OK-VQA: the ten annotators';
            A-OKVQA: its ten direct answers; GQA: its one answer; RefCOCO: none).
        answer_type: ``yes/no``, ``number``, ``other`` or ``box`` (what HYDRA's reward counts as a related answer).
        choices: A-OKVQA's multiple-choice options (else empty).
        correct_choice: the index of the right option in ``choices`` (A-OKVQA), else None.
        box: the referred object's box, COCO ``[x, y, width, height]`` in pixels (RefCOCO), else None.
        image_size: ``(width, height)`` when the annotations give it, else None.
    """

    task_id: str
    benchmark: str
    image: Path
    question: str
    answers: tuple[str, ...] = ()
    answer_type: str = "other"
    choices: tuple[str, ...] = ()
    correct_choice: int | None = None
    box: tuple[float, float, float, float] | None = None
    image_size: tuple[int, int] | None = None


@dataclass
class SkippedRecords:
    """Records a reader left out, counted by reason, with the first record of each reason for the message."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, record: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, record)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line per reason: ``N records skipped: <reason> (first: <record>)``; empty when nothing was skipped."""
        return "; ".join(f"{n:,} record{'s' if n != 1 else ''} skipped: {reason} (first: {self.first[reason]})"
                         for reason, n in self.counts.items())
