"""What every export shares: reading a Lightning checkpoint (whole or sharded) and copying a base model into the
export (``--copy-base``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from clova_train.core.errors import ClovaTrainError, DataError, ExportError
from clova_train.core.manifest import BASE_DIR
from clova_train.core.safe_files import read_yaml


def newest_run_config(run_dir: Path) -> Path | None:
    """The run's newest resolved LightningCLI ``config.yaml`` (a run may hold several: one per fit or resume)."""
    candidates = sorted(run_dir.rglob("config.yaml"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def run_config_section(run_dir: Path | None, key: str) -> dict[str, Any]:
    """The ``key`` section (``model``, ``data``) of the run's newest ``config.yaml``, read by the safe reader; empty
    when the run has none or it cannot be read (what it feeds, a model card, is written without it)."""
    path = newest_run_config(run_dir) if run_dir is not None else None
    if path is None:
        return {}
    try:
        config = read_yaml(path, "run config")
    except DataError:
        return {}
    section = config.get(key) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def copy_base_model(name: str, staging: Path) -> None:
    """``--copy-base``: the local model directory ``name`` copied to ``staging/base``, or an :class:`ExportError`."""
    from clova_train.tools.pretrained import local_model_path

    base = local_model_path(name)
    if base is None or not base.is_dir():
        raise ExportError(
            f"--copy-base needs the base model on disk, but {name!r} is not a local directory "
            "(download it, fit from that directory, or export without --copy-base)"
        )
    copy_tree(base, staging / BASE_DIR)


def copy_tree(source: Path, target: Path) -> None:
    """Copy a model directory; entries get the normal modes of this process's umask, not the source's
    (``shutil.copytree`` would carry over a private source's 0700 directories)."""
    from clova_train.core.progress import progress

    files = [Path(folder) / name for folder, _, names in os.walk(source, followlinks=True) for name in names]
    sizes = [path.stat().st_size for path in files]
    with progress(sum(sizes), f"copying {source.name}", "B", disable=sum(sizes) < 64 << 20) as bar:
        for path, size in zip(files, sizes):
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
            bar.update(size)
    target.mkdir(parents=True, exist_ok=True)  # an empty model directory still gives an (empty) copy


def is_distributed_checkpoint(path: Path) -> bool:
    """A checkpoint directory written by ``torch.distributed.checkpoint`` (a sharded run: ModelParallelStrategy)."""
    return path.is_dir() and (path / ".metadata").is_file()


def load_distributed_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A sharded checkpoint directory as one checkpoint dict: the shards consolidated on the CPU (no process
    group needed; nothing unpickled outside an allowlist, see ``distributed_checkpoint``) and Lightning's
    ``meta.pt`` (everything but the tensors) merged in."""
    from clova_train.export.distributed_checkpoint import read_distributed_checkpoint

    try:
        checkpoint = read_distributed_checkpoint(ckpt)
        meta = ckpt / "meta.pt"
        if meta.is_file():
            checkpoint.update(torch.load(meta, map_location="cpu", weights_only=True))
    except ClovaTrainError:
        raise
    except Exception as err:  # torch raises many types for a truncated or foreign directory
        raise ExportError(f"cannot read sharded checkpoint {ckpt}: {err}") from err
    return checkpoint


def load_checkpoint(ckpt: Path) -> dict[str, Any]:
    """A Lightning checkpoint's contents (tensors and plain data only: no pickled code runs); a sharded
    checkpoint directory is consolidated first."""
    if is_distributed_checkpoint(ckpt):
        return load_distributed_checkpoint(ckpt)
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a truncated or foreign file
        raise ExportError(f"cannot read checkpoint {ckpt}: {err}") from err
    if not isinstance(checkpoint, dict):
        raise ExportError(f"{ckpt} is not a Lightning checkpoint")
    return checkpoint
