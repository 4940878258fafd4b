"""LOC's benchmark settings: the prompt-tuning benchmark's small OWL-ViT (``benchmarks/prompt_tuning.py``) and the seed
measurement of its quickstart (``benchmarks/prompt_tool_seeds.py``); the scenes and the public procedure are
grounding's (:mod:`clova_train.tools.grounding.benchmark`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clova_train.tools.base import PromptTool
from clova_train.tools.benchmark_settings import SeedMeasurement
from clova_train.tools.grounding.benchmark import PAPER, RANDOM, SERVED, GroundingPromptTuning, measure_grounding_seed
from clova_train.tools.grounding.instances import GroundedImage

if TYPE_CHECKING:
    from clova_train.tools.prompt_server import PromptToolServer

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


@contextmanager
def paper_rule(tool: Any) -> Iterator[None]:
    """The tool serving by the paper's rule alone (``detection_margin`` off) inside the block."""
    margin, tool.detection_margin = tool.detection_margin, None
    try:
        yield
    finally:
        tool.detection_margin = margin


def measure_seed(server: PromptToolServer, export: Path, seed: int) -> dict[str, dict[str, float]]:
    """The export's ``detection_margin`` chosen on validation scenes rendered with seeds the run never used (until the
    unmodified detector has found 149 of them: :mod:`clova_train.tools.loc.margin`, the rule fixed before the run) and
    written into it; the export loaded again as a server loads it; then grounding's measurement
    (:func:`~clova_train.tools.grounding.benchmark.measure_grounding_seed`) with the pool served at that margin, the
    random-prompt pool at the same margin and the pool under the paper's rule alone; and, in the operating point,
    the margin and the validation images it was chosen on."""
    from clova_train.tools.loc.margin import calibrate
    from clova_train.tools.prompt_server import PromptToolServer

    margin, _, forwards, _ = calibrate(export, scratch=export.parent / "validation")
    server = PromptToolServer.from_export(export)
    scores = measure_grounding_seed(served_detection, server, export, seed, paper_rule)
    scores["operating point"].update({"detection_margin": float(server.tool.detection_margin),
                                      "validation images": float(len(forwards)),
                                      "validation images found": float(forwards.plain_found.sum())})
    return scores


SEEDS = SeedMeasurement(
    metric="share of images whose concept is detected", columns=("no prompt", SERVED, RANDOM, PAPER),
    contrasts=((SERVED, RANDOM), (SERVED, PAPER)), measure=measure_seed, seeded_data=("split_seed",),
    changed="images prompted")
