"""Loading a frozen transformers model with its processor, and fingerprinting its weights (shared by tools)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clova_train.core.errors import ModelError, loading

LOCAL_DIR_PREFIX = "local-dir:"  # open_clip's marker for a model directory on disk


def local_model_path(name: str) -> Path | None:
    """The directory a model name points at on this machine (``local-dir:`` prefix allowed), or ``None``
    for a hub id or architecture name."""
    path = Path(name.removeprefix(LOCAL_DIR_PREFIX)).expanduser()
    if name.startswith((LOCAL_DIR_PREFIX, ".", "/", "~")) or path.exists():
        return path
    return None


def absolute_model_name(name: str) -> str:
    """``name`` with a local path made absolute (so a description written here loads from any working
    directory); hub ids and architecture names are returned unchanged."""
    path = local_model_path(name)
    if path is None:
        return name
    prefix = LOCAL_DIR_PREFIX if name.startswith(LOCAL_DIR_PREFIX) else ""
    return prefix + str(path.resolve())


def relocated_model_name(name: str, directory: str | Path) -> str:
    """The model name that loads ``directory`` the way ``name`` was loaded (a ``local-dir:`` prefix is kept,
    and added for an open_clip directory)."""
    directory = Path(directory).expanduser().resolve()
    if name.startswith(LOCAL_DIR_PREFIX) or (directory / "open_clip_config.json").is_file():
        return LOCAL_DIR_PREFIX + str(directory)
    return str(directory)


def load_pretrained(model_class: Any, processor_class: Any, model_name: str, label: str) -> tuple[nn.Module, Any]:
    """``from_pretrained`` of a model and its processor (a hub id or a local directory), with one clear error."""
    local = Path(model_name).expanduser()
    if (model_name.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").is_file():
        raise ModelError(f"{label} model directory {local} not found or has no config.json")
    with loading(f"the {label} model", model_name):
        return model_class.from_pretrained(model_name), processor_class.from_pretrained(model_name)


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
