"""envs/hammr."""
