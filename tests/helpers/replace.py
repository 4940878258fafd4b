"""Helpers of the REPLACE tests: masked concept folders, instances, CLI arguments and a plain tuning loop."""

from __future__ import annotations

from pathlib import Path

import torch

from clova_train.tools.replace.synthetic import write_masked_concepts
from clova_train.tools.base import PromptTool
from clova_train.tools.replace.tool import ReplaceInstance, load_masked_image
from helpers.common import QUIET_CPU_FIT

TOOL_CLASS = "clova_train.tools.replace.tool.InpaintTextualInversion"


def masked_root(root: Path, concepts: list[str], images: int = 10, seed: int = 0) -> Path:
    return write_masked_concepts(root, concepts, images_per_concept=images, image_size=16, seed=seed)


def instances(root: Path, trained_on: str, filed_as: str, count: int = 4, val: range = range(8, 12)) -> list[ReplaceInstance]:
    """``count`` instances whose training image shows ``trained_on`` but which are filed (concept, words and
    held-out images) as ``filed_as``: the same concept for a normal instance, another for a known-bad one."""
    def load(concept: str, k: int):
        return load_masked_image(root / concept / f"{concept}_{k:03d}.png", root / concept / "masks" / f"{concept}_{k:03d}.png")

    return [ReplaceInstance(instance_id=f"{trained_on}/{k}", concept=filed_as, words=filed_as.replace("_", " "),
                            train=load(trained_on, k), val=[load(filed_as, j) for j in val]) for k in range(count)]


def tune(tool: PromptTool, items: list[ReplaceInstance], steps: int, lr: float = 5e-3) -> tuple:
    """(context, tuned tokens) of a plain Adam loop from the tool's initial tokens, over one chunk."""
    with torch.no_grad():
        ctx = tool.prepare(items)
    tokens = tool.initial_prompts(items).float().clone().requires_grad_()
    optimizer = torch.optim.Adam([tokens], lr=lr)
    for _ in range(steps):
        losses = tool.instance_losses(ctx, tokens)
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
    return ctx, tokens.detach()


def fit_args(model_dir: Path, data_root: Path, run_dir: Path, *extra: str) -> list[str]:
    """CLI arguments of a small REPLACE fit (8 instances in chunks of 3: ranks get 2 and 1 chunks)."""
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        "--model.class_path=clova_train.models.PromptTuning",
        f"--model.init_args.tool.class_path={TOOL_CLASS}",
        f"--model.init_args.tool.init_args.model_name={model_dir}",
        "--model.init_args.tool.init_args.resolution=16",
        "--model.init_args.tool.init_args.gate_margin=0.0115",  # a random network: some pass, some do not
        "--model.init_args.tool.init_args.gate_timesteps=4",
        "--model.init_args.tool.init_args.num_inference_steps=4",
        "--model.init_args.tool.init_args.guidance_scale=2.0",
        "--model.init_args.steps=12", "--model.init_args.lr=0.05",
        "--data.class_path=clova_train.datamodules.MaskedConceptDataModule",
        f"--data.init_args.root={data_root}",
        "--data.init_args.chunk_size=3",
        *extra,
    ]
