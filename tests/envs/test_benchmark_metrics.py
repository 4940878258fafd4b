"""The benchmarks' own metrics (clova_train.envs.tasks.metrics) on hand-made cases, each expectation worked out from
the official evaluation script named in its docstring: GT-Vision-Lab/VQA vqaEval.py (VQAv2, OK-VQA), allenai/aokvqa
evaluation/eval_predictions.py (A-OKVQA), GQA's eval.py, and COCO's box IoU (pycocotools) for RefCOCO."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from clova_train.core.errors import DataError
from clova_train.envs.tasks.metrics import (
    METRICS, aokvqa_direct_answer_accuracy, aokvqa_multiple_choice_accuracy, as_box, benchmark_metric, box_iou,
    eq3_answer_terms, gqa_exact_match, normalise_vqa_answer, refcoco_accuracy, related, score, vqa_accuracy,
    xyxy_to_xywh)


def leave_one_out(matches: int, total: int = 10) -> float:
    """VQAEval.evaluate by hand: leaving out a matching answer leaves matches - 1, another leaves matches."""
    return (matches * min(1.0, (matches - 1) / 3) + (total - matches) * min(1.0, matches / 3)) / total


# --- VQA normalisation: processPunctuation, processDigitArticle ----------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("1,000", "1000"),          # commaStrip (digit,digit) -> every mark deleted, not spaced
    ("1,000-2,000", "10002000"),
    ("1.5", "1.5"),             # periodStrip keeps a period followed by a digit
    ("1.5.", "1.5"),
    ("5.", "5"),                # trailing period
    ("a.m.", "am"),
    ("mr. smith", "mr smith"),
    ("t-shirt", "t shirt"),     # a mark not next to a space becomes a space
    ("semi - final", "semi final"),  # next to a space: deleted (the spaces then collapse)
    ("yes, it is!", "yes it is"),
    ("what?", "what"),
    ('"quoted"', "quoted"),
    ("3:30", "3:30"),           # ':' is not in the punctuation list
    ("$5", "$5"),               # nor '$', '%', "'"
    ("it's", "it's"),
    ("the red car", "red car"),  # articles
    ("an apple", "apple"),
    ("A", ""),
    ("Two dogs.", "2 dogs"),    # manualMap number words
    ("ten", "10"),
    ("none", "0"),              # manualMap maps 'none' to '0'
    ("eleven", "eleven"),       # only zero..ten are mapped
    ("dont", "don't"),          # contractions
    ("Dont know", "don't know"),
    ("oclock", "o'clock"),
    ("Im here", "im here"),     # the table's capitalised keys never match the lower-cased words
    ("somebody'd", "somebodyd"),  # the table maps this one backwards
    ("  YES \n", "yes"),        # case and whitespace
    ("  spaced   out\tthere ", "spaced out there"),
])
def test_vqa_normalisation_follows_vqaeval(raw: str, expected: str) -> None:
    """VQAEval.processPunctuation then processDigitArticle, after evaluate's newline/tab -> space and strip."""
    assert normalise_vqa_answer(raw) == expected


def test_at_most_32_periods_are_deleted() -> None:
    """processPunctuation passes re.UNICODE (32) where Pattern.sub takes its count: periods past the 32nd stay."""
    assert normalise_vqa_answer("." * 40 + "x") == "." * 8 + "x"


# --- VQA accuracy: VQAEval.evaluate -------------------------------------------------------------------------------

