"""The dtype a frozen network is stored in under a Lightning ``trainer.precision`` (read as a string, so nothing
here imports Lightning)."""

from __future__ import annotations

from typing import Any

import torch

PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "bf16": torch.bfloat16,
                    "16-mixed": torch.float16, "16-true": torch.float16, "16": torch.float16,
                    "32-true": torch.float32, "32": torch.float32}


def precision_dtype(precision: Any) -> torch.dtype:
    """The dtype the frozen base is stored in for a Lightning ``precision`` (float32 when none or another kind)."""
    return PRECISION_DTYPES.get(str(precision), torch.float32)
