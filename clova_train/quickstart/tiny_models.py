"""Every tiny model ``clova-train tiny-model`` builds: each tool recipe's (:mod:`clova_train.tools.recipes`) and the
tool-using LLM's, a Llama no prompt tool owns."""

from __future__ import annotations

from clova_train.core.errors import ClovaTrainError
from clova_train.tools.recipes import TinyModel, tool_recipes

LLAMA = TinyModel("llama", "clova_train.quickstart.tiny_llama:build_quickstart_llama", 1000,
                  "Llama (transformers), next-token on tool prompts and generic lookup and copy documents, after a "
                  "phase on copy documents alone")


def tiny_models() -> dict[str, TinyModel]:
    """The tiny models by kind: the tool recipes' in their order, then the Llama."""
    recipes = tool_recipes()
    models = {recipe.tiny_model.kind: recipe.tiny_model for recipe in recipes.values()}
    if LLAMA.kind in models:
        taker = next(name for name, recipe in recipes.items() if recipe.tiny_model.kind == LLAMA.kind)
        raise ClovaTrainError(f"the tool recipe {taker!r} names its tiny model {LLAMA.kind!r}, the tool-using LLM's "
                              "kind: give it another")
    return {**models, LLAMA.kind: LLAMA}


def tiny_model(kind: str) -> TinyModel:
    """The tiny model of kind ``kind``, or a :class:`ClovaTrainError` listing the known ones."""
    models = tiny_models()
    if kind not in models:
        raise ClovaTrainError(f"unknown tiny model {kind!r} (known: {', '.join(sorted(models))})")
    return models[kind]
