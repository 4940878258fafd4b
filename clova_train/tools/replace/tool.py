"""Stable Diffusion inpainting (diffusers' ``StableDiffusionInpaintPipeline``) as the REPLACE prompt tool
(CLOVA supp. 9.5): textual inversion, one learned token embedding per training instance.

Where the prompt enters: a placeholder token (``<concept>``) is added to the tokenizer once, and the text
encoder's embedding table grows by one row. The prompt (``1 x`` text width: 768 on SD 1.x) *is* that row: a
forward hook on the token embedding writes prompt row ``b`` at the placeholder's positions of text row ``b``.
Every other row and every network (VAE, UNet, text encoder) is frozen. Training text: ``template`` with the
placeholder (``"a photo of a <concept>"``).

Loss (the latent-diffusion loss of the paper): the inpainting UNet's noise-prediction MSE on its real
9-channel input (noisy latents, the mask at latent size, the masked image's latents), noised with the
pipeline's training schedule (a ``DDPMScheduler`` from its scheduler config; epsilon or v-prediction target).
The VAE latents (posterior mode, scaled) of each image and of its masked image are computed once per chunk
in ``prepare``, not once per step. Each step's noise and timestep come from a generator seeded by
``(instance id, step)``: an instance follows the same trajectory alone, in any chunk, on any rank. Adam 5e-3
(paper). Tokens start from the embedding of ``initializer_token`` (default: the concept's last word).

Gate (the paper has none; defined here): on the instance's held-out images of its concept, the mean
noise-prediction loss with the learned token must be at least ``gate_margin`` (2%) below the loss with the
concept's plain words in the same template, over ``gate_timesteps`` fixed timesteps (evenly spread over the
schedule) x ``gate_noise_draws`` noise draws seeded by the image, the same draws for both (a paired
comparison, so the verdict is reproducible). The margin keeps out tokens that only match the words by
chance: measured on the tiny pipeline (token loss / words loss), tuned tokens scored 0.955 to 1.009, random
tokens of the tuned norms 0.99 to 1.24, tokens tuned on other concepts' images 1.06 to 1.95. Blind spot: a
concept close to the target can pass when the words say little about the difference; a specificity check on
other concepts' images would catch it and is not part of this gate.

Ensemble: the image being edited does not show the new concept (it is what gets painted in), so there is no
query feature to weight stored tokens by. A concept's token is the uniform mean of its stored tokens,
rescaled to their mean norm (a plain mean of unrelated directions shrinks). The same token is served and
exported. Pool features (the mean latent inside the training image's mask) record what each instance looked
like; they weight nothing.

Export: each concept's ensembled token in diffusers' textual-inversion format
(``textual_inversion/<concept>-<hash>/learned_embeds.safetensors``, ``{"<concept_name>": [1, D]}``), loadable
by plain diffusers with ``pipeline.load_textual_inversion(path, token=...)``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from clova_train.core.errors import DataError, ModelError
from clova_train.tools.base import PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance
from clova_train.tools.pretrained import weights_fingerprint

DEFAULT_MODEL = "runwayml/stable-diffusion-inpainting"
EXPORT_FOLDER = "textual_inversion"
GATE_BATCH = 64  # UNet samples per gate forward (held-out images x timesteps x draws)
TOKENS_FILE = "tokens.json"


# ---------------------------------------------------------------------- data
@dataclass
class MaskedImage:
    """An image and the mask of its region to repaint (``image`` ``[3, H, W]`` in [0, 1], ``mask`` ``[1, H, W]``
    in {0, 1}, 1 = repaint), with the file it came from."""

    image: torch.Tensor
    mask: torch.Tensor
    source: str
    key: str = field(init=False)

    def __post_init__(self) -> None:
        check_masked_image(self.image, self.mask, self.source)
        digest = hashlib.sha256(self.image.float().numpy().tobytes())
        digest.update(self.mask.float().numpy().tobytes())
        self.key = digest.hexdigest()[:16]


def check_masked_image(image: torch.Tensor, mask: torch.Tensor, source: str) -> None:
    """Raise :class:`DataError` naming ``source`` if the image and mask cannot be inpainted."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise DataError(f"{source}: image must be [3, H, W], got {tuple(image.shape)}")
    if mask.ndim != 3 or mask.shape[0] != 1:
        raise DataError(f"{source}: mask must be [1, H, W], got {tuple(mask.shape)}")
    if tuple(mask.shape[1:]) != tuple(image.shape[1:]):
        raise DataError(f"{source}: the mask is {mask.shape[2]}x{mask.shape[1]} but the image is "
                        f"{image.shape[2]}x{image.shape[1]}")
    if not bool((mask >= 0.5).any()):
        raise DataError(f"{source}: the mask is empty (nothing to repaint)")


