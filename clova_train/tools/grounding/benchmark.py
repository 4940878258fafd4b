"""What LOC's and SEG's benchmark settings share: the prompt-tuning benchmark's scenes and public procedure
(``benchmarks/prompt_tuning.py``) and the seed measurement of their quickstarts
(``benchmarks/prompt_tool_seeds.py``)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from clova_train.tools.benchmark_settings import PromptTuningBenchmark, SeedMeasurement
from clova_train.tools.grounding.instances import GroundedImage

if TYPE_CHECKING:
    from clova_train.tools.prompt_server import PromptToolServer

CONCEPT = "purple circle"
VAL_IMAGES = 4


class GroundingPromptTuning(PromptTuningBenchmark):
    """A grounding tool on synthetic COCO scenes of one concept (two objects per 64 px image), one instance per image.

    The fair loop runs the detector on the pixels (and the query texts) once per instance. The reference is the
    public CLOVA prompt training: one image at a time, the whole model re-run from the pixels every step with weights
    that require gradients, and, where the public code had one (:attr:`checks_each_step`), the pass check after every
    step (its result ignored so that every method takes the same number of steps).

    Attributes:
        model_directory: the small model's folder under the benchmark's work directory.
        checks_each_step: the public code checked whether the prompt passes after every step.
    """

    synthetic_data = False
    model_directory: ClassVar[str]
    checks_each_step: ClassVar[bool] = False

    def build_small_model(self, workdir: Path, args: argparse.Namespace) -> str:
        model, processor = self.build_model()
        directory = workdir / self.model_directory
        model.save_pretrained(directory)
        processor.save_pretrained(directory)
        return str(directory)

    def build_model(self) -> tuple[Any, Any]:
        """The small model and its processor (random weights)."""
        raise NotImplementedError

    def write_data(self, workdir: Path, args: argparse.Namespace, datamodule_class: type) -> Path:
        from clova_train.tools.grounding.synthetic import write_coco_scenes

        return write_coco_scenes(workdir / "data", [CONCEPT], args.instances + VAL_IMAGES, objects_per_image=2,
                                 image_size=64, seed=0)

    def make_datamodule(self, datamodule_class: type, data: Path, chunk_size: int, args: argparse.Namespace) -> Any:
        datamodule = datamodule_class(str(data / "annotations.json"), CONCEPT, max_images=args.instances,
                                      num_val_images=VAL_IMAGES, chunk_size=chunk_size)
        datamodule.setup()
        return datamodule

    def reference_prompt(self, module: Any, item: Any, device: str) -> torch.Tensor:
        tool = module.tool
        tool.model.requires_grad_(True)  # the public code never froze the tool
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            ctx = tool.prepare([item])  # the whole model from the pixels (and the query texts), every step
            loss = tool.instance_losses(ctx, prompt).sum()
            optimizer.zero_grad()
            tool.model.zero_grad()
            loss.backward()
            optimizer.step()
            if self.checks_each_step:
                with torch.no_grad():  # the pass check after every step
                    tool.gate(ctx, prompt)
        return prompt.detach()[0].cpu()


SERVED, RANDOM, PAPER = "pool, served", "random-prompt pool, same rule", "pool, paper's rule"
"""The columns besides "no prompt": the pool as the export serves it (the paper's rule: the concept's stored prompts
under which the concept scores above ``score_threshold`` are ensembled, none kept, the unmodified tool answers; and,
for a tool with a serving margin, that margin), the pool of random prompts of the same norms under the same rule, and
(for a tool with a margin) the pool under the paper's rule alone."""

PaperRule = Callable[[Any], AbstractContextManager[None]]
"""``tool -> context`` in which the tool serves by the paper's rule alone (its margin off)."""

ServedOutput = Callable[[Any, Any, GroundedImage, str], dict[str, Any]]
"""``(tool, lookup, image, concept) -> the tool's served output for one image`` (a dict with ``"prompted"``)."""


def share(found: torch.Tensor, where: torch.Tensor) -> float:
    """The share of ``where``'s images that ``found`` marks (NaN when ``where`` selects none)."""
    return float(found[where].double().mean()) if bool(where.any()) else float("nan")


def measure_grounding_seed(served: ServedOutput, server: PromptToolServer, export: Path, seed: int,
                           paper_rule: PaperRule | None = None) -> dict[str, dict[str, float]]:
    """Per held-out image of the concept: found (the tool's evaluation metric) without prompts, with the pool served
    and with the random-prompt pool under the same rule; groups: all images, those the unmodified tool finds (what
    serving the pool can lose) and those it misses (what the pool can gain); and the operating point: the share of
    images the served pool prompts (its output differs from the unmodified tool's on those only; other concepts
    have no prompts and are never prompted), the share whose found/missed result changes, and the share of the
    unmodified tool's found images that the served pool loses. With ``paper_rule``, the pool is also scored under
    the paper's rule alone (:data:`PAPER`)."""
    from clova_train.core.pool import control_pool
    from clova_train.tools.grounding.demo import eval_images
    from clova_train.tools.prompt_server import PromptToolServer

    concept, images = eval_images(export)
    control = PromptToolServer(server.tool, control_pool(server.pool, "random", seed), server.top_k)
    batch = [(image, concept) for image in images]
    plain_key, pool_key = server.tool.evaluation_metrics
    with torch.no_grad():
        measured, random = server.tool.evaluate(server, batch), server.tool.evaluate(control, batch)
        prompted = torch.tensor([bool(served(server.tool, server, image, concept)["prompted"]) for image in images])
    found = {"no prompt": measured[plain_key].bool(), SERVED: measured[pool_key].bool(), RANDOM: random[pool_key].bool()}
    if paper_rule is not None:
        with paper_rule(server.tool), torch.no_grad():
            found[PAPER] = server.tool.evaluate(server, batch)[pool_key].bool()
    known = found["no prompt"]
    groups = {"all": torch.ones_like(known), "found without prompts": known, "missed without prompts": ~known}
    scores = {name: {column: share(hits, where) for column, hits in found.items()} for name, where in groups.items()}
    scores["operating point"] = {
        "images prompted": float(prompted.double().mean()),
        "results changed": float((found[SERVED] != known).double().mean()),
        "found images lost": share(~found[SERVED], known),
    }
    return scores


def grounding_seeds(metric: str, served: ServedOutput) -> SeedMeasurement:
    """The seed measurement of a grounding quickstart whose score is ``metric`` (its scenes split by the seed too);
    ``served`` gives the tool's served output for one image (whether the pool prompted it)."""
    return SeedMeasurement(metric=metric, columns=("no prompt", SERVED, RANDOM), contrasts=((SERVED, RANDOM),),
                           measure=functools.partial(measure_grounding_seed, served), seeded_data=("split_seed",),
                           changed="images prompted")
