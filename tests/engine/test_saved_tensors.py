"""The saved-bytes counter that prompt tuning's memory budget, the real-size probe and the LLM layer benchmark share."""

from __future__ import annotations

import torch

from clova_train.core.saved_tensors import SavedTensorBytes


def test_counts_each_saved_storage_once_without_the_excluded_weights_and_splits_by_dtype() -> None:
    weight = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorBytes([weight]) as saved:
        hidden = x @ weight  # saves the weight (x's gradient needs it): excluded
        low = hidden.to(torch.bfloat16)
        y = hidden.sigmoid().sum() + (low * low).float().sum()  # the sigmoid's float32 output; low twice, one storage
    assert saved.by_dtype() == {"float32": 4 * 8 * 4, "bfloat16": 4 * 8 * 2}
    assert saved.total == 4 * 8 * 4 + 4 * 8 * 2
    y.backward()  # the tensors came back unchanged
    assert x.grad is not None and x.grad.shape == x.shape

    with SavedTensorBytes() as everything:
        (x @ weight).sum()
    assert everything.total == 8 * 8 * 4  # the weight, not excluded now

    outside = SavedTensorBytes()
    (x @ weight).sum()  # not entered: nothing counted
    assert outside.total == 0 and outside.by_dtype() == {}
