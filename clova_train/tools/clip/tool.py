"""CLIP (open_clip) as the SELECT / CLASSIFY tool, with deep visual prompts (VPT-deep, CLOVA supp. 9.4).

Where the prompt enters: for each of the first ``prompt_depth`` vision blocks, ``num_prompt_tokens`` tokens
are placed right after the class token (replacing the previous block's outputs at those positions, as in
VPT-deep); after the last block the prompt positions are dropped, so pooling and projection see exactly the
unprompted token layout. With no prompt the forward is open_clip's own: the unmodified tool.

Loss: cross-entropy of each image (the instance's positive image and its negative training images, all
seen through the instance's prompt) over the text prompts of the instance's candidate concepts (the concept
and its distinct negatives), averaged over the instance's own images. Text features: once per run.

Gate: with the instance's prompt, every held-out positive image of the concept must be classified as the
concept and (unless ``gate_negatives`` is off) no held-out negative may be; a prompt that pulls every image
to the concept passes a positives-only gate, so the negative check matters. By default (``gate_decision:
both``) an image must be right by two rules: the prompted forward's argmax (the paper's "the tool with the
prompt") and the rule CLASSIFY serves with (below: the concept's score from the prompted forward, every
other label's from the unprompted one). The second catches a prompt that raises the concept's probability on
look-alikes the unprompted tool is unsure of without making it their prompted argmax: at serving such a
prompt takes those images; the first catches one that wins the prompted forward on a negative the
unprompted tool is sure of.

Pool feature: the unprompted, normalised image embedding of the instance's positive image. Serving:
CLASSIFY scores label ``l`` of image ``x`` as ``softmax_l(scale * f(x; p_l) . t)`` with ``p_l`` label ``l``'s
ensembled prompt (unprompted if it has none); SELECT encodes each crop with the concept's ensembled prompt
and returns the crop closest to the concept's text.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from clova_train.core.errors import DataError, ModelError
from clova_train.tools.base import PromptLookup, PromptTool
from clova_train.tools.clip.margin import classify_forwards, served_scores
from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance
from clova_train.tools.operating_point import check_margin
from clova_train.tools.pretrained import LOCAL_DIR_PREFIX

WEIGHT_FILE = "open_clip_model.safetensors"
CONFIG_FILE = "open_clip_config.json"


@dataclass(frozen=True)
class ClipSource:
    """Where the frozen CLIP comes from.

    Args:
        model_name: an open_clip architecture name (``"ViT-L-14"``), ``"hf-hub:org/repo"``, or
            ``"local-dir:/path"`` (a directory holding ``open_clip_config.json`` and weights, the layout
            open_clip's ``save_for_hf`` writes).
        pretrained: open_clip pretrained tag (``"openai"``) or a checkpoint path; ignored with a schema.
    """

    model_name: str
    pretrained: str | None = None


def _resolve_local(model_name: str) -> Path | None:
    if not model_name.startswith(LOCAL_DIR_PREFIX):
        return None
    path = Path(model_name[len(LOCAL_DIR_PREFIX) :]).expanduser()
    if not path.is_dir():
        raise ModelError(f"CLIP model directory not found: {path} (from model_name={model_name!r})")
    if not (path / CONFIG_FILE).is_file():
        raise ModelError(f"CLIP model directory {path} has no {CONFIG_FILE}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and not any(path.glob("*.pth")):
        raise ModelError(f"CLIP model directory {path} has no weights (*.safetensors, *.bin or *.pth)")
    return path


def load_open_clip(source: ClipSource) -> tuple[nn.Module, object]:
    """Load an open_clip model and its tokenizer through open_clip's own factory."""
    import open_clip  # here, not at the top: every CLI start imports this module through its data modules (0.5 s)

    _resolve_local(source.model_name)
    try:
        model = open_clip.create_model(source.model_name, pretrained=source.pretrained, device="cpu")
        tokenizer = open_clip.get_tokenizer(source.model_name)
    except Exception as err:  # open_clip raises RuntimeError, ValueError, FileNotFoundError, hub errors
        raise ModelError(
            f"could not load CLIP model {source.model_name!r} (pretrained={source.pretrained!r}): {err}"
        ) from err
    if not hasattr(model, "visual") or not hasattr(model.visual, "transformer"):
        raise ModelError(
            f"CLIP model {source.model_name!r} has no vision transformer; deep visual prompts need a ViT image tower"
        )
    return model, tokenizer


def save_open_clip(model: nn.Module, model_config: dict, directory: str | Path) -> Path:
    """Save ``model`` in the ``local-dir:`` layout open_clip loads (config JSON + safetensors weights)."""
    import open_clip
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    preprocess = open_clip.get_model_preprocess_cfg(model)
    config = {"model_cfg": model_config, "preprocess_cfg": {"mean": preprocess["mean"], "std": preprocess["std"]}}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHT_FILE))
    return directory


