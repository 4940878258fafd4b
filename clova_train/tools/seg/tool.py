"""MaskFormer (transformers' ``MaskFormerForInstanceSegmentation``) as the SEG prompt tool (CLOVA supp. 9.3).

Where the prompt enters: ``num_prompt_tokens`` vectors (paper: 100 x 256, the decoder width) are appended
to the transformer decoder's memory, the projected backbone features its queries cross-attend to. Prompt
tokens get a zero position embedding (they have no place in the image) and a prompt token that is exactly
zero is masked out of the cross-attention: a zero prompt, and no prompt, are the unmodified segmenter. The
pixel decoder, whose per-pixel embeddings the mask embeddings are multiplied with, never sees the prompt.

Loss (paper): MaskFormer's mask loss only (sigmoid focal x ``mask_weight`` + dice x ``dice_weight``, the
model's own weights), on the queries paired with the concept's ground-truth masks by the model's own
Hungarian matcher with its class cost removed (the concept need not be one of the model's classes).
Adam 1e-1, 100 steps.

Segments (what :meth:`segment` serves, and what the gate checks): every query whose object score (the
largest non-"no object" class probability) reaches ``object_threshold`` and whose mask (sigmoid >= 0.5,
at the image's size) is not empty.

Gate (the paper gives none): on the training image and on each held-out image of the instance, every
ground-truth mask of the concept is covered by a segment with mask IoU >= ``gate_iou`` (0.5). 0.5 is the
IoU at which COCO, LVIS and MaskFormer's own evaluation count a predicted mask as a true positive (AP50);
a looser threshold accepts masks that spill into the neighbours, a stricter one rejects masks whose only
fault is the decoder's stride-4 resolution at object borders. Checking served segments (not the matched
query alone) makes the gate reject a prompt whose mask would be filtered out before a user sees it.

Pool feature (paper): the average-pooled projected backbone feature (the decoder memory, 256 wide).
Serving (paper): the ``top_k`` (10) stored prompts of the concept most similar to the query image by
cosine are ensembled with cosine weights; a concept without prompts runs the unmodified segmenter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from clova_train.core.errors import DataError, ModelError
from clova_train.tools.base import NoPrompt, PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection
from clova_train.tools.grounding.instances import GroundedImage, GroundingInstance, gate_results, prompts_of_views
from clova_train.tools.pretrained import load_pretrained, processed_images, weights_fingerprint

DEFAULT_MODEL = "facebook/maskformer-swin-base-coco"


@dataclass
class SegmentationViews:
    """Images prepared for prompted segmentation (everything that does not depend on the prompt)."""

    memory: torch.Tensor  # [m, HW, D] projected backbone features (the decoder's memory)
    positions: torch.Tensor  # [m, HW, D] their sine position embeddings
    pixel_embeddings: torch.Tensor  # [m, C, h, w] the pixel decoder's output
    pixel_values: torch.Tensor  # [m, 3, H', W'] the processed images
    content: list[tuple[int, int]]  # the resized image inside the padded pixel frame (height, width)
    frame: tuple[int, int]  # the padded pixel frame (height, width)
    targets: list[torch.Tensor]  # [t, Hc, Wc] float ground-truth masks of the concept, in the content frame
    sources: list[str]
    owner: torch.Tensor  # [m] the instance (prompt row) of each view


@dataclass
class SegChunk:
    """Prompt-independent tensors of one chunk: training views (one per instance) and held-out views."""

    features: torch.Tensor  # [n, D]
    train: SegmentationViews
    val: SegmentationViews | None


def mask_iou(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """IoU of every target mask ``[t, H, W]`` with every predicted mask ``[p, H, W]`` (bool): ``[t, p]``."""
    predicted, target = predicted.flatten(1).float(), target.flatten(1).float()
    inter = target @ predicted.T
    union = target.sum(1, keepdim=True) + predicted.sum(1)[None] - inter
    return inter / union.clamp_min(1.0)


class MaskFormerSeg(PromptTool):
    """A frozen MaskFormer whose transformer decoder also attends to a learned prompt (SEG tool).

    Args:
        model_name: a hub id (``facebook/maskformer-swin-base-coco``) or a local directory with a
            ``MaskFormerForInstanceSegmentation`` checkpoint and its image processor (``from_pretrained``).
        num_prompt_tokens: prompt vectors appended to the decoder's memory (paper: 100).
        gate_iou: a ground-truth mask counts as segmented when a segment overlaps it with at least this IoU
            (0.5: the COCO / LVIS true-positive threshold; the paper gives none).
        object_threshold: a query is a segment when its largest non-"no object" class probability reaches
            this (0.5, transformers' instance-segmentation default); 0 keeps every non-empty query mask.
        top_k: serving ensembles the ``top_k`` stored prompts of the concept most similar to the query image
            (paper: 10).
    """

    name: ClassVar[str] = "maskformer_seg"
    default_lr: ClassVar[float] = 1e-1
    default_steps: ClassVar[int] = 100
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("segmented_no_prompt", "segmented_pool")
    served_operations: ClassVar[tuple[str, ...]] = ("segment",)

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        num_prompt_tokens: int = 100,
        gate_iou: float = 0.5,
        object_threshold: float = 0.5,
        top_k: int = 10,
    ) -> None:
        super().__init__()
        from transformers import MaskFormerForInstanceSegmentation, MaskFormerImageProcessor
        from transformers.models.maskformer.modeling_maskformer import MaskFormerHungarianMatcher

        if num_prompt_tokens < 1:
            raise ModelError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if not 0 < gate_iou < 1:
            raise ModelError(f"gate_iou must be in (0, 1), got {gate_iou}")
        if not 0 <= object_threshold < 1:
            raise ModelError(f"object_threshold must be in [0, 1), got {object_threshold}")
        if top_k < 1:
            raise ModelError(f"top_k must be >= 1, got {top_k}")
        self.model_name, self.num_prompt_tokens, self.gate_iou = model_name, num_prompt_tokens, gate_iou
        self.object_threshold, self.top_k = object_threshold, top_k
        model, self.processor = load_pretrained(
            MaskFormerForInstanceSegmentation, MaskFormerImageProcessor, model_name, "MaskFormer")
        self.model = self.freeze(model)
        config = model.config
        self.width = int(config.decoder_config.hidden_size if hasattr(config.decoder_config, "hidden_size")
                         else config.decoder_config.d_model)
        self.mask_weight, self.dice_weight = float(config.mask_weight), float(config.dice_weight)
        self.matcher = MaskFormerHungarianMatcher(cost_class=0.0, cost_mask=self.mask_weight, cost_dice=self.dice_weight)
        self.identity = self._fingerprint()

    # ------------------------------------------------------------------ description
    @property
    def prompt_shape(self) -> tuple[int, int]:
        return (self.num_prompt_tokens, self.width)

    @property
    def feature_dim(self) -> int:
        return self.width

    @property
    def serving_top_k(self) -> int:
        return self.top_k

    def init_args(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "num_prompt_tokens": self.num_prompt_tokens, "gate_iou": self.gate_iou,
                "object_threshold": self.object_threshold, "top_k": self.top_k}

    def init_scale(self) -> float:
        """Prompts start small (uniform in +-0.02): close to the unmodified tool."""
        return 0.02

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """The transformer decoder's layers, whose cross-attention reads the prompt (backbone and pixel decoder run
        once per chunk, without gradients)."""
        return list(self.model.model.transformer_module.decoder.layers)

    def _fingerprint(self) -> str:
        probes = ("model.transformer_module.queries_embedder.weight", "class_predictor.weight",
                  "model.transformer_module.decoder.layernorm.weight", "model.pixel_level_module.decoder.mask_projection.weight")
        return weights_fingerprint("maskformer_seg", self.model, probes, int(self.model.config.num_labels))

    # ------------------------------------------------------------------ prompt-independent parts
    def pixel_inputs(self, images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(``pixel_values`` ``[m, 3, H', W']``, the resized image's (height, width) inside that padded frame)."""
        processed = processed_images(self.processor, images)
        pixel_mask = processed["pixel_mask"].bool()
        content = [(int(m.any(1).sum()), int(m.any(0).sum())) for m in pixel_mask]
        return processed["pixel_values"].to(self.device), content

    def encode(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(memory ``[m, HW, D]``, its position embeddings, pixel embeddings ``[m, C, h, w]``) of processed images."""
        pixel_level = self.model.model.pixel_level_module(pixel_values)
        module = self.model.model.transformer_module
        features = pixel_level.encoder_last_hidden_state
        if module.input_projection is not None:
            features = module.input_projection(features)
        m, channels = features.shape[:2]
        positions = module.position_embedder(features.shape, features.device, features.dtype)
        return (features.flatten(2).transpose(1, 2), positions.reshape(m, channels, -1).transpose(1, 2),
                pixel_level.decoder_last_hidden_state)

    @staticmethod
    def image_features(memory: torch.Tensor) -> torch.Tensor:
        """The pool feature: the average-pooled decoder memory (projected backbone features)."""
        return memory.mean(1)

    def views(self, images: Sequence[GroundedImage], concept: str, owner: Sequence[int]) -> SegmentationViews:
        pixel_values, content = self.pixel_inputs([item.image for item in images])
        memory, positions, pixel_embeddings = self.encode(pixel_values)
        targets = []
        for item, size in zip(images, content):
            masks = item.masks[item.objects_of(concept)].float()[:, None]
            targets.append(F.interpolate(masks, size=size, mode="nearest")[:, 0].to(self.device))
        return SegmentationViews(memory, positions, pixel_embeddings, pixel_values, content, tuple(pixel_values.shape[-2:]), targets,
                                 [item.source for item in images], torch.as_tensor(list(owner), dtype=torch.long))

    def check_instance(self, instance: GroundingInstance) -> None:
        for image in (instance.train, *instance.val):
            objects = image.objects_of(instance.concept)
            if not len(objects):
                raise DataError(f"{image.source}: no object of {instance.concept!r} in this image")
            if not bool(image.masks[objects].flatten(1).any(1).all()):
                raise DataError(f"{image.source}: an object of {instance.concept!r} has a box but no mask "
                                "(SEG learns from segmentations)")

    # ------------------------------------------------------------------ the prompted segmenter
    def decode(self, memory: torch.Tensor, positions: torch.Tensor, pixel_embeddings: torch.Tensor,
               prompts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(class logits ``[m, Q, L + 1]``, mask logits ``[m, Q, h, w]``) with ``prompts`` ``[m, K, D]`` (or none)."""
        module = self.model.model.transformer_module
        m = memory.shape[0]
        keys, key_positions, key_mask = memory, positions, None
        if prompts is not None:
            expected = (m, *self.prompt_shape)
            if tuple(prompts.shape) != expected:
                raise ModelError(f"prompts have shape {tuple(prompts.shape)}, expected {expected}")
            prompts = prompts.to(memory.dtype)
            keys = torch.cat([memory, prompts], 1)
            key_positions = torch.cat([positions, torch.zeros_like(prompts)], 1)
            absent = (prompts == 0).all(-1)  # an all-zero token is no token
            if bool(absent.any()):
                key_mask = torch.cat([torch.ones_like(memory[..., 0], dtype=torch.long), (~absent).long()], 1)
        queries = module.queries_embedder.weight[None].expand(m, -1, -1)
        hidden = module.decoder(
            inputs_embeds=torch.zeros_like(queries), encoder_hidden_states=keys, encoder_attention_mask=key_mask,
            spatial_position_embeddings=key_positions, object_queries_position_embeddings=queries,
        ).last_hidden_state
        classes = self.model.class_predictor(hidden)
        masks = torch.einsum("bqc,bchw->bqhw", self.model.mask_embedder(hidden), pixel_embeddings)
        return classes, masks

    def decode_views(self, views: SegmentationViews, prompts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(views.memory, views.positions, views.pixel_embeddings, prompts_of_views(views.owner, prompts))

    def segments(self, classes: torch.Tensor, masks: torch.Tensor, frame: tuple[int, int], content: tuple[int, int],
                 size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool masks ``[s, H, W]``, object scores ``[s]``) of one image's segments.

        ``masks`` ``[Q, h, w]`` are upsampled to the padded pixel ``frame``, cropped to the ``content``, then
        resized to ``size`` (the original image) when given.
        """
        scores = classes.float().softmax(-1)[:, :-1].amax(-1)
        keep = scores >= self.object_threshold
        if not bool(keep.any()):
            height, width = size if size is not None else content
            return torch.zeros(0, height, width, dtype=torch.bool, device=masks.device), scores[keep]
        logits = F.interpolate(masks[keep][None].float(), size=frame, mode="bilinear", align_corners=False)[0]
        logits = logits[:, : content[0], : content[1]]
        if size is not None and tuple(size) != tuple(content):
            logits = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)[0]
        binary = logits.sigmoid() >= 0.5
        nonempty = binary.flatten(1).any(1)
        return binary[nonempty], scores[keep][nonempty]

    def _judge(self, views: SegmentationViews, prompts: torch.Tensor | None) -> list[list[Rejection]]:
        classes, masks = self.decode_views(views, prompts)
        verdicts = []
        for v in range(len(views.sources)):
            found, _ = self.segments(classes[v], masks[v], views.frame, views.content[v])
            target = views.targets[v] > 0.5
            best = mask_iou(found, target).amax(1) if len(found) else torch.zeros(len(target))
            problems = []
            if not bool((best >= self.gate_iou).all()):
                problems.append(Rejection("low mask IoU", f"best mask IoU {float(best.min()):.2f} < {self.gate_iou} "
                                                          f"in {views.sources[v]}"))
            verdicts.append(problems)
        return verdicts

    # ------------------------------------------------------------------ training hooks
    def _instance_views(self, instances: Sequence[GroundingInstance], held_out: bool) -> SegmentationViews | None:
        images, owners = [], []
        for i, item in enumerate(instances):
            for image in item.val if held_out else [item.train]:
                images.append(image)
                owners.append(i)
        if not images:
            return None
        concepts = {item.concept for item in instances}
        if len(concepts) != 1:  # one chunk holds one concept (the grounding datamodule's split)
            raise DataError(f"a SEG chunk mixes concepts {sorted(concepts)}")
        return self.views(images, instances[0].concept, owners)

    def prepare(self, instances: Sequence[GroundingInstance]) -> SegChunk:
        train = self._instance_views(instances, held_out=False)
        return SegChunk(self.image_features(train.memory), train, self._instance_views(instances, held_out=True))

    def instance_losses(self, ctx: SegChunk, prompts: torch.Tensor) -> torch.Tensor:
        """Per instance: MaskFormer's mask loss (focal x ``mask_weight`` + dice x ``dice_weight``) on the matched queries."""
        views = ctx.train
        classes, masks = self.decode_views(views, prompts)
        losses = []
        with self.full_precision():  # matching, focal and dice losses in float32, whatever the network's precision
            classes, masks = classes.float(), masks.float()
            for v, target in enumerate(views.targets):
                padded = masks.new_zeros(len(target), *views.frame)
                padded[:, : target.shape[1], : target.shape[2]] = target
                indices = self.matcher(masks[v : v + 1].detach(), classes[v : v + 1].detach(), [padded],
                                       [torch.zeros(len(target), dtype=torch.long, device=masks.device)])
                parts = self.model.criterion.loss_masks(masks[v : v + 1], [padded], indices, num_masks=len(target))
                losses.append(self.mask_weight * parts["loss_mask"] + self.dice_weight * parts["loss_dice"])
        return torch.stack(losses)

    def gate(self, ctx: SegChunk, prompts: torch.Tensor) -> list[GateResult]:
        held_out = None if ctx.val is None else self._judge(ctx.val, prompts)
        return gate_results(self._judge(ctx.train, prompts), held_out, None if ctx.val is None else ctx.val.owner)

    def pool_features(self, ctx: SegChunk) -> torch.Tensor:
        return ctx.features

    def unmodified_outputs(self, ctx: SegChunk) -> torch.Tensor:
        """MaskFormer's own forward on the training images: class probabilities and mask logits."""
        out = self.model(pixel_values=ctx.train.pixel_values)
        return torch.cat([out.class_queries_logits.float().softmax(-1).flatten(1), out.masks_queries_logits.flatten(1)], 1)

    def prompted_outputs(self, ctx: SegChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        classes, masks = self.decode_views(ctx.train, prompts)
        return torch.cat([classes.float().softmax(-1).flatten(1), masks.flatten(1)], 1)

    # ------------------------------------------------------------------ serving
    def segment(self, lookup: PromptLookup, images: Sequence[torch.Tensor], concept: str) -> list[dict[str, Any]]:
        """Segments of each image (``[3, H, W]`` uint8), with the pool's prompt for ``concept``.

        Returns, per image, ``{"masks": [H, W] bool tensor per segment, "scores": [...], "prompted": bool}``,
        segments in order of object score.
        """
        if not images or not isinstance(concept, str) or not concept.strip():
            raise DataError("segment needs at least one image and a concept name")
        results = []
        for image in images:
            pixel_values, content = self.pixel_inputs([image])
            memory, positions, pixel_embeddings = self.encode(pixel_values)
            prompt = lookup.prompts_for(concept, self.image_features(memory))
            classes, masks = self.decode(memory, positions, pixel_embeddings, None if prompt is None else prompt.to(memory))
            size = (int(image.shape[1]), int(image.shape[2]))
            found, scores = self.segments(classes[0], masks[0], tuple(pixel_values.shape[-2:]), content[0], size)
            order = scores.argsort(descending=True)
            results.append({"masks": found[order].cpu(), "scores": scores[order].tolist(), "prompted": prompt is not None})
        return results

    def evaluate(self, lookup: PromptLookup, batch: list[tuple[GroundedImage, str]]) -> dict[str, torch.Tensor]:
        """Per image, whether every mask of the concept is covered by a segment with IoU >= ``gate_iou``
        (without / with the pool)."""
        values: dict[str, list[float]] = {"segmented_no_prompt": [], "segmented_pool": []}
        for key, source in (("segmented_no_prompt", NoPrompt()), ("segmented_pool", lookup)):
            for image, concept in batch:
                found = self.segment(source, [image.image], concept)[0]["masks"]
                target = image.masks[image.objects_of(concept)]
                best = mask_iou(found, target).amax(1) if len(found) else torch.zeros(len(target))
                values[key].append(float(bool((best >= self.gate_iou).all())))
        return {k: torch.tensor(v) for k, v in values.items()}

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"image": path, "concept": name}`` -> ``{"segments": [{"box", "area", "rle", "score"}], "prompted"}``
        (each mask as COCO RLE, pycocotools' encoding)."""
        import numpy as np
        from pycocotools import mask as mask_utils

        from clova_train.tools.images import load_image_uint8

        image, concept = request.get("image"), request.get("concept")
        if not isinstance(image, str) or not image:
            raise DataError("a SEG request needs 'image': a path")
        if not isinstance(concept, str) or not concept.strip():
            raise DataError("a SEG request needs 'concept': a non-empty string")
        result = self.segment(lookup, [load_image_uint8(Path(image))], concept)[0]
        segments = []
        for mask, score in zip(result["masks"], result["scores"]):
            rle = mask_utils.encode(np.asfortranarray(mask.numpy().astype(np.uint8)))
            segments.append({"box": [float(v) for v in mask_utils.toBbox(rle)], "area": int(mask.sum()),
                             "rle": {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")},
                             "score": score})
        return {"segments": segments, "prompted": result["prompted"]}
