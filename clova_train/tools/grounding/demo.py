"""Serve a LOC (OWL-ViT) or SEG (MaskFormer) export on held-out images, with and without the prompt pool.

``python -m clova_train.tools.grounding.demo <export dir> [--picture out.png]`` loads the export the way a serving
process would (no Lightning), takes the evaluation images of the run's concept (the ``num_eval_images``
of its seeded split: never trained on, never gated on) and prints, per image set, how often the concept
is found (LOC: detected with mean box IoU above the tool's ``gate_iou``; SEG: every mask covered by a
segment with IoU >= ``gate_iou``) by the unmodified tool, with the pool, and with a control pool of the
same structure whose prompts are random vectors of the learned prompts' norms. It saves one picture: the
first evaluation image with the ground truth (white), the unmodified tool's output (red) and the pooled
tool's output (green); for SEG, the outline of the segment that best matches each mask of the concept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from scipy.ndimage import binary_erosion

from clova_train.core.pool import control_pool
from clova_train.tools.base import NoPrompt
from clova_train.tools.grounding.instances import GroundedImage
from clova_train.tools.grounding.validation import run_split
from clova_train.tools.seg.tool import mask_iou
from clova_train.tools.prompt_server import PromptToolServer


def eval_images(export_dir: Path) -> tuple[str, list[GroundedImage]]:
    """(concept, evaluation images) of the run that wrote ``export_dir`` (from its config.yaml)."""
    annotations, split = run_split(export_dir)
    if not split.eval_ids:
        raise SystemExit("the run kept no evaluation images (num_eval_images: 0); nothing held out to show")
    return split.concept, [annotations.grounded_image(i) for i in split.eval_ids]


def draw(image: GroundedImage, concept: str, outputs: list[tuple[dict, tuple[int, int, int]]], scale: int = 4) -> Image.Image:
    """The image, enlarged, with the concept's ground truth in white and each output in its colour."""
    picture = Image.fromarray(image.image.permute(1, 2, 0).numpy()).resize(
        (image.size[1] * scale, image.size[0] * scale), Image.NEAREST).convert("RGBA")
    layer = Image.new("RGBA", picture.size, (0, 0, 0, 0))
    pen = ImageDraw.Draw(layer)
    for k in image.objects_of(concept).tolist():
        pen.rectangle([v * scale for v in image.boxes[k].tolist()], outline=(255, 255, 255, 255), width=2)
    for output, colour in outputs:
        for box in output.get("boxes", []):
            pen.rectangle([v * scale for v in box], outline=(*colour, 255), width=2)
        for mask in matching_segments(output.get("masks", []), image, concept):
            big = np.kron(mask.numpy().astype(np.uint8), np.ones((scale, scale), np.uint8)).astype(bool)
            outline = np.zeros((*big.shape, 4), np.uint8)
            outline[big & ~binary_erosion(big, iterations=2)] = (*colour, 255)
            layer = Image.alpha_composite(layer, Image.fromarray(outline, "RGBA"))
            pen = ImageDraw.Draw(layer)
    return Image.alpha_composite(picture, layer).convert("RGB")


def matching_segments(masks: list | torch.Tensor, image: GroundedImage, concept: str) -> list[torch.Tensor]:
    """Per mask of the concept, the segment that overlaps it best (the one the evaluation counts), if any."""
    if len(masks) == 0:
        return []
    found = torch.stack(list(masks)) if isinstance(masks, list) else masks
    target = image.masks[image.objects_of(concept)]
    iou, best = mask_iou(found, target).max(1)
    return [found[k] for k in sorted(set(best[iou > 0].tolist()))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.grounding.demo", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--picture", type=Path, default=None, help="where to save the picture (default: in the export)")
    args = parser.parse_args(argv)
    server = PromptToolServer.from_export(args.export)
    tool = server.tool
    control = PromptToolServer(tool, control_pool(server.pool, "random"), server.top_k)
    concept, images = eval_images(args.export)
    batch = [(image, concept) for image in images]
    with torch.no_grad():
        measured = tool.evaluate(server, batch)
        random = tool.evaluate(control, batch)
    plain_key, pool_key = tool.evaluation_metrics
    print(f"\n{tool.name} on {len(images)} held-out images of {concept!r} ({server.pool.num_prompts(concept)} prompts "
          f"in the pool for it)")
    print(f"{'':<24}{'no prompt':>11}{'with pool':>11}{'random-prompt pool':>20}")
    print(f"{plain_key.split('_')[0] + ' (fraction)':<24}{measured[plain_key].mean():>11.2f}"
          f"{measured[pool_key].mean():>11.2f}{random[pool_key].mean():>20.2f}")
    operation = getattr(server, tool.served_operations[0])
    first = images[0]
    with torch.no_grad():
        plain = getattr(tool, tool.served_operations[0])(NoPrompt(), [first.image], concept)[0]
        pooled = operation([first.image], concept)[0]
    picture = args.picture or args.export / f"{tool.name}_example.png"
    draw(first, concept, [(plain, (230, 40, 40)), (pooled, (40, 220, 60))]).save(picture)
    print(f"picture of {first.source}: ground truth white, no prompt red, with pool green -> {picture}")
    assert "lightning" not in sys.modules, "serving imported Lightning"


if __name__ == "__main__":
    main()
