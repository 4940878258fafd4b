"""Progress lines for a fit whose output is not a terminal.

Lightning's progress bars redraw one terminal line: in a log file (``make demo-llm > log``, a CI job, a scheduler's
output file) the rich bar draws nothing and the tqdm bar writes carriage returns, so a fit of minutes says nothing
until it ends. :class:`ProgressLines` prints a plain line every 30 seconds (and one when an epoch ends) there, and
nothing on a terminal, where the bar already shows it; ``clova-train fit`` adds it on rank 0.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from lightning.pytorch import Callback, LightningModule, Trainer

from clova_train.core.progress import LOG_EVERY_SECONDS


class ProgressLines(Callback):
    """``fit: epoch 2/10, step 40/100 (batch 10/25), 65 s, about 97 s left, train/loss 1.234`` every ``every``
    seconds and at each epoch's end, when ``stream`` is not a terminal.

    Args:
        every: seconds between lines.
        stream: where the lines go (default stderr).
    """

    def __init__(self, every: float = LOG_EVERY_SECONDS, stream: TextIO | None = None) -> None:
        self.every = every
        self.stream = stream
        self.start = self.last = 0.0

    @property
    def _out(self) -> TextIO:
        return self.stream or sys.stderr

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = self.last = time.monotonic()

    def _line(self, trainer: Trainer) -> str:
        elapsed = time.monotonic() - self.start
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1)
                 else f"epoch {trainer.current_epoch + 1}"]
        if isinstance(total, (int, float)) and math.isfinite(total) and total > 0:
            parts.append(f"step {step}/{int(total)}")
            left = f", about {elapsed / step * (total - step):.0f} s left" if step else ""
        else:
            parts.append(f"step {step}")
            left = ""
        metrics = {k: v for k, v in trainer.callback_metrics.items() if "loss" in k}
        shown = "".join(f", {k} {float(v):.4g}" for k, v in sorted(metrics.items())[:2])
        return f"fit: {', '.join(parts)}, {elapsed:.0f} s{left}{shown}"

    def _print(self, trainer: Trainer) -> None:
        if trainer.is_global_zero and not self._out.isatty():
            self.last = time.monotonic()
            print(self._line(trainer), file=self._out, flush=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if time.monotonic() - self.last >= self.every:
            self._print(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._print(trainer)
