"""OWL-ViT (transformers' ``OwlViTForObjectDetection``) as the LOC prompt tool (CLOVA supp. 9.2).

Where the prompt enters: ``num_prompt_tokens`` vectors (paper: 100 x 768, the vision width) are appended to
the vision encoder's input after its pre-layernorm and removed from its output, so the box and class heads
see exactly the original class token and patch tokens. A prompt token that is exactly zero is masked out of
attention: a zero prompt, and no prompt, are the unmodified detector.

Queries per image: the concept, one other category present in the image and ``num_negatives`` (paper: 13)
category names known to be absent, chosen with a generator seeded by the instance id. Text embeddings are
prompt-independent and computed once per chunk.

Loss: OWL-ViT's own (``detection_losses``): Hungarian matching, sigmoid focal classification loss, L1 and
GIoU box losses. Adam 5e-4, up to 100 steps.

Gate (paper): on the training image every positive query is detected (some patch whose best query it is
scores >= ``score_threshold``, 0.1) and the mean IoU of the positive ground-truth boxes with their best
detection exceeds ``gate_iou`` (0.6); on each held-out image of the instance, the same for the concept's
boxes (the other classes there are not what the prompt was tuned for).

Pool feature: the image's class embedding (the vision model's pooled, post-layernorm class token, without
prompt). Serving (paper): the concept's stored prompts are the candidates; each runs on the query image and
only those under which the concept scores above ``score_threshold`` are kept, then ensembled with cosine
weights; if none is kept the detector runs unmodified.

Serving rule (``detection_margin``): applying a prompt can cost images the unmodified detector already found (its box
moves or its score drops under the threshold; random prompts cost the same). With ``detection_margin`` set, the
unmodified detector also runs on every image the pool prompts, and the prompted detections are served only where
their confidence (the best score among the concept's detections, 0 when there are none) beats the unmodified one's by
more than the margin; else the unmodified detections are. ``None`` is the paper's rule (the prompted detections
whenever a prompt is kept). The margin is chosen on validation images by the rule every tool shares
(:mod:`clova_train.tools.loc.margin`, :mod:`clova_train.tools.operating_point`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torchvision.ops import box_convert, nms

from clova_train.core.errors import DataError, ModelError
from clova_train.core.pool import ensemble_prompt
from clova_train.tools.base import NoPrompt, PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection
from clova_train.tools.loc.detection_losses import BoxTargets, detection_losses
from clova_train.tools.grounding.instances import (
    GroundedImage, GroundingInstance, best_box_iou, gate_results, instance_rng, prompts_of_views, queries_for,
)
from clova_train.tools.operating_point import check_margin
from clova_train.tools.pretrained import load_pretrained, processed_pixels, weights_fingerprint

DEFAULT_MODEL = "google/owlvit-base-patch32"
SERVED_QUERIES_KEPT = 512  # query lists whose text embeddings detect() keeps
CANDIDATE_ROWS = 64  # (image, stored prompt) pairs whose forwards serving runs together


@dataclass
class DetectionViews:
    """Images prepared for prompted detection (everything that does not depend on the prompt)."""

    embedded: torch.Tensor  # [m, 1 + P, D] vision tokens after the pre-layernorm
    queries: torch.Tensor  # [m, Q, Dt] query embeddings, padded
    query_mask: torch.Tensor  # [m, Q] True for real queries
    query_ids: torch.Tensor  # [m * Q, T] token ids (all-zero rows for padding: the library's convention)
    query_attention: torch.Tensor  # [m * Q, T]
    pixel_values: torch.Tensor  # [m, 3, S, S]
    names: list[list[str]]
    positives: list[int]  # positive queries per view (the first ones)
    targets: list[BoxTargets]  # normalised cxcywh boxes, labels index the view's queries
    boxes: list[torch.Tensor]  # [t, 4] xyxy pixels of the same objects
    sizes: list[tuple[int, int]]
    sources: list[str]
    owner: torch.Tensor  # [m] the instance (prompt row) of each view


@dataclass
class LocChunk:
    """Prompt-independent tensors of one chunk: training views (one per instance) and held-out views."""

    features: torch.Tensor  # [n, Dv]
    train: DetectionViews
    val: DetectionViews | None


def detection_confidence(detections: dict[str, Any]) -> float:
    """The confidence of one image's detections of a concept: the best box score, 0 when there is no box."""
    return max(detections["scores"], default=0.0)


