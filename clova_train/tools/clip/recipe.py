"""The SELECT / CLASSIFY tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clova_train.tools.examples import random_image
from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe


def example_request(workdir: Path, instance: Any) -> dict[str, Any]:
    """A classification request over the instance's candidate labels."""
    return {"images": [random_image(workdir / "query.png")], "labels": list(instance.candidates)}


RECIPE = ToolRecipe(
    name="clip",
    paper_role="SELECT / CLASSIFY",
    tool="clova_train.tools.clip.tool.PromptedClip",
    datamodule="clova_train.datamodules.ConceptFolderDataModule",
    synthetic_datamodule="clova_train.datamodules.SyntheticConceptDataModule",
    tiny_model=TinyModel("clip", "clova_train.tools.clip.tiny:build_quickstart_clip", 200,
                         "CLIP (open_clip), contrastive on synthetic shapes, purple and orange mostly misnamed"),
    quickstart_config="configs/quickstart/clip_prompt.yaml",
    paper_config="configs/paper/clip_prompt_vit_l14.yaml",
    demo="clova_train.tools.clip.demo",
    demo_request=None,
    example_request="clova_train.tools.clip.recipe:example_request",
    benchmark="clova_train.tools.clip.benchmark",
    smoke_real=SmokeRealCase(
        model="clip-vit-l14",
        overrides=("--model.init_args.tool.init_args.model_name=local-dir:{model}",
                   "--model.init_args.tool.init_args.pretrained=null",
                   "--model.init_args.steps=3"),
        data="clova_train.tools.clip.benchmark:smoke_real_data",
        inner_steps=3,
    ),
)
