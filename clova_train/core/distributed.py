"""Which data-parallel rank this process is, read from a Lightning trainer without importing Lightning."""

from __future__ import annotations

from typing import Any


def data_parallel(trainer: Any) -> tuple[int, int]:
    """(ranks that hold different batches, this rank's place among them) of ``trainer``'s strategy: DDP gives every
    process, ``ModelParallelStrategy`` its data-parallel mesh dimension; (1, 0) without a trainer or on one device."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    return (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (1, 0)
