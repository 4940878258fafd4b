"""Running the shipped Lightning configs as a user runs them on several devices (issue 37); the tests are in
configs/test_quickstart_configs_ddp.py and configs/test_paper_configs_ddp.py (two files, so pytest-xdist runs them
side by side).

Each config under ``configs/`` that LightningCLI reads is launched in a subprocess with
``--trainer.devices=2 --trainer.strategy=ddp`` on CPU (the sharded config keeps its ModelParallelStrategy at two
data-parallel ranks), with the config's own progress bar, loggers and callbacks. The run's working directory is a
fresh folder that holds what the config's relative paths name: the quickstarts' ``checkpoints/models/tiny-*``
and the paper configs' ``data/...`` are links to the test suite's tiny models and synthetic data in the real
formats. The overrides are the tiny model's identity and sizes (a local model path instead of a hub id, its
input resolution), the data's concept name, and a few steps, samples or epochs to keep the suite fast; each
recipe splits its chunks or batches unevenly over the ranks. A callback records, on every rank, the batch count
Lightning announced for the epoch (what every bar, logger and callback reads) and the batches that ran.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from helpers.common import REPO, run_cli_subprocess
from helpers.progress import read_batch_counts

CONFIGS = REPO / "configs"
FIXTURE = re.compile(r"\{(\w+)\}")  # a fixture's path in an override
COUNTS = "counts"  # where the recording callback writes, under the run's working directory
TWO_RANKS = ["--trainer.accelerator=cpu", "--trainer.devices=2"]
DDP = [*TWO_RANKS, "--trainer.strategy=ddp"]
SHARDED = [*TWO_RANKS, "--trainer.strategy.init_args.data_parallel_size=2"]
FEW_STEPS = ["--model.init_args.steps=2"]
LLM_PAPER = ["--model.init_args.max_new_tokens=8", "--trainer.max_epochs=1"]


@dataclass
class Recipe:
    """How one shipped config is run here.

    Args:
        links: relative path in the working directory -> fixture name (or ``fixture/sub/path``) it links to.
        overrides: command-line overrides (fixture paths as ``{fixture}``).
        chunk_size: the recipe's chunk size, for prompt-tuning configs (checks the split is uneven).
    """

    links: dict[str, str]
    overrides: list[str]
    chunk_size: int | None = None
    launch: list[str] = field(default_factory=lambda: list(DDP))


RECIPES: dict[str, Recipe] = {
    "quickstart/clip_prompt.yaml": Recipe(
        {"checkpoints/models/tiny-clip": "tiny_clip_dir"},
        ["--data.init_args.images_per_concept=7", "--data.init_args.val_per_concept=2",  # 10 instances
         "--data.init_args.test_images_per_concept=2", "--data.init_args.chunk_size=4", *FEW_STEPS],  # 3 chunks
        chunk_size=4),
    "quickstart/loop_clip_fit.yaml": Recipe(  # the loop sets the data root of each collection
        {"checkpoints/models/tiny-clip": "tiny_clip_dir"},
        ["--data.init_args.root={concept_root}", "--data.init_args.val_per_concept=1",  # 20 instances in 3 chunks
         "--data.init_args.negatives_per_instance=2", "--data.init_args.val_negatives_per_instance=3", *FEW_STEPS],
        chunk_size=8),
    "quickstart/vqa_prompt.yaml": Recipe(
        {"checkpoints/models/tiny-blip": "tiny_blip_dir"},
        ["--data.init_args.images_per_colour=3", "--data.init_args.wrong_answers=1",
         "--data.init_args.eval_per_colour=1", "--data.init_args.chunk_size=7", *FEW_STEPS],  # 20 in 3 chunks
        chunk_size=7),
    "quickstart/loc_prompt.yaml": Recipe(
        {"checkpoints/models/tiny-owlvit": "tiny_owlvit_dir"},
        ["--data.init_args.images=9", "--data.init_args.num_val_images=2", "--data.init_args.num_eval_images=2",
         "--data.init_args.chunk_size=2", *FEW_STEPS],
        chunk_size=2),
    "quickstart/seg_prompt.yaml": Recipe(
        {"checkpoints/models/tiny-maskformer": "tiny_maskformer_dir"},
        ["--data.init_args.images=9", "--data.init_args.num_val_images=2", "--data.init_args.num_eval_images=2",
         "--data.init_args.chunk_size=2", *FEW_STEPS],
        chunk_size=2),
    "quickstart/replace_prompt.yaml": Recipe(
        {"checkpoints/models/tiny-sd-inpaint": "tiny_sd_dir"},
        ["--data.init_args.images_per_concept=5", "--data.init_args.chunk_size=1", *FEW_STEPS],  # 3 chunks
        chunk_size=1),
    "quickstart/tool_llm_lora.yaml": Recipe(
        {"checkpoints/models/tiny-llama": "tiny_llama_dir"},
        ["--data.init_args.conversations_per_tool=2", "--data.init_args.negatives=5",  # 111: last batch uneven
         "--data.init_args.eval_conversations_per_tool=1", "--data.init_args.batch_size=5",
         "--model.init_args.max_new_tokens=8", "--trainer.max_epochs=1"]),
    "paper/clip_prompt_vit_l14.yaml": Recipe(
        {"data/concepts": "concept_root"},  # 20 instances in one chunk of 32: rank 1 pads
        ["--model.init_args.tool.init_args.model_name=local-dir:{tiny_clip_dir}",
         "--model.init_args.tool.init_args.pretrained=null", "--model.init_args.tool.init_args.num_prompt_tokens=8",
         "--data.init_args.image_size=32", *FEW_STEPS],
        chunk_size=32),
    "paper/vqa_prompt_blip.yaml": Recipe(
        {"data/vqa": "vqa_root"},
        ["--model.init_args.tool.init_args.model_name={tiny_blip_dir}", *FEW_STEPS],
        chunk_size=32),
    "paper/loc_prompt_owlvit.yaml": Recipe(
        {"data/lvis/lvis_v1_train.json": "loc_scenes/annotations.json", "data/coco/train2017": "loc_scenes/images"},
        ["--model.init_args.tool.init_args.model_name={tiny_owlvit_dir}",
         "--model.init_args.tool.init_args.num_prompt_tokens=16",
         "--data.init_args.concept=purple circle", "--data.init_args.num_val_images=2",
         "--data.init_args.num_eval_images=2", *FEW_STEPS],
        chunk_size=32),
    "paper/seg_prompt_maskformer.yaml": Recipe(
        {"data/lvis/lvis_v1_train.json": "seg_scenes/annotations.json", "data/coco/train2017": "seg_scenes/images"},
        ["--model.init_args.tool.init_args.model_name={tiny_maskformer_dir}",
         "--model.init_args.tool.init_args.num_prompt_tokens=16",
         "--data.init_args.concept=red circle", "--data.init_args.num_val_images=2",
         "--data.init_args.num_eval_images=2", "--data.init_args.chunk_size=5", *FEW_STEPS],
        chunk_size=5),
    "paper/replace_prompt_sd_inpaint.yaml": Recipe(
        {"data/replace_concepts": "masked_concepts_root"},
        ["--model.init_args.tool.init_args.model_name={tiny_sd_dir}",
         "--model.init_args.tool.init_args.resolution=16", "--model.init_args.tool.init_args.gate_timesteps=2",
         "--model.init_args.tool.init_args.gate_noise_draws=1", *FEW_STEPS],
        chunk_size=8),
    "paper/tool_llm_vicuna13b.yaml": Recipe(
        {"data/gpt4tools/gpt4tools_71k.json": "llm_data/train.json",
         "data/gpt4tools/gpt4tools_val_seen.json": "llm_data/val.json",
         "data/gpt4tools/gpt4tools_test_unseen.json": "llm_data/test.json"},
        ["--model.init_args.model_name_or_path={tiny_llama_dir}", "--data.init_args.tokenizer={tiny_llama_dir}",
         "--data.init_args.batch_size=5", *LLM_PAPER]),
    "paper/tool_llm_vicuna13b_sharded.yaml": Recipe(
        {"data/gpt4tools/gpt4tools_71k.json": "llm_data/train.json",
         "data/gpt4tools/gpt4tools_val_seen.json": "llm_data/val.json",
         "data/gpt4tools/gpt4tools_test_unseen.json": "llm_data/test.json"},
        ["--model.init_args.model_name_or_path={tiny_llama_dir}", "--data.init_args.tokenizer={tiny_llama_dir}",
         "--data.init_args.batch_size=5", *LLM_PAPER],
        launch=SHARDED),
}


def lightning_configs() -> list[str]:
    """Every shipped config that ``clova-train fit`` reads (the controller and loop configs have no trainer)."""
    found = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        if "trainer" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}):
            found.append(str(path.relative_to(CONFIGS)))
    return found


def fixture_path(request: pytest.FixtureRequest, reference: str) -> Path:
    name, _, rest = reference.partition("/")
    path = Path(request.getfixturevalue(name))
    return path / rest if rest else path


def callback_arg(class_path: str, **init_args: object) -> str:
    """``--trainer.callbacks+=...``: one more callback beside the config's own."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def launch(config: str, request: pytest.FixtureRequest, workdir: Path, *extra: str,
           launch_args: list[str] | None = None) -> tuple[object, dict]:
    """Lay out the working directory, run ``clova-train fit --config <config>`` there (on the recipe's two ranks
    unless ``launch_args`` says otherwise); returns the finished process and the config as YAML."""
    recipe = RECIPES[config]
    for relative, reference in recipe.links.items():
        link = workdir / relative
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(fixture_path(request, reference), link)

    def fixtures(text: str) -> str:
        return FIXTURE.sub(lambda match: str(fixture_path(request, match.group(1))), text)

    recorder = callback_arg("helpers.progress.RecordBatchCounts", directory=str(workdir / COUNTS))
    args = ["fit", "--config", str(CONFIGS / config), *(recipe.launch if launch_args is None else launch_args),
            *map(fixtures, recipe.overrides), recorder, *extra]
    result = run_cli_subprocess(args, timeout=480, cwd=workdir)
    return result, yaml.safe_load((CONFIGS / config).read_text(encoding="utf-8"))


