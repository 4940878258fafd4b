"""Export a trained controller for serving: the SB3 ``.zip``, a TorchScript Q-network, a JSON description, a
standalone observation builder and a README.

The Q-network is exported whatever its architecture (``dqn.q_network``: HYDRA's ``mlp`` or the ``per_sample``
scorer): it is traced to TorchScript from the SB3 model and checked to give its Q-values, so serving reads
``q_network.pt`` the same way for both; ``controller.json``'s ``q_network.architecture`` names it.

The directory is staged and swapped in atomically and carries the same ``export.json`` / ``versions.json``
as every other export (``clova_train.core.manifest``).

``controller.json`` says how to rebuild the observation (its named parts and their offsets, which parts are texts,
the embedder's identity and dimension) and what each action means. ``observation.py`` (numpy only; the very
module the environments build their observations with, ``clova_train.core.observation_builder``) turns the
planner's output into that vector, so a serving stack can run ``q_network.pt`` (``torch.jit.load``; input
``[batch, observation_dim]`` float32, output ``[batch, n_actions]`` Q-values) or ``DQN.load("controller.zip")``
and never import clova-train. ``README.md`` in the export shows the calls.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
import warnings
from pathlib import Path

import torch

from clova_train.core import observation_builder
from clova_train.core.atomic import write_json_atomic
from clova_train.core.manifest import staged_directory, write_manifest
from clova_train.core.run_manifest import RUN_MANIFEST_FILE, RunManifest, export_manifest_fields, read_run_manifest
from clova_train.controller.trainer import ControllerConfig
from clova_train.envs import make_env
from clova_train.core.errors import ExportError
from clova_train.envs.common.selection import ACTION_RULES, MASKED_RULE


OBSERVATION_MODULE = "observation.py"


PER_SAMPLE_NOTE = (
    "\nQ-network: `per_sample` (one MLP with shared weights scores each instruction sample, a separate one re-plan; "
    "`clova_train.controller.per_sample_policy`). `q_network.pt` runs it without clova-train; `controller.zip` names "
    "that policy class, so `DQN.load` needs clova-train importable.\n")


PLANNER_REPLY_FORMAT = """
The planner's reply is read by `observation.parse_samples(reply, num_samples)`: one instruction per line (a list
marker such as `1.`, `2)`, `-` or `*` is dropped, never read as a probability), at most `num_samples` lines, each
with its probability before or after the text: in brackets (`[0.83]`, `(p=0.83)`, `{83%}`), after a label
(`probability: 0.83`, `p=0.83`) or bare (`0.83`, `83%`). A number inside the instruction (`pick the 2 red cubes`,
`zoom 1.5x`, `scale by 0.5`) is not a probability; a line without one gets 0; a bracketed or labelled value outside
[0, 1] is clipped to it. A probability on a line of its own goes with the instruction above it (or, when that one
has its own or is a heading ending in `:`, with the one below): it never takes a slot. A short reply is padded with
`(no instruction)` at 0, so action i always means the i-th sample. `observation.parse_samples_report` returns the
same samples with a note for each line read as 0 (`missing`, `unreadable`), each clipped value, each probability
left without an instruction (`unpaired`) and where a reply too long to read was `cut` (after
`observation.max_reply_lines(num_samples)` non-empty lines): count them to see how well your planner follows the
format.

Example reply (`num_samples` = 5):

```text
1. [0.83] find the red circles
2. count them (70%)
3. pick the 2 largest 0.6
4. compare the counts
   Probability: 0.4
```

is read as:

| action | instruction | probability |
| --- | --- | --- |
| 0 | find the red circles | 0.83 |
| 1 | count them | 0.7 |
| 2 | pick the 2 largest | 0.6 |
| 3 | compare the counts | 0.4 |
| 4 | (no instruction) | 0 |

