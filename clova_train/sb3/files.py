"""Reading stable-baselines3 files (model zips, replay buffers) without running code from them.

An SB3 zip's ``data`` entry is JSON, but the fields JSON cannot hold (observation and action spaces, schedules,
the policy and buffer classes, numpy arrays, random generators, ``train_freq``) are cloudpickled inside it, and
``BaseAlgorithm.load`` unpickles them: a zip from someone else could run any code on load. A replay buffer is a
plain pickle. Here both are unpickled by :class:`~clova_train.core.safe_pickle.AllowlistUnpickler`, which
resolves only the classes and functions such fields legitimately name (:data:`ALLOWED_GLOBALS`); the zip's fields then reach SB3 as
``custom_objects``, so SB3 unpickles nothing itself. The weights (``policy.pth``, ``pytorch_variables.pth``)
SB3 already reads with ``torch.load(weights_only=True)``. A file that names anything else is refused with one
message naming the file, the field and what it asked for.

Before SB3 sees a zip, every field that sizes what it builds is checked against what a real controller holds
(:func:`check_zip_fields`): the spaces (at most :data:`MAX_OBSERVATION_VALUES` observation values and
:data:`MAX_ACTIONS` actions), the replay buffer's size (at most :data:`MAX_REPLAY_TRANSITIONS`, and no more memory
than the machine has: SB3 allocates it on load), the network's widths, the classes (a policy class must be a DQN
policy), and every count, rate and probability. Only regular files are read (a FIFO or a device is refused at once),
and sizes are checked before reading.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from clova_train.core.errors import ClovaTrainError, DataError, UnsafeFileError
from clova_train.core.safe_pickle import AllowlistUnpickler, restricted_loads
from clova_train.core.safe_files import ReadLimits, parse_json, printable, reading

MAX_ZIP_BYTES = 4 << 30  # a controller zip: weights of at most MAX_NETWORK_PARAMETERS twice (policy, optimizer)
MAX_ZIP_ENTRY_BYTES = 2 << 30
DATA_LIMITS = ReadLimits(max_bytes=64 << 20, max_depth=16, max_values=1_000_000, max_text=32 << 20, finite_only=True)
MAX_REPLAY_FILE_BYTES = 1 << 40
MAX_OBSERVATION_VALUES = 1 << 20  # HYDRA's observation is 1,536 values
MAX_ACTIONS = 1 << 16
MAX_REPLAY_TRANSITIONS = 100_000_000  # SB3's default is 1e6
MAX_ENVS = 1024
MAX_LAYERS = 64
MAX_LAYER_WIDTH = 1 << 16
MAX_NETWORK_PARAMETERS = 1 << 28  # 1 GiB of float32 weights
MAX_COUNT = 1 << 62  # timesteps, calls, updates
# field -> (lowest, highest) for the integers SB3 sizes or counts with
INTEGER_FIELDS = {
    "n_envs": (1, MAX_ENVS), "buffer_size": (1, MAX_REPLAY_TRANSITIONS), "batch_size": (1, 1 << 24),
    "learning_starts": (0, MAX_COUNT), "gradient_steps": (-1, 1 << 20), "target_update_interval": (1, MAX_COUNT),
    "num_timesteps": (0, MAX_COUNT), "_total_timesteps": (0, MAX_COUNT), "_num_timesteps_at_start": (0, MAX_COUNT),
    "_episode_num": (0, MAX_COUNT), "_n_updates": (0, MAX_COUNT), "_n_calls": (0, MAX_COUNT), "n_steps": (1, 1 << 20),
    "_stats_window_size": (1, 1 << 20), "sde_sample_freq": (-1, 1 << 20), "verbose": (0, 2),
    "mask_size": (0, MAX_ACTIONS), "num_samples": (0, MAX_ACTIONS), "exploration_decay_every": (0, MAX_COUNT),
}
UNIT_FIELDS = ("gamma", "tau", "exploration_initial_eps", "exploration_final_eps", "exploration_fraction",
               "exploration_rate", "_current_progress_remaining", "exploration_decay")
NON_NEGATIVE_FIELDS = {"learning_rate": 1e6, "max_grad_norm": 1e12, "start_time": float(2**63)}  # field -> highest


# (module, name) pairs a legitimate SB3 DQN zip or replay buffer refers to (numpy under its 1.x and 2.x names).
ALLOWED_GLOBALS = frozenset({
    ("builtins", "object"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("copyreg", "_reconstructor"),
    ("collections", "deque"), ("collections", "OrderedDict"),
    *((core, name) for core in ("numpy.core.multiarray", "numpy._core.multiarray") for name in ("_reconstruct", "scalar")),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.random._pickle", "__generator_ctor"), ("numpy.random._pickle", "__bit_generator_ctor"),
    ("numpy.random._pickle", "__randomstate_ctor"),
    ("numpy.random._pcg64", "PCG64"), ("numpy.random._pcg64", "PCG64DXSM"), ("numpy.random._mt19937", "MT19937"),
    ("numpy.random.bit_generator", "SeedSequence"), ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
    ("torch", "device"),
    ("gymnasium.spaces.box", "Box"), ("gymnasium.spaces.discrete", "Discrete"),
    ("gymnasium.spaces.multi_discrete", "MultiDiscrete"), ("gymnasium.spaces.multi_binary", "MultiBinary"),
    ("stable_baselines3.common.utils", "ConstantSchedule"), ("stable_baselines3.common.utils", "FloatSchedule"),
    ("stable_baselines3.common.utils", "LinearSchedule"),
    ("stable_baselines3.common.type_aliases", "TrainFreq"),
    ("stable_baselines3.common.type_aliases", "TrainFrequencyUnit"),
    ("stable_baselines3.common.buffers", "ReplayBuffer"),
    ("stable_baselines3.dqn.policies", "DQNPolicy"), ("stable_baselines3.dqn.policies", "QNetwork"),
    ("clova_train.controller.per_sample_policy", "PerSampleDQNPolicy"),  # dqn.q_network: per_sample
})


def zip_custom_objects(path: str | Path) -> dict[str, Any]:
    """Every cloudpickled field of the SB3 zip at ``path``, unpickled through the allowlist and checked with
    :func:`check_zip_fields`: pass it to ``load(..., custom_objects=...)`` and SB3 unpickles nothing.

    Raises:
        UnsafeFileError: a field names a class or function outside the allowlist, or is not a pickle.
        ClovaTrainError: ``path`` is not an SB3 zip, is not a regular file, or a field is out of bounds.
    """
    path = Path(path)
    where = printable(path)
    try:
        with reading(path, "controller zip") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_ZIP_BYTES:
                raise DataError(f"controller zip {where} is {size:,} bytes, more than the {MAX_ZIP_BYTES:,} accepted")
            with zipfile.ZipFile(handle) as archive:
                for entry in archive.infolist():
                    if entry.file_size > MAX_ZIP_ENTRY_BYTES:
                        raise DataError(f"controller zip {where}: entry {entry.filename[:100]!r} unpacks to "
                                        f"{entry.file_size:,} bytes, more than the {MAX_ZIP_ENTRY_BYTES:,} accepted")
                with archive.open("data") as entry:
                    raw = entry.read(DATA_LIMITS.max_bytes + 1)
            data = parse_json(raw, f"the 'data' entry of {where}", DATA_LIMITS)
    except (OSError, KeyError, zipfile.BadZipFile, ValueError, EOFError) as err:
        raise ClovaTrainError(f"{where} is not a stable-baselines3 zip: {err}") from None
    if not isinstance(data, dict):
        raise ClovaTrainError(f"{where} is not a stable-baselines3 zip: its 'data' is not a JSON object")
    objects = {}
    for key, value in data.items():
        if not (isinstance(value, dict) and ":serialized:" in value):
            continue
        try:
            serialized = value[":serialized:"]
            if not isinstance(serialized, str):
                raise ValueError("the field is not base64 text")
            objects[key] = restricted_loads(base64.b64decode(serialized, validate=True), ALLOWED_GLOBALS)
        except (pickle.UnpicklingError, binascii.Error, ValueError, TypeError, EOFError, AttributeError,
                IndexError, KeyError, MemoryError, RecursionError) as err:
            raise UnsafeFileError(f"{where}: field {key!r} cannot be loaded safely ({str(err)[:200]}); a controller "
                                  "zip holds spaces, schedules, SB3 classes and arrays only") from None
    check_zip_fields({**data, **objects}, where)
    return objects


def _bad(where: str, key: str, value: Any, rule: str) -> ClovaTrainError:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"an integer of {value.bit_length()} bits"
    return ClovaTrainError(f"controller zip {where}: field {key!r} = {text[:80]}: {rule}")


def _space_values(space: Any) -> int:
    return math.prod(int(n) for n in space.shape) if space.shape else 1


def check_zip_fields(fields: dict[str, Any], where: str) -> None:
    """Refuse a zip whose fields (``data`` with its pickled ones unpickled) ask SB3 to build more than a real
    controller holds, or name a class that is not what the field takes; one :class:`ClovaTrainError` naming the
    file and the field."""
    import numpy as np
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer
    from stable_baselines3.dqn.policies import DQNPolicy

    for key in ("policy_class", "observation_space", "action_space"):
        if key not in fields:
            raise ClovaTrainError(f"controller zip {where} has no field {key!r}: it is not a DQN controller")
    policy = fields["policy_class"]
    if not (isinstance(policy, type) and issubclass(policy, DQNPolicy)):
        raise _bad(where, "policy_class", policy, "must be a DQN policy class")
    buffer_class = fields.get("replay_buffer_class")
    if buffer_class is not None and not (isinstance(buffer_class, type) and issubclass(buffer_class, ReplayBuffer)):
        raise _bad(where, "replay_buffer_class", buffer_class, "must be a replay buffer class")
    observation = fields["observation_space"]
    if not isinstance(observation, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)) \
            or not all(isinstance(n, (int, np.integer)) and n >= 0 for n in (observation.shape or ())):
        raise _bad(where, "observation_space", observation, "must be a Box, Discrete, MultiDiscrete or MultiBinary space")
    if _space_values(observation) > MAX_OBSERVATION_VALUES:
        raise _bad(where, "observation_space", observation,
                   f"holds {_space_values(observation):,} values, more than the {MAX_OBSERVATION_VALUES:,} accepted")
    action = fields["action_space"]
    if not isinstance(action, spaces.Discrete) or not 1 <= int(action.n) <= MAX_ACTIONS \
            or abs(int(action.start)) > MAX_COUNT:
        raise _bad(where, "action_space", action, f"must be a Discrete space of 1 to {MAX_ACTIONS:,} actions")
    for key, (low, high) in INTEGER_FIELDS.items():
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise _bad(where, key, value, f"must be an integer from {low:,} to {high:,}")
    for key in (*UNIT_FIELDS, *NON_NEGATIVE_FIELDS):
        value = fields.get(key)
        high = NON_NEGATIVE_FIELDS.get(key, 1)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not 0 <= value <= high):
            raise _bad(where, key, value, f"must be a number from 0 to {high:g}")
    _check_network(fields.get("policy_kwargs"), _space_values(observation), int(action.n), where)
    _check_replay_memory(fields, observation, where)
    train_freq = fields.get("train_freq")
    frequency = getattr(train_freq, "frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, int) or not 1 <= frequency <= MAX_COUNT:
        raise _bad(where, "train_freq", train_freq, "must be a positive train frequency")


def _check_network(policy_kwargs: Any, inputs: int, outputs: int, where: str) -> None:
    """``policy_kwargs.net_arch``: at most :data:`MAX_LAYERS` widths of at most :data:`MAX_LAYER_WIDTH`, and a Q-network
    of at most :data:`MAX_NETWORK_PARAMETERS` weights."""
    if policy_kwargs is None:
        return
    if not isinstance(policy_kwargs, dict):
        raise _bad(where, "policy_kwargs", policy_kwargs, "must be a mapping")
    widths = policy_kwargs.get("net_arch", [64, 64])
    if not isinstance(widths, list) or len(widths) > MAX_LAYERS or not all(
            isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_LAYER_WIDTH for w in widths):
        raise _bad(where, "policy_kwargs", policy_kwargs,
                   f"net_arch must be a list of at most {MAX_LAYERS} layer widths from 1 to {MAX_LAYER_WIDTH:,}")
    sizes = [inputs, *widths, outputs]
    parameters = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    if parameters > MAX_NETWORK_PARAMETERS:
        raise _bad(where, "policy_kwargs", policy_kwargs, f"makes a Q-network of {parameters:,} weights, more than the "
                   f"{MAX_NETWORK_PARAMETERS:,} accepted")


def _check_replay_memory(fields: dict[str, Any], observation: Any, where: str) -> None:
    """SB3 allocates the replay buffer when it loads a zip: refuse one larger than this machine's memory."""
    import numpy as np

    buffer_size, n_envs = fields.get("buffer_size", 1_000_000), fields.get("n_envs", 1)
    rows = max(buffer_size // n_envs, 1) * n_envs
    copies = 1 if fields.get("optimize_memory_usage") else 2
    needed = rows * _space_values(observation) * np.dtype(observation.dtype or np.float32).itemsize * copies
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if needed > memory:
        raise _bad(where, "buffer_size", buffer_size, f"needs {needed / 2**30:,.1f} GiB for the replay buffer's "
                   f"observations, more than this machine's {memory / 2**30:,.1f} GiB of memory")


def load_replay_buffer(model: Any, path: str | Path) -> None:
    """Give the off-policy ``model`` the replay buffer pickled at ``path`` (what ``save_replay_buffer`` wrote),
    unpickled through the allowlist instead of SB3's plain ``pickle.load``."""
    from stable_baselines3.common.buffers import ReplayBuffer

    path = Path(path)
    try:
        with reading(path, "replay buffer") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_REPLAY_FILE_BYTES:
                raise DataError(f"replay buffer {printable(path)} is {size:,} bytes, more than the "
                                f"{MAX_REPLAY_FILE_BYTES:,} accepted")
            buffer = AllowlistUnpickler(handle, ALLOWED_GLOBALS).load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError) as err:
        raise UnsafeFileError(f"replay buffer {path} cannot be loaded safely ({str(err)[:200]}); it must hold an SB3 "
                              "ReplayBuffer of arrays only") from None
    if not isinstance(buffer, ReplayBuffer):
        raise ClovaTrainError(f"replay buffer {path} holds a {type(buffer).__name__}, not an SB3 ReplayBuffer")
    _check_buffer_sizes(buffer, path)
    filled = buffer.buffer_size if buffer.full else buffer.pos
    for name in REPLAY_ARRAYS:
        if getattr(buffer, name, None) is not None:
            check_finite_transitions(getattr(buffer, name), name, path, rows=filled)
    model.replay_buffer = buffer


