"""The tiny OWL-ViT detector (transformers), pretrained to detect named shapes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clova_train.synthetic.shapes import SHAPES
from clova_train.tools.tiny_common import clip_bpe_tokenizer, pretraining_steps, single_thread, warmup_cosine


def build_tiny_owlvit(image_size: int = 64, seed: int = 0, width: int = 64, layers: int = 3) -> tuple:
    """A random-weight ``OwlViTForObjectDetection`` of the real architecture and its ``OwlViTProcessor``.

    ViT with ``patch_size`` 8 (``(image_size / 8)^2`` box predictions), text transformer with CLIP's BPE
    vocabulary and 16 positions (the processor pads queries to 16, as the real one does).
    """
    import tempfile

    from transformers import OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = clip_bpe_tokenizer(scratch)
    torch.manual_seed(seed)
    config = OwlViTConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": width * 2,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"hidden_size": width, "intermediate_size": width * 2, "num_hidden_layers": layers,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": 8},
        projection_dim=width,
    )
    image_processor = OwlViTImageProcessor(size={"height": image_size, "width": image_size},
                                           crop_size={"height": image_size, "width": image_size})
    model = small_detection_heads(OwlViTForObjectDetection(config))
    return model.eval(), OwlViTProcessor(image_processor=image_processor, tokenizer=tokenizer)


def small_detection_heads(model: torch.nn.Module) -> torch.nn.Module:
    """Redraw an OWL-ViT's class and box heads with small weights and zero biases (in place; returns the model).

    transformers initialises the detection heads with unit-variance weights (real checkpoints overwrite them): from
    there the box head saturates at once. Small weights start every box at its patch.
    """
    for head in (model.class_head, model.box_head):
        for layer in head.modules():
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=0.02)
                torch.nn.init.zeros_(layer.bias)
    return model


# The tiny detectors learn every colour name, but purple and orange only from other shades than the ones
# the synthetic tasks render (a lavender purple, a brown orange): like a real detector facing an unfamiliar
# look of a concept it knows by name, they miss the task's purple and orange, and a prompt has something
# to teach.
GROUNDING_PRETRAIN_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")


GROUNDING_PRETRAIN_PALETTE = {"purple": (205, 160, 240), "orange": (140, 80, 35)}


def _grounding_batch(rng: np.random.Generator, size: int, image_size: int) -> list:
    from clova_train.tools.grounding.synthetic import random_scene

    return [random_scene(rng, image_size, None, list(GROUNDING_PRETRAIN_COLOURS), int(rng.integers(1, 3)),
                         palette=GROUNDING_PRETRAIN_PALETTE) for _ in range(size)]


def pretrain_owlvit(model: torch.nn.Module, processor: object, steps: int, batch_size: int = 32, seed: int = 0,
                    lr: float = 1e-3, log_every: int = 0) -> None:
    """Train every weight to detect the shapes of :data:`GROUNDING_PRETRAIN_COLOURS` by name (OWL-ViT losses,
    AdamW with warm-up and cosine decay). The query texts are embedded once per step, not once per image.
    Runs on one thread (see :func:`single_thread`)."""
    from clova_train.tools.grounding.synthetic import category_name

    rng = np.random.default_rng(seed)
    names = [category_name(c, s) for c in GROUNDING_PRETRAIN_COLOURS for s in SHAPES]
    image_size = model.config.vision_config.image_size
    text = processor.tokenizer(names, padding="max_length", max_length=16, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = warmup_cosine(optimizer, warmup=50, steps=steps)
    query_mask = torch.ones(batch_size, len(names), dtype=torch.bool)
    with single_thread():
        model.train()
        for step in pretraining_steps(steps, "OWL-ViT"):
            loss = _owlvit_step(model, processor, optimizer, schedule, rng, names, text, query_mask, batch_size,
                                image_size)
            if log_every and step % log_every == 0:
                print(f"owlvit pretrain step {step}: loss {loss:.3f}")
    model.eval()


def _owlvit_step(model: torch.nn.Module, processor: object, optimizer: torch.optim.Optimizer, schedule: object,
                 rng: np.random.Generator, names: list[str], text: dict, query_mask: torch.Tensor, batch_size: int,
                 image_size: int) -> float:
    from clova_train.tools.grounding.synthetic import scene_targets
    from torchvision.ops import box_convert

    from clova_train.tools.loc.detection_losses import BoxTargets, detection_losses

    scenes = _grounding_batch(rng, batch_size, image_size)
    pixels = processor.image_processor(images=[s.image for s in scenes], return_tensors="pt")["pixel_values"]
    targets = []
    for scene in scenes:
        labels, boxes, _ = scene_targets(scene, names)
        cxcywh = box_convert(torch.from_numpy(boxes) / image_size, "xyxy", "cxcywh")
        targets.append(BoxTargets(torch.tensor(labels, dtype=torch.long), cxcywh))
    queries = model.owlvit.get_text_features(**text).pooler_output
    feature_map = model.image_embedder(pixel_values=pixels)[0]
    features = feature_map.reshape(batch_size, -1, feature_map.shape[-1])
    logits = model.class_predictor(features, queries[None].expand(batch_size, -1, -1), query_mask)[0]
    loss = detection_losses(logits, model.box_predictor(features, feature_map), query_mask, targets).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return loss.detach().item()


def make_tiny_owlvit(directory: str | Path, seed: int = 0, pretrain_steps: int = 1500, image_size: int = 64) -> Path:
    """Write a tiny OWL-ViT detector and processor to ``directory`` (load with ``from_pretrained``)."""
    directory = Path(directory)
    model, processor = build_tiny_owlvit(image_size=image_size, seed=seed)
    if pretrain_steps:
        pretrain_owlvit(model, processor, pretrain_steps, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
