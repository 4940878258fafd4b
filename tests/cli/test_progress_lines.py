"""A fit whose output is a log file says how far it is (models/progress_lines.py); on a terminal it leaves that to
the bar."""

from __future__ import annotations

import io
from types import SimpleNamespace

from clova_train.models.progress_lines import ProgressLines


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _trainer(step: int, epoch: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, estimated_stepping_batches=100, current_epoch=epoch, max_epochs=10,
                           callback_metrics={"train/loss": 1.2345, "val/sr": 0.5}, is_global_zero=True)


def test_lines_every_interval_and_at_each_epoch_end_off_a_terminal() -> None:
    stream = io.StringIO()
    lines = ProgressLines(every=0.0, stream=stream)
    lines.on_train_start(_trainer(0), None)
    lines.on_train_batch_end(_trainer(40, epoch=3), None, None, None, 0)
    lines.on_train_epoch_end(_trainer(50, epoch=4), None)
    first, second = stream.getvalue().splitlines()
    assert first.startswith("fit: epoch 4/10, step 40/100, ") and "s left, train/loss 1.234" in first
    assert second.startswith("fit: epoch 5/10, step 50/100") and "val/sr" not in second


def test_nothing_on_a_terminal_or_between_intervals() -> None:
    terminal = _Terminal()
    lines = ProgressLines(every=0.0, stream=terminal)
    lines.on_train_start(_trainer(0), None)
    lines.on_train_epoch_end(_trainer(10), None)
    assert terminal.getvalue() == ""
    quiet = io.StringIO()
    slow = ProgressLines(every=3600.0, stream=quiet)
    slow.on_train_start(_trainer(0), None)
    slow.on_train_batch_end(_trainer(1), None, None, None, 0)
    assert quiet.getvalue() == ""
