"""Atomic file writes: a reader sees either the old file or the complete new one, never a partial one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process umask (read by setting and restoring it; there is no read-only call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode ``open`` / ``mkdir`` would give a new file or directory under the current umask.

    ``mkstemp`` and ``mkdtemp`` create private (0600 / 0700) entries whatever the umask; exports are read by
    servers running as other users, so the entries this package writes get the normal mode instead.
    """
    return (0o777 if directory else 0o666) & ~current_umask()


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it is fsynced and renamed over ``target``.

    On an exception the temporary file is removed and ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, default_mode())  # after the writer: some writers (safetensors) recreate the file
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(target: str | os.PathLike[str], writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and move the result over ``target`` atomically."""
    with atomic_path(target) as tmp:
        writer(tmp)


def write_text_atomic(target: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically."""
    write_atomic(target, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(target: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``target`` atomically."""
    write_text_atomic(target, json.dumps(obj, indent=2, sort_keys=True) + "\n")
