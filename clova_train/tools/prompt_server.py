"""One serving entry point for every prompt tool: rebuild it from an export and answer with the ensemble.

>>> server = PromptToolServer.from_export("checkpoints/quickstart_clip/export")
>>> labels, scores = server.classify(images, ["purple", "red"])      # an operation the CLIP tool serves
>>> server.serve({"image": "photo.png", "question": "what colour?"})  # JSON requests (BLIP VQA export)

No Lightning. The server owns the tool and its pool and hands itself to the tool's serving methods as the
:class:`~clova_train.tools.base.PromptLookup`: for a query of a concept with prompts, the ensembled prompt
``sum_i w_i p_i / sum_i w_i`` (``w_i``: cosine between the query's unprompted feature and stored instance
``i``'s, over the ``top_k`` most similar when set); for a concept without prompts, ``None``: the
unmodified tool. Tools without concepts (VQA) keep every prompt together and retrieve with ``None``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import DataError, ExportError, ModelError
from clova_train.core.pool import PromptPool
from clova_train.core.run_manifest import POOL_FILE, TOOL_FILE
from clova_train.core.safe_files import ReadLimits, parse_json, read_json
from clova_train.tools.base import PromptTool
from clova_train.tools.pretrained import relocated_model_name

DESCRIPTION_LIMITS = ReadLimits(max_bytes=16 << 20, max_depth=32)
REQUEST_LIMITS = ReadLimits(max_bytes=16 << 20, max_depth=16)  # a request is a flat object of fields and lists
BASE_IN_EXPORT = "base_in_export"  # tool.json key: the frozen model's copy inside the export (--copy-base)


def read_tool_description(directory: Path) -> dict[str, Any]:
    path = directory / TOOL_FILE
    if not path.exists():
        raise ExportError(f"export directory {directory} is incomplete: {TOOL_FILE} missing")
    try:
        description = read_json(path, "tool description", DESCRIPTION_LIMITS)
    except DataError as err:
        raise ExportError(f"{path} is not a readable tool description: {err}") from err
    if not isinstance(description, dict):
        raise ExportError(f"{path} is not a tool description (a JSON object)")
    return description


def parse_request(line: str, where: str) -> dict[str, Any]:
    """One JSON request (an object) from a line of text, or a :class:`DataError` naming ``where`` it came from."""
    request = parse_json(line, where, REQUEST_LIMITS)
    if not isinstance(request, dict):
        raise DataError(f"{where} must be a JSON object (a request)")
    return request


def with_base_model(
    description: dict[str, Any], directory: Path, base_model: str | os.PathLike[str] | None
) -> dict[str, Any]:
    """``description`` with its ``model_name`` pointed at ``base_model``, or at the export's own copy of the
    base (``base_in_export``, relative to ``directory``)."""
    init_args = description.get("init_args")
    if not isinstance(init_args, dict) or not isinstance(init_args.get("model_name"), str):
        if base_model is not None:
            raise ExportError(f"{directory / TOOL_FILE} names no model_name that --base-model could replace")
        return description
    if base_model is not None:
        location = Path(base_model).expanduser()
        if not location.is_dir():
            raise ExportError(f"base model directory not found: {location}")
    elif isinstance(description.get(BASE_IN_EXPORT), str):
        location = directory / description[BASE_IN_EXPORT]
        if not location.is_dir():
            raise ExportError(f"export directory {directory} is incomplete: its base model {location.name}/ is missing")
    else:
        return description
    model_name = relocated_model_name(init_args["model_name"], location)
    return {**description, "init_args": {**init_args, "model_name": model_name}}


def with_served_margins(description: dict[str, Any], directory: Path, margins: dict[str, float | None]
                        ) -> dict[str, Any]:
    """``description`` with each given (not ``None``) served margin put in its ``init_args``, in place of the one the
    export carries; an :class:`ExportError` when the tool takes no such margin."""
    given = {name: value for name, value in margins.items() if value is not None}
    if not given:
        return description
    import inspect

    from clova_train.tools.base import tool_class

    try:
        takes = inspect.signature(tool_class(description)).parameters
    except ModelError as err:
        raise ExportError(f"{directory / TOOL_FILE}: {err}") from err
    for name in given:
        if name not in takes:
            raise ExportError(f"the {description.get('tool')} tool of {directory} takes no {name} (its served margin "
                              f"is {', '.join(n for n in margins if n in takes) or 'none'})")
    init_args = description.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ExportError(f"{directory / TOOL_FILE}: init_args must be an object")
    return {**description, "init_args": {**init_args, **given}}


def margins_taken(directory: Path, margins: dict[str, float | None]) -> dict[str, float]:
    """The given (not ``None``) served margins that the tool of the export ``directory`` takes (``serve``'s
    ``--classify-margin`` / ``--answer-margin`` / ``--detection-margin`` apply to the exports whose tool has that setting)."""
    import inspect

    from clova_train.tools.base import tool_class

    given = {name: value for name, value in margins.items() if value is not None}
    if not given:
        return {}
    try:
        takes = inspect.signature(tool_class(read_tool_description(directory))).parameters
    except ModelError as err:
        raise ExportError(f"{directory / TOOL_FILE}: {err}") from err
    return {name: value for name, value in given.items() if name in takes}


class PromptToolServer:
    """A frozen prompt tool with its prompt pool, serving the tool's operations with the prompt ensemble.

    Args:
        tool: the frozen tool.
        pool: prompts learned for it (checked against the tool's identity and shapes).
        top_k: ensemble only the ``top_k`` most similar stored prompts (default: the tool's ``serving_top_k``).
    """

    def __init__(self, tool: PromptTool, pool: PromptPool, top_k: int | None = None) -> None:
        problems = pool.spec.mismatches(tool.pool_spec())
        if problems:
            raise ExportError(f"prompt pool does not fit this {tool.name} tool: " + "; ".join(problems))
        self.tool = tool.eval()
        self.pool = pool
        self.top_k = top_k if top_k is not None else tool.serving_top_k

    @staticmethod
    def check_export(directory: str | os.PathLike[str], base_model: str | os.PathLike[str] | None = None
                     ) -> dict[str, Any]:
        """What can be checked of an export without loading its model (a server checks this before its workers load
        it): the directory, its tool description, the base model it points at and its pool file. Returns the
        description with its model located; an :class:`ExportError` names what is wrong."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ExportError(f"export directory not found: {directory}")
        description = with_base_model(read_tool_description(directory), directory, base_model)
        if not (directory / POOL_FILE).is_file():
            raise ExportError(f"export directory {directory} is incomplete: {POOL_FILE} missing")
        return description

    @classmethod
    def from_export(
        cls,
        directory: str | os.PathLike[str],
        top_k: int | None = None,
        device: str | torch.device = "cpu",
        base_model: str | os.PathLike[str] | None = None,
        classify_margin: float | None = None,
        answer_margin: float | None = None,
        detection_margin: float | None = None,
    ) -> PromptToolServer:
        """Load a directory written by ``clova-train export`` (or a finished run directory).

        The frozen network is the one ``tool.json`` names: the copy inside the export when it was written with
        ``--copy-base``, else the (absolute) path or hub id it was trained from. ``base_model`` (a local
        directory) overrides both; its weights must still be the ones the prompts were trained on.

        The pool is served at the operating point ``tool.json`` carries (the margin its calibration chose and wrote
        there: ``clova_train.tools.operating_point``); ``classify_margin`` (CLIP), ``answer_margin`` (BLIP VQA) or
        ``detection_margin`` (OWL-ViT LOC) overrides it.
        """
        directory = Path(directory)
        description = with_served_margins(cls.check_export(directory, base_model), directory,
                                          {"classify_margin": classify_margin, "answer_margin": answer_margin,
                                           "detection_margin": detection_margin})
        try:
            tool = PromptTool.from_description(description).to(device)
        except ModelError as err:
            raise ExportError(f"cannot rebuild the tool of {directory}: {err}") from err
        return cls(tool, PromptPool.load(directory / POOL_FILE, expected=tool.pool_spec()), top_k)

    def prompts_for(self, concept: str | None, features: torch.Tensor) -> torch.Tensor | None:
        """Ensembled prompts ``[q, *prompt_shape]`` for queries with unprompted ``features``, or ``None``."""
        if not self.tool.has_concepts:
            concept = None
        if concept not in self.pool:
            return None
        return self.pool.retrieve(concept, features, top_k=self.top_k).to(features.device)

    def candidates(self, concept: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored (features, prompts) of ``concept``, or ``None`` when it has none."""
        if not self.tool.has_concepts:
            concept = None
        if concept not in self.pool:
            return None
        features, prompts, _ = self.pool.entry(concept)
        return features, prompts

    def serve(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one JSON request (its fields are the tool's; see the tool's ``serve_request``)."""
        with torch.no_grad():
            return self.tool.serve_request(self, request)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the server lacks: the tool's serving operations, bound to this server.
        tool = self.__dict__.get("tool")
        if tool is not None and name in type(tool).served_operations:
            return functools.partial(torch.no_grad()(getattr(tool, name)), self)
        raise AttributeError(f"{type(self).__name__} (tool {getattr(tool, 'name', '?')!r}) has no operation {name!r}")
