"""Layer 4, entry point: HYDRA's DQN controller trainer, its callbacks, evaluation and export."""
