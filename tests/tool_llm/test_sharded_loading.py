"""The meta-device side of :mod:`clova_train.models.sharded_loading` on one gloo process posing as a rank other than 0
(the two-rank runs are in test_lora_distributed.py): a tensor attribute that aliased a buffer follows the new buffer,
and a tensor that is neither a parameter nor a buffer left on the meta device is refused with one message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from clova_train.core.errors import ModelError
from clova_train.models import sharded_loading


class Rotary(nn.Module):
    """transformers 4's rotary embedding: ``original_inv_freq`` is a plain attribute aliasing the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
        self.original_inv_freq = self.inv_freq


class Scaled(nn.Module):
    """A tensor kept as a plain attribute, aliasing nothing: nothing can restore it after meta-device building."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(3)


@pytest.fixture
def meta_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(sharded_loading, "is_source_rank", lambda: False)
    try:
        yield
    finally:
        dist.destroy_process_group()


def source_state() -> dict[str, torch.Tensor]:
    """What rank 0 would send (this process is also the group's rank 0, so it sends these to itself)."""
    return {f"0.{k}": v for k, v in nn.Linear(2, 2).state_dict().items()}


def test_an_attribute_aliasing_a_buffer_follows_it_off_the_meta_device(meta_rank: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Rotary())
    sent = source_state()
    sharded_loading.materialise_from_rank0(model, dict(sent), torch.device("cpu"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sent.items())
    rotary = model[1]
    assert not rotary.inv_freq.is_meta and rotary.original_inv_freq is rotary.inv_freq


def test_a_meta_tensor_no_rank_can_send_is_refused_with_its_name(meta_rank: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Scaled())
    with pytest.raises(ModelError, match=r"neither parameters nor buffers on the meta device .*\['1\.scale'\]"):
        sharded_loading.materialise_from_rank0(model, source_state(), torch.device("cpu"))
