"""Each prompt tool's recipe: what the CLI, the demos, the benchmarks and the test suite need to know about a tool,
declared once in the tool's own folder.

A tool is a folder, ``clova_train/tools/<name>/``: its tool class (``tool.py``), synthetic data writer
(``synthetic.py``), tiny-model builder (``tiny.py``), demo (``demo.py``), benchmark settings (``benchmark.py``) and a
``recipe.py`` whose ``RECIPE`` is a :class:`ToolRecipe` naming them. :func:`tool_recipes` finds every folder of this
package that has a ``recipe.py``, every recipe an installed package declares under the ``clova_train.tool_recipes``
entry-point group (a tool outside this package: docs/architecture.md, "Adding a tool") and those registered at run time
with :func:`register_tool`. Classes and functions are named by dotted path and imported only when used, so reading the
recipes is cheap.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from clova_train.core.errors import ClovaTrainError

RECIPE_ENTRY_POINT_GROUP = "clova_train.tool_recipes"
TOOLS_PACKAGE = __name__.rpartition(".")[0]

# What a builder's output depends on besides its own module: the shared builder pieces, the synthetic data it
# pretrains on (the shared scenes, each tool's writer, the tool-use text the tiny Llama reads). The tools' own code is
# left out: a change there would rebuild every model.
FINGERPRINTED_PACKAGES = ("clova_train.synthetic", "clova_train.datamodules", "clova_train.tooluse",
                          "clova_train.tools.tiny_common", "clova_train.quickstart.tiny_llama")
FINGERPRINTED_TOOL_MODULES = ("tiny", "synthetic")  # clova_train.tools.<name>.tiny / .synthetic


def resolve(dotted: str) -> Any:
    """The object ``"package.module:name"`` or ``"package.module.name"`` names (imports its module)."""
    module, colon, name = dotted.partition(":")
    if not colon:
        module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TinyModel:
    """A tiny model of a real architecture, saved in its library's own layout (``clova-train tiny-model KIND DIR``).

    Args:
        kind: the name ``clova-train tiny-model`` takes.
        builder: ``"module:function"``; the function takes ``(directory, seed=..., pretrain_steps=...)`` and returns
            the directory it wrote.
        pretrain_steps: the builder's default pretraining steps (the quickstart's model).
        summary: what the model is and what its pretraining teaches, for ``--help``.
        environment: variables the building process must start with (math-library modes read at load time), as
            the demos and the test fixtures set them.
    """

    kind: str
    builder: str
    pretrain_steps: int
    summary: str
    environment: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def build(self, directory: str | Path, seed: int = 0, pretrain_steps: int | None = None) -> Path:
        """Build the model into ``directory`` (the default step count when ``pretrain_steps`` is None)."""
        steps = self.pretrain_steps if pretrain_steps is None else pretrain_steps
        return Path(resolve(self.builder)(directory, seed=seed, pretrain_steps=steps))

    def fingerprint(self) -> str:
        """A hash of the code that builds the model (its module and the builder and synthetic-data modules it
        imports, transitively) and of its build environment: a cache of built models keyed by it rebuilds when the
        builder changes instead of reusing an old model."""
        digest = hashlib.sha256(repr(sorted(self.environment.items())).encode())
        for path in sorted(source_closure(self.builder.partition(":")[0])):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:12]


def _fingerprinted(module: str) -> bool:
    if module.startswith(FINGERPRINTED_PACKAGES):
        return True
    package, _, name = module.rpartition(".")
    return package.rpartition(".")[0] == TOOLS_PACKAGE and name in FINGERPRINTED_TOOL_MODULES


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ModuleNotFoundError, ValueError):  # ``package.name`` where name is a function or class, not a module
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def source_closure(module: str) -> set[Path]:
    """The source files of ``module`` and of every fingerprinted module it imports, transitively (imports inside
    functions included)."""
    seen: set[str] = set()
    files: set[Path] = set()
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        files.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from package import module`` imports the module too: try each name as a submodule
                imported = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            pending += [m for m in imported if _fingerprinted(m)]
    return files


@dataclass(frozen=True)
class SmokeRealCase:
    """How ``benchmarks/smoke_real.py`` runs the tool's paper config at the real model's size (random weights).

    Args:
        model: the real-size model: a name of ``benchmarks/real_size/models.py``'s table, or ``"module:function"``
            building one into a directory.
        overrides: ``clova-train fit`` options of the run, ``{model}`` standing for the model's directory.
        data: ``"module:function"`` taking ``(workdir, full)``: writes the synthetic data at the paper config's own
            paths under ``workdir`` (``full``: one whole chunk of the config's) and returns the JSON request to serve
            (paths relative to ``workdir``).
        inner_steps: prompt-tuning steps per instance the overrides set.
    """

    model: str
    overrides: tuple[str, ...]
    data: str
    inner_steps: int


@dataclass(frozen=True)
class ToolRecipe:
    """One prompt tool's pieces, named once.

    Args:
        name: the tool's short name (``make demo-<name>``, benchmark ``--tool``, test ids).
        paper_role: the CLOVA tool it stands for (``"VQA"``, ``"LOC"``...).
        tool: the :class:`~clova_train.tools.base.PromptTool` subclass, as a dotted class path.
        datamodule: the datamodule of the tool's own data files, as a dotted class path.
        synthetic_datamodule: the datamodule that writes synthetic data first (quickstarts, tests).
        tiny_model: the tiny model its quickstart, demo and tests run on.
        quickstart_config: the ``clova-train fit`` config of its quickstart (tiny model, synthetic data, CPU), relative
            to the repository or absolute.
        paper_config: the config at the paper's model size and settings (same).
        demo: the module run on the quickstart's export to report what the prompts changed (``python -m``).
        demo_request: a JSON request ``make demo-<name>`` serves after the demo (``{run}`` stands for the run
            directory; an ``output`` file is written under the run directory, ``serve --output-dir``), or None.
        example_request: ``"module:function"`` taking ``(workdir, instance)``: a request the tool serves for that
            training instance's concept, with any image it needs written under ``workdir`` (the conformance suite).
        benchmark: the module of its ``benchmarks/prompt_tuning.py`` settings (the small model, data and the public
            procedure it is compared with), or None: the benchmark then times the engine against the plain
            per-instance loop on the tiny model's architecture and the synthetic datamodule's data.
        smoke_real: how the real-size smoke run drives its paper config, or None (not run there).
    """

    name: str
    paper_role: str
    tool: str
    datamodule: str
    synthetic_datamodule: str
    tiny_model: TinyModel
    quickstart_config: str
    paper_config: str
    demo: str | None = None
    demo_request: Mapping[str, Any] | None = None
    example_request: str | None = None
    benchmark: str | None = None
    smoke_real: SmokeRealCase | None = None

    def tool_class(self) -> type:
        """The tool class (imports its module)."""
        return resolve(self.tool)

    def datamodule_class(self, synthetic: bool = False) -> type:
        """The datamodule class (imports its module)."""
        return resolve(self.synthetic_datamodule if synthetic else self.datamodule)

    def quickstart_arguments(self, *keys: str) -> dict[str, Any]:
        """The ``init_args`` of the quickstart config at ``keys`` (``"model", "tool"``: the tool's; ``"data"``: the
        datamodule's), each level's own ``init_args`` entered; ``{}`` where the config has none."""
        from clova_train.core.safe_files import read_yaml

        section: Any = read_yaml(Path(self.quickstart_config), "quickstart config")
        for key in keys:
            section = ((section or {}).get(key) or {}).get("init_args") or {}
        return dict(section)

    def model_name_for(self, directory: str | Path) -> str:
        """The tool's ``model_name`` for a saved model directory: with open_clip's ``local-dir:`` prefix where the
        quickstart config's model name has it."""
        from clova_train.tools.pretrained import LOCAL_DIR_PREFIX

        configured = str(self.quickstart_arguments("model", "tool").get("model_name", ""))
        return f"{LOCAL_DIR_PREFIX if configured.startswith(LOCAL_DIR_PREFIX) else ''}{directory}"

    def quickstart_tool(self, model_dir: str | Path, **overrides: Any) -> Any:
        """The tool with the quickstart config's arguments on the model saved in ``model_dir`` (``overrides`` last)."""
        arguments = {**self.quickstart_arguments("model", "tool"), "model_name": self.model_name_for(model_dir)}
        return self.tool_class()(**{**arguments, **overrides})


_REGISTERED: dict[str, ToolRecipe] = {}


def _shipped_recipes() -> list[ToolRecipe]:
    package = importlib.import_module(TOOLS_PACKAGE)
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"{TOOLS_PACKAGE}.{info.name}.recipe") is not None:
            found.append(importlib.import_module(f"{TOOLS_PACKAGE}.{info.name}.recipe").RECIPE)
    return found


def _installed_recipes() -> list[ToolRecipe]:
    from importlib.metadata import entry_points

    found = []
    for entry in entry_points(group=RECIPE_ENTRY_POINT_GROUP):
        try:
            recipe = entry.load()
        except Exception as error:  # a broken plug-in names itself instead of breaking every command
            raise ClovaTrainError(f"the tool recipe {entry.name!r} ({entry.value}, entry point group "
                                  f"{RECIPE_ENTRY_POINT_GROUP!r}) failed to load: {error}") from error
        if not isinstance(recipe, ToolRecipe):
            raise ClovaTrainError(f"the entry point {entry.name!r} ({entry.value}) of group {RECIPE_ENTRY_POINT_GROUP!r} "
                                  f"is a {type(recipe).__name__}, not a ToolRecipe")
        found.append(recipe)
    return found


def tool_recipes() -> dict[str, ToolRecipe]:
    """Every recipe by name: this package's tool folders, then installed plug-ins, then run-time registrations. Two
    different recipes under one name are an error naming both, and so are two different tiny models of one kind (a
    plug-in's would otherwise replace a shipped tool's model in ``clova-train tiny-model`` without a word)."""
    recipes: dict[str, ToolRecipe] = {}
    kinds: dict[str, ToolRecipe] = {}
    for recipe in (*_shipped_recipes(), *_installed_recipes(), *_REGISTERED.values()):
        known = recipes.get(recipe.name)
        if known is not None and known != recipe:
            raise ClovaTrainError(f"two tool recipes are named {recipe.name!r}: {known.tool} and {recipe.tool}")
        recipes[recipe.name] = recipe
        other = kinds.setdefault(recipe.tiny_model.kind, recipe)
        if other.tiny_model != recipe.tiny_model:
            raise ClovaTrainError(f"two tiny models are named {recipe.tiny_model.kind!r}: the {other.name!r} recipe's "
                                  f"({other.tiny_model.builder}) and the {recipe.name!r} recipe's "
                                  f"({recipe.tiny_model.builder})")
    return recipes


def register_tool(recipe: ToolRecipe) -> None:
    """Add a recipe at run time (a program or test that cannot install an entry point). A name already taken by
    another recipe, or a tiny-model kind another recipe's model has, is refused and nothing is registered."""
    for known in tool_recipes().values():
        if known.name == recipe.name and known != recipe:
            raise ClovaTrainError(f"a recipe named {recipe.name!r} is already registered")
        if known.tiny_model.kind == recipe.tiny_model.kind and known.tiny_model != recipe.tiny_model:
            raise ClovaTrainError(f"a tiny model named {recipe.tiny_model.kind!r} is already registered")
    _REGISTERED[recipe.name] = recipe


def unregister_tool(name: str) -> None:
    """Remove a recipe :func:`register_tool` added (nothing if there is none)."""
    _REGISTERED.pop(name, None)


def tool_recipe(name: str) -> ToolRecipe:
    """The recipe named ``name``, or a :class:`ClovaTrainError` listing the known ones."""
    recipes = tool_recipes()
    if name not in recipes:
        raise ClovaTrainError(f"unknown tool {name!r} (known: {', '.join(sorted(recipes))})")
    return recipes[name]


def recipe_for_tool_class(class_path: str) -> ToolRecipe | None:
    """The recipe whose tool class is ``class_path``, or None."""
    return next((r for r in tool_recipes().values() if r.tool == class_path), None)

