"""``make demo-<tool>`` runs ``python -m clova_train.quickstart.demo <tool>``: the commands it runs come from the tool's
recipe and quickstart config (the Makefile names no tool)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clova_train.quickstart.demo import demo_commands, quickstart_paths
from clova_train.tools.recipes import tool_recipe, tool_recipes
from helpers.common import REPO


def test_a_demo_fits_exports_demonstrates_reports_and_serves_from_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    recipe = tool_recipe("replace")
    model_dir, run_dir = quickstart_paths(recipe)
    assert str(model_dir) == "checkpoints/models/tiny-sd-inpaint" and str(run_dir) == "checkpoints/quickstart_replace"
    commands = [command for command, _ in demo_commands(recipe)]
    assert commands[:4] == [
        ["clova-train", "fit", "--config", "configs/quickstart/replace_prompt.yaml",
         "--model.init_args.on_existing_pool=overwrite"],
        ["clova-train", "export", "checkpoints/quickstart_replace", "--output", "checkpoints/quickstart_replace/export"],
        ["python", "-m", "clova_train.tools.replace.demo", "checkpoints/quickstart_replace/export"],
        ["clova-train", "report", "checkpoints/quickstart_replace"],
    ]
    serve = commands[4]
    assert serve[:3] == ["clova-train", "serve", "checkpoints/quickstart_replace/export"]
    assert json.loads(serve[4])["output"] == "export/demo/served.png"
    assert serve[5:] == ["--output-dir", "checkpoints/quickstart_replace"]  # written in the run's folder


def test_every_recipe_has_a_demo_whose_paths_its_quickstart_config_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    for recipe in tool_recipes().values():
        model_dir, run_dir = quickstart_paths(recipe)
        assert str(run_dir).startswith("checkpoints/") and str(model_dir).startswith("checkpoints/models/"), recipe.name
        assert demo_commands(recipe)[0][0][:2] == ["clova-train", "fit"]


def test_an_unknown_tool_is_refused_naming_the_known_ones() -> None:
    done = subprocess.run([sys.executable, "-m", "clova_train.quickstart.demo", "nope"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown tool 'nope'" in done.stderr and "clip" in done.stderr
    assert "Traceback" not in done.stderr
    listed = subprocess.run([sys.executable, "-m", "clova_train.quickstart.demo", "--list"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    assert set(listed.stdout.split()) >= {"clip", "vqa", "loc", "seg", "replace"}
