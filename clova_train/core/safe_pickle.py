"""Unpickling formats that are pickle by nature (SB3 zips' fields, replay buffers, distributed-checkpoint metadata)
without running code from the file: only the globals a legitimate file of the format names are resolved."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Collection
from typing import IO, Any


class AllowlistUnpickler(pickle.Unpickler):
    """An unpickler that resolves a global only if ``allowed`` admits it (a collection of ``(module, name)`` pairs,
    or a predicate); anything else raises ``pickle.UnpicklingError`` naming it, before it is imported.

    Args:
        file: the binary stream to read.
        allowed: the admitted ``(module, name)`` pairs, or a function of ``(module, name)``.
    """

    def __init__(self, file: IO[bytes], allowed: Collection[tuple[str, str]] | Callable[[str, str], bool]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        admitted = self.allowed(module, name) if callable(self.allowed) else (module, name) in self.allowed
        if not admitted:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


def restricted_loads(data: bytes, allowed: Collection[tuple[str, str]] | Callable[[str, str], bool]) -> Any:
    """Unpickle ``data`` through :class:`AllowlistUnpickler`."""
    return AllowlistUnpickler(io.BytesIO(data), allowed).load()
