"""The conformance checks every prompt tool with a recipe gets, as plain functions of a recipe (and what was built
from it): ``tools/test_conformance.py`` runs them on each registered tool, ``tools/test_adding_a_tool.py`` on a toy tool
from a test folder. See the suite's docstring for what they check."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from clova_train.core.safe_files import read_yaml
from clova_train.datamodules import PromptTuningDataModule
from clova_train.tools.recipes import TinyModel, ToolRecipe, resolve
from clova_train.tools.base import PromptTool
from clova_train.tools.benchmark_settings import accepted_arguments
from clova_train.tools.contracts import TrainingInstance

REPO = Path(__file__).resolve().parents[2]

# Sizes of a conformance run, applied to whichever of these arguments a tool's synthetic datamodule takes (the rest
# of its quickstart config is kept): enough data to draw a few instances, nothing for evaluation.
SMALL_DATA: dict[str, Any] = {
    "chunk_size": 2,
    "num_workers": 0,
    "images_per_concept": 4,  # concept folders (CLIP, REPLACE)
    "val_per_concept": 1,
    "negatives_per_instance": 2,
    "val_negatives_per_instance": 2,
    "test_images_per_concept": 0,
    "images_per_colour": 2,  # VQA records
    "eval_per_colour": 1,
    "wrong_answers": 0,
    "images": 6,  # grounding scenes (LOC, SEG)
    "max_images": 3,
    "num_val_images": 1,
    "num_eval_images": 1,
}
# Tool arguments that only make serving and gating slower (REPLACE's diffusion steps), where a tool takes them.
SMALL_TOOL: dict[str, Any] = {"num_inference_steps": 2, "gate_timesteps": 2, "gate_noise_draws": 1}
FIT_INSTANCES = 2
FIT_STEPS = 2




# ---------------------------------------------------------------------- reading a recipe's configs
def config_path(path: str) -> Path:
    """A recipe's config path (relative to the repository, or absolute for a tool registered at run time)."""
    return REPO / path


def read_config(path: str) -> dict[str, Any]:
    config = read_yaml(config_path(path), "config")
    assert isinstance(config, dict), f"{path} is not a YAML mapping"
    return config


def _init_args(section: dict[str, Any] | None) -> dict[str, Any]:
    return dict((section or {}).get("init_args") or {})


def check_recipe_configs(recipe: ToolRecipe) -> None:
    """The recipe's configs exist and name its classes; its classes and tiny model resolve."""
    tool_cls = recipe.tool_class()
    assert isinstance(tool_cls, type) and issubclass(tool_cls, PromptTool), f"{recipe.tool} is not a PromptTool"
    for synthetic in (False, True):
        assert issubclass(recipe.datamodule_class(synthetic), PromptTuningDataModule)
    assert isinstance(recipe.tiny_model, TinyModel), f"{recipe.name}: its tiny model is a {type(recipe.tiny_model)}"
    resolve(recipe.tiny_model.builder)
    if recipe.example_request is not None:
        assert callable(resolve(recipe.example_request)), f"{recipe.name}: {recipe.example_request} is not a function"
    datamodules = {recipe.datamodule, recipe.synthetic_datamodule}
    for path in (recipe.quickstart_config, recipe.paper_config):
        assert config_path(path).is_file(), f"{recipe.name}: config {path} is missing"
        config = read_config(path)
        model = config.get("model") or {}
        tool = _init_args(model).get("tool") or {}
        assert tool.get("class_path") == recipe.tool, (
            f"{path} trains {tool.get('class_path')!r}, but the {recipe.name!r} recipe's tool is {recipe.tool!r}")
        data = (config.get("data") or {}).get("class_path")
        assert data in datamodules, f"{path} reads data with {data!r}, not one of the recipe's {sorted(datamodules)}"
    quickstart_data = read_config(recipe.quickstart_config)["data"]["class_path"]
    assert quickstart_data == recipe.synthetic_datamodule, (
        f"{recipe.quickstart_config} must write its own data ({recipe.synthetic_datamodule}), "
        f"not read {quickstart_data}")


# ---------------------------------------------------------------------- building a tool and its data
def build_tool(recipe: ToolRecipe, model_dir: Path) -> PromptTool:
    """The recipe's tool with its quickstart config's arguments, on the model in ``model_dir``."""
    accepted = accepted_arguments(recipe.tool_class())
    return recipe.quickstart_tool(model_dir, **{k: v for k, v in SMALL_TOOL.items() if k in accepted})


