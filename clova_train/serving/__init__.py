"""Serving exports over HTTP: what stands in front of the models (request guard: API key, limits, errors)."""
