"""Tool-usage success rates of GPT4Tools (Sec. 3.3): SR_t, SR_act, SR_args and SR, as a torchmetrics metric.

Each sample compares a generated response with the ground-truth response (both in the ReAct format of
:mod:`clova_train.tooluse.react`); samples are grouped as ``seen`` (every ground-truth tool was in training),
``unseen`` and ``no_tool`` (the ground truth answers without a tool), and every group plus ``all`` is
reported. Two modes:

``paper`` (the paper's definitions, scored step by step):
  * thought: 1 if, for every ground-truth step, the predicted decision ("Yes"/"No") at that step is the
    same and the prediction has no extra tool step; a no-tool sample also needs an ``AI:`` reply;
  * action: 1 if the predicted tool names equal the ground truth's, step by step (same count);
  * args: per step, the mean over argument positions (comma separated) of: image paths (an argument with
    an image extension) 1 if the file names are equal, else 0; text: sentence BLEU (NLTK) over word and
    punctuation tokens, n-gram order ``min(4, reference tokens)``, uniform weights, add-one smoothing of
    the n >= 2 precisions (Lin and Och; NLTK's ``method2``) and the brevity penalty; a missing or extra
    argument or step scores 0; the sample's value is the mean over ``max(len(pred), len(gt))`` steps;
  * SR: thought * action * (args > 0.5). A no-tool sample scores action = args = thought.

``gpt4tools`` (reproduces the public ``eval/evaluate_result.py`` exactly, so numbers compare with published ones):
  * parsing is the script's: regular-expression *searches* over the stripped response, anywhere in a line
    (``Thought: Do I need to use a tool\\? (.*)``, ``Action: (.*)``, ``Action Input: (.*)``, ``AI: (.*)``),
    each capture stripped; the space after each colon is required (``tool?Yes`` is no decision) and an
    ``Action Input: `` with nothing after it is still a step (with an empty argument);
  * a sample is a tool sample if its reference contains ``"Action:"`` and ``"Action Input:"``. Decisions,
    tools and arguments are aligned by position over ``max(len(pred), len(gt))`` positions (a missing one
    scores 0); the reference's decisions are cut to its number of tools; one trailing predicted "No" after
    the last action is dropped;
  * arguments: both sides split on every ``,`` (not stripped); a different count scores the step 0; an
    argument whose reference contains ``".png"`` scores 1 if the prediction also does, else the whole step
    scores 0; any other argument scores pycocoevalcap's BLEU-1 of the prediction against the reference
    (:func:`coco_bleu1`, with its epsilon terms: a perfect match of n words scores about ``1 - 2e-9 / n``);
    the step's score is the mean over its arguments;
  * SR needs thought = action = 1 and args >= 0.5 (a NaN mean, from no decisions on either side, passes, as
    in the script);
  * a no-tool sample: thought is the aligned mean of the decisions, set to 0 unless the first predicted
    decision is "No" and an ``AI: `` capture exists anywhere; action, args and SR are 1 if thought is 1,
    else 0.
  Not reproduced: the script's IoU (not one of the four rates) and its printing.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Literal

import torch
from torchmetrics import Metric

from clova_train.tooluse.react import ReActResponse, parse_react, split_arguments

CATEGORIES = ("seen", "unseen", "no_tool")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
Scores = tuple[float, float, float, float]  # thought, action, args, success


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _paper_text_similarity(prediction: str, reference: str) -> float:
    # nltk (0.3 s with the scikit-learn it pulls in) only when a metric is computed, not with every CLI start
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    ref_tokens, pred_tokens = _TOKEN.findall(reference), _TOKEN.findall(prediction)
    if not ref_tokens or not pred_tokens:
        return float(ref_tokens == pred_tokens)
    order = min(4, len(ref_tokens))
    return float(sentence_bleu([ref_tokens], pred_tokens, weights=(1 / order,) * order,
                               smoothing_function=SmoothingFunction().method2))


def _is_image_path(argument: str) -> bool:
    return argument.lower().endswith(IMAGE_EXTENSIONS)


def _paper_argument_score(prediction: str | None, reference: str | None) -> float:
    if prediction is None or reference is None:
        return 0.0
    pred_args, ref_args = split_arguments(prediction), split_arguments(reference)
    scores = []
    for k in range(max(len(pred_args), len(ref_args))):
        if k >= len(pred_args) or k >= len(ref_args):
            scores.append(0.0)
        elif _is_image_path(ref_args[k]):
            scores.append(float(os.path.basename(pred_args[k]) == os.path.basename(ref_args[k])))
        else:
            scores.append(_paper_text_similarity(pred_args[k], ref_args[k]))
    return sum(scores) / len(scores)


def score_paper(prediction: ReActResponse, reference: ReActResponse) -> Scores:
    """The paper's per-sample scores (see module docstring)."""
    gt_tools = reference.tool_steps
    if not gt_tools:
        correct = bool(prediction.steps) and prediction.steps[0].decision == "No" and prediction.reply is not None
        value = float(correct and not prediction.tool_steps)
        return value, value, value, value
    pred_tools = prediction.tool_steps
    gt_decisions = [s.decision for s in reference.steps if s.action is not None]
    pred_decisions = prediction.decisions[: len(gt_decisions)]
    thought = float(pred_decisions == gt_decisions and len(pred_tools) <= len(gt_tools))
    action = float([s.action for s in pred_tools] == [s.action for s in gt_tools])
    steps = max(len(pred_tools), len(gt_tools))
    args = sum(
        _paper_argument_score(
            pred_tools[j].action_input if j < len(pred_tools) else None,
            gt_tools[j].action_input if j < len(gt_tools) else None,
        )
        for j in range(steps)
    ) / steps
    return thought, action, args, thought * action * float(args > 0.5)


