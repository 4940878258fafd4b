"""Choosing CLASSIFY's ``classify_margin`` on validation images, so that labels without prompts keep their accuracy.

A CLIP prompt pool can correct a concept the tool gets wrong and, on the same images' look-alikes, take images
that the unmodified tool classified right (purple prompts pulling blue images to purple). ``classify_margin``
(:class:`~clova_train.tools.clip.PromptedClip`) sets how much surer the prompted forward must be than the
unmodified one before it takes an image. :func:`choose_margin` scores a grid of margins on labelled validation
images (never the test images) and returns the one with the best accuracy among those under which no label
without prompts loses more than ``tolerance`` against the unmodified tool (the largest margin when none does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MARGINS = tuple(round(0.05 * k, 2) for k in range(11))  # 0.0, 0.05, ..., 0.5
TOLERANCE = 0.02


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
    unprompted_logits = tool.logit_scale * base @ text.T
    prompted = {}
    for k, label in enumerate(labels):
        prompts = lookup.prompts_for(label, base)
        if prompts is None:
            continue
        probabilities = unprompted_logits.softmax(-1).clone()
        rows = prompts.flatten(1).abs().amax(1) > 0
        if bool(rows.any()):
            features = tool.encode_tokens(tokens[rows], prompts[rows])
            probabilities[rows] = (tool.logit_scale * features @ text.T).softmax(-1).to(probabilities.dtype)
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
                  tolerance: float = TOLERANCE, margins: Sequence[float] = MARGINS) -> tuple[float, dict]:
    """The margin chosen on these validation images (module docstring) and, per margin, the per-label accuracies
    (``"unmodified"``: the tool without its pool)."""
    with torch.no_grad():
        forwards = classify_forwards(server, images, labels)
    table = {"unmodified": per_label_accuracy(forwards.unprompted.argmax(-1), truth, labels)}
    without = [labels[k] for k in range(len(labels)) if k not in forwards.prompted and labels[k] in table["unmodified"]]
    best: tuple[float, float] | None = None
    for margin in margins:
        scores = per_label_accuracy(decide(server.tool, forwards, margin), truth, labels)
        table[margin] = scores
        keeps = all(scores[name] >= table["unmodified"][name] - tolerance for name in without)
        if keeps and (best is None or scores["all"] > best[0]):
            best = (scores["all"], margin)
    return (best[1] if best is not None else max(margins)), table
