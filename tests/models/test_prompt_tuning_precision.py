"""The training precision of the frozen tools (issue 36): under ``bf16-mixed`` every registered tool's frozen network is
stored in bfloat16 once, at setup, so that no frozen weight is converted during a training step (autocast would
otherwise cast every float32 weight at every inner step); the prompts and their optimizer, the pool and the export stay
float32; validation and serving work with the stored tool. ``32-true`` changes nothing; ``-true`` low precisions
are refused.

Each tool runs on its recipe's random-weight tiny model with its synthetic data (as in ``tools/test_conformance.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from clova_train.core.errors import ModelError
from clova_train.core.pool import PromptPool
from clova_train.tools.recipes import ToolRecipe, tool_recipe, tool_recipes
from clova_train.tools.tiny_common import torch_threads
from clova_train.tools.base import PromptTool
from clova_train.tools.prompt_server import PromptToolServer
from helpers.conformance import BuiltTool, _Instances, build_recipe, check_export_serves, served_query

RECIPES = [pytest.param(recipe, id=name) for name, recipe in tool_recipes().items()]
CONVERSIONS = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


class FrozenWeightConversions(TorchDispatchMode):
    """Records every dtype conversion of a whole frozen tensor of ``tool`` (``aten._to_copy`` of it, or a ``copy_``
    from it into another dtype): what autocast does to a float32 weight at every use under bf16. (A few elements read
    from a weight, like the word embedding a textual-inversion token starts from, are not a weight's conversion.)"""

    def __init__(self, tool: PromptTool) -> None:
        super().__init__()
        self.frozen = {(t.untyped_storage().data_ptr(), t.numel()): name
                       for name, t in [*tool.named_parameters(), *tool.named_buffers()]}
        self.found: list[tuple[str, torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in CONVERSIONS:
            source = args[0] if func is CONVERSIONS[0] else args[1]
            name = self.frozen.get((source.untyped_storage().data_ptr(), source.numel()))
            target = result.dtype if func is CONVERSIONS[0] else args[0].dtype
            if name is not None and target != source.dtype:
                self.found.append((name, source.dtype, target))
        return result


def fit(built: BuiltTool, run_dir: Path, precision: str, monkeypatch: pytest.MonkeyPatch, count: int = 2,
        steps: int = 2, **options: Any) -> tuple[Any, list[FrozenWeightConversions]]:
    """A short fit of ``count`` instances at ``precision``, every training step (prepare, the inner steps' forward and
    backward, the gate) run under :class:`FrozenWeightConversions`; returns the module and the steps' records."""
    from lightning import Trainer

    from clova_train.models import PromptTuning

    built.datamodule.instances = _Instances(built.instances[:count])
    model = PromptTuning(built.tool, steps=steps, validation_gate=False, **options)
    steps_seen: list[FrozenWeightConversions] = []
    training_step = model.training_step

    def watched(chunk: Any, batch_idx: int) -> Any:
        steps_seen.append(FrozenWeightConversions(model.tool))
        with steps_seen[-1]:
            return training_step(chunk, batch_idx)

    monkeypatch.setattr(model, "training_step", watched)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=str(run_dir), precision=precision)
    trainer.fit(model, datamodule=built.datamodule)
    return model, steps_seen


@pytest.fixture
def build(tiny_models: Callable[[str], Path], tmp_path: Path) -> Callable[[ToolRecipe], BuiltTool]:
    """A fresh tool per call (a fit changes its tool's dtype in place)."""
    return lambda recipe: build_recipe(recipe, tiny_models(recipe.tiny_model), tmp_path / f"{recipe.name}-data")


def floating_dtypes(tool: PromptTool, kept: bool | None = None) -> set[torch.dtype]:
    """The dtypes of the tool's floating parameters and buffers (only those its ``keep_float32`` names, or only the
    others, with ``kept`` true or false)."""
    names = type(tool).keep_float32

    def is_kept(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in names)

    return {t.dtype for name, t in [*tool.named_parameters(), *tool.named_buffers()]
            if t.is_floating_point() and (kept is None or is_kept(name) == kept)}


def safetensors_dtypes(directory: Path) -> set[torch.dtype]:
    files = sorted(directory.rglob("*.safetensors"))
    assert files, f"no safetensors file under {directory}"
    return {t.dtype for f in files for t in load_file(str(f)).values()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_mixed_stores_the_tool_in_bfloat16_once_and_keeps_prompts_float32(
        recipe: ToolRecipe, checkpointing: bool, build: Callable[[ToolRecipe], BuiltTool], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With activation checkpointing too: the blocks recomputed in the backward pass convert no weight either."""
    built = build(recipe)
    model, steps = fit(built, tmp_path / "run", "bf16-mixed", monkeypatch, activation_checkpointing=checkpointing)

    assert floating_dtypes(built.tool, kept=False) == {torch.bfloat16}
    assert floating_dtypes(built.tool, kept=True) <= {torch.float32}
    assert model.tool_dtype == torch.bfloat16
    assert model.prompts.dtype == torch.float32
    assert steps and all(not step.found for step in steps), [step.found[:5] for step in steps]

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    curves = [record["loss_curve"] for record in summary["instances"]]
    assert summary["complete"] and len(curves) == 2 and all(len(c) == 2 for c in curves)
    assert all(math.isfinite(loss) for curve in curves for loss in curve), curves
    assert safetensors_dtypes(tmp_path / "run") == {torch.float32}

    # In process, as validate and test serve: the stored tool under the training precision's autocast.
    request = served_query(built, tmp_path)
    pool = PromptPool.load(tmp_path / "run" / "pool.safetensors", expected=built.tool.pool_spec())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reply = PromptToolServer(built.tool, pool).serve(request)
    assert isinstance(reply, dict) and reply
    # From the export, as `clova-train serve` does (a float32 tool rebuilt from tool.json).
    check_export_serves(built, tmp_path / "run", tmp_path / "export", request)
    assert safetensors_dtypes(tmp_path / "export") == {torch.float32}


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.values[0].tool_class().evaluation_metrics])
def test_bf16_mixed_validates_with_the_stored_tool(recipe: ToolRecipe, build: Callable[[ToolRecipe], BuiltTool],
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning import Trainer

    built = build(recipe)
    model, _ = fit(built, tmp_path / "run", "bf16-mixed", monkeypatch)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path / "run"), precision="bf16-mixed", limit_val_batches=2)
    (metrics,) = trainer.validate(model, datamodule=built.datamodule)
    names = type(built.tool).evaluation_metrics
    assert {f"val/{name}" for name in names} <= set(metrics), metrics
    assert all(0.0 <= metrics[f"val/{name}"] <= 1.0 for name in names), metrics


def test_the_check_sees_the_conversions_of_a_float32_tool_under_autocast(
        build: Callable[[ToolRecipe], BuiltTool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the test above: the same fit with the tool left in float32 converts weights at every step."""
    monkeypatch.setattr(PromptTool, "store_weights_in", lambda self, dtype: self)
    built = build(tool_recipe("clip"))
    _, steps = fit(built, tmp_path / "run", "bf16-mixed", monkeypatch)
    assert steps and all(step.found for step in steps)
    assert {(source, target) for step in steps for _, source, target in step.found} == {(torch.float32, torch.bfloat16)}


def test_32_true_keeps_the_tool_in_float32(build: Callable[[ToolRecipe], BuiltTool], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    built = build(tool_recipe("clip"))
    model, steps = fit(built, tmp_path / "run", "32-true", monkeypatch)
    assert floating_dtypes(built.tool) == {torch.float32} and model.tool_dtype == torch.float32
    assert steps and all(not step.found for step in steps)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_true_low_precisions_are_refused(precision: str, build: Callable[[ToolRecipe], BuiltTool], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    built = build(tool_recipe("clip"))
    with pytest.raises(ModelError, match=f"trainer.precision={precision} would convert the prompts.*use bf16-mixed"):
        fit(built, tmp_path / "run", precision, monkeypatch)
    assert floating_dtypes(built.tool) == {torch.float32}
