"""Sharding tool-instruction data across ranks so that N processes train exactly what one process would.

* :class:`GlobalBatchSampler`: the one-device order (length-grouped mega-batches, or a plain permutation),
  cut into global batches of ``batch_size x num_replicas``; rank ``r`` takes the ``r``-th slice of each. The
  union over ranks of each step's batches is the one-device batch of ``batch_size x num_replicas`` samples,
  so with the loss normalised by the global count of response tokens
  (:meth:`~clova_train.models.LoraToolLLM.response_loss`) N ranks and one device take the same optimizer steps.
  A last global batch too short to give every rank a sample gives the ranks left out a *weightless* copy (an
  index ``>= len(dataset)``; :class:`WeightlessPadding` returns it with no labelled token): every rank runs
  the same number of steps, nothing is counted twice. It can resume inside an epoch (:meth:`skip`).
* :class:`ShardedEvalSampler`: rank ``r`` evaluates samples ``r, r + N, ...``, each exactly once; shards are
  padded to one length with weightless copies (every rank runs the same number of generation batches, which a
  sharded model needs), and the metric ignores them.
* Resuming inside an epoch: the data module's ``state_dict`` records the epoch and the batches consumed, and
  :meth:`GlobalBatchSampler.skip` starts the resumed epoch at the next batch instead of its first.

All are ``DistributedSampler`` subclasses, so Lightning keeps them instead of putting its own in their place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

IGNORE_INDEX = -100


def length_grouped_order(lengths: list[int], mega: int, seed: int) -> list[int]:
    """Shuffled mega-batches of ``mega`` indices, each sorted longest first (neighbours have similar lengths)."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    grouped: list[int] = []
    for start in range(0, len(order), mega):
        grouped += sorted(order[start: start + mega], key=lambda i: -lengths[i])
    return grouped


class WeightlessPadding(Dataset):
    """``dataset`` for indices ``< n``; index ``n + i`` is sample ``i`` with no labelled token (weight 0) and
    ``padding: True`` (an evaluation copy the metric skips)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.dataset)
        if index < n:
            return self.dataset[index]
        item = dict(self.dataset[index - n])
        if "labels" in item:
            item["labels"] = [IGNORE_INDEX] * len(item["labels"])
        item["padding"] = True
        return item


class GlobalBatchSampler(DistributedSampler):
    """Rank ``rank``'s share of the one-device training order (see the module docstring).

    Args:
        lengths: token count of each sample.
        batch_size: samples per rank per step.
        num_replicas: ranks (1: the one-device order itself).
        rank: this rank.
        seed: shuffling seed (combined with the epoch).
        group_by_length: length-grouped mega-batches of 50 global batches; false: a plain permutation.
    """

    def __init__(self, lengths: list[int], batch_size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 group_by_length: bool = True) -> None:
        self.lengths, self.batch_size, self.group_by_length = lengths, batch_size, group_by_length
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.dataset = lengths  # what DistributedSampler keeps; unused
        self._skip: tuple[int, int] | None = None  # (epoch, global batches already consumed in it)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def order(self) -> list[int]:
        """The one-device order of this epoch."""
        if self.group_by_length:
            return length_grouped_order(self.lengths, self.global_batch * 50, self.seed + self.epoch)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.lengths), generator=generator).tolist()

    def shards(self) -> list[list[int]]:
        """This rank's batches of the epoch (weightless copies where a short last batch leaves it nothing)."""
        order, n, b = self.order(), len(self.lengths), self.batch_size
        batches = []
        for start in range(0, len(order), self.global_batch):
            chunk = order[start: start + self.global_batch]
            mine = chunk[self.rank * b: (self.rank + 1) * b]
            batches.append(mine or [chunk[0] + n])
        return batches

    def skip(self, epoch: int, batches: int) -> None:
        """Start epoch ``epoch`` after its first ``batches`` batches (a run resumed inside that epoch)."""
        self._skip = (epoch, batches)

    def __iter__(self) -> Iterator[int]:  # a generator: runs at the first batch, after Lightning's set_epoch
        batches = self.shards()
        if self._skip is not None and self._skip[0] == self.epoch:
            batches = batches[self._skip[1]:]
        elif self._skip is not None and self.epoch > self._skip[0]:
            self._skip = None
        for batch in batches:
            yield from batch

    def __len__(self) -> int:
        return sum(len(batch) for batch in self.shards())


class ShardedEvalSampler(DistributedSampler):
    """Samples ``rank, rank + num_replicas, ...`` in order, padded with weightless copies to one length per rank.

    Args:
        size: samples in the evaluation set.
        num_replicas: ranks.
        rank: this rank.
    """

    def __init__(self, size: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.size, self.num_replicas, self.rank, self.epoch = size, num_replicas, rank, 0
        self.dataset = range(size)

    def __iter__(self) -> Iterator[int]:
        mine = list(range(self.rank, self.size, self.num_replicas))
        per_rank = -(-self.size // self.num_replicas)
        return iter(mine + [self.size + (i % max(1, self.size)) for i in range(per_rank - len(mine))])

    def __len__(self) -> int:
        return -(-self.size // self.num_replicas)
