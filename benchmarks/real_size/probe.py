"""A Lightning callback the real-size smoke run adds to a paper config: wall time of every training batch, for the
first batch the bytes autograd keeps for backpropagation, and on a GPU the peak memory of each phase of the fit
(``--trainer.callbacks+=``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from clova_train.core.atomic import write_text_atomic
from clova_train.core.saved_tensors import SavedTensorBytes


class CudaPeakMemory:
    """torch's peak allocated bytes on the current CUDA device since the last :meth:`reset`."""

    def reset(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())


class PhasePeaks:
    """The peak memory of each phase of a fit, the largest over its occurrences, from a gauge with ``reset()`` and
    ``peak()``. Phases follow one another: starting one ends the one before."""

    def __init__(self, gauge: Any) -> None:
        self.gauge = gauge
        self.peaks: dict[str, int] = {}
        self.current: str | None = None
        self._overall = 0

    def start(self, phase: str) -> None:
        self.end()
        self.gauge.reset()
        self.current = phase

    def end(self) -> None:
        peak = self.gauge.peak()  # outside a phase too: the gap since the last reset counts for the whole fit
        self._overall = max(self._overall, peak)
        if self.current is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.current = None

    def overall(self) -> int:
        """The peak over the whole measurement, the resets notwithstanding."""
        return max(self._overall, self.gauge.peak())


class StepProbe(Callback):
    """Record each training batch's wall time and the activation bytes of the first one, and on a GPU the peak memory
    of each phase of the fit; written as JSON at the end.

    Args:
        output: JSON file rank 0 writes when training ends.
        measure_activations: sum the storages autograd saves in the first batch's forward pass (the module's own
            parameters and buffers excluded, each storage once): the activations kept for backward. Checkpointed
            layers keep only their inputs; what they recompute in the backward pass is not counted.
        phase_memory: on a CUDA device, torch's peak allocated bytes in each phase: ``training step`` and
            ``validation``; for prompt tuning the training step split into ``prepare`` (the chunk's inputs, once),
            ``inner steps`` (forward and backward through the frozen tool, the optimizer) and ``gate`` (and the
            records after it). Not measured on the CPU (resetting the peak resident set would also reset the peak a
            parent reads from the process's rusage).
    """

    def __init__(self, output: str, measure_activations: bool = False, phase_memory: bool = True) -> None:
        self.output = output
        self.measure_activations = measure_activations
        self.phase_memory = phase_memory
        self.phases: PhasePeaks | None = None
        self._split = False
        self.seconds: list[float] = []
        self.samples: list[int] = []
        self.tokens: list[int] = []
        self.activation_bytes: int | None = None
        self._start = 0.0
        self._saved: SavedTensorBytes | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.phases is None and self.phase_memory and pl_module.device.type == "cuda":
            self.phases = PhasePeaks(CudaPeakMemory())
        tool = getattr(pl_module, "tool", None)
        if self.phases is not None and tool is not None and hasattr(tool, "prepare") and hasattr(tool, "gate"):
            self._split_training_step(trainer, tool)
            self._split = True

    def _split_training_step(self, trainer: Trainer, tool: Any) -> None:
        """Wrap the prompt tool's ``prepare`` and ``gate`` on this instance: inside a training step each starts its
        phase and, when it returns, the next one (validation calls them too and keeps its own phase)."""
        phases = self.phases
        assert phases is not None
        prepare, gate = tool.prepare, tool.gate

        def timed_prepare(*args: Any, **kwargs: Any) -> Any:
            if not trainer.training:
                return prepare(*args, **kwargs)
            phases.start("prepare")
            result = prepare(*args, **kwargs)
            phases.start("inner steps")
            return result

        def timed_gate(*args: Any, **kwargs: Any) -> Any:
            if not trainer.training:
                return gate(*args, **kwargs)
            phases.start("gate")
            return gate(*args, **kwargs)

        tool.prepare, tool.gate = timed_prepare, timed_gate

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.phases is not None:
            self.phases.start("validation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.phases is not None:
            self.phases.end()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.phases is not None and not self._split:
            self.phases.start("training step")
        if self.measure_activations and self.activation_bytes is None and self._saved is None:
            self._saved = SavedTensorBytes([*pl_module.parameters(), *pl_module.buffers()]).__enter__()
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # What the forward pass saved, before the backward pass recomputes checkpointed layers (their recomputed
        # activations live one layer at a time and are not what the step keeps).
        self._stop_measuring()

    def _stop_measuring(self) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self.activation_bytes = self._saved.total
            self._saved = None

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
        if self.phases is not None:
            self.phases.end()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        record = {"batch_seconds": self.seconds, "batch_samples": self.samples, "batch_tokens": self.tokens,
                  "optimizer_steps": int(trainer.global_step), "first_batch_activation_bytes": self.activation_bytes,
                  "world_size": trainer.world_size,
                  "peak_gpu_bytes": (self.phases.overall() if self.phases is not None else
                                     torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None),
                  "phase_peak_bytes": self.phases.peaks if self.phases is not None else None}
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
