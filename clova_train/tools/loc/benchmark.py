"""LOC's benchmark settings: the prompt-tuning benchmark's small OWL-ViT (``benchmarks/prompt_tuning.py``) and the seed
measurement of its quickstart (``benchmarks/prompt_tool_seeds.py``); the scenes and the public procedure are
grounding's (:mod:`clova_train.tools.grounding.benchmark`)."""

from __future__ import annotations

import argparse
from typing import Any

from clova_train.tools.base import PromptTool
from clova_train.tools.grounding.benchmark import GroundingPromptTuning, grounding_seeds
from clova_train.tools.grounding.instances import GroundedImage

# OWL-ViT of the real architecture at a CPU-friendly size (random weights).
BENCH_OWLVIT = {"image_size": 64, "width": 128, "layers": 4}


class LocPromptTuning(GroundingPromptTuning):
    """OWL-ViT LOC; the public OWL-ViT prompt training checked whether the prompt passes after every step."""

    reference = "CLOVA's OWL-ViT prompt training"
    model_directory = "loc"
    checks_each_step = True

    def build_model(self) -> tuple[Any, Any]:
        from clova_train.tools.loc.tiny import build_tiny_owlvit

        return build_tiny_owlvit(seed=0, **BENCH_OWLVIT)

    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        from clova_train.tools.loc.tool import OwlVitLoc

        return OwlVitLoc(model_name, num_prompt_tokens=args.prompt_tokens)

    def describe(self, args: argparse.Namespace) -> str:
        b = BENCH_OWLVIT
        return (f"tool OWL-ViT LOC (OwlViTForObjectDetection, width {b['width']}, {b['layers']} vision layers, "
                f"image {b['image_size']}px, patch 8), {self.describe_prompt(args)}, up to 15 queries per image, "
                f"{args.steps} steps, {args.instances} instances (+1 held-out image each)")


PROMPT_TUNING = LocPromptTuning
def served_detection(tool: Any, lookup: Any, image: GroundedImage, concept: str) -> dict[str, Any]:
    """LOC's served output for one image (as ``serve`` answers a request)."""
    return tool.detect(lookup, [image.image], concept)[0]


SEEDS = grounding_seeds("share of images whose concept is detected", served_detection)
