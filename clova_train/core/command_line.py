"""How every ``clova-train`` parser treats the options a user types: spelled out in full, with a suggestion when one
is misspelled, and with its default in ``--help``.

argparse (and jsonargparse, LightningCLI's parser) accept any unambiguous prefix of an option by default, so
``--trainer.max_epoch 2`` silently set ``max_epochs``. Every parser here is built with ``allow_abbrev=False`` and
answers an unknown option with the closest known ones (:func:`with_suggestions`, ``difflib``).
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable
from typing import Any, NoReturn

_UNKNOWN = re.compile(r"unrecognized arguments?: (.*)", re.DOTALL)
_OPTION = re.compile(r"(?<!\S)--?[A-Za-z][\w.-]*")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string ``parser`` knows (``--trainer.max_epochs`` ...)."""
    return sorted(getattr(parser, "_option_string_actions", {}))


def with_suggestions(message: str, known: Iterable[str]) -> str:
    """``message`` (an argparse error) with "did you mean ...?" for each unknown option that is close to a known one."""
    found = _UNKNOWN.search(message)
    if not found:
        return message
    known = list(known)
    hints = []
    for name in dict.fromkeys(_OPTION.findall(found.group(1))):  # the pattern stops before any "=value"
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.75)
        if close and name not in close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    return message if not hints else f"{message}\n" + "\n".join(hints)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default (``(default: ...)``), except flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default == [] \
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return action.help or ""
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """The parser of a plain ``clova-train`` command: full option names only, suggestions, defaults in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        super().error(with_suggestions(message, option_strings(self)))


def suggesting(parser_class: type) -> type:
    """A subclass of a jsonargparse parser class (LightningCLI's included) whose errors carry suggestions and which
    refuses abbreviated options."""

    class Suggesting(parser_class):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("allow_abbrev", False)
            super().__init__(*args, **kwargs)

        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            parser = getattr(ex, "subcommand_parser", None) or self
            super().error(with_suggestions(message, option_strings(parser)), ex)

    Suggesting.__name__ = Suggesting.__qualname__ = f"Suggesting{parser_class.__name__}"
    return Suggesting
