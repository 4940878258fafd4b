"""Loading never runs code from a file (issue 32, part 1): each hostile artifact carries a canary command; loading it
fails with one clear message and the canary never runs."""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from clova_train.core.errors import ClovaTrainError, DataError, ModelError, UnsafeFileError
from clova_train.core.pool import PoolSpec, PromptPool
from clova_train.sb3.files import load_replay_buffer, zip_custom_objects
from clova_train.tools.base import ENTRY_POINT_GROUP, PromptTool, registered_tool, tool_class
from helpers.common import run_cli_subprocess

CANARY_MODULE = """
from pathlib import Path
Path(__file__).with_name("CANARY").write_text("code from a file ran")

class Evil:
    pass
"""


def hostile_export(directory: Path, class_path: str) -> Path:
    """An export whose ``tool.json`` names a module that sits in the working directory, with a canary."""
    directory.mkdir(parents=True)
    (directory / "evil_tool.py").write_text(CANARY_MODULE)
    (directory / "export").mkdir()
    (directory / "export" / "tool.json").write_text(json.dumps(
        {"class_path": class_path, "init_args": {}, "tool": "clip", "identity": "x", "prompt_shape": [1, 2],
         "feature_dim": 2}))
    pool = PromptPool(PoolSpec("clip", "x", (1, 2), 2))
    pool.save(directory / "export" / "pool.safetensors")
    return directory


