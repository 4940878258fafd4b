"""Reading an offline world's file: the checks every world format shares, each naming the file and key at fault.

Used by the HYDRA reasoning world (:mod:`clova_train.envs.hydra.reasoning_world`) and the AVIS / HAMMR
information-seeking world (:mod:`clova_train.envs.avis.seeking_world`). Nothing in a file is run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clova_train.core.checks import is_integer, is_number
from clova_train.core.errors import DataError
from clova_train.core.safe_files import ReadLimits, read_json, read_yaml

# What a world file can hold: a few sections of a few keys (the shipped ones are under 2 kB), so a file of a megabyte,
# ten thousand values or a text of a thousand characters is not a world; numbers are finite.
WORLD_LIMITS = ReadLimits(max_bytes=1 << 20, max_depth=8, max_nodes=10_000, max_values=10_000, max_text=1_000,
                          finite_only=True)
MAX_NAME_CHARS = 200
MAX_WEIGHT = 1e6  # a question kind's weight (only their ratios matter)
MAX_GUESS_ONE_IN = 1_000_000


def shown(value: Any, width: int = 40) -> str:
    """``repr(value)`` cut to ``width`` characters for a message (a file's value may be a 4,000-digit integer)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


def section(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``raw[key]`` as a mapping (absent or empty: ``{}``)."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where}: {key} must be a mapping, got {type(value).__name__}")
    return value


def refuse_unknown(mapping: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """A :class:`DataError` naming the first key of ``mapping`` not in ``allowed``."""
    extra = sorted(set(mapping) - set(allowed), key=str)
    if extra:
        raise DataError(f"{where}: unknown key {extra[0]!r} (expected {', '.join(allowed)})")


def world_mapping(raw: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    """The file's top-level mapping, holding only ``keys``."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a world file must hold a mapping, got {type(raw).__name__}")
    refuse_unknown(raw, keys, where)
    return raw


def world_name(raw: dict[str, Any], where: str) -> str:
    """The ``name`` key (default: the file's stem), stripped."""
    name = raw.get("name", Path(where).stem)
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"{where}: name must be non-empty text")
    if len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise DataError(f"{where}: name = {shown(name)}: must be one line of printable text of at most "
                        f"{MAX_NAME_CHARS} characters")
    return name.strip()


def question_weights(raw: dict[str, Any], kinds: tuple[str, ...], default: Mapping[str, float],
                     where: str) -> dict[str, float]:
    """The ``questions`` key: kind -> weight >= 0 over ``kinds``, at least one above 0 (absent: ``default``)."""
    questions = section(raw, "questions", where) or dict(default)
    refuse_unknown(questions, kinds, f"{where}: questions")
    for kind, weight in questions.items():
        if not is_number(weight) or not 0 <= weight <= MAX_WEIGHT:
            raise DataError(f"{where}: questions.{kind} = {shown(weight)}: must be a number from 0 to {MAX_WEIGHT:g}")
    if not any(questions.values()):
        raise DataError(f"{where}: questions: at least one kind needs a weight > 0")
    if not math.isfinite(sum(float(v) for v in questions.values())):
        raise DataError(f"{where}: questions: the weights must have a finite sum")
    return {k: float(v) for k, v in questions.items()}


def guess_right_one_in(tools: dict[str, Any], default: int, where: str) -> int:
    """``tools.guess_right_one_in``: a guessing tool gives the gold answer once in this many questions (>= 1)."""
    guess = tools.get("guess_right_one_in", default)
    if not is_integer(guess) or not 1 <= guess <= MAX_GUESS_ONE_IN:
        raise DataError(f"{where}: tools.guess_right_one_in = {shown(guess)}: must be an integer from 1 to "
                        f"{MAX_GUESS_ONE_IN:,}")
    return int(guess)


def preset_or_file(path_or_preset: str, presets_dir: Path) -> Path | None:
    """The shipped preset ``presets_dir/<name>.yaml`` a bare name means, else the file; None when neither exists."""
    path = Path(path_or_preset)
    if not path.suffix and (presets_dir / f"{path_or_preset}.yaml").is_file():
        path = presets_dir / f"{path_or_preset}.yaml"
    return path if path.is_file() else None


def shipped(presets_dir: Path) -> str:
    """The names of the presets in ``presets_dir``, for a message."""
    return ", ".join(sorted(p.stem for p in presets_dir.glob("*.yaml")))


def read_world_file(path_or_preset: str, presets_dir: Path, family: str) -> tuple[Any, str]:
    """The parsed content of a YAML/JSON world file, or of the shipped preset of that name in ``presets_dir``, and
    the path read; a :class:`DataError` names the shipped ``family`` worlds when neither exists."""
    path = preset_or_file(path_or_preset, presets_dir)
    if path is None:
        raise DataError(f"world {path_or_preset!r} is neither a file nor a shipped {family} ({shipped(presets_dir)})")
    raw = read_json(path, "world file", WORLD_LIMITS) if path.suffix == ".json" \
        else read_yaml(path, "world file", WORLD_LIMITS)
    return raw, str(path)
