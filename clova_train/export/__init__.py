"""Layer 4, entry point: exports of every learner (``dispatch.export_run`` for prompt-tool and LoRA runs,
``controller.export_controller`` for controllers)."""

from clova_train.export.dispatch import export_run

__all__ = ["export_run"]