def load_mask(path: Path) -> torch.Tensor:
    """``[1, H, W]`` float mask in {0, 1} of a mask image (a pixel is repainted when its grey level >= 128)."""
    import numpy as np

    from clova_train.tools.images import open_rgb

    grey = np.asarray(open_rgb(Path(path)).convert("L"), dtype=np.uint8)
    return torch.from_numpy((grey >= 128).astype("float32"))[None]


def load_masked_image(image_path: Path, mask_path: Path | None) -> MaskedImage:
    """The image at ``image_path`` with its mask (``None``: the whole image is repainted)."""
    from clova_train.tools.images import load_image_uint8

    image = load_image_uint8(Path(image_path)).float() / 255
    mask = torch.ones(1, *image.shape[1:]) if mask_path is None else load_mask(mask_path)
    source = str(image_path) if mask_path is None else f"{image_path} (mask {mask_path})"
    return MaskedImage(image, mask, source)


@dataclass(kw_only=True)
class ReplaceInstance(TrainingInstance):
    """One training image of a concept for textual inversion.

    Args:
        words: the concept's plain words (``"purple circle"``), what the gate compares the token with.
        train: the training image and the mask of its concept's region.
        val: held-out images of the same concept (the gate's data).
    """

    words: str
    train: MaskedImage
    val: list[MaskedImage]


def concept_words(concept: str) -> str:
    """The plain words of a concept name: ``"purple_circle"`` -> ``"purple circle"``."""
    return " ".join(concept.replace("_", " ").split())


def save_image_atomic(image: Any, path: str | Path) -> Path:
    """Save a PIL image atomically (the format from ``path``'s suffix)."""
    from clova_train.core.atomic import atomic_path

    path = Path(path)
    file_format = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}.get(path.suffix.lower(), "PNG")
    with atomic_path(path) as tmp:
        image.save(tmp, format=file_format)
    return path


def load_inpaint_pipeline(model_name: str) -> Any:
    """``StableDiffusionInpaintPipeline.from_pretrained`` (a hub id or a local directory), without safety checker,
    with one clear error."""
    from diffusers import StableDiffusionInpaintPipeline

    local = Path(model_name).expanduser()
    if (model_name.startswith((".", "/", "~")) or local.exists()) and not (local / "model_index.json").is_file():
        raise ModelError(f"Stable Diffusion inpainting directory {local} not found or has no model_index.json")
    from clova_train.core.errors import loading

    with loading("the Stable Diffusion inpainting model", model_name):
        pipeline = StableDiffusionInpaintPipeline.from_pretrained(
            model_name, safety_checker=None, requires_safety_checker=False)
    if pipeline.unet.config.in_channels != 9:
        raise ModelError(f"{model_name!r} is not an inpainting model: its UNet takes "
                         f"{pipeline.unet.config.in_channels} channels, not 9")
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def ensembled_token(prompts: torch.Tensor) -> torch.Tensor:
    """A concept's served token ``[1, D]``: the uniform mean of its stored tokens ``[n, 1, D]``, rescaled to their
    mean norm (module docstring)."""
    prompts = prompts.float()
    mean = prompts.mean(0)
    norm = float(mean.norm())
    return mean * (float(prompts.flatten(1).norm(dim=1).mean()) / norm) if norm > 0 else mean


def export_token_name(concept: str) -> str:
    """The token a concept's exported embedding is installed as: ``<purple_circle>``."""
    return "<" + re.sub(r"\s+", "_", concept.strip()) + ">"


