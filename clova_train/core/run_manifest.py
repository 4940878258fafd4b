"""What a run or an export directory is: one manifest written by every learner, read through one function.

``clova-train fit``, ``controller fit`` and ``loop`` write ``run.json`` into their run directory:

    format_version, kind (prompt_tuning | lora | controller | closed_loop | lightning), tool (a prompt tool's name,
    else null), learner (what trained: a class path or a command), config_digest (sha256 of the resolved
    config), versions (python and the libraries), created

An export carries its own: its ``export.json`` holds the same ``kind``, ``tool`` and ``config_digest``, and the
run's manifest under ``run``. Export, serve and report learn what a directory is from :func:`read_run_manifest`
only; directories written before manifests existed are recognised there, by their files, and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import DataError
from clova_train.core.manifest import MANIFEST_FILE, package_versions
from clova_train.core.safe_files import read_json_object

RUN_MANIFEST_FILE = "run.json"
# the files of a prompt-tuning run (and of its export) that other modules look for
POOL_FILE = "pool.safetensors"
TOOL_FILE = "tool.json"
SUMMARY_FILE = "summary.json"
RUN_MANIFEST_VERSION = 1
RUN_KINDS = ("prompt_tuning", "lora", "controller", "closed_loop", "lightning")
# what exports written before run manifests call their learner in export.json
_EXPORT_LEARNERS = {"prompt_tool": "prompt_tuning", "lora_tool_llm": "lora", "controller": "controller"}


@dataclass(frozen=True)
class RunManifest:
    """What a run or export directory holds (see the module docstring for the fields)."""

    kind: str
    tool: str | None = None
    learner: str | None = None
    config_digest: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    exported: bool = False
    """an export directory (``export.json``) rather than a run directory"""
    legacy: bool = False
    """written before manifests: ``kind`` was recognised from the directory's files"""


def config_digest(config: str | dict[str, Any]) -> str:
    """sha256 of a config: its text, or a mapping in canonical JSON."""
    text = config if isinstance(config, str) else json.dumps(config, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def run_manifest_fields(kind: str, tool: str | None = None, learner: str | None = None,
                        config: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's fields for a run of ``kind`` (also what an export copies into its ``export.json``)."""
    if kind not in RUN_KINDS:
        raise ValueError(f"unknown run kind {kind!r}; expected one of {', '.join(RUN_KINDS)}")
    return {
        "format_version": RUN_MANIFEST_VERSION,
        "kind": kind,
        "tool": tool,
        "learner": learner,
        "config_digest": None if config is None else config_digest(config),
        "versions": package_versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def export_manifest_fields(kind: str, tool: str | None, run: RunManifest | None) -> dict[str, Any]:
    """What an export's ``export.json`` says of the run it came from (``run`` is None for a checkpoint)."""
    return {"kind": kind, "tool": tool, "config_digest": run.config_digest if run else None,
            "run": None if run is None or run.legacy else {
                "kind": run.kind, "tool": run.tool, "learner": run.learner, "config_digest": run.config_digest,
                "versions": run.versions}}


def write_run_manifest(directory: str | Path, kind: str, tool: str | None = None, learner: str | None = None,
                       config: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``run.json`` into ``directory`` (atomically). A directory already holding a run of another kind is
    refused: two learners writing one directory would overwrite each other's files."""
    directory = Path(directory)
    path = directory / RUN_MANIFEST_FILE
    if path.is_file():
        earlier = _from_record(path, exported=False)
        if earlier.kind != kind or (tool is not None and earlier.tool not in (None, tool)):
            what = earlier.kind + (f" ({earlier.tool})" if earlier.tool else "")
            raise DataError(f"{directory} already holds a {what} run ({path}); write this {kind} run into "
                            "another directory")
    manifest = run_manifest_fields(kind, tool, learner, config)
    directory.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest)
    return manifest


def read_run_manifest(directory: str | Path) -> RunManifest:
    """What ``directory`` is: its ``run.json``, an export's ``export.json``, or, for a directory written before
    manifests, what its files show. A :class:`DataError` when it is none of these."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"directory not found: {directory}")
    for name, exported in ((MANIFEST_FILE, True), (RUN_MANIFEST_FILE, False)):
        if (directory / name).is_file():
            return _from_record(directory / name, exported)
    kind = _kind_from_files(directory)
    if kind is None:
        raise DataError(f"{directory} is neither a run nor an export: it has no {RUN_MANIFEST_FILE} or "
                        f"{MANIFEST_FILE}, nor the files of a run written before them (adapter/, pool.safetensors, "
                        "summary.json, controller.zip, logs/progress.csv, journal.jsonl)")
    return RunManifest(kind=kind, legacy=True)


def _from_record(path: Path, exported: bool) -> RunManifest:
    record = read_json_object(path, "run manifest")
    kind = record.get("kind")
    if kind is None and exported:  # an export written before run manifests
        kind = _EXPORT_LEARNERS.get(record.get("learner"))  # type: ignore[arg-type]
        if kind is None:
            kind = _kind_from_files(path.parent)
    if kind not in RUN_KINDS:
        raise DataError(f"{path}: 'kind' must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
    tool, learner, digest = record.get("tool"), record.get("learner"), record.get("config_digest")
    versions = record.get("versions", {})
    for name, value in (("tool", tool), ("learner", learner), ("config_digest", digest)):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{path}: '{name}' must be text or null, got {type(value).__name__}")
    if not isinstance(versions, dict):
        raise DataError(f"{path}: 'versions' must be an object")
    return RunManifest(kind=kind, tool=tool, learner=learner, config_digest=digest,
                       versions={str(k): str(v) for k, v in versions.items()}, exported=exported)


def _kind_from_files(directory: Path) -> str | None:
    """The kind of a directory written before manifests, from the files each learner writes."""
    if (directory / "adapter" / "adapter_config.json").is_file():
        return "lora"
    if (directory / "controller.zip").is_file() or (directory / "logs" / "progress.csv").is_file():
        return "controller"
    if any((directory / name).is_file() for name in (POOL_FILE, SUMMARY_FILE, TOOL_FILE)):
        return "prompt_tuning"
    if (directory / "journal.jsonl").is_file():
        return "closed_loop"
    return None
