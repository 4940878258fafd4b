"""Layer 2, agent runtime: LLM backends and their configs, the persistent call cache and the sandbox for generated
code."""
