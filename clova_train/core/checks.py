"""Checking a config's values before anything starts: every bad value found, one message each.

A :class:`Problems` collects messages of the form ``<key> = <value>: <rule>`` (the key as the user writes it on
the command line, ``dqn.gamma``, ``hydra.llm.timeout_s``), so that a config object can check its own fields with a
prefix its owner gives, and the owner can raise one error listing all of them.
"""

from __future__ import annotations

import math
import sys
from typing import Any


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool); an int only as large as a float can hold (a file's 4,000-digit integer
    is not a number anything here computes with)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= sys.float_info.max  # compared exactly: converting it could overflow
    return math.isfinite(value)


def is_integer(value: Any) -> bool:
    """An int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


class Problems:
    """The problems found in a config, as ``<prefix>.<key> = <value>: <rule>`` messages.

    Args:
        prefix: where the checked fields sit in the whole config (``env``, ``dqn``); empty: at the top.
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.messages: list[str] = []

    def key(self, name: str) -> str:
        """``name`` as the user writes it (with the prefix)."""
        return f"{self.prefix}.{name}" if self.prefix else name

    def add(self, message: str) -> None:
        """A message in its own words (a rule about several fields, a failure to build something)."""
        self.messages.append(message)

    def need(self, ok: bool, name: str, value: Any, rule: str) -> None:
        """Record ``name = value: rule`` unless ``ok``."""
        if not ok:
            self.messages.append(f"{self.key(name)} = {value!r}: {rule}")

    def finite(self, name: str, value: Any) -> None:
        self.need(is_number(value), name, value, "must be a finite number")

    def at_least(self, name: str, value: Any, low: float) -> None:
        self.need(is_number(value) and value >= low, name, value, f"must be a number >= {low:g}")

    def positive(self, name: str, value: Any) -> None:
        self.need(is_number(value) and value > 0, name, value, "must be a number > 0")

    def within(self, name: str, value: Any, low: float, high: float) -> None:
        self.need(is_number(value) and low <= value <= high, name, value, f"must be between {low:g} and {high:g}")

    def integer_at_least(self, name: str, value: Any, low: int) -> None:
        self.need(is_integer(value) and value >= low, name, value, f"must be an integer >= {low}")

    def one_of(self, name: str, value: Any, choices: tuple[str, ...]) -> None:
        """``value`` must be one of ``choices`` (the message quotes them: ``must be 'a', 'b' or 'c'``)."""
        quoted = [repr(c) for c in choices]
        spelled = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        self.need(value in choices, name, value, f"must be {spelled}")

    def __bool__(self) -> bool:
        return bool(self.messages)
