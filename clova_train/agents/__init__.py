"""Layer 2, agent runtime: LLM backends, the persistent call cache and the sandbox for generated code."""
