"""Reading a sharded (torch.distributed.checkpoint) checkpoint directory without running code from it.

torch's reader unpickles the directory's ``.metadata`` and loads every non-tensor entry of the shards with
``torch.load(weights_only=False)``: a directory from someone else could run any code. Here ``.metadata`` goes
through an allowlist unpickler (the metadata classes of ``torch.distributed.checkpoint``, ``torch.Size``, dtypes,
layouts and paths) and non-tensor entries through ``torch.load(weights_only=True)``, as the tensors already are.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
# what torch's own dcp_to_torch_save calls to fill an empty dict from a checkpoint (the public load() copies it)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from clova_train.core.errors import ExportError, UnsafeFileError
from clova_train.core.safe_pickle import AllowlistUnpickler

METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


def metadata_global_allowed(module: str, name: str) -> bool:
    """A global that legitimate distributed-checkpoint metadata names (``torch.<dtype>`` included)."""
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return True
    return name in METADATA_CLASSES.get(module, ())


class SafeFileSystemReader(FileSystemReader):
    """torch's file-system reader with ``.metadata`` read through the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self, "_metadata", None) is not None:  # read (and checked) once, before loading
            return self._metadata
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            try:
                metadata = AllowlistUnpickler(handle, metadata_global_allowed).load()
            except pickle.UnpicklingError as err:
                raise UnsafeFileError(f"{path} cannot be loaded safely ({err}); distributed-checkpoint metadata "
                                      "holds torch's checkpoint metadata classes only") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeFileError(f"{path} holds a {type(metadata).__name__}, not distributed-checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata


class _PlainDataPlanner(_EmptyStateDictLoadPlanner):
    """Loads every entry the checkpoint holds; non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            reason = f"{found.group(1)} is not allowed" if found else str(err).splitlines()[0]
            raise UnsafeFileError(f"entry {read_item.dest_index.fqn!r} cannot be loaded safely ({reason}); "
                                  "a checkpoint's entries hold tensors and plain data only") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_distributed_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Every entry of the sharded checkpoint in ``directory``, consolidated on the CPU in this process (no
    process group needed), without unpickling anything outside the allowlists."""
    state: dict[str, Any] = {}
    reader = SafeFileSystemReader(str(directory))
    reader.read_metadata()  # here, so that a refusal is reported as it is (torch's loader would try other files)
    _load_entries(directory, state, reader, _PlainDataPlanner())
    return state


def _load_entries(directory: str | Path, state: dict[str, Any], reader: SafeFileSystemReader,
                  planner: _PlainDataPlanner) -> None:
    """Fill ``state`` with what ``planner`` asks of the checkpoint, in this process; one clear error on failure."""
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as err:  # the failure of each rank (here one), with its traceback in the text
        failure = next(iter(err.failures.values()), None)
        failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
        if isinstance(failure, UnsafeFileError):
            raise UnsafeFileError(f"{directory}: {failure}") from None
        raise ExportError(f"cannot read sharded checkpoint {directory}: {failure!r}") from None


def check_distributed_checkpoint(directory: str | Path) -> None:
    """Refuse (:class:`UnsafeFileError`) a sharded checkpoint whose ``.metadata`` or non-tensor entries name code,
    before torch's own loader (which unpickles both) reads it; no tensor is loaded here."""
    reader = SafeFileSystemReader(str(directory))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise ExportError(f"{directory} is not a sharded checkpoint directory (no .metadata)") from None
    byte_entries = {key for key, value in metadata.state_dict_metadata.items() if isinstance(value, BytesStorageMetadata)}
    if byte_entries:
        _load_entries(directory, {}, reader, _PlainDataPlanner(keys=byte_entries))


def check_checkpoint_source(checkpoint_path: str | Path) -> None:
    """What a Lightning ``ckpt_path`` must be before Lightning loads it: a local file (loaded with
    ``weights_only=True``) or a sharded checkpoint directory that passes :func:`check_distributed_checkpoint`. A URL
    is refused: Lightning loads remote checkpoints with ``weights_only=False``."""
    text = str(checkpoint_path)
    if "://" in text:
        raise UnsafeFileError(f"checkpoint {text}: remote checkpoints are not loaded (Lightning would unpickle them "
                              "with weights_only=False); download it and pass the local path")
    if Path(text).is_dir():
        check_distributed_checkpoint(text)


def guard_checkpoint_loading(strategy: Any) -> None:
    """Route every checkpoint a Lightning strategy loads (an explicit ``ckpt_path``, or ``last``/``best`` once Lightning
    has resolved them) through :func:`check_checkpoint_source`, and load files with ``weights_only=True``.

    Lightning resolves ``last``/``best`` inside ``trainer.fit`` and hands the result to ``strategy.load_checkpoint``;
    wrapping that one method of this strategy instance is the only point every path passes through."""
    original = strategy.load_checkpoint
    if getattr(original, "_checks_sources", False):
        return

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        check_checkpoint_source(checkpoint_path)
        return original(checkpoint_path, weights_only=True)

    load_checkpoint._checks_sources = True  # type: ignore[attr-defined]
    strategy.load_checkpoint = load_checkpoint
