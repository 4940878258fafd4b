"""Each prompt tool's recipe, declared once: the tool class, its datamodules, the tiny model its quickstart and tests
run on, its configs and its demo report. ``clova-train tiny-model`` and the test fixtures (tiny-model cache, the
conformance suite) read it. The benchmarks keep their own per-tool baselines (each tool's reference loop).

Adding a tool (docs/prompt-tools.md, "Adding a tool"): write the tool class (``clova_train/tools/<name>.py``, one subclass of
:class:`~clova_train.tools.base.PromptTool`), its datamodule, one :class:`ToolRecipe` in :data:`TOOLS` (and a
:class:`TinyModel` in :data:`TINY_MODELS` if no existing one fits), its configs, and tests. Classes are named by
dotted path and imported only when used, so reading the registry is cheap.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from clova_train.core.errors import ClovaTrainError

# What a builder's output depends on besides its own module: the shared builder pieces and the pretraining data
# (synthetic scenes, the tool-use text the tiny Llama reads). The tools' own code is left out: a change there would
# rebuild every model.
FINGERPRINTED_PACKAGES = ("clova_train.quickstart.tiny", "clova_train.synthetic", "clova_train.datamodules",
                          "clova_train.tooluse")


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
            ``make`` and the test fixtures set them.
    """

    kind: str
    builder: str
    pretrain_steps: int
    summary: str
    environment: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def build(self, directory: str | Path, seed: int = 0, pretrain_steps: int | None = None) -> Path:
        """Build the model into ``directory`` (the default step count when ``pretrain_steps`` is None)."""
        steps = self.pretrain_steps if pretrain_steps is None else pretrain_steps
        return Path(self._builder()(directory, seed=seed, pretrain_steps=steps))

    def _builder(self) -> Callable[..., Any]:
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)

    def fingerprint(self) -> str:
        """A hash of the code that builds the model (its module and the tiny-model and synthetic-data modules it
        imports, transitively) and of its build environment: a cache of built models keyed by it rebuilds when the
        builder changes instead of reusing an old model."""
        digest = hashlib.sha256(repr(sorted(self.environment.items())).encode())
        for path in sorted(_source_closure(self.builder.partition(":")[0])):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:12]


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # ``package.name`` where name is a function or class, not a module
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _source_closure(module: str) -> set[Path]:
    """The source files of ``module`` and of every module of :data:`FINGERPRINTED_PACKAGES` it imports, transitively
    (imports inside functions included)."""
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
            pending += [m for m in imported if m.startswith(FINGERPRINTED_PACKAGES)]
    return files


@dataclass(frozen=True)
class ToolRecipe:
    """One prompt tool's pieces, named once.

    Args:
        name: the tool's short name (``make demo-<name>``, benchmark ``--tool``, test ids).
        paper_role: the CLOVA tool it stands for (``"VQA"``, ``"LOC"``...).
        tool: the :class:`~clova_train.tools.base.PromptTool` subclass, as a dotted class path.
        datamodule: the datamodule of the tool's own data files, as a dotted class path.
        synthetic_datamodule: the datamodule that writes synthetic data first (quickstarts, tests).
        tiny_model: the :data:`TINY_MODELS` kind its quickstart and tests run on.
        quickstart_config: the ``clova-train fit`` config of its quickstart (tiny model, synthetic data, CPU).
        paper_config: the config at the paper's model size and settings.
        demo: the module run on the quickstart's export to report what the prompts changed (``python -m``).
    """

    name: str
    paper_role: str
    tool: str
    datamodule: str
    synthetic_datamodule: str
    tiny_model: str
    quickstart_config: str
    paper_config: str
    demo: str | None = None

    def tool_class(self) -> type:
        """The tool class (imports its module)."""
        return _resolve(self.tool)

    def datamodule_class(self, synthetic: bool = False) -> type:
        """The datamodule class (imports its module)."""
        return _resolve(self.synthetic_datamodule if synthetic else self.datamodule)


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


TINY_MODELS: dict[str, TinyModel] = {
    model.kind: model
    for model in (
        TinyModel("clip", "clova_train.quickstart.tiny.clip:build_quickstart_clip", 200,
                  "CLIP (open_clip), contrastive on synthetic shapes, purple and orange mostly misnamed"),
        TinyModel("blip", "clova_train.quickstart.tiny.blip:make_tiny_blip", 300,
                  "BLIP VQA (transformers), answers to questions about synthetic shapes"),
        TinyModel("owlvit", "clova_train.quickstart.tiny.owlvit:make_tiny_owlvit", 1500,
                  "OWL-ViT detection (transformers), detecting named shapes"),
        # MKL's reproducible mode: its own AVX-512 kernels build another segmenter on some Intel hosts (docs/tools/loc-seg.md).
        TinyModel("maskformer", "clova_train.quickstart.tiny.maskformer:make_tiny_maskformer", 2000,
                  "MaskFormer segmentation (transformers, tiny Swin), segmenting shapes of four colours",
                  MappingProxyType({"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"})),
        TinyModel("sd-inpaint", "clova_train.quickstart.tiny.sd_inpaint:make_tiny_inpainting", 1200,
                  "Stable Diffusion inpainting (diffusers): UNet and text encoder inpainting captioned shapes, "
                  "after the VAE's own steps"),
        TinyModel("llama", "clova_train.quickstart.tiny.llama:build_quickstart_llama", 1000,
                  "Llama (transformers), next-token on tool prompts and generic lookup and copy documents, after "
                  "a phase on copy documents alone"),
    )
}

