"""A prompt tool's benchmark settings: what ``benchmarks/prompt_tuning.py`` and ``benchmarks/prompt_tool_seeds.py`` need
to know about one tool, kept in the tool's folder.

A recipe's ``benchmark`` names a module that may define

* ``PROMPT_TUNING``: a :class:`PromptTuningBenchmark` subclass (the small model of the tool's real architecture the
  speed benchmark tunes on, its data, the table's description and the public procedure the engine is compared with);
* ``SEEDS``: a :class:`SeedMeasurement` (how one seed's export of the tool's quickstart is scored).

A recipe without such a module, or a module without ``PROMPT_TUNING``, is benchmarked by :class:`PromptTuningBenchmark`
itself: the engine against the plain per-instance loop (no ``reference``) on the recipe's tiny model built without
pretraining and on its synthetic datamodule's data. A tool without ``SEEDS`` has no seed measurement.

Nothing here imports Lightning, the LightningModules or the datamodules (the tools sit below them): the benchmark
builds the ``PromptTuning`` module and the ``Trainer`` and hands the datamodule class in.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from clova_train.tools.base import PromptTool
from clova_train.tools.contracts import TrainingInstance
from clova_train.tools.recipes import ToolRecipe

if TYPE_CHECKING:
    from clova_train.tools.prompt_server import PromptToolServer

PROMPT_TUNING_ATTRIBUTE = "PROMPT_TUNING"
SEEDS_ATTRIBUTE = "SEEDS"


def config_init_args(recipe: ToolRecipe, *keys: str) -> dict[str, Any]:
    """The ``init_args`` of the recipe's quickstart config at ``keys`` (``"model"``, ``"tool"``: the tool's), each
    level's own ``init_args`` entered (:meth:`ToolRecipe.quickstart_arguments`)."""
    return recipe.quickstart_arguments(*keys)


