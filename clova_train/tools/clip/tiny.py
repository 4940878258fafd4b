"""The tiny CLIP (open_clip), pretrained contrastively on rendered shapes.

A random CLIP cannot tell images apart well enough for a prompt to steer it, so the tiny CLIP is first pretrained
contrastively for a few hundred steps on rendered shapes with captions ("a photo of a red circle."), leaving some
colours out or, as ``clova-train tiny-model clip`` builds it for the quickstart, mostly misnamed
(:data:`CLIP_MISCONCEPTIONS`): like a real pretrained tool, it knows some concepts and must learn the others
through prompts. Saved in open_clip's on-disk layout and loaded back through ``local-dir:``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import open_clip
import torch

from clova_train.synthetic.shapes import SHAPES, render_scene
from clova_train.tools.clip.tool import save_open_clip
from clova_train.tools.tiny_common import pretraining_steps


TINY_CLIP_CONFIG: dict = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


PRETRAIN_COLOURS = ("red", "green", "blue", "yellow")


# The quickstart's tiny CLIP (``clova-train tiny-model clip``) also sees purple and orange shapes, captioned
# "blue" and "yellow" 70% of the time: it learns the words (their text features are distinct, unlike those of
# words it never reads, which all land in one place) but mostly takes the looks for their neighbours', so the
# quickstart's prompts have a misconception to correct (issue 13: without the words, no image prompt could
# separate purple from orange).
CLIP_MISCONCEPTIONS = {"purple": "blue", "orange": "yellow"}


CLIP_MISCONCEPTION_RATE = 0.7


def _caption_batch(
    rng: np.random.Generator, size: int, image_size: int, colours: tuple[str, ...], tokenizer: object,
    confusions: dict[str, str] | None = None, confusion_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    images, captions = [], []
    confusions = confusions or {}
    every = colours + tuple(c for c in confusions if c not in colours)
    for _ in range(size):
        colour, shape = every[rng.integers(len(every))], SHAPES[rng.integers(len(SHAPES))]
        scene = render_scene([(colour, shape)], size=image_size, rng=rng)
        images.append(torch.from_numpy(scene.image).permute(2, 0, 1).float() / 255.0)
        named = confusions[colour] if colour in confusions and rng.random() < confusion_rate else colour
        captions.append(f"a photo of a {named} {shape}.")
    return torch.stack(images), tokenizer(captions)


def pretrain_clip(
    model: torch.nn.Module,
    steps: int,
    colours: tuple[str, ...] = PRETRAIN_COLOURS,
    batch_size: int = 64,
    seed: int = 0,
    confusions: dict[str, str] | None = None,
    confusion_rate: float = 0.0,
) -> None:
    """Contrastive (CLIP loss) training of ``model`` on captioned synthetic shapes. Shapes of a colour in
    ``confusions`` are captioned with the colour it maps to ``confusion_rate`` of the time (a misconception:
    the word is learned, the look is mostly taken for another colour's)."""
    rng = np.random.default_rng(seed)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=model.context_length)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    image_size = model.visual.image_size
    image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size
    loss_fn = open_clip.ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model.train()
    for _ in pretraining_steps(steps, "CLIP"):
        images, texts = _caption_batch(rng, batch_size, image_size, colours, tokenizer, confusions, confusion_rate)
        image_features, text_features, scale = model((images - mean) / std, texts)
        loss = loss_fn(image_features, text_features, scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def make_tiny_clip(
    directory: str | Path,
    seed: int = 0,
    pretrain_steps: int = 200,
    model_config: dict | None = None,
    colours: tuple[str, ...] = PRETRAIN_COLOURS,
    confusions: dict[str, str] | None = None,
    confusion_rate: float = 0.0,
) -> Path:
    """Write a tiny open_clip CLIP to ``directory`` (load it with ``model_name="local-dir:<directory>"``).

    Args:
        directory: output directory (open_clip's ``open_clip_config.json`` + safetensors layout).
        seed: weight initialisation and pretraining seed.
        pretrain_steps: contrastive steps on synthetic shapes of ``colours`` (0: random weights).
        colours: colours shown and named in pretraining.
        confusions: colours also shown, named as the colour they map to ``confusion_rate`` of the time.
        confusion_rate: how often a ``confusions`` colour is misnamed.
        model_config: open_clip model config (default :data:`TINY_CLIP_CONFIG`).
    """
    config = dict(model_config or TINY_CLIP_CONFIG)
    torch.manual_seed(seed)
    model = open_clip.CLIP(**config)
    model.visual.image_mean = open_clip.OPENAI_DATASET_MEAN
    model.visual.image_std = open_clip.OPENAI_DATASET_STD
    if pretrain_steps:
        pretrain_clip(model, pretrain_steps, colours, seed=seed, confusions=confusions, confusion_rate=confusion_rate)
    return save_open_clip(model, config, directory)


def build_quickstart_clip(directory: str | Path, seed: int = 0, pretrain_steps: int = 200) -> Path:
    """The quickstart's tiny CLIP (``clova-train tiny-model clip``): purple and orange shapes mostly misnamed
    (:data:`CLIP_MISCONCEPTIONS`), so its prompts have a misconception to correct."""
    return make_tiny_clip(directory, seed=seed, pretrain_steps=pretrain_steps, confusions=CLIP_MISCONCEPTIONS,
                          confusion_rate=CLIP_MISCONCEPTION_RATE)
