"""The VQA tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`)."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

from clova_train.tools.examples import random_image
from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe


def example_request(workdir: Path, instance: Any) -> dict[str, Any]:
    """The instance's question about a new image."""
    return {"image": random_image(workdir / "query.png"), "question": instance.question}


RECIPE = ToolRecipe(
    name="vqa",
    paper_role="VQA",
    tool="clova_train.tools.vqa.tool.BlipVqa",
    datamodule="clova_train.datamodules.VqaRecordDataModule",
    synthetic_datamodule="clova_train.datamodules.SyntheticVqaDataModule",
    tiny_model=TinyModel("blip", "clova_train.tools.vqa.tiny:make_tiny_blip", 300,
                         "BLIP VQA (transformers), answers to questions about synthetic shapes"),
    quickstart_config="configs/quickstart/vqa_prompt.yaml",
    paper_config="configs/paper/vqa_prompt_blip.yaml",
    demo="clova_train.tools.vqa.demo",
    demo_request=MappingProxyType({
        "image": "checkpoints/data/synthetic_vqa/images/eval_orange_000.png",
        "question": "what colour is the circle?",
    }),
    example_request="clova_train.tools.vqa.recipe:example_request",
    benchmark="clova_train.tools.vqa.benchmark",
    smoke_real=SmokeRealCase(
        model="blip-vqa-capfilt-large",
        overrides=("--model.init_args.tool.init_args.model_name={model}",
                   "--model.init_args.steps=3"),
        data="clova_train.tools.vqa.benchmark:smoke_real_data",
        inner_steps=3,
    ),
)
