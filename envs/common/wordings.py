"""Question wordings of the offline worlds: the checks a world file's wordings pass, the held-out wording of each
question kind, and the wording a task is asked in.

A world file may give each question kind several wordings (``{c}``: a colour, ``{s}``: a shape; HYDRA's comparison
also ``{c2}`` and ``{s2}``). The first is the kind's canonical wording. A kind with
:data:`~clova_train.envs.common.world.TEST_ONLY_FROM` wordings or more keeps its last one for test tasks (a wording
seen only at test): training and validation tasks are asked in the others, test tasks in any of them. Which one a
task gets is drawn from its id alone, apart from everything else the task draws, so adding wordings changes a task's
question text and nothing else (:func:`~clova_train.envs.common.world.task_wording`, beside the task splits). Used by
the HYDRA reasoning world (:mod:`clova_train.envs.hydra.reasoning_world`) and the AVIS / HAMMR information-seeking
world (:mod:`clova_train.envs.avis.seeking_world`).
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clova_train.core.errors import DataError
from clova_train.envs.common.world import COLOURS, SHAPES

MAX_WORDINGS = 20  # per kind
MAX_WORDING_CHARS = 300
# {s} lazily, so that "{s}s" reads a plural
GROUP_PATTERNS = {"c": r"(?P<c>\w+)", "s": r"(?P<s>\w+?)", "c2": r"(?P<c2>\w+)", "s2": r"(?P<s2>\w+?)"}


def template_fields(template: str) -> list[tuple[str, str | None, str | None, str | None]]:
    """``string.Formatter``'s reading of a wording: (literal text, field, format spec, conversion) pieces."""
    return list(string.Formatter().parse(template))


def wording_pattern(template: str, anchored: bool = True) -> re.Pattern[str]:
    """A checked wording as a regular expression: its literal text escaped, a group per placeholder (``anchored``:
    the whole question; otherwise anywhere in it)."""
    parts = [re.escape(text) + (GROUP_PATTERNS[name] if name is not None else "")
             for text, name, _, _ in template_fields(template)]
    body = "".join(parts)
    return re.compile(f"^{body}$" if anchored else body)


def wording_problem(template: Any, allowed: Sequence[str], kind: str) -> str:
    """Why ``template`` cannot be a wording of ``kind``, whose questions name each of ``allowed`` once ("" when it
    can)."""
    if not isinstance(template, str) or not template.strip():
        return "must be non-empty text"
    if len(template) > MAX_WORDING_CHARS or any(not ch.isprintable() for ch in template):
        return f"must be one line of printable text of at most {MAX_WORDING_CHARS} characters"
    try:
        fields = template_fields(template)
    except ValueError as err:
        return f"is not a valid template ({err})"
    if any(spec or conversion for _, name, spec, conversion in fields if name is not None):
        return "placeholders take no format spec or conversion: write " + " and ".join(f"{{{a}}}" for a in allowed) + \
            " only"
    names = [name for _, name, _, _ in fields if name is not None]
    bad = next((n for n in names if n not in allowed), None)
    if bad is not None:
        return f"uses {{{bad}}}: a {kind} question takes only " + " and ".join(f"{{{a}}}" for a in allowed)
    missing = [a for a in allowed if names.count(a) != 1]
    if missing:
        return f"must use {{{missing[0]}}} exactly once"
    return ""


def read_phrasings(given: Mapping[str, Any], fields_by_kind: Mapping[str, Sequence[str]],
                   default: Mapping[str, tuple[str, ...]], where: str) -> dict[str, tuple[str, ...]]:
    """A world file's ``phrasings`` section (kind -> a wording or a list of them; the kinds already checked), each
    wording checked, over ``default``; a :class:`DataError` names the file, kind and wording at fault."""
    phrasings = dict(default)
    for kind, wordings in given.items():
        wordings = [wordings] if isinstance(wordings, str) else wordings
        if not isinstance(wordings, list) or not 1 <= len(wordings) <= MAX_WORDINGS:
            raise DataError(f"{where}: phrasings.{kind} must be a list of 1 to {MAX_WORDINGS} wordings")
        for i, template in enumerate(wordings):
            problem = wording_problem(template, fields_by_kind[kind], kind)
            if problem:
                raise DataError(f"{where}: phrasings.{kind}[{i}] = {template!r}: {problem}")
        phrasings[kind] = tuple(t.strip() for t in wordings)
    return phrasings


def check_unambiguous(phrasings: Mapping[str, Sequence[str]], fields_by_kind: Mapping[str, Sequence[str]],
                      parse: Callable[[str], tuple[str, dict[str, str]] | None], where: str) -> None:
    """Every wording, filled with any colours and shapes, must read (``parse``) as its own kind with the same
    colours and shapes; a :class:`DataError` names the first that does not."""
    values = {"c": COLOURS, "s": SHAPES, "c2": COLOURS, "s2": SHAPES}
    for kind, wordings in phrasings.items():
        names = list(fields_by_kind[kind])
        for i, template in enumerate(wordings):
            for filled in itertools.product(*(values[n] for n in names)):
                groups = dict(zip(names, filled))
                question = template.format(**groups)
                parsed = parse(question)
                if parsed != (kind, groups):
                    read = "no question of this world" if parsed is None else f"a question of kind {parsed[0]!r}"
                    raise DataError(f"{where}: phrasings.{kind}[{i}] = {template!r}: {question!r} reads as {read}; "
                                    "each wording must read as its own kind only")
