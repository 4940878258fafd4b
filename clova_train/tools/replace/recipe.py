"""The REPLACE tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`)."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

from clova_train.tools.examples import random_image, square_mask
from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe


def example_request(workdir: Path, instance: Any) -> dict[str, Any]:
    """An inpainting request of the instance's concept into a new image's masked square."""
    return {"image": random_image(workdir / "query.png", 16), "mask": square_mask(workdir / "mask.png"),
            "concept": instance.concept, "output": str(workdir / "served.png"), "seed": 0}


RECIPE = ToolRecipe(
    name="replace",
    paper_role="REPLACE",
    tool="clova_train.tools.replace.tool.InpaintTextualInversion",
    datamodule="clova_train.datamodules.MaskedConceptDataModule",
    synthetic_datamodule="clova_train.datamodules.SyntheticMaskedConceptDataModule",
    tiny_model=TinyModel("sd-inpaint", "clova_train.tools.replace.tiny:make_tiny_inpainting", 1200,
                         "Stable Diffusion inpainting (diffusers): UNet and text encoder inpainting captioned shapes, "
                         "after the VAE's own steps"),
    quickstart_config="configs/quickstart/replace_prompt.yaml",
    paper_config="configs/paper/replace_prompt_sd_inpaint.yaml",
    demo="clova_train.tools.replace.demo",
    demo_request=MappingProxyType({
        "image": "checkpoints/data/synthetic_masked_concepts/orange_circle/orange_circle_000.png",
        "mask": "checkpoints/data/synthetic_masked_concepts/orange_circle/masks/orange_circle_000.png",
        "concept": "orange_circle",
        "output": "export/demo/served.png",  # under the run folder: the demo serves with --output-dir <run>
        "seed": 0,
    }),
    example_request="clova_train.tools.replace.recipe:example_request",
    benchmark="clova_train.tools.replace.benchmark",
    smoke_real=SmokeRealCase(
        model="sd-inpainting",
        overrides=("--model.init_args.tool.init_args.model_name={model}",
                   "--model.init_args.tool.init_args.gate_timesteps=1",
                   "--model.init_args.tool.init_args.gate_noise_draws=1",
                   "--model.init_args.tool.init_args.num_inference_steps=2",
                   "--model.init_args.steps=2"),
        data="clova_train.tools.replace.benchmark:smoke_real_data",
        inner_steps=2,
    ),
)
