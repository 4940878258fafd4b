"""The benchmarks' own metrics, as their official evaluation scripts compute them, and the terms of HYDRA's Eq. 3.

Each function scores one prediction against one question's ground truth; a benchmark's number is the mean over
its questions (times 100). The facts below were read from the public evaluation scripts; the code is this
project's own.

**VQAv2 and OK-VQA** (GT-Vision-Lab/VQA, ``PythonEvaluationTools/vqaEvaluation/vqaEval.py``, ``VQAEval.evaluate``;
OK-VQA is scored with the same script, as its leaderboard page says and ViperGPT's dataset code cites):
:func:`vqa_accuracy`.

* Every ground-truth answer and the prediction have newlines and tabs turned into spaces and are stripped.
* **Quirk, reproduced:** the answers are normalised (:func:`normalise_vqa_answer`) *only when the ground-truth
  answers are not all the same* (``len(set(gtAnswers)) > 1``). When all annotators wrote the same answer, the
  prediction is compared with it verbatim: ten ``"yes"`` score ``"Yes"`` or ``"yes."`` as 0, ten ``"two"`` score
  ``"2"`` as 0. ``normalise_unanimous=True`` normalises in that case too (not the official number).
* Accuracy: for each of the n answers, leave it out and count how many of the other n - 1 equal the prediction;
  that subset scores ``min(1, matches / 3)``; the accuracy is the mean over the n subsets (10 choose 9 for the
  usual ten answers). The left-out answer is one *position* (the script compares annotation records, each with
  its own ``answer_id``), not every answer equal to it. With k of ten matching: 0, 0.3, 0.6, 0.9, then 1.0 from 4.

:func:`normalise_vqa_answer` is the script's ``processPunctuation`` then ``processDigitArticle``:

* punctuation ``; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? !`` (not ``' : . * # $ % & ~ ^ |``): each mark is
  deleted when the *original* text has it next to a space (``"x, y"``) or the text holds a digit-comma-digit
  anywhere (``"1,000"``: then every mark is deleted), otherwise replaced by a space (``"t-shirt"`` -> ``"t shirt"``);
* then every period not followed by a digit is deleted (``"1.5"`` keeps its point, ``"5."`` and ``"a.m."`` lose
  theirs). **Quirk, reproduced:** the script passes ``re.UNICODE`` (32) where ``re.sub`` takes its ``count``, so
  at most 32 periods are deleted. (Its pattern ``(?!<=\\d)`` is a look-ahead typo for a look-behind; it never
  fires, so it is left out here.)
* lower case, split on whitespace (runs of spaces collapse), number words ``none zero one ... ten`` -> digits
  (``none`` -> ``0``; ``eleven`` stays), articles ``a an the`` dropped, then the contractions table
  (``dont`` -> ``don't``). **Quirks, reproduced:** the table's capitalised keys (``Im``, ``Ive``, ``Id've``,
  ``I'dve``) never match the lower-cased words, and ``somebody'd`` maps to ``somebodyd``.

**A-OKVQA** (allenai/aokvqa, ``evaluation/eval_predictions.py``, ``eval_aokvqa``; ``load_aokvqa.py`` only reads the
JSON): direct answer (:func:`aokvqa_direct_answer_accuracy`) is ``min(1, matches / 3)`` over *all* ten
``direct_answers`` (no leave-one-out) with **no normalisation**: the prediction must equal an answer verbatim
(case, spaces and punctuation included). Questions flagged ``difficult_direct_answer`` are left out of the
direct-answer mean (the caller's job). Multiple choice (:func:`aokvqa_multiple_choice_accuracy`) is
``pred == choices[correct_choice_idx]``; a prediction that is not one of the choices scores 0 (the script's
``strict=False``, which its command line uses; ``remap_predictions.py`` maps free text to the nearest choice by
GloVe embeddings beforehand, which this module does not do).

**GQA** (the official ``eval.py`` distributed at gqadataset.org, mirrored in many repositories): accuracy is
``predicted == gold``, an exact string match with **no normalisation**, averaged over the balanced questions
(``isBalanced``). :func:`gqa_exact_match`; ``normalise=True`` applies :func:`normalise_vqa_answer` to both sides
(the lenient reading compositional-VQA code uses, e.g. ViperGPT's ``datasets/gqa.py`` normalises the prediction
with the VQA rules; not the official number).

**RefCOCO / RefCOCO+ / RefCOCOg**: :func:`box_iou` of boxes in COCO ``[x, y, width, height]``, continuous
coordinates (right edge ``x + width``, area ``width * height``, no +1 pixel). Chosen because COCO's (and so
RefCOCO's) boxes are real-valued, because pycocotools' box IoU (``maskApi.c`` ``bbIou``) computes exactly this, and
because HYDRA's own evaluation (ControlNet/HYDRA ``hydra_vl4ai/evaluation/grounding_eval.py``) and ViperGPT's
(``datasets/refcoco.py``, torchvision ``box_iou``) do too. The ``computeIoU`` of lichengunc's MAttNet code uses an
inclusive-pixel variant (intersection ``x2 - x1 + 1`` with ``x2 = x + w - 1``, strict ``<`` test): equal on integer
boxes except that a one-pixel-wide overlap counts as none there. :func:`refcoco_accuracy` is ``IoU >= 0.5`` (the
usual grounding accuracy, MAttNet's ``IoU >= 0.5``). HYDRA reports the mean IoU (its Table 2b), so the registry's
``refcoco`` metric is the IoU and ``refcoco@0.5`` the accuracy.

**HYDRA's Eq. 3**: a final answer adds ``alpha * m`` when it is *related* and ``-alpha`` when it is unrelated, where
``m`` is "the performance metric (e.g. accuracy, intersection over union)" of the final answer. :data:`METRICS`
maps each benchmark to its ``m``; :func:`related` says whether an answer has the kind the question asks for
(by answer type); :func:`eq3_answer_terms` gives both. (HYDRA's released code scores OK-VQA more leniently: a
stemmed ground-truth answer contained in the stemmed prediction counts; this module keeps the official metrics.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clova_train.core.errors import DataError
from clova_train.envs.tasks.records import ANSWER_TYPES  # VQA's yes/no, number, other, plus a box for grounding

Box = tuple[float, float, float, float]
"""A box in COCO's ``[x, y, width, height]`` (pixels, continuous coordinates)."""

