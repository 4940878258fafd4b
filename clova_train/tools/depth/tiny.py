"""The tiny depth model: a random-weight Depth Anything (transformers, DINOv2 backbone) of the real architecture.

Depth Anything V2 (``depth-anything/Depth-Anything-V2-Small-hf``) is the depth model a HYDRA-style run would load; its
tiny twin here has a four-layer, 32-wide DINOv2 backbone and a DPT neck, sees 56-pixel images (4 x 4 patches of 14)
and builds and runs in milliseconds on a CPU. Its weights are random, not pretrained: its depths mean nothing, and it
exists to test the loading, post-processing, box and serving code offline. transformers draws the neck and head
with small weights that leave the relative head's ReLU output at about 1e-8 everywhere (every median a tie), so
they are redrawn with PyTorch's default initialisation and a unit output bias: depths near 1 that differ from
pixel to pixel. Saved with ``save_pretrained`` (safetensors, config.json, preprocessor_config.json) and loaded back
by :meth:`~clova_train.tools.depth.estimator.DepthEstimator.from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_IMAGE_SIZE = 56  # the processor's target (shorter side, a multiple of the 14-pixel patch)


def build_tiny_depth_anything(seed: int = 0, image_size: int = TINY_IMAGE_SIZE) -> tuple:
    """A random-weight ``DepthAnythingForDepthEstimation`` (relative depth: larger is nearer) and its
    ``DPTImageProcessor`` (aspect ratio kept, sides multiples of 14, as the real model's processor does).

    Args:
        seed: weight initialisation seed.
        image_size: the side the processor resizes to (a multiple of 14).
    """
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config, DPTImageProcessor

    torch.manual_seed(seed)
    backbone = Dinov2Config(image_size=image_size, patch_size=14, hidden_size=32, num_hidden_layers=4,
                            num_attention_heads=2, intermediate_size=64, out_indices=[1, 2, 3, 4],
                            reshape_hidden_states=False)
    config = DepthAnythingConfig(backbone_config=backbone, patch_size=14, reassemble_hidden_size=32,
                                 neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16, head_hidden_size=8,
                                 depth_estimation_type="relative")
    model = DepthAnythingForDepthEstimation(config)
    for layer in (*model.neck.modules(), *model.head.modules()):
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            layer.reset_parameters()
    torch.nn.init.constant_(model.head.conv3.bias, 1.0)
    processor = DPTImageProcessor(size={"height": image_size, "width": image_size}, keep_aspect_ratio=True,
                                  ensure_multiple_of=14, resample=3, do_pad=False,
                                  image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return model.eval(), processor


def make_tiny_depth_anything(directory: str | Path, seed: int = 0, image_size: int = TINY_IMAGE_SIZE) -> Path:
    """Write the tiny Depth Anything and its image processor to ``directory`` (load it with
    ``DepthEstimator.from_pretrained(directory)``) and return the directory.

    Args:
        directory: output directory (created if missing).
        seed: weight initialisation seed (one seed, one model).
        image_size: the side the processor resizes to (a multiple of 14).
    """
    directory = Path(directory)
    model, processor = build_tiny_depth_anything(seed, image_size)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