TOOLS: dict[str, ToolRecipe] = {
    recipe.name: recipe
    for recipe in (
        ToolRecipe("clip", "SELECT / CLASSIFY", "clova_train.tools.clip.PromptedClip",
                   "clova_train.datamodules.ConceptFolderDataModule", "clova_train.datamodules.SyntheticConceptDataModule",
                   "clip", "configs/quickstart/clip_prompt.yaml", "configs/paper/clip_prompt_vit_l14.yaml",
                   "clova_train.quickstart.demos.clip"),
        ToolRecipe("vqa", "VQA", "clova_train.tools.blip_vqa.BlipVqa",
                   "clova_train.datamodules.VqaRecordDataModule", "clova_train.datamodules.SyntheticVqaDataModule",
                   "blip", "configs/quickstart/vqa_prompt.yaml", "configs/paper/vqa_prompt_blip.yaml",
                   "clova_train.quickstart.demos.vqa"),
        ToolRecipe("loc", "LOC", "clova_train.tools.owlvit_loc.OwlVitLoc",
                   "clova_train.datamodules.GroundingDataModule", "clova_train.datamodules.SyntheticGroundingDataModule",
                   "owlvit", "configs/quickstart/loc_prompt.yaml", "configs/paper/loc_prompt_owlvit.yaml",
                   "clova_train.quickstart.demos.grounding"),
        ToolRecipe("seg", "SEG", "clova_train.tools.maskformer_seg.MaskFormerSeg",
                   "clova_train.datamodules.GroundingDataModule", "clova_train.datamodules.SyntheticGroundingDataModule",
                   "maskformer", "configs/quickstart/seg_prompt.yaml", "configs/paper/seg_prompt_maskformer.yaml",
                   "clova_train.quickstart.demos.grounding"),
        ToolRecipe("replace", "REPLACE", "clova_train.tools.sd_inpaint_replace.InpaintTextualInversion",
                   "clova_train.datamodules.MaskedConceptDataModule",
                   "clova_train.datamodules.SyntheticMaskedConceptDataModule",
                   "sd-inpaint", "configs/quickstart/replace_prompt.yaml", "configs/paper/replace_prompt_sd_inpaint.yaml",
                   "clova_train.quickstart.demos.replace"),
    )
}


def register_tool(recipe: ToolRecipe, tiny_model: TinyModel | None = None) -> None:
    """Add a recipe (and its tiny model) at run time, as a plug-in package or a test does. A name already taken by
    another entry, or a recipe naming an unknown tiny model, is refused with neither table changed."""
    if recipe.name in TOOLS and TOOLS[recipe.name] != recipe:
        raise ClovaTrainError(f"a recipe named {recipe.name!r} is already registered")
    if tiny_model is not None and tiny_model.kind in TINY_MODELS and TINY_MODELS[tiny_model.kind] != tiny_model:
        raise ClovaTrainError(f"a tiny model named {tiny_model.kind!r} is already registered")
    known = set(TINY_MODELS) | ({tiny_model.kind} if tiny_model is not None else set())
    if recipe.tiny_model not in known:
        raise ClovaTrainError(f"tool recipe {recipe.name!r} names tiny model {recipe.tiny_model!r}, which is not registered "
                              f"(known: {', '.join(sorted(known))})")
    if tiny_model is not None:
        TINY_MODELS[tiny_model.kind] = tiny_model
    TOOLS[recipe.name] = recipe


def tool_recipe(name: str) -> ToolRecipe:
    """The recipe named ``name``, or a :class:`ClovaTrainError` listing the known ones."""
    if name not in TOOLS:
        raise ClovaTrainError(f"unknown tool {name!r} (known: {', '.join(sorted(TOOLS))})")
    return TOOLS[name]


def tiny_model(kind: str) -> TinyModel:
    """The tiny model of kind ``kind``, or a :class:`ClovaTrainError` listing the known ones."""
    if kind not in TINY_MODELS:
        raise ClovaTrainError(f"unknown tiny model {kind!r} (known: {', '.join(sorted(TINY_MODELS))})")
    return TINY_MODELS[kind]

