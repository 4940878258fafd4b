"""A Lightning callback the real-size smoke run adds to a paper config: wall time of every training batch and, for the
first batch, the bytes autograd keeps for backpropagation (``--trainer.callbacks+=``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from clova_train.core.atomic import write_text_atomic


class StepProbe(Callback):
    """Record each training batch's wall time and the activation bytes of the first one, written as JSON at the end.

    Args:
        output: JSON file rank 0 writes when training ends.
        measure_activations: sum the storages autograd saves in the first batch's forward pass (the module's own
            parameters and buffers excluded, each storage once): the activations kept for backward. Checkpointed
            layers keep only their inputs; what they recompute in the backward pass is not counted.
    """

    def __init__(self, output: str, measure_activations: bool = False) -> None:
        self.output = output
        self.measure_activations = measure_activations
        self.seconds: list[float] = []
        self.samples: list[int] = []
        self.tokens: list[int] = []
        self.activation_bytes: int | None = None
        self._start = 0.0
        self._hooks: Any = None
        self._saved: dict[int, int] = {}
        self._weights: set[int] = set()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.measure_activations and self.activation_bytes is None and self._hooks is None:
            self._weights = {t.untyped_storage().data_ptr() for t in [*pl_module.parameters(), *pl_module.buffers()]}
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
            self._hooks.__enter__()
        self._start = time.perf_counter()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._weights:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # What the forward pass saved, before the backward pass recomputes checkpointed layers (their recomputed
        # activations live one layer at a time and are not what the step keeps).
        self._stop_measuring()

    def _stop_measuring(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self.activation_bytes = sum(self._saved.values())
            self._saved = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        if isinstance(batch, dict) and "input_ids" in batch:
            self.samples.append(int(batch["input_ids"].shape[0]))
            mask = batch.get("attention_mask")
            self.tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        else:
            self.samples.append(len(batch) if hasattr(batch, "__len__") else 1)
        self._stop_measuring()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        record = {"batch_seconds": self.seconds, "batch_samples": self.samples, "batch_tokens": self.tokens,
                  "optimizer_steps": int(trainer.global_step), "first_batch_activation_bytes": self.activation_bytes,
                  "world_size": trainer.world_size,
                  "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
        Path(self.output).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.output, json.dumps(record, indent=1))


class ActivationMemory(Callback):
    """Measure, before training starts, what one inner step of prompt tuning keeps per instance in four modes: float32
    and bfloat16 (the tool stored in bf16 under autocast, as ``bf16-mixed`` trains), each with and without activation
    checkpointing through the frozen tool; written as JSON (MB per instance, MB shared by the chunk, and the measured
    step's saved MB by dtype: where float32 copies under autocast go). Run with
    ``--trainer.max_steps=0`` and ``trainer.precision=32-true``: the tool is converted to bfloat16 for the last two.

    Args:
        output: JSON file rank 0 writes.
    """

    def __init__(self, output: str) -> None:
        self.output = output

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        plan = pl_module.plan.instances  # a lazy sequence: indexed, not sliced
        instances = [plan[i] for i in range(min(8, len(plan)))]
        instances = [item for item in instances if not item.keep_unchanged][:2]
        tool = pl_module.tool
        modes: dict[str, dict[str, float]] = {}
        for dtype in (torch.float32, torch.bfloat16):
            tool.store_weights_in(dtype)
            pl_module.tool_dtype = dtype
            for checkpointed in (False, True):
                blocks = tool.set_activation_checkpointing(checkpointed)
                by_dtype: dict[str, int] = {}
                per_instance, shared = pl_module.activation_profile(instances, by_dtype)
                modes[f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}{' checkpointed' if checkpointed else ''}"] = {
                    "mb_per_instance": per_instance / 1e6, "mb_shared": shared / 1e6, "checkpointed_blocks": blocks,
                    "mb_by_dtype": {name: nbytes / 1e6 for name, nbytes in by_dtype.items()}}
        tool.set_activation_checkpointing(False)
        tool.store_weights_in(torch.float32)  # as the run's precision has it (the stop after this evaluates it)
        pl_module.tool_dtype = torch.float32
        Path(self.output).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.output, json.dumps({"instances": len(instances), "modes": modes}, indent=1))