def accepted_arguments(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` up to the base classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


class PromptTuningBenchmark:
    """One tool's settings of ``benchmarks/prompt_tuning.py``; as it stands, the generic ones any recipe gets.

    The benchmark calls, in order: :meth:`build_small_model` (or :meth:`model_dir_name` for ``--model-dir``) and
    :meth:`write_data` once; then in each method's process :meth:`make_tool` (wrapped in ``PromptTuning`` there) and
    :meth:`make_datamodule`; the loops run :meth:`fair_prompt` (``sequential``) or :meth:`reference_prompt`
    (``reference``) on each instance (after :meth:`loop_item`); :meth:`describe` heads the table.

    ``module`` below is the ``PromptTuning`` LightningModule: its ``tool``, ``start_prompts``, ``lr`` and ``steps``.

    Attributes:
        reference: the public procedure :meth:`reference_prompt` follows, or None: no ``reference`` method.
        synthetic_data: whether :meth:`make_datamodule` is handed the recipe's synthetic datamodule (which writes its
            data) or its plain one (which reads what :meth:`write_data` wrote).
    """

    reference: ClassVar[str | None] = None
    synthetic_data: ClassVar[bool] = True

    def __init__(self, recipe: ToolRecipe) -> None:
        self.recipe = recipe

    @property
    def lr(self) -> float:
        """The default learning rate: the tool's own (the paper's)."""
        return float(self.recipe.tool_class().default_lr)

    # ------------------------------------------------------------------ model and data (the benchmark's process)
    def build_small_model(self, workdir: Path, args: argparse.Namespace) -> str:
        """A small random model of the tool's real architecture saved under ``workdir``; its model name. Here: the
        recipe's tiny model without pretraining."""
        directory = self.recipe.tiny_model.build(workdir / "model", seed=0, pretrain_steps=0)
        return self.model_dir_name(directory)

    def model_dir_name(self, directory: Path) -> str:
        """The tool's model name for a saved model directory (``--model-dir``). Here: with open_clip's ``local-dir:``
        prefix where the quickstart config's model name has it."""
        return self.recipe.model_name_for(directory)

    def write_data(self, workdir: Path, args: argparse.Namespace, datamodule_class: type) -> Path:
        """Write the benchmark's data (``args.instances`` training instances at least) under ``workdir``; its path.
        Here: the synthetic datamodule renders it."""
        self.make_datamodule(datamodule_class, workdir / "data", 1, args)
        return workdir / "data"

    # ------------------------------------------------------------------ each method's process
    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        """The tool on ``model_name``. Here: the quickstart config's tool arguments, ``--prompt-tokens`` where the
        tool takes ``num_prompt_tokens``."""
        tool_class = self.recipe.tool_class()
        arguments = config_init_args(self.recipe, "model", "tool")
        if "num_prompt_tokens" in accepted_arguments(tool_class):
            arguments["num_prompt_tokens"] = args.prompt_tokens
        return tool_class(**{**arguments, "model_name": model_name})

    def make_datamodule(self, datamodule_class: type, data: Path, chunk_size: int, args: argparse.Namespace) -> Any:
        """The datamodule over ``data`` with chunks of ``chunk_size``, set up. Here: the synthetic datamodule with
        the quickstart config's data arguments, writing (once) under ``data``."""
        arguments = config_init_args(self.recipe, "data")
        accepted = accepted_arguments(datamodule_class)
        arguments.update({k: v for k, v in {"root": str(data), "chunk_size": chunk_size}.items() if k in accepted})
        datamodule = datamodule_class(**arguments)
        datamodule.prepare_data()
        datamodule.setup("fit")
        return datamodule

    def loop_item(self, item: TrainingInstance) -> TrainingInstance:
        """The instance as the sequential loops tune it (the engine gets it unchanged)."""
        return item

    def fair_prompt(self, module: Any, item: TrainingInstance, device: str) -> torch.Tensor:
        """The fair sequential loop: the tool's prompt-independent work once, then only the prompted losses."""
        tool = module.tool
        with torch.no_grad():
            ctx = tool.prepare([item])
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            loss = tool.instance_losses(ctx, prompt).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return prompt.detach()[0].cpu()

    def reference_prompt(self, module: Any, item: TrainingInstance, device: str) -> torch.Tensor:
        """The public procedure (:attr:`reference`) on one instance."""
        raise NotImplementedError(f"the {self.recipe.name} tool's benchmark settings name no public procedure")

    # ------------------------------------------------------------------ the table
    def describe_prompt(self, args: argparse.Namespace) -> str:
        """The prompt's size in the table's description."""
        return f"{args.prompt_tokens} prompt tokens"

    def describe(self, args: argparse.Namespace) -> str:
        """The table's description of the tool, its small model and the data (before the engine's settings)."""
        tool_class = self.recipe.tool_class()
        prompt = (self.describe_prompt(args) if "num_prompt_tokens" in accepted_arguments(tool_class)
                  else "the quickstart config's prompt")
        return (f"tool {self.recipe.name} ({self.recipe.paper_role}: {tool_class.__name__}, tiny "
                f"{self.recipe.tiny_model.kind} model without pretraining, random weights), {prompt}, {args.steps} "
                f"steps, {args.instances} instances (the quickstart config's synthetic data)")


@dataclass(frozen=True)
class SeedMeasurement:
    """How ``benchmarks/prompt_tool_seeds.py`` scores one seed's export of the tool's quickstart.

    Args:
        metric: what a score is, for the table's description.
        columns: the policies scored in each group; the first is the one the others are paired against.
        contrasts: ``(learned, control)`` column pairs also reported as paired differences.
        measure: ``(server, export, seed) -> group -> column -> score`` of the export served by ``server``.
        seeded_data: the quickstart data's arguments set to the seed besides ``render_seed``.
        bounded: the scores are shares in [0, 1] (intervals cut there); False: unbounded (distances).
        score_format: how one seed's score is printed.
        changed: the ``operating point`` quantity that is the share of items whose served output differs from the
            unmodified tool's (the seeds where it is above 0 are counted, and the served pool's gain there reported).
    """

    metric: str
    columns: tuple[str, ...]
    contrasts: tuple[tuple[str, str], ...]
    measure: Callable[[PromptToolServer, Path, int], dict[str, dict[str, float]]]
    seeded_data: tuple[str, ...] = ()
    bounded: bool = True
    score_format: str = "{:.2f}"
    changed: str | None = None


def _settings_module(recipe: ToolRecipe) -> Any:
    return None if recipe.benchmark is None else importlib.import_module(recipe.benchmark)


def prompt_tuning_settings(recipe: ToolRecipe) -> PromptTuningBenchmark:
    """The recipe's prompt-tuning benchmark settings (:class:`PromptTuningBenchmark` where it declares none)."""
    settings = getattr(_settings_module(recipe), PROMPT_TUNING_ATTRIBUTE, PromptTuningBenchmark)
    return settings(recipe)


def seed_measurement(recipe: ToolRecipe) -> SeedMeasurement | None:
    """The recipe's seed measurement, or None where its benchmark settings have none."""
    return getattr(_settings_module(recipe), SEEDS_ATTRIBUTE, None)
