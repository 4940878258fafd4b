"""Chunks of not-yet-finished training instances: the train loader of every per-instance prompt tuner.

Per-instance prompt tuning trains each instance once. A chunk of up to ``chunk_size`` instances is
tuned in lockstep inside one ``training_step``; the LightningModule records every finished instance
(accepted or rejected) in its checkpoint. This iterable asks the module which instances are finished
*when iteration starts*, so a run resumed from a checkpoint yields only the remaining ones, however far
the killed run had got. (Lightning's batch-count resume is not used: it cannot know which batches a
killed run had finished, and chunk composition does not change any instance's result.)

Under DDP the chunks are dealt round-robin to ranks, and every rank yields the same number of chunks
(the last ones may be empty) because the module gathers results across ranks after each chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from torch.utils.data import IterableDataset, get_worker_info


class InstanceDataset(Protocol):
    """A map-style dataset whose items are dicts with an ``"instance_id"`` key."""

    instance_ids: Sequence[str]

    def __getitem__(self, index: int) -> dict[str, Any]: ...

    def __len__(self) -> int: ...


class PendingChunks(IterableDataset):
    """Iterate over chunks (lists of instance dicts) of the instances not yet finished.

    Args:
        dataset: the instances.
        chunk_size: instances tuned together in one training step.
        finished: returns the ids of finished instances; called at the start of every iteration.
        rank: this process's rank.
        world_size: number of processes.
    """

    def __init__(
        self,
        dataset: InstanceDataset,
        chunk_size: int,
        finished: Callable[[], set[str] | frozenset[str]] = frozenset,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.dataset = dataset
        self.chunk_size = chunk_size
        self.finished = finished
        self.rank = rank
        self.world_size = world_size

    def chunk_indices(self) -> list[list[int]]:
        """This rank's chunks (dataset indices), padded with empty chunks to the common count."""
        done = self.finished()
        pending = [i for i, iid in enumerate(self.dataset.instance_ids) if iid not in done]
        chunks = [pending[k : k + self.chunk_size] for k in range(0, len(pending), self.chunk_size)]
        per_rank = math.ceil(len(chunks) / self.world_size)
        mine = chunks[self.rank :: self.world_size]
        return mine + [[] for _ in range(per_rank - len(mine))]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        chunks = self.chunk_indices()
        worker = get_worker_info()
        if worker is not None:
            chunks = chunks[worker.id :: worker.num_workers]
        for chunk in chunks:
            yield [self.dataset[i] for i in chunk]


def keep_chunk(chunk: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collate function for :class:`PendingChunks` (a chunk is already a batch)."""
    return chunk
