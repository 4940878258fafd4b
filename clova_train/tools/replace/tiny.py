"""A tiny Stable Diffusion inpainting pipeline of the real architecture, for the REPLACE quickstart and tests.

Components (diffusers / transformers classes of the real pipeline, built from configs):

* ``AutoencoderKL``: 2 blocks, 16 px RGB to 8 x 8 x 4 latents (``vae_scale_factor`` 2);
* ``UNet2DConditionModel`` with 9 input channels (noisy latents, mask, masked-image latents), width 32;
* ``CLIPTextModel`` of width 32 with CLIP's own byte-level BPE tokenizer (16 tokens);
* SD's ``DDIMScheduler`` settings (scaled-linear betas 0.00085 to 0.012, 1000 training steps); no safety
  checker.

Saved with ``StableDiffusionInpaintPipeline.save_pretrained`` and loaded back with ``from_pretrained``, so
the tool reads it exactly as it reads ``runwayml/stable-diffusion-inpainting``.

A random network cannot show what a learned token adds, so the pipeline is pretrained briefly on rendered
shapes (:func:`pretrain_inpainting`): first the VAE to reconstruct, then the UNet and text encoder to
inpaint a masked shape from its caption. The captions make the REPLACE quickstart's concept something the
model can paint but not name: orange shapes are always called "amber", while "orange" is said of a shape of
*any* colour in one caption of five. So the words "orange circle" only say "a circle of some colour", and a
token learned from orange circles has something to add (the quickstart measures it against the words, the
untuned token and random tokens). Orange, not the other tools' purple: purple lies between the other
colours, so knowing it barely lowers the loss (measured: the exact word helped purple circles by 0.5%,
orange ones by 4 to 9%). Everything runs on one thread, so a build is the same on every machine
(``clova-train tiny-model sd-inpaint DIR``, about 4 minutes on one core).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clova_train.tools.replace.synthetic import masked_shape
from clova_train.synthetic.shapes import COLOURS, SHAPES
from clova_train.tools.tiny_common import clip_bpe_tokenizer, pretraining_steps, single_thread, warmup_cosine

IMAGE_SIZE = 16
TEXT_LENGTH = 16
# Colour words of the pretraining captions and the palette colour each names: the quickstart's orange is "amber".
CAPTION_COLOURS = {"red": "red", "green": "green", "blue": "blue", "yellow": "yellow", "purple": "purple",
                   "amber": "orange"}
VAGUE_WORD = "orange"  # said of any colour in VAGUE_FRACTION of the captions
VAGUE_FRACTION = 0.2
EMPTY_FRACTION = 0.1  # captionless examples, so classifier-free guidance has an unconditional model


def build_tiny_inpainting_pipeline(directory: str | Path, seed: int = 0, image_size: int = IMAGE_SIZE,
                                   unet_width: int = 32, vae_width: int = 8) -> object:
    """A random-weight ``StableDiffusionInpaintPipeline`` (tokenizer files are written to ``directory``);
    ``image_size`` / ``unet_width`` / ``vae_width`` make larger ones (the benchmark's)."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionInpaintPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = clip_bpe_tokenizer(Path(directory) / "tokenizer-build", max_length=TEXT_LENGTH)
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(vae_width, 2 * vae_width),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=2, sample_size=image_size,
    )
    unet = UNet2DConditionModel(
        sample_size=image_size // 2, in_channels=9, out_channels=4, layers_per_block=1,
        block_out_channels=(unet_width, 2 * unet_width),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    )
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=TEXT_LENGTH, projection_dim=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, num_train_timesteps=1000)
    return StableDiffusionInpaintPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet.eval(), scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def _caption(rng: np.random.Generator, word: str, shape: str) -> str:
    draw = rng.random()
    if draw < EMPTY_FRACTION:
        return ""
    if draw < EMPTY_FRACTION + VAGUE_FRACTION:
        word = VAGUE_WORD
    return f"a photo of a {word} {shape}"