@pytest.mark.parametrize("matches, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (7, 1.0), (10, 1.0)])
def test_ten_choose_nine_averaging(matches: int, expected: float) -> None:
    """evaluate: mean over the 10 leave-one-out subsets of min(1, matches / 3). With 2 of 10 matching, the 2 subsets
    leaving out a match see 1 (1/3 each), the other 8 see 2 (2/3 each): (2/3 + 16/3) / 10 = 0.6."""
    answers = ["cat"] * matches + ["dog", "bird"] * 5
    answers = answers[:10]
    assert leave_one_out(matches) == pytest.approx(expected)
    assert vqa_accuracy("cat", answers) == pytest.approx(expected)


def test_leave_one_out_removes_one_position_not_every_equal_answer() -> None:
    """evaluate compares annotation records (each with its answer_id), so leaving out one "cat" keeps the other
    "cat"s: with three of ten, each subset without a "cat" still has two (2/3), not zero."""
    assert vqa_accuracy("cat", ["cat"] * 3 + ["dog"] * 7) == pytest.approx((3 * 2 / 3 + 7 * 1) / 10)


def test_answers_are_normalised_only_when_annotators_disagree() -> None:
    """evaluate: processPunctuation/processDigitArticle run only if len(set(gtAnswers)) > 1."""
    assert vqa_accuracy("Yes", ["yes"] * 10) == 0.0          # unanimous: compared verbatim
    assert vqa_accuracy("yes.", ["yes"] * 10) == 0.0
    assert vqa_accuracy(" yes\n", ["yes"] * 10) == 1.0       # ... after the strip
    assert vqa_accuracy("2", ["two"] * 10) == 0.0
    assert vqa_accuracy("two", ["two"] * 10) == 1.0
    assert vqa_accuracy("Yes", ["yes"] * 9 + ["no"]) == 1.0   # not unanimous: both sides normalised
    assert vqa_accuracy("Yes", ["yes"] * 9 + ["Yes"]) == 1.0  # the set is taken before lower-casing
    assert vqa_accuracy("Yes", ["yes"] * 10, normalise_unanimous=True) == 1.0


@pytest.mark.parametrize("prediction, answers, matches", [
    ("1,000", ["1000"] * 2 + ["many"] * 8, 2),
    ("1.5", ["1.5"] * 3 + ["2"] * 7, 3),
    ("two", ["2"] * 1 + ["3"] * 9, 1),
    ("The Dog.", ["dog"] * 4 + ["cat"] * 6, 4),
    ("dont know", ["don't know"] * 2 + ["no"] * 8, 2),
    ("red-white", ["red white"] * 3 + ["red"] * 7, 3),
    ("no", ["yes"] * 9 + ["No"], 1),
])
def test_vqa_accuracy_on_normalised_matches(prediction: str, answers: list[str], matches: int) -> None:
    """evaluate with disagreeing annotators: prediction and answers normalised, then leave-one-out."""
    assert vqa_accuracy(prediction, answers) == pytest.approx(leave_one_out(matches))


def test_vqa_accuracy_rejects_no_answers_and_a_bare_string() -> None:
    with pytest.raises(ValueError):
        vqa_accuracy("yes", [])
    with pytest.raises(TypeError):
        vqa_accuracy("yes", "yes")


# --- GQA, A-OKVQA ---------------------------------------------------------------------------------------------------

def test_gqa_exact_match() -> None:
    """GQA eval.py: correct = (predicted == gold), no normalisation."""
    assert gqa_exact_match("table", "table") == 1.0
    assert gqa_exact_match("Table", "table") == 0.0
    assert gqa_exact_match("the table", "table") == 0.0
    assert gqa_exact_match("table ", "table") == 0.0
    assert gqa_exact_match("The table.", "table", normalise=True) == 1.0  # the lenient, non-official option


def test_aokvqa_direct_answer() -> None:
    """eval_aokvqa (direct answer): min(1, number of direct_answers equal to pred / 3), verbatim, no leave-one-out."""
    answers = ["dog"] * 2 + ["puppy"] * 3 + ["Dog", "canine", "pet", "animal", "dogs"]
    assert aokvqa_direct_answer_accuracy("dog", answers) == pytest.approx(2 / 3)   # VQA's formula would give 0.6
    assert aokvqa_direct_answer_accuracy("puppy", answers) == 1.0                  # VQA's would give 0.9
    assert aokvqa_direct_answer_accuracy("canine", answers) == pytest.approx(1 / 3)
    assert aokvqa_direct_answer_accuracy("the dog", answers) == 0.0                # no article removal
    assert aokvqa_direct_answer_accuracy("Puppy", answers) == 0.0                  # no lower-casing
    assert aokvqa_direct_answer_accuracy("cat", answers) == 0.0


def test_aokvqa_multiple_choice() -> None:
    """eval_aokvqa (multiple choice): float(pred == choices[correct_choice_idx]); strict asserts pred is a choice."""
    choices = ["dog", "cat", "horse", "cow"]
    assert aokvqa_multiple_choice_accuracy("cat", choices, 1) == 1.0
    assert aokvqa_multiple_choice_accuracy(1, choices, 1) == 1.0
    assert aokvqa_multiple_choice_accuracy("dog", choices, 1) == 0.0
    assert aokvqa_multiple_choice_accuracy(0, choices, 1) == 0.0
    assert aokvqa_multiple_choice_accuracy("Cat", choices, 1) == 0.0   # not a choice: 0 (strict=False)
    assert aokvqa_multiple_choice_accuracy(7, choices, 1) == 0.0
    assert aokvqa_multiple_choice_accuracy(-3, choices, 1) == 0.0
    with pytest.raises(ValueError):
        aokvqa_multiple_choice_accuracy("Cat", choices, 1, strict=True)
    with pytest.raises(ValueError):
        aokvqa_multiple_choice_accuracy("cat", choices, 4)
    with pytest.raises(TypeError):
        aokvqa_multiple_choice_accuracy(True, choices, 1)


# --- Boxes ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, expected", [
    ([0, 0, 10, 10], [0, 0, 10, 10], 1.0),
    ([0, 0, 10, 10], [5, 0, 10, 10], 50 / 150),
    ([0, 0, 10, 10], [20, 20, 5, 5], 0.0),         # no overlap
    ([0, 0, 10, 10], [10, 0, 10, 10], 0.0),        # touching edges
    ([0, 0, 10, 10], [10, 10, 5, 5], 0.0),         # touching corners
    ([0, 0, 10, 10], [9, 0, 10, 10], 10 / 190),    # one-pixel-wide overlap (MAttNet's inclusive computeIoU: 0)
    ([0, 0, 10, 10], [2, 2, 4, 4], 16 / 100),      # containment
    ([2, 2, 4, 4], [0, 0, 10, 10], 16 / 100),
    ([0, 0, 10, 10], [5, 5, 0, 0], 0.0),           # zero-area box inside another
    ([5, 5, 0, 0], [5, 5, 0, 0], 0.0),             # two zero-area boxes: 0, not 0/0
    ([0.5, 0.5, 2.5, 1.5], [1.0, 1.0, 2.0, 2.0], 2.0 / (3.75 + 4.0 - 2.0)),  # real-valued COCO boxes
    ([-5, -5, 10, 10], [0, 0, 10, 10], 25 / 175),  # outside the image: the caller's problem, still a box
])
def test_box_iou(a: list[float], b: list[float], expected: float) -> None:
    """COCO [x, y, w, h], continuous coordinates; the same number as pycocotools' bbIou (maskUtils.iou on boxes)."""
    from pycocotools import mask as coco_mask

    assert box_iou(a, b) == pytest.approx(expected)
    assert box_iou(b, a) == pytest.approx(expected)
    assert coco_mask.iou(np.array([a], float), np.array([b], float), [0])[0][0] == pytest.approx(expected)


