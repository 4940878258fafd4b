"""A frozen transformers depth-estimation model: a depth map at the image's own size, and the median depth of boxes.

What ``compute_depth`` returns is the model's own quantity, and its direction depends on the model. Relative models
(DPT/MiDaS, Depth Anything's relative head) predict relative inverse depth, a disparity: larger values are nearer, and
values from two images are not on one scale. Metric models (GLPN, ZoeDepth, Depth Pro, Depth Anything's metric head)
predict distances in metres: larger values are farther. :attr:`DepthEstimator.larger_is_nearer` says which, so that a
caller comparing two patches ("which is closer?") reads the comparison the right way round.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from clova_train.core.errors import DataError, ModelError, loading
from clova_train.core.safe_files import ReadLimits, printable, read_json_object
from clova_train.tools.depth.request import box_pixels, parse_depth_request
from clova_train.tools.images import open_rgb
from clova_train.tools.pretrained import local_model_path

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
CONFIG_LIMITS = ReadLimits(max_bytes=4 << 20, max_depth=32)

# Whether larger values of each architecture's post-processed output are nearer. Depth Anything (and Prompt Depth
# Anything) declare it in ``depth_estimation_type``; DPT checkpoints are MiDaS-style relative inverse depth (a DPT
# fine-tuned for metric depth, such as the DINOv2 KITTI/NYU ones, should say ``"larger_is_nearer": false`` in its
# config.json); Depth Pro's post-processing turns its inverse depth into metres.
LARGER_IS_NEARER = {"dpt": True, "depth_pro": False, "glpn": False, "zoedepth": False, "tipsv2_dpt": False}
DECLARED_DIRECTION = "larger_is_nearer"  # a config.json key that overrides the table


def depth_model_types() -> frozenset[str]:
    """The ``model_type`` values ``AutoModelForDepthEstimation`` maps to a model class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES

    return frozenset(MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES)


def _model_type(directory: Path) -> str:
    """The ``model_type`` of ``directory``'s config.json, or a :class:`DataError` saying why there is none."""
    config = read_json_object(directory / CONFIG_FILE, "model config", CONFIG_LIMITS)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise DataError(f"{printable(directory / CONFIG_FILE)} names no 'model_type'")
    return model_type