REPLAY_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


def _check_buffer_sizes(buffer: Any, path: Path) -> None:
    """A pickled buffer's sizes agree with its arrays (``buffer_size`` x ``n_envs`` rows, ``pos`` within them)."""
    import numpy as np

    def integer(name: str, low: int, high: int) -> int:
        value = getattr(buffer, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
            raise DataError(f"replay buffer {path}: {name} = {str(value)[:40]}: must be an integer from {low} to {high:,}")
        return int(value)

    size, n_envs = integer("buffer_size", 1, MAX_REPLAY_TRANSITIONS), integer("n_envs", 1, MAX_ENVS)
    integer("pos", 0, size)
    if not isinstance(getattr(buffer, "full", None), bool):
        raise DataError(f"replay buffer {path}: full must be true or false")
    for name in REPLAY_ARRAYS:
        values = getattr(buffer, name, None)
        if values is not None and (not isinstance(values, np.ndarray) or values.shape[:2] != (size, n_envs)):
            raise DataError(f"replay buffer {path}: {name} has shape {getattr(values, 'shape', None)}, its buffer_size "
                            f"x n_envs is {size} x {n_envs}")


def save_replay_arrays(model: Any, handle: Any) -> None:
    """Write the filled part of ``model``'s replay buffer to the open binary file ``handle`` as an ``.npz`` of plain
    arrays (no pickle): ``buffer_size x n_envs`` rows preallocated by SB3 are not written while still empty."""
    import numpy as np

    buffer = model.replay_buffer
    filled = buffer.buffer_size if buffer.full else buffer.pos
    arrays = {name: getattr(buffer, name)[:filled] for name in REPLAY_ARRAYS
              if getattr(buffer, name, None) is not None and not (name == "next_observations"
                                                                  and buffer.optimize_memory_usage)}
    np.savez(handle, pos=np.int64(buffer.pos), full=np.bool_(buffer.full), buffer_size=np.int64(buffer.buffer_size),
             n_envs=np.int64(buffer.n_envs), **arrays)


def load_replay_arrays(model: Any, path: str | Path) -> None:
    """Fill ``model``'s (freshly built) replay buffer from an ``.npz`` written by :func:`save_replay_arrays`; the file's
    arrays are read without pickle and checked against the buffer's sizes, with one message naming the file."""
    import numpy as np

    path, buffer = Path(path), model.replay_buffer
    try:
        with reading(path, "replay buffer") as handle, np.load(handle, allow_pickle=False) as saved:
            _check_npz_headers(saved, buffer, path)
            sizes = (int(saved["buffer_size"]), int(saved["n_envs"]))
            if sizes != (buffer.buffer_size, buffer.n_envs):
                raise ClovaTrainError(f"replay buffer {path} holds {sizes[0]} x {sizes[1]} transitions, the run's buffer "
                                      f"{buffer.buffer_size} x {buffer.n_envs}: resume with the same dqn.buffer_size "
                                      "and train.n_envs, or start afresh with --force")
            for name in REPLAY_ARRAYS:
                if name not in saved.files:
                    continue
                stored, target = saved[name], getattr(buffer, name)
                if stored.shape[1:] != target.shape[1:] or len(stored) > len(target):
                    raise ClovaTrainError(f"replay buffer {path}: {name} has shape {stored.shape}, the run's buffer "
                                          f"{target.shape}")
                check_finite_transitions(stored, name, path)
                target[: len(stored)] = stored
            buffer.pos, buffer.full = int(saved["pos"]), bool(saved["full"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, MemoryError) as err:  # not an npz, truncated,
        raise ClovaTrainError(f"replay buffer {path} cannot be read: {str(err)[:200]}") from None  # a field missing


def _check_npz_headers(saved: Any, buffer: Any, path: Path) -> None:
    """Each array of the ``.npz`` read from its header alone (shape and type) before numpy allocates it: at most the
    run's buffer of rows, of plain numbers; the scalars are scalars."""
    import numpy as np
    from numpy.lib import format as npy

    for member in saved.zip.infolist():
        name = member.filename.removesuffix(".npy")
        with saved.zip.open(member) as entry:
            version = npy.read_magic(entry)
            shape, _, dtype = (npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0)(entry)
        if dtype.hasobject or not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise ClovaTrainError(f"replay buffer {path} cannot be read: {name} must be an array of numbers, got {dtype}")
        target = getattr(buffer, name, None) if name in REPLAY_ARRAYS else None
        largest = target.size if isinstance(target, np.ndarray) else 1
        if math.prod(shape) > largest:
            raise ClovaTrainError(f"replay buffer {path} cannot be read: {name} has shape {shape}, more than the run's buffer "
                                  f"({largest:,} values)")


def check_finite_transitions(values: Any, name: str, path: Path, rows: int | None = None) -> None:
    """Refuse ``values`` (a replay buffer's ``name`` array; its first ``rows`` rows, the filled ones, when given)
    unless they are numbers and finite: a NaN or infinite reward or observation would make every Q-target it
    reaches NaN."""
    import numpy as np

    if not isinstance(values, np.ndarray) or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
        raise DataError(f"replay buffer {path}: {name} must be an array of numbers, got "
                        f"{getattr(values, 'dtype', type(values).__name__)}")
    values = values if rows is None else values[:rows]
    if np.issubdtype(values.dtype, np.inexact) and not np.isfinite(values).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise DataError(f"replay buffer {path}: {name} holds {values[where]} at transition {where[0]} (index {list(where)}); "
                        "a replay buffer to train on holds finite numbers only")