def assert_ran_cleanly(result: object) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    return output


def assert_batch_counts_announced(workdir: Path, ranks: int = 2) -> list[dict]:
    """Every rank ran exactly the batches Lightning announced, and the same number as the others."""
    counts = read_batch_counts(workdir / COUNTS)
    assert [c["world_size"] for c in counts] == [ranks] * ranks, counts
    for record in counts:
        assert record["epochs"], record
        for epoch in record["epochs"]:
            assert epoch["announced"] == epoch["ran"] >= 1, counts
    assert len({json.dumps(c["epochs"]) for c in counts}) == 1, counts  # lockstep: the ranks meet in collectives
    return counts


def assert_loggers_wrote(workdir: Path, settings: dict) -> None:
    loggers = settings["trainer"].get("logger")
    names = {entry["class_path"].rsplit(".", 1)[-1] for entry in loggers} if isinstance(loggers, list) else set()
    metrics = list(workdir.rglob("metrics.csv"))
    events = list(workdir.rglob("events.out.tfevents.*"))
    assert bool(metrics) == ("CSVLogger" in names), (names, metrics)
    assert bool(events) == ("TensorBoardLogger" in names), (names, events)
    if metrics:
        assert len(metrics) == 1 and len(metrics[0].read_text().splitlines()) > 1  # rank 0 writes, once


