"""Per-instance prompt tuning of a frozen tool with a validation gate (CLOVA Sec. 3.4).

Read top to bottom, one training step does this for a chunk of instances (see ``datamodules.chunks``):

1. drop instances already finished (a resumed run skips them);
2. compute everything that does not depend on the prompt once (``prepare_chunk``);
3. give every instance a fresh prompt, seeded by its id, and a fresh optimizer state;
4. take ``steps`` optimizer steps on the *sum* of per-instance losses: instance i's loss depends only on
   prompt row i, and Adam is elementwise, so each row follows exactly the trajectory it would follow if
   the instance were tuned alone, whatever the chunk size or number of devices;
5. gate: keep an instance's prompt only if the tool with it passes the instance's validation data
   (with ``early_stop_every``, an instance that passes earlier stops there and its row is frozen);
6. gather the chunk's results from every rank, so each rank's checkpoint holds all finished instances.

When every instance is finished, rank 0 writes the accepted prompts and their features into the prompt
pool (one file, written atomically, merged with an existing pool if asked) plus a summary and a tool
description. Under DDP, gradient synchronisation is switched off: ranks tune different instances, and
averaging their prompt gradients would mix unrelated instances (sharding strategies such as FSDP are
refused for the same reason; the frozen tools fit on one device).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from abc import abstractmethod
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning import LightningModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ModelError, PoolError
from clova_train.core.pool import PoolSpec, PromptPool

CHECKPOINT_KEY = "clova_train.prompt_tuning"

# Two Lightning warnings that describe this design, not a mistake: the frozen tool is in eval mode on
# purpose, and a per-chunk checkpoint taken after the optimizer steps is exactly the state to resume from.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning)


@dataclass
class GateResult:
    """Outcome of the validation gate for one instance; ``reason`` says why it failed."""

    passed: bool
    reason: str = ""


class PerInstancePromptTuning(LightningModule):
    """Base class: a frozen tool that learns one prompt per training instance, kept only if validated.

    Subclasses set ``self.tool`` and implement the tool-specific hooks below (``prompt_shape``,
    ``prepare_chunk``, ``instance_losses``, ``gate``, ``pool_features``, ``describe_tool``).

    Args:
        lr: Adam learning rate of the prompts.
        steps: optimizer steps per instance.
        early_stop_every: if > 0, run the gate every this many steps and stop an instance as soon as it
            passes (its prompt is frozen from then on); 0 tunes every instance for ``steps`` steps.
        pool_path: where the prompt pool is written (default: ``<trainer.default_root_dir>/pool.safetensors``).
        on_existing_pool: what to do if ``pool_path`` already holds a pool: ``merge`` the new prompts into
            it (instances it already holds are kept), ``overwrite`` it, or raise an ``error``.
        seed: seed of the per-instance prompt initialisation (each instance's init depends only on the
            seed and its instance id).
        max_chunk_size: prompt rows held at once when the datamodule has no ``chunk_size`` attribute;
            larger chunks are tuned in pieces (with identical results).
        keep_rejected_prompts: also keep the prompts and features of rejected instances in the run's
            records and checkpoints, for analysis (they never enter the pool).
    """

    def __init__(
        self,
        lr: float,
        steps: int,
        early_stop_every: int = 0,
        pool_path: str | None = None,
        on_existing_pool: Literal["merge", "overwrite", "error"] = "merge",
        seed: int = 0,
        max_chunk_size: int = 32,
        keep_rejected_prompts: bool = False,
    ) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen tool is rebuilt from its source, not from checkpoints
        self.lr = lr
        self.steps = steps
        self.early_stop_every = early_stop_every
        self.pool_path = pool_path
        self.on_existing_pool = on_existing_pool
        self.seed = seed
        self.max_chunk_size = max_chunk_size
        self.keep_rejected_prompts = keep_rejected_prompts
        self.records: dict[str, dict[str, Any]] = {}
        self.tool: nn.Module

    # ------------------------------------------------------------------ tool-specific hooks
    @property
    @abstractmethod
    def prompt_shape(self) -> tuple[int, ...]:
        """Shape of one instance's prompt."""

    @abstractmethod
    def prepare_chunk(self, chunk: list[dict[str, Any]]) -> Any:
        """Prompt-independent work for the chunk (run once, without gradients)."""

    @abstractmethod
    def instance_losses(self, context: Any, prompts: torch.Tensor) -> torch.Tensor:
        """``[n]`` losses; entry i may depend only on ``prompts[i]``."""

    @abstractmethod
    def gate(self, context: Any, prompts: torch.Tensor) -> list[GateResult]:
        """Validate each instance with its own prompt on its held-out data."""

    @abstractmethod
    def pool_features(self, context: Any) -> torch.Tensor:
        """``[n, d]`` retrieval features of the instances (computed without prompts)."""

    @abstractmethod
    def describe_tool(self) -> dict[str, Any]:
        """JSON description of the frozen tool: enough to rebuild it for serving, with its identity."""

    def pool_spec(self) -> PoolSpec:
        return PoolSpec.from_tool_description(self.describe_tool())

    def init_prompt(self, instance_id: str) -> torch.Tensor:
        """Uniform(-s, s) init seeded by ``(seed, instance_id)``; override ``init_scale`` to change ``s``."""
        digest = hashlib.sha256(f"{self.seed}:{instance_id}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        scale = self.init_scale()
        return (torch.rand(self.prompt_shape, generator=generator, dtype=torch.float64) * 2 - 1) * scale

    def init_scale(self) -> float:
        return 1.0

    # ------------------------------------------------------------------ Lightning plumbing
    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            self._check_strategy()
        if not hasattr(self, "prompts"):
            # Rows for the prompts of one chunk. Its shape is fixed before Lightning wraps the module
            # (DDP keeps autograd's per-parameter state, so the parameter must not be resized later).
            capacity = getattr(self.trainer.datamodule, "chunk_size", None) if self._trainer else None
            self.prompts = nn.Parameter(torch.zeros(capacity or self.max_chunk_size, *self.prompt_shape))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([self.prompts], lr=self.lr)

    def configure_callbacks(self) -> list[Callback]:
        # A checkpoint after every chunk, so a killed run loses at most the chunk in progress.
        return [
            ModelCheckpoint(
                dirpath=Path(self.trainer.default_root_dir) / "checkpoints",
                filename="chunk-{step}",
                save_top_k=0,
                save_last=True,
                every_n_train_steps=1,
            )
        ]

    def _check_strategy(self) -> None:
        strategy = self.trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise ModelError(
                f"per-instance prompt tuning runs on one device or with DDP, not {type(strategy).__name__}: "
                "sharding strategies would split and average the prompts of unrelated instances"
            )

    def _without_gradient_sync(self) -> contextlib.AbstractContextManager:
        # Lightning re-enables DDP's gradient sync after every manual-optimization step, so it is
        # switched off here, around each chunk, rather than once per run.
        model = self.trainer.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    @property
    def finished_instance_ids(self) -> set[str]:
        """Ids of instances already tuned and gated (read by the chunk loader to skip them)."""
        return set(self.records)

    # ------------------------------------------------------------------ one chunk
    def training_step(self, chunk: list[dict[str, Any]], batch_idx: int) -> None:
        chunk = [item for item in chunk if item["instance_id"] not in self.records]
        with self._without_gradient_sync():
            results = self.tune_chunk(chunk) if chunk else []
        results = self._gather_from_ranks(results)
        for record in results:
            self.records[record["instance_id"]] = record
        accepted = sum(r["accepted"] for r in results)
        self.log_dict(
            {
                "chunk/tried": float(len(results)),
                "chunk/accepted": float(accepted),
                "chunk/rejected": float(len(results) - accepted),
                "total/accepted": float(sum(r["accepted"] for r in self.records.values())),
                "total/finished": float(len(self.records)),
            },
            batch_size=max(len(results), 1),
            rank_zero_only=True,
        )
        if results:
            self.log("loss", sum(r["loss"] for r in results) / len(results), prog_bar=True, rank_zero_only=True, batch_size=len(results))
            self.log("accepted", float(sum(r["accepted"] for r in self.records.values())), prog_bar=True, rank_zero_only=True, batch_size=1)

    def tune_chunk(self, chunk: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tune, gate and describe every instance of ``chunk`` (all present in every step)."""
        capacity = self.prompts.shape[0]
        if len(chunk) > capacity:
            return [r for k in range(0, len(chunk), capacity) for r in self.tune_chunk(chunk[k : k + capacity])]
        ids = [item["instance_id"] for item in chunk]
        n = len(ids)
        with torch.no_grad():
            context = self.prepare_chunk(chunk)
            features = self.pool_features(context).detach().float().cpu()
            self.prompts.zero_()
            self.prompts[:n] = torch.stack([self.init_prompt(i) for i in ids]).to(self.prompts)
        optimizer = self.optimizers()
        # Fresh optimizer state per chunk; rows past n get zero gradients and so never move.
        optimizer.optimizer.state.clear()

        active = torch.ones(n, dtype=torch.bool, device=self.device)
        outcome: list[GateResult | None] = [None] * n
        losses = torch.zeros(n)
        for step in range(1, self.steps + 1):
            rows = self.prompts[:n]
            step_losses = self.instance_losses(context, rows)
            losses = torch.where(active.cpu(), step_losses.detach().float().cpu(), losses)
            optimizer.zero_grad()
            self.manual_backward(step_losses[active].sum())
            frozen = self.prompts.data[:n][~active].clone()
            optimizer.step()
            self.prompts.data[:n][~active] = frozen
            if self.early_stop_every and step % self.early_stop_every == 0 and step < self.steps:
                self._early_stop(context, active, outcome)
                if not active.any():
                    break
        with torch.no_grad():
            final = self.gate(context, self.prompts[:n].detach())
        for i in range(n):
            if outcome[i] is None:
                outcome[i] = final[i]

        prompts = self.prompts[:n].detach().float().cpu()
        records = []
        for i, item in enumerate(chunk):
            result = outcome[i]
            assert result is not None
            keep = result.passed or self.keep_rejected_prompts
            records.append(
                {
                    "instance_id": ids[i],
                    "concept": item["concept"],
                    "accepted": bool(result.passed),
                    "reason": result.reason if not result.passed else "",
                    "loss": float(losses[i]),
                    "feature": features[i].clone() if keep else None,
                    "prompt": prompts[i].clone() if keep else None,
                }
            )
        return records

    def _early_stop(self, context: Any, active: torch.Tensor, outcome: list[GateResult | None]) -> None:
        with torch.no_grad():
            results = self.gate(context, self.prompts[: len(outcome)].detach())
        for i, result in enumerate(results):
            if active[i] and result.passed:
                active[i] = False
                outcome[i] = result

    def _gather_from_ranks(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return results
        gathered: list[list[dict[str, Any]] | None] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, results)
        return [record for part in gathered for record in (part or [])]

    # ------------------------------------------------------------------ end of run
    def on_train_epoch_end(self) -> None:
        # One pass over the pending instances is the whole job.
        self.trainer.should_stop = True

    def on_train_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        pending = self._pending_count()
        if pending:
            rank_zero_info(
                f"{pending} instance(s) not finished; no pool written. Resume with --ckpt_path last to finish."
            )
            self._write_summary(complete=False)
            return
        pool_path, added = self.write_pool()
        summary = self._write_summary(complete=True)
        rank_zero_info(
            f"Prompt pool: {pool_path} ({added} prompt(s) added; accepted {summary['accepted']} of "
            f"{summary['tried']}, rejected {summary['rejected']})"
        )

    def _pending_count(self) -> int:
        loader = self.trainer.train_dataloader
        dataset = getattr(getattr(loader, "dataset", None), "dataset", None)
        ids = getattr(dataset, "instance_ids", None)
        return 0 if ids is None else sum(1 for i in ids if i not in self.records)

    def resolved_pool_path(self) -> Path:
        return Path(self.pool_path) if self.pool_path else Path(self.trainer.default_root_dir) / "pool.safetensors"

    def build_pool(self) -> PromptPool:
        """A pool of every accepted instance recorded so far."""
        return pool_from_records(self.pool_spec(), self.records)

    def write_pool(self) -> tuple[Path, int]:
        path = self.resolved_pool_path()
        pool = self.build_pool()
        added = len(pool)
        if path.exists():
            if self.on_existing_pool == "error":
                raise PoolError(f"prompt pool {path} already exists (on_existing_pool='error')")
            if self.on_existing_pool == "merge":
                existing = PromptPool.load(path, expected=pool.spec)
                added = existing.merge(pool)
                pool = existing
        pool.save(path)
        write_json_atomic(path.with_name("tool.json"), self.describe_tool())
        return path, added

    def summary(self) -> dict[str, Any]:
        """Counts of tried / accepted / rejected instances, per concept, and of rejections per reason."""
        records = list(self.records.values())
        per_concept: dict[str, dict[str, int]] = {}
        for r in records:
            entry = per_concept.setdefault(r["concept"], {"tried": 0, "accepted": 0, "rejected": 0})
            entry["tried"] += 1
            entry["accepted" if r["accepted"] else "rejected"] += 1
        # One count per failure kind per instance ("held-out positive", "held-out negative", ...).
        reasons = Counter(
            kind
            for r in records
            if not r["accepted"]
            for kind in sorted({part.split(":")[0].strip() for part in r["reason"].split(";")})
        )
        return {
            "tried": len(records),
            "accepted": sum(r["accepted"] for r in records),
            "rejected": sum(not r["accepted"] for r in records),
            "per_concept": per_concept,
            "rejection_reasons": dict(reasons),
            "instances": [
                {k: r[k] for k in ("instance_id", "concept", "accepted", "reason", "loss")}
                for r in sorted(records, key=lambda r: r["instance_id"])
            ],
        }

    def _write_summary(self, complete: bool) -> dict[str, Any]:
        summary = {"complete": complete, **self.summary()}
        write_json_atomic(self.resolved_pool_path().with_name("summary.json"), summary)
        return summary

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The frozen tool and the working prompts are not state: only the finished instances are.
        checkpoint["state_dict"] = {}
        checkpoint[CHECKPOINT_KEY] = {"records": self.records, "tool": self.describe_tool()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            raise ModelError("checkpoint holds no prompt-tuning state (was it written by another module?)")
        saved, current = state["tool"], self.describe_tool()
        if saved["identity"] != current["identity"] or saved["prompt_shape"] != current["prompt_shape"]:
            raise ModelError(
                f"checkpoint was written for tool {saved['identity']} with prompt shape {saved['prompt_shape']}, "
                f"but this run has {current['identity']} with prompt shape {current['prompt_shape']}"
            )
        self.records = dict(state["records"])


def pool_from_records(spec: PoolSpec, records: dict[str, dict[str, Any]]) -> PromptPool:
    """Build a pool of the accepted records (sorted by instance id, so the order is reproducible)."""
    pool = PromptPool(spec)
    by_concept: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records.values(), key=lambda r: r["instance_id"]):
        if record["accepted"]:
            by_concept.setdefault(record["concept"], []).append(record)
    for concept, recs in by_concept.items():
        pool.add(
            concept,
            torch.stack([r["feature"] for r in recs]),
            torch.stack([r["prompt"] for r in recs]),
            [r["instance_id"] for r in recs],
        )
    return pool
