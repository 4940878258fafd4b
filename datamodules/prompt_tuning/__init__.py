"""datamodules/prompt_tuning."""
