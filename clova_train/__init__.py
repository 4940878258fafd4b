"""clova-train: Lightning training for LLM + visual-tool agents (CLOVA prompts, GPT4Tools LoRA, HYDRA controllers)."""

__version__ = "0.1.0"
