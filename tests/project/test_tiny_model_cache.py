"""The pretrained tiny models' test cache is keyed by a hash of their builders' code: a changed builder (or a module
of the tiny-model packages it imports) gets a new cache entry, never an old model."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clova_train.core.errors import ClovaTrainError
from clova_train.quickstart.tiny_models import tiny_models
from clova_train.tools import recipes
from clova_train.tools.recipes import TinyModel, ToolRecipe
from helpers.tiny_models import cache_name

BUILDER = """
from probe_tiny.shared import WIDTH


def build(directory, seed=0, pretrain_steps=0):
    return directory
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TinyModel, Path]]:
    """A builder module in a throw-away package that the fingerprint follows (as it follows the tiny-model
    packages), importing one shared module of the package."""
    package = tmp_path / "probe_tiny"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shared.py").write_text("WIDTH = 32\n")
    (package / "unrelated.py").write_text("DEPTH = 2\n")
    (package / "builder.py").write_text(BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(recipes, "FINGERPRINTED_PACKAGES", (*recipes.FINGERPRINTED_PACKAGES, "probe_tiny"))
    yield TinyModel("probe", "probe_tiny.builder:build", 10, "a probe"), package
    for name in [n for n in sys.modules if n == "probe_tiny" or n.startswith("probe_tiny.")]:
        del sys.modules[name]  # find_spec imported the package


def test_the_fingerprint_follows_the_builder_and_the_modules_it_imports(probe: tuple[TinyModel, Path]) -> None:
    model, package = probe
    first = model.fingerprint()
    assert model.fingerprint() == first
    (package / "unrelated.py").write_text("DEPTH = 3\n")
    assert model.fingerprint() == first, "a module the builder does not import is not part of its code"
    (package / "shared.py").write_text("WIDTH = 64\n")
    second = model.fingerprint()
    assert second != first
    (package / "builder.py").write_text(BUILDER.replace("return directory", "return str(directory)"))
    assert model.fingerprint() not in (first, second)


def test_the_fingerprint_follows_a_module_imported_from_its_package(probe: tuple[TinyModel, Path]) -> None:
    """``from package import module`` (as the tiny Llama imports its skill documents) brings the module's code in."""
    model, package = probe
    (package / "builder.py").write_text(BUILDER.replace("from probe_tiny.shared import WIDTH",
                                                        "from probe_tiny import shared, unrelated as other"))
    first = model.fingerprint()
    (package / "unrelated.py").write_text("DEPTH = 3\n")
    assert model.fingerprint() != first


def test_a_refused_registration_changes_no_table() -> None:
    tools, models = dict(recipes.tool_recipes()), dict(tiny_models())
    clash = TinyModel("clip", "elsewhere:build", 1, "another clip")
    recipe = ToolRecipe("probe-tool", "PROBE", "x.Tool", "x.Data", "x.Synthetic", clash, "q.yaml", "p.yaml")
    with pytest.raises(ClovaTrainError, match="a tiny model named 'clip' is already registered"):
        recipes.register_tool(recipe)
    renamed = ToolRecipe("clip", "PROBE", "x.Tool", "x.Data", "x.Synthetic", TinyModel("probe", "x:b", 1, "p"),
                         "q.yaml", "p.yaml")
    with pytest.raises(ClovaTrainError, match="a recipe named 'clip' is already registered"):
        recipes.register_tool(renamed)
    assert recipes.tool_recipes() == tools and tiny_models() == models


def test_the_cache_name_changes_with_the_builder_the_steps_and_the_kernels(probe: tuple[TinyModel, Path]) -> None:
    model, package = probe
    base = {"ATEN_CPU_CAPABILITY": "default"}
    name = cache_name(model, base=base)
    assert name.startswith("tiny-probe-10-") and model.fingerprint() in name
    assert cache_name(model, 20, base=base) != name
    assert cache_name(model, base={"ATEN_CPU_CAPABILITY": "avx512"}) != name
    (package / "builder.py").write_text(BUILDER + "\n# another pretraining schedule\n")
    assert cache_name(model, base=base) != name


def test_every_registry_builder_is_fingerprinted_with_its_shared_pieces() -> None:
    for model in tiny_models().values():
        files = {path.name for path in recipes.source_closure(model.builder.partition(":")[0])}
        assert f"{model.builder.split(':')[0].rsplit('.', 1)[-1]}.py" in files
        assert "tiny_common.py" in files, f"{model.kind}: the shared builder pieces are part of its fingerprint"
    maskformer = tiny_models()["maskformer"]
    assert maskformer.fingerprint() != TinyModel(**{**maskformer.__dict__, "environment": {}}).fingerprint()


def test_a_recipe_cannot_take_the_llamas_kind(restored_registry_state: None) -> None:
    from clova_train.quickstart.tiny_models import LLAMA

    recipes.register_tool(ToolRecipe("probe-tool", "PROBE", "x.Tool", "x.Data", "x.Synthetic",
                                     TinyModel(LLAMA.kind, "x:b", 1, "p"), "q.yaml", "p.yaml"))
    with pytest.raises(ClovaTrainError, match="'probe-tool' names its tiny model 'llama'"):
        tiny_models()


@pytest.fixture
def restored_registry_state() -> Iterator[None]:
    registered = dict(recipes._REGISTERED)
    yield
    recipes._REGISTERED.clear()
    recipes._REGISTERED.update(registered)
