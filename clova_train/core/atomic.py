"""Atomic file writes: a reader sees either the old file or the complete new one, never a partial one.

A write goes to a temporary beside its target (``.<name>.<host>-<pid>.<random>.tmp``; a staged directory ends in
``.staging``), which is renamed over the target when complete. A writer that is killed leaves its temporary
behind; the next write of the same target on the same host removes those whose process is gone. A full disk
(``ENOSPC``, or a used-up quota) ends in one :class:`~clova_train.core.errors.StorageError` naming the target,
which is left as it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clova_train.core.errors import StorageError

TEMP_SUFFIX = ".tmp"
STAGING_SUFFIX = ".staging"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def temporary_prefix(target: Path) -> str:
    """The name start of this process's temporaries for ``target``: ``.<name>.<host>-<pid>.``."""
    return f".{target.name}.{socket.gethostname()}-{os.getpid()}."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporaries of ``target`` that writers on this host left when they were killed (their process
    is gone); those of live writers, of other hosts (a shared file system) and of other files stay. Returns
    what was removed."""
    host, removed = socket.gethostname(), []
    start = f".{target.name}."
    try:
        with os.scandir(target.parent) as entries:  # names compared as strings: cheap in a folder of thousands
            candidates = [entry.name for entry in entries
                          if entry.name.startswith(start) and entry.name.endswith((TEMP_SUFFIX, STAGING_SUFFIX))]
    except OSError:
        return removed
    for name in candidates:
        owner = name[len(start):].rsplit(".", 2)[0]  # <host>-<pid> (the random part and suffix cut off)
        owner_host, _, pid = owner.rpartition("-")
        if owner_host != host or not pid.isdigit() or int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        entry = target.parent / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write that failed for lack of space (or quota)."""
    return isinstance(error, OSError) and error.errno in DISK_FULL


def storage_error(target: Path, error: OSError, intact: bool = True) -> StorageError:
    """One message for a write to ``target`` that ran out of space (``intact``: an atomic write, which left the
    old ``target`` as it was)."""
    kept = f"{target} is as it was before; " if intact else ""
    return StorageError(f"no space left on the device to write {target} ({os.strerror(error.errno)}); "
                        f"{kept}free some space and run the same command again")


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it is fsynced and renamed over ``target``.

    On an exception the temporary file is removed and ``target`` is left untouched; a full disk raises
    :class:`~clova_train.core.errors.StorageError`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    fd, tmp_name = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=TEMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, default_mode())  # after the writer: some writers (safetensors) recreate the file
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as error:
        if disk_full(error):
            raise storage_error(target, error) from error
        raise
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
