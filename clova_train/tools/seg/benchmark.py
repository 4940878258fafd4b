"""SEG's benchmark settings: the prompt-tuning benchmark's small MaskFormer (``benchmarks/prompt_tuning.py``) and the
seed measurement of its quickstart (``benchmarks/prompt_tool_seeds.py``); the scenes and the public procedure are
grounding's (:mod:`clova_train.tools.grounding.benchmark`)."""

from __future__ import annotations

import argparse
from typing import Any

from clova_train.tools.base import PromptTool
from clova_train.tools.grounding.benchmark import GroundingPromptTuning, grounding_seeds
from clova_train.tools.grounding.instances import GroundedImage

# MaskFormer of the real architecture at a CPU-friendly size (random weights).
BENCH_MASKFORMER = {"image_size": 64, "width": 64, "num_queries": 32}


class SegPromptTuning(GroundingPromptTuning):
    """MaskFormer SEG; the public MaskFormer prompt training had no validation, so no check after each step."""

    reference = "CLOVA's MaskFormer prompt training"
    model_directory = "seg"

    def build_model(self) -> tuple[Any, Any]:
        from clova_train.tools.seg.tiny import build_tiny_maskformer

        return build_tiny_maskformer(seed=0, **BENCH_MASKFORMER)

    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        from clova_train.tools.seg.tool import MaskFormerSeg

        return MaskFormerSeg(model_name, num_prompt_tokens=args.prompt_tokens, object_threshold=0.0)

    def describe(self, args: argparse.Namespace) -> str:
        b = BENCH_MASKFORMER
        return (f"tool MaskFormer SEG (MaskFormerForInstanceSegmentation, tiny Swin, decoder width {b['width']}, "
                f"{b['num_queries']} queries, image {b['image_size']}px), {self.describe_prompt(args)}, "
                f"{args.steps} steps, {args.instances} instances (+1 held-out image each)")


PROMPT_TUNING = SegPromptTuning
def served_segmentation(tool: Any, lookup: Any, image: GroundedImage, concept: str) -> dict[str, Any]:
    """SEG's served output for one image (as ``serve`` answers a request)."""
    return tool.segment(lookup, [image.image], concept)[0]


SEEDS = grounding_seeds("share of images whose concept is segmented", served_segmentation)
