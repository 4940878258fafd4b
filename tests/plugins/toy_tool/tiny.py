"""The toy tool's tiny-model builder (``clova-train tiny-model toy DIR``) and the smoke run's "real-size" model.

Written the way docs/architecture.md ("A tool is a folder") says a user writes a tiny builder: a function of
``(directory, seed=..., pretrain_steps=...)`` that writes the frozen network in the layout the tool loads
(:func:`toy_tool.tool.load_toy_model`) and returns the directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from clova_train.tools.tiny_common import torch_threads
from .synthetic import TOY_CLASSES, TOY_DIM, TOY_MISCONCEPTIONS, TOY_NOISE, concept_vectors
from .tool import CONFIG_FILE, WEIGHT_FILE

PRETRAIN_STEPS = 50


def build_toy_model(directory: str | Path, seed: int = 0, pretrain_steps: int = PRETRAIN_STEPS) -> Path:
    """Write a toy classifier into ``directory`` (config JSON and safetensors weights): random weights, then
    ``pretrain_steps`` of full-batch Adam on synthetic vectors of :data:`TOY_CLASSES` with
    :data:`TOY_MISCONCEPTIONS` as their labels (0 keeps the random weights)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    classifier = nn.Linear(TOY_DIM, len(TOY_CLASSES))
    vectors = torch.cat([concept_vectors(c, 32, TOY_DIM, TOY_NOISE, seed + k) for k, c in enumerate(TOY_CLASSES)])
    labels = torch.tensor([TOY_CLASSES.index(TOY_MISCONCEPTIONS.get(c, c)) for c in TOY_CLASSES for _ in range(32)])
    optimizer = torch.optim.Adam(classifier.parameters(), lr=0.1)
    # one thread, as the package's tiny-model builders: the same model on every host (and no thread hand-offs,
    # which cost more than these tiny steps)
    with torch_threads(1):
        for _ in range(pretrain_steps):
            optimizer.zero_grad()
            F.cross_entropy(classifier(vectors), labels).backward()
            optimizer.step()
    (directory / CONFIG_FILE).write_text(json.dumps({"dim": TOY_DIM, "classes": list(TOY_CLASSES)}), encoding="utf-8")
    save_file({k: v.detach().contiguous() for k, v in classifier.state_dict().items()}, str(directory / WEIGHT_FILE))
    return directory


def build_real_size(directory: str | Path, seed: int = 0, **_: object) -> Path:
    """The smoke run's model (``SmokeRealCase.model``): the toy has one size, so its random-weight classifier, as
    the real-size builders write random weights in the real layout."""
    return build_toy_model(directory, seed=seed, pretrain_steps=0)
