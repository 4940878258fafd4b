"""``benchmarks/prompt_tuning.py`` and ``benchmarks/prompt_tool_seeds.py`` iterate over the tool recipes: each tool's
benchmark settings (``clova_train/tools/<name>/benchmark.py``) carry its small model, data, learning rate, description,
public procedure and seed measurement, and a recipe without settings gets the generic benchmark (no reference)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator

import pytest

from clova_train.tools.benchmark_settings import PromptTuningBenchmark, prompt_tuning_settings, seed_measurement
from clova_train.tools.recipes import ToolRecipe, register_tool, tool_recipe, tool_recipes, unregister_tool
from helpers.common import REPO

SHIPPED = ("clip", "loc", "replace", "seg", "vqa")


def test_every_shipped_tool_has_its_settings_and_the_papers_learning_rate() -> None:
    import prompt_tuning

    for name in SHIPPED:
        recipe = tool_recipe(name)
        settings = prompt_tuning_settings(recipe)
        assert recipe.benchmark == f"clova_train.tools.{name}.benchmark"
        assert type(settings) is not PromptTuningBenchmark and settings.reference, name
        args, _ = prompt_tuning.parse_arguments(["--tool", name])
        assert args.methods == ["engine", "sequential", "reference"]
        assert args.lr == recipe.tool_class().default_lr


@pytest.fixture
def without_settings() -> Iterator[ToolRecipe]:
    """CLIP's recipe under another name and without benchmark settings, registered for the test."""
    recipe = dataclasses.replace(tool_recipe("clip"), name="clip-plain", benchmark=None)
    register_tool(recipe)
    try:
        yield recipe
    finally:
        unregister_tool(recipe.name)


def test_a_recipe_without_settings_is_timed_against_the_fair_loop_only(without_settings: ToolRecipe) -> None:
    import prompt_tuning

    assert type(prompt_tuning_settings(without_settings)) is PromptTuningBenchmark
    args, settings = prompt_tuning.parse_arguments(["--tool", without_settings.name, "--steps", "3"])
    assert args.methods == ["engine", "sequential"] and settings.reference is None
    assert args.lr == 1e-2  # PromptedClip's default_lr
    assert settings.describe(args).startswith("tool clip-plain (SELECT / CLASSIFY: PromptedClip, tiny clip model "
                                              "without pretraining")
    with pytest.raises(SystemExit):
        prompt_tuning.parse_arguments(["--tool", without_settings.name, "--methods", "engine", "reference"])


def test_the_seed_benchmark_measures_the_tools_whose_settings_say_how() -> None:
    measured = {name for name, recipe in tool_recipes().items() if seed_measurement(recipe) is not None}
    assert measured >= {"vqa", "loc", "seg", "replace"} and "clip" not in measured
    assert seed_measurement(tool_recipe("loc")).seeded_data == ("split_seed",)


def test_seed_tables_keep_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "unchanged")  # importing the script must not set it for this process
    import prompt_tool_seeds

    seg = seed_measurement(tool_recipe("seg"))
    assert seg.columns == ("no prompt", "pool, served", "random-prompt pool, same rule")
    per_seed = [{"all": dict(zip(seg.columns, (0.25, 0.75, 0.5))),
                 "operating point": {"images prompted": 0.5, "results changed": 0.5, "found images lost": 0.0},
                 "prompts accepted": {"count": 3.0}},
                {"all": dict(zip(seg.columns, (0.5, 0.5, 0.5))),
                 "operating point": {"images prompted": 0.0, "results changed": 0.0, "found images lost": 0.0},
                 "prompts accepted": {"count": 0.0}}]
    rows = prompt_tool_seeds.table_rows("seg", seg, per_seed)
    assert rows[:4] == ["| seg | all | no prompt | 0.375 [0.000, 1.000] | - | 0.25, 0.50 |",
                        "| seg | all | pool, served | 0.625 [0.000, 1.000] | +0.250 [-1.000, +1.000] | 0.75, 0.50 |",
                        "| seg | all | random-prompt pool, same rule | 0.500 [0.500, 0.500] | +0.125 [-1.000, +1.000] | 0.50, 0.50 |",
                        "| seg | all | pool, served - random-prompt pool, same rule | - | +0.125 [-1.000, +1.000] | +0.25, +0.00 |"]
    assert rows[4].startswith("| seg | operating point | images prompted | ")
    assert rows[-3] == "| seg | prompts accepted | - | - | - | 3, 0 |"
    # the seeds whose served pool prompted any image, and its gain over those seeds only
    assert rows[-2:] == ["| seg | all | seeds whose pool, served differs from the no prompt tool | - | - | 1 of 2 |",
                         "| seg | all | pool, served - no prompt, seeds where it differs | - | +0.500 | +0.50 |"]
    replace = seed_measurement(tool_recipe("replace"))
    per_seed = [{"orange_circle": dict(zip(replace.columns, (90.0, 30.4, 80.0, 40.0, 120.0)))}]
    assert prompt_tool_seeds.table_rows("replace", replace, per_seed)[1] == \
        "| replace | orange_circle | exported token | 30.400 | -59.600 | 30 |"


