"""REPLACE quickstart report: what the exported token adds, measured on new images, and one edit to look at.

``python -m clova_train.tools.replace.demo EXPORT [--images 24]`` (after ``make demo-replace`` fit and export):

1. renders ``--images`` new masked images of each exported concept (a seed the quickstart never used, so
   never trained or gated on) and reports the mean held-out noise-prediction loss (the gate's 10 timesteps x
   2 draws, paired) with the concept's plain words, the exported token, the untuned token (the initializer
   word's embedding), random tokens of the exported token's norm (5 seeds) and, when the run kept its
   rejected tokens (``keep_rejected_prompts``), the ungated pool (every tuned token, same uniform ensemble);
   and on how many images the token beats the words;
2. repaints the box of ``--images`` new green squares as the concept, the same seeds for every row, with the
   words, the exported token and the same controls, and reports how far the repainted region's mean colour is
   from the concept's colour; saves before / after pictures of one of them.

No Lightning: it uses the serving code (``PromptToolServer``) as a deployment would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from clova_train.core.errors import ClovaTrainError
from clova_train.core.pool import random_prompts_like
from clova_train.tools.replace.synthetic import masked_shape
from clova_train.synthetic.shapes import COLOURS
from clova_train.tools.base import NoPrompt
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.tools.replace.tool import (
    MaskedImage, ReplaceInstance, concept_words, ensembled_token, save_image_atomic,
)

DEMO_SEED = 12345  # the quickstart renders with seed 0: these images are new


def _masked_images(concept: str, count: int, size: int) -> list[MaskedImage]:
    colour, _, shape = concept.partition("_")
    rng = np.random.default_rng(DEMO_SEED)
    images = []
    for k in range(count):
        image, mask = masked_shape(rng, colour, shape, size)
        images.append(MaskedImage(torch.from_numpy(image).permute(2, 0, 1).float() / 255,
                                  torch.from_numpy(mask)[None].float() / 255, f"demo {concept} {k}"))
    return images


def ungated_token(export: Path, concept: str) -> tuple[torch.Tensor, int] | None:
    """The uniform ensemble of every token the run tuned for ``concept``, accepted or not, with their count
    (from the run's newest checkpoint; ``None`` when the run did not keep rejected tokens)."""
    from clova_train.core.safe_files import read_json_object

    manifest = export / "export.json"
    source = read_json_object(manifest, "export manifest").get("source", {}) if manifest.is_file() else {}
    folder = Path(source.get("path", "")) / "checkpoints"
    checkpoints = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    if not checkpoints:
        return None
    state = torch.load(checkpoints[-1], map_location="cpu", weights_only=True).get("clova_train.prompt_tuning", {})
    records = [r for r in state.get("records", {}).values() if r.get("concept") == concept]
    if not records or any(r.get("prompt") is None for r in records):
        return None
    return ensembled_token(torch.stack([r["prompt"] for r in records])), len(records)


def held_out_table(server: PromptToolServer, concept: str, count: int,
                   ungated: tuple[torch.Tensor, int] | None = None) -> dict[str, torch.Tensor]:
    """Per-image gate losses on ``count`` new images of ``concept`` with the words, the exported token, the
    untuned token and random tokens."""
    tool = server.tool
    images = _masked_images(concept, count, tool.resolution)
    instance = ReplaceInstance(instance_id="demo", concept=concept, words=concept_words(concept), train=images[0],
                               val=images)
    token = server.token_for(concept)
    with torch.no_grad():
        ctx = tool.prepare([instance])
        rows = {
            "words": tool.held_out_losses(ctx, None)[0],
            "exported token": tool.held_out_losses(ctx, token[None])[0],
            "untuned token": tool.held_out_losses(ctx, tool.initial_prompts([instance]).float())[0],
        }
        randoms = [tool.held_out_losses(ctx, random_prompts_like(token[None], torch.Generator().manual_seed(s)))[0]
                   for s in range(5)]
        if ungated is not None:
            rows[f"ungated pool ({ungated[1]} tokens)"] = tool.held_out_losses(ctx, ungated[0][None])[0]
    rows["random tokens (5 seeds)"] = torch.stack(randoms).mean(0)
    return rows


class FixedToken:
    """A lookup that serves one given token for every concept (the demo's controls)."""

    def __init__(self, token: torch.Tensor) -> None:
        self.token = token

    def prompts_for(self, concept: str | None, features: torch.Tensor) -> None:
        return None

    def candidates(self, concept: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 1), self.token[None]


def repaint_table(server: PromptToolServer, concept: str, tokens: dict[str, torch.Tensor | None], count: int,
                  seed: int) -> dict[str, float]:
    """Mean RGB distance from the concept's colour of the region repainted in ``count`` new pictures of a green
    square (the box repainted as ``concept``, the same seeds for every row); ``None`` is the plain words."""
    colour = concept.partition("_")[0]
    rng = np.random.default_rng(DEMO_SEED + 2)
    scenes = [masked_shape(rng, "green", "square", server.tool.resolution) for _ in range(count)]
    table = {}
    for name, token in tokens.items():
        lookup = NoPrompt() if token is None else FixedToken(token)
        distances = []
        for k, (image, mask) in enumerate(scenes):
            painted, _ = server.tool.inpaint(lookup, Image.fromarray(image), Image.fromarray(mask), concept, seed + k)
            distances.append(region_colour_distance(painted, mask, colour))
        table[name] = float(np.mean(distances))
    return table


def region_colour_distance(picture: Image.Image, mask: np.ndarray, colour: str) -> float:
    """RGB distance between the mean colour inside ``mask`` and the palette colour ``colour``."""
    pixels = np.asarray(picture.convert("RGB"), dtype=np.float64)[mask > 127]
    return float(np.linalg.norm(pixels.mean(0) - np.array(COLOURS[colour])))


def colour_known(concept: str) -> bool:
    """Whether the concept is a rendered ``<colour>_<shape>`` (the demo can draw and measure it)."""
    colour, _, shape = concept.partition("_")
    return colour in COLOURS and bool(shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.replace.demo", description=__doc__.split("\n")[0])
    parser.add_argument("export", help="directory written by clova-train export")
    parser.add_argument("--images", type=int, default=24, help="new images per concept for the loss table")
    parser.add_argument("--seed", type=int, default=0, help="seed of the repainting")
    args = parser.parse_args(argv)
    try:
        server = PromptToolServer.from_export(args.export)
        concepts = server.pool.concepts
        if not concepts:
            print("the export's pool is empty: no token passed the gate (see summary.json)")
            return 0
        out = Path(args.export) / "demo"
        for concept in concepts:
            rows = held_out_table(server, concept, args.images, ungated_token(Path(args.export), concept))
            words = rows["words"]
            print(f"\n{concept}: mean noise-prediction loss on {args.images} new images (lower is better)")
            for name, losses in rows.items():
                print(f"  {name:<24} {float(losses.mean()):.4f}")
            wins = int((rows["exported token"] < words).sum())
            print(f"  the token beats the words on {wins} of {len(words)} images")
            if colour_known(concept):
                controls = {"words": None, "exported token": server.token_for(concept),
                            "untuned token": server.tool.initial_token(concept_words(concept))}
                ungated = ungated_token(Path(args.export), concept)
                if ungated is not None:
                    controls[f"ungated pool ({ungated[1]} tokens)"] = ungated[0]
                exported = controls["exported token"]
                for s in range(3):
                    controls[f"random token (seed {s})"] = random_prompts_like(exported[None], torch.Generator().manual_seed(s))[0]
                print(f"\n  repainting {args.images} green squares as {concept} (seeds {args.seed}..): mean distance of the "
                      f"region's colour from {concept.partition('_')[0]} (RGB, lower is better)")
                for name, distance in repaint_table(server, concept, controls, args.images, args.seed).items():
                    print(f"  {name:<24} {distance:.0f}")

            if not colour_known(concept):
                continue
            rng = np.random.default_rng(DEMO_SEED + 1)
            image, mask = masked_shape(rng, "green", "square", server.tool.resolution)
            before = Image.fromarray(image)
            mask_image = Image.fromarray(mask)
            with_words, _ = server.tool.inpaint(NoPrompt(), before, mask_image, concept, args.seed)
            with_token, prompted = server.inpaint(before, mask_image, concept, args.seed)
            colour = concept.partition("_")[0]
            paths = [save_image_atomic(picture.resize((128, 128), Image.NEAREST), out / f"{concept}_{name}.png")
                     for name, picture in (("before", before), ("words", with_words), ("token", with_token))]
            print(f"  repainting a green square as {concept} (seed {args.seed}): region colour distance from "
                  f"{colour} {region_colour_distance(with_words, mask, colour):.0f} with the words, "
                  f"{region_colour_distance(with_token, mask, colour):.0f} with the token (prompted: {prompted})")
            print("  before / with the words / with the token: " + ", ".join(str(p) for p in paths))
    except ClovaTrainError as err:
        print(f"demo_replace: error: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
