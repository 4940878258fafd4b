"""Export a trained controller for serving: the SB3 ``.zip``, a TorchScript Q-network and a JSON description.

The directory is staged and swapped in atomically and carries the same ``export.json`` / ``versions.json``
as every other export (``clova_train.core.manifest``).

``controller.json`` says how to rebuild the observation (the text template, the layout, the embedder's
identity and dimension, N) and what each action means, so a serving stack can embed its own planner
output, run ``q_network.pt`` (``torch.jit.load``; input ``[batch, observation_dim]`` float32, output
``[batch, N + 1]`` Q-values; pick the argmax) and never import clova-train or stable-baselines3.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
import warnings
from pathlib import Path

import torch

from clova_train.core.atomic import write_json_atomic
from clova_train.core.manifest import staged_directory, write_manifest
from clova_train.controller.trainer import ControllerConfig
from clova_train.envs import make_env
from clova_train.core.errors import ExportError
from clova_train.envs.common.selection import ACTION_RULES, MASKED_RULE


def export_controller(checkpoint: str | Path, output: str | Path, config: ControllerConfig) -> Path:
    """Write ``controller.zip``, ``q_network.pt`` and ``controller.json`` to ``output``; returns it."""
    from clova_train.controller.trainer import load_controller

    checkpoint, output = Path(checkpoint), Path(output)
    if not checkpoint.is_file():
        raise ExportError(f"controller checkpoint {checkpoint} does not exist")
    model = load_controller(checkpoint, config)
    env = make_env(replace(config.env_config(), cache_path=None))
    try:
        description = env.describe()
    finally:
        env.close()
    expected = (description["observation_dim"],)
    if model.observation_space.shape != expected:
        raise ExportError(f"{checkpoint} takes observations of shape {model.observation_space.shape}, but the "
                          f"configured environment gives {expected}: export with the config it was trained with")
    q_net = model.q_net.eval()
    example = torch.rand(4, *expected) * 2 - 1
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 marks TorchScript deprecated; loaders still read it
        scripted = torch.jit.trace(q_net, example)
        check = torch.rand(8, *expected) * 2 - 1
        if not torch.allclose(scripted(check), q_net(check), atol=1e-6):
            raise ExportError("the TorchScript Q-network does not reproduce the SB3 one")
    with staged_directory(output) as staging:
        shutil.copyfile(checkpoint, staging / "controller.zip")
        scripted.save(str(staging / "q_network.pt"))
        write_json_atomic(staging / "controller.json", {
            **description,
            "q_network": {"file": "q_network.pt", "format": "torchscript", "input_shape": ["batch", *expected],
                          "output_shape": ["batch", int(model.action_space.n)],
                          "action": MASKED_RULE if model.mask_size else ACTION_RULES[config.dqn.action_selection]},
            "action_selection": config.dqn.action_selection,
            "sb3_zip": "controller.zip",
        })
        write_manifest(staging, "controller", {"kind": "checkpoint", "path": str(checkpoint.resolve())})
    return output
