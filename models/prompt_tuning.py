"""Per-instance prompt tuning of any frozen prompt tool, with a validation gate (CLOVA Sec. 3.4).

Read top to bottom, one training step does this for a chunk of instances (``datamodules.chunks``):

1. drop instances already finished (a resumed run skips them);
2. compute everything that does not depend on the prompt once (``tool.prepare``);
3. give every instance a fresh prompt, seeded by its id (around the tool's ``initial_prompts``), and a fresh
   optimizer state;
4. take ``steps`` Adam steps on the *sum* of per-instance losses: instance i's loss depends only on prompt
   row i, and Adam is elementwise, so each row follows exactly the trajectory it would follow if the
   instance were tuned alone, whatever the chunk size or number of devices;
5. gate: keep an instance's prompt only if the tool with it passes the instance's validation data (with
   ``early_stop_every``, an instance that passes ``tool.quick_gate`` earlier stops there, its row frozen);
6. gather the chunk's records from every rank, so each rank's checkpoint holds all finished instances.

Every rank takes exactly one counted optimizer step per chunk, empty padding chunks included (the inner
steps go to the raw optimizer), so global steps, checkpoints and their collectives stay in lockstep
whatever the split of chunks over ranks.

When every instance is finished, rank 0 writes into the run directory the pool of this run's accepted
prompts, ``summary.json`` and ``tool.json`` (what ``clova-train export RUN`` reads) and, when
``pool_path`` names a shared pool, merges the accepted prompts into it as well. Under DDP gradient
synchronisation is off: ranks tune different instances, and averaging their gradients would mix unrelated
instances (sharding strategies are refused for the same reason; the frozen tools fit on one device).

Precision: under ``bf16-mixed`` the frozen tool is stored in bfloat16 once, at setup (``PromptTool.store_weights_in``),
so autocast never casts its weights again; the prompts, their Adam state, the pool and the records stay float32, and
the tools compute their losses and gates from float32 logits. ``activation_checkpointing`` recomputes the tool's
repeated blocks in the backward pass instead of keeping their activations (``PromptTool.checkpoint_blocks``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from filelock import FileLock
from lightning import LightningModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torchmetrics import MeanMetric

from clova_train.core.atomic import write_json_atomic, write_text_atomic
from clova_train.core.errors import DataError, ModelError, PoolError
from clova_train.core.pool import PoolSpec, PromptPool, control_pool, merge_into_file
from clova_train.core.precision import precision_dtype
from clova_train.core.safe_files import read_json_object
from clova_train.core.saved_tensors import SavedTensorBytes
from clova_train.core.evaluation_report import SampleTable, format_report
from clova_train.tools.base import PromptTool
from clova_train.tools.contracts import ChunkPlan, ChunkSource, InstanceRecord, TrainingInstance
from clova_train.core.run_manifest import POOL_FILE, SUMMARY_FILE, TOOL_FILE
from clova_train.tools.prompt_server import PromptToolServer

CHECKPOINT_KEY = "clova_train.prompt_tuning"
EVALUATION_DIR = "evaluation"
CONTROLS = ("zero_prompt", "random_prompt", "ungated")
POOL_SUFFIX = "_pool"


def control_metric(pool_metric: str, control: str) -> str:
    """``accuracy_pool`` under the ``zero_prompt`` control is logged as ``accuracy_zero_prompt``."""
    return pool_metric[: -len(POOL_SUFFIX)] + "_" + control

# Two Lightning warnings that describe this design, not a mistake: the frozen tool is in eval mode on
# purpose, and a per-chunk checkpoint taken after the optimizer steps is exactly the state to resume from.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning)


def summary_of(tool: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
    """A run summary from its instances' records (:meth:`InstanceRecord.summary`): counts of tried / accepted /
    rejected instances, per concept, and of rejections per kind."""
    per_concept: dict[str, dict[str, int]] = {}
    for item in instances:
        entry = per_concept.setdefault(str(item["concept"]), {"tried": 0, "accepted": 0, "rejected": 0})
        entry["tried"] += 1
        entry["accepted" if item["accepted"] else "rejected"] += 1
    reasons = Counter(kind for item in instances if not item["accepted"]
                      for kind in sorted({r["kind"] for r in item["rejections"]}))
    return {
        "tool": tool,
        "tried": len(instances),
        "accepted": sum(bool(item["accepted"]) for item in instances),
        "rejected": sum(not item["accepted"] for item in instances),
        "per_concept": per_concept,
        "rejection_reasons": dict(reasons),
        "instances": instances,
    }


def earlier_instances(path: Path, tool: str) -> list[dict[str, Any]]:
    """The instance records of the summary at ``path`` that other runs of ``tool`` wrote; none when there is no file.
    A file that is not such a summary is replaced, with a warning naming it."""
    if not path.exists():
        return []
    try:
        summary = read_json_object(path, "run summary")
    except DataError as err:
        rank_zero_warn(f"{err}; it is replaced by this run's summary")
        return []
    instances = summary.get("instances")
    if summary.get("tool") != tool or not isinstance(instances, list) or not all(_is_instance_record(i) for i in instances):
        rank_zero_warn(f"run summary {path} is not a summary of {tool!r} runs; it is replaced by this run's summary")
        return []
    return instances


def _is_instance_record(item: Any) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("instance_id"), str) and "concept" in item
            and isinstance(item.get("accepted"), bool) and isinstance(item.get("rejections"), list)
            and all(isinstance(r, dict) and isinstance(r.get("kind"), str) for r in item["rejections"]))


class PromptTuning(LightningModule):
    """Learn one prompt per training instance for a frozen tool; keep it only if the tool then validates.

    Args:
        tool: the frozen prompt tool (``class_path`` of a :class:`~clova_train.tools.base.PromptTool`
            subclass, e.g. ``clova_train.tools.clip.tool.PromptedClip``, with its ``init_args``).
        lr: Adam learning rate of the prompts (default: the tool's paper value).
        steps: optimizer steps per instance (default: the tool's paper value).
        early_stop_every: if > 0, run the tool's quick gate every this many steps and stop an instance as
            soon as it passes (its prompt is frozen from then on); 0 tunes every instance for ``steps``.
        pool_path: a shared prompt pool to merge this run's accepted prompts into, in addition to the
            run directory's own ``pool.safetensors``.
        on_existing_pool: when the pool file already exists: ``merge`` the new prompts into it (instances
            it holds are kept), ``overwrite`` it, or raise an ``error``.
        seed: seed of the per-instance prompt initialisation (an instance's init depends only on the seed
            and its id).
        keep_rejected_prompts: also keep rejected instances' prompts and features in the run's records and
            checkpoints, for analysis and the ``ungated`` control (they never enter the pool).
        validation_gate: keep only prompts that pass the tool's gate (CLOVA). ``false`` puts every tuned prompt
            into the pool (the gate still runs and its verdicts are recorded): the paper's "w/o validation"
            ablation, for measuring what the gate is worth.
        evaluation_controls: what ``validate`` / ``test`` score beside the unmodified tool and the pool, on the
            same samples: ``zero_prompt`` (the pool's entries with every prompt zero: every shipped tool then
            serves exactly as the unmodified tool, so it checks the serving path), ``random_prompt`` (every prompt
            replaced by a random one of its norm: the same retrieval, decision rule and perturbation size with
            nothing learned) and ``ungated`` (every tuned prompt, rejected ones included,
            as if there were no validation gate; needs ``keep_rejected_prompts``). Tools that name each
            sample's concept also get a per-concept table with 95% intervals in ``<run>/evaluation/``.
        max_memory_gb: memory budget, in GB, for what one inner step keeps for backpropagation (the activations
            through the frozen tool). The first chunk measures it (the bytes autograd saves for one and for two
            instances) and every chunk is then tuned in sub-chunks of as many instances as fit; null: a whole
            chunk at once. Results do not depend on it (each instance's loss depends only on its own prompt).
        activation_checkpointing: recompute each repeated block of the frozen tool (its ``checkpoint_blocks``: CLIP's
            vision blocks, BLIP's answer-decoder layers, OWL-ViT's vision layers, MaskFormer's decoder layers, the
            Stable Diffusion UNet's blocks and text-encoder layers) in the backward pass instead of keeping its
            activations: less memory per instance (more instances per inner step under ``max_memory_gb``) for about
            one more forward pass per step. Same losses and prompts; gates and serving are unchanged.
    """

    run_kind = "prompt_tuning"  # what this learner's ``run.json`` calls its runs (:mod:`clova_train.core.run_manifest`)

    def __init__(
        self,
        tool: PromptTool,
        lr: float | None = None,
        steps: int | None = None,
        early_stop_every: int = 0,
        pool_path: str | None = None,
        on_existing_pool: Literal["merge", "overwrite", "error"] = "merge",
        seed: int = 0,
        keep_rejected_prompts: bool = False,
        validation_gate: bool = True,
        evaluation_controls: list[Literal["zero_prompt", "random_prompt", "ungated"]] = ["zero_prompt", "ungated"],  # noqa: B006
        max_memory_gb: float | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(tool, PromptTool):
            raise ModelError(f"tool must be a PromptTool, got {type(tool).__name__}")
        self.save_hyperparameters(ignore=["tool"])
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen tool is rebuilt from its source, not from checkpoints
        self.tool = tool
        self.lr = float(lr if lr is not None else tool.default_lr)
        self.steps = int(steps if steps is not None else tool.default_steps)
        if self.steps < 1:
            raise ModelError(f"steps must be >= 1, got {self.steps}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ModelError(f"lr must be a positive number, got {self.lr} (0 would save untrained prompts)")
        if early_stop_every < 0:
            raise ModelError(f"early_stop_every must be >= 0, got {early_stop_every}")
        self.early_stop_every = early_stop_every
        self.pool_path = pool_path
        self.on_existing_pool = on_existing_pool
        self.seed = seed
        self.keep_rejected_prompts = keep_rejected_prompts
        self.validation_gate = validation_gate
        if max_memory_gb is not None and not max_memory_gb > 0:
            raise ModelError(f"max_memory_gb must be a positive number of GB (or null), got {max_memory_gb}")
        self.max_memory_gb = max_memory_gb
        self.activation_checkpointing = activation_checkpointing
        self.tool_dtype = torch.float32  # the frozen tool's dtype, from the trainer's precision at setup
        self.instances_per_step: int | None = None  # measured from max_memory_gb on the first chunk
        self.records: dict[str, InstanceRecord] = {}
        self.chunks_done_in_epoch = 0  # training steps of this epoch, as Lightning counts its batches
        self.plan: ChunkPlan | None = None
        unknown = sorted(set(evaluation_controls) - set(CONTROLS))
        if unknown:
            raise ModelError(f"evaluation_controls: unknown control(s) {unknown}; choose from {list(CONTROLS)}")
        self.evaluation_controls = list(dict.fromkeys(evaluation_controls))
        self.pool_metrics = [name for name in tool.evaluation_metrics if name.endswith(POOL_SUFFIX)]
        names = list(tool.evaluation_metrics) + [control_metric(name, control) for control in self.evaluation_controls
                                                 for name in self.pool_metrics]
        self.metrics = nn.ModuleDict({name: MeanMetric() for name in names})
        self._server: PromptToolServer | None = None
        self._controls: dict[str, PromptToolServer | None] = {}
        self._samples: SampleTable | None = None

    # ------------------------------------------------------------------ set-up
    def init_prompt(self, instance_id: str) -> torch.Tensor:
        """Uniform(-s, s) with the tool's ``init_scale``, seeded by ``(seed, instance_id)``."""
        digest = hashlib.sha256(f"{self.seed}:{instance_id}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        shape = self.tool.prompt_shape
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * self.tool.init_scale()

    def start_prompts(self, chunk: list[TrainingInstance]) -> torch.Tensor:
        """``[n, *prompt_shape]`` float64 starting prompts: the tool's ``initial_prompts`` (zero by default) plus
        each instance's seeded noise (:meth:`init_prompt`)."""
        start = torch.stack([self.init_prompt(item.instance_id) for item in chunk])
        offset = self.tool.initial_prompts(chunk)
        return start if offset is None else start + offset.to(start)

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            self._check_strategy()
            # Before the strategy moves the tool to its device (a no-op when already so stored): autocast then finds
            # the weights in its dtype and casts none of them at a step.
            self.tool_dtype = precision_dtype(self.trainer.precision)
            self.tool.store_weights_in(self.tool_dtype)
            datamodule = self.trainer.datamodule
            if stage == "fit":
                if not isinstance(datamodule, ChunkSource):
                    raise ModelError(
                        f"prompt tuning needs a prompt-tuning datamodule (one with connect()), "
                        f"got {type(datamodule).__name__}"
                    )
                self.check_existing_pools()
                # The data module asks the module which instances are finished and how many chunks of the epoch
                # ran: a resumed run hands out only pending instances (split anew over this run's ranks). Lightning's
                # own resumable-loader state (a loader's state_dict, saved in the checkpoint) does not fit: the fit
                # loop draws a batch ahead of the one being trained, and a loader cannot know which instances the
                # other ranks finished.
                self.plan = datamodule.connect(lambda: set(self.records), lambda: self.chunks_done_in_epoch)
                if type(self.tool).check_instance is not PromptTool.check_instance:
                    for index in range(len(self.plan.instances)):
                        self.tool.check_instance(self.plan.instances[index])
        if self.activation_checkpointing and not self.tool.set_activation_checkpointing(True):
            rank_zero_warn(f"activation_checkpointing has no effect: {type(self.tool).__name__} declares no "
                           "checkpoint_blocks")
        if not hasattr(self, "prompts"):
            # Rows for the prompts of one chunk. Its shape is fixed before Lightning wraps the module
            # (DDP keeps autograd's per-parameter state, so the parameter must not be resized later).
            capacity = self.plan.chunk_size if self.plan else 1
            self.prompts = nn.Parameter(torch.zeros(capacity, *self.tool.prompt_shape, dtype=torch.float32))

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
        if getattr(strategy.precision_plugin, "scaler", None) is not None:
            raise ModelError(
                "per-instance prompt tuning does not use a loss scaler: set trainer.precision to "
                "bf16-mixed or 32-true, not 16-mixed"
            )
        if str(self.trainer.precision).endswith("-true") and precision_dtype(self.trainer.precision) != torch.float32:
            raise ModelError(
                f"trainer.precision={self.trainer.precision} would convert the prompts, their optimizer state and the "
                "instances' data (boxes, images) to low precision: use bf16-mixed, which stores the frozen tool in "
                "bfloat16 as well and keeps those float32"
            )

    def _without_gradient_sync(self) -> contextlib.AbstractContextManager:
        # Lightning re-enables DDP's gradient sync after every manual-optimization step, so it is switched
        # off here, around each chunk, rather than once per run.
        model = self.trainer.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ one chunk
    def training_step(self, chunk: list[TrainingInstance], batch_idx: int) -> None:
        chunk = [item for item in chunk if item.instance_id not in self.records]
        with self._without_gradient_sync():
            results = self.tune_chunk(chunk) if chunk else []
        results = self._gather_from_ranks(results)
        for record in results:
            self.records[record.instance_id] = record
        self._count_chunk()
        self.chunks_done_in_epoch = batch_idx + 1
        accepted = sum(r.accepted for r in results)
        total_accepted = float(sum(r.accepted for r in self.records.values()))
        # Every rank logs the same values (they come from the gathered records), so none needs a sync.
        self.log_dict(
            {
                "chunk/tried": float(len(results)),
                "chunk/accepted": float(accepted),
                "chunk/rejected": float(len(results) - accepted),
                "total/accepted": total_accepted,
                "total/finished": float(len(self.records)),
            },
            batch_size=max(len(results), 1),
        )
        if results:
            loss = sum(r.loss for r in results) / len(results)
            self.log("loss", loss, prog_bar=True, batch_size=len(results))
            self.log("accepted", total_accepted, prog_bar=True, batch_size=1)

    def _count_chunk(self) -> None:
        """One counted optimizer step per chunk on every rank (Adam skips the prompts: they have no grad).

        Why not a Lightning mechanism: under manual optimization ``global_step`` (what ``every_n_train_steps``
        checkpoints, ``max_steps`` and the loggers' x axis count) advances only through the ``LightningOptimizer``'s
        ``step``; a chunk takes ``steps`` raw inner steps (``early_stop_every`` may end rows early, a padding chunk
        takes none), and Lightning has no other counter of finished batches that those all read. One counted step
        per chunk keeps the ranks' collectives and checkpoints in lockstep whatever each rank's chunk held."""
        self.prompts.grad = None
        self.optimizers().step()

    def tune_chunk(self, chunk: list[TrainingInstance]) -> list[InstanceRecord]:
        """Tune, gate and record every instance of ``chunk`` (all present in every step)."""
        capacity = self.prompts.shape[0]
        if self.max_memory_gb is not None:
            if self.instances_per_step is None:
                self.instances_per_step = self.fitting_instances([i for i in chunk if not i.keep_unchanged][:2])
            capacity = min(capacity, self.instances_per_step)
        if len(chunk) > capacity:
            return [r for k in range(0, len(chunk), capacity) for r in self.tune_chunk(chunk[k : k + capacity])]
        unchanged = [item for item in chunk if item.keep_unchanged]
        tuned = [item for item in chunk if not item.keep_unchanged]
        records = {r.instance_id: r for r in self._tune(tuned)} if tuned else {}
        if unchanged:
            records.update({r.instance_id: r for r in self._zero_prompt_records(unchanged)})
        return [records[item.instance_id] for item in chunk]

    def activation_bytes(self, chunk: list[TrainingInstance], by_dtype: dict[str, int] | None = None) -> int:
        """Bytes autograd saves for backpropagation in one inner step over ``chunk`` (tensors of the frozen tool's own
        weights excluded, each storage counted once): the activation memory a step needs beyond the model.
        ``by_dtype``, when given, receives the same bytes split by the saved tensors' dtype (``"float32": n``)."""
        n = len(chunk)
        with self._tool_precision():
            with torch.no_grad():
                context = self.tool.prepare(chunk)
                start = self.start_prompts(chunk).to(self.prompts)
            prompts = start.clone().requires_grad_(True)
            with torch.enable_grad(), SavedTensorBytes([*self.tool.parameters(), *self.tool.buffers()]) as saved:
                losses = self.tool.instance_losses(context, prompts[:n])
        del losses
        if by_dtype is not None:
            for dtype, nbytes in saved.by_dtype().items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        return saved.total

    def _tool_precision(self) -> contextlib.AbstractContextManager:
        """Autocast to the frozen tool's dtype when it is stored in low precision (Lightning's steps already run
        under it; this is for calls from outside them, like a direct :meth:`activation_bytes`)."""
        if self.tool_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.prompts.device.type, dtype=self.tool_dtype)

    def activation_profile(self, probe: list[TrainingInstance],
                           by_dtype: dict[str, int] | None = None) -> tuple[int, int]:
        """``(bytes per instance, bytes shared by the chunk)`` one inner step keeps, from :meth:`activation_bytes` of
        one and of two instances of ``probe`` (a share is independent of the count: text features, a chunk's tables;
        with one instance, all of it counts per instance). ``by_dtype`` receives the largest step's bytes by dtype."""
        if len(probe) < 2:
            one = self.activation_bytes(probe[:1], by_dtype)
            return one, 0
        one = self.activation_bytes(probe[:1])
        per_instance = max(self.activation_bytes(probe[:2], by_dtype) - one, 1)
        return per_instance, max(one - per_instance, 0)

    def fitting_instances(self, probe: list[TrainingInstance]) -> int:
        """How many instances one inner step may hold within ``max_memory_gb``, from :meth:`activation_profile` of
        ``probe``."""
        budget = float(self.max_memory_gb) * 1e9
        if not probe:
            return self.prompts.shape[0]
        by_dtype: dict[str, int] = {}
        per_instance, shared = self.activation_profile(probe, by_dtype)
        fitting = max(1, int((budget - shared) // per_instance))
        note = "" if budget >= shared + per_instance else " (one instance needs more than the budget: tuned one at a time)"
        largest_first = sorted(by_dtype.items(), key=lambda item: -item[1])
        split = ", ".join(f"{dtype} {nbytes / 1e6:,.1f} MB" for dtype, nbytes in largest_first)
        rank_zero_info(f"prompt tuning: {per_instance / 1e6:,.1f} MB of activations per instance "
                       f"(+{shared / 1e6:,.1f} MB shared); max_memory_gb={self.max_memory_gb} fits {fitting} instances "
                       f"per inner step{note}; saved by dtype in the measured step: {split}")
        return fitting

    def _zero_prompt_records(self, chunk: list[TrainingInstance]) -> list[InstanceRecord]:
        with torch.no_grad():
            features = self.tool.pool_features(self.tool.prepare(chunk)).detach().float().cpu()
        zero = torch.zeros(self.tool.prompt_shape)
        return [
            InstanceRecord(item.instance_id, item.concept, True, [], 0.0, 0, features[i].clone(), zero.clone())
            for i, item in enumerate(chunk)
        ]

    def _tune(self, chunk: list[TrainingInstance]) -> list[InstanceRecord]:
        ids = [item.instance_id for item in chunk]
        n = len(ids)
        with torch.no_grad():
            context = self.tool.prepare(chunk)
            features = self.tool.pool_features(context).detach().float().cpu()
            self.prompts.zero_()
            self.prompts[:n] = self.start_prompts(chunk).to(self.prompts)
        # The raw optimizer: inner steps are not Lightning's counted steps (see _count_chunk). Fresh state
        # per chunk; rows past n get zero gradients and so never move.
        optimizer = self.optimizers().optimizer
        optimizer.state.clear()

        active = torch.ones(n, dtype=torch.bool, device=self.prompts.device)
        steps_taken = torch.zeros(n, dtype=torch.long)
        losses = torch.zeros(n)
        curves: list[list[float]] = [[] for _ in range(n)]
        for step in range(1, self.steps + 1):
            step_losses = self.tool.instance_losses(context, self.prompts[:n])
            losses = torch.where(active.cpu(), step_losses.detach().float().cpu(), losses)
            for i in torch.nonzero(active.cpu()).flatten().tolist():
                curves[i].append(float(losses[i]))
            steps_taken += active.cpu().long()
            optimizer.zero_grad()
            self.manual_backward(step_losses[active].sum())
            frozen = self.prompts.data[:n][~active].clone()
            optimizer.step()
            self.prompts.data[:n][~active] = frozen
            if self.early_stop_every and step % self.early_stop_every == 0 and step < self.steps:
                with torch.no_grad():
                    quick = self.tool.quick_gate(context, self.prompts[:n].detach())
                active &= torch.tensor([not r.passed for r in quick], device=active.device)
                if not active.any():
                    break
        # Every instance is judged by the full gate; an early-stopped one on the prompt frozen when it passed.
        with torch.no_grad():
            final = self.tool.gate(context, self.prompts[:n].detach())

        prompts = self.prompts[:n].detach().float().cpu()
        records = []
        for i, (item, result) in enumerate(zip(chunk, final)):
            accepted = result.passed or not self.validation_gate
            keep = accepted or self.keep_rejected_prompts
            records.append(
                InstanceRecord(
                    ids[i], item.concept, accepted, list(result.rejections), float(losses[i]),
                    int(steps_taken[i]), features[i].clone() if keep else None, prompts[i].clone() if keep else None,
                    curves[i],
                )
            )
        return records

    def _gather_from_ranks(self, records: list[InstanceRecord]) -> list[InstanceRecord]:
        if self.trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return records
        gathered: list[list[dict[str, Any]] | None] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, [r.to_state() for r in records])
        return [InstanceRecord.from_state(state) for part in gathered for state in (part or [])]

    # ------------------------------------------------------------------ end of run
    def on_train_epoch_start(self) -> None:
        # Not called when a killed run resumes inside its epoch: the count then comes from the checkpoint.
        self.chunks_done_in_epoch = 0

    def on_train_epoch_end(self) -> None:
        # One pass over the pending instances is the whole job, whatever trainer.max_epochs says (its default
        # would run up to 1,000 empty epochs). ``should_stop`` is Lightning's documented way for a module to end
        # a fit, and unlike overriding max_epochs it leaves the user's trainer config as given.
        self.trainer.should_stop = True

    def on_train_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        pending = self.pending_count()
        if pending:
            rank_zero_info(
                f"{pending} instance(s) not finished; no pool written. Resume with --ckpt_path last to finish."
            )
            self._write_summary(complete=False)
            return
        run_pool, shared = self.write_pools()
        summary = self._write_summary(complete=True)
        where = f"{run_pool}" + (f", merged into {shared[0]} ({shared[1]} added)" if shared else "")
        rank_zero_info(
            f"Prompt pool: {where}; accepted {summary['accepted']} of {summary['tried']}, "
            f"rejected {summary['rejected']}"
        )

    def pending_count(self) -> int:
        """Instances of the run not finished yet (from the datamodule's plan)."""
        if self.plan is None:
            return 0
        return sum(1 for i in self.plan.instance_ids if i not in self.records)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.default_root_dir)

    def build_pool(self) -> PromptPool:
        """A pool of every accepted instance recorded so far."""
        return pool_from_records(self.tool.pool_spec(), self.records.values())

    def write_pools(self) -> tuple[Path, tuple[Path, int] | None]:
        """The run directory's pool and tool description; the merge into ``pool_path`` when it is another file.

        ``on_existing_pool`` applies to both files; with ``error`` both are checked before either is written.
        """
        pool = self.build_pool()
        targets = self.pool_targets()
        if self.on_existing_pool == "error":
            for path in targets:
                if path.exists():
                    raise PoolError(f"prompt pool {path} already exists (on_existing_pool='error')")
        added = [merge_into_file(path, pool, overwrite=self.on_existing_pool == "overwrite") for path in targets]
        write_json_atomic(self.run_dir / TOOL_FILE, self.tool.describe())
        return targets[0], (targets[1], added[1]) if len(targets) > 1 else None

    def pool_targets(self) -> list[Path]:
        """The pool files this run writes: its own, and ``pool_path`` when that is another file."""
        targets = [self.run_dir / POOL_FILE]
        if self.pool_path and Path(self.pool_path).resolve() != targets[0].resolve():
            targets.append(Path(self.pool_path))
        return targets

    def check_existing_pools(self) -> None:
        """Before any training: with ``error``, no pool file may exist; with ``merge``, existing ones must load
        and fit this tool (``overwrite`` never reads them, so a corrupt one does not block it)."""
        if self.trainer.ckpt_path:  # a resumed run has already passed this check
            return
        for path in self.pool_targets():
            if not path.exists():
                continue
            if self.on_existing_pool == "error":
                raise PoolError(f"prompt pool {path} already exists (on_existing_pool='error')")
            if self.on_existing_pool == "merge":
                PromptPool.load(path, expected=self.tool.pool_spec())

    def summary(self) -> dict[str, Any]:
        """Counts of tried / accepted / rejected instances, per concept, and of rejections per kind."""
        records = sorted(self.records.values(), key=lambda r: r.instance_id)
        return summary_of(self.tool.name, [r.summary() for r in records])

    def _write_summary(self, complete: bool) -> dict[str, Any]:
        """``summary.json``: this run's records merged, under the file's lock, into those that other runs sharing the
        run directory wrote (as its pool keeps their concepts); replaced instead with ``on_existing_pool='overwrite'``,
        as the pool is. ``complete``: whether this run, the last to write it, finished."""
        path = self.run_dir / SUMMARY_FILE
        with FileLock(path.with_name(f".{path.name}.lock")):
            earlier = [] if self.on_existing_pool == "overwrite" else earlier_instances(path, self.tool.name)
            ours = {r.instance_id for r in self.records.values()}
            kept = [item for item in earlier if item["instance_id"] not in ours]
            instances = sorted(kept + [r.summary() for r in self.records.values()], key=lambda item: item["instance_id"])
            summary = {"complete": complete, **summary_of(self.tool.name, instances)}
            write_json_atomic(path, summary)
        return summary

    # ------------------------------------------------------------------ validate / test
    def evaluation_pool(self) -> PromptPool:
        """This run's accepted prompts; else the pool at ``pool_path`` or in the run directory (unless this run
        overwrites them: they may come from another model, or be corrupt); else empty."""
        if any(r.accepted for r in self.records.values()):
            return self.build_pool()
        if self.on_existing_pool == "overwrite":  # the existing pools are being replaced, maybe from another model
            return PromptPool(self.tool.pool_spec())
        for path in (Path(self.pool_path) if self.pool_path else None, self.run_dir / POOL_FILE):
            if path is not None and path.is_file():
                return PromptPool.load(path, expected=self.tool.pool_spec())
        return PromptPool(self.tool.pool_spec())

    def ungated_pool(self) -> PromptPool | None:
        """Every tuned prompt of this run, rejected ones included (the pool without the validation gate); ``None``
        when the run kept no rejected prompts (``keep_rejected_prompts`` off) or rejected none."""
        tuned = [r for r in self.records.values() if r.prompt is not None and r.feature is not None]
        if not any(not r.accepted for r in tuned):
            return None
        return pool_from_records(self.tool.pool_spec(), [replace(r, accepted=True) for r in tuned])

    def on_validation_epoch_start(self) -> None:
        pool = self.evaluation_pool()
        self._server = PromptToolServer(self.tool, pool)
        self._controls = {}
        for control in self.evaluation_controls:
            if control == "ungated":
                control_pool_ = self.ungated_pool()
            else:
                control_pool_ = control_pool(pool, "zero" if control == "zero_prompt" else "random", self.seed)
            if control_pool_ is None:
                if not self.keep_rejected_prompts and self.records and not self.trainer.sanity_checking:
                    rank_zero_info("ungated control skipped: the run kept no rejected prompts "
                                   "(set model.init_args.keep_rejected_prompts: true to score it)")
                continue  # (or nothing was rejected: the ungated pool is the pool)
            # an empty control is the (then empty) pool itself: scored once
            self._controls[control] = PromptToolServer(self.tool, control_pool_, self._server.top_k) if len(control_pool_) else None
        self._samples = SampleTable(list(self.metrics))

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: Any, stage: str) -> None:
        assert self._server is not None and self._samples is not None
        with torch.no_grad():
            values = self.tool.evaluate(self._server, batch)
            for control, server in self._controls.items():
                scored = values if server is None else self.tool.evaluate(server, batch)
                values.update({control_metric(name, control): scored[name] for name in self.pool_metrics})
        for name, per_sample in values.items():
            metric = self.metrics[name]
            metric.update(per_sample.to(self.device))
            self.log(f"{stage}/{name}", metric, batch_size=len(per_sample), prog_bar=name in self.tool.evaluation_metrics)
        samples = self.tool.evaluation_samples(batch)
        if samples is not None:
            self._samples.add([k for k, _ in samples], [c for _, c in samples],
                              {name: v.tolist() for name, v in values.items()})

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _write_report(self, stage: str) -> None:
        """Gather every rank's samples (each counted once) and write ``<run>/evaluation/<stage>.json|.md``."""
        table = self._samples
        self._samples = None
        if table is None or self.trainer.sanity_checking:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, table.rows)
            for rows in gathered:
                table.merge(SampleTable(table.columns, rows))
        if not self.trainer.is_global_zero or not table.rows:
            return
        pool = self.pool_metrics[0] if self.pool_metrics else None
        control = control_metric(pool, "zero_prompt") if pool and "zero_prompt" in self._controls else None
        report = table.report(pool, control)
        directory = self.run_dir / EVALUATION_DIR
        write_json_atomic(directory / f"{stage}.json", {"stage": stage, "top_k": self._server.top_k if self._server else None,
                                                        "prompts": len(self._server.pool) if self._server else 0,
                                                        "per_concept": report})
        text = format_report(report)
        write_text_atomic(directory / f"{stage}.md", text + "\n")
        rank_zero_info(f"\n{stage} per concept (mean [95% interval]), also in {directory / (stage + '.md')}:\n{text}")

    def on_validation_epoch_end(self) -> None:
        self._write_report("validate")

    def on_test_epoch_end(self) -> None:
        self._write_report("test")

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The frozen tool and the working prompts are not state: only the finished instances are. Lightning has
        # no switch to leave a module's frozen parameters out of the checkpoint, and ``state_dict`` is torch's (what
        # users and other libraries read of the module), so it stays whole and the checkpoint's copy is emptied
        # here (with ``strict_loading`` off, a resume loads nothing into the tool, which its config rebuilt).
        checkpoint["state_dict"] = {}
        checkpoint[CHECKPOINT_KEY] = {
            "records": {k: r.to_state() for k, r in self.records.items()},
            "tool": self.tool.describe(),
            "chunks_done_in_epoch": self.chunks_done_in_epoch,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            raise ModelError("checkpoint holds no prompt-tuning state (was it written by another module?)")
        saved, current = state["tool"], self.tool.describe()
        if saved["identity"] != current["identity"] or saved["prompt_shape"] != current["prompt_shape"]:
            raise ModelError(
                f"checkpoint was written for tool {saved['identity']} with prompt shape {saved['prompt_shape']}, "
                f"but this run has {current['identity']} with prompt shape {current['prompt_shape']}"
            )
        self.records = {k: InstanceRecord.from_state(r) for k, r in state["records"].items()}
        # Checkpoints from before this count: a run has one epoch and one counted step per chunk.
        self.chunks_done_in_epoch = int(state.get("chunks_done_in_epoch", checkpoint.get("global_step", 0)))


def pool_from_records(spec: PoolSpec, records: Any) -> PromptPool:
    """A pool of the accepted records (sorted by instance id, so the order is reproducible)."""
    pool = PromptPool(spec)
    by_concept: dict[str | None, list[InstanceRecord]] = {}
    for record in sorted(records, key=lambda r: r.instance_id):
        if record.accepted:
            by_concept.setdefault(record.concept, []).append(record)
    for concept, recs in by_concept.items():
        pool.add(
            concept,
            torch.stack([r.feature for r in recs]),
            torch.stack([r.prompt for r in recs]),
            [r.instance_id for r in recs],
        )
    return pool
