"""What autograd keeps for the backward pass: the bytes of the tensors it saves while a counter is active."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class SavedTensorBytes:
    """Count the storages autograd saves for backpropagation while active, each storage once, those of ``excluded``
    tensors (a model's own weights, which a step does not add) left out: the activation memory a step keeps. A
    context manager; a callback may also enter it in one hook and exit it in another.

    Args:
        excluded: tensors whose storages are not counted (parameters, buffers).
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self._saved: dict[int, tuple[int, str]] = {}
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":  # a meta tensor has no storage to count
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._excluded:
                self._saved[storage.data_ptr()] = (storage.nbytes(), str(tensor.dtype).removeprefix("torch."))
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpacked)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    @property
    def total(self) -> int:
        """Bytes saved so far."""
        return sum(nbytes for nbytes, _ in self._saved.values())

    def by_dtype(self) -> dict[str, int]:
        """The same bytes split by the saved tensors' dtype (``{"float32": n, "bfloat16": m}``)."""
        split: dict[str, int] = {}
        for nbytes, dtype in self._saved.values():
            split[dtype] = split.get(dtype, 0) + nbytes
        return split
