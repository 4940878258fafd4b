"""Layer 4, entry point: ``clova-train export`` for prompt-tool and LoRA runs."""

from clova_train.export.runs import export_run

__all__ = ["export_run"]
