"""Reading stable-baselines3 files (model zips, replay buffers) without running code from them.

An SB3 zip's ``data`` entry is JSON, but the fields JSON cannot hold (observation and action spaces, schedules,
the policy and buffer classes, numpy arrays, random generators, ``train_freq``) are cloudpickled inside it, and
``BaseAlgorithm.load`` unpickles them: a zip from someone else could run any code on load. A replay buffer is a
plain pickle. Here both are unpickled by :class:`~clova_train.core.safe_pickle.AllowlistUnpickler`, which
resolves only the classes and functions such fields legitimately name (:data:`ALLOWED_GLOBALS`); the zip's fields then reach SB3 as
``custom_objects``, so SB3 unpickles nothing itself. The weights (``policy.pth``, ``pytorch_variables.pth``)
SB3 already reads with ``torch.load(weights_only=True)``. A file that names anything else is refused with one
message naming the file, the field and what it asked for.
"""

from __future__ import annotations

import base64
import binascii
import pickle
import zipfile
from pathlib import Path
from typing import Any

from clova_train.core.errors import ClovaTrainError, DataError, UnsafeFileError
from clova_train.core.safe_pickle import AllowlistUnpickler, restricted_loads
from clova_train.core.safe_files import parse_json

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
    """Every cloudpickled field of the SB3 zip at ``path``, unpickled through the allowlist: pass it to
    ``load(..., custom_objects=...)`` and SB3 unpickles nothing.

    Raises:
        UnsafeFileError: a field names a class or function outside the allowlist, or is not a pickle.
        ClovaTrainError: ``path`` is not an SB3 zip.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            data = parse_json(archive.read("data"), f"the 'data' entry of {path}")
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as err:
        raise ClovaTrainError(f"{path} is not a stable-baselines3 zip: {err}") from None
    if not isinstance(data, dict):
        raise ClovaTrainError(f"{path} is not a stable-baselines3 zip: its 'data' is not a JSON object")
    objects = {}
    for key, value in data.items():
        if not (isinstance(value, dict) and ":serialized:" in value):
            continue
        try:
            objects[key] = restricted_loads(base64.b64decode(value[":serialized:"], validate=True), ALLOWED_GLOBALS)
        except (pickle.UnpicklingError, binascii.Error, ValueError, TypeError, EOFError, AttributeError) as err:
            raise UnsafeFileError(f"{path}: field {key!r} cannot be loaded safely ({err}); a controller zip "
                                  "holds spaces, schedules, SB3 classes and arrays only") from None
    return objects


def load_replay_buffer(model: Any, path: str | Path) -> None:
    """Give the off-policy ``model`` the replay buffer pickled at ``path`` (what ``save_replay_buffer`` wrote),
    unpickled through the allowlist instead of SB3's plain ``pickle.load``."""
    from stable_baselines3.common.buffers import ReplayBuffer

    path = Path(path)
    try:
        with open(path, "rb") as handle:
            buffer = AllowlistUnpickler(handle, ALLOWED_GLOBALS).load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError, AttributeError) as err:
        raise UnsafeFileError(f"replay buffer {path} cannot be loaded safely ({err}); it must hold an SB3 "
                              "ReplayBuffer of arrays only") from None
    if not isinstance(buffer, ReplayBuffer):
        raise ClovaTrainError(f"replay buffer {path} holds a {type(buffer).__name__}, not an SB3 ReplayBuffer")
    filled = buffer.buffer_size if buffer.full else buffer.pos
    for name in REPLAY_ARRAYS:
        if getattr(buffer, name, None) is not None:
            check_finite_transitions(getattr(buffer, name), name, path, rows=filled)
    model.replay_buffer = buffer


REPLAY_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


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
        with np.load(path, allow_pickle=False) as saved:
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
    except (OSError, ValueError, KeyError) as err:  # not an npz, truncated, or a field missing
        raise ClovaTrainError(f"replay buffer {path} cannot be read: {err}") from None


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