def test_refcoco_accuracy_is_iou_at_least_a_half() -> None:
    assert refcoco_accuracy([0, 0, 10, 10], [0, 0, 10, 20]) == 1.0       # IoU exactly 0.5 counts
    assert refcoco_accuracy([0, 0, 10, 10], [0, 0, 10, 20.1]) == 0.0
    assert refcoco_accuracy([0, 0, 10, 10], [5, 0, 10, 10]) == 0.0       # 1/3
    assert refcoco_accuracy([0, 0, 10, 10], [5, 0, 10, 10], threshold=0.3) == 1.0


def test_boxes_and_non_boxes() -> None:
    assert as_box((1, 2, 3, 4)) == (1.0, 2.0, 3.0, 4.0)
    assert as_box(np.array([1.5, 2, 3, 4], dtype=np.float32)) == (1.5, 2.0, 3.0, 4.0)
    for not_a_box in ("1 2 3 4", [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, -3, 4], [1, 2, float("nan"), 4], [True, 0, 1, 1],
                      ["1", 2, 3, 4], None, 5, {"x": 1, "y": 2, "w": 3, "h": 4}):
        assert as_box(not_a_box) is None
    with pytest.raises(ValueError):
        box_iou([0, 0, -1, 1], [0, 0, 1, 1])
    assert xyxy_to_xywh((10, 20, 30, 60)) == (10.0, 20.0, 20.0, 40.0)


# --- HYDRA Eq. 3: related, m, the registry --------------------------------------------------------------------------

