"""envs/avis."""
