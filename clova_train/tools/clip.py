"""CLIP (open_clip) as the SELECT / CLASSIFY tool, with deep visual prompts (VPT-deep, CLOVA supp. 9.4).

The frozen CLIP network takes learned prompt tokens in its vision transformer: for each of the first
``prompt_depth`` blocks, ``num_prompt_tokens`` tokens are placed right after the class token (replacing the
previous block's outputs at those positions, as in VPT-deep); after the last block the prompt positions
are dropped, so pooling and projection see exactly the unprompted token layout. With no prompt the
forward is open_clip's own (no tokens added), i.e. the unmodified tool.

This module needs no Lightning: the training module and the serving loader both use it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F
from torch import nn

from clova_train.core.errors import ModelError

LOCAL_DIR_PREFIX = "local-dir:"
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
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    preprocess = open_clip.get_model_preprocess_cfg(model)
    config = {"model_cfg": model_config, "preprocess_cfg": {"mean": preprocess["mean"], "std": preprocess["std"]}}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHT_FILE))
    return directory


@dataclass(frozen=True)
class PromptConfig:
    """Deep visual prompt layout.

    Args:
        num_prompt_tokens: prompt tokens per prompted block (paper: 100).
        prompt_depth: number of leading vision-transformer blocks that get their own prompt (paper: 3).
    """

    num_prompt_tokens: int = 100
    prompt_depth: int = 3


class PromptedClip(nn.Module):
    """A frozen open_clip model whose image tower accepts per-image deep visual prompts.

    Args:
        source: where the CLIP weights come from.
        prompt: prompt layout (tokens per block, number of prompted blocks).
        text_template: how a concept name becomes a text prompt; ``{}`` is replaced by the concept
            (underscores in concept names become spaces).
    """

    def __init__(
        self, source: ClipSource, prompt: PromptConfig = PromptConfig(), text_template: str = "a photo of a {}."
    ) -> None:
        super().__init__()
        model, tokenizer = load_open_clip(source)
        self.source = source
        self.prompt_config = prompt
        self.text_template = text_template
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        visual = self.model.visual
        self.num_blocks = len(visual.transformer.resblocks)
        if not 1 <= prompt.prompt_depth <= self.num_blocks:
            raise ModelError(
                f"prompt_depth={prompt.prompt_depth} but the CLIP image tower has {self.num_blocks} blocks"
            )
        if prompt.num_prompt_tokens < 1:
            raise ModelError(f"num_prompt_tokens must be >= 1, got {prompt.num_prompt_tokens}")
        self.width = int(visual.conv1.out_channels)
        size = visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        preprocess = open_clip.get_model_preprocess_cfg(self.model)
        self.register_buffer("mean", torch.tensor(preprocess["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(preprocess["std"]).view(1, 3, 1, 1), persistent=False)
        self.feature_dim = int(self.model.text_projection.shape[1]) if self.model.text_projection is not None else self.width
        self.identity = self._fingerprint()
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
        return (self.prompt_config.prompt_depth, self.prompt_config.num_prompt_tokens, self.width)

    def init_scale(self) -> float:
        """VPT's uniform init bound: sqrt(6 / (3 * patch_area + width))."""
        patch = self.model.visual.conv1.kernel_size
        return math.sqrt(6.0 / (3 * patch[0] * patch[1] + self.width))

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

    def describe(self) -> dict:
        """JSON-serialisable description that rebuilds this tool (see :meth:`from_description`)."""
        return {
            "tool": "clip",
            "source": asdict(self.source),
            "prompt": asdict(self.prompt_config),
            "text_template": self.text_template,
            "identity": self.identity,
            "prompt_shape": list(self.prompt_shape),
            "feature_dim": self.feature_dim,
        }

    @classmethod
    def from_description(cls, description: dict) -> PromptedClip:
        tool = cls(
            ClipSource(**description["source"]),
            PromptConfig(**description["prompt"]),
            description.get("text_template", "a photo of a {}."),
        )
        if description.get("identity") and description["identity"] != tool.identity:
            raise ModelError(
                f"CLIP weights loaded from {tool.source.model_name!r} have identity {tool.identity}, "
                f"but the prompts were trained on {description['identity']}"
            )
        return tool

    # ------------------------------------------------------------------ text
    def text_prompt(self, concept: str) -> str:
        return self.text_template.format(concept.replace("_", " "))

    @torch.no_grad()
    def encode_text(self, concepts: list[str]) -> torch.Tensor:
        """Normalised text features ``[len(concepts), feature_dim]`` of the concepts' text prompts."""
        tokens = self.tokenizer([self.text_prompt(c) for c in concepts]).to(self.mean.device)
        return F.normalize(self.model.encode_text(tokens), dim=-1)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp()

    # ------------------------------------------------------------------ image
    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` floats in [0, 1] -> resized to the model's input size and normalised."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ModelError(f"expected images of shape [N, 3, H, W], got {tuple(images.shape)}")
        images = images.to(self.mean.dtype)
        if tuple(images.shape[-2:]) != self.image_size:
            images = F.interpolate(images, size=self.image_size, mode="bicubic", antialias=True, align_corners=False)
        return (images - self.mean) / self.std

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """Prompt-independent token embeddings (patches + class token + positions, after ln_pre)."""
        return self.model.visual._embeds(self.preprocess(images))

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
            n_prompt = self.prompt_config.num_prompt_tokens
            prompts = prompts.to(tokens.dtype)
            x = tokens if transformer.batch_first else tokens.transpose(0, 1)
            seq_dim = 1 if transformer.batch_first else 0
            blocks = list(transformer.resblocks)
            shortcut = self._class_token_only and self.prompt_config.prompt_depth < len(blocks)
            for index, block in enumerate(blocks):
                if index < self.prompt_config.prompt_depth:
                    layer_prompt = prompts[:, index] if transformer.batch_first else prompts[:, index].transpose(0, 1)
                    rest = x.narrow(seq_dim, 1 if index == 0 else 1 + n_prompt, x.shape[seq_dim] - (1 if index == 0 else 1 + n_prompt))
                    x = torch.cat([x.narrow(seq_dim, 0, 1), layer_prompt, rest], dim=seq_dim)
                if shortcut and index == len(blocks) - 1:
                    x = _class_token_output(block, x)
                else:
                    x = block(x)
            if not shortcut:
                x = torch.cat([x.narrow(seq_dim, 0, 1), x.narrow(seq_dim, 1 + n_prompt, x.shape[seq_dim] - 1 - n_prompt)], dim=seq_dim)
            if not transformer.batch_first:
                x = x.transpose(0, 1)
        pooled, _ = visual._pool(x)
        if visual.proj is not None:
            pooled = pooled @ visual.proj
        return F.normalize(pooled, dim=-1)

    def encode_image(self, images: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised image features of ``[N, 3, H, W]`` images in [0, 1], optionally prompted."""
        return self.encode_tokens(self.embed_patches(images), prompts)


def _class_token_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)[:, :1]`` for an open_clip ResidualAttentionBlock, computing only the class token's row."""
    normed = block.ln_1(x)
    h = x[:, :1] + block.ls_1(block.attention(q_x=normed[:, :1], k_x=normed, v_x=normed))
    return h + block.ls_2(block.mlp(block.ln_2(h)))
