"""LoRA fine-tuning of a causal LM on tool-usage instructions (GPT4Tools Sec. 3, Table 12).

Read top to bottom:

* ``configure_model`` loads ``AutoModelForCausalLM`` and wraps it with PEFT LoRA on the named projections
  (checked against the model's linear layers first, with an error listing the ones it has);
* ``training_step`` is the causal-LM loss on the response tokens (labels are -100 elsewhere). By default
  it is computed exactly but cheaper than ``model(labels=...)``: logits only at the positions that predict
  a response token (``logits_to_keep``), and no attention mask for right-padded batches (under causal
  attention a real token never sees the padding after it), which lets SDPA use its causal kernel. On N
  ranks it is normalised by the response tokens of all ranks' batches together, so that the gradient DDP or
  FSDP averages is the one-device gradient of the same global batch (not a mean of per-rank means);
* sharded training: under Lightning's ``ModelParallelStrategy`` (FSDP2) ``configure_model`` shards every
  decoder layer and the whole model with ``fully_shard`` (optionally in bf16 with fp32 gradient reduction). Only
  global rank 0 reads the checkpoint; the other ranks build the model on the meta device and receive their shards
  of rank 0's weights and LoRA initialisation (:mod:`clova_train.models.sharded_loading`), so a node holds one
  host copy of the base, not one per rank. This is done in ``configure_model`` itself, before Lightning restores a
  checkpoint (which therefore wins) and for every trainer function alike;
  ``gradient_checkpointing`` recomputes activations in the backward pass on any strategy;
* ``validation_step`` / ``test_step`` generate greedily until ``Observation:`` (the template's stop
  strings) and feed :class:`~clova_train.tooluse.metrics.ToolUsageSuccessRate` (SR_t, SR_act, SR_args, SR for
  seen tools, unseen tools and no-tool samples);
* ``configure_optimizers``: AdamW, linear warm-up then linear decay over the run;
* checkpoints hold the LoRA weights only (the base model is reloaded from its source), and at the end of
  ``fit`` rank 0 writes the PEFT adapter directory (``<default_root_dir>/adapter``) with the tokenizer and
  the prompt template; ``clova-train export`` adds the merged model.

Global batch = ``batch_size x devices x accumulate_grad_batches``: the paper's 512 is e.g.
``batch_size: 4, devices: 8, accumulate_grad_batches: 16``.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from clova_train.core.atomic import write_json_atomic
from clova_train.core.distributed import data_parallel
from clova_train.core.errors import ModelError
from clova_train.core.precision import precision_dtype
from clova_train.tooluse.metrics import ToolUsageSuccessRate
from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate

LORA_CHECKPOINT_KEY = "clova_train.lora"  # the key export reads from this module's checkpoints


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Raise :class:`ModelError` if a LoRA target names no linear layer of ``model``."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ModelError(
            f"LoRA target module(s) {missing} not found in {type(model).__name__}; its linear layers are: {linear}"
        )


def load_causal_lm(name_or_path: str, dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` from a hub id or a local directory (kept as an absolute path in the model's
    ``name_or_path``, so the adapter written from it names its base portably)."""
    from transformers import AutoModelForCausalLM

    from clova_train.core.errors import loading
    from clova_train.tools.pretrained import absolute_model_name

    options = {} if dtype is None else {"dtype": dtype}
    with loading("the causal LM", name_or_path):
        return AutoModelForCausalLM.from_pretrained(absolute_model_name(name_or_path), **options)


