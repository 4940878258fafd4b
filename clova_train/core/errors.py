"""Exceptions raised for user-facing failures.

Each carries one message that names the thing at fault (a file, a config key, a record), so the CLI
can print it without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ClovaTrainError(Exception):
    """Base class of every error clova-train reports to the user."""


class DataError(ClovaTrainError):
    """A dataset, folder, image or record is missing or malformed."""


class PoolError(ClovaTrainError):
    """A prompt pool file is missing, corrupted, or does not fit the model it is loaded for."""


class ModelError(ClovaTrainError):
    """A model cannot be loaded, or its architecture does not match what was asked for."""


class ExportError(ClovaTrainError):
    """A run or export directory is missing or incomplete."""


class StorageError(ClovaTrainError):
    """A file could not be written: the device is full or the quota used up (what was saved before is intact)."""


class UnsafeFileError(ClovaTrainError):
    """A file asks for code to be loaded (a pickled global) that no legitimate file of its kind needs."""


class ToolServiceError(ClovaTrainError):
    """A visual tool could not answer a request, in-process or behind ``clova-train serve``; the message names the
    tool's role, where it was asked (export or URL) and why."""


@contextmanager
def loading(label: str, name: str) -> Iterator[None]:
    """Turn any failure of loading a model into one :class:`ModelError` naming the model and the underlying cause
    (transformers, diffusers, safetensors and open_clip raise many types: a truncated weights file is a
    ``SafetensorError``, a bad config a ``ValueError``, a missing file an ``OSError``)."""
    try:
        yield
    except ModelError:
        raise
    except Exception as err:
        cause = " ".join(str(err).split()) or type(err).__name__
        raise ModelError(f"cannot load {label} from {name!r}: {type(err).__name__}: {cause[:500]}") from err
