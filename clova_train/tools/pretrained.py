"""Loading a frozen transformers model with its processor, and fingerprinting its weights (shared by tools)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clova_train.core.errors import ModelError


def load_pretrained(model_class: Any, processor_class: Any, model_name: str, label: str) -> tuple[nn.Module, Any]:
    """``from_pretrained`` of a model and its processor (a hub id or a local directory), with one clear error."""
    local = Path(model_name).expanduser()
    if (model_name.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").is_file():
        raise ModelError(f"{label} model directory {local} not found or has no config.json")
    try:
        return model_class.from_pretrained(model_name), processor_class.from_pretrained(model_name)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"could not load {label} model {model_name!r}: {err}") from err


def weights_fingerprint(prefix: str, model: nn.Module, probes: Iterable[str], vocabulary_size: int) -> str:
    """``prefix:<16 hex>`` from every parameter's name and shape plus the values of a few probe tensors."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        digest.update(f"{name}:{tuple(state[name].shape)};".encode())
    for name in probes:
        if name in state:
            digest.update(state[name].detach().cpu().float().numpy().tobytes())
    digest.update(str(vocabulary_size).encode())
    return f"{prefix}:{digest.hexdigest()[:16]}"


def processed_images(image_processor: Any, images: Sequence[torch.Tensor]) -> Any:
    """Everything a transformers image processor returns for ``[3, H, W]`` uint8 images (``pixel_values``,
    and ``pixel_mask`` where the processor pads)."""
    arrays = [np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy()) for image in images]
    return image_processor(images=arrays, return_tensors="pt")


def processed_pixels(image_processor: Any, images: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``pixel_values`` of ``[3, H, W]`` uint8 images through a transformers image processor."""
    return processed_images(image_processor, images)["pixel_values"].to(device)
