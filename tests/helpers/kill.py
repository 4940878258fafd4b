"""A callback that kills its own process (SIGKILL, no clean-up) when a given chunk is about to start; the CLI
subprocesses of the tests import it (``tests/`` is on their ``PYTHONPATH``)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAtChunk(Callback):
    """SIGKILL the process at the start of training step ``chunk`` (earlier chunks are checkpointed).

    Args:
        chunk: zero-based index of the chunk at whose start the process dies.
    """

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.chunk:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_at_chunk(chunk: int) -> str:
    """The ``clova-train fit`` argument that adds :class:`KillAtChunk` at ``chunk`` (replacing the configured
    callbacks)."""
    return '--trainer.callbacks=[{"class_path": "helpers.kill.KillAtChunk", "init_args": {"chunk": %d}}]' % chunk
