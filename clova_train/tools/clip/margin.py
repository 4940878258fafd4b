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

from clova_train.tools.operating_point import (  # noqa: F401 (the rule's constants and bounds, re-exported)
    CONFIDENCE, MARGINS, NEVER, TOLERANCE, choose_operating_point, images_needed, label_confidence, taken_share_bound,
)


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


def choose_margin(server, images: torch.Tensor, truth: torch.Tensor, labels: Sequence[str],
                  tolerance: float = TOLERANCE, margins: Sequence[float] = MARGINS,
                  confidence: float = CONFIDENCE) -> tuple[float, dict]:
    """The margin chosen on these validation images (module docstring;
    :func:`~clova_train.tools.operating_point.choose_operating_point` with the labels without prompts as the protected
    groups) and, per margin (``NEVER`` included), the per-label accuracies with, under ``"taken_bound"``, each label
    without prompts' upper bound on the share taken away (``"unmodified"``: the tool without its pool)."""
    with torch.no_grad():
        forwards = classify_forwards(server, images, labels)
    unmodified = forwards.unprompted.argmax(-1)
    without = {labels[k]: truth == k for k in range(len(labels))
               if k not in forwards.prompted and bool((truth == k).any())}
    predicted: dict[float, torch.Tensor] = {}

    def served_right_at(margin: float) -> torch.Tensor:
        predicted[margin] = decide(server.tool, forwards, margin)
        return predicted[margin] == truth

    margin, bounds = choose_operating_point(unmodified == truth, without, served_right_at, margins, tolerance,
                                            confidence)
    table: dict = {"unmodified": per_label_accuracy(unmodified, truth, labels)}
    for m, entry in bounds.items():
        table[m] = {**per_label_accuracy(predicted[m], truth, labels), "taken_bound": entry["taken_bound"]}
    return margin, table
