"""envs/common."""