# --- VQA normalisation (facts from vqaEval.py) ---------------------------------------------------------------

_PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",",
                "?", "!")
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")
_PERIODS_DELETED_AT_MOST = 32  # re.UNICODE, passed where re.sub takes its count
_NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                 "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = frozenset({"a", "an", "the"})
# The official contractions table as "written -> normalised" pairs, two per token pair, in the script's order.
_CONTRACTION_PAIRS = """
aint ain't  arent aren't  cant can't  couldve could've  couldnt couldn't  couldn'tve couldn't've
couldnt've couldn't've  didnt didn't  doesnt doesn't  dont don't  hadnt hadn't  hadnt've hadn't've
hadn'tve hadn't've  hasnt hasn't  havent haven't  hed he'd  hed've he'd've  he'dve he'd've  hes he's
howd how'd  howll how'll  hows how's  Id've I'd've  I'dve I'd've  Im I'm  Ive I've  isnt isn't  itd it'd
itd've it'd've  it'dve it'd've  itll it'll  let's let's  maam ma'am  mightnt mightn't  mightnt've mightn't've
mightn'tve mightn't've  mightve might've  mustnt mustn't  mustve must've  neednt needn't  notve not've
oclock o'clock  oughtnt oughtn't  ow's'at 'ow's'at  'ows'at 'ow's'at  'ow'sat 'ow's'at  shant shan't
shed've she'd've  she'dve she'd've  she's she's  shouldve should've  shouldnt shouldn't
shouldnt've shouldn't've  shouldn'tve shouldn't've  somebody'd somebodyd  somebodyd've somebody'd've
somebody'dve somebody'd've  somebodyll somebody'll  somebodys somebody's  someoned someone'd
someoned've someone'd've  someone'dve someone'd've  someonell someone'll  someones someone's
somethingd something'd  somethingd've something'd've  something'dve something'd've  somethingll something'll
thats that's  thered there'd  thered've there'd've  there'dve there'd've  therere there're  theres there's
theyd they'd  theyd've they'd've  they'dve they'd've  theyll they'll  theyre they're  theyve they've
twas 'twas  wasnt wasn't  wed've we'd've  we'dve we'd've  weve we've  werent weren't  whatll what'll
whatre what're  whats what's  whatve what've  whens when's  whered where'd  wheres where's  whereve where've
whod who'd  whod've who'd've  who'dve who'd've  wholl who'll  whos who's  whove who've  whyll why'll
whyre why're  whys why's  wont won't  wouldve would've  wouldnt wouldn't  wouldnt've wouldn't've
wouldn'tve wouldn't've  yall y'all  yall'll y'all'll  y'allll y'all'll  yall'd've y'all'd've
y'alld've y'all'd've  y'all'dve y'all'd've  youd you'd  youd've you'd've  you'dve you'd've  youll you'll
youre you're  youve you've
""".split()
_CONTRACTIONS = dict(zip(_CONTRACTION_PAIRS[::2], _CONTRACTION_PAIRS[1::2]))


