"""docs/prompt-tools.md's "Adding a tool", walked with a toy tool that lives outside the package (``tests/helpers/toy_tool.py``).

The steps, as a user takes them (nothing in the package is edited):

(a) the tool class: a :class:`~clova_train.tools.base.PromptTool` subclass, with its ``TrainingInstance`` subclass;
(b) its datamodule: a :class:`~clova_train.datamodules.PromptTuningDataModule` that builds those instances, and a
    synthetic one that writes its data first (the quickstart's and the tests');
(c) its registry entry: ``register_tool(ToolRecipe(...), TinyModel(...))``, the tiny model a function that writes
    the frozen network into a directory;
(d) its configs: a quickstart one (tiny model, synthetic data) and a paper one (real data), naming its classes;
(e) the conformance checks every registered tool gets (``test_conformance.py``);
(f) ``clova-train fit --config`` with its module importable (LightningCLI imports the classes the YAML names);
    ``clova-train export`` and ``serve`` run in fresh processes that import no module by name, so the tool's
    package declares the class under the ``clova_train.prompt_tools`` entry-point group.

Every test restores the registry: the toy is never left registered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clova_train.core.errors import ClovaTrainError
from clova_train.quickstart import registry
from clova_train.quickstart.registry import ToolRecipe, register_tool
from clova_train.tools.base import ENTRY_POINT_GROUP
from helpers.toy_tool import (
    TOY_DIM,
    TOY_NOISE,
    TOY_TINY_MODEL,
    ToyPromptClassifier,
    concept_vectors,
    toy_recipe,
    write_toy_configs,
)
from helpers.conformance import build_recipe, check_contract, check_export_serves, check_recipe_configs, fit_briefly

TESTS = Path(__file__).resolve().parents[1]
TOOL_CLASS_PATH = f"{ToyPromptClassifier.__module__}.{ToyPromptClassifier.__qualname__}"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def held_out(concept: str, count: int = 5) -> list[list[float]]:
    """Vectors of ``concept`` that the toy data never holds (another noise seed)."""
    return concept_vectors(concept, count, TOY_DIM, TOY_NOISE, seed=1_000).tolist()


@pytest.fixture
def toy(tmp_path: Path, restored_registry: None) -> ToolRecipe:
    """Steps (c) and (d): the toy's configs written, its recipe and tiny model registered, the model built."""
    model_dir = tmp_path / "models" / "toy"
    quickstart, paper = write_toy_configs(tmp_path / "configs", model_dir, tmp_path / "data", tmp_path / "run")
    recipe = toy_recipe(quickstart, paper)
    register_tool(recipe, TOY_TINY_MODEL)
    registry.tiny_model(recipe.tiny_model).build(model_dir)  # as `clova-train tiny-model toy DIR` would
    return recipe


def test_a_registered_tool_is_in_the_registry_once(toy: ToolRecipe) -> None:
    assert registry.tool_recipe("toy") is toy and registry.tiny_model("toy") is TOY_TINY_MODEL
    register_tool(toy, TOY_TINY_MODEL)  # the same entry again: accepted
    clash = ToolRecipe(**{**vars(toy), "tool": "elsewhere.Other"})
    with pytest.raises(ClovaTrainError, match="a recipe named 'toy' is already registered"):
        register_tool(clash)


def test_the_toy_passes_the_conformance_checks(toy: ToolRecipe, tiny_models: Callable[[str], Path],
                                               tmp_path: Path) -> None:
    """Step (e), in this process: the checks of ``test_conformance.py``, on the toy's registry entry."""
    check_recipe_configs(toy)
    built = build_recipe(toy, tiny_models(toy.tiny_model), tmp_path / "conformance-data")
    assert isinstance(built.tool, ToyPromptClassifier)
    check_contract(built)
    run_dir = fit_briefly(built, tmp_path / "conformance-run")
    reply = check_export_serves(built, run_dir, tmp_path / "conformance-export",
                                {"vectors": held_out("purple"), "concept": built.instances[0].concept})
    assert reply["prompted"] is True and len(reply["labels"]) == 5


def clova_train(args: list[str], cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    """``python -m clova_train ARGS`` in a fresh process with ``pythonpath`` (tests/ makes ``helpers`` importable)."""
    # one torch thread, as in this process (the one_torch_thread fixture)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "clova_train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def declare_entry_point(site: Path) -> Path:
    """What installing a package that declares the toy under the prompt-tool entry-point group leaves on the path
    (its ``*.dist-info``): ``[clova_train.prompt_tools] toy_classifier = helpers.toy_tool:ToyPromptClassifier``."""
    info = site / "toy_prompt_tools-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-prompt-tools\nVersion: 0.1\n", encoding="utf-8")
    module, _, name = TOOL_CLASS_PATH.rpartition(".")
    entry_points = f"[{ENTRY_POINT_GROUP}]\ntoy_classifier = {module}:{name}\n"
    (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    return site


@pytest.mark.slow  # four fresh clova-train processes
def test_the_cli_fits_exports_and_serves_a_users_tool(toy: ToolRecipe, tmp_path: Path) -> None:
    """Step (f): the YAML names the toy's classes, which LightningCLI imports from the path; export and serve
    find the tool through its entry point, and refuse it without one."""
    fit = clova_train(["fit", "--config", toy.quickstart_config], tmp_path, [TESTS])
    assert fit.returncode == 0, fit.stderr[-3000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tool"] == ToyPromptClassifier.name and summary["tried"] == 4 and summary["accepted"] >= 1, summary
    assert json.loads((run_dir / "tool.json").read_text())["class_path"] == TOOL_CLASS_PATH

    # Without the entry point a fresh process does not know the class tool.json names: nothing imports it by name.
    refused = clova_train(["export", str(run_dir), "--output", str(tmp_path / "refused")], tmp_path, [TESTS])
    assert refused.returncode == 2 and ENTRY_POINT_GROUP in refused.stderr, refused.stderr[-3000:]

    path = [TESTS, declare_entry_point(tmp_path / "site")]
    export = clova_train(["export", str(run_dir), "--output", str(tmp_path / "export")], tmp_path, path)
    assert export.returncode == 0, export.stderr[-3000:]
    requests = [{"vectors": held_out("purple")}, {"vectors": held_out("purple"), "concept": "purple"},
                {"vectors": held_out("blue"), "concept": "purple"}]
    served = clova_train(["serve", str(tmp_path / "export"), *(f"--request={json.dumps(r)}" for r in requests)],
                         tmp_path, path)
    assert served.returncode == 0, served.stderr[-3000:]
    unprompted, prompted, look_alikes = [json.loads(line) for line in served.stdout.strip().splitlines()[-3:]]
    # the toy classifier calls purple "blue"; the learned prompts fix that, and leave blue vectors blue
    assert unprompted == {"labels": ["blue"] * 5, "prompted": False}
    assert prompted == {"labels": ["purple"] * 5, "prompted": True}
    assert look_alikes == {"labels": ["blue"] * 5, "prompted": True}