def sharded_causal_lm(name_or_path: str) -> nn.Module:
    """For FSDP2: on global rank 0 the causal LM loaded as :func:`load_causal_lm` does (in the checkpoint's dtype); on
    the other ranks the same architecture (rank 0's config and generation config) on the meta device, without
    reading the weights. A load failure on rank 0 is raised on every rank."""
    from transformers import AutoModelForCausalLM

    from clova_train.models.sharded_loading import load_on_rank0

    def build(description: tuple[Any, Any]) -> nn.Module:
        config, generation_config = description
        model = AutoModelForCausalLM.from_config(config)
        if generation_config is not None:  # what generate() uses: from generation_config.json on rank 0
            model.generation_config = generation_config
        return model.eval()  # as from_pretrained leaves it

    return load_on_rank0(lambda: load_causal_lm(name_or_path),
                         lambda model: (model.config, getattr(model, "generation_config", None)), build)


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True if every row of a 0/1 mask is ones then zeros (padding only at the end)."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """``text`` up to and including the first stop string."""
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return text[: min(ends)] if ends else text


def random_state() -> dict[str, Any]:
    """This process's torch random state (CPU and every CUDA device)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class LoraToolLLM(LightningModule):
    """A causal LM fine-tuned with LoRA to use tools in the ReAct format.

    Args:
        model_name_or_path: ``AutoModelForCausalLM`` hub id or local directory.
        lora_r: LoRA rank (paper: 16).
        lora_alpha: LoRA scaling alpha (paper: 16).
        lora_dropout: dropout on the LoRA path (paper: 0.05).
        target_modules: names of the projections that get LoRA (paper: q, k, v, o).
        lr: AdamW learning rate (paper: 3e-4).
        warmup_steps: linear warm-up steps (paper: 100), then linear decay to 0.
        weight_decay: AdamW weight decay (paper: 0).
        metric_mode: ``paper`` or ``gpt4tools`` (the public evaluation script), see ``clova_train.tooluse.metrics``.
        max_new_tokens: generation budget per evaluated step.
        response_logits_only: compute the training loss from logits at response positions only, without
            the attention mask of right-padded batches. Exact for causal LMs (same loss as the model's own
            ``labels=`` loss up to float rounding) and faster; set false for models whose forward needs
            the mask for more than padding, or to use the model's own loss (then each rank's batch is
            averaged on its own, and N ranks match one device only when batches hold equal token counts).
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass (less memory,
            about a third more compute).
        shard_param_dtype: ``ModelParallelStrategy`` only: dtype of the sharded parameters in forward and
            backward (``bfloat16`` on GPUs: half the all-gather traffic); gradients are reduced in float32.
        checkpoint_every_n_steps: also write ``checkpoints/last.ckpt`` every this many optimizer steps (0: at
            epoch ends only); a run killed inside an epoch resumes from it at the next batch, with the
            optimizer, the LR schedule and the random state (dropout) as they were.
    """

    run_kind = "lora"  # what this learner's ``run.json`` calls its runs (:mod:`clova_train.core.run_manifest`)

    def __init__(
        self,
        model_name_or_path: str,
        lora_r: int = 16,
        lora_alpha: int = 16,
        lora_dropout: float = 0.05,
        target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"],  # noqa: B006 (shown in --help)
        lr: float = 3e-4,
        warmup_steps: int = 100,
        weight_decay: float = 0.0,
        metric_mode: Literal["paper", "gpt4tools"] = "paper",
        max_new_tokens: int = 128,
        response_logits_only: bool = True,
        gradient_checkpointing: bool = False,
        shard_param_dtype: Literal["float32", "bfloat16"] = "float32",
        checkpoint_every_n_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.strict_loading = False  # checkpoints hold the LoRA weights only
        self.model: nn.Module | None = None
        self.template = PromptTemplate()
        self.metric = ToolUsageSuccessRate(metric_mode)

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model

        sharded = self.device_mesh is not None
        # The frozen base is stored in the training precision's dtype: under bf16-mixed a checkpoint saved in float16
        # (Vicuna) would otherwise stay float16, and autocast would keep a bf16 copy of every weight per step. The
        # LoRA weights stay float32 (peft upcasts adapters). FSDP2 keeps float32 shards (see shard_param_dtype).
        dtype = None if sharded else precision_dtype(self.trainer.precision if self._trainer is not None else None)
        if sharded:  # rank 0 reads the checkpoint, the other ranks build on the meta device
            base = sharded_causal_lm(self.hparams.model_name_or_path)
        else:  # DDP or one device: every process holds the whole model anyway
            base = load_causal_lm(self.hparams.model_name_or_path, dtype=dtype)
        on_meta = next(base.parameters()).is_meta
        check_lora_targets(base, list(self.hparams.target_modules))
        config = LoraConfig(
            r=self.hparams.lora_r,
            lora_alpha=self.hparams.lora_alpha,
            lora_dropout=self.hparams.lora_dropout,
            target_modules=list(self.hparams.target_modules),
            task_type="CAUSAL_LM",
        )
        if self.hparams.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with torch.device("meta") if on_meta else nullcontext():
            self.model = get_peft_model(base, config)
        # from_pretrained leaves the base in eval mode and Lightning keeps each module's mode through fit; transformers
        # checkpoints a layer only in training mode, so an eval-mode base silently kept every activation. The base is
        # frozen by requires_grad, and runs in training mode as under the HF Trainer of the paper's recipe (its
        # dropout, if the architecture has any, active; Llama's has none). Validation and generation run in eval mode.
        self.model.train()
        if self.hparams.response_logits_only and not accepts_logits_to_keep(base):
            rank_zero_info(f"{type(base).__name__} has no logits_to_keep argument: using its own full loss")
            self.hparams.response_logits_only = False
        if sharded:  # ModelParallelStrategy: shard with FSDP2, then fill the shards from rank 0's copy
            from clova_train.models.sharded_loading import match_rank0_dtypes, materialise_from_rank0

            full_state = {} if on_meta else self.model.state_dict()  # rank 0's only full copy, freed after loading
            match_rank0_dtypes(self.model)
            self.shard(self.device_mesh)
            materialise_from_rank0(self.model, full_state, self.trainer.strategy.root_device)

    def shard(self, device_mesh: Any) -> None:
        """``fully_shard`` every decoder layer, then the causal LM, over the mesh's data-parallel dimension."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        names = device_mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
            raise ModelError("LoraToolLLM shards with FSDP only: give ModelParallelStrategy tensor_parallel_size: 1 "
                             "and data_parallel_size: devices x nodes (its 'auto' puts every device of a node into "
                             "tensor parallelism)")
        mesh = device_mesh["data_parallel"] if "data_parallel" in names else device_mesh
        dtype = torch.bfloat16 if self.hparams.shard_param_dtype == "bfloat16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        layers = [m for m in self.model.modules() if type(m).__name__.endswith("DecoderLayer")]
        if not layers:
            raise ModelError(f"{type(self.model.get_base_model()).__name__} has no *DecoderLayer modules to shard")
        # The causal LM is the root (not the PEFT wrapper): generate() calls it directly, and its forward is what
        # gathers the embedding and the head.
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model.get_base_model(), mesh=mesh, mp_policy=policy)

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer else None
        if datamodule is not None and hasattr(datamodule, "template"):
            self.template = datamodule.template
            self.metric.seen_tools = set(getattr(datamodule, "seen_tools", [])) or None

    @property
    def tokenizer(self) -> Any:
        datamodule = self.trainer.datamodule
        if datamodule is None or getattr(datamodule, "tokenizer", None) is None:
            raise ModelError("LoraToolLLM needs a datamodule with a tokenizer (ToolInstructionDataModule)")
        return datamodule.tokenizer

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.hparams.response_logits_only:
            loss = self.response_loss(batch)
        else:
            loss = self.model(**batch, use_cache=False).loss  # no KV cache while training: it is never read
        tokens = (batch["labels"] != -100).sum()
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0],
                 sync_dist=data_parallel(self._trainer)[0] > 1)  # the ranks' values average to the global loss
        self.log("train/response_tokens", tokens.float(), reduce_fx="sum", batch_size=batch["input_ids"].shape[0])
        return loss

    def response_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy over the response tokens, from the logits that predict them only; on N
        ranks, this rank's sum over N times the mean token count of all ranks (see the module docstring)."""
        attention_mask = batch["attention_mask"]
        targets = batch["labels"][:, 1:]  # logits at position t predict the token at t + 1
        positions = (targets != -100).any(0).nonzero().squeeze(1)
        if positions.numel() == 0:  # a weightless batch (a rank's padding): keep the graph whole, add nothing
            positions = torch.tensor([targets.shape[1] - 1], device=targets.device)
        output = self.model(
            input_ids=batch["input_ids"],
            attention_mask=None if is_right_padded(attention_mask) else attention_mask,
            use_cache=False,
            logits_to_keep=positions,
        )
        logits = output.logits.flatten(0, 1).float()
        total = F.cross_entropy(logits, targets[:, positions].flatten(), ignore_index=-100, reduction="sum")
        tokens = (targets != -100).sum().to(total.dtype)
        world, _ = data_parallel(self._trainer)
        if world > 1:
            tokens = tokens.detach().clone()
            torch.distributed.all_reduce(tokens)
            return total * world / tokens.clamp(min=1)
        return total / tokens.clamp(min=1)

    def configure_optimizers(self) -> dict[str, Any]:
        from transformers import get_linear_schedule_with_warmup

        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.lr, betas=(0.9, 0.999), weight_decay=self.hparams.weight_decay
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = get_linear_schedule_with_warmup(optimizer, min(self.hparams.warmup_steps, total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
        """Greedy responses to left-padded prompts, each cut after the first stop string."""
        tokenizer = self.tokenizer
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=self.hparams.max_new_tokens,
            do_sample=False,
            stop_strings=list(self.template.stop_strings),
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
            synced_gpus=self.device_mesh is not None,  # sharded: every rank runs every decoding step
        )
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1]:], skip_special_tokens=True)
        return [cut_at_stop(t, self.template.stop_strings) for t in texts]

    def _evaluate(self, batch: dict[str, Any]) -> None:
        predictions = self.generate_responses(batch["input_ids"], batch["attention_mask"])
        kept = [(p, r) for p, r in zip(predictions, batch["references"]) if r is not None]  # not padding copies
        if kept:
            self.metric.update([p for p, _ in kept], [r for _, r in kept])

    def _log_metric(self, stage: str) -> None:
        values = self.metric.compute()
        self.log_dict({f"{stage}/{k}": v for k, v in values.items()}, prog_bar=False)
        if "all/SR" in values:
            self.log(f"{stage}/SR", values["all/SR"], prog_bar=True)
        self.metric.reset()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_metric("val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch)

    def on_test_epoch_end(self) -> None:
        self._log_metric("test")

    # ------------------------------------------------------------------ checkpoints and the adapter
    def configure_callbacks(self) -> list:
        from lightning.pytorch.callbacks import ModelCheckpoint

        # last.ckpt at every epoch end, whatever the validation cadence (Lightning's default saves after
        # validation only when check_val_every_n_epoch > 1), so every run can resume; and, if asked, every
        # n optimizer steps too (one callback cannot do both).
        directory = Path(self.trainer.default_root_dir) / "checkpoints"
        callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=0, save_last=True, save_on_train_epoch_end=True)]
        if self.hparams.checkpoint_every_n_steps > 0:
            callbacks.append(ModelCheckpoint(dirpath=directory, save_top_k=0, save_last=True,
                                             every_n_train_steps=self.hparams.checkpoint_every_n_steps))
        return callbacks

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Sharded: the LoRA weights only. ``ModelParallelStrategy`` saves and restores a sharded checkpoint through
        this dict, and restoring asks the checkpoint for every key in it (the checkpoint holds no base weights)."""
        state = super().state_dict(*args, **kwargs)
        if self.device_mesh is not None:
            for key in [k for k in state if "lora_" not in k]:
                del state[key]
        return state

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k: v for k, v in state.items() if "lora_" in k}
        datamodule = self.trainer.datamodule if self._trainer else None
        checkpoint[LORA_CHECKPOINT_KEY] = {
            "template": self.template.to_dict(),
            "tokenizer": getattr(datamodule, "tokenizer_name", None),
            "rng": random_state(),  # dropout masks after a resume are those the run would have drawn
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(LORA_CHECKPOINT_KEY)
        if state is None:
            raise ModelError("checkpoint holds no LoRA fine-tuning state (was it written by another module?)")
        self.template = PromptTemplate.from_dict(state["template"])
        self._resumed_random_state = state.get("rng")  # applied in on_train_start: model set-up draws numbers too

    def on_train_start(self) -> None:
        if getattr(self, "_resumed_random_state", None) is not None:
            set_random_state(self._resumed_random_state)
            self._resumed_random_state = None

    def on_train_end(self) -> None:
        state = self.lora_state_dict()  # every rank: a collective when the model is sharded
        if self.trainer.is_global_zero:
            path = self.save_adapter(Path(self.trainer.default_root_dir) / "adapter", state)
            rank_zero_info(f"LoRA adapter: {path}")

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights, whole (sharded ones gathered: every rank must call this, in the same order)."""
        from torch.distributed.tensor import DTensor

        state = {}
        for name, parameter in self.model.named_parameters():
            if "lora_" in name:
                whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
                state[name] = whole.detach().float().cpu()
        return state

    def save_adapter(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """PEFT adapter directory (adapter_config.json, adapter_model.safetensors), tokenizer and template."""
        self.model.save_pretrained(str(directory), safe_serialization=True,
                                   state_dict=state if state is not None else self.lora_state_dict())
        tokenizer = self.trainer.datamodule.tokenizer if self._trainer and self.trainer.datamodule else None
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        write_json_atomic(directory / TEMPLATE_FILE, self.template.to_dict())
        return directory