@dataclass(kw_only=True)
class ClipInstance(TrainingInstance):
    """A CLIP training instance: one positive image of ``concept``, negatives, and held-out validation images.

    Args:
        candidates: the concept names the images are classified over (the concept first).
        images: ``[1 + K, 3, S, S]`` in [0, 1]: the positive image, then ``K`` negative training images.
        labels: the concept of each training image.
        val_images: ``[V, 3, S, S]`` held-out positives of the concept and held-out negatives.
        val_labels: the concept of each held-out image.
        val_files: where each held-out image came from (named in rejection details).
    """

    candidates: list[str]
    images: torch.Tensor
    labels: list[str]
    val_images: torch.Tensor
    val_labels: list[str]
    val_files: list[str]


@dataclass
class ClipChunk:
    """Prompt-independent tensors of one chunk."""

    tokens: torch.Tensor  # [N, L, W] patch tokens of all training images
    images: torch.Tensor  # [N, 3, S, S] the training images (for the unmodified forward)
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
    # [V, T] each held-out image's unprompted probabilities over its instance's candidates (for the serving
    # rule of the gate; None when the gate does not use it)
    val_unprompted: torch.Tensor | None = None


class PromptedClip(PromptTool):
    """A frozen open_clip model whose image tower takes per-image deep visual prompts (SELECT / CLASSIFY).

    Args:
        model_name: open_clip architecture (``ViT-L-14``), ``hf-hub:org/repo`` or ``local-dir:/path`` (a
            directory with ``open_clip_config.json`` and weights, the layout ``save_for_hf`` writes).
        pretrained: open_clip pretrained tag or checkpoint path (ignored with ``hf-hub:``/``local-dir:``).
        num_prompt_tokens: prompt tokens in each prompted vision block (paper: 100).
        prompt_depth: leading vision blocks that get their own prompt tokens (paper: 3).
        text_template: text prompt of a concept; ``{}`` is the concept with underscores as spaces.
        gate_negatives: the gate also requires held-out negatives not to be classified as the concept.
        gate_decision: how the gate classifies a held-out image: ``prompted`` (the argmax of the prompted
            forward), ``serving`` (the rule CLASSIFY serves a pool with, see ``classify_margin``), or ``both`` (an
            image must be right by both rules).
        gate_criterion: ``all_correct`` (the paper's: every held-out image right with the prompt) or
            ``fewer_errors`` (the prompt makes fewer held-out errors than the unprompted tool, by each rule of
            ``gate_decision``): with several held-out positives a single-image prompt rarely gets all of them
            right, and the graded criterion keeps the prompts that help without keeping those that harm.
        top_k: serving ensembles the ``top_k`` stored prompts of the label most similar to the query image
            (``null``: all of them). CLOVA (supp. 9.4) ensembles "the prompts corresponding to data with high
            similarities" without a number; 10 is the number it gives for SEG, the other per-concept tool.
        classify_margin: how CLASSIFY decides with a pool. The unmodified forward gives every label a probability;
            a label with prompts is predicted instead of the unmodified argmax only where the forward with its own
            prompts ranks it first among all labels *and* gives it a probability above the unmodified forward's top
            probability plus this margin. So a label without prompts is judged by the same forward as in the
            unmodified tool, an all-zero ensembled prompt changes nothing (its forward is the unmodified one, see
            ``clova_train.tools.clip.margin.classify_forwards``), and a prompt changes a prediction only by winning
            the whole prompted classification. The gate's ``serving`` rule applies the same test to one instance's
            prompt over its candidate labels (the served decision uses the ensembled prompts over the request's
            labels). A larger margin keeps more of the unmodified tool's predictions (fewer false switches to a
            prompted label, fewer true ones); 1 keeps them all (what ``choose_margin`` returns when no margin keeps
            the labels without prompts safe on the validation images).
    """

    name: ClassVar[str] = "clip"
    default_lr: ClassVar[float] = 1e-2
    default_steps: ClassVar[int] = 100
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("accuracy_no_prompt", "accuracy_pool")
    served_operations: ClassVar[tuple[str, ...]] = ("score", "classify", "select")
    request_image_field: ClassVar[str] = "images"
    keep_float32: ClassVar[tuple[str, ...]] = ("mean", "std")  # images are resized and normalised in float32

    def __init__(
        self,
        model_name: str = "ViT-L-14",
        pretrained: str | None = "openai",
        num_prompt_tokens: int = 100,
        prompt_depth: int = 3,
        text_template: str = "a photo of a {}.",
        gate_negatives: bool = True,
        top_k: int | None = 10,
        gate_decision: Literal["both", "serving", "prompted"] = "both",
        gate_criterion: Literal["all_correct", "fewer_errors"] = "all_correct",
        classify_margin: float = 0.0,
    ) -> None:
        super().__init__()
        self.classify_margin = check_margin("classify_margin", classify_margin)
        if gate_decision not in ("both", "serving", "prompted"):
            raise ModelError(f"gate_decision must be 'both', 'serving' or 'prompted', got {gate_decision!r}")
        if gate_criterion not in ("all_correct", "fewer_errors"):
            raise ModelError(f"gate_criterion must be 'all_correct' or 'fewer_errors', got {gate_criterion!r}")
        self.gate_decision = gate_decision
        self.gate_criterion = gate_criterion
        if top_k is not None and top_k < 1:
            raise ModelError(f"top_k must be >= 1 or null (every prompt), got {top_k}")
        self.top_k = top_k
        self.source = ClipSource(model_name, pretrained)
        model, tokenizer = load_open_clip(self.source)
        self.num_prompt_tokens, self.prompt_depth = num_prompt_tokens, prompt_depth
        self.text_template = text_template
        self.gate_negatives = gate_negatives
        self.model = self.freeze(model)
        self.tokenizer = tokenizer
        visual = self.model.visual
        self.num_blocks = len(visual.transformer.resblocks)
        if not 1 <= prompt_depth <= self.num_blocks:
            raise ModelError(f"prompt_depth={prompt_depth} but the CLIP image tower has {self.num_blocks} blocks")
        if num_prompt_tokens < 1:
            raise ModelError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        self.width = int(visual.conv1.out_channels)
        size = visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        import open_clip

        preprocess = open_clip.get_model_preprocess_cfg(self.model)
        self.register_buffer("mean", torch.tensor(preprocess["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(preprocess["std"]).view(1, 3, 1, 1), persistent=False)
        projection = self.model.text_projection
        self._feature_dim = int(projection.shape[1]) if projection is not None else self.width
        self.identity = self._fingerprint()
        self._text_cache: dict[str, torch.Tensor] = {}
        # With class-token pooling only the class token of the last block is read, so the prompted forward
        # computes that block's queries, attention output and MLP for the class token alone (exact).
        self._class_token_only = (
            visual.attn_pool is None
            and getattr(visual, "pool_type", None) == "tok"
            and visual.transformer.batch_first
            and all(type(b) is open_clip.transformer.ResidualAttentionBlock for b in visual.transformer.resblocks)
            and not hasattr(visual.transformer.resblocks[-1], "ln_1_kv")
        )

    # ------------------------------------------------------------------ description
    @property
    def prompt_shape(self) -> tuple[int, int, int]:
        return (self.prompt_depth, self.num_prompt_tokens, self.width)

    @property
    def feature_dim(self) -> int:
        return self._feature_dim

    def init_args(self) -> dict[str, Any]:
        return {
            "model_name": self.source.model_name, "pretrained": self.source.pretrained,
            "num_prompt_tokens": self.num_prompt_tokens, "prompt_depth": self.prompt_depth,
            "text_template": self.text_template, "gate_negatives": self.gate_negatives, "top_k": self.top_k,
            "gate_decision": self.gate_decision, "gate_criterion": self.gate_criterion,
            "classify_margin": self.classify_margin,
        }

    @property
    def serving_top_k(self) -> int | None:
        return self.top_k

    def init_scale(self) -> float:
        """VPT's uniform init bound: sqrt(6 / (3 * patch_area + width))."""
        patch = self.model.visual.conv1.kernel_size
        return math.sqrt(6.0 / (3 * patch[0] * patch[1] + self.width))

    def checkpoint_blocks(self) -> list[nn.Module]:
        """The image tower's residual blocks, which the prompted forward (:meth:`encode_tokens`) calls one by one."""
        return list(self.model.visual.transformer.resblocks)

    def _fingerprint(self) -> str:
        """Architecture + weights identity: shapes of all tensors and the bytes of a few small ones."""
        digest = hashlib.sha256()
        state = self.model.state_dict()
        for name in sorted(state):
            digest.update(f"{name}:{tuple(state[name].shape)};".encode())
        for name in ("visual.class_embedding", "visual.proj", "text_projection", "logit_scale", "visual.ln_post.weight"):
            if name in state:
                digest.update(state[name].detach().cpu().float().numpy().tobytes())
        return f"open_clip:{digest.hexdigest()[:16]}"

    # ------------------------------------------------------------------ text
    def text_prompt(self, concept: str) -> str:
        return self.text_template.format(concept.replace("_", " "))

    @torch.no_grad()
    def encode_text(self, concepts: Sequence[str]) -> torch.Tensor:
        """Normalised text features ``[len(concepts), feature_dim]`` of the concepts' text prompts."""
        tokens = self.tokenizer([self.text_prompt(c) for c in concepts]).to(self.mean.device)
        return F.normalize(self.model.encode_text(tokens), dim=-1)

    def text_features(self, names: Sequence[str]) -> torch.Tensor:
        """:meth:`encode_text`, each name computed once per tool (the text tower never sees a prompt)."""
        missing = [n for n in dict.fromkeys(names) if n not in self._text_cache]
        if missing:
            for name, feature in zip(missing, self.encode_text(missing)):
                self._text_cache[name] = feature.float()
        return torch.stack([self._text_cache[n] for n in names]).to(self.mean.device)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp()

    def logits(self, features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """``logit_scale * features @ text.T`` in float32 (also under autocast: every loss and decision reads it)."""
        with self.full_precision():
            return self.logit_scale.float() * features.float() @ text.float().T

    # ------------------------------------------------------------------ image
    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` floats in [0, 1] -> resized to the model's input size and normalised."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ModelError(f"expected images of shape [N, 3, H, W], got {tuple(images.shape)}")
        images = images.to(self.mean.device, self.mean.dtype)
        if tuple(images.shape[-2:]) != self.image_size:
            images = F.interpolate(images, size=self.image_size, mode="bicubic", antialias=True, align_corners=False)
        return (images - self.mean) / self.std

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """Prompt-independent token embeddings (patches + class token + positions, after ln_pre)."""
        return vit_token_embeddings(self.model.visual, self.preprocess(images))

    def encode_tokens(self, tokens: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised image features from :meth:`embed_patches` output, with per-image prompts.

        Args:
            tokens: ``[N, L, width]``.
            prompts: ``[N, depth, num_prompt_tokens, width]`` or ``None`` for the unmodified tool.
        """
        visual = self.model.visual
        transformer = visual.transformer
        if prompts is None:
            x = transformer(tokens)
        else:
            expected = (tokens.shape[0], *self.prompt_shape)
            if tuple(prompts.shape) != expected:
                raise ModelError(f"prompts have shape {tuple(prompts.shape)}, expected {expected}")
            n_prompt = self.num_prompt_tokens
            prompts = prompts.to(tokens.dtype)
            x = tokens if transformer.batch_first else tokens.transpose(0, 1)
            seq_dim = 1 if transformer.batch_first else 0
            blocks = list(transformer.resblocks)
            shortcut = self._class_token_only and self.prompt_depth < len(blocks)
            for index, block in enumerate(blocks):
                if index < self.prompt_depth:
                    layer_prompt = prompts[:, index] if transformer.batch_first else prompts[:, index].transpose(0, 1)
                    start = 1 if index == 0 else 1 + n_prompt
                    rest = x.narrow(seq_dim, start, x.shape[seq_dim] - start)
                    x = torch.cat([x.narrow(seq_dim, 0, 1), layer_prompt, rest], dim=seq_dim)
                if shortcut and index == len(blocks) - 1:
                    x = _class_token_output(block, x)
                else:
                    x = block(x)
            if not shortcut:
                rest = x.narrow(seq_dim, 1 + n_prompt, x.shape[seq_dim] - 1 - n_prompt)
                x = torch.cat([x.narrow(seq_dim, 0, 1), rest], dim=seq_dim)
            if not transformer.batch_first:
                x = x.transpose(0, 1)
        pooled, _ = visual._pool(x)
        if visual.proj is not None:
            pooled = pooled @ visual.proj
        return F.normalize(pooled.float(), dim=-1)

    def encode_image(self, images: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised image features of ``[N, 3, H, W]`` images in [0, 1], optionally prompted."""
        return self.encode_tokens(self.embed_patches(images), prompts)

    # ------------------------------------------------------------------ training hooks
    def prepare(self, instances: Sequence[ClipInstance]) -> ClipChunk:
        names = sorted({c for item in instances for c in [*item.candidates, *item.labels, *item.val_labels]})
        index = {name: k for k, name in enumerate(names)}
        device = self.mean.device
        candidates = torch.zeros(len(instances), len(names), dtype=torch.bool, device=device)
        for i, item in enumerate(instances):
            candidates[i, [index[c] for c in item.candidates]] = True

        def stack(images: list[torch.Tensor], labels: list[list[str]]) -> tuple[torch.Tensor, ...]:
            batch = torch.cat(images).to(device)
            owner = torch.cat([torch.full((len(x),), i) for i, x in enumerate(images)]).to(device)
            label_index = torch.tensor([index[c] for group in labels for c in group], device=device)
            return batch, self.embed_patches(batch), owner, label_index

        images, tokens, owner, labels = stack([x.images for x in instances], [x.labels for x in instances])
        _, val_tokens, val_owner, val_labels = stack(
            [x.val_images for x in instances], [x.val_labels for x in instances]
        )
        sizes = torch.tensor([len(item.images) for item in instances])
        first = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]).to(device)
        text = self.text_features(names)
        val_unprompted = None
        if self.gate_decision != "prompted" or self.gate_criterion == "fewer_errors":
            logits = self.logits(self.encode_tokens(val_tokens, None), text)
            val_unprompted = logits.masked_fill(~candidates[val_owner], float("-inf")).softmax(-1)
        return ClipChunk(
            tokens, images, owner, labels, first, candidates, text, names,
            [str(item.concept) for item in instances], val_tokens, val_owner, val_labels,
            [f for item in instances for f in item.val_files], val_unprompted,
        )

    def _logits(self, tokens: torch.Tensor, owner: torch.Tensor, prompts: torch.Tensor, ctx: ClipChunk) -> torch.Tensor:
        logits = self.logits(self.encode_tokens(tokens, prompts[owner]), ctx.text)
        return logits.masked_fill(~ctx.candidates[owner], float("-inf"))

    def instance_losses(self, ctx: ClipChunk, prompts: torch.Tensor) -> torch.Tensor:
        logits = self._logits(ctx.tokens, ctx.owner, prompts, ctx)
        per_image = F.cross_entropy(logits, ctx.labels, reduction="none")
        n = prompts.shape[0]
        total = torch.zeros(n, dtype=per_image.dtype, device=per_image.device).index_add(0, ctx.owner, per_image)
        return total / torch.bincount(ctx.owner, minlength=n).to(per_image.dtype)

    def gate_predictions(self, ctx: ClipChunk, prompts: torch.Tensor) -> dict[str, torch.Tensor]:
        """The label index each held-out image is classified as with its instance's prompt, by each rule the
        gate applies (``gate_decision``): ``prompted`` (the prompted forward's argmax) and ``serving``."""
        prompted = self._logits(ctx.val_tokens, ctx.val_owner, prompts, ctx)
        rules = {}
        if self.gate_decision in ("prompted", "both"):
            rules["prompted"] = prompted.argmax(-1)
        if self.gate_decision in ("serving", "both"):
            unprompted = ctx.val_unprompted
            concept = torch.tensor([ctx.names.index(c) for c in ctx.concepts], device=unprompted.device)[ctx.val_owner]
            wins = self.prompted_label_wins(prompted.softmax(-1).to(unprompted.dtype), concept, unprompted)
            rules["serving"] = torch.where(wins, concept, unprompted.argmax(-1))
        return rules

    def prompted_label_wins(self, prompted: torch.Tensor, label: torch.Tensor, unprompted: torch.Tensor,
                            margin: float | None = None) -> torch.Tensor:
        """Booleans ``[N]``: where the forward with ``label``'s prompts (probabilities ``prompted``, ``[N, L]``)
        takes the prediction from the unmodified forward (probabilities ``unprompted``): ``label`` (an index, or
        ``[N]``) ranks first in it and beats the unmodified top probability by ``margin`` (default:
        ``classify_margin``)."""
        margin = self.classify_margin if margin is None else margin
        label = torch.as_tensor(label, device=prompted.device).expand(len(prompted))
        own = prompted.gather(1, label[:, None])[:, 0]
        return (prompted.argmax(-1) == label) & (own > unprompted.max(-1).values + margin)

    def gate(self, ctx: ClipChunk, prompts: torch.Tensor) -> list[GateResult]:
        rules = self.gate_predictions(ctx, prompts)
        if self.gate_criterion == "fewer_errors":
            rules["unprompted"] = ctx.val_unprompted.argmax(-1)
        errors: dict[str, list[list[Rejection]]] = {rule: [[] for _ in ctx.concepts] for rule in rules}
        for rule, predicted in rules.items():
            for k, (i, label, pred) in enumerate(zip(ctx.val_owner.tolist(), ctx.val_labels.tolist(), predicted.tolist())):
                concept, file = ctx.concepts[i], Path(ctx.val_files[k]).name
                if ctx.names[label] == concept and ctx.names[pred] != concept:
                    errors[rule][i].append(Rejection("held-out positive", f"{file} classified as {ctx.names[pred]!r} ({rule})"))
                elif self.gate_negatives and ctx.names[label] != concept and ctx.names[pred] == concept:
                    errors[rule][i].append(Rejection(
                        "held-out negative", f"{file} ({ctx.names[label]}) classified as {concept!r} ({rule})"))
        if self.gate_criterion == "all_correct":
            return [GateResult(tuple(e for rule in rules for e in errors[rule][i])) for i in range(len(ctx.concepts))]
        base = errors.pop("unprompted")
        results = []
        for i in range(len(ctx.concepts)):
            rejections = tuple(
                Rejection("no fewer errors", f"{len(errors[rule][i])} held-out errors with the prompt, "
                          f"{len(base[i])} without ({rule}): " + "; ".join(e.detail for e in errors[rule][i]))
                for rule in errors if len(errors[rule][i]) >= len(base[i])
            )
            results.append(GateResult(rejections))
        return results

    def pool_features(self, ctx: ClipChunk) -> torch.Tensor:
        return self.encode_tokens(ctx.tokens[ctx.first_image], None)

    def unmodified_outputs(self, ctx: ClipChunk) -> torch.Tensor:
        return F.normalize(self.model.encode_image(self.preprocess(ctx.images)).float(), dim=-1)

    def prompted_outputs(self, ctx: ClipChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        return self.encode_tokens(ctx.tokens, None if prompts is None else prompts[ctx.owner])

    # ------------------------------------------------------------------ serving
    def score(self, lookup: PromptLookup, images: torch.Tensor, labels: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """CLASSIFY scores with the pool and the unmodified tool's logits, both ``[N, len(labels)]``.

        The unprompted forward runs once: it gives the retrieval features, the unmodified logits and every label's
        score; a label with prompts gets the probability of the forward with its prompts where that forward takes
        the prediction (``classify_margin``), so the scores' argmax is the served label.
        """
        if not labels:
            raise ValueError("classify needs at least one label")
        forwards = classify_forwards(lookup, images, labels, tool=self)
        return served_scores(self, forwards, self.classify_margin), forwards.unprompted_logits

    def classify(self, lookup: PromptLookup, images: torch.Tensor, labels: Sequence[str]) -> tuple[list[str], torch.Tensor]:
        """Label each of ``images`` (``[N, 3, H, W]`` in [0, 1]) with one of ``labels``; also the scores."""
        scores, _ = self.score(lookup, images, labels)
        return [labels[i] for i in scores.argmax(-1).tolist()], scores.cpu()

    def select(self, lookup: PromptLookup, crops: torch.Tensor, concept: str) -> tuple[int, torch.Tensor]:
        """Index of the crop (``[M, 3, H, W]`` in [0, 1]) that best matches ``concept``, and all scores."""
        tokens = self.embed_patches(crops)
        prompts = lookup.prompts_for(concept, self.encode_tokens(tokens, None))
        features = self.encode_tokens(tokens, prompts)
        with self.full_precision():
            scores = features @ self.text_features([concept])[0]
        return int(scores.argmax()), scores.cpu()

    def evaluate(self, lookup: PromptLookup, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """CLASSIFY correctness over ``batch["names"]``, without prompts and with the pool."""
        names, labels = batch["names"], batch["labels"]
        scores, base_logits = self.score(lookup, batch["images"], names)
        correct = {
            key: torch.tensor([names[i] == y for i, y in zip(values.argmax(-1).tolist(), labels)], dtype=torch.float)
            for key, values in (("accuracy_no_prompt", base_logits), ("accuracy_pool", scores))
        }
        return correct

    def evaluation_samples(self, batch: dict[str, Any]) -> list[tuple[str, str]] | None:
        """Keyed by image file (``batch["files"]``, as the concept-folder datamodules give it)."""
        files = batch.get("files")
        return None if files is None else list(zip(files, batch["labels"]))

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"images": [paths], "labels": [...]}`` -> CLASSIFY; ``{"images": [...], "concept": c}`` -> SELECT."""
        from clova_train.tools.images import load_images

        if "labels" in request:
            labels = request["labels"]
            if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
                raise DataError("request field 'labels' must be a non-empty list of strings")
            predicted, scores = self.classify(lookup, load_images(request.get("images"), self.image_size[0], "images"), labels)
            return {"labels": predicted, "scores": scores.tolist()}
        concept = request.get("concept")
        if not isinstance(concept, str) or not concept:
            raise DataError("a CLIP request needs 'labels' (CLASSIFY) or 'concept' (SELECT)")
        images = load_images(request.get("images"), self.image_size[0], "images")
        index, scores = self.select(lookup, images, concept)
        return {"index": index, "scores": scores.tolist()}


def vit_token_embeddings(visual: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """``[N, 1 + grid**2, width]``: what open_clip's ``VisionTransformer`` feeds its first block (patch
    embedding, class token, positions, patch dropout, ``ln_pre``), built from its public submodules.

    open_clip 3.x has this step as the private ``VisionTransformer._embeds`` (absent from 2.x); this adapter
    is the only place that knows the tower's layout, and a test checks it against ``_embeds`` and the tower's
    own ``forward``.
    """
    x = visual.conv1(pixels)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    cls = visual.class_embedding.to(x.dtype).reshape(1, 1, -1).expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
    return visual.ln_pre(visual.patch_dropout(x))


def _class_token_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)[:, :1]`` for an open_clip ResidualAttentionBlock, computing only the class token's row."""
    normed = block.ln_1(x)
    h = x[:, :1] + block.ls_1(block.attention(q_x=normed[:, :1], k_x=normed, v_x=normed))
    return h + block.ls_2(block.mlp(block.ln_2(h)))
