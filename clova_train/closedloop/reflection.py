"""Prompt templates and reflection: global (one go) and local (step by step), and parsing the replies.

Templates are plain files (``templates/*.txt`` in this package) with ``$name`` fields (:class:`string.Template`),
so a user reads and changes them without touching code: point ``templates_dir`` at a folder holding any of
them and those files win. A reflection reply names where the error is and, for a tool, the concept it got
wrong::

    Error Location: CLASSIFY
    Concept: purple
    Reason: the circle is purple but CLASSIFY said it is not.

:func:`parse_reflection` turns a reply into a :class:`Critique`; a reply it cannot read, or one naming a tool
the loop does not have, becomes a :class:`Critique` with ``problem`` set (recorded and reported; nothing is
learned from it), never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.safe_files import read_text

TEMPLATE_NAMES = ("plan", "program", "global_reflection", "local_reflection", "vqa_answer")
DEFAULT_TEMPLATES = Path(__file__).parent / "templates"
NON_TOOL_LOCATIONS = ("plan", "program")


class Templates:
    """The loop's prompt templates: ``templates_dir/<name>.txt`` where present, else the packaged default.

    Args:
        templates_dir: a folder of template files overriding the defaults (any subset of
            plan, program, global_reflection, local_reflection, vqa_answer).
    """

    def __init__(self, templates_dir: str | Path | None = None) -> None:
        self.texts: dict[str, str] = {}
        folder = Path(templates_dir) if templates_dir else None
        if folder is not None and not folder.is_dir():
            raise DataError(f"templates_dir {folder} is not a folder")
        for name in TEMPLATE_NAMES:
            path = folder / f"{name}.txt" if folder is not None and (folder / f"{name}.txt").is_file() else DEFAULT_TEMPLATES / f"{name}.txt"
            self.texts[name] = read_text(path, "template", max_bytes=1 << 20)
            try:
                fields = set(Template(self.texts[name]).get_identifiers())
            except ValueError as err:
                raise DataError(f"template {path}: {err}") from None
            self._check(path, name, fields)

    @staticmethod
    def _check(path: Path, name: str, fields: set[str]) -> None:
        allowed = TEMPLATE_FIELDS[name]
        unknown = sorted(fields - allowed)
        if unknown:
            raise DataError(f"template {path} uses unknown field(s) {unknown}; {name} templates may use {sorted(allowed)}")

    def render(self, name: str, **fields: object) -> str:
        try:
            return Template(self.texts[name]).substitute({k: str(v) for k, v in fields.items()})
        except KeyError as err:  # a field the template needs and the loop did not give: a bug, not user input
            raise ClovaTrainError(f"template {name} needs field {err}") from None


TEMPLATE_FIELDS: dict[str, set[str]] = {
    "plan": {"correct_examples", "incorrect_examples", "instruction"},
    "program": {"correct_examples", "incorrect_examples", "instruction", "plan", "labels"},
    "global_reflection": {"instruction", "caption", "feedback", "answer", "plan", "program", "steps"},
    "local_reflection": {"instruction", "caption", "feedback", "answer", "total", "checked", "index", "step"},
    "vqa_answer": {"instruction", "caption", "feedback", "steps", "question", "tool_answer"},
}


@dataclass(frozen=True)
class Critique:
    """What a reflection concluded: the error's ``location`` (a tool, ``plan`` or ``program``), the ``concept``
    a tool got wrong, the ``reason``; ``step`` for local reflection. ``problem`` is set when the reply could not
    be used (unparseable, or naming an unknown tool); ``reply`` keeps the raw text for the record."""

    location: str = ""
    concept: str = ""
    reason: str = ""
    step: int | None = None
    problem: str = ""
    reply: str = ""

    @property
    def tool(self) -> str | None:
        """The visual tool to update, if the critique names one and was usable."""
        return None if self.problem or self.location in NON_TOOL_LOCATIONS else self.location


_FIELD = re.compile(r"^\s*(error location|location|concept|reason)\s*:\s*(.*?)\s*$", re.IGNORECASE)


def parse_reflection(reply: str, tools: list[str] | tuple[str, ...], step: int | None = None,
                     prefilled_location: bool = True) -> Critique:
    """Read a reflection reply (see the module docstring). ``tools``: the visual tools the loop can update.

    The global template ends with ``Error Location:``, so the reply may start with the location itself
    (``prefilled_location``)."""
    fields: dict[str, str] = {}
    lines = [line for line in reply.strip().splitlines() if line.strip()]
    for number, line in enumerate(lines):
        match = _FIELD.match(line)
        if match:
            key = "location" if match.group(1).lower() in ("error location", "location") else match.group(1).lower()
            fields.setdefault(key, match.group(2))
        elif number == 0 and prefilled_location and ":" not in line:
            fields.setdefault("location", line.strip())
    location = fields.get("location", "").strip().strip(".'\"`")
    if not location:
        return Critique(problem="no error location in the reply", reply=reply, step=step)
    by_lower = {t.lower(): t for t in (*tools, *NON_TOOL_LOCATIONS)}
    if location.lower() not in by_lower:
        return Critique(location=location, problem=f"the reply names {location!r}, which is not a tool of this loop "
                        f"({', '.join(tools)}) nor plan / program", reply=reply, step=step)
    location = by_lower[location.lower()]
    concept = fields.get("concept", "").strip().strip(".'\"`").lower()
    if location in tools and not concept:
        return Critique(location=location, problem=f"the reply blames {location} but names no concept", reply=reply, step=step)
    return Critique(location, concept if location in tools else "", fields.get("reason", ""), step, "", reply)


def parse_local_verdict(reply: str, tools: list[str] | tuple[str, ...], step: int) -> Critique | None:
    """A local-reflection reply: ``None`` when it says the step is correct ("yes"), else its critique."""
    text = reply.strip()
    first = text.splitlines()[0].strip().lower().rstrip(".,!") if text else ""
    if first == "yes":
        return None
    if first.startswith("no"):
        rest = text.split("\n", 1)[1] if "\n" in text else ""
        return parse_reflection(rest, tools, step=step, prefilled_location=False) if rest.strip() else \
            Critique(problem="the reply says the step is wrong but not where", reply=reply, step=step)
    return Critique(problem="the reply starts with neither yes nor no", reply=reply, step=step)
