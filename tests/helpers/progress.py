"""A callback that writes down, on every rank, the epoch's batch count that Lightning announced (what progress
bars, loggers and other callbacks read) and the batches that actually ran, so a test can compare them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class RecordBatchCounts(Callback):
    """Write ``<directory>/batches-rank<R>.json`` with, per training epoch, the announced and the run batch count.

    Args:
        directory: where every rank writes its file.
    """

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.epochs: list[dict[str, object]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        announced = trainer.num_training_batches
        self.epochs.append({"announced": announced if math.isfinite(announced) else None, "ran": 0})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.epochs:  # a run resumed inside its epoch: Lightning does not call on_train_epoch_start
            self.on_train_epoch_start(trainer, pl_module)
            self.epochs[-1]["resumed_at"] = batch_idx
        self.epochs[-1]["ran"] = batch_idx + 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"world_size": trainer.world_size, "has_bar": trainer.progress_bar_callback is not None,
                  "epochs": self.epochs}
        (self.directory / f"batches-rank{trainer.global_rank}.json").write_text(json.dumps(record))


def read_batch_counts(directory: Path) -> list[dict]:
    """Every rank's record, in rank order."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("batches-rank*.json"))]