def served_prompted(prompted_confidence: float, plain_confidence: float, margin: float) -> bool:
    """``detection_margin``'s rule: the prompted detections are served when surer by more than ``margin``."""
    return prompted_confidence - plain_confidence > margin


class OwlVitLoc(PromptTool):
    """A frozen OWL-ViT detector whose vision encoder also attends to a learned prompt (LOC tool).

    Args:
        model_name: a hub id (``google/owlvit-base-patch32``) or a local directory with an
            ``OwlViTForObjectDetection`` checkpoint and its processor, loaded with ``from_pretrained``.
        num_prompt_tokens: prompt vectors appended to the vision encoder's input (paper: 100).
        num_negatives: absent category names queried per image besides the positives (paper: 13).
        score_threshold: a box is a detection when its query's sigmoid score reaches this (paper: 0.1).
        gate_iou: the gate's mean IoU with the ground truth must exceed this (paper: 0.6).
        max_candidates: serving runs at most this many of the concept's stored prompts (the most similar
            by image feature) before filtering by confidence; ``None``: all of them (paper).
        nms_iou: served boxes overlapping a higher-scoring box of the concept by more than this IoU are
            dropped (torchvision's non-maximum suppression; OWL-ViT predicts one box per patch, so one object
            is found by several neighbouring patches); 1 keeps every box. The gate does not use it.
        detection_margin: the serving rule (module docstring): ``None``, the prompted detections whenever the pool
            keeps a prompt (paper); a number in [0, 1], they are served only where their best score beats the
            unmodified detector's by more than it (1: never). Chosen on validation images by
            :mod:`clova_train.tools.loc.margin`, which writes it into the export.
    """

    name: ClassVar[str] = "owlvit_loc"
    serving_rule: ClassVar[str | None] = (
        "CLOVA's LOC ensemble: of the concept's stored prompts (the max_candidates most similar to the image, when set), "
        "only those under which the frozen detector finds the concept in the image (a box scoring above "
        "score_threshold) are kept, and the cosine-weighted ensemble below runs over them; with none kept, the "
        "unmodified detector answers. The filter needs the detector: `clova-train serve` applies it. With "
        "detection_margin set, the prompted detections are served only where their best score beats the unmodified "
        "detector's by more than the margin.")
    default_lr: ClassVar[float] = 5e-4
    default_steps: ClassVar[int] = 100
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("detected_no_prompt", "detected_pool")
    served_operations: ClassVar[tuple[str, ...]] = ("detect",)

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        num_prompt_tokens: int = 100,
        num_negatives: int = 13,
        score_threshold: float = 0.1,
        gate_iou: float = 0.6,
        max_candidates: int | None = None,
        nms_iou: float = 0.5,
        detection_margin: float | None = None,
    ) -> None:
        super().__init__()
        from transformers import OwlViTForObjectDetection, OwlViTProcessor

        if num_prompt_tokens < 1:
            raise ModelError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if num_negatives < 0:
            raise ModelError(f"num_negatives must be >= 0, got {num_negatives}")
        if not 0 < score_threshold < 1 or not 0 < gate_iou < 1:
            raise ModelError(f"score_threshold and gate_iou must be in (0, 1), got {score_threshold}, {gate_iou}")
        if max_candidates is not None and max_candidates < 1:
            raise ModelError(f"max_candidates must be >= 1 or null, got {max_candidates}")
        if not 0 < nms_iou <= 1:
            raise ModelError(f"nms_iou must be in (0, 1], got {nms_iou}")
        self.nms_iou = nms_iou
        self.detection_margin = check_margin("detection_margin", detection_margin, optional=True)
        self.model_name, self.num_prompt_tokens, self.num_negatives = model_name, num_prompt_tokens, num_negatives
        self.score_threshold, self.gate_iou, self.max_candidates = score_threshold, gate_iou, max_candidates
        model, self.processor = load_pretrained(OwlViTForObjectDetection, OwlViTProcessor, model_name, "OWL-ViT")
        self.model = self.freeze(model)
        self.width = int(model.config.vision_config.hidden_size)
        self.max_text_length = int(model.config.text_config.max_position_embeddings)
        self.identity = self._fingerprint()
        self._served_queries: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    # ------------------------------------------------------------------ description
    @property
    def prompt_shape(self) -> tuple[int, int]:
        return (self.num_prompt_tokens, self.width)

    @property
    def feature_dim(self) -> int:
        return self.width

    def init_args(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "num_prompt_tokens": self.num_prompt_tokens,
                "num_negatives": self.num_negatives, "score_threshold": self.score_threshold,
                "gate_iou": self.gate_iou, "max_candidates": self.max_candidates, "nms_iou": self.nms_iou,
                "detection_margin": self.detection_margin}

    def init_scale(self) -> float:
        """Prompts start small (uniform in +-0.02) next to layer-normalised tokens: close to the unmodified tool."""
        return 0.02

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """The vision encoder's layers, which the prompt tokens run through."""
        return list(self.model.owlvit.vision_model.encoder.layers)

    def _fingerprint(self) -> str:
        probes = ("owlvit.vision_model.embeddings.class_embedding", "owlvit.vision_model.post_layernorm.weight",
                  "box_head.dense2.weight", "class_head.dense0.weight", "owlvit.text_projection.weight")
        return weights_fingerprint("owlvit_loc", self.model, probes, len(self.processor.tokenizer))

    # ------------------------------------------------------------------ prompt-independent parts
    def pixel_values(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        return processed_pixels(self.processor.image_processor, images, self.device)

    def embed_tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        vision = self.model.owlvit.vision_model
        return vision.pre_layernorm(vision.embeddings(pixel_values))

    def image_features(self, embedded: torch.Tensor) -> torch.Tensor:
        """The pool feature of images embedded by :meth:`embed_tokens`: the vision model's pooled output
        (post-layernormed class token), without prompt."""
        vision = self.model.owlvit.vision_model
        return vision.post_layernorm(vision.encoder(inputs_embeds=embedded).last_hidden_state[:, 0])

    def tokenize_queries(self, names: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids ``[m * Q, T]``, attention ``[m * Q, T]``, mask ``[m, Q]``), padded queries all-zero ids."""
        width = max(len(row) for row in names)
        flat = [name for row in names for name in row]
        tokens = self.processor.tokenizer(flat, padding="max_length", max_length=self.max_text_length,
                                          truncation=True, return_tensors="pt")
        ids = torch.zeros(len(names) * width, self.max_text_length, dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros(len(names), width, dtype=torch.bool)
        k = 0
        for i, row in enumerate(names):
            for j in range(len(row)):
                ids[i * width + j], attention[i * width + j] = tokens["input_ids"][k], tokens["attention_mask"][k]
                mask[i, j] = True
                k += 1
        return ids.to(self.device), attention.to(self.device), mask.to(self.device)

    def embed_queries(self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        text = self.model.owlvit.get_text_features(input_ids=ids, attention_mask=attention).pooler_output
        return text.reshape(*mask.shape, -1)

    def views(self, images: Sequence[GroundedImage], names: list[list[str]], positives: list[int],
              owner: Sequence[int]) -> DetectionViews:
        pixel_values = self.pixel_values([item.image for item in images])
        ids, attention, mask = self.tokenize_queries(names)
        targets, boxes = [], []
        for item, row in zip(images, names):
            keep = [i for i, label in enumerate(item.labels) if label in row]
            xyxy = item.boxes[keep].float()
            height, width = item.size
            scale = torch.tensor([width, height, width, height], dtype=torch.float, device=xyxy.device)
            targets.append(BoxTargets(torch.tensor([row.index(item.labels[i]) for i in keep], dtype=torch.long),
                                      box_convert(xyxy / scale, "xyxy", "cxcywh")))
            boxes.append(xyxy)
        return DetectionViews(
            self.embed_tokens(pixel_values), self.embed_queries(ids, attention, mask), mask, ids, attention,
            pixel_values, names, positives, targets, boxes, [item.size for item in images],
            [item.source for item in images], torch.as_tensor(list(owner), dtype=torch.long),
        )

    def check_instance(self, instance: GroundingInstance) -> None:
        for image in (instance.train, *instance.val):
            if not len(image.objects_of(instance.concept)):
                raise DataError(f"{image.source}: no object of {instance.concept!r} in this image")

    # ------------------------------------------------------------------ the prompted detector
    def detect_tokens(self, embedded: torch.Tensor, prompts: torch.Tensor | None, queries: torch.Tensor,
                      query_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits ``[m, P, Q]``, boxes ``[m, P, 4]`` cxcywh) with ``prompts`` ``[m, K, D]`` (or none)."""
        vision = self.model.owlvit.vision_model
        tokens, attention = embedded, None
        length = embedded.shape[1]
        if prompts is not None:
            expected = (embedded.shape[0], *self.prompt_shape)
            if tuple(prompts.shape) != expected:
                raise ModelError(f"prompts have shape {tuple(prompts.shape)}, expected {expected}")
            prompts = prompts.to(embedded.dtype)
            tokens = torch.cat([embedded, prompts], 1)
            absent = (prompts == 0).all(-1)  # an all-zero token is no token
            if bool(absent.any()):
                keys = torch.cat([torch.zeros_like(embedded[..., 0], dtype=torch.bool), absent], 1)
                attention = torch.zeros(keys.shape, dtype=embedded.dtype, device=embedded.device)
                attention = attention.masked_fill(keys, torch.finfo(embedded.dtype).min)[:, None, None, :]
        hidden = vision.encoder(inputs_embeds=tokens, attention_mask=attention).last_hidden_state[:, :length]
        hidden = vision.post_layernorm(hidden)
        merged = self.model.layer_norm(hidden[:, 1:] * hidden[:, :1])
        side = int(round(merged.shape[1] ** 0.5))
        feature_map = merged.reshape(merged.shape[0], side, side, merged.shape[-1])
        logits = self.model.class_predictor(merged, queries, query_mask)[0]
        boxes = self.model.box_predictor(merged, feature_map)
        return logits, boxes

    def detect_views(self, views: DetectionViews, prompts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.detect_tokens(views.embedded, prompts_of_views(views.owner, prompts), views.queries, views.query_mask)

    def _detections(self, logits: torch.Tensor, boxes: torch.Tensor, mask: torch.Tensor, size: tuple[int, int],
                    query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel xyxy boxes, scores) of one view's detections of ``query``: best query and score >= threshold."""
        scores = logits.float().sigmoid().masked_fill(~mask[None], 0.0)
        best = scores.argmax(-1)
        keep = (best == query) & (scores[:, query] >= self.score_threshold)
        height, width = size
        scale = torch.tensor([width, height, width, height], dtype=torch.float, device=boxes.device)
        found = box_convert(boxes[keep].float(), "cxcywh", "xyxy") * scale
        return torch.minimum(found.clamp_min(0), scale), scores[keep, query]

    def _judge(self, views: DetectionViews, prompts: torch.Tensor | None, all_positives: bool) -> list[list[Rejection]]:
        logits, boxes = self.detect_views(views, prompts)
        verdicts = []
        for v in range(len(views.names)):
            positives = range(views.positives[v] if all_positives else 1)
            problems, ious = [], []
            for q in positives:
                found, _ = self._detections(logits[v], boxes[v], views.query_mask[v], views.sizes[v], q)
                objects = views.targets[v].labels == q
                if not len(found):
                    problems.append(Rejection("not detected", f"{views.names[v][q]!r} in {views.sources[v]}"))
                ious.append(best_box_iou(found.cpu(), views.boxes[v][objects]))
            mean_iou = float(torch.cat(ious).mean()) if ious else 0.0
            if not problems and mean_iou <= self.gate_iou:
                problems.append(Rejection("low IoU", f"mean IoU {mean_iou:.2f} <= {self.gate_iou} in {views.sources[v]}"))
            verdicts.append(problems)
        return verdicts

    # ------------------------------------------------------------------ training hooks
    def _queried_views(self, instances: Sequence[GroundingInstance], held_out: bool) -> DetectionViews | None:
        """Views of the instances' training images (or of their held-out images), each with its queries."""
        images, names, positives, owners = [], [], [], []
        for i, item in enumerate(instances):
            chosen = [(f"val{j}", image) for j, image in enumerate(item.val)] if held_out else [("train", item.train)]
            for purpose, image in chosen:
                row, count = queries_for(image, item.concept, self.num_negatives, instance_rng(item.instance_id, purpose))
                images.append(image)
                names.append(row)
                positives.append(count)
                owners.append(i)
        return self.views(images, names, positives, owners) if images else None

    def prepare(self, instances: Sequence[GroundingInstance]) -> LocChunk:
        train = self._queried_views(instances, held_out=False)
        return LocChunk(self.image_features(train.embedded), train, self._queried_views(instances, held_out=True))

    def instance_losses(self, ctx: LocChunk, prompts: torch.Tensor) -> torch.Tensor:
        logits, boxes = self.detect_views(ctx.train, prompts)
        return detection_losses(logits, boxes, ctx.train.query_mask, ctx.train.targets)

    def gate(self, ctx: LocChunk, prompts: torch.Tensor) -> list[GateResult]:
        held_out = None if ctx.val is None else self._judge(ctx.val, prompts, all_positives=False)
        return gate_results(self._judge(ctx.train, prompts, all_positives=True), held_out,
                            None if ctx.val is None else ctx.val.owner)

    def pool_features(self, ctx: LocChunk) -> torch.Tensor:
        return ctx.features

    def unmodified_outputs(self, ctx: LocChunk) -> torch.Tensor:
        """OWL-ViT's own forward on the training views: sigmoid scores and boxes."""
        views = ctx.train
        out = self.model(input_ids=views.query_ids, attention_mask=views.query_attention, pixel_values=views.pixel_values)
        return torch.cat([out.logits.float().sigmoid().flatten(1), out.pred_boxes.flatten(1)], 1)

    def prompted_outputs(self, ctx: LocChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        logits, boxes = self.detect_views(ctx.train, prompts)
        return torch.cat([logits.float().sigmoid().flatten(1), boxes.flatten(1)], 1)

    # ------------------------------------------------------------------ serving
    def prompts_for_images(self, lookup: PromptLookup, concept: str, embedded: torch.Tensor, features: torch.Tensor,
                           queries: torch.Tensor, query_mask: torch.Tensor) -> list[torch.Tensor | None]:
        """The paper's LOC ensemble for each of ``n`` images (``embedded`` ``[n, T, D]``, ``features`` ``[n, D]``,
        ``queries`` ``[1, Q, Dt]``): keep the concept's stored prompts under which it is detected in the image (score
        above the threshold), ensemble those by cosine; ``None`` for an image where none is kept. The candidate
        forwards of all the images run together, :data:`CANDIDATE_ROWS` at a time."""
        stored = lookup.candidates(concept)
        if stored is None:
            return [None] * len(embedded)
        features_stored, prompts = stored
        chosen = []  # per image: indices of its candidates
        for feature in features:
            if self.max_candidates is not None and len(prompts) > self.max_candidates:
                similarity = F.cosine_similarity(features_stored, feature.cpu()[None].float(), dim=-1)
                chosen.append(similarity.topk(self.max_candidates).indices)
            else:
                chosen.append(torch.arange(len(prompts)))
        rows = [(i, int(j)) for i, indices in enumerate(chosen) for j in indices]
        confident = []
        for start in range(0, len(rows), CANDIDATE_ROWS):
            part = rows[start:start + CANDIDATE_ROWS]
            images = torch.tensor([i for i, _ in part])
            candidates = prompts[torch.tensor([j for _, j in part])].to(embedded)
            logits, _ = self.detect_tokens(embedded[images.to(embedded.device)], candidates,
                                           queries.expand(len(part), -1, -1), query_mask.expand(len(part), -1))
            confident.append((logits[..., 0].float().sigmoid().amax(-1) > self.score_threshold).cpu())
        kept = torch.cat(confident) if confident else torch.zeros(0, dtype=torch.bool)
        results: list[torch.Tensor | None] = []
        offset = 0
        for feature, indices in zip(features, chosen):
            keep = kept[offset:offset + len(indices)]
            offset += len(indices)
            if not bool(keep.any()):
                results.append(None)
                continue
            indices = indices[keep]
            results.append(ensemble_prompt(feature.cpu().float(), features_stored[indices], prompts[indices]).to(embedded))
        return results

    def detect(self, lookup: PromptLookup, images: Sequence[torch.Tensor], concept: str,
               other_queries: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Boxes of ``concept`` in each image (``[3, H, W]`` uint8), with the pool's prompt for it.

        Returns, per image, ``{"boxes": [[x0, y0, x1, y1], ...] (pixels), "scores": [...], "prompted": bool}``,
        boxes after non-maximum suppression, best first; ``prompted``: the prompted detections were served (the pool
        kept a prompt and, with ``detection_margin`` set, they beat the unmodified ones by more than it).
        ``other_queries`` compete with the concept for each box (a box is the concept's when it is its best query).
        """
        served = []
        for plain, prompted in self.both_detections(lookup, images, concept, other_queries,
                                                    plain_needed=self.detection_margin is not None):
            if prompted is not None and (self.detection_margin is None or served_prompted(
                    detection_confidence(prompted), detection_confidence(plain), self.detection_margin)):
                served.append({**prompted, "prompted": True})
            else:
                served.append({**plain, "prompted": False})
        return served

    def both_detections(self, lookup: PromptLookup, images: Sequence[torch.Tensor], concept: str,
                        other_queries: Sequence[str] = (), plain_needed: bool = True
                        ) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
        """Per image, the unmodified detections and the prompted ones (``None`` when the pool keeps no prompt for the
        image), each ``{"boxes", "scores"}`` as :meth:`detect` gives them. ``plain_needed`` False skips the
        unmodified forward on images the pool prompts (``None`` in their place). The images run together."""
        if not images or not isinstance(concept, str) or not concept.strip():
            raise DataError("detect needs at least one image and a concept name")
        queries, mask = self._query_embeddings([concept, *other_queries])
        sizes = [(int(image.shape[1]), int(image.shape[2])) for image in images]
        embedded = self.embed_tokens(self.pixel_values(list(images)))
        prompts = self.prompts_for_images(lookup, concept, embedded, self.image_features(embedded), queries, mask)
        prompted_rows = [i for i, prompt in enumerate(prompts) if prompt is not None]
        plain_rows = [i for i, prompt in enumerate(prompts) if prompt is None or plain_needed]
        prompted = self._served_boxes(embedded, prompted_rows, torch.stack([prompts[i] for i in prompted_rows])
                                      if prompted_rows else None, queries, mask, sizes)
        plain = self._served_boxes(embedded, plain_rows, None, queries, mask, sizes)
        return [(plain.get(i), prompted.get(i)) for i in range(len(images))]

    def _served_boxes(self, embedded: torch.Tensor, rows: list[int], prompts: torch.Tensor | None,
                      queries: torch.Tensor, mask: torch.Tensor, sizes: list[tuple[int, int]]
                      ) -> dict[int, dict[str, Any]]:
        """``{row: {"boxes", "scores"}}`` of the images ``rows`` of ``embedded``, with ``prompts`` (one per row) or
        none; boxes after non-maximum suppression, best first."""
        if not rows:
            return {}
        index = torch.tensor(rows, device=embedded.device)
        logits, boxes = self.detect_tokens(embedded[index], prompts, queries.expand(len(rows), -1, -1),
                                           mask.expand(len(rows), -1))
        served = {}
        for k, row in enumerate(rows):
            found, scores = self._detections(logits[k], boxes[k], mask[0], sizes[row], 0)
            order = nms(found, scores, self.nms_iou) if self.nms_iou < 1 else scores.argsort(descending=True)
            served[row] = {"boxes": found[order].tolist(), "scores": scores[order].tolist()}
        return served

    def _query_embeddings(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries ``[1, Q, D]``, mask ``[1, Q]``) of ``names``, remembered for the last
        :data:`SERVED_QUERIES_KEPT` lists: the text encoder is frozen and prompts only enter the image side, so a
        served detector asked for the same names again (an agent's programs ask for "red circle" over and over)
        skips the text encoder."""
        device_type = self.device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        key = (str(self.device), autocast, *names)
        found = self._served_queries.get(key)
        if found is None:
            ids, attention, mask = self.tokenize_queries([names])
            found = self._served_queries[key] = (self.embed_queries(ids, attention, mask).detach(), mask)
            if len(self._served_queries) > SERVED_QUERIES_KEPT:
                self._served_queries.popitem(last=False)
        else:
            self._served_queries.move_to_end(key)
        return found

    def evaluate(self, lookup: PromptLookup, batch: list[tuple[GroundedImage, str]]) -> dict[str, torch.Tensor]:
        """Per image, whether the concept is detected with mean IoU above ``gate_iou`` (without / with the pool)."""
        values: dict[str, list[float]] = {"detected_no_prompt": [], "detected_pool": []}
        for key, source in (("detected_no_prompt", NoPrompt()), ("detected_pool", lookup)):
            for image, concept in batch:
                values[key].append(float(self.found(self.detect(source, [image.image], concept)[0], image, concept)))
        return {k: torch.tensor(v) for k, v in values.items()}

    def found(self, detections: dict[str, Any], image: GroundedImage, concept: str) -> bool:
        """Whether ``detections`` (:meth:`detect`'s output for ``image``) find ``concept``: some box, and the
        concept's ground-truth boxes matched at mean best IoU above ``gate_iou`` (the evaluation metric)."""
        iou = best_box_iou(torch.tensor(detections["boxes"]).reshape(-1, 4), image.boxes[image.objects_of(concept)])
        return bool(detections["boxes"]) and float(iou.mean()) > self.gate_iou

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"image": path, "concept": name, "other_queries": [names]}`` -> ``{"boxes", "scores", "prompted"}``."""
        from clova_train.tools.images import load_image_uint8

        image, concept = request.get("image"), request.get("concept")
        others = request.get("other_queries", [])
        if not isinstance(image, str) or not image:
            raise DataError("a LOC request needs 'image': a path")
        if not isinstance(concept, str) or not concept.strip():
            raise DataError("a LOC request needs 'concept': a non-empty string")
        if not isinstance(others, list) or not all(isinstance(o, str) for o in others):
            raise DataError("'other_queries' must be a list of strings")
        return self.detect(lookup, [load_image_uint8(Path(image))], concept, others)[0]