@pytest.mark.parametrize("class_path", ["evil_tool.Evil", "os.system", "subprocess.Popen"])
def test_a_tool_json_naming_a_module_never_imports_it(class_path: str, tmp_path: Path) -> None:
    """`python -m clova_train serve` from a directory holding the named module (the working directory is on
    sys.path there): one error line, no canary."""
    work = hostile_export(tmp_path / "work", class_path)
    done = subprocess.run([sys.executable, "-m", "clova_train", "serve", "export", "--request", '{"images": []}'],
                          cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert not (work / "CANARY").exists()
    assert "Traceback" not in done.stderr
    assert f"tool class {class_path!r} is not a registered prompt tool" in done.stderr


@pytest.mark.parametrize("init_args, words", [
    ({"model_name": "x", "bogus_key": 1}, "tool.json's init_args has the key 'bogus_key', which PromptedClip does not "
                                          "take (it takes model_name, "),
    (["model_name"], "tool.json's init_args must be an object, got list"),
])
def test_init_args_a_tool_does_not_take_are_named_before_anything_loads(tmp_path: Path, init_args: object,
                                                                        words: str) -> None:
    from clova_train.core.errors import ExportError
    from clova_train.tools.prompt_server import PromptToolServer

    export = hostile_export(tmp_path / "work", "clova_train.tools.clip.tool.PromptedClip") / "export"
    description = json.loads((export / "tool.json").read_text())
    (export / "tool.json").write_text(json.dumps({**description, "init_args": init_args}))
    with pytest.raises(ExportError, match=f"cannot rebuild the tool of {export}: ") as caught:
        PromptToolServer.from_export(export)
    assert words in str(caught.value)


def test_registered_tools_are_the_shipped_ones_imported_subclasses_and_entry_points() -> None:
    assert tool_class({"class_path": "clova_train.tools.vqa.tool.BlipVqa"}).__name__ == "BlipVqa"

    class OwnTool(PromptTool):  # a user's tool: registered because their program imported (defined) it
        name = "own"

    path = f"{OwnTool.__module__}.{OwnTool.__qualname__}"
    assert registered_tool(path) is OwnTool
    assert registered_tool("tests.not_a_tool.Tool") is None
    with pytest.raises(ModelError, match=rf"'json.JSONDecoder' is not a registered prompt tool.*{ENTRY_POINT_GROUP}"):
        tool_class({"class_path": "json.JSONDecoder"})


class Canary:
    """Unpickling this runs ``touch <path>`` (what a hostile pickle does)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def hostile_zip(path: Path, canary: Path, field: str = "observation_space") -> Path:
    """An SB3 zip whose ``data`` holds a cloudpickled field that runs a command when unpickled."""
    payload = base64.b64encode(pickle.dumps(Canary(canary))).decode()
    data = {"policy_class": {":type:": "<class 'abc.ABCMeta'>", ":serialized:": payload} if field == "policy_class"
            else {"__module__": "stable_baselines3.dqn.policies"},
            field: {":type:": "<class 'gymnasium.spaces.box.Box'>", ":serialized:": payload}}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data", json.dumps(data))
        archive.writestr("policy.pth", b"")
    return path


@pytest.mark.parametrize("command", ["evaluate", "export"])
@pytest.mark.parametrize("field", ["observation_space", "policy_class", "lr_schedule"])
def test_a_controller_zip_with_a_pickled_command_is_refused_unrun(command: str, field: str, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    evil = hostile_zip(tmp_path / "evil.zip", canary, field)
    extra = ["--output", str(tmp_path / "out")] if command == "export" else []
    done = run_cli_subprocess(["controller", command, "--config", "configs/quickstart/controller_dqn.yaml",
                               f"--train.output_dir={tmp_path / 'run'}", f"--checkpoint={evil}", *extra])
    assert done.returncode == 2, done.stderr[-3000:]
    assert not canary.exists()
    assert "Traceback" not in done.stderr
    assert f"{evil}: field {field!r} cannot be loaded safely (posix.system is not allowed)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_hammr_agent_with_a_hostile_controller_zip_is_refused_unrun(tmp_path: Path) -> None:
    from clova_train.envs.avis.agents import load_controller_policy

    canary = tmp_path / "CANARY"
    evil = hostile_zip(tmp_path / "evil.zip", canary)
    with pytest.raises(ClovaTrainError, match=r"agent specialist: .*evil.zip: field 'observation_space' cannot be "
                                              r"loaded safely \(posix.system is not allowed\)"):
        load_controller_policy(str(evil), env=None, agent="specialist")
    assert not canary.exists()


def test_a_replay_buffer_with_a_pickled_command_is_refused_unrun(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    (tmp_path / "replay_buffer.pkl").write_bytes(pickle.dumps({"observations": Canary(canary)}))
    with pytest.raises(UnsafeFileError, match=r"replay buffer .*replay_buffer.pkl cannot be loaded safely "
                                              r"\(posix.system is not allowed\)"):
        load_replay_buffer(object(), tmp_path / "replay_buffer.pkl")
    assert not canary.exists()


def pickled_adapter(directory: Path, canary: Path) -> Path:
    """A PEFT adapter directory whose weights are an ``adapter_model.bin`` pickle carrying a canary."""
    adapter = directory / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nowhere/base",
                                                             "peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"base_model.lora_A.weight": Canary(canary)}))
    return directory


def test_a_pickled_adapter_is_refused_by_the_python_api_and_the_export(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    from clova_train.cli import main
    from clova_train.core.errors import ExportError
    from clova_train.tooluse.served_llm import ServedToolLLM

    canary = tmp_path / "CANARY"
    export = pickled_adapter(tmp_path / "export", canary)
    words = r"adapter weights .*adapter_model.bin are a pickle, which clova-train does not load"
    with pytest.raises(ExportError, match=words):
        ServedToolLLM.from_export(export)
    with pytest.raises(ExportError, match=words):
        ServedToolLLM.from_export(export, base_model=str(tmp_path))
    run = pickled_adapter(tmp_path / "run", canary)
    assert main(["export", str(run), "-o", str(tmp_path / "out"), "--merged"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(words, err), err
    assert not (tmp_path / "out").exists() and not canary.exists()


def test_the_allowlist_loads_what_sb3_writes(tmp_path: Path) -> None:
    """A real DQN zip and replay buffer load through the allowlist, to the same weights and buffer."""
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=10, buffer_size=500, seed=0,
                policy_kwargs={"net_arch": [8]})
    model.learn(60)
    model.save(tmp_path / "model.zip")
    model.save_replay_buffer(tmp_path / "replay.pkl")
    loaded = DQN.load(tmp_path / "model.zip", custom_objects=zip_custom_objects(tmp_path / "model.zip"))
    load_replay_buffer(loaded, tmp_path / "replay.pkl")
    assert all(torch.equal(a, b) for a, b in zip(model.policy.state_dict().values(), loaded.policy.state_dict().values()))
    assert np.array_equal(model.replay_buffer.observations, loaded.replay_buffer.observations)
    assert loaded.observation_space == model.observation_space and loaded.train_freq == model.train_freq


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_replay_buffer_with_non_finite_rewards_is_refused_naming_the_file(tmp_path: Path, value: float) -> None:
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import DQN

    from clova_train.core.errors import DataError
    from clova_train.sb3.files import load_replay_arrays, save_replay_arrays

    def dqn() -> DQN:
        return DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=10, buffer_size=500, seed=0,
                   policy_kwargs={"net_arch": [8]})

    model = dqn()
    model.learn(30)
    model.replay_buffer.rewards[7, 0] = value
    model.save_replay_buffer(tmp_path / "replay.pkl")
    with open(tmp_path / "replay.npz", "wb") as handle:
        save_replay_arrays(model, handle)
    for name, load in (("replay.pkl", load_replay_buffer), ("replay.npz", load_replay_arrays)):
        fresh = dqn()
        with pytest.raises(DataError, match=rf"replay buffer .*{name}: rewards holds {value} at transition 7"):
            load(fresh, tmp_path / name)
        assert not np.isin(fresh.replay_buffer.rewards, [value]).any()  # nothing of it reached the model


def sharded_checkpoint(directory: Path, **entries: object) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.ones(2)}, **entries}, checkpoint_id=str(directory), no_dist=True)
    return directory


@pytest.mark.parametrize("where", ["metadata", "entry"])
def test_a_sharded_checkpoint_with_a_pickled_command_is_refused_unrun(where: str, tmp_path: Path) -> None:
    """In ``.metadata`` (torch's reader unpickles it) or in a non-tensor entry of a shard (torch loads those with
    ``weights_only=False``): ``clova-train export`` refuses in one line and the command never runs."""
    canary = tmp_path / "CANARY"
    if where == "metadata":
        ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
        (ckpt / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
        expected = r"\.metadata cannot be loaded safely \(posix.system is not allowed\)"
    else:
        ckpt = sharded_checkpoint(tmp_path / "last.ckpt", hyper=Canary(canary))
        expected = r"last.ckpt: entry 'hyper' cannot be loaded safely \(posix.system is not allowed\)"
    assert not canary.exists()  # saving ran nothing
    done = run_cli_subprocess(["export", str(ckpt), "--output", str(tmp_path / "out")])
    assert done.returncode == 2, done.stderr[-3000:]
    assert not canary.exists()
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert re.search(expected, done.stderr), done.stderr
    assert not (tmp_path / "out").exists()


class RecordingStrategy:
    """Stands in for a Lightning strategy: records what its ``load_checkpoint`` was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, object]] = []

    def load_checkpoint(self, checkpoint_path: object, weights_only: bool | None = None) -> dict:
        self.loaded.append((str(checkpoint_path), weights_only))
        return {}


