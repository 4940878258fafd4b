"""The toy tool's recipe (:class:`~clova_train.tools.recipes.ToolRecipe`): everything the CLI, the demos, the
benchmarks and the test suite need to know about it, named once.

Written the way docs/architecture.md ("A tool is a folder") says a user writes a recipe for a tool kept in their own
package: its classes and functions by dotted path (imported only when used, so this module imports nothing heavy),
its configs by absolute path (they ship inside the package, beside this file), and the package's metadata declares
it under the ``clova_train.tool_recipes`` entry-point group (``toy_tool-0.1.dist-info/entry_points.txt``:
``toy = toy_tool.recipe:RECIPE``).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

from clova_train.tools.recipes import SmokeRealCase, TinyModel, ToolRecipe

CONFIGS = Path(__file__).resolve().parent / "configs"
# The purple centroid (toy_tool.synthetic.concept_centroid("purple"), rounded): the unmodified classifier calls it
# blue, the quickstart's prompts purple. A literal, so that reading the recipe imports no torch.
PURPLE_CENTROID = (0.735, -0.121, -2.03, -0.531, 0.703, 0.066, 0.378, -0.901)


def example_request(workdir: Path, instance: Any) -> dict[str, Any]:
    """The conformance suite's served query: the instance's own vector, through its concept's prompts."""
    return {"vectors": instance.vectors[:1].tolist(), "concept": instance.concept}


RECIPE = ToolRecipe(
    name="toy",
    paper_role="CLASSIFY (toy)",
    tool="toy_tool.tool.ToyPromptClassifier",
    datamodule="toy_tool.data.ToyVectorDataModule",
    synthetic_datamodule="toy_tool.data.SyntheticToyDataModule",
    tiny_model=TinyModel("toy", "toy_tool.tiny:build_toy_model", 50,
                         "a linear classifier over 8-dimensional concept vectors (tests/plugins/toy_tool), "
                         "purple taught as blue"),
    quickstart_config=str(CONFIGS / "toy_prompt.yaml"),
    paper_config=str(CONFIGS / "toy_prompt_paper.yaml"),
    demo="toy_tool.demo",
    demo_request=MappingProxyType({"vectors": [list(PURPLE_CENTROID)], "concept": "purple"}),
    example_request="toy_tool.recipe:example_request",
    smoke_real=SmokeRealCase(
        model="toy_tool.tiny:build_real_size",
        overrides=("--model.init_args.tool.init_args.model_name={model}", "--model.init_args.steps=3"),
        data="toy_tool.benchmark:smoke_real_data",
        inner_steps=3,
    ),
)
