"""One copy of a checkpoint per job under FSDP2: rank 0 reads it, the other ranks build the same module on the meta
device, and after ``fully_shard`` every rank receives its shards of rank 0's values.

Used by :meth:`~clova_train.models.lora_tool_llm.LoraToolLLM.configure_model` in this order, on every rank:

1. :func:`load_on_rank0`: rank 0 builds the module from the checkpoint and sends the others what they need to build
   the same architecture (a load failure is sent too, so that every rank reports it instead of waiting);
2. :func:`match_rank0_dtypes` (before sharding: a shard keeps its parameter's dtype): meta tensors take rank 0's
   dtypes, and a module that differs from rank 0's in its tensors' names is refused;
3. ``fully_shard``;
4. :func:`materialise_from_rank0`: the meta ranks allocate their shards, rank 0's full state dict (taken before
   sharding, the only full copy) is broadcast tensor by tensor and each rank keeps its shards, and the
   non-persistent buffers (which no state dict holds: rotary ``inv_freq``) are copied from rank 0 as well.

Lightning's ``ModelParallelStrategy`` then finds no meta tensor left, so its own materialisation (``to_empty`` and
``reset_parameters``: random LoRA B, uninitialised rotary buffers) never runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clova_train.core.errors import ModelError

SOURCE_RANK = 0  # set_model_state_dict(broadcast_from_rank0=True) sends from global rank 0


def is_source_rank() -> bool:
    """True on the process that reads the checkpoint (global rank 0)."""
    return dist.get_rank() == SOURCE_RANK


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (picklable objects only)."""
    box = [value]
    dist.broadcast_object_list(box, src=SOURCE_RANK)
    return box[0]


def load_on_rank0(load: Callable[[], nn.Module], describe: Callable[[nn.Module], Any],
                  build: Callable[[Any], nn.Module]) -> nn.Module:
    """Rank 0: ``load()``; every other rank: ``build(description)`` on the meta device, where ``description`` is
    ``describe(model)`` of rank 0's model (its config, for instance). If rank 0 fails, the other ranks raise a
    :class:`ModelError` with its message instead of waiting for rank 0."""
    model, failure, description = None, None, None
    if is_source_rank():
        try:
            model = load()
            description = describe(model)
        except Exception as err:  # re-raised below, once the other ranks have its message
            failure = err
    message = None if failure is None else str(failure) if isinstance(failure, ModelError) else (
        f"rank 0 could not load the model: {type(failure).__name__}: {failure}")
    message, description = broadcast_object((message, description))
    if failure is not None:
        raise failure
    if message is not None:
        raise ModelError(message)
    if model is None:
        with torch.device("meta"):
            model = build(description)
    return model


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers (persistent or not), each once."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def match_rank0_dtypes(model: nn.Module) -> None:
    """Give the meta tensors of ``model`` the dtypes of rank 0's; raise :class:`ModelError` if ``model`` does not
    hold the tensors rank 0's holds (by name)."""
    dtypes = broadcast_object({name: t.dtype for name, t in named_tensors(model)} if is_source_rank() else None)
    mine = dict(named_tensors(model))
    if mine.keys() != dtypes.keys():
        extra, missing = sorted(mine.keys() - dtypes.keys()), sorted(dtypes.keys() - mine.keys())
        raise ModelError(f"rank {dist.get_rank()} built {type(model).__name__} unlike rank 0: tensors only here "
                         f"{extra[:5]}, only on rank 0 {missing[:5]} (is the same code installed on every node?)")
    for name, tensor in mine.items():
        if tensor.is_meta and tensor.dtype != dtypes[name]:
            tensor.data = tensor.data.to(dtypes[name])


def non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers no state dict holds, each once, in module order."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for name in sorted(module._non_persistent_buffers_set):
            buffer = module._buffers.get(name)
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                yield f"{prefix}.{name}" if prefix else name, buffer


def materialise_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """After ``fully_shard``: every rank holds its shards of rank 0's ``full_state`` (rank 0's ``state_dict()`` taken
    before sharding; ``{}`` on the other ranks) and rank 0's non-persistent buffers. The meta ranks allocate their
    shards on ``device`` first. Raises :class:`ModelError` if a tensor is left on the meta device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # A plain tensor attribute that is one of its module's buffers (transformers 4's rotary ``original_inv_freq``)
    # would keep the meta tensor that ``to_empty`` replaces: it is pointed at the new buffer afterwards.
    aliases = [(module, attribute, name) for module in model.modules() for attribute, value in vars(module).items()
               if isinstance(value, torch.Tensor) for name, buffer in module._buffers.items() if buffer is value]
    if not is_source_rank():
        model.to_empty(device=device)
    # Rank 0 sends one tensor at a time (each rank keeps its shard of it), so no rank holds a second full copy.
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for _, buffer in non_persistent_buffers(model):
            # rank 0's buffers are where it loaded them (host memory), and NCCL broadcasts device tensors only
            staged = buffer.to(device)
            dist.broadcast(staged, src=SOURCE_RANK)
            buffer.copy_(staged)
    for module, attribute, name in aliases:
        setattr(module, attribute, module._buffers[name])
    left = [f"{prefix}.{attribute}" if prefix else attribute for prefix, module in model.named_modules()
            for attribute, value in vars(module).items() if isinstance(value, torch.Tensor) and value.is_meta]
    if left:
        raise ModelError(f"{type(model).__name__} keeps tensors that are neither parameters nor buffers on the meta "
                         f"device after loading from rank 0: {left[:5]}; ModelParallelStrategy cannot build it on "
                         "ranks other than 0 (use the ddp strategy)")