# ---------------------------------------------------------------------- chunk context
@dataclass
class Latents:
    """VAE latents of images (prompt-independent, computed once)."""

    latents: torch.Tensor  # [m, C, h, w], scaled
    masked: torch.Tensor  # [m, C, h, w] latents of the masked images, scaled
    masks: torch.Tensor  # [m, 1, h, w] masks at latent size


@dataclass
class ReplaceChunk:
    """Prompt-independent tensors of one chunk."""

    ids: list[str]
    train: Latents  # one row per instance
    token_ids: torch.Tensor  # [1, T] template with the placeholder
    features: torch.Tensor  # [n, C]
    val: Latents | None  # one row per distinct held-out image of the chunk
    val_of: list[list[int]]  # per instance: its rows of ``val``
    val_keys: list[str]
    words_val_loss: dict[tuple[int, str], float]  # (val row, words) -> the words' gate loss
    words: list[str]
    step: int = 0  # calls of instance_losses so far: the step that seeds the draws


class InpaintTextualInversion(PromptTool):
    """A frozen Stable Diffusion inpainting pipeline whose placeholder token is a learned embedding (REPLACE).

    Args:
        model_name: a hub id (``runwayml/stable-diffusion-inpainting``) or a local directory of a
            ``StableDiffusionInpaintPipeline`` (its ``model_index.json``), loaded with ``from_pretrained``.
        placeholder_token: the token added to the tokenizer whose embedding is learned; it must be new to the
            tokenizer and kept whole by it (no spaces).
        template: the training and serving text, ``{}`` standing for the concept (the placeholder, or the
            concept's words with no token).
        initializer_token: the word whose embedding a token starts from (default: the concept's last word,
            ``"circle"`` for ``purple_circle``; it must be one token).
        resolution: side length images are resized to (SD 1.x inpainting: 512; the tiny pipeline: 16).
        gate_timesteps: fixed timesteps of the gate, evenly spread over the training schedule.
        gate_noise_draws: noise draws per held-out image and timestep in the gate.
        gate_margin: the token's held-out loss must be this fraction below the words' (0.02: 2%).
        num_inference_steps: denoising steps when serving.
        guidance_scale: classifier-free guidance scale when serving.
    """

    name: ClassVar[str] = "sd_inpaint_replace"
    serving_rule: ClassVar[str | None] = (
        "the concept's token is the uniform mean of its stored tokens (no query feature: the ensemble below does not "
        "apply); the export's textual_inversion/ holds each concept's token in diffusers' format "
        "(pipeline.load_textual_inversion).")
    default_lr: ClassVar[float] = 5e-3
    default_steps: ClassVar[int] = 200
    served_operations: ClassVar[tuple[str, ...]] = ("inpaint", "token_for")

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        placeholder_token: str = "<concept>",
        template: str = "a photo of a {}",
        initializer_token: str | None = None,
        resolution: int = 512,
        gate_timesteps: int = 10,
        gate_noise_draws: int = 2,
        gate_margin: float = 0.02,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
    ) -> None:
        super().__init__()
        from diffusers import DDPMScheduler

        if template.count("{}") != 1:
            raise ModelError(f"template must contain exactly one '{{}}' for the concept, got {template!r}")
        if gate_timesteps < 1 or gate_noise_draws < 1:
            raise ModelError(f"gate_timesteps and gate_noise_draws must be >= 1, got {gate_timesteps}, {gate_noise_draws}")
        if not 0 <= gate_margin < 1:
            raise ModelError(f"gate_margin must be in [0, 1), got {gate_margin}")
        if num_inference_steps < 1:
            raise ModelError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        self.model_name, self.placeholder_token, self.template = model_name, placeholder_token, template
        self.initializer_token, self.resolution = initializer_token, resolution
        self.gate_timesteps, self.gate_noise_draws, self.gate_margin = gate_timesteps, gate_noise_draws, gate_margin
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale

        pipeline = load_inpaint_pipeline(model_name)
        factor = int(pipeline.vae_scale_factor)
        if resolution < factor or resolution % factor != 0:
            raise ModelError(f"resolution must be a positive multiple of the VAE's scale factor {factor}, got {resolution}")
        self.tokenizer = pipeline.tokenizer
        self.vae = self.freeze(pipeline.vae)
        self.unet = self.freeze(pipeline.unet)
        self.text_encoder = self.freeze(pipeline.text_encoder)
        self.identity = weights_fingerprint(
            "sd_inpaint", torch.nn.ModuleDict({"unet": self.unet, "vae": self.vae, "text": self.text_encoder}),
            ("text.text_model.final_layer_norm.weight", "unet.conv_in.weight", "unet.conv_out.weight",
             "vae.encoder.conv_in.weight", "vae.decoder.conv_out.weight"), len(self.tokenizer))
        self.placeholder_id = self._add_placeholder(placeholder_token)
        self.noise_schedule = DDPMScheduler.from_config(pipeline.scheduler.config)
        self.pipeline = pipeline
        self.width = int(self.text_encoder.config.hidden_size)
        self._active: torch.Tensor | None = None  # [rows or 1, D] written at the placeholder while set
        self.text_encoder.get_input_embeddings().register_forward_hook(self._substitute_placeholder)

    # ------------------------------------------------------------------ the placeholder token
    def _single_token(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _add_placeholder(self, token: str) -> int:
        if not token or token != token.strip() or any(c.isspace() for c in token):
            raise ModelError(f"placeholder_token {token!r} must be one word without spaces")
        if token in self.tokenizer.get_vocab() or token in self.tokenizer.all_special_tokens:
            raise ModelError(f"placeholder_token {token!r} is already in the tokenizer's vocabulary: choose a new one")
        known = self._single_token(token)
        if len(known) == 1:
            existing = self.tokenizer.convert_ids_to_tokens(known[0])
            raise ModelError(f"placeholder_token {token!r} is already read by the tokenizer as the token "
                             f"{existing!r}: choose a new one")
        self.tokenizer.add_tokens([token])
        ids = self._single_token(token)
        in_text = self._single_token(self.template.format(token))
        placeholder = self.tokenizer.convert_tokens_to_ids(token)
        if ids != [placeholder] or in_text.count(placeholder) != 1:
            raise ModelError(f"placeholder_token {token!r} is split by the tokenizer ({ids}): choose another")
        self.text_encoder.resize_token_embeddings(len(self.tokenizer), mean_resizing=False)
        with torch.no_grad():  # never read: the hook writes the prompt there (zero keeps the row deterministic)
            self.text_encoder.get_input_embeddings().weight[placeholder:] = 0
        self.text_encoder.requires_grad_(False)
        return int(placeholder)

    def _substitute_placeholder(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self._active is None:
            return None
        where = (inputs[0] == self.placeholder_id)[..., None]
        rows = self._active.to(output.dtype)
        rows = rows.expand(output.shape[0], -1) if rows.shape[0] == 1 else rows
        return torch.where(where, rows[:, None, :], output)

    def text_states(self, token_ids: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """The text encoder's last hidden states of ``token_ids`` ``[b, T]``, the placeholder of row ``b`` being
        ``prompts[b]`` (``[b, 1, D]``; ``[1, 1, D]`` for every row)."""
        self._active = None if prompts is None else prompts.reshape(prompts.shape[0], -1)
        try:
            return self.text_encoder(token_ids.to(self.device))[0]
        finally:
            self._active = None

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(texts), padding="max_length", max_length=self.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids.to(self.device)

    def initial_token(self, words: str) -> torch.Tensor:
        """``[1, D]`` embedding of the initializer token (default: the last word of ``words``)."""
        word = self.initializer_token or words.split()[-1]
        ids = self._single_token(word)
        if len(ids) != 1:
            raise DataError(f"initializer token {word!r} is {len(ids)} tokens, not one: set initializer_token")
        return self.text_encoder.get_input_embeddings().weight[ids[0]].detach().float().cpu()[None]

    # ------------------------------------------------------------------ description
    @property
    def prompt_shape(self) -> tuple[int, int]:
        return (1, self.width)

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """The UNet's down, mid and up blocks and the text encoder's layers: the token reaches the loss through the
        text encoder and the UNet's cross-attention (the VAE runs once per chunk, without gradients)."""
        unet = self.unet
        mid = [] if unet.mid_block is None else [unet.mid_block]
        text = getattr(self.text_encoder, "text_model", self.text_encoder)  # transformers 4.x nests it, 5.x does not
        return [*unet.down_blocks, *mid, *unet.up_blocks, *text.encoder.layers]

    @property
    def feature_dim(self) -> int:
        return int(self.vae.config.latent_channels)

    def init_args(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "placeholder_token": self.placeholder_token, "template": self.template,
                "initializer_token": self.initializer_token, "resolution": self.resolution,
                "gate_timesteps": self.gate_timesteps, "gate_noise_draws": self.gate_noise_draws,
                "gate_margin": self.gate_margin, "num_inference_steps": self.num_inference_steps,
                "guidance_scale": self.guidance_scale}

    def init_scale(self) -> float:
        """Tokens start at the initializer word's embedding plus uniform noise in +-0.001 (see initial_prompts)."""
        return 1e-3

    def initial_prompts(self, instances: Sequence[ReplaceInstance]) -> torch.Tensor:
        return torch.stack([self.initial_token(item.words) for item in instances]).double()

    # ------------------------------------------------------------------ prompt-independent parts
    def _pixels(self, images: Sequence[MaskedImage]) -> tuple[torch.Tensor, torch.Tensor]:
        size = (self.resolution, self.resolution)
        pixels = torch.stack([F.interpolate(item.image[None].float(), size=size, mode="bilinear", antialias=True,
                                            align_corners=False)[0] for item in images]) * 2 - 1
        masks = torch.stack([(F.interpolate(item.mask[None].float(), size=size, mode="nearest")[0] >= 0.5).float()
                             for item in images])
        return pixels.clamp(-1, 1).to(self.device), masks.to(self.device)

    def encode(self, images: Sequence[MaskedImage]) -> Latents:
        """Scaled posterior-mode latents of the images and of their masked images, masks at latent size.

        Float32 whatever the VAE's dtype: the noise, the schedule's noising and the loss's target are computed from
        them in float32 (the UNet's input is cast to its precision by autocast)."""
        pixels, masks = self._pixels(images)
        scale = float(self.vae.config.scaling_factor)
        latents = self.vae.encode(pixels).latent_dist.mode().float() * scale
        masked = self.vae.encode(pixels * (masks < 0.5)).latent_dist.mode().float() * scale
        return Latents(latents, masked, F.interpolate(masks, size=latents.shape[-2:]))

    def check_instance(self, instance: ReplaceInstance) -> None:
        if not instance.words.strip():
            raise DataError(f"instance {instance.instance_id}: the concept has no words")
        self.initial_token(instance.words)

    def prepare(self, instances: Sequence[ReplaceInstance]) -> ReplaceChunk:
        train = self.encode([item.train for item in instances])
        inside = train.masks.sum((2, 3)).clamp_min(1)
        features = (train.latents * train.masks).sum((2, 3)) / inside
        keys: dict[str, int] = {}
        images: list[MaskedImage] = []
        val_of = []
        for item in instances:
            rows = []
            for image in item.val:
                if image.key not in keys:
                    keys[image.key] = len(images)
                    images.append(image)
                rows.append(keys[image.key])
            val_of.append(rows)
        val = self.encode(images) if images else None
        words = [item.words for item in instances]
        words_loss: dict[tuple[int, str], float] = {}
        if val is not None:
            pairs = sorted({(row, w) for rows, w in zip(val_of, words) for row in rows})
            losses = self._gate_losses(val, [r for r, _ in pairs], [self.template.format(w) for _, w in pairs],
                                       [images[r].key for r, _ in pairs], None)
            words_loss = {pair: float(loss) for pair, loss in zip(pairs, losses)}
        return ReplaceChunk([item.instance_id for item in instances], train,
                            self.tokenize([self.template.format(self.placeholder_token)]), features, val, val_of,
                            [image.key for image in images], words_loss, words)

    # ------------------------------------------------------------------ the loss
    def _target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        kind = self.noise_schedule.config.prediction_type
        if kind == "epsilon":
            return noise
        if kind == "v_prediction":
            return self.noise_schedule.get_velocity(latents, noise, timesteps)
        raise ModelError(f"unsupported prediction_type {kind!r} (epsilon or v_prediction)")

    def _noise_losses(self, latents: Latents, rows: torch.Tensor, states: torch.Tensor, noise: torch.Tensor,
                      timesteps: torch.Tensor) -> torch.Tensor:
        """Per-sample noise-prediction MSE of latent rows ``rows`` with text ``states``, ``noise`` and ``timesteps``."""
        clean = latents.latents[rows]
        noisy = self.noise_schedule.add_noise(clean, noise, timesteps)
        model_input = torch.cat([noisy, latents.masks[rows], latents.masked[rows]], 1)
        prediction = self.unet(model_input, timesteps, states).sample
        return (prediction.float() - self._target(clean, noise, timesteps).float()).pow(2).mean((1, 2, 3))

    def _draw(self, seed_text: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        digest = hashlib.sha256(seed_text.encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        noise = torch.randn(shape, generator=generator)
        timestep = torch.randint(int(self.noise_schedule.config.num_train_timesteps), (1,), generator=generator)
        return noise, timestep

    def _instance_draws(self, ctx: ReplaceChunk, seed_texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(noise ``[n, C, h, w]``, timesteps ``[n]``) for the chunk's instances, one seed text each."""
        draws = [self._draw(text, tuple(ctx.train.latents.shape[1:])) for text in seed_texts]
        return (torch.stack([d[0] for d in draws]).to(self.device, ctx.train.latents.dtype),
                torch.cat([d[1] for d in draws]).to(self.device))

    def instance_losses(self, ctx: ReplaceChunk, prompts: torch.Tensor) -> torch.Tensor:
        """Each instance's noise-prediction loss on its training image at this step's seeded noise and timestep."""
        ctx.step += 1
        n = len(ctx.ids)
        noise, timesteps = self._instance_draws(ctx, [f"{instance_id}:{ctx.step}" for instance_id in ctx.ids])
        states = self.text_states(ctx.token_ids.expand(n, -1), prompts)
        return self._noise_losses(ctx.train, torch.arange(n, device=self.device), states, noise, timesteps)

    # ------------------------------------------------------------------ the gate
    def gate_schedule(self) -> torch.Tensor:
        """The gate's fixed timesteps, evenly spread over the training schedule (ends excluded)."""
        total = int(self.noise_schedule.config.num_train_timesteps)
        return ((torch.arange(self.gate_timesteps) + 0.5) * total / self.gate_timesteps).long()

    def _gate_losses(self, val: Latents, rows: list[int], texts: list[str], keys: list[str],
                     prompts: torch.Tensor | None) -> torch.Tensor:
        """Mean loss over the gate's timesteps and draws for each (held-out row, text[, prompt]) pair, the UNet
        run on up to ``GATE_BATCH`` samples at a time (pairs x timesteps x draws)."""
        if not rows:
            return torch.zeros(0)
        times = self.gate_schedule()
        shape = tuple(val.latents.shape[1:])
        per_pair = len(times) * self.gate_noise_draws
        states = self.text_states(self.tokenize(texts), prompts)  # one text row per pair
        noise = torch.cat([
            torch.stack([self._draw(f"gate:{key}:{d}", shape)[0] for d in range(self.gate_noise_draws)]).repeat(
                len(times), 1, 1, 1) for key in keys]).to(self.device, val.latents.dtype)
        timesteps = times.repeat_interleave(self.gate_noise_draws).repeat(len(rows)).to(self.device)
        pair = torch.arange(len(rows), device=self.device).repeat_interleave(per_pair)
        latent_rows = torch.as_tensor(rows, device=self.device)[pair]
        losses = torch.cat([
            self._noise_losses(val, latent_rows[k : k + GATE_BATCH], states[pair[k : k + GATE_BATCH]],
                               noise[k : k + GATE_BATCH], timesteps[k : k + GATE_BATCH])
            for k in range(0, len(pair), GATE_BATCH)])
        return losses.reshape(len(rows), per_pair).mean(1)

    def held_out_losses(self, ctx: ReplaceChunk, prompts: torch.Tensor | None) -> list[torch.Tensor]:
        """Per instance, the gate loss ``[v]`` on each of its held-out images with its token (prompt row i), or
        with its plain words when ``prompts`` is ``None``."""
        if ctx.val is None:
            return [torch.zeros(0) for _ in ctx.ids]
        if prompts is None:
            return [torch.tensor([ctx.words_val_loss[(r, ctx.words[i])] for r in rows])
                    for i, rows in enumerate(ctx.val_of)]
        owners = [i for i, rows in enumerate(ctx.val_of) for _ in rows]
        rows = [r for instance_rows in ctx.val_of for r in instance_rows]
        losses = self._gate_losses(ctx.val, rows, [self.template.format(self.placeholder_token)] * len(rows),
                                   [ctx.val_keys[r] for r in rows], prompts[owners]).float().cpu()
        return list(losses.split([len(instance_rows) for instance_rows in ctx.val_of]))

    def gate(self, ctx: ReplaceChunk, prompts: torch.Tensor) -> list[GateResult]:
        results = []
        for i, (token, words) in enumerate(zip(self.held_out_losses(ctx, prompts), self.held_out_losses(ctx, None))):
            if not len(token):
                results.append(GateResult.failed("no held-out images", f"{ctx.ids[i]}: the gate needs held-out images"))
            elif float(token.mean()) <= (1 - self.gate_margin) * float(words.mean()):
                results.append(GateResult())
            else:
                results.append(GateResult((Rejection(
                    "not better than the words",
                    f"held-out loss {float(token.mean()):.4f} with the token vs {float(words.mean()):.4f} with "
                    f"{ctx.words[i]!r} (must be {self.gate_margin:.1%} lower)"),)))
        return results

    def pool_features(self, ctx: ReplaceChunk) -> torch.Tensor:
        return ctx.features

    # ------------------------------------------------------------------ checked by check_tool
    def _training_predictions(self, ctx: ReplaceChunk, states: torch.Tensor) -> torch.Tensor:
        """The UNet's predictions ``[n, C*h*w]`` on the training latents at fixed seeded draws, with text ``states``."""
        noise, timesteps = self._instance_draws(ctx, [f"check:{instance_id}" for instance_id in ctx.ids])
        noisy = self.noise_schedule.add_noise(ctx.train.latents, noise, timesteps)
        unet_input = torch.cat([noisy, ctx.train.masks, ctx.train.masked], 1)
        return self.unet(unet_input, timesteps, states).sample.flatten(1)

    def unmodified_outputs(self, ctx: ReplaceChunk) -> torch.Tensor:
        """diffusers' UNet on the training latents with the concept's words through the library text encoder."""
        states = self.text_encoder(self.tokenize([self.template.format(w) for w in ctx.words]))[0]
        return self._training_predictions(ctx, states)

    def prompted_outputs(self, ctx: ReplaceChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        """The same through the prompted path: the token's template (or, with no prompt, the words)."""
        if prompts is None:
            states = self.text_states(self.tokenize([self.template.format(w) for w in ctx.words]), None)
        else:
            states = self.text_states(ctx.token_ids.expand(len(ctx.ids), -1), prompts)
        return self._training_predictions(ctx, states)

    # ------------------------------------------------------------------ serving
    def token_for(self, lookup: PromptLookup, concept: str) -> torch.Tensor | None:
        """The concept's ensembled token ``[1, D]`` (uniform mean, module docstring), or ``None`` without one."""
        stored = lookup.candidates(concept)
        return None if stored is None else ensembled_token(stored[1])

    def inpaint(self, lookup: PromptLookup, image: Any, mask: Any, concept: str, seed: int = 0) -> tuple[Any, bool]:
        """Repaint the masked region of ``image`` as ``concept``; returns (the PIL image, at ``image``'s size, and
        whether a token was used).

        ``image``: a PIL image or a path; ``mask``: a PIL image or a path (white = repaint). With a pool token
        the text is the template with the placeholder; without one, the template with the concept's words
        (the unmodified pipeline).
        """
        from PIL import Image

        if not isinstance(concept, str) or not concept.strip():
            raise DataError("inpaint needs a concept name")
        image = self._as_pil(image, "image").convert("RGB")
        mask_image = self._as_pil(mask, "mask").convert("L")
        if mask_image.size != image.size:
            raise DataError(f"the mask is {mask_image.size[0]}x{mask_image.size[1]} but the image is "
                            f"{image.size[0]}x{image.size[1]}")
        if max(mask_image.getextrema()) < 128:
            raise DataError("the mask is empty (nothing to repaint)")
        token = self.token_for(lookup, concept)
        text = self.template.format(concept_words(concept) if token is None else self.placeholder_token)
        size = self.resolution
        self._active = None if token is None else token.to(self.device)
        try:
            result = self.pipeline(
                prompt=text, image=image.resize((size, size), Image.BICUBIC),
                mask_image=mask_image.resize((size, size), Image.NEAREST), height=size, width=size,
                num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                generator=torch.Generator(device="cpu").manual_seed(int(seed)),
            ).images[0]
        finally:
            self._active = None
        if result.size != image.size:  # the pipeline works at its resolution; the caller gets its own picture's size
            result = result.resize(image.size, Image.BICUBIC)
        return result, token is not None

    @staticmethod
    def _as_pil(value: Any, what: str) -> Any:
        from clova_train.tools.images import open_rgb

        if isinstance(value, (str, Path)):
            if what == "mask":
                from PIL import Image

                return Image.fromarray((load_mask(Path(value))[0].numpy() * 255).astype("uint8"))
            return open_rgb(Path(value))
        if not hasattr(value, "convert"):
            raise DataError(f"{what} must be a PIL image or a file path, got {type(value).__name__}")
        return value

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"image": path, "mask": path, "concept": name, "output": path, "seed": int}`` -> ``{"output", "prompted"}``;
        the edited image is written to ``output`` atomically."""
        for key in ("image", "mask", "concept", "output"):
            if not isinstance(request.get(key), str) or not request[key].strip():
                raise DataError(f"a REPLACE request needs {key!r}: a non-empty string")
        seed = request.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise DataError(f"'seed' must be an integer from 0 to 2**63 - 1, got {seed!r}")
        edited, prompted = self.inpaint(lookup, request["image"], request["mask"], request["concept"], seed)
        try:
            written = save_image_atomic(edited, request["output"])
        except OSError as err:  # a name the file system refuses, a file where a folder is needed, no permission
            raise DataError(f"'output' {request['output']!r} cannot be written: {err.strerror or err}") from err
        return {"output": str(written), "prompted": prompted}

    # ------------------------------------------------------------------ export
    @classmethod
    def write_export_files(cls, pool: Any, description: dict[str, Any], directory: Path) -> None:
        """Each concept's ensembled token in diffusers' textual-inversion format, and ``tokens.json`` naming them."""
        from safetensors.torch import save_file

        from clova_train.core.atomic import write_json_atomic

        tokens = {}
        for concept in pool.concepts:
            _, prompts, ids = pool.entry(concept)
            token = export_token_name(concept)
            folder = Path(EXPORT_FOLDER) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', concept)}-" \
                                           f"{hashlib.sha256(concept.encode()).hexdigest()[:6]}"
            (directory / folder).mkdir(parents=True, exist_ok=True)
            save_file({token: ensembled_token(prompts).contiguous()}, str(directory / folder / "learned_embeds.safetensors"))
            tokens[concept] = {"token": token, "path": str(folder), "instances": len(ids)}
        write_json_atomic(directory / EXPORT_FOLDER / TOKENS_FILE, {
            "model": description.get("init_args", {}).get("model_name"), "template": description.get("init_args", {}).get("template"),
            "ensemble": "uniform mean of the concept's tokens, rescaled to their mean norm", "concepts": tokens,
        })