def _clean_whitespace(text: str) -> str:
    """What ``evaluate`` does to every answer first: newlines and tabs become spaces, then strip."""
    return text.replace("\n", " ").replace("\t", " ").strip()


def _process_punctuation(text: str) -> str:
    """``processPunctuation``: delete or space out the marks (tested on the original text), then periods."""
    delete_all = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in _PUNCTUATION:
        deleted = delete_all or (mark + " ") in text or (" " + mark) in text
        out = out.replace(mark, "" if deleted else " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out, count=_PERIODS_DELETED_AT_MOST)


def _process_digits_articles(text: str) -> str:
    """``processDigitArticle``: lower case, number words to digits, articles out, contractions in."""
    words = [_NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    return " ".join(_CONTRACTIONS.get(word, word) for word in words if word not in _ARTICLES)


def normalise_vqa_answer(text: str) -> str:
    """The official VQA normalisation of one answer (the module docstring lists its rules and quirks).

    ``"Two dogs."`` -> ``"2 dogs"``, ``"1,000"`` -> ``"1000"``, ``"1.5"`` -> ``"1.5"``, ``"dont know"`` ->
    ``"don't know"``, ``" The  Red-Car "`` -> ``"red car"``.
    """
    return _process_digits_articles(_process_punctuation(_clean_whitespace(text)))


def vqa_accuracy(prediction: str, answers: Sequence[str], *, normalise_unanimous: bool = False) -> float:
    """VQA accuracy of one prediction against the annotators' answers (VQAv2, OK-VQA), in [0, 1].

    The mean over leaving out each answer in turn of ``min(1, matches among the others / 3)``, answers and
    prediction normalised only when the answers are not unanimous (the official quirk; ``normalise_unanimous``
    lifts it). Raises ``ValueError`` on an empty answer list (the script would divide by zero).
    """
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of strings, not one string")
    if not answers:
        raise ValueError("VQA accuracy needs at least one ground-truth answer")
    truths = [_clean_whitespace(answer) for answer in answers]
    predicted = _clean_whitespace(prediction)
    if len(set(truths)) > 1 or normalise_unanimous:
        truths = [_process_digits_articles(_process_punctuation(answer)) for answer in truths]
        predicted = _process_digits_articles(_process_punctuation(predicted))
    hits = [truth == predicted for truth in truths]
    total = sum(hits)
    per_subset = [min(1.0, float(total - hit) / 3) for hit in hits]
    return float(sum(per_subset)) / len(per_subset)


# --- GQA and A-OKVQA ---------------------------------------------------------------------------------------------

def gqa_exact_match(prediction: str, answer: str, *, normalise: bool = False) -> float:
    """GQA accuracy of one prediction: 1.0 when it equals the gold answer verbatim (official ``eval.py``), else 0.0.

    ``normalise=True`` compares :func:`normalise_vqa_answer` of both instead (lenient, not the official number).
    """
    if normalise:
        return float(normalise_vqa_answer(prediction) == normalise_vqa_answer(answer))
    return float(prediction == answer)


def aokvqa_direct_answer_accuracy(prediction: str, direct_answers: Sequence[str]) -> float:
    """A-OKVQA direct-answer accuracy: ``min(1, verbatim matches among all direct answers / 3)``.

    No normalisation and no leave-one-out (``eval_aokvqa``): ``"Yes"`` does not match ``"yes"``.
    """
    if isinstance(direct_answers, str):
        raise TypeError("direct_answers must be a sequence of strings, not one string")
    matches = sum(prediction == answer for answer in direct_answers)
    return min(1.0, matches / 3.0)


def aokvqa_multiple_choice_accuracy(prediction: int | str, choices: Sequence[str], correct_choice_idx: int, *,
                                    strict: bool = False) -> float:
    """A-OKVQA multiple-choice accuracy: 1.0 when the prediction is the correct choice, else 0.0.

    ``prediction`` is a choice's text (compared verbatim with ``choices[correct_choice_idx]``, as ``eval_aokvqa``
    does) or its index. A prediction that is not a choice (text not among ``choices``, an index out of range)
    scores 0.0, or raises ``ValueError`` with ``strict`` (the script's ``strict=True`` assertion).
    """
    if isinstance(correct_choice_idx, bool) or not isinstance(correct_choice_idx, int) \
            or not 0 <= correct_choice_idx < len(choices):
        raise ValueError(f"correct_choice_idx {correct_choice_idx!r} is not an index of the {len(choices)} choices")
    if isinstance(prediction, str):
        valid = prediction in choices
        correct = prediction == choices[correct_choice_idx]
    elif isinstance(prediction, int) and not isinstance(prediction, bool):
        valid = 0 <= prediction < len(choices)
        correct = prediction == correct_choice_idx
    else:
        raise TypeError(f"a multiple-choice prediction is a choice's text or index, not {type(prediction).__name__}")
    if strict and not valid:
        raise ValueError(f"prediction {prediction!r:.60} is not one of the choices")
    return float(correct)


# --- Boxes (RefCOCO, RefCOCO+, RefCOCOg) ------------------------------------------------------------------------

def as_box(value: object) -> Box | None:
    """``value`` as a COCO ``(x, y, width, height)`` box: four finite real numbers, width and height >= 0; else None.

    Text, booleans, NaN, infinities and negative sizes are not boxes. A box outside the image is still a box (the
    caller clips it if the benchmark wants that).
    """
    if isinstance(value, (str, bytes, Mapping)):
        return None
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        return None
    if len(items) != 4:
        return None
    numbers = []
    for item in items:
        if isinstance(item, (str, bytes)) or type(item).__name__ in ("bool", "bool_"):
            return None
        try:
            number = float(item)
        except (TypeError, ValueError, OverflowError):
            return None
        if not math.isfinite(number):
            return None
        numbers.append(number)
    x, y, width, height = numbers
    if width < 0 or height < 0:
        return None
    return (x, y, width, height)


def _require_box(value: object, name: str) -> Box:
    box = as_box(value)
    if box is None:
        raise ValueError(f"{name} is not an [x, y, width, height] box with finite numbers and sizes >= 0: "
                         f"{value!r:.80}")
    return box


def xyxy_to_xywh(box: Sequence[float]) -> Box:
    """``(left, top, right, bottom)`` -> COCO ``(x, y, width, height)`` (continuous coordinates, no +1)."""
    left, top, right, bottom = (float(v) for v in box)
    return (left, top, right - left, bottom - top)


def box_iou(a_xywh: Sequence[float], b_xywh: Sequence[float]) -> float:
    """Intersection over union of two COCO ``[x, y, width, height]`` boxes, continuous coordinates, in [0, 1].

    Boxes that only touch, do not overlap, or have zero area intersect in nothing: 0.0 (also for two zero-area
    boxes, as pycocotools gives, rather than 0/0). Raises ``ValueError`` on something that is not a box
    (:func:`as_box`).
    """
    ax, ay, aw, ah = _require_box(a_xywh, "the first box")
    bx, by, bw, bh = _require_box(b_xywh, "the second box")
    overlap_w = min(ax + aw, bx + bw) - max(ax, bx)
    overlap_h = min(ay + ah, by + bh) - max(ay, by)
    if overlap_w <= 0 or overlap_h <= 0:
        return 0.0
    intersection = overlap_w * overlap_h
    return min(1.0, intersection / (aw * ah + bw * bh - intersection))


def refcoco_accuracy(predicted: Sequence[float], target: Sequence[float], threshold: float = 0.5) -> float:
    """Grounding accuracy of one prediction: 1.0 when ``box_iou(predicted, target) >= threshold``, else 0.0."""
    return float(box_iou(predicted, target) >= threshold)


# --- HYDRA's "related" and the registry ---------------------------------------------------------------------------

_YES_NO = frozenset({"yes", "no"})
_NUMERAL = re.compile(r"-?\d+(\.\d+)?")
_LARGER_NUMBER_WORDS = frozenset({
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million", "dozen"})


def related(prediction: object, answer_type: str) -> bool:
    """Whether a final answer is *related* to the question in the sense of HYDRA's Eq. 3, by answer type.

    The paper gives the final answer ``+alpha * m`` when it is related and ``-alpha`` when it is unrelated, without
    spelling out "related"; here it means the answer has the kind the question asks for:

    * ``yes/no``: the answer normalises (:func:`normalise_vqa_answer`) to ``yes`` or ``no``;
    * ``number``: it normalises to a numeral (``"two"`` -> ``2``, ``"1,000"``, ``"1.5"``, ``"none"`` -> ``0``) or is an
      English number word beyond ten (``"twelve"``, ``"a dozen"``);
    * ``other``: any non-empty text;
    * ``box``: a box (:func:`as_box`: four finite numbers, sizes >= 0).

    A text answer to a box question, a box answer to a text question, and empty text are unrelated. Raises
    ``ValueError`` on an answer type outside :data:`ANSWER_TYPES`.
    """
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"unknown answer type {answer_type!r}; known: {', '.join(ANSWER_TYPES)}")
    if answer_type == "box":
        return as_box(prediction) is not None
    if not isinstance(prediction, str):
        return False
    normalised = normalise_vqa_answer(prediction)
    if answer_type == "yes/no":
        return normalised in _YES_NO
    if answer_type == "number":
        return _NUMERAL.fullmatch(normalised) is not None or \
            (bool(normalised) and all(word in _LARGER_NUMBER_WORDS for word in normalised.split()))
    return bool(normalised)


class TaskTruth(Protocol):
    """What a metric reads of a task's ground truth (``clova_train.envs.tasks.records.BenchmarkTask`` has it)."""

    @property
    def answers(self) -> Sequence[str]: ...  # VQA / OK-VQA: the annotators'; A-OKVQA: direct answers; GQA: one

    @property
    def answer_type(self) -> str: ...  # one of ANSWER_TYPES

    @property
    def choices(self) -> Sequence[str]: ...  # A-OKVQA multiple choice

    @property
    def correct_choice(self) -> int | None: ...

    @property
    def box(self) -> Sequence[float] | None: ...  # RefCOCO: COCO [x, y, width, height]


MetricFn = Callable[[object, TaskTruth], float]


def _text_metric(score: Callable[[str, TaskTruth], float]) -> MetricFn:
    def metric(prediction: object, truth: TaskTruth) -> float:
        return score(prediction, truth) if isinstance(prediction, str) else 0.0
    return metric


def _vqa(prediction: str, truth: TaskTruth) -> float:
    return vqa_accuracy(prediction, truth.answers)


def _gqa(prediction: str, truth: TaskTruth) -> float:
    if len(truth.answers) != 1:
        raise DataError(f"a GQA task has one answer, got {len(truth.answers)}")
    return gqa_exact_match(prediction, truth.answers[0])


def _aokvqa_da(prediction: str, truth: TaskTruth) -> float:
    return aokvqa_direct_answer_accuracy(prediction, truth.answers)


def _choice_index(truth: TaskTruth) -> int:
    if truth.correct_choice is None:
        raise DataError("an A-OKVQA multiple-choice task needs its correct_choice")
    return truth.correct_choice


def _aokvqa_mc(prediction: object, truth: TaskTruth) -> float:
    if not isinstance(prediction, (str, int)) or isinstance(prediction, bool):
        return 0.0
    return aokvqa_multiple_choice_accuracy(prediction, truth.choices, _choice_index(truth))


def _is_choice(prediction: object, truth: TaskTruth) -> bool:
    if isinstance(prediction, str):
        return prediction in truth.choices
    return isinstance(prediction, int) and not isinstance(prediction, bool) and 0 <= prediction < len(truth.choices)


def _target_box(truth: TaskTruth) -> Sequence[float]:
    if truth.box is None:
        raise DataError("a grounding task needs its box")
    return truth.box


def _iou(prediction: object, truth: TaskTruth) -> float:
    box = as_box(prediction)
    return 0.0 if box is None else box_iou(box, _target_box(truth))


def _accuracy_at_half(prediction: object, truth: TaskTruth) -> float:
    box = as_box(prediction)
    return 0.0 if box is None else refcoco_accuracy(box, _target_box(truth))


def _related_by_type(prediction: object, truth: TaskTruth) -> bool:
    return related(prediction, truth.answer_type)


@dataclass(frozen=True)
class BenchmarkMetric:
    """A benchmark's per-question metric: ``score(prediction, truth)`` in [0, 1] (Eq. 3's ``m``) and its source.

    ``related(prediction, truth)`` is Eq. 3's relatedness (by the task's answer type unless the benchmark says
    otherwise: a multiple-choice answer is related when it is one of the choices). A prediction of the wrong kind
    (a box for a text question, text for a box) scores 0.0; a task missing what its metric needs raises
    :class:`~clova_train.core.errors.DataError`.
    """

    name: str
    score: MetricFn
    source: str
    related: Callable[[object, TaskTruth], bool] = field(default=_related_by_type)


_VQA_SOURCE = "GT-Vision-Lab/VQA PythonEvaluationTools/vqaEvaluation/vqaEval.py (VQAEval.evaluate)"
_GROUNDING_SOURCE = "COCO [x, y, w, h] IoU as pycocotools' bbIou; HYDRA's grounding_eval.py reports its mean"
METRICS: Mapping[str, BenchmarkMetric] = {metric.name: metric for metric in (
    BenchmarkMetric("vqav2", _text_metric(_vqa), _VQA_SOURCE),
    BenchmarkMetric("okvqa", _text_metric(_vqa), _VQA_SOURCE + ", as the OK-VQA leaderboard uses it"),
    BenchmarkMetric("aokvqa", _text_metric(_aokvqa_da),
                    "allenai/aokvqa evaluation/eval_predictions.py (direct answer)"),
    BenchmarkMetric("aokvqa-mc", _aokvqa_mc, "allenai/aokvqa evaluation/eval_predictions.py (multiple choice)",
                    related=_is_choice),
    BenchmarkMetric("gqa", _text_metric(_gqa), "GQA eval.py (gqadataset.org): predicted == gold"),
    *(BenchmarkMetric(name, _iou, _GROUNDING_SOURCE) for name in ("refcoco", "refcoco+", "refcocog")),
    *(BenchmarkMetric(f"{name}@0.5", _accuracy_at_half, "accuracy at IoU >= 0.5 (MAttNet's evaluation threshold)")
      for name in ("refcoco", "refcoco+", "refcocog")),
)}
"""Benchmark name -> its metric. ``refcoco*`` is the IoU (what HYDRA reports), ``refcoco*@0.5`` the accuracy."""


def benchmark_metric(benchmark: str) -> BenchmarkMetric:
    """The metric registered for ``benchmark`` (a key of :data:`METRICS`); ``KeyError`` naming the known ones."""
    try:
        return METRICS[benchmark]
    except KeyError:
        raise KeyError(f"no metric for benchmark {benchmark!r}; known: {', '.join(METRICS)}") from None


def score(benchmark: str, prediction: object, truth: TaskTruth) -> float:
    """``benchmark``'s metric of ``prediction`` against ``truth``, in [0, 1]."""
    return benchmark_metric(benchmark).score(prediction, truth)


def eq3_answer_terms(benchmark: str, prediction: object, truth: TaskTruth) -> tuple[bool, float]:
    """``(related, m)`` of a final answer for HYDRA's Eq. 3: ``+alpha * m`` if related, else ``-alpha``.

    ``m`` is the benchmark's metric; ``related`` is the benchmark's relatedness, and an answer that scores above
    0 is always related (a yes/no question some annotators answered with a number still credits that number).
    """
    metric = benchmark_metric(benchmark)
    m = metric.score(prediction, truth)
    return (m > 0 or metric.related(prediction, truth)), m
