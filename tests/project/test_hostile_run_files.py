"""Every file of a run is read within limits before the library that parses it sees it (issue 53, point 1): SB3 zips
and replay buffers, metrics CSVs, summaries and evaluations, world files and pool metadata. A special file is refused
at once, a size, count or magnitude beyond what a real file of its kind holds is one message naming the file and the
field, never a traceback, a hang or an allocation of gigabytes."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from clova_train.core.errors import ClovaTrainError, DataError, PoolError

SPECIAL_FILES = ("fifo", "link to /dev/zero", "directory")


@pytest.fixture(autouse=True)
def no_hang(request: pytest.FixtureRequest) -> Iterator[None]:
    """A reader that blocks (opening a FIFO waits for a writer) fails the test instead of hanging the suite (a
    contained case is bounded by its child's own limits)."""
    if "contained" in request.node.name:
        yield
        return

    def expired(*_: Any) -> None:
        raise TimeoutError("the reader blocked")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def special_file(path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return path


def _readers() -> dict[str, tuple[str, Callable[[Path], Any]]]:
    from clova_train.report.runs import read_concept_evaluation, read_policy_evaluation, read_series, read_summary
    from clova_train.sb3.files import load_replay_arrays, load_replay_buffer, zip_custom_objects

    return {
        "metrics.csv": ("metrics.csv", lambda p: read_series(p, ("step",))),
        "summary.json": ("summary.json", read_summary),
        "evaluation": ("test.json", read_concept_evaluation),
        "controller evaluation": ("evaluation.json", read_policy_evaluation),
        "controller zip": ("controller.zip", zip_custom_objects),
        "replay pickle": ("replay.pkl", lambda p: load_replay_buffer(object(), p)),
        "replay arrays": ("replay.npz", lambda p: load_replay_arrays(SimpleNamespace(replay_buffer=None), p)),
    }


@pytest.mark.parametrize("kind", SPECIAL_FILES)
@pytest.mark.parametrize("reader", list(_readers()))
def test_special_files_are_refused_at_once_naming_the_file(tmp_path: Path, reader: str, kind: str) -> None:
    name, read = _readers()[reader]
    path = special_file(tmp_path / name, kind)
    started = time.monotonic()
    with pytest.raises(ClovaTrainError, match="is not a regular file") as caught:
        read(path)
    assert str(path) in str(caught.value) and time.monotonic() - started < 1


# --------------------------------------------------------------------------- SB3 zips


@pytest.fixture(scope="module")
def controller_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import DQN

    class Tiny(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
        action_space = gym.spaces.Discrete(3)

    path = tmp_path_factory.mktemp("sb3") / "controller.zip"
    DQN("MlpPolicy", Tiny(), buffer_size=100, policy_kwargs={"net_arch": [8]}, device="cpu").save(path)
    return path


def _serialized(value: Any) -> dict[str, str]:
    import cloudpickle

    return {":type:": "x", ":serialized:": base64.b64encode(cloudpickle.dumps(value)).decode()}


def _huge_box() -> Any:
    import gymnasium as gym

    box = gym.spaces.Box(-1, 1, (2,))
    box._shape = (200_000, 200_000)  # what a 37 GiB observation space looks like in a zip: its shape
    return box


def _discrete(n: int) -> Any:
    import gymnasium as gym

    return gym.spaces.Discrete(n)


ZIP_FIELDS = {  # field, value (a callable: pickled), words of the message
    "huge observation space": ("observation_space", _huge_box, "holds 40,000,000,000 values"),
    "replay buffer of 1e11": ("buffer_size", 10**11, "must be an integer from 1 to 100,000,000"),
    "policy class a name": ("policy_class", "NotAPolicy", "must be a DQN policy class"),
    "policy class not a policy": ("policy_class", lambda: set, "must be a DQN policy class"),
    "policy class an instance": ("policy_class", lambda: _discrete(3), "must be a DQN policy class"),
    "a trillion actions": ("action_space", lambda: _discrete(10**12), "must be a Discrete space of 1 to 65,536"),
    "a giant layer": ("policy_kwargs", {"net_arch": [10**9]}, "net_arch must be a list"),
    "a network of 2^32 weights": ("policy_kwargs", {"net_arch": [65536, 65536]}, "weights, more than"),
    "gamma above 1": ("gamma", 5, "must be a number from 0 to 1"),
    "batch size as text": ("batch_size", "32", "must be an integer"),
    "n_envs huge": ("n_envs", 2**40, "must be an integer from 1 to 1,024"),
    "a bool for a count": ("learning_starts", True, "must be an integer"),
    "not base64": ("lr_schedule", {":serialized:": 5}, "cannot be loaded safely"),
}


def _rewritten(source: Path, target: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    with zipfile.ZipFile(source) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    data = json.loads(entries["data"])
    change(data)
    entries["data"] = json.dumps(data).encode()
    with zipfile.ZipFile(target, "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    return target


@pytest.mark.parametrize("case", list(ZIP_FIELDS))
def test_a_zip_field_beyond_a_real_controller_is_named(controller_zip: Path, tmp_path: Path, case: str) -> None:
    from clova_train.sb3.files import zip_custom_objects

    key, value, words = ZIP_FIELDS[case]
    stored = _serialized(value()) if callable(value) else value
    path = _rewritten(controller_zip, tmp_path / "controller.zip", lambda data: data.update({key: stored}))
    with pytest.raises(ClovaTrainError) as caught:
        zip_custom_objects(path)
    assert str(path) in str(caught.value) and repr(key) in str(caught.value) and words in str(caught.value), caught.value


def test_a_zip_whose_replay_buffer_needs_more_than_the_memory_is_refused(controller_zip: Path, tmp_path: Path) -> None:
    import gymnasium as gym

    from clova_train.sb3.files import zip_custom_objects

    space = _serialized(gym.spaces.Box(-1, 1, (1536,)))  # HYDRA's observation, 10^8 transitions: 1.2 TB
    path = _rewritten(controller_zip, tmp_path / "big.zip",
                      lambda data: data.update(buffer_size=100_000_000, observation_space=space))
    with pytest.raises(ClovaTrainError, match="'buffer_size' = 100000000: needs 1,144.4 GiB for the replay buffer"):
        zip_custom_objects(path)


def test_a_zip_whose_data_entry_is_inflated_or_not_finite_is_refused(controller_zip: Path, tmp_path: Path) -> None:
    from clova_train.sb3.files import zip_custom_objects

    path = _rewritten(controller_zip, tmp_path / "nan.zip", lambda data: data.update(tau=float("nan")))
    with pytest.raises(ClovaTrainError, match="tau = nan: must be a finite number"):
        zip_custom_objects(path)
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data", b" " * (65 << 20))  # 65 MiB of spaces, 65 kB packed
    with pytest.raises(ClovaTrainError, match="more than the 67,108,864 accepted"):
        zip_custom_objects(bomb)


def test_the_checked_zip_still_loads(controller_zip: Path) -> None:
    from stable_baselines3 import DQN

    from clova_train.sb3.files import zip_custom_objects

    model = DQN.load(controller_zip, custom_objects=zip_custom_objects(controller_zip), device="cpu")
    assert model.observation_space.shape == (4,) and model.replay_buffer.buffer_size == 100


def test_replay_arrays_are_sized_from_their_headers_before_numpy_allocates(tmp_path: Path) -> None:
    import numpy as np

    from clova_train.sb3.files import load_replay_arrays

    path = tmp_path / "replay.npz"
    np.savez(path, observations=np.zeros((2, 1, 4), np.float32), pos=1, full=False, buffer_size=10, n_envs=1)
    with zipfile.ZipFile(path) as archive:  # the header claims 10^11 rows, the data is 32 bytes
        entries = {name: archive.read(name) for name in archive.namelist()}
    entries["observations.npy"] = entries["observations.npy"].replace(b"(2, 1, 4)", b"(100000000000, 1, 4)")
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    model = SimpleNamespace(replay_buffer=SimpleNamespace(observations=np.zeros((10, 1, 4), np.float32),
                                                          buffer_size=10, n_envs=1))
    with pytest.raises(ClovaTrainError, match=r"observations has shape \(100000000000, 1, 4\), more than the run's"):
        load_replay_arrays(model, path)


# --------------------------------------------------------------------------- the report's files


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_metrics_logs_beyond_a_real_log_are_refused(tmp_path: Path) -> None:
    from clova_train.report.runs import MAX_LOG_COLUMNS, read_series

    wide = _csv(tmp_path / "wide.csv", ",".join(f"c{i}" for i in range(MAX_LOG_COLUMNS + 1)) + "\n")
    with pytest.raises(DataError, match="columns, more than the 10,000"):
        read_series(wide, ("step",))
    cell = _csv(tmp_path / "cell.csv", "step,loss\n1," + "9" * 200_000 + "\n")
    with pytest.raises(DataError, match="cell.csv"):
        read_series(cell, ("step",))
    fine = _csv(tmp_path / "fine.csv", "step,loss\n1,0.5\n2,nan\n3," + "9" * 5000 + "\n")
    assert read_series(fine, ("step",))["loss"].y == [0.5]


def test_a_dense_or_sparse_log_within_the_bytes_is_bounded_in_numbers_and_cells(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within 512 MiB, 10,000 columns and 10 million rows, a dense log of numbers filled more than 6 GB (a 500 MB log
    of 1,000 columns: MemoryError in ``report``) and a sparse one of 10,000 mostly empty columns took minutes (50 MB:
    39 s): the numbers kept and the cells read are bounded too (here at small limits; 500 MB: 4 s and 2 s)."""
    from clova_train.report import runs

    monkeypatch.setattr(runs, "MAX_LOG_VALUES", 1000)
    monkeypatch.setattr(runs, "MAX_LOG_CELLS", 10_000)
    dense = _csv(tmp_path / "dense.csv", "step," + ",".join(f"c{i}" for i in range(100)) + "\n"
                 + ("1," + ",".join(["0.5"] * 100) + "\n") * 20)
    with pytest.raises(DataError, match="dense.csv holds more than 1,000 numbers"):
        runs.read_series(dense, ("step",))
    sparse = _csv(tmp_path / "sparse.csv", "step," + ",".join(f"c{i}" for i in range(999)) + "\n"
                  + ("1" + "," * 999 + "\n") * 20)
    with pytest.raises(DataError, match="sparse.csv has more than .* 10,000 cells"):
        runs.read_series(sparse, ("step",))
    repeated = _csv(tmp_path / "repeated.csv", "step,a,a,\n1,2,3,4,5\n\n2,,6\n")  # the last 'a' counts, as before
    assert {name: (s.x, s.y) for name, s in runs.read_series(repeated, ("step",)).items()} == {"a": ([1.0, 2.0], [3.0, 6.0])}


SUMMARIES = {  # an instance record, the field named
    "NaN curve": ({"accepted": True, "loss_curve": [1.0, float("nan")]}, "instances[0].loss_curve[1] = nan"),
    "infinite curve": ({"accepted": True, "loss_curve": [float("inf")]}, "instances[0].loss_curve[0] = inf"),
    "curve of text": ({"accepted": True, "loss_curve": "abc"}, "instances[0].loss_curve must be a list"),
    "accepted as text": ({"accepted": "yes"}, "instances[0].accepted must be true or false"),
    "concept an object": ({"accepted": True, "concept": {"a": 1}}, "instances[0].concept must be a name"),
    "steps 1e30": ({"accepted": True, "steps": 10**30}, "instances[0].steps = 1000000000000000000000000000000"),
    "rejections of numbers": ({"accepted": False, "rejections": [1]}, "instances[0].rejections must be a list"),
    "record a list": ([1, 2], "instances[0] must be an object"),
}


@pytest.mark.parametrize("case", list(SUMMARIES))
def test_a_summary_field_of_the_wrong_type_or_not_finite_is_named(tmp_path: Path, case: str) -> None:
    from clova_train.report.runs import read_summary

    record, words = SUMMARIES[case]
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"instances": [record]}))
    with pytest.raises(DataError) as caught:
        read_summary(path)
    assert str(path) in str(caught.value) and words in str(caught.value), caught.value


def test_a_summary_of_more_numbers_than_a_real_one_is_refused_before_it_is_walked(tmp_path: Path) -> None:
    """A 128 MB summary of one 64-million-number curve (within the bytes) stacked every number before counting it:
    over 120 s and gigabytes in ``report``; a list longer than the values left is now refused at once (about 4 s)."""
    from clova_train.core.safe_files import ReadLimits, check_values
    from clova_train.report.runs import SUMMARY_LIMITS

    assert SUMMARY_LIMITS.max_values <= 10_000_000 and SUMMARY_LIMITS.max_bytes <= 128 << 20  # 60,000 x 100 steps fit
    started = time.monotonic()
    with pytest.raises(DataError, match="holds more than 1,000 values"):
        check_values({"instances": [{"loss_curve": [0.5] * 5_000_000}]}, "summary", ReadLimits(max_values=1000))
    assert time.monotonic() - started < 0.5


def test_evaluations_with_infinite_or_mistyped_numbers_are_named(tmp_path: Path) -> None:
    from clova_train.report.runs import read_concept_evaluation, read_policy_evaluation

    path = tmp_path / "test.json"
    path.write_text(json.dumps({"per_concept": [{"concept": "a", "pool": {"mean": "high", "ci95": [0, 1]}}]}))
    with pytest.raises(DataError, match=r"per_concept\[0\].pool.mean = high"):
        read_concept_evaluation(path)
    path.write_text('{"trained controller": {"accuracy": Infinity}}')
    with pytest.raises(DataError, match="trained controller.accuracy = inf"):
        read_policy_evaluation(path)


def test_the_gate_picture_of_many_concepts_is_linear(tmp_path: Path) -> None:
    from clova_train.report import figures

    instances = [{"concept": f"c{i}", "accepted": i % 2 == 0, "steps": 3, "rejections": []} for i in range(20_000)]
    instances += [{"concept": "c7", "accepted": True, "steps": 3}] * 5
    started = time.monotonic()
    table = figures.gate_acceptance(instances, tmp_path / "gate.png")
    assert time.monotonic() - started < 10  # it was quadratic: 100,000 concepts took over 300 s
    assert table.count("\n") == 20_000 + 1 and "| c7 | 6 | 5 | 0.833 |" in table


REPORT_FILES = {"metrics.csv": Path("logs") / "version_0" / "metrics.csv", "summary.json": Path("summary.json")}


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
@pytest.mark.parametrize("name", list(REPORT_FILES))
def test_the_report_command_names_a_special_file_and_exits_2_contained(tmp_path: Path, name: str, kind: str) -> None:
    """``clova-train report`` as the user runs it, in a child under time and memory limits: a FIFO (which would
    block) or a link to /dev/zero (which would fill the memory) is one error naming the file, never a hang."""
    from clova_train.core.run_manifest import write_run_manifest
    from helpers.contained import assert_one_clean_error, run_cli

    run = tmp_path / "run"
    write_run_manifest(run, "lora")
    (run / REPORT_FILES[name]).parent.mkdir(parents=True, exist_ok=True)
    special_file(run / REPORT_FILES[name], kind)
    outcome = run_cli(["report", str(run)], timeout_s=8, cpu_s=8)
    assert_one_clean_error(outcome, name)


def _hostile_case(argv: list[str]) -> int:
    """What a case that escapes its reader's bounds does in the contained child (the runner's own check)."""
    if argv == ["hang"]:
        while True:
            pass
    if argv == ["abort"]:
        os.abort()
    bytearray(64 << 30)  # "memory": far beyond the child's address-space limit
    return 0


@pytest.mark.parametrize(("case", "killed"), [("hang", "timeout"), ("abort", "signal 6"), ("memory", "memory")])
def test_the_contained_runner_reports_a_hang_an_abort_and_memory_exhaustion(case: str, killed: str) -> None:
    from helpers.contained import run_cli

    outcome = run_cli([case], timeout_s=3, cpu_s=1, entry=_hostile_case)
    assert outcome.killed == killed, outcome
    assert outcome.seconds < 6, outcome


# --------------------------------------------------------------------------- world files and pool metadata


WORLDS = {  # file name, content, words
    "a rank of 1e30": ("w.yaml", "planner: {good_rank: {count: 1000000000000000000000000000000}}\n",
                       "planner.good_rank.count = 10000000000000000000... (31 digits)"),
    "a rank of -1e30": ("w.json", '{"planner": {"good_rank": {"count": -1000000000000000000000000000000}}}',
                        "planner.good_rank.count = -1000000000000000000..."),
    "a rank of 5000": ("w.yaml", "planner: {good_rank: {colour: 5000}}\n", "must be an integer rank (-1000 to 999)"),
    "a reward of 1e400": ("w.json", '{"rewards": {"r1": 1e400}}', "rewards.r1 = inf: must be a finite number"),
    "a reward as an integer of 400 digits": ("w.yaml", "rewards: {alpha: 1" + "0" * 400 + "}\n",
                                             "rewards.alpha = 10000000000000000000... (401 digits)"),
    "a reward of 1e9": ("w.yaml", "rewards: {r1: 1000000000}\n", "rewards.r1 = 1000000000: must be a number from"),
    "a .nan probability": ("w.yaml", "planner: {malformed: .nan}\n", "planner.malformed = nan"),
    "a long name": ("w.yaml", "name: " + "x" * 5000 + "\n", "name is a text of 5,000 characters"),
    "a 2 MB file": ("w.yaml", "name: " + "x" * (2 << 20) + "\n", "more than the 1,048,576 accepted"),
    "20,000 values": ("w.json", '{"planner": {"has_good": [' + ",".join(["0.5"] * 20_000) + "]}}",
                      "holds more than 10,000 values"),
}


@pytest.mark.parametrize("case", list(WORLDS))
def test_a_world_file_beyond_a_real_world_is_named(tmp_path: Path, case: str) -> None:
    from clova_train.envs.hydra.reasoning_world import load_world

    name, content, words = WORLDS[case]
    path = tmp_path / name
    path.write_text(content)
    started = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_world(str(path))
    assert str(path) in str(caught.value) and words in str(caught.value), caught.value
    assert time.monotonic() - started < 1


def test_a_seeking_world_name_is_bounded_too(tmp_path: Path) -> None:
    from clova_train.envs.avis.seeking_world import load_seeking_world

    path = tmp_path / "w.yaml"
    path.write_text("name: " + "x" * 300 + "\n")
    with pytest.raises(DataError, match="name = 'xxxx.*: must be one line of printable text of at most 200"):
        load_seeking_world(str(path))


def test_pool_metadata_larger_than_a_real_pool_is_refused(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from clova_train.core.pool import PromptPool

    meta = {"format_version": 1, "tool": "clip", "model_identity": "x" * (17 << 20), "prompt_shape": [1, 2],
            "feature_dim": 2, "concepts": []}
    path = tmp_path / "pool.safetensors"
    save_file({"a": torch.zeros(1)}, str(path), metadata={"clova_train.pool": json.dumps(meta)})
    with pytest.raises(PoolError, match="more than the 16,777,216 accepted"):
        PromptPool.load(path)
    meta["model_identity"] = "x" * 5000
    save_file({"a": torch.zeros(1)}, str(path), metadata={"clova_train.pool": json.dumps(meta)})
    with pytest.raises(PoolError, match="model_identity is a text of 5,000 characters"):
        PromptPool.load(path)


# --------------------------------------------------------------------------- every category as the user runs it


def _zip_with(field: str, value: Any) -> Callable[[Path, Path], list[str]]:
    """A case: the controller zip with ``field`` replaced, named by ``--checkpoint``."""
    def case(controller: Path, root: Path) -> list[str]:
        stored = _serialized(value()) if callable(value) else value
        return [str(_rewritten(controller, root / "controller.zip", lambda data: data.update({field: stored})))]

    return case


def _evaluate_zip(field: str, value: Any) -> Callable[[Path, Path], list[str]]:
    def case(controller: Path, root: Path) -> list[str]:
        return ["controller", "evaluate", "--checkpoint", *_zip_with(field, value)(controller, root),
                f"--train.output_dir={root / 'run'}"]

    return case


def _export_zip(field: str, value: Any) -> Callable[[Path, Path], list[str]]:
    def case(controller: Path, root: Path) -> list[str]:
        return ["controller", "export", "--checkpoint", *_zip_with(field, value)(controller, root),
                f"--train.output_dir={root / 'run'}", f"--output={root / 'export'}"]

    return case


def _report_on(kind: str, relative: str, content: str) -> Callable[[Path, Path], list[str]]:
    """A case: ``clova-train report`` on a ``kind`` run whose file ``relative`` holds ``content``."""
    def case(_: Path, root: Path) -> list[str]:
        from clova_train.core.run_manifest import write_run_manifest

        run = root / "run"
        write_run_manifest(run, kind)
        (run / relative).parent.mkdir(parents=True, exist_ok=True)
        (run / relative).write_text(content)
        return ["report", str(run)]

    return case


def _fit_on_world(environment: str, name: str, content: str) -> Callable[[Path, Path], list[str]]:
    """A case: ``clova-train controller fit --config`` whose ``environment`` section names the world file ``name``
    holding ``content``."""
    def case(_: Path, root: Path) -> list[str]:
        world = root / name
        world.write_text(content)
        config = root / "controller.yaml"
        config.write_text(json.dumps({"environment": environment, environment: {"world": str(world)},
                                      "train": {"output_dir": str(root / "run")}}))
        return ["controller", "fit", "--config", str(config)]

    return case


def _export_pool_run(_: Path, root: Path) -> list[str]:
    """A case: ``clova-train export`` of a prompt-tuning run whose pool's metadata is 50 MB."""
    import torch
    from safetensors.torch import save_file

    run = root / "run"
    run.mkdir()
    tool = {"tool": "clip", "identity": "x", "prompt_shape": [1, 2], "feature_dim": 2}
    (run / "tool.json").write_text(json.dumps(tool))
    meta = {"format_version": 1, "tool": "clip", "model_identity": "x" * (50 << 20), "prompt_shape": [1, 2],
            "feature_dim": 2, "concepts": []}
    save_file({"a": torch.zeros(1)}, str(run / "pool.safetensors"), metadata={"clova_train.pool": json.dumps(meta)})
    return ["export", str(run), "--output", str(root / "export")]


WIDE_LOG = ",".join(f"c{i}" for i in range(10_001)) + "\n"
CONTAINED = {  # case: (what writes the hostile file and gives the command, the words of its one error)
    "zip: a 37 GiB observation space, controller evaluate": (
        _evaluate_zip("observation_space", _huge_box), ("controller.zip", "holds 40,000,000,000 values")),
    "zip: a replay buffer of 10^11, controller evaluate": (
        _evaluate_zip("buffer_size", 10**11), ("controller.zip", "'buffer_size'", "must be an integer from 1 to")),
    "zip: a policy class that is no class, controller export": (
        _export_zip("policy_class", lambda: set), ("controller.zip", "'policy_class'", "must be a DQN policy class")),
    "metrics log of 10,001 columns, report": (
        _report_on("lora", "logs/version_0/metrics.csv", WIDE_LOG), ("metrics.csv", "more than the 10,000")),
    "controller log of 10,001 columns, report": (
        _report_on("controller", "logs/progress.csv", WIDE_LOG), ("progress.csv", "more than the 10,000")),
    "summary with a NaN curve, report": (
        _report_on("prompt_tuning", "summary.json",
                   '{"instances": [{"accepted": true, "loss_curve": [1.0, NaN]}]}'),
        ("summary.json", "instances[0].loss_curve[1] = nan")),
    "concept evaluation of text, report": (
        _report_on("prompt_tuning", "evaluation/test.json",
                   json.dumps({"per_concept": [{"concept": "a", "pool": {"mean": "high", "ci95": [0, 1]}}]})),
        ("test.json", "per_concept[0].pool.mean = high")),
    "controller evaluation of Infinity, report": (
        _report_on("controller", "evaluation.json", '{"trained controller": {"accuracy": Infinity}}'),
        ("evaluation.json", "trained controller.accuracy = inf")),
    "world: a reward of 1e400, controller fit": (
        _fit_on_world("hydra", "world.json", '{"rewards": {"r1": 1e400}}'), ("world.json", "rewards.r1 = inf: must be a finite number")),
    "seeking world: a name of 300 characters, controller fit": (
        _fit_on_world("avis", "world.yaml", "name: " + "x" * 300 + "\n"),
        ("world.yaml", "must be one line of printable text of at most 200")),
    "pool metadata of 50 MB, export": (_export_pool_run, ("pool.safetensors", "more than the 16,777,216 accepted")),
}


@pytest.mark.parametrize("case", list(CONTAINED))
def test_each_hostile_file_is_one_error_of_the_users_command_contained(controller_zip: Path, tmp_path: Path,
                                                                        case: str) -> None:
    """The hostile file where the user's command reads it, and that command (``clova-train ...``) in a child under a
    time and memory bound: one error line naming the file and the field, exit 1 or 2, no traceback; a case that
    escaped its reader's bound would be killed (a hang, gigabytes, an abort), not hang or crash the worker."""
    from helpers.contained import assert_one_clean_error, run_cli

    write, words = CONTAINED[case]
    argv = write(controller_zip, tmp_path)
    started = time.monotonic()
    outcome = run_cli(argv, timeout_s=20, memory_mb=6144, cpu_s=20)
    assert_one_clean_error(outcome, *words)
    print(f"{case}: {time.monotonic() - started:.2f} s")


LORA_CASES = [  # one command per kind of LoRA case (every case with both: tests/tool_llm/test_hostile_lora_cli.py)
    ("a template that loops", "export"), ("a 100 MB template", "serve"), ("a tokenizer regex that panics", "serve"),
    ("10^6 replicated layers", "export"),
]


@pytest.fixture(scope="module")
def tiny_lora_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.hostile_lora_export import write_tiny_lora_export

    return write_tiny_lora_export(tmp_path_factory.mktemp("lora") / "export")


@pytest.mark.parametrize(("case", "command"), LORA_CASES)
def test_a_lora_runs_hostile_file_is_one_error_of_export_or_serve_contained(tiny_lora_export: Path, tmp_path: Path,
                                                                            case: str, command: str) -> None:
    """A LoRA run's (or export's) hostile template, tokenizer or adapter config, through ``clova-train export`` or
    ``serve`` in a bounded child: a loop is stopped by the template probe's bound, a 100 MB template (an abort in
    tokenizers) and a panicking regex never reach the server process, 10^6 layers are refused before PEFT."""
    from helpers.contained import assert_one_clean_error
    from helpers.hostile_lora_export import run_hostile_case

    outcome, words = run_hostile_case(tiny_lora_export, tmp_path, case, command)
    assert_one_clean_error(outcome, *words)
