"""The LOC tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`)."""

from __future__ import annotations

from types import MappingProxyType

from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe

RECIPE = ToolRecipe(
    name="loc",
    paper_role="LOC",
    tool="clova_train.tools.loc.tool.OwlVitLoc",
    datamodule="clova_train.datamodules.GroundingDataModule",
    synthetic_datamodule="clova_train.datamodules.SyntheticGroundingDataModule",
    tiny_model=TinyModel("owlvit", "clova_train.tools.loc.tiny:make_tiny_owlvit", 1500,
                         "OWL-ViT detection (transformers), detecting named shapes"),
    quickstart_config="configs/quickstart/loc_prompt.yaml",
    paper_config="configs/paper/loc_prompt_owlvit.yaml",
    demo="clova_train.tools.grounding.demo",
    demo_request=MappingProxyType({
        "image": "checkpoints/data/synthetic_loc/images/00001.png",
        "concept": "purple circle",
        "other_queries": ["red square", "blue triangle"],
    }),
    example_request="clova_train.tools.grounding.examples:example_request",
    benchmark="clova_train.tools.loc.benchmark",
    smoke_real=SmokeRealCase(
        model="owlvit-base-patch32",
        overrides=("--model.init_args.tool.init_args.model_name={model}",
                   "--data.init_args.concept=purple circle",
                   "--data.init_args.num_val_images=1",
                   "--data.init_args.num_eval_images=1",
                   "--model.init_args.steps=3"),
        data="clova_train.tools.grounding.examples:smoke_real_data",
        inner_steps=3,
    ),
)
