"""Layer 2, LLM backends: chat and embedding backends (served, local, hashing), their configs and the persistent
call cache."""
