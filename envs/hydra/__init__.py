"""envs/hydra."""
