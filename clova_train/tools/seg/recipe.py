"""The SEG tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`)."""

from __future__ import annotations

from types import MappingProxyType

from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe

RECIPE = ToolRecipe(
    name="seg",
    paper_role="SEG",
    tool="clova_train.tools.seg.tool.MaskFormerSeg",
    datamodule="clova_train.datamodules.GroundingDataModule",
    synthetic_datamodule="clova_train.datamodules.SyntheticGroundingDataModule",
    tiny_model=TinyModel("maskformer", "clova_train.tools.seg.tiny:make_tiny_maskformer", 2000,
                         "MaskFormer segmentation (transformers, tiny Swin), segmenting shapes of four colours",
                         # MKL's reproducible mode: its own AVX-512 kernels build another segmenter on some Intel hosts
                         # (docs/tools/loc-seg.md)
                         MappingProxyType({"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"})),
    quickstart_config="configs/quickstart/seg_prompt.yaml",
    paper_config="configs/paper/seg_prompt_maskformer.yaml",
    demo="clova_train.tools.grounding.demo",
    demo_request=MappingProxyType({
        "image": "checkpoints/data/synthetic_seg_red_circle/images/00001.png",
        "concept": "purple circle",
    }),
    example_request="clova_train.tools.grounding.examples:example_request",
    benchmark="clova_train.tools.seg.benchmark",
    smoke_real=SmokeRealCase(
        model="maskformer-swin-base-coco",
        overrides=("--model.init_args.tool.init_args.model_name={model}",
                   "--data.init_args.concept=purple circle",
                   "--data.init_args.num_val_images=1",
                   "--data.init_args.num_eval_images=1",
                   "--model.init_args.steps=3"),
        data="clova_train.tools.grounding.examples:smoke_real_data",
        inner_steps=3,
    ),
)
