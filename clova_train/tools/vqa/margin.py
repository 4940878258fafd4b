"""Choosing BLIP VQA's ``answer_margin`` on validation records, so that the answers the tool already knew stay right.

Applying any prompt can change answers the unmodified tool gives right (on the quickstart: yellow images retrieve
orange's prompts and are answered "orange"; random prompts cost the same). ``answer_margin``
(:class:`~clova_train.tools.vqa.tool.BlipVqa`) serves the prompted answer only where its confidence beats the
unmodified answer's by more than the margin. :func:`choose_answer_margin` picks it on labelled validation records
(never the test records) by CLASSIFY's rule (:func:`clova_train.tools.operating_point.choose_operating_point`): the
protected groups are the gold answers the unmodified tool gives right on some validation question; for each, the
share of its questions the served pool takes away (unmodified right, served wrong) must stay within 2% with 95%
confidence for all of them together. :func:`calibrate_export` writes the chosen margin into an export's
``tool.json``, and serving uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import DataError
from clova_train.tools.operating_point import (
    CONFIDENCE, MARGINS, TOLERANCE, choose_operating_point, operating_point_record, write_operating_point,
)
from clova_train.tools.vqa.tool import normalise_answer, served_answers

PARAMETER = "answer_margin"


@dataclass(frozen=True)
class AnswerForwards:
    """Per question: the gold answer, the unmodified answer and its confidence, the prompted one and its."""

    gold: list[str]
    plain: list[str]
    plain_confidence: torch.Tensor
    prompted: list[str]
    prompted_confidence: torch.Tensor

    def served(self, margin: float) -> list[str]:
        """The answers served at ``margin``."""
        return served_answers(self.plain, self.plain_confidence, self.prompted, self.prompted_confidence, margin)

    def right(self, answers: Sequence[str]) -> torch.Tensor:
        return torch.tensor([a == g for a, g in zip(answers, self.gold)], dtype=torch.bool)


def answer_forwards(server: Any, records: Sequence[dict[str, Any]], batch_size: int = 32) -> AnswerForwards:
    """Both forwards of ``server``'s tool (a ``PromptToolServer`` of a BLIP VQA export) on ``records``
    (``{image: path, question, answer}``)."""
    from clova_train.tools.images import load_image_uint8

    tool, parts = server.tool, ([], [], [], [], [])
    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        images = [load_image_uint8(Path(r["image"])) for r in batch]
        with torch.no_grad():
            image_embeds = tool.image_embeddings(tool.pixel_values(images))
            encoded = tool.encode_questions(image_embeds, *tool.tokenize_questions([r["question"] for r in batch]))
            prompts = server.prompts_for(None, image_embeds.mean(1))
            if prompts is None:
                prompts = torch.zeros(len(batch), *tool.prompt_shape)  # an all-zero prompt is the unmodified tool
            plain, plain_conf, prompted, prompted_conf = tool.both_answers(encoded, prompts)
        for part, values in zip(parts, ([normalise_answer(r["answer"]) for r in batch], plain, plain_conf, prompted,
                                        prompted_conf)):
            part.append(values)
    gold, plain, plain_conf, prompted, prompted_conf = parts
    return AnswerForwards(sum(gold, []), sum(plain, []), torch.cat(plain_conf), sum(prompted, []),
                          torch.cat(prompted_conf))


def choose_answer_margin(forwards: AnswerForwards, margins: Sequence[float] = MARGINS, tolerance: float = TOLERANCE,
                         confidence: float = CONFIDENCE) -> tuple[float, dict]:
    """The margin chosen on these validation forwards (module docstring) and the table of every margin's accuracy and
    bounds (:func:`~clova_train.tools.operating_point.choose_operating_point`)."""
    unmodified_right = forwards.right(forwards.plain)
    gold = forwards.gold
    groups = {answer: torch.tensor([g == answer for g in gold]) for answer in sorted(set(gold))}
    protected = {a: mask for a, mask in groups.items() if bool((mask & unmodified_right).any())}
    return choose_operating_point(unmodified_right, protected, lambda m: forwards.right(forwards.served(m)), margins,
                                  tolerance, confidence)


def calibrate_export(export_dir: str | Path, validation_records: Sequence[dict[str, Any]], validation: str,
                     held_out: Sequence[Path] = ()) -> tuple[float, dict]:
    """Choose ``answer_margin`` on ``validation_records`` (described by ``validation``) and write it into the export's
    ``tool.json``; ``held_out``: record files the choice must not see (the run's test records): a
    :class:`DataError` when a validation record's image is one of theirs."""
    from clova_train.tools.prompt_server import PromptToolServer
    from clova_train.tools.vqa.records import read_records, record_image

    if not validation_records:
        raise DataError(f"no validation records to choose {PARAMETER} on ({validation})")
    test_images = {record_image(path, r["image"]).resolve() for path in held_out for r in read_records(path)}
    overlap = [r["image"] for r in validation_records if Path(r["image"]).resolve() in test_images]
    if overlap:
        raise DataError(f"validation records ({validation}) include {len(overlap)} test images (first: {overlap[0]}): "
                        f"{PARAMETER} must be chosen on data the reported test never touches")
    server = PromptToolServer.from_export(export_dir)
    forwards = answer_forwards(server, validation_records)
    margin, table = choose_answer_margin(forwards)
    write_operating_point(export_dir, PARAMETER, margin,
                          operating_point_record(PARAMETER, margin, validation, len(validation_records)))
    return margin, table
