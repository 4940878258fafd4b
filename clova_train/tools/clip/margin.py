"""Choosing CLASSIFY's ``classify_margin`` on validation images, so that labels without prompts keep their accuracy.

A CLIP prompt pool can correct a concept the tool gets wrong and, on the same images' look-alikes, take images
that the unmodified tool classified right (purple prompts pulling blue images to purple). ``classify_margin``
(:class:`~clova_train.tools.clip.tool.PromptedClip`) sets how much surer the prompted forward must be than the
unmodified one before it takes an image. :func:`choose_margin` scores a grid of margins on labelled validation
images (never the test images) and returns the most accurate one among those that keep every label without
prompts safe: the share of its images that the unmodified tool classifies right and the pool takes away must stay
within ``tolerance`` *with 95% confidence for all those labels together* (one-sided Clopper-Pearson upper bounds
at 1 - 0.05 / L each for L labels without prompts, Bonferroni; scipy), not only on average. A point estimate
passed on validation and failed on test (the margin study in ``benchmarks/prompt_pool_controls.py``: 3 points lost
on one seed with 100 validation images per label). Showing a 2-point bound needs at least :func:`images_needed`
images per label (149 for one label without prompts, 217 for four); when no margin qualifies, ``NEVER`` is
returned: prompts never override the unmodified tool. Ties go to the larger (safer) margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from scipy import stats

NEVER = 1.0  # probabilities differ by less than 1: at this margin the prompted forward never takes an image
MARGINS = (*(round(0.025 * k, 3) for k in range(21)), NEVER)  # 0.0, 0.025, ..., 0.5, never
TOLERANCE = 0.02
CONFIDENCE = 0.95


@dataclass(frozen=True)
class ClassifyForwards:
    """The unmodified forward's logits ``[N, L]`` and, per label with prompts (by index), the probabilities of the
    forward with that label's prompts."""

    unprompted_logits: torch.Tensor
    prompted: dict[int, torch.Tensor]

    @property
    def unprompted(self) -> torch.Tensor:
        return self.unprompted_logits.softmax(-1)


def classify_forwards(lookup, images: torch.Tensor, labels: Sequence[str], tool=None) -> ClassifyForwards:
    """Every forward CLASSIFY runs for ``images`` (``[N, 3, H, W]`` in [0, 1]) over ``labels`` with ``lookup``'s pool
    (a ``PromptToolServer``; ``tool``: its CLIP, by default ``lookup.tool``): the unprompted one once (retrieval
    features, the unmodified logits), then one per label that has prompts. An image whose ensembled prompt is all
    zero gets the unmodified forward for that label: CLIP's prompt tokens are not masked, so a zero token would
    still move the features, and a zero prompt must mean "no prompt" (as in the tools that mask zero tokens)."""
    tool = tool or lookup.tool
    tokens, text = tool.embed_patches(images), tool.text_features(list(labels))
    base = tool.encode_tokens(tokens, None)
    unprompted_logits = tool.logits(base, text)
    prompted = {}
    for k, label in enumerate(labels):
        prompts = lookup.prompts_for(label, base)
        if prompts is None:
            continue
        probabilities = unprompted_logits.softmax(-1).clone()
        rows = prompts.flatten(1).abs().amax(1) > 0
        if bool(rows.any()):
            features = tool.encode_tokens(tokens[rows], prompts[rows])
            probabilities[rows] = tool.logits(features, text).softmax(-1).to(probabilities.dtype)
        prompted[k] = probabilities
    return ClassifyForwards(unprompted_logits, prompted)


def served_scores(tool, forwards: ClassifyForwards, margin: float) -> torch.Tensor:
    """CLASSIFY's scores ``[N, L]`` at ``margin``: the unmodified probabilities, with a prompted label's own prompted
    probability where its forward takes the image (``PromptedClip.prompted_label_wins``); their argmax is served."""
    unprompted = forwards.unprompted
    scores = unprompted.clone()
    for k, probabilities in forwards.prompted.items():
        wins = tool.prompted_label_wins(probabilities, torch.tensor(k), unprompted, margin)
        scores[wins, k] = probabilities[wins, k]
    return scores


def decide(tool, forwards: ClassifyForwards, margin: float) -> torch.Tensor:
    """The labels CLASSIFY serves at ``margin``."""
    return served_scores(tool, forwards, margin).argmax(-1)


def per_label_accuracy(predicted: torch.Tensor, truth: torch.Tensor, labels: Sequence[str]) -> dict[str, float]:
    """Accuracy per true label (labels with images only) and over all (``"all"``)."""
    accuracy = {name: float((predicted[truth == k] == k).float().mean()) for k, name in enumerate(labels)
                if bool((truth == k).any())}
    return {**accuracy, "all": float((predicted == truth).float().mean())}


def label_confidence(labels_without_prompts: int, confidence: float = CONFIDENCE) -> float:
    """The confidence each label's bound needs so that all hold together with ``confidence`` (Bonferroni)."""
    return 1 - (1 - confidence) / max(1, labels_without_prompts)


def taken_share_bound(taken: int, images: int, confidence: float = CONFIDENCE) -> float:
    """One-sided upper confidence bound on the share of a label's images the pool takes away (``taken`` of
    ``images``, Clopper-Pearson)."""
    if taken >= images:
        return 1.0
    return float(stats.beta.ppf(confidence, taken + 1, images - taken))


def images_needed(labels_without_prompts: int = 1, tolerance: float = TOLERANCE, confidence: float = CONFIDENCE) -> int:
    """The fewest validation images per label that can show ``tolerance`` for ``labels_without_prompts`` labels
    together (none of their images taken)."""
    each, images = label_confidence(labels_without_prompts, confidence), 1
    while taken_share_bound(0, images, each) > tolerance:
        images += 1
    return images


def choose_margin(server, images: torch.Tensor, truth: torch.Tensor, labels: Sequence[str],
                  tolerance: float = TOLERANCE, margins: Sequence[float] = MARGINS,
                  confidence: float = CONFIDENCE) -> tuple[float, dict]:
    """The margin chosen on these validation images (module docstring) and, per margin (``NEVER`` included), the
    per-label accuracies with, under ``"taken_bound"``, each label without prompts' upper bound on the share taken
    away (``"unmodified"``: the tool without its pool)."""
    with torch.no_grad():
        forwards = classify_forwards(server, images, labels)
    unmodified = forwards.unprompted.argmax(-1)
    table: dict = {"unmodified": per_label_accuracy(unmodified, truth, labels)}
    without = [k for k in range(len(labels)) if k not in forwards.prompted and bool((truth == k).any())]
    each = label_confidence(len(without), confidence)
    best: tuple[float, float] | None = None
    for margin in sorted({*margins, NEVER}):
        predicted = decide(server.tool, forwards, margin)
        bounds = {labels[k]: taken_share_bound(int(((truth == k) & (unmodified == k) & (predicted != k)).sum()),
                                               int((truth == k).sum()), each) for k in without}
        table[margin] = {**per_label_accuracy(predicted, truth, labels), "taken_bound": bounds}
        if all(b <= tolerance for b in bounds.values()) and (best is None or table[margin]["all"] >= best[0]):
            best = (table[margin]["all"], margin)
    return (best[1] if best is not None else NEVER), table