@pytest.mark.parametrize("prediction, answer_type, expected", [
    ("Yes.", "yes/no", True), ("no", "yes/no", True), ("maybe", "yes/no", False), ("2", "yes/no", False),
    ("two", "number", True), ("1,000", "number", True), ("1.5", "number", True), ("none", "number", True),
    ("twelve", "number", True), ("a dozen", "number", True), ("many", "number", False), ("", "number", False),
    ("red", "other", True), ("yes", "other", True), ("  ", "other", False), ("the", "other", False),
    ([1, 2, 3, 4], "box", True), ("[1, 2, 3, 4]", "box", False), ([1, 2, 3, 4], "other", False),
    (None, "yes/no", False),
])
def test_related_by_answer_type(prediction: object, answer_type: str, expected: bool) -> None:
    assert related(prediction, answer_type) is expected


def test_related_rejects_an_unknown_answer_type() -> None:
    with pytest.raises(ValueError, match="unknown answer type"):
        related("yes", "colour")


@dataclass(frozen=True)
class Truth:
    answers: tuple[str, ...] = ()
    answer_type: str = "other"
    choices: tuple[str, ...] = ()
    correct_choice: int | None = None
    box: tuple[float, float, float, float] | None = None


def test_registry_scores_each_benchmark() -> None:
    assert {"vqav2", "okvqa", "aokvqa", "aokvqa-mc", "gqa", "refcoco", "refcoco+"} <= set(METRICS)
    vqa = Truth(answers=("2",) * 2 + ("3",) * 8, answer_type="number")
    assert score("vqav2", "two", vqa) == pytest.approx(0.6)
    assert score("okvqa", "two", vqa) == pytest.approx(0.6)
    assert score("vqav2", [0, 0, 1, 1], vqa) == 0.0                 # a box is no text answer
    assert score("gqa", "left", Truth(answers=("left",))) == 1.0
    assert score("aokvqa", "dog", Truth(answers=("dog",) * 3 + ("cat",) * 7)) == 1.0
    mc = Truth(choices=("dog", "cat"), correct_choice=1)
    assert score("aokvqa-mc", 1, mc) == score("aokvqa-mc", "cat", mc) == 1.0
    grounding = Truth(answer_type="box", box=(0, 0, 10, 10))
    assert score("refcoco", [5, 0, 10, 10], grounding) == pytest.approx(1 / 3)   # the IoU, as HYDRA reports
    assert score("refcoco+@0.5", [5, 0, 10, 10], grounding) == 0.0
    assert score("refcoco+", "the dog", grounding) == 0.0
    for name, metric in METRICS.items():
        assert benchmark_metric(name) is metric and metric.source
    with pytest.raises(KeyError, match="vqav2"):
        benchmark_metric("clevr")
    with pytest.raises(DataError):
        score("refcoco", [0, 0, 1, 1], Truth(answer_type="box"))
    with pytest.raises(DataError):
        score("aokvqa-mc", 0, Truth(choices=("a", "b")))


def test_every_task_format_has_a_metric_that_reads_its_records() -> None:
    from pathlib import Path

    from clova_train.envs.tasks.formats import FORMATS
    from clova_train.envs.tasks.records import BenchmarkTask

    assert set(FORMATS) <= set(METRICS)
    task = BenchmarkTask("1", "refcoco", Path("x.jpg"), "the left dog", answer_type="box", box=(0.0, 0.0, 10.0, 10.0))
    assert eq3_answer_terms(task.benchmark, [0, 0, 10, 10], task) == (True, 1.0)


def test_eq3_terms() -> None:
    yes_no = Truth(answers=("yes",) * 7 + ("2",) * 3, answer_type="yes/no")
    assert eq3_answer_terms("vqav2", "no", yes_no) == (True, 0.0)        # related, wrong: +alpha * 0
    assert eq3_answer_terms("vqav2", "yes", yes_no) == (True, 1.0)
    assert eq3_answer_terms("vqav2", "blue", yes_no) == (False, 0.0)     # unrelated: -alpha
    related_number, m = eq3_answer_terms("vqav2", "2", yes_no)           # scores, so related
    assert related_number and m == pytest.approx(0.9)
    mc = Truth(choices=("dog", "cat"), correct_choice=1)
    assert eq3_answer_terms("aokvqa-mc", "dog", mc) == (True, 0.0)      # a choice is related
    assert eq3_answer_terms("aokvqa-mc", "wolf", mc) == (False, 0.0)
    grounding = Truth(answer_type="box", box=(0, 0, 10, 10))
    assert eq3_answer_terms("refcoco", [20, 20, 5, 5], grounding) == (True, 0.0)
    assert eq3_answer_terms("refcoco", "left dog", grounding) == (False, 0.0)