def synthetic_datamodule(recipe: ToolRecipe, data_root: Path) -> PromptTuningDataModule:
    """The recipe's synthetic datamodule with its quickstart config's arguments made small (:data:`SMALL_DATA`),
    writing its data under ``data_root``; prepared and set up."""
    cls = recipe.datamodule_class(synthetic=True)
    arguments = _init_args(read_config(recipe.quickstart_config)["data"])
    accepted = accepted_arguments(cls)
    arguments.update({k: v for k, v in SMALL_DATA.items() if k in accepted})
    if "root" in accepted:
        arguments["root"] = str(data_root)
    datamodule = cls(**arguments)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def training_instances(datamodule: PromptTuningDataModule, count: int) -> list[TrainingInstance]:
    """The first ``count`` instances that get a prompt tuned (not ``keep_unchanged``)."""
    dataset = datamodule.instances
    found = []
    for index in range(len(dataset)):
        instance = dataset[index]
        if not instance.keep_unchanged:
            found.append(instance)
        if len(found) == count:
            return found
    raise AssertionError(f"{type(datamodule).__name__} gave {len(found)} instances to tune, the test needs {count}")


@dataclass
class BuiltTool:
    """What the checks run on: a recipe's tool, its synthetic datamodule and a few of its instances."""

    recipe: ToolRecipe
    tool: PromptTool
    datamodule: PromptTuningDataModule
    instances: list[TrainingInstance]


def build_recipe(recipe: ToolRecipe, model_dir: Path, data_root: Path, count: int = 3) -> BuiltTool:
    datamodule = synthetic_datamodule(recipe, data_root)
    return BuiltTool(recipe, build_tool(recipe, model_dir), datamodule, training_instances(datamodule, count))


# ---------------------------------------------------------------------- the checks
def check_contract(built: BuiltTool) -> dict[str, Any]:
    """``check_tool`` on the built tool and its instances; returns its report."""
    from clova_train.tools.check import check_tool

    for instance in built.instances:
        built.tool.check_instance(instance)
    report = check_tool(built.tool, built.instances)
    assert report["max_cross_row_gradient"] == 0.0 and report["rebuilt"]
    return report


class _Instances:
    """A fixed list of instances as a datamodule's instance dataset."""

    def __init__(self, items: list[TrainingInstance]) -> None:
        self.items = items
        self.instance_ids = [item.instance_id for item in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TrainingInstance:
        return self.items[index]


def fit_briefly(built: BuiltTool, run_dir: Path, count: int = FIT_INSTANCES, steps: int = FIT_STEPS) -> Path:
    """Prompt-tune ``count`` of the built instances for ``steps`` steps with the Lightning Trainer; every tuned
    prompt enters the pool (``validation_gate=False``: the gate still runs, its verdict is only recorded)."""
    from lightning import Trainer

    from clova_train.models import PromptTuning

    built.datamodule.instances = _Instances(built.instances[:count])
    model = PromptTuning(built.tool, steps=steps, validation_gate=False)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=str(run_dir))
    trainer.fit(model, datamodule=built.datamodule)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is True and summary["tried"] == count, summary
    return run_dir


def check_export_serves(built: BuiltTool, run_dir: Path, export_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Export the run, load the export in a server and answer ``request``; returns the reply.

    Checks on the way: the export holds the fitted instances' prompts, and the served pool gives a prompt for the
    first instance's concept (retrieved by the instance's own feature)."""
    from clova_train.export import export_run
    from clova_train.tools.prompt_server import PromptToolServer

    export_run(run_dir, export_dir)
    for name in ("tool.json", "pool.safetensors", "export.json"):
        assert (export_dir / name).is_file(), f"the export has no {name}"
    server = PromptToolServer.from_export(export_dir)
    assert type(server.tool) is type(built.tool) and server.tool.identity == built.tool.identity
    fitted = {item.instance_id for item in built.instances[:FIT_INSTANCES]}
    stored = {i for concept in server.pool.concepts for i in server.pool.entry(concept or None)[2]}
    assert stored == fitted, f"the export's pool holds {sorted(stored)}, the run tuned {sorted(fitted)}"
    first = built.instances[0]
    with torch.no_grad():
        feature = server.tool.pool_features(server.tool.prepare([first]))
    assert server.prompts_for(first.concept, feature) is not None, "the served pool has no prompt for the concept"
    reply = server.serve(request)
    assert isinstance(reply, dict) and reply, f"the served query gave {reply!r}"
    json.dumps(reply)  # a JSON reply, as `clova-train serve` sends it
    return reply


# ---------------------------------------------------------------------- served queries
def write_image(path: Path, size: int = 32, seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def guessed_query(tool: PromptTool, workdir: Path, instance: TrainingInstance) -> dict[str, Any]:
    """A request for a tool whose recipe has no ``example_request``: an image in its image field, and the
    instance's concept."""
    image = str(write_image(workdir / "query.png"))
    field = type(tool).request_image_field
    request: dict[str, Any] = {field: [image] if field == "images" else image}
    if instance.concept is not None:
        request["concept"] = instance.concept
    return request


def served_query(built: BuiltTool, workdir: Path) -> dict[str, Any]:
    """The recipe's example request for the first instance (its ``example_request``), else a guess."""
    if built.recipe.example_request is None:
        return guessed_query(built.tool, workdir, built.instances[0])
    return resolve(built.recipe.example_request)(workdir, built.instances[0])