MOVED_RUN = "runs/moved"  # the run directory check_shipped_config gives every config


def check_shipped_config(config: str, request: pytest.FixtureRequest, workdir: Path) -> None:
    """Run ``config`` on two ranks with its own bar, loggers and callbacks, in another run directory than its own
    (``--trainer.default_root_dir``); every rank ran the batches Lightning announced, the bar drew on rank 0, the
    loggers wrote once and inside that run directory (nothing under the config's own), and a prompt-tuning run pooled
    every instance."""
    result, settings = launch(config, request, workdir, f"--trainer.default_root_dir={MOVED_RUN}")
    output = assert_ran_cleanly(result)
    counts = assert_batch_counts_announced(workdir)
    assert all(c["has_bar"] == settings["trainer"].get("enable_progress_bar", True) for c in counts)
    if settings["trainer"].get("enable_progress_bar", True):
        assert "Epoch 0" in output  # the bar drew on rank 0
        assert output.count("fit: epoch 1") >= 1  # and, its output not being a terminal, progress lines (rank 0's)
    assert_loggers_wrote(workdir / MOVED_RUN, settings)
    own = settings["trainer"].get("default_root_dir")
    assert own is None or not (workdir / own).exists(), f"the run wrote into the config's own {own}"
    if RECIPES[config].chunk_size is not None:  # prompt tuning: every instance reached rank 0's pool, once
        run_dir = workdir / MOVED_RUN
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["complete"] and summary["tried"] == len(summary["instances"]) >= 1
        chunks = math.ceil(summary["tried"] / RECIPES[config].chunk_size)
        assert chunks % 2 == 1, "the recipe must split its chunks unevenly over the two ranks"
        assert counts[0]["epochs"][0]["announced"] == math.ceil(chunks / 2)
        assert output.count("Prompt pool:") == 1


