"""The tiny MaskFormer segmenter (transformers, Swin backbone), pretrained to segment shapes of four colours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clova_train.synthetic.shapes import SHAPES
from clova_train.tools.tiny_common import pretraining_steps, single_thread, warmup_cosine


# ---------------------------------------------------------------------- MaskFormer (SEG)
# The tiny segmenter is pretrained on scenes in which shapes of two colours also appear but are never
# annotated: like a closed-vocabulary segmenter facing an LVIS-only category, it learned to leave them in
# the background (a mask-only prompt cannot undo that: the gate rejects those prompts). It segments the
# shapes of the annotated colours, not always well: a prompt has something to fix there.
# Six queries for scenes of one to three objects. With sixteen, most queries were idle and painted arbitrary
# masks; a random prompt scrambled them into new masks, and the best of those matched the object as often as
# a learned prompt's did. A random-prompt control could not tell learning apart from noise. With six queries,
# a random prompt loses objects and a learned pool gains where the model is weak (the SEG quickstart, 80
# held-out images: red circles 0.70 segmented unprompted, 0.69 with random prompts, 0.84 with the pool).
SEGMENTATION_PRETRAIN_COLOURS = ("red", "green", "blue", "yellow")


SEGMENTATION_UNANNOTATED_COLOURS = ("purple", "orange")


def build_tiny_maskformer(image_size: int = 64, seed: int = 0, width: int = 32, num_queries: int = 6) -> tuple:
    """A random-weight ``MaskFormerForInstanceSegmentation`` (tiny Swin backbone) and its image processor.

    Classes are the ``"<colour> <shape>"`` names of :data:`SEGMENTATION_PRETRAIN_COLOURS`; the decoder is
    ``width`` wide (the real model: 256), masks come out at stride 4 like the real model's.
    """
    from transformers import DetrConfig, MaskFormerConfig, MaskFormerForInstanceSegmentation, MaskFormerImageProcessor, SwinConfig

    from clova_train.tools.grounding.synthetic import category_name

    names = [category_name(c, s) for c in SEGMENTATION_PRETRAIN_COLOURS for s in SHAPES]
    torch.manual_seed(seed)
    config = MaskFormerConfig(
        backbone_config=SwinConfig(image_size=image_size, patch_size=4, embed_dim=24, depths=[1, 1, 1, 1],
                                   num_heads=[1, 2, 2, 4], window_size=4,
                                   out_features=["stage1", "stage2", "stage3", "stage4"]),
        decoder_config=DetrConfig(d_model=width, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                                  num_queries=num_queries),
        fpn_feature_size=width, mask_feature_size=width, num_labels=len(names),
        id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)},
    )
    processor = MaskFormerImageProcessor(size={"height": image_size, "width": image_size}, size_divisor=32)
    model = MaskFormerForInstanceSegmentation(config)
    # transformers draws the query embeddings with std 0.02 (real checkpoints overwrite them): near-identical
    # queries then learn one and the same mask. DETR's unit-variance queries start them apart.
    torch.nn.init.normal_(model.model.transformer_module.queries_embedder.weight, std=1.0)
    return model.eval(), processor


def pretrain_maskformer(model: torch.nn.Module, processor: object, steps: int, batch_size: int = 16, seed: int = 0,
                        lr: float = 3e-4, log_every: int = 0) -> None:
    """Train every weight on shape scenes with MaskFormer's own loss: the shapes of
    :data:`SEGMENTATION_PRETRAIN_COLOURS` are annotated, those of :data:`SEGMENTATION_UNANNOTATED_COLOURS` are not.

    Runs on one thread (see :func:`single_thread`).
    """
    from clova_train.tools.grounding.synthetic import category_name

    rng = np.random.default_rng(seed)
    names = [category_name(c, s) for c in SEGMENTATION_PRETRAIN_COLOURS for s in SHAPES]
    colours = list(SEGMENTATION_PRETRAIN_COLOURS + SEGMENTATION_UNANNOTATED_COLOURS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = warmup_cosine(optimizer, warmup=30, steps=steps)
    with single_thread():
        model.train()
        _maskformer_steps(model, processor, optimizer, schedule, rng, names, colours, steps, batch_size, log_every)
    model.eval()


def _maskformer_steps(model: torch.nn.Module, processor: object, optimizer: torch.optim.Optimizer, schedule: object,
                      rng: np.random.Generator, names: list[str], colours: list[str], steps: int, batch_size: int,
                      log_every: int) -> None:
    from clova_train.tools.grounding.synthetic import random_scene, scene_targets

    image_size = int(model.config.backbone_config.image_size)
    for step in pretraining_steps(steps, "MaskFormer"):
        scenes = [random_scene(rng, image_size, None, colours, int(rng.integers(1, 4))) for _ in range(batch_size)]
        pixels = processor(images=[s.image for s in scenes], return_tensors="pt")["pixel_values"]
        labels, masks = [], []
        for scene in scenes:
            label, _, mask = scene_targets(scene, names)
            labels.append(torch.tensor(label, dtype=torch.long))
            masks.append(torch.from_numpy(mask).float())
        loss = model(pixel_values=pixels, mask_labels=masks, class_labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log_every and step % log_every == 0:
            print(f"maskformer pretrain step {step}: loss {loss.item():.3f}")


def make_tiny_maskformer(directory: str | Path, seed: int = 0, pretrain_steps: int = 2000, image_size: int = 64) -> Path:
    """Write a tiny MaskFormer and its image processor to ``directory`` (load with ``from_pretrained``)."""
    directory = Path(directory)
    model, processor = build_tiny_maskformer(image_size=image_size, seed=seed)
    if pretrain_steps:
        pretrain_maskformer(model, processor, pretrain_steps, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
