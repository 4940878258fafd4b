"""LightningModules of clova-train (installed as ``clova_train.models``)."""

from clova_train.models.lora_tool_llm import LoraToolLLM
from clova_train.models.prompt_tuning import PromptTuning

__all__ = ["LoraToolLLM", "PromptTuning"]
