"""A prompt tool's demo, from its recipe (``make demo-<name>``; ``make demo`` is CLIP's).

The steps, each printed before it runs as ``make`` prints a recipe line: build the tool's tiny model where its
quickstart config expects it (once; in a process started with the model's build environment), ``clova-train fit`` the
quickstart config afresh (``on_existing_pool=overwrite``), export the run, run the tool's demo module on the export,
``clova-train report`` the run, and serve the recipe's example request from the export when it has one.

    python -m clova_train.quickstart.demo clip
    python -m clova_train.quickstart.demo --list        # the tools that have a recipe, one per line
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from clova_train.core.errors import ClovaTrainError
from clova_train.core.safe_files import read_yaml
from clova_train.tools.pretrained import LOCAL_DIR_PREFIX
from clova_train.tools.recipes import ToolRecipe, tool_recipe, tool_recipes


def _setting(config: object, *keys: str) -> object:
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def quickstart_paths(recipe: ToolRecipe) -> tuple[Path, Path]:
    """The tiny model's directory and the run directory the recipe's quickstart config names."""
    config = read_yaml(Path(recipe.quickstart_config), "quickstart config")
    model_name = _setting(config, "model", "init_args", "tool", "init_args", "model_name")
    run_dir = _setting(config, "trainer", "default_root_dir")
    if not isinstance(model_name, str) or not isinstance(run_dir, str):
        raise ClovaTrainError(f"{recipe.quickstart_config} must set model.init_args.tool.init_args.model_name and "
                              "trainer.default_root_dir (the demo builds the model there and reads the run there)")
    return Path(model_name.removeprefix(LOCAL_DIR_PREFIX)), Path(run_dir)


def demo_commands(recipe: ToolRecipe) -> list[tuple[list[str], dict[str, str]]]:
    """The demo's commands after the model build, each with the environment variables it adds."""
    _, run_dir = quickstart_paths(recipe)
    export = run_dir / "export"
    commands: list[tuple[list[str], dict[str, str]]] = [
        (["clova-train", "fit", "--config", recipe.quickstart_config, "--model.init_args.on_existing_pool=overwrite"], {}),
        (["clova-train", "export", str(run_dir), "--output", str(export)], {}),
    ]
    if recipe.demo is not None:
        commands.append((["python", "-m", recipe.demo, str(export)], {}))
    commands.append((["clova-train", "report", str(run_dir)], {}))
    if recipe.demo_request is not None:
        request = json.loads(json.dumps(dict(recipe.demo_request)).replace("{run}", str(run_dir)))
        # a request's output file goes under --output-dir: the run's folder, where the demo's other files are
        commands.append((["clova-train", "serve", str(export), "--request", json.dumps(request),
                          "--output-dir", str(run_dir)], {}))
    return commands


def _run(command: list[str], environment: dict[str, str]) -> None:
    shown = " ".join(f"{k}={v}" for k, v in environment.items())
    print(f"{shown} {shlex.join(command)}".strip(), flush=True)
    program = [sys.executable, "-m", "clova_train"] if command[0] == "clova-train" else [sys.executable]
    completed = subprocess.run([*program, *command[1:]], env={**os.environ, **environment}, check=False)
    if completed.returncode != 0:
        raise SystemExit(completed.returncode)


def run_demo(name: str) -> None:
    """Build the tiny model if missing, then fit, export, demo, report and serve (:func:`demo_commands`)."""
    recipe = tool_recipe(name)
    model_dir, _ = quickstart_paths(recipe)
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        model = recipe.tiny_model
        _run(["clova-train", "tiny-model", model.kind, str(model_dir)], dict(model.environment))
    for command, environment in demo_commands(recipe):
        _run(command, environment)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.quickstart.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("tool", nargs="?", help="the tool's recipe name (--list shows them)")
    parser.add_argument("--list", action="store_true", help="print the tools that have a recipe, one per line")
    args = parser.parse_args(argv)
    try:
        if args.list or args.tool is None:
            print("\n".join(tool_recipes()))
            return
        run_demo(args.tool)
    except ClovaTrainError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