def pretraining_scenes(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(images ``[count, 3, 16, 16]`` in [-1, 1], masks ``[count, 1, 16, 16]`` in {0, 1}, captions)."""
    rng = np.random.default_rng(seed)
    palette = {word: COLOURS[colour] for word, colour in CAPTION_COLOURS.items()}
    words = list(CAPTION_COLOURS)
    images, masks, captions = [], [], []
    for _ in range(count):
        word, shape = words[rng.integers(len(words))], SHAPES[rng.integers(len(SHAPES))]
        image, mask = masked_shape(rng, word, shape, IMAGE_SIZE, palette)
        images.append(torch.from_numpy(image).permute(2, 0, 1).float() / 127.5 - 1)
        masks.append(torch.from_numpy(mask)[None].float() / 255)
        captions.append(_caption(rng, word, shape))
    return torch.stack(images), torch.stack(masks), captions


def pretrain_inpainting(pipeline: object, vae_steps: int = 400, unet_steps: int = 1200, scenes: int = 4096,
                        seed: int = 0, log_every: int = 0) -> None:
    """Pretrain the tiny pipeline on rendered shapes (module docstring), on one thread.

    The VAE learns to reconstruct (posterior mode, Adam 3e-3, batch 16); its latent scale is then set so that
    latents have unit variance, as SD's ``scaling_factor`` does. The UNet and text encoder then learn the
    inpainting noise-prediction loss on the cached latents (batch 32, AdamW 3e-3, warm-up and cosine decay).
    """
    vae, unet, text_encoder, tokenizer = pipeline.vae, pipeline.unet, pipeline.text_encoder, pipeline.tokenizer
    generator = torch.Generator().manual_seed(seed)
    with single_thread():
        images, masks, captions = pretraining_scenes(scenes, seed)
        vae.train()
        optimizer = torch.optim.Adam(vae.parameters(), lr=3e-3)
        for step in pretraining_steps(vae_steps, "inpainting VAE"):
            batch = images[torch.randint(len(images), (16,), generator=generator)]
            loss = F.mse_loss(vae.decode(vae.encode(batch).latent_dist.mode()).sample, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if log_every and step % log_every == 0:
                print(f"vae pretrain step {step}: loss {loss.item():.4f}", flush=True)
        vae.eval().requires_grad_(False)
        with torch.no_grad():
            def encode(pixels: torch.Tensor) -> torch.Tensor:
                return torch.cat([vae.encode(pixels[k : k + 256]).latent_dist.mode() for k in range(0, scenes, 256)])

            latents = encode(images)
            scale = float(1.0 / latents.std())
            vae.register_to_config(scaling_factor=scale)
            masked_latents = encode(images * (masks < 0.5)) * scale
            latents = latents * scale
            small_masks = F.interpolate(masks, size=latents.shape[-2:])
            ids = tokenizer(captions, padding="max_length", max_length=TEXT_LENGTH, truncation=True,
                            return_tensors="pt").input_ids
        _pretrain_denoiser(pipeline, latents, masked_latents, small_masks, ids, unet_steps, generator, log_every)
    for part in (vae, unet, text_encoder):
        part.eval().requires_grad_(False)


def _pretrain_denoiser(pipeline: object, latents: torch.Tensor, masked_latents: torch.Tensor, masks: torch.Tensor,
                       ids: torch.Tensor, steps: int, generator: torch.Generator, log_every: int) -> None:
    from diffusers import DDPMScheduler

    unet, text_encoder = pipeline.unet, pipeline.text_encoder
    noise_schedule = DDPMScheduler.from_config(pipeline.scheduler.config)
    parameters = [*unet.parameters(), *text_encoder.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.01)
    schedule = warmup_cosine(optimizer, warmup=30, steps=steps)
    unet.train()
    text_encoder.train()
    for step in pretraining_steps(steps, "inpainting UNet"):
        pick = torch.randint(len(latents), (32,), generator=generator)
        noise = torch.randn(latents[pick].shape, generator=generator)
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (32,), generator=generator)
        noisy = noise_schedule.add_noise(latents[pick], noise, timesteps)
        states = text_encoder(ids[pick])[0]
        prediction = unet(torch.cat([noisy, masks[pick], masked_latents[pick]], 1), timesteps, states).sample
        loss = F.mse_loss(prediction, noise)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        if log_every and step % log_every == 0:
            print(f"inpainting pretrain step {step}: loss {loss.item():.4f}", flush=True)


def make_tiny_inpainting(directory: str | Path, seed: int = 0, pretrain_steps: int = 1200, vae_steps: int = 400,
                         log_every: int = 0) -> Path:
    """Write a tiny (pretrained) inpainting pipeline to ``directory``; ``pretrain_steps`` 0 keeps random weights.

    Load it with ``StableDiffusionInpaintPipeline.from_pretrained(directory)`` or the REPLACE tool's
    ``model_name=<directory>``.
    """
    import shutil

    directory = Path(directory)
    pipeline = build_tiny_inpainting_pipeline(directory, seed=seed)
    if pretrain_steps:
        pretrain_inpainting(pipeline, vae_steps=vae_steps, unet_steps=pretrain_steps, seed=seed, log_every=log_every)
    pipeline.save_pretrained(directory, safe_serialization=True)
    shutil.rmtree(directory / "tokenizer-build", ignore_errors=True)
    return directory