def _aligned(gt: list, pred: list, equal) -> list[float]:
    """Per-position scores over max(len) positions: ``equal(g, p)`` where both exist, else 0."""
    length = max(len(gt), len(pred))
    return [equal(gt[k], pred[k]) if k < min(len(gt), len(pred)) else 0.0 for k in range(length)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def coco_bleu1(candidate: str, reference: str) -> float:
    """pycocoevalcap's ``Bleu(n=1)`` score of one candidate against one reference, from its formula.

    Whitespace tokens; ``p1 = (clipped matches + 1e-15) / (candidate length + 1e-9)``; brevity penalty
    ``exp(1 - 1 / r)`` when ``r = (candidate length + 1e-15) / (reference length + 1e-9) < 1``, which the
    epsilons make true even for equal lengths.
    """
    candidate_words, reference_words = candidate.split(), reference.split()
    counts = Counter(reference_words)
    matches = sum(min(n, counts[word]) for word, n in Counter(candidate_words).items())
    score = (matches + _TINY) / (len(candidate_words) + _SMALL)
    ratio = (len(candidate_words) + _TINY) / (len(reference_words) + _SMALL)
    if ratio < 1:
        score *= math.exp(1 - 1 / ratio)
    return score


_TINY, _SMALL = 1e-15, 1e-9
_GPT4TOOLS_THOUGHT = re.compile(r"Thought: Do I need to use a tool\? (.*)")
_GPT4TOOLS_ACTION = re.compile(r"Action: (.*)")
_GPT4TOOLS_INPUT = re.compile(r"Action Input: (.*)")
_GPT4TOOLS_REPLY = re.compile(r"AI: (.*)")


def _found(pattern: re.Pattern, text: str) -> list[str]:
    return [match.strip() for match in pattern.findall(text)]


def _gpt4tools_argument_score(gt_item: str, pred_item: str) -> float:
    gt_args, pred_args = gt_item.split(","), pred_item.split(",")
    if len(gt_args) != len(pred_args):
        return 0.0
    scores = []
    for k, v in zip(gt_args, pred_args):
        if ".png" in k and ".png" not in v:
            return 0.0
        scores.append(coco_bleu1(v, k) if ".png" not in k else 1.0)
    return _mean(scores)


def score_gpt4tools(prediction_text: str, reference_text: str) -> Scores:
    """Per-sample scores of the public GPT4Tools evaluation script (see module docstring)."""
    prediction = prediction_text.strip()
    pred_thoughts = _found(_GPT4TOOLS_THOUGHT, prediction)
    if "Action:" in reference_text and "Action Input:" in reference_text:
        gt_actions, gt_inputs = _found(_GPT4TOOLS_ACTION, reference_text), _found(_GPT4TOOLS_INPUT, reference_text)
        if len(gt_actions) != len(gt_inputs):
            raise ValueError(f"reference has {len(gt_actions)} 'Action:' lines but {len(gt_inputs)} 'Action Input:' lines")
        gt_thoughts = _found(_GPT4TOOLS_THOUGHT, reference_text)[: len(gt_actions)]
        pred_actions, pred_inputs = _found(_GPT4TOOLS_ACTION, prediction), _found(_GPT4TOOLS_INPUT, prediction)
        action = _mean(_aligned(gt_actions, pred_actions, lambda g, p: float(g == p)))
        args = _mean(_aligned(gt_inputs, pred_inputs, _gpt4tools_argument_score))
        if len(pred_thoughts) == 1 + len(pred_actions) and pred_thoughts[-1] == "No":
            pred_thoughts = pred_thoughts[:-1]
        thought = _mean(_aligned(gt_thoughts, pred_thoughts, lambda g, p: float(g == p)))
        success = float(not (thought < 1.0 or action < 1.0 or args < 0.5))
        return thought, action, args, success
    gt_thoughts = _found(_GPT4TOOLS_THOUGHT, reference_text)
    thought = _mean(_aligned(gt_thoughts, pred_thoughts, lambda g, p: float(g == p)))
    if not pred_thoughts or pred_thoughts[0] != "No" or not _GPT4TOOLS_REPLY.findall(prediction):
        thought = 0.0
    value = 0.0 if thought < 1.0 else 1.0
    return thought, value, value, value


class ToolUsageSuccessRate(Metric):
    """SR_t, SR_act, SR_args and SR of generated ReAct responses, per sample group.

    Args:
        mode: ``"paper"`` (the paper's definitions) or ``"gpt4tools"`` (the public evaluation script).
        seen_tools: tool names seen in training; a tool sample whose tools are all seen is ``seen``,
            otherwise ``unseen`` (with ``None`` every tool sample is ``seen``).
    """

    full_state_update = False

    def __init__(self, mode: Literal["paper", "gpt4tools"] = "paper", seen_tools: list[str] | None = None) -> None:
        super().__init__()
        if mode not in ("paper", "gpt4tools"):
            raise ValueError(f"mode must be 'paper' or 'gpt4tools', got {mode!r}")
        self.mode = mode
        self.seen_tools = set(seen_tools) if seen_tools is not None else None
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("categories", default=[], dist_reduce_fx="cat")

    def category(self, reference: str) -> str:
        tools = [s.action for s in parse_react(reference).tool_steps]
        if not tools:
            return "no_tool"
        if self.seen_tools is None or all(t in self.seen_tools for t in tools):
            return "seen"
        return "unseen"

    def update(self, predictions: list[str], references: list[str]) -> None:
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
        rows, cats = [], []
        for prediction, reference in zip(predictions, references):
            if self.mode == "paper":
                rows.append(score_paper(parse_react(prediction), parse_react(reference)))
            else:
                rows.append(score_gpt4tools(prediction, reference))
            cats.append(CATEGORIES.index(self.category(reference)))
        self.scores.append(torch.tensor(rows, dtype=torch.float64, device=self.device).reshape(-1, 4))
        self.categories.append(torch.tensor(cats, dtype=torch.long, device=self.device))

    def compute(self) -> dict[str, torch.Tensor]:
        scores = torch.cat(self.scores) if isinstance(self.scores, list) else self.scores
        cats = torch.cat(self.categories) if isinstance(self.categories, list) else self.categories
        result: dict[str, torch.Tensor] = {}
        groups = {"all": torch.ones_like(cats, dtype=torch.bool)}
        groups.update({name: cats == k for k, name in enumerate(CATEGORIES)})
        for group, mask in groups.items():
            if mask.any():
                means = scores[mask].mean(0)
                for name, value in zip(("SR_t", "SR_act", "SR_args", "SR"), means):
                    result[f"{group}/{name}"] = value.float()
                result[f"{group}/samples"] = mask.sum().float()  # on N ranks: every sample exactly once
        return result
