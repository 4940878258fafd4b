"""The export manifest every learner writes, and the staged, atomic replacement of an export directory.

Every export directory (prompt tools, LoRA adapters, controllers) holds:

    export.json    format version, what was exported (``learner``), where from (``source``), when, file list
    versions.json  python and the versions of the packages that wrote it

and is written into a hidden staging directory beside its target, which replaces the target only when
complete: a reader sees the old export or the new one, never a mixture, and a failed export leaves the
previous one in place and no staging directory behind.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from clova_train.core.atomic import (
    STAGING_SUFFIX, default_mode, disk_full, remove_stale_temporaries, storage_error, temporary_prefix, write_json_atomic,
)

EXPORT_FORMAT_VERSION = 1
MANIFEST_FILE = "export.json"
BASE_DIR = "base"  # where ``export --copy-base`` puts the frozen base model inside an export
VERSIONS_FILE = "versions.json"
_PACKAGES = (
    "clova-train", "torch", "lightning", "open_clip_torch", "transformers", "peft", "diffusers",
    "stable-baselines3", "gymnasium", "safetensors",
)


def package_versions() -> dict[str, str]:
    """Python and the installed versions of the packages an export depends on."""
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_manifest(directory: Path, learner: str, source: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Write ``versions.json`` and ``export.json`` (listing every file already in ``directory``)."""
    write_json_atomic(directory / VERSIONS_FILE, package_versions())
    manifest = {
        "format_version": EXPORT_FORMAT_VERSION,
        "learner": learner,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "files": sorted({p.name for p in directory.iterdir()} | {MANIFEST_FILE}),
        **extra,
    }
    write_json_atomic(directory / MANIFEST_FILE, manifest)
    return manifest


@contextmanager
def staged_directory(output: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces ``output``, on failure it is removed."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(output)
    staging = Path(tempfile.mkdtemp(prefix=temporary_prefix(output), suffix=STAGING_SUFFIX, dir=output.parent))
    os.chmod(staging, default_mode(directory=True))
    try:
        yield staging
        _replace_dir(staging, output)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if disk_full(error):
            raise storage_error(output, error) from error
        raise


def _replace_dir(staging: Path, output: Path) -> None:
    """Move ``staging`` to ``output``; an existing ``output`` is swapped out, then removed."""
    if output.exists():
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(staging, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, output)
