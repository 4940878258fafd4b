"""Where the test cache keeps a pretrained tiny model of a tool recipe, and how its build is started.

A cache entry is named by the model's kind, its pretraining steps, the recipe's fingerprint of the builder's
code (:meth:`~clova_train.tools.recipes.TinyModel.fingerprint`) and the math-library settings the build
runs under: a changed builder, step count or kernel choice gives a new name, so the model is rebuilt instead of an
old one being reused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from clova_train.tools.recipes import TinyModel

# The variables that choose the math kernels a build runs on (the Makefile's demos set them; the tests run on the
# host's own kernels): a model pretrained for minutes comes out differently on other kernels.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def build_environment(model: TinyModel, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the building process starts with: ``base`` (default: this process's) and the model's own."""
    return {**(os.environ if base is None else base), **model.environment}


def cache_name(model: TinyModel, steps: int | None = None, base: Mapping[str, str] | None = None) -> str:
    """The cache directory's name of ``model`` pretrained for ``steps`` (default: the model's own step count)."""
    steps = model.pretrain_steps if steps is None else steps
    environment = build_environment(model, base)
    kernels = ",".join(f"{name}={environment.get(name, '')}" for name in KERNEL_VARIABLES)
    kernel_digest = hashlib.sha256(kernels.encode()).hexdigest()[:8]
    return f"tiny-{model.kind}-{steps}-{model.fingerprint()}-{kernel_digest}"