@pytest.mark.slow  # about 20 s on 2 cores: the model build and two spawned processes
def test_the_benchmark_prints_a_vqa_table() -> None:
    command = [sys.executable, "benchmarks/prompt_tuning.py", "--tool", "vqa", "--instances", "1", "--chunk-size", "1",
               "--steps", "1", "--prompt-tokens", "2", "--repeats", "1", "--methods", "engine", "reference",
               "--no-record"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert ("tool BLIP VQA (BlipForQuestionAnswering, hidden 128, 4 layers per tower, image 64px, patch 8), 2 prompt "
            "tokens, 1 steps, 1 instances (one question each), engine chunk size 1, ") in "\n".join(lines)
    rows = [line.split(" | ") for line in lines if line.startswith(("| engine", "| reference"))]
    assert [row[0] for row in rows] == ["| engine", "| reference"], done.stdout[-2000:]
    assert all(float(row[-1].rstrip(" |")) < 1e-5 for row in rows)  # the same prompts as the engine's


def test_the_grounding_measurement_splits_images_by_what_the_unmodified_tool_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found / missed without prompts, the served pool's losses on the found ones, and the share it prompts."""
    import torch

    import clova_train.core.pool as pool_module
    import clova_train.tools.grounding.demo as demo
    import clova_train.tools.prompt_server as prompt_server
    from clova_train.tools.grounding.benchmark import measure_grounding_seed

    plain = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    outcomes = {"pool": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), "random": torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])}

    class Tool:
        evaluation_metrics = ("found_no_prompt", "found_pool")

        def evaluate(self, lookup, batch):
            return {"found_no_prompt": plain, "found_pool": outcomes[lookup.pool]}

    class Server:
        def __init__(self, tool, pool, top_k=None):
            self.tool, self.pool, self.top_k = tool, pool, top_k

    monkeypatch.setattr(demo, "eval_images", lambda export: ("purple circle", list(range(5))))
    monkeypatch.setattr(pool_module, "control_pool", lambda pool, kind, seed: kind)
    monkeypatch.setattr(prompt_server, "PromptToolServer", Server)
    served = lambda tool, lookup, image, concept: {"prompted": image in (1, 3)}  # noqa: E731
    scores = measure_grounding_seed(served, Server(Tool(), "pool"), None, 0)
    assert scores["all"] == {"no prompt": 0.6, "pool, served": 0.6, "random-prompt pool, same rule": 0.4}
    assert scores["found without prompts"] == pytest.approx(
        {"no prompt": 1.0, "pool, served": 2 / 3, "random-prompt pool, same rule": 2 / 3})
    assert scores["missed without prompts"] == {"no prompt": 0.0, "pool, served": 0.5,
                                                "random-prompt pool, same rule": 0.0}
    assert scores["operating point"] == pytest.approx(
        {"images prompted": 0.4, "results changed": 0.4, "found images lost": 1 / 3})
