"""Exceptions raised for user-facing failures.

Each carries one message that names the thing at fault (a file, a config key, a record), so the CLI
can print it without a traceback.
"""

from __future__ import annotations


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