@pytest.mark.parametrize("where", ["metadata", "entry"])
def test_resuming_from_a_hostile_sharded_directory_is_refused_before_torch_reads_it(where: str, tmp_path: Path) -> None:
    from clova_train.export.distributed_checkpoint import guard_checkpoint_loading

    canary = tmp_path / "CANARY"
    if where == "metadata":
        ckpt = sharded_checkpoint(tmp_path / "last.ckpt")
        (ckpt / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
    else:
        ckpt = sharded_checkpoint(tmp_path / "last.ckpt", hyper=Canary(canary))
    strategy = RecordingStrategy()
    guard_checkpoint_loading(strategy)
    guard_checkpoint_loading(strategy)  # idempotent
    with pytest.raises(UnsafeFileError, match="cannot be loaded safely"):
        strategy.load_checkpoint(ckpt)
    assert not canary.exists() and strategy.loaded == []


@pytest.mark.parametrize("url", ["https://example.invalid/last.ckpt", "http://127.0.0.1:1/x.ckpt", "s3://bucket/x.ckpt"])
def test_remote_checkpoints_are_refused(url: str) -> None:
    from clova_train.export.distributed_checkpoint import guard_checkpoint_loading

    strategy = RecordingStrategy()
    guard_checkpoint_loading(strategy)
    with pytest.raises(UnsafeFileError, match="remote checkpoints are not loaded"):
        strategy.load_checkpoint(url)
    assert strategy.loaded == []


def test_checkpoint_files_and_clean_sharded_directories_load_weights_only(tmp_path: Path) -> None:
    from clova_train.export.distributed_checkpoint import guard_checkpoint_loading

    ckpt = sharded_checkpoint(tmp_path / "good.ckpt", step=3, name="run")
    strategy = RecordingStrategy()
    guard_checkpoint_loading(strategy)
    strategy.load_checkpoint(ckpt, weights_only=False)
    strategy.load_checkpoint(tmp_path / "plain.ckpt")
    assert strategy.loaded == [(str(ckpt), True), (str(tmp_path / "plain.ckpt"), True)]


def test_fit_with_a_hostile_ckpt_path_stops_in_one_line_unrun(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    """The CLI path: ``clova-train fit ... --ckpt_path <hostile sharded directory>``."""
    from helpers.common import fit_args

    canary = tmp_path / "CANARY"
    ckpt = sharded_checkpoint(tmp_path / "resume.ckpt")
    (ckpt / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
    done = run_cli_subprocess([*fit_args(tiny_clip_dir, concept_root, tmp_path / "run"), f"--ckpt_path={ckpt}"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert not canary.exists()
    assert "Traceback" not in done.stderr and "cannot be loaded safely" in done.stderr, done.stderr[-3000:]


def test_the_safe_reader_reads_what_torch_writes(tmp_path: Path) -> None:
    from clova_train.export.distributed_checkpoint import read_distributed_checkpoint

    ckpt = sharded_checkpoint(tmp_path / "ckpt", step=5, name="run", groups=[{"lr": 0.1, "params": [0]}],
                              half=torch.arange(4, dtype=torch.bfloat16))
    state = read_distributed_checkpoint(ckpt)
    assert torch.equal(state["state_dict"]["w"], torch.ones(2)) and state["half"].dtype == torch.bfloat16
    assert (state["step"], state["name"], state["groups"]) == (5, "run", [{"lr": 0.1, "params": [0]}])


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "symlink to a fifo"])
def test_an_image_path_that_is_no_regular_file_is_refused_without_blocking(kind: str, tmp_path: Path) -> None:
    """A FIFO named as an image blocked the only serving worker (opening it waits for a writer)."""
    import threading

    from clova_train.tools.images import check_image, open_rgb

    path = tmp_path / "image.png"
    if kind in ("fifo", "symlink to a fifo"):
        os.mkfifo(tmp_path / "fifo")
        path = tmp_path / "fifo"
        if kind == "symlink to a fifo":
            (tmp_path / "link.png").symlink_to(path)
            path = tmp_path / "link.png"
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    outcomes: list[BaseException] = []

    def read() -> None:
        for reader in (check_image, open_rgb):
            try:
                reader(path)
            except BaseException as err:  # noqa: BLE001 (recorded for the assertions)
                outcomes.append(err)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "reading blocked"
    assert len(outcomes) == 2 and all(isinstance(e, DataError) for e in outcomes), outcomes  # ImageReadError is one
    assert all(str(e) == f"image {path} is not a regular file" for e in outcomes)
