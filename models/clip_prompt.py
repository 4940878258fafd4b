"""CLIP SELECT / CLASSIFY: per-instance deep visual prompt tuning (CLOVA supp. 9.4).

Loss: cross-entropy of each image (the instance's positive image and its negative training images, all
seen through the instance's prompt) over the text prompts of the instance's candidate concepts: the
concept itself and its distinct negative concepts. Text features are computed once per run.

Gate: with the instance's prompt, every held-out positive image of the concept must be classified as
the concept, and (unless ``gate_negatives`` is off) no held-out negative image may be; a prompt that
pulls every image to the concept passes a positives-only gate, so the negative check matters.

Pool feature: the unprompted, normalised CLIP image embedding of the instance's positive image.

Validate / test: CLASSIFY accuracy over all concept names of the data, without prompts and with the pool
(the pool of this run's accepted prompts, or the pool file when the run holds none), computed with the
serving code (:class:`clova_train.tools.serving.ClipPromptServer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from clova_train.models.prompt_tuning import GateResult, PerInstancePromptTuning
from clova_train.core.pool import PromptPool
from clova_train.tools.serving import ClipPromptServer
from clova_train.tools.clip import ClipSource, PromptConfig, PromptedClip


@dataclass
class ClipChunk:
    """Prompt-independent tensors of one chunk."""

    tokens: torch.Tensor  # [N, L, W] patch tokens of all training images
    owner: torch.Tensor  # [N] instance index of each training image
    labels: torch.Tensor  # [N] index of each image's concept in ``names``
    first_image: torch.Tensor  # [n] row of each instance's positive image in ``tokens``
    candidates: torch.Tensor  # [n, T] which names each instance is classified over
    text: torch.Tensor  # [T, d] text features of ``names``
    names: list[str]
    concepts: list[str]  # [n]
    val_tokens: torch.Tensor
    val_owner: torch.Tensor
    val_labels: torch.Tensor
    val_files: list[str]


class ClipPromptTuning(PerInstancePromptTuning):
    """Per-instance deep visual prompt tuning of a frozen open_clip model (SELECT / CLASSIFY tools).

    Args:
        model_name: open_clip architecture (``ViT-L-14``), ``hf-hub:org/repo`` or ``local-dir:/path``.
        pretrained: open_clip pretrained tag or checkpoint path (ignored with ``hf-hub:``/``local-dir:``).
        num_prompt_tokens: prompt tokens in each prompted vision block (paper: 100).
        prompt_depth: leading vision blocks that get their own prompt tokens (paper: 3).
        text_template: text prompt of a concept; ``{}`` is the concept with underscores as spaces.
        gate_negatives: also require held-out negatives not to be classified as the concept.
        lr: Adam learning rate (paper: 1e-2).
        steps: optimizer steps per instance (paper: 100).
        early_stop_every: gate every this many steps and stop instances that pass (0: off).
        pool_path: prompt pool file (default: ``<trainer.default_root_dir>/pool.safetensors``).
        on_existing_pool: ``merge`` into, ``overwrite`` or ``error`` on an existing pool file.
        seed: seed of the per-instance prompt initialisation.
        max_chunk_size: prompt rows held at once when the datamodule sets no ``chunk_size``.
        keep_rejected_prompts: keep rejected instances' prompts in records/checkpoints (never in the pool).
    """

    def __init__(
        self,
        model_name: str = "ViT-L-14",
        pretrained: str | None = "openai",
        num_prompt_tokens: int = 100,
        prompt_depth: int = 3,
        text_template: str = "a photo of a {}.",
        gate_negatives: bool = True,
        lr: float = 1e-2,
        steps: int = 100,
        early_stop_every: int = 0,
        pool_path: str | None = None,
        on_existing_pool: Literal["merge", "overwrite", "error"] = "merge",
        seed: int = 0,
        max_chunk_size: int = 32,
        keep_rejected_prompts: bool = False,
    ) -> None:
        super().__init__(
            lr, steps, early_stop_every, pool_path, on_existing_pool, seed, max_chunk_size, keep_rejected_prompts
        )
        self.save_hyperparameters()
        self.tool = PromptedClip(
            ClipSource(model_name, pretrained), PromptConfig(num_prompt_tokens, prompt_depth), text_template
        )
        self.gate_negatives = gate_negatives
        self._text_cache: dict[str, torch.Tensor] = {}
        self.accuracy_no_prompt = MeanMetric()
        self.accuracy_pool = MeanMetric()
        self._server: ClipPromptServer | None = None

    @property
    def prompt_shape(self) -> tuple[int, ...]:
        return self.tool.prompt_shape

    def init_scale(self) -> float:
        return self.tool.init_scale()

    def describe_tool(self) -> dict[str, Any]:
        return self.tool.describe()

    def text_features(self, names: list[str]) -> torch.Tensor:
        """Text features of ``names``, each computed once per run."""
        missing = [n for n in names if n not in self._text_cache]
        if missing:
            for name, feature in zip(missing, self.tool.encode_text(missing)):
                self._text_cache[name] = feature
        return torch.stack([self._text_cache[n] for n in names]).to(self.device)

    # ------------------------------------------------------------------ hooks
    def prepare_chunk(self, chunk: list[dict[str, Any]]) -> ClipChunk:
        names = sorted({c for item in chunk for c in [*item["candidates"], *item["labels"], *item["val_labels"]]})
        index = {name: k for k, name in enumerate(names)}
        candidates = torch.zeros(len(chunk), len(names), dtype=torch.bool, device=self.device)
        for i, item in enumerate(chunk):
            candidates[i, [index[c] for c in item["candidates"]]] = True

        def stack(key: str, labels_key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            images = torch.cat([item[key] for item in chunk]).to(self.device)
            owner = torch.cat([torch.full((len(item[key]),), i) for i, item in enumerate(chunk)]).to(self.device)
            labels = torch.tensor([index[c] for item in chunk for c in item[labels_key]], device=self.device)
            tokens = self.tool.embed_patches(images.to(self.dtype))
            return tokens, owner, labels

        tokens, owner, labels = stack("images", "labels")
        val_tokens, val_owner, val_labels = stack("val_images", "val_labels")
        sizes = torch.tensor([len(item["images"]) for item in chunk])
        first = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]).to(self.device)
        return ClipChunk(
            tokens, owner, labels, first, candidates, self.text_features(names), names,
            [item["concept"] for item in chunk], val_tokens, val_owner, val_labels,
            [f for item in chunk for f in item["val_files"]],
        )

    def _logits(self, tokens: torch.Tensor, owner: torch.Tensor, prompts: torch.Tensor, ctx: ClipChunk) -> torch.Tensor:
        features = self.tool.encode_tokens(tokens, prompts[owner])
        logits = self.tool.logit_scale * features @ ctx.text.to(features.dtype).T
        return logits.masked_fill(~ctx.candidates[owner], float("-inf"))

    def instance_losses(self, ctx: ClipChunk, prompts: torch.Tensor) -> torch.Tensor:
        logits = self._logits(ctx.tokens, ctx.owner, prompts, ctx)
        per_image = F.cross_entropy(logits, ctx.labels, reduction="none")
        n = prompts.shape[0]
        total = torch.zeros(n, dtype=per_image.dtype, device=per_image.device).index_add(0, ctx.owner, per_image)
        counts = torch.bincount(ctx.owner, minlength=n).to(per_image.dtype)
        return total / counts

    def gate(self, ctx: ClipChunk, prompts: torch.Tensor) -> list[GateResult]:
        predicted = self._logits(ctx.val_tokens, ctx.val_owner, prompts, ctx).argmax(-1).tolist()
        failures: list[list[str]] = [[] for _ in ctx.concepts]
        for k, (i, label, pred) in enumerate(zip(ctx.val_owner.tolist(), ctx.val_labels.tolist(), predicted)):
            concept = ctx.concepts[i]
            file = Path(ctx.val_files[k]).name
            if ctx.names[label] == concept and ctx.names[pred] != concept:
                failures[i].append(f"held-out positive: {file} classified as {ctx.names[pred]!r}")
            elif self.gate_negatives and ctx.names[label] != concept and ctx.names[pred] == concept:
                failures[i].append(f"held-out negative: {file} ({ctx.names[label]}) classified as {concept!r}")
        return [GateResult(not f, "; ".join(f)) for f in failures]

    def pool_features(self, ctx: ClipChunk) -> torch.Tensor:
        return self.tool.encode_tokens(ctx.tokens[ctx.first_image], None)

    # ------------------------------------------------------------------ evaluation
    def evaluation_pool(self) -> PromptPool:
        """This run's accepted prompts; else the pool file at ``pool_path``; else an empty pool."""
        if any(r["accepted"] for r in self.records.values()):
            return self.build_pool()
        path = self.resolved_pool_path()
        if path.is_file():
            return PromptPool.load(path, expected=self.pool_spec())
        return PromptPool(self.pool_spec())

    def on_validation_epoch_start(self) -> None:
        self._server = ClipPromptServer(self.tool, self.evaluation_pool())

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        assert self._server is not None
        names, labels = batch["names"], batch["labels"]
        images = batch["images"].to(self.dtype)
        with torch.no_grad():
            scores, base_logits = self._server.score(images, names)
        n = len(labels)
        for metric, predicted in ((self.accuracy_no_prompt, base_logits), (self.accuracy_pool, scores)):
            correct = [names[i] == y for i, y in zip(predicted.argmax(-1).tolist(), labels)]
            metric.update(torch.tensor(correct, dtype=torch.float))
        self.log(f"{stage}/accuracy_no_prompt", self.accuracy_no_prompt, batch_size=n, prog_bar=True)
        self.log(f"{stage}/accuracy_pool", self.accuracy_pool, batch_size=n, prog_bar=True)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")
