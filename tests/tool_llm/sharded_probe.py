"""A callback for the sharded LoRA tests' CLI subprocesses (``tests/`` is on their ``PYTHONPATH``, so it is
``tool_llm.sharded_probe.ShardedStartProbe``): on every rank it records which checkpoints the process loaded with
``from_pretrained``, the bytes of real (not meta) tensors the model held when sharding began, and, once the strategy
has set the model up (``on_fit_start``, ``on_validation_start``), the whole parameters and the non-persistent buffers,
to ``<directory>/<hook>-rank<r>.pt``."""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from clova_train.models.sharded_loading import non_persistent_buffers


class ShardedStartProbe(Callback):
    """Records what each rank loaded and started from (see the module docstring).

    Args:
        directory: where each rank writes its records.
    """

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.loads: list[str] = []
        self.bytes_before_sharding: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before ``configure_model``: count checkpoint loads and measure the model as sharding begins."""
        from transformers import PreTrainedModel

        probe = self
        load = PreTrainedModel.from_pretrained.__func__

        def recording_load(cls: type, name: Any, *args: Any, **kwargs: Any) -> Any:
            probe.loads.append(str(name))
            return load(cls, name, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(recording_load)
        shard = pl_module.shard

        def recording_shard(module: Any, mesh: Any) -> None:
            tensors = chain(module.model.parameters(), module.model.buffers())
            probe.bytes_before_sharding = sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
            shard(mesh)

        pl_module.shard = MethodType(recording_shard, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.record("fit_start", trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.record("validation_start", trainer, pl_module)

    def record(self, hook: str, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.tensor import DTensor

        def whole(tensor: torch.Tensor) -> torch.Tensor:  # a collective for a shard: every rank, in the same order
            return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()

        model = pl_module.model
        record = {
            "loads": list(self.loads),
            "bytes_before_sharding": self.bytes_before_sharding,
            "parameters": {name: whole(p) for name, p in model.named_parameters()},
            "local_shards": {name: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
                             for name, p in model.named_parameters()},
            "buffers": {name: b.detach().cpu().clone() for name, b in non_persistent_buffers(model)},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(record, self.directory / f"{hook}-rank{trainer.global_rank}.pt")