def depth_model_type(directory: str | os.PathLike[str]) -> str | None:
    """The ``model_type`` of the transformers depth-estimation model saved in ``directory``, read from its
    config.json without loading any weights; ``None`` when the directory holds no such model (no readable
    config.json, or a model of another task)."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        return None
    try:
        model_type = _model_type(directory)
    except DataError:
        return None
    return model_type if model_type in depth_model_types() else None


def check_depth_model_dir(directory: str | os.PathLike[str]) -> str:
    """The ``model_type`` of the depth-estimation model in ``directory``, or a :class:`ModelError` naming the
    directory and what is wrong with it (nothing is loaded: a server checks this before its workers start)."""
    directory = Path(directory)
    where = f"depth model directory {printable(directory)}"
    if not directory.is_dir():
        raise ModelError(f"{where} not found")
    if not (directory / CONFIG_FILE).is_file():
        raise ModelError(f"{where} has no {CONFIG_FILE} (save the model with save_pretrained)")
    try:
        model_type = _model_type(directory)
    except DataError as err:
        raise ModelError(f"{where}: {err}") from None
    known = depth_model_types()
    if model_type not in known:
        raise ModelError(f"{where} holds a {model_type!r} model, not a depth-estimation model (model types: "
                         f"{', '.join(sorted(known))})")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ModelError(f"{where} has no safetensors weights ({' or '.join(WEIGHT_FILES)}); pickled weights "
                         "(pytorch_model.bin) are not loaded")
    return model_type


def larger_is_nearer_for(config: Any) -> bool | None:
    """Whether larger outputs of the model ``config`` describes are nearer (see the module docstring): the config's own
    ``larger_is_nearer`` key when it has one, else what its architecture predicts; ``None`` when unknown."""
    declared = getattr(config, DECLARED_DIRECTION, None)
    if isinstance(declared, bool):
        return declared
    model_type = getattr(config, "model_type", None)
    if model_type in ("depth_anything", "prompt_depth_anything"):
        return getattr(config, "depth_estimation_type", "relative") != "metric"
    return LARGER_IS_NEARER.get(model_type)


class DepthEstimator:
    """A frozen depth-estimation model (HYDRA's ``compute_depth``): depth maps and the median depth of boxes.

    Args:
        model: a transformers ``...ForDepthEstimation`` model (put in eval mode, gradients off).
        image_processor: its image processor (resizing, normalisation, and post-processing back to the image's size).
        larger_is_nearer: whether larger depth values are nearer (relative inverse depth) or farther (distances).
        name: where the model came from, for messages.
    """

    def __init__(self, model: torch.nn.Module, image_processor: Any, larger_is_nearer: bool,
                 name: str = "depth model") -> None:
        self.model = model.eval().requires_grad_(False)
        self.image_processor = image_processor
        self.larger_is_nearer = bool(larger_is_nearer)
        self.name = name

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: str = "cpu",
                        larger_is_nearer: bool | None = None) -> DepthEstimator:
        """Load a depth-estimation model and its image processor (``AutoModelForDepthEstimation`` /
        ``AutoImageProcessor``). No code from the directory is run and only safetensors weights are read.

        Args:
            path: a local model directory (written by ``save_pretrained``) or a hub id
                (``depth-anything/Depth-Anything-V2-Small-hf``, ``Intel/dpt-hybrid-midas``).
            device: torch device to run on.
            larger_is_nearer: the output's direction, for a model whose config does not tell it (see
                :func:`larger_is_nearer_for`); given, it overrides the config.
        """
        from transformers import AutoImageProcessor, AutoModelForDepthEstimation

        name = str(path)
        local = Path(path) if isinstance(path, os.PathLike) else local_model_path(name)
        if local is not None:
            check_depth_model_dir(local)
            name = str(local)
        with loading("the depth model", name):
            model = AutoModelForDepthEstimation.from_pretrained(name, use_safetensors=True, trust_remote_code=False)
            processor = AutoImageProcessor.from_pretrained(name, trust_remote_code=False)
        direction = larger_is_nearer if larger_is_nearer is not None else larger_is_nearer_for(model.config)
        if direction is None:
            raise ModelError(f"cannot tell whether larger depths of {name!r} ({model.config.model_type}) are nearer or "
                             f"farther: set \"{DECLARED_DIRECTION}\": true or false in its {CONFIG_FILE}, or pass "
                             "larger_is_nearer")
        return cls(model.to(device), processor, direction, name)

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return next(self.model.parameters()).device

    @torch.no_grad()  # not inference_mode: callers may edit the map in place
    def depth_map(self, image: str | os.PathLike[str] | Image.Image | np.ndarray | torch.Tensor) -> torch.Tensor:
        """The predicted depth of every pixel, ``[H, W]`` float32 on the CPU, at the image's own size.

        Args:
            image: an image file's path (read with the package's safe reader), a PIL image, an ``[H, W, 3]`` uint8
                array, or a ``[3, H, W]`` uint8 tensor.
        """
        pixels = _rgb_array(image)
        height, width = pixels.shape[:2]
        try:  # channels_last said outright: an image 1 or 3 pixels high would be read as channels-first
            inputs = self.image_processor(images=pixels, return_tensors="pt", input_data_format="channels_last")
        except (ValueError, RuntimeError) as err:  # a sliver the resize rounds to nothing, say
            raise DataError(f"the depth model cannot take a {width}x{height} image: {err}") from None
        inputs = inputs.to(self.device)
        outputs = self.model(**inputs)
        depth = self._post_processed(outputs, (height, width)).float().cpu().reshape(height, width)
        if not torch.isfinite(depth).all():
            raise ModelError(f"{self.name} predicted non-finite depths for a {width}x{height} image")
        return depth

    def _post_processed(self, outputs: Any, size: tuple[int, int]) -> torch.Tensor:
        """The depth back at ``size`` through the processor's own post-processing where it has one (it knows the
        model's padding and output scale), else interpolated bicubically."""
        post_process = getattr(self.image_processor, "post_process_depth_estimation", None)
        if post_process is None:
            return torch.nn.functional.interpolate(outputs.predicted_depth[:, None], size=size, mode="bicubic",
                                                   align_corners=False)[0, 0]
        extra = {"source_sizes": [size]} if "source_sizes" in inspect.signature(post_process).parameters else {}
        return post_process(outputs, target_sizes=[size], **extra)[0]["predicted_depth"]

    def median_depths(self, image: str | os.PathLike[str] | Image.Image | np.ndarray | torch.Tensor,
                      boxes: list[tuple[float, float, float, float]] | tuple = ()) -> list[float]:
        """The median depth inside each box, or, without boxes, of the whole image (one value): torch's median, the
        lower middle value of an even count, as ViperGPT's ``compute_depth`` takes it.

        Args:
            image: as :meth:`depth_map` takes it.
            boxes: ``(x0, y0, x1, y1)`` in pixels, y from the top, clipped to the image (one outside it is a
                :class:`DataError`); see :mod:`clova_train.tools.depth.request`.
        """
        pixels = _rgb_array(image)
        height, width = pixels.shape[:2]
        regions = [box_pixels(box, width, height, f"boxes[{index}]") for index, box in enumerate(boxes)]
        depth = self.depth_map(pixels)  # after the boxes are checked: a bad box costs no model run
        if not regions:
            return [float(depth.median())]
        return [float(depth[rows, columns].median()) for rows, columns in regions]

    def serve(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"image": path, "boxes": [[x0, y0, x1, y1], ...]}`` -> ``{"depths": [...], "larger_is_nearer": bool}``:
        the median depth inside each box (pixels, y from the top), or of the whole image without boxes.

        Args:
            request: the parsed JSON request; a malformed one is a :class:`DataError` naming the field, an unreadable
                image an ``ImageReadError`` naming the file.
        """
        checked = parse_depth_request(request)
        depths = self.median_depths(Path(checked.image), checked.boxes)
        return {"depths": depths, "larger_is_nearer": self.larger_is_nearer}


def _rgb_array(image: Any) -> np.ndarray:
    """``image`` as an ``[H, W, 3]`` uint8 array."""
    if isinstance(image, (str, os.PathLike)):
        image = open_rgb(Path(image))
    if isinstance(image, Image.Image):
        return np.array(image.convert("RGB"), dtype=np.uint8)  # a writable copy (torch warns on read-only arrays)
    if isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
            raise DataError(f"a depth image tensor must be [3, H, W] uint8, got {list(image.shape)} {image.dtype}")
        return np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy())
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise DataError(f"a depth image array must be [H, W, 3] uint8, got {list(image.shape)} {image.dtype}")
        return np.ascontiguousarray(image)
    raise DataError(f"a depth image must be a path, a PIL image, an array or a tensor, got {type(image).__name__}")
