"""``make demo-hydra-benchmark``'s material: a small benchmark in GQA's and OK-VQA's formats and the tool exports
its ``ImagePatch`` tools run on, all offline.

:func:`prepare` writes

* the benchmark (:func:`~clova_train.envs.tasks.offline.write_offline_benchmark`): scenes of the shapes world as
  COCO-named JPEGs, GQA-format training questions and OK-VQA-format evaluation questions (ten annotator answers), so
  a controller is trained on one dataset's files and evaluated on another's, as HYDRA's Table 4 does;
* the tiny tool models, pretrained briefly on synthetic shapes (OWL-ViT for LOC, CLIP for CLASSIFY, BLIP for VQA;
  built once under ``models``, reused after) and a random-weight tiny depth model;
* an export of each prompt tool with an empty prompt pool (``tool.json`` + ``pool.safetensors``: the unprompted
  tool, what ``clova-train serve`` and the environments load), under ``<root>/tools/``.

Then ``clova-train controller fit --config configs/quickstart/controller_hydra_benchmark.yaml`` trains and evaluates
a controller on them. Reruns reuse what is already written.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from clova_train.core.atomic import write_json_atomic
from clova_train.core.pool import PromptPool
from clova_train.envs.tasks.offline import write_offline_benchmark
from clova_train.envs.common.world import is_held_out
from clova_train.tools.depth.tiny import make_tiny_depth_anything
from clova_train.tools.recipes import tool_recipe

DEFAULT_ROOT = "checkpoints/data/hydra_benchmark"
DEFAULT_MODELS = "checkpoints/models"
ROLE_RECIPES = (("loc", "loc"), ("classify", "clip"), ("vqa", "vqa"))  # ImagePatch role -> tool recipe
POOL_FILE = "pool.safetensors"
TOOL_FILE = "tool.json"


def task_ids(count: int, held_out: bool, start: int = 1) -> list[int]:
    """The first ``count`` shapes-world task ids of the training (``held_out`` false) or held-out split."""
    ids, candidate = [], start
    while len(ids) < count:
        if is_held_out(candidate) == held_out:
            ids.append(candidate)
        candidate += 1
    return ids


def tiny_model_dir(kind: str, models: Path, builder: object) -> Path:
    """``models/tiny-<kind>``, built by ``builder(directory)`` unless it is there (built beside it and renamed into
    place when finished, so an interrupted build is never taken for a model)."""
    directory = models / f"tiny-{kind}"
    if not directory.is_dir():
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        print(f"building the tiny {kind} model in {directory} (pretraining on CPU can take minutes)", flush=True)
        builder(partial)  # type: ignore[operator]
        partial.rename(directory)
    return directory


def write_unprompted_export(recipe_name: str, model_dir: Path, directory: Path) -> Path:
    """An export of the recipe's tool on ``model_dir`` with an empty prompt pool (the tool as it is, unprompted)."""
    if (directory / TOOL_FILE).is_file() and (directory / POOL_FILE).is_file():
        return directory
    recipe = tool_recipe(recipe_name)
    tool = recipe.quickstart_tool(model_dir)
    directory.mkdir(parents=True, exist_ok=True)
    PromptPool(tool.pool_spec()).save(directory / POOL_FILE)
    write_json_atomic(directory / TOOL_FILE, json.loads(json.dumps(tool.describe())))
    return directory


def prepare(root: str | Path = DEFAULT_ROOT, models: str | Path = DEFAULT_MODELS, train_tasks: int = 300,
            eval_tasks: int = 100, scale: int = 2, pretrain_steps: int | None = None) -> dict[str, Path]:
    """Write the benchmark and the tool exports (module docstring); the paths a config names, by key.
    ``pretrain_steps``: the tiny tool models' pretraining (None: each model's own; 0: random weights, for tests)."""
    root, models = Path(root), Path(models)
    if not (root / "okvqa").is_dir():
        write_offline_benchmark(root, task_ids(train_tasks, False), task_ids(eval_tasks, True), scale)
    written = {"root": root}
    for role, name in ROLE_RECIPES:
        recipe = tool_recipe(name)
        build = functools.partial(recipe.tiny_model.build, pretrain_steps=pretrain_steps)
        model_dir = tiny_model_dir(recipe.tiny_model.kind, models, build)
        written[role] = write_unprompted_export(name, model_dir, root / "tools" / name)
    written["depth"] = tiny_model_dir("depth-anything", models, make_tiny_depth_anything)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=DEFAULT_ROOT, help="where the benchmark and the exports are written")
    parser.add_argument("--models", default=DEFAULT_MODELS, help="where the tiny models are built (once)")
    parser.add_argument("--train-tasks", type=int, default=300, help="GQA-format training questions")
    parser.add_argument("--eval-tasks", type=int, default=100, help="OK-VQA-format evaluation questions")
    args = parser.parse_args(argv)
    for key, path in prepare(args.root, args.models, args.train_tasks, args.eval_tasks).items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    main()
