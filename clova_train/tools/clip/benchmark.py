"""CLIP's benchmark settings: the real-size smoke run's data (``benchmarks/smoke_real.py``) and the prompt-tuning
benchmark's small model, data and public procedure (``benchmarks/prompt_tuning.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from clova_train.tools.base import PromptTool
from clova_train.tools.benchmark_settings import PromptTuningBenchmark
from clova_train.tools.pretrained import LOCAL_DIR_PREFIX


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's concept folders (``full``: one whole chunk of 16 instances); a request on one image."""
    from clova_train.tools.clip.synthetic import write_concept_folders

    write_concept_folders(workdir / "data" / "concepts", ["red", "purple"], images_per_concept=17 if full else 2,
                          image_size=224)
    return {"images": ["data/concepts/purple/purple_001.png"], "labels": ["purple", "red"]}


# A small ViT-B-like CLIP that runs on a laptop CPU; --model picks a real open_clip architecture instead.
BENCH_CLIP_CONFIG = {
    "embed_dim": 256,
    "vision_cfg": {"image_size": 64, "layers": 6, "width": 256, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 4},
}
CONCEPTS = ["red", "green", "blue", "yellow"]


class ClipPromptTuning(PromptTuningBenchmark):
    """CLIP on a small ViT (``--model``: an open_clip architecture instead), four colour concepts, each instance one
    positive and three negative images (``--image-size`` px).

    The fair loop embeds the patches and encodes the candidates' text once per instance, then runs the prompted
    blocks each step. The reference is the public CLOVA ``CLASSIFY.train_prompt``: one instance at a time, the frozen
    model's weights still requiring gradients (computed every step), the image tower in full (every token through
    every block), text features recomputed every step, and after every step the prompted tool run on the validation
    images.
    """

    reference = "CLOVA's CLASSIFY.train_prompt"
    synthetic_data = False

    def build_small_model(self, workdir: Path, args: argparse.Namespace) -> str:
        from clova_train.tools.clip.tiny import make_tiny_clip

        config = None
        if args.model:
            import open_clip

            config = open_clip.get_model_config(args.model)
        make_tiny_clip(workdir / "model", seed=0, pretrain_steps=0, model_config=config or BENCH_CLIP_CONFIG)
        return self.model_dir_name(workdir / "model")

    def model_dir_name(self, directory: Path) -> str:
        return f"{LOCAL_DIR_PREFIX}{directory}"

    def write_data(self, workdir: Path, args: argparse.Namespace, datamodule_class: type) -> Path:
        from clova_train.tools.clip.synthetic import write_concept_folders

        return write_concept_folders(workdir / "data", CONCEPTS, args.instances // 4 + 2, 64, seed=0)

    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        from clova_train.tools.clip.tool import PromptedClip

        return PromptedClip(model_name, None, num_prompt_tokens=args.prompt_tokens, prompt_depth=3)

    def make_datamodule(self, datamodule_class: type, data: Path, chunk_size: int, args: argparse.Namespace) -> Any:
        datamodule = datamodule_class(str(data), image_size=args.image_size, val_per_concept=1,
                                      negatives_per_instance=3, chunk_size=chunk_size)
        datamodule.setup()
        return datamodule

    def fair_prompt(self, module: Any, item: Any, device: str) -> torch.Tensor:
        tool = module.tool
        with torch.no_grad():
            tokens = tool.embed_patches(item.images.to(device))
            names = item.candidates
            text = tool.encode_text(names)
        labels = torch.tensor([names.index(c) for c in item.labels], device=device)
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            features = tool.encode_tokens(tokens, prompt.expand(len(tokens), *prompt.shape[1:]))
            loss = F.cross_entropy(tool.logit_scale * features @ text.T, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return prompt.detach()[0].cpu()

    def reference_prompt(self, module: Any, item: Any, device: str) -> torch.Tensor:
        tool = module.tool
        tool.model.requires_grad_(True)  # the public code never froze the tool
        tool._class_token_only = False  # and ran every vision block in full for every token
        names = item.candidates
        labels = torch.tensor([names.index(c) for c in item.labels], device=device)
        texts = tool.tokenizer([tool.text_prompt(c) for c in names]).to(device)
        images = item.images.to(device)
        val_images = item.val_images.to(device)
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            text = F.normalize(tool.model.encode_text(texts), dim=-1)  # recomputed every step
            features = tool.encode_image(images, prompt.expand(len(images), *prompt.shape[1:]))
            loss = F.cross_entropy(tool.logit_scale * features @ text.T, labels)
            optimizer.zero_grad()
            tool.model.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():  # the per-step validation check
                val_features = tool.encode_image(val_images, prompt.expand(len(val_images), *prompt.shape[1:]))
                (val_features @ F.normalize(tool.model.encode_text(texts), dim=-1).T).argmax(-1)
        return prompt.detach()[0].cpu()

    def describe_prompt(self, args: argparse.Namespace) -> str:
        return f"{args.prompt_tokens} prompt tokens x 3 blocks"

    def describe(self, args: argparse.Namespace) -> str:
        model = args.model or "small ViT (width 256, 6 blocks, patch 8)"
        return (f"tool CLIP, model {model}, image {args.image_size}px, {self.describe_prompt(args)}, {args.steps} "
                f"steps, {args.instances} instances (1 positive + 3 negative images each)")


PROMPT_TUNING = ClipPromptTuning
