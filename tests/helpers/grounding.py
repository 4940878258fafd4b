"""Helpers shared by the LOC and SEG tests: instances of a concept, the paper's tuning loop, a fresh-process
serving check, the chunk-size comparison of CLI runs (REPLACE's too) and a small LOC fit's arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from clova_train.tools.base import PromptTool
from clova_train.tools.grounding.instances import GroundingInstance
from helpers.common import QUIET_CPU_FIT, run_fit, serve_in_fresh_process


def instances_of(scenes: Path, concept: str) -> list[GroundingInstance]:
    """8 training instances of ``concept`` from a synthetic COCO folder, each gated on one of 4 held-out images."""
    from clova_train.tools.grounding.coco import GroundingAnnotations, GroundingInstances, GroundingSplit

    annotations = GroundingAnnotations(scenes / "annotations.json")
    split = GroundingSplit(annotations, concept, max_images=8, num_val_images=4, num_eval_images=0, split_seed=0)
    dataset = GroundingInstances(annotations, split, val_images_per_instance=1)
    return [dataset[i] for i in range(len(dataset))]


def tune(tool: PromptTool, instances: list[GroundingInstance], steps: int = 100, lr: float = 0.1, seed: int = 0) -> tuple:
    """(context, first losses, last losses, tuned prompts) of a plain Adam loop over one chunk from prompts drawn
    with ``seed``."""
    torch.manual_seed(seed)
    with torch.no_grad():
        ctx = tool.prepare(instances)
    prompts = ((torch.rand(len(instances), *tool.prompt_shape) * 2 - 1) * tool.init_scale()).requires_grad_()
    optimizer = torch.optim.Adam([prompts], lr=lr)
    first = None
    for _ in range(steps):
        losses = tool.instance_losses(ctx, prompts)
        first = losses.detach() if first is None else first
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
    with torch.no_grad():
        last = tool.instance_losses(ctx, prompts)
    return ctx, first, last, prompts.detach()


@dataclass
class Outcomes:
    """What tuning did, summed over every (scene set, prompt seed) run: gate passes of the unprompted tool and of the
    tuned prompts; training losses."""

    tunings: int = 0
    before: int = 0
    after: int = 0
    first_loss: float = 0.0
    last_loss: float = 0.0
    loss_fell: int = 0

    def add(self, tool: PromptTool, instances: list[GroundingInstance], seed: int) -> None:
        ctx, first, last, prompts = tune(tool, instances, seed=seed)
        with torch.no_grad():
            self.before += sum(r.passed for r in tool.gate(ctx, torch.zeros_like(prompts)))
            self.after += sum(r.passed for r in tool.gate(ctx, prompts))
        self.tunings += len(instances)
        self.first_loss += float(first.sum())
        self.last_loss += float(last.sum())
        self.loss_fell += int((last < first).sum())


def outcomes(tool: PromptTool, scene_sets: list[Path], concept: str, seeds: tuple[int, ...] = (0, 1, 2)) -> Outcomes:
    """Tune ``concept``'s 8 instances of every scene set from every prompt seed and sum what happened."""
    summed = Outcomes()
    for scenes in scene_sets:
        instances = instances_of(scenes, concept)
        for seed in seeds:
            summed.add(tool, instances, seed)
    return summed


def scene_sets(root: Path, concepts: list[str], seeds: tuple[int, ...] = (1, 2)) -> list[Path]:
    """Synthetic COCO folders of ``concepts`` (16 images, two objects each, four distractor colours), one per seed."""
    from clova_train.tools.grounding.synthetic import write_coco_scenes

    return [write_coco_scenes(root / f"scenes-{seed}", concepts, 16, distractor_colours=["red", "green", "blue", "yellow"],
                              objects_per_image=2, seed=seed) for seed in seeds]


def random_prompt_server(tool: PromptTool, instances: list[GroundingInstance]) -> object:
    """A server whose pool holds two random "purple circle" prompts (keyed by two instances' features)."""
    from clova_train.core.pool import PromptPool
    from clova_train.tools.prompt_server import PromptToolServer

    with torch.no_grad():
        ctx = tool.prepare(instances[:2])
        pool = PromptPool(tool.pool_spec())
        pool.add("purple circle", tool.pool_features(ctx), torch.rand(2, *tool.prompt_shape), ["a", "b"])
    return PromptToolServer(tool, pool)


def serve_accepted_in_fresh_process(tool: PromptTool, instances: list[GroundingInstance], scenes: Path,
                                    export: Path) -> tuple[dict, dict]:
    """Tune, export the accepted prompts (every tuned one if none passed; pool + tool.json), serve one held-out image
    in a fresh process that must not import Lightning; returns (served reply, the unprompted tool's reply)."""
    from clova_train.core.pool import PromptPool
    from clova_train.tools.base import NoPrompt

    ctx, _, _, prompts = tune(tool, instances)
    with torch.no_grad():
        passed = [i for i, result in enumerate(tool.gate(ctx, prompts)) if result.passed]
    # the check is the export path, not the gate (the learning tests are)
    passed = passed or list(range(len(instances)))
    pool = PromptPool(tool.pool_spec())
    pool.add(instances[0].concept, ctx.features[passed], prompts[passed], [instances[i].instance_id for i in passed])
    export.mkdir()
    pool.save(export / "pool.safetensors")
    (export / "tool.json").write_text(json.dumps(tool.describe()), encoding="utf-8")
    image = instances[0].val[0]
    request = {"image": str(scenes / "images" / image.source.split("(")[-1].rstrip(")")), "concept": instances[0].concept}
    served = serve_in_fresh_process(export, request)
    with torch.no_grad():
        plain = tool.serve_request(NoPrompt(), request)
    return served, plain


def assert_same_runs_at_chunk_sizes_1_and_8(fit_args: list[str], run_root: Path, instances: int) -> None:
    """The CLI run gives the same instances, verdicts, steps and losses at chunk size 1 and 8."""
    summaries = {}
    for size in (1, 8):
        run_dir = run_root / f"chunk{size}"
        assert run_fit(*fit_args, f"--trainer.default_root_dir={run_dir}", f"--data.init_args.chunk_size={size}") == 0
        summaries[size] = json.loads((run_dir / "summary.json").read_text())
        assert (run_dir / "pool.safetensors").is_file() and (run_dir / "tool.json").is_file()
    one, eight = summaries[1]["instances"], summaries[8]["instances"]
    assert [r["instance_id"] for r in one] == [r["instance_id"] for r in eight] and len(one) == instances
    for a, b in zip(one, eight):
        assert a["accepted"] == b["accepted"] and a["steps"] == b["steps"]
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"]))


def loc_fit_args(owlvit_dir: Path, annotations: Path, run_dir: Path, *extra: str) -> list[str]:
    """CLI arguments of a small LOC fit (4 prompt tokens, 4 steps) on ``annotations``' purple circles."""
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        "--model.class_path=clova_train.models.PromptTuning",
        "--model.init_args.tool.class_path=clova_train.tools.loc.tool.OwlVitLoc",
        f"--model.init_args.tool.init_args.model_name={owlvit_dir}",
        "--model.init_args.tool.init_args.num_prompt_tokens=4",
        "--model.init_args.lr=0.05", "--model.init_args.steps=4",
        "--data.class_path=clova_train.datamodules.GroundingDataModule",
        f"--data.init_args.annotations={annotations}",
        "--data.init_args.concept=purple circle",
        "--data.init_args.num_val_images=2",
        "--data.init_args.chunk_size=8",
        *extra,
    ]
