"""One conformance suite for every prompt tool with a recipe (:func:`clova_train.tools.recipes.tool_recipes`).

Each recipe is checked the same way, so a new tool is covered by its recipe:

1. its configs exist and name its tool class and one of its datamodules (the recipe cannot drift from them);
2. its tool, built from its quickstart config on its tiny model (random weights), keeps the prompt-tool contract
   (``check_tool``) on instances from its synthetic datamodule;
3. a two-instance, two-step fit writes a run that exports, and the export loads in
   :class:`~clova_train.tools.prompt_server.PromptToolServer` and answers a served query.

The checks are plain functions of a recipe (and what was built from it): ``test_adding_a_tool.py`` runs them on a
toy tool from a test folder. The served query is the recipe's ``example_request`` (requests are the tool's own
JSON, which no interface describes); a recipe without one is served a guess (its image field and a concept) and, if
that fails, the failure says where to add it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from clova_train.core.errors import DataError
from clova_train.tools.recipes import ToolRecipe, tool_recipes
from helpers.conformance import (
    check_recipe_configs,
    BuiltTool,
    build_recipe,
    check_contract,
    fit_briefly,
    check_export_serves,
    served_query,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------- the suite
RECIPES = [pytest.param(recipe, id=name) for name, recipe in tool_recipes().items()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_configs_name_the_recipes_classes(recipe: ToolRecipe) -> None:
    check_recipe_configs(recipe)


@pytest.fixture(scope="module")
def built_tools(tiny_models: Callable[[str], Path],
                tmp_path_factory: pytest.TempPathFactory) -> Callable[[ToolRecipe], BuiltTool]:
    """Each recipe built once per module (its contract and its fit test share the tool and the data)."""
    cache: dict[str, BuiltTool] = {}

    def build(recipe: ToolRecipe) -> BuiltTool:
        if recipe.name not in cache:
            cache[recipe.name] = build_recipe(recipe, tiny_models(recipe.tiny_model),
                                              tmp_path_factory.mktemp(f"{recipe.name}-data"))
        return cache[recipe.name]

    return build


@pytest.mark.parametrize("recipe", RECIPES)
def test_tool_keeps_the_prompt_tool_contract(recipe: ToolRecipe,
                                             built_tools: Callable[[ToolRecipe], BuiltTool]) -> None:
    report = check_contract(built_tools(recipe))
    assert report["tool"] == recipe.tool_class().name


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_short_fit_exports_and_serves(recipe: ToolRecipe, built_tools: Callable[[ToolRecipe], BuiltTool],
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = built_tools(recipe)
    run_dir = fit_briefly(built, tmp_path / "run")
    request = served_query(built, tmp_path)
    try:
        check_export_serves(built, run_dir, tmp_path / "export", request)
    except DataError as err:
        if recipe.example_request is not None:
            raise
        pytest.fail(f"the guessed request {request} does not fit the {recipe.name!r} tool ({err}); give its recipe an "
                    f"example_request (clova_train/tools/recipes.py)")
    check_documented_requests(recipe, tmp_path / "export", tmp_path / "docs", monkeypatch)


def check_documented_requests(recipe: ToolRecipe, export: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/http-api.md's JSON requests for this tool's endpoint, with the images they name in the working
    directory, are answered by the export (the live server runs the CLIP ones: tests/serving/test_http_serving.py)."""
    import json
    import re

    from clova_train.tools.prompt_server import PromptToolServer
    from helpers.common import REPO
    from helpers.conformance import write_image
    from helpers.docs import shell_commands

    endpoint = f"/v1/{recipe.tool_class().name} "
    bodies = [json.loads(m.group(1)) for c in shell_commands(REPO / "docs" / "http-api.md")
              if endpoint in c + " " and (m := re.search(r"-d '(\{.*?\})'", c))]
    if recipe.tool_class().__module__.startswith("clova_train.tools."):
        assert bodies, f"docs/http-api.md shows no JSON request for {endpoint.strip()}"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    write_image(workdir / "a.png", 64)
    write_image(workdir / "b.png", 64, seed=1)
    server = PromptToolServer.from_export(export)
    for body in bodies:
        reply = server.serve(body)
        assert isinstance(reply, dict) and reply and json.dumps(reply), (body, reply)
