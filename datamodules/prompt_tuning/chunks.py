"""Chunks of not-yet-finished training instances: the data plumbing of every per-instance prompt tuner.

Per-instance prompt tuning trains each instance once. A chunk of up to ``chunk_size`` instances is tuned
in lockstep inside one ``training_step``; the LightningModule records every finished instance (accepted or
rejected) in its checkpoint. :class:`PendingChunks` asks which instances are finished *when iteration
starts*, so a run resumed from a checkpoint yields only the remaining ones, however far the killed run had
got. (Lightning's batch-count resume is not used: it cannot know which batches a killed run had finished,
and chunk composition does not change any instance's result.)

Under DDP the chunks are dealt round-robin to ranks, and every rank yields the same number of chunks (the
last ones may be empty) because the module gathers results across ranks after each chunk.

The stream has a length, so Lightning itself knows the epoch's batch count (progress bars, loggers and any
other callback read it through ``trainer.num_training_batches``, on every rank). On resume Lightning counts
the batches the killed run had finished in the epoch as done, so the length is those chunks plus the pending
ones: the module tells how many it had counted (``chunks_done`` in :meth:`PromptTuningDataModule.connect`).

:class:`PromptTuningDataModule` is the base of every prompt-tuning datamodule: a subclass only builds its
instances (``build_instances``) and, if it wants, evaluation loaders. The module connects to it once
(:meth:`PromptTuningDataModule.connect`): it hands over how to ask which instances are finished and gets
the :class:`~clova_train.tools.contracts.ChunkPlan` (chunk size, instance ids) back.
"""

from __future__ import annotations

import math
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterator

from lightning import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from clova_train.core.errors import DataError
from clova_train.tools.contracts import ChunkPlan, InstanceDataset, TrainingInstance

# Lightning warns that an IterableDataset's length may be wrong with several workers; PendingChunks deals its
# chunks to the workers (see __iter__), so its length holds whatever their number.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined", category=UserWarning)
# ... and, on a resume inside the epoch, that the loader cannot resume: PendingChunks yields only the instances
# not finished yet, so it resumes where the killed run stopped.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended",
                        category=UserWarning)


class PendingChunks(IterableDataset):
    """Iterate over chunks (lists of instance dicts) of the instances not yet finished.

    Args:
        dataset: the instances.
        chunk_size: instances tuned together in one training step.
        finished: returns the ids of finished instances; called at the start of every iteration.
        rank: this process's rank.
        world_size: number of processes.
        chunks_done: returns how many chunks of the current epoch were already trained before this stream
            was made (non-zero only when a killed run resumes inside its epoch); part of the length.
    """

    def __init__(
        self,
        dataset: InstanceDataset,
        chunk_size: int,
        finished: Callable[[], set[str] | frozenset[str]] = frozenset,
        rank: int = 0,
        world_size: int = 1,
        chunks_done: Callable[[], int] = int,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.dataset = dataset
        self.chunk_size = chunk_size
        self.finished = finished
        self.rank = rank
        self.world_size = world_size
        self.chunks_done = chunks_done

    def chunk_indices(self) -> list[list[int]]:
        """This rank's chunks (dataset indices), padded with empty chunks to the common count."""
        done = self.finished()
        pending = [i for i, iid in enumerate(self.dataset.instance_ids) if iid not in done]
        chunks = [pending[k : k + self.chunk_size] for k in range(0, len(pending), self.chunk_size)]
        per_rank = math.ceil(len(chunks) / self.world_size)
        mine = chunks[self.rank :: self.world_size]
        return mine + [[] for _ in range(per_rank - len(mine))]

    def pending_chunk_count(self) -> int:
        """Chunks this rank will yield from now on (the same on every rank)."""
        return len(self.chunk_indices())

    def __len__(self) -> int:
        """The epoch's batch count as Lightning counts it: chunks already trained in it plus those pending."""
        return self.chunks_done() + self.pending_chunk_count()

    def __iter__(self) -> Iterator[list[TrainingInstance]]:
        chunks = self.chunk_indices()
        worker = get_worker_info()
        if worker is not None:
            chunks = chunks[worker.id :: worker.num_workers]
        for chunk in chunks:
            yield [self.dataset[i] for i in chunk]


def keep_chunk(chunk: list[TrainingInstance]) -> list[TrainingInstance]:
    """Collate function for :class:`PendingChunks` (a chunk is already a batch)."""
    return chunk


class PromptTuningDataModule(LightningDataModule):
    """Base of prompt-tuning datamodules: chunks of pending instances for training, dealt to ranks.

    Args:
        chunk_size: instances tuned together in one training step (results do not depend on it; larger
            chunks are faster and hold more prompts in memory at once).
        num_workers: DataLoader worker processes.
    """

    def __init__(self, chunk_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        if chunk_size < 1:
            raise DataError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.num_workers = num_workers
        self.instances: InstanceDataset | None = None
        self._finished: Callable[[], set[str]] = set
        self._chunks_done: Callable[[], int] = int

    @abstractmethod
    def build_instances(self) -> InstanceDataset:
        """Read (and check) the training instances; called once by ``setup``."""

    def setup(self, stage: str | None = None) -> None:
        if self.instances is None:
            self.instances = self.build_instances()
            ids = list(self.instances.instance_ids)
            if len(set(ids)) != len(ids):
                duplicate = next(i for i in ids if ids.count(i) > 1)
                raise DataError(f"{type(self).__name__}: instance id {duplicate!r} occurs more than once")

    def connect(self, finished: Callable[[], set[str]], chunks_done: Callable[[], int] = int) -> ChunkPlan:
        """The hand-off with the prompt-tuning module (call after ``setup``): which instances are finished and
        how many chunks of the current epoch it has trained (see :class:`PendingChunks`)."""
        if self.instances is None:
            self.setup("fit")
        assert self.instances is not None
        self._finished = finished
        self._chunks_done = chunks_done
        return ChunkPlan(self.chunk_size, tuple(self.instances.instance_ids), self.instances)

    def train_dataloader(self) -> DataLoader:
        if self.instances is None:
            self.setup("fit")
        rank = self.trainer.global_rank if self.trainer is not None else 0
        world = self.trainer.world_size if self.trainer is not None else 1
        chunks = PendingChunks(self.instances, self.chunk_size, self._finished, rank, world, self._chunks_done)
        return DataLoader(chunks, batch_size=None, collate_fn=keep_chunk, num_workers=self.num_workers)