"""


def controller_card(description: dict, n_actions: int, rule: str, q_network: str = "mlp") -> str:
    """The export's README: what the files are and how to choose an action without clova-train."""
    environment = description.get("environment", "hydra")
    if environment == "hydra":
        parts = ("samples = observation.parse_samples(planner_reply, description['num_samples'])  # exactly N, padded\n"
                 "parts = observation.hydra_parts(description, question, iteration, memory_entries, samples)\n"
                 "# iteration: 1-based step; memory_entries: the State Memory Bank's entries (one per step)")
    else:
        names = [name for name in description["observation_parts"] if name not in description.get("text_parts", {})]
        flags = ("description['agent_names']" if environment == "hammr"
                 else "the action names, description['actions'] (the state: description['states'])")
        parts = ("# memory entries: observation.agent_memory_line(label, action, observation.tool_output_line(output))\n"
                 'parts = {"question": question, "memory": observation.memory_text(entries, last=8),\n'
                 + "".join(f'         "{name}": ...,\n' for name in names)
                 + f"}}  # flags over {flags}: observation.one_hot(names, chosen)")
    actions = "\n".join(f"| {index} | {meaning} |" for index, meaning in description["actions"].items())
    planner_format = PLANNER_REPLY_FORMAT if environment == "hydra" else ""
    return f"""# {environment} controller (DQN, stable-baselines3)

Exported by clova-train. Files: `controller.zip` (stable-baselines3 DQN), `q_network.pt` (TorchScript Q-network),
`controller.json` (observation layout, embedder, actions, environment settings), `observation.py` (builds the
observation; numpy only), `export.json` and `versions.json`.

## Choosing an action without clova-train

```python
import json, numpy as np, torch
import observation                      # this directory's observation.py
description = json.load(open("controller.json"))
embed = observation.embedder_from_description(description["embedder"])  # 'hashing'; else your own embed(texts)
{parts}
x = observation.build_observation(description, parts, embed)            # float32 [{description["observation_dim"]}]
q_values = torch.jit.load("q_network.pt")(torch.from_numpy(x)[None])     # [1, {n_actions}]
# or: from stable_baselines3 import DQN; DQN.load("controller.zip").predict(x, deterministic=True)
```

Action rule: {rule} (`controller.zip`'s plain `predict` takes the argmax over every action).
{PER_SAMPLE_NOTE if q_network == "per_sample" else ""}{planner_format}Observation parts (`[start, end)`): {json.dumps(description["observation_parts"])}.

| action | meaning |
| --- | --- |
{actions}
"""


def trained_by(checkpoint: Path) -> RunManifest | None:
    """The manifest of the controller run a checkpoint belongs to (its directory's, or for a file under
    ``checkpoints/`` the run's), if it has one."""
    for directory in (checkpoint.parent, checkpoint.parent.parent):
        if (directory / RUN_MANIFEST_FILE).is_file():
            run = read_run_manifest(directory)
            return run if run.kind == "controller" else None
    return None


def export_controller(checkpoint: str | Path, output: str | Path, config: ControllerConfig) -> Path:
    """Write ``controller.zip``, ``q_network.pt``, ``controller.json``, ``observation.py`` and ``README.md`` to
    ``output``; returns it."""
    from clova_train.controller.trainer import load_controller, q_network_kind

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
    rule = MASKED_RULE if model.mask_size else ACTION_RULES[config.dqn.action_selection]
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
        shutil.copyfile(observation_builder.__file__, staging / OBSERVATION_MODULE)
        write_json_atomic(staging / "controller.json", {
            **description,
            "q_network": {"file": "q_network.pt", "format": "torchscript", "input_shape": ["batch", *expected],
                          "output_shape": ["batch", int(model.action_space.n)],
                          "action": rule, "architecture": q_network_kind(model)},
            "action_selection": config.dqn.action_selection,
            "sb3_zip": "controller.zip",
            "observation_builder": OBSERVATION_MODULE,
        })
        card = controller_card(description, int(model.action_space.n), rule, q_network_kind(model))
        (staging / "README.md").write_text(card)
        write_manifest(staging, "controller", {"kind": "checkpoint", "path": str(checkpoint.resolve())},
                       **export_manifest_fields("controller", None, trained_by(checkpoint)))
    return output
