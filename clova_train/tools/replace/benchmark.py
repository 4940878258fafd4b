"""REPLACE's benchmark settings: the real-size smoke run's data (``benchmarks/smoke_real.py``), the prompt-tuning
benchmark's small model, data and public procedure (``benchmarks/prompt_tuning.py``) and the seed measurement of its
quickstart (``benchmarks/prompt_tool_seeds.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clova_train.tools.base import PromptTool
from clova_train.tools.benchmark_settings import PromptTuningBenchmark, SeedMeasurement

if TYPE_CHECKING:
    from clova_train.tools.prompt_server import PromptToolServer


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's masked shapes; a request repainting the first one."""
    from clova_train.tools.replace.synthetic import write_masked_concepts

    write_masked_concepts(workdir / "data" / "replace_concepts", ["orange_circle"], images_per_concept=10 if full else 4,
                          image_size=64)
    return {"image": "data/replace_concepts/orange_circle/orange_circle_000.png",
            "mask": "data/replace_concepts/orange_circle/masks/orange_circle_000.png",
            "concept": "orange_circle", "output": "served.png", "seed": 0}


# ---------------------------------------------------------------------- benchmarks/prompt_tuning.py
# A Stable Diffusion inpainting pipeline of the real architecture at a CPU-friendly size (random weights).
BENCH_SD = {"image_size": 32, "unet_width": 32, "vae_width": 16}
CONCEPT = "orange_circle"
VAL_IMAGES = 2


class ReplacePromptTuning(PromptTuningBenchmark):
    """SD inpainting's textual inversion of one concept's masked shapes, one image per instance.

    The loops do not gate (no held-out latents or word losses to prepare: :meth:`loop_item`); the fair loop encodes
    the latents once per instance. The reference is CLOVA's textual inversion as diffusers' textual-inversion script
    does it: one image at a time, the VAE re-encoding the image and the masked image every step, and the UNet's and
    text encoder's weights requiring gradients (the public code never froze its tools; the token-embedding table is
    trained whole and its other rows restored after each step).
    """

    reference = "CLOVA's textual inversion (diffusers' textual-inversion script)"
    synthetic_data = False

    def build_small_model(self, workdir: Path, args: argparse.Namespace) -> str:
        from clova_train.tools.replace.tiny import build_tiny_inpainting_pipeline

        build_tiny_inpainting_pipeline(workdir / "sd", seed=0, **BENCH_SD).save_pretrained(workdir / "sd")
        return str(workdir / "sd")

    def write_data(self, workdir: Path, args: argparse.Namespace, datamodule_class: type) -> Path:
        from clova_train.tools.replace.synthetic import write_masked_concepts

        return write_masked_concepts(workdir / "data", [CONCEPT], args.instances + VAL_IMAGES,
                                     image_size=BENCH_SD["image_size"], seed=0)

    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        from clova_train.tools.replace.tool import InpaintTextualInversion

        return InpaintTextualInversion(model_name, resolution=BENCH_SD["image_size"])

    def make_datamodule(self, datamodule_class: type, data: Path, chunk_size: int, args: argparse.Namespace) -> Any:
        datamodule = datamodule_class(str(data), val_per_concept=VAL_IMAGES, chunk_size=chunk_size)
        datamodule.setup()
        return datamodule

    def loop_item(self, item: Any) -> Any:
        return dataclasses.replace(item, val=[])

    def reference_prompt(self, module: Any, item: Any, device: str) -> torch.Tensor:
        tool = module.tool
        tool.unet.requires_grad_(True)  # the public code never froze the tool: weight gradients every step
        tool.text_encoder.requires_grad_(True)  # the whole embedding table included (textual-inversion scripts)
        with torch.no_grad():
            ctx = tool.prepare([item])
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            with torch.no_grad():
                ctx.train = tool.encode([item.train])  # the VAE on the image and the masked image, every step
            loss = tool.instance_losses(ctx, prompt).sum()
            optimizer.zero_grad()
            tool.unet.zero_grad()
            tool.text_encoder.zero_grad()
            loss.backward()
            optimizer.step()
        tool.unet.requires_grad_(False)
        tool.text_encoder.requires_grad_(False)
        return prompt.detach()[0].cpu()

    def describe(self, args: argparse.Namespace) -> str:
        b = BENCH_SD
        return (f"tool SD inpainting REPLACE (StableDiffusionInpaintPipeline: UNet width {b['unet_width']}, 9 input "
                f"channels, VAE width {b['vae_width']}, CLIP text encoder width 32, image {b['image_size']}px), one "
                f"32-d token, {args.steps} steps, {args.instances} instances ({VAL_IMAGES} held-out images "
                "shared; the engine's time includes its gate, the loops do not gate)")


PROMPT_TUNING = ReplacePromptTuning


# ---------------------------------------------------------------------- benchmarks/prompt_tool_seeds.py
REPAINT_IMAGES = 24


def measure_seed(server: PromptToolServer, export: Path, seed: int) -> dict[str, dict[str, float]]:
    """Per concept, the distance of a repainted region's mean colour from the concept's colour (RGB) over
    :data:`REPAINT_IMAGES` new green squares repainted as the concept (repaint seeds ``seed``..), with the words, the
    exported token, the untuned token, the ungated pool (every tuned token) and a random token of the exported
    token's norm."""
    from clova_train.core.pool import random_prompts_like
    from clova_train.core.safe_files import read_yaml
    from clova_train.tools.replace.demo import repaint_table, ungated_token
    from clova_train.tools.replace.tool import concept_words

    data = read_yaml(export / "config.yaml", "run config")["data"]
    scores = {}
    for concept in data.get("init_args", data).get("synthetic_concepts") or server.pool.concepts:
        exported = server.token_for(concept)  # None when no token passed the gate: the words are served
        untuned = server.tool.initial_token(concept_words(concept))
        ungated = ungated_token(export, concept)
        tokens = {"words": None, "exported token": exported, "untuned token": untuned,
                  "ungated pool": ungated[0] if ungated else exported,
                  "random token": random_prompts_like((untuned if exported is None else exported)[None],
                                                      torch.Generator().manual_seed(seed))[0]}
        with torch.no_grad():
            scores[concept] = repaint_table(server, concept, tokens, REPAINT_IMAGES, seed)
    return scores


SEEDS = SeedMeasurement(
    metric="repainted region's RGB distance from the concept's colour (lower is better)",
    columns=("words", "exported token", "untuned token", "ungated pool", "random token"),
    contrasts=(("exported token", "untuned token"), ("exported token", "ungated pool"),
               ("exported token", "random token")),
    measure=measure_seed,
    bounded=False,
    score_format="{:.0f}",
)
