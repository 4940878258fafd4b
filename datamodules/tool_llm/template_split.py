"""Train / validation / test splits of the synthetic tool data by request template, and by tool for unseen tools.

The rule (:func:`split_templates`, deterministic for a seed):

* each seen tool's request templates (:data:`~.tool_conversations.COMMANDS`) are shuffled with
  ``random.Random(f"{seed}:{tool}")``; the first ``max(1, n // 5)`` go to test, the next as many to validation,
  the rest (at least three of five) to training;
* the chain requests (:data:`~.tool_conversations.CHAIN_COMMANDS`, shared by every chained generator) and the
  chit-chat exchanges of the no-tool samples (:data:`~.tool_conversations.CHAT`) are split the same way, keyed
  ``"chains"`` and ``"chat"``;
* the unseen tools (GPT4Tools Table 6) are never trained on: shuffled with ``random.Random(f"{seed}:unseen")``,
  the first ``max(1, 3 * n // 8)`` are validation's, the others test's, each with all its templates.

So no validation or test request is written from a template that a training request is written from, and a chain's
context samples (the chain cut at a step) share their request's split: no (template, step) pair crosses splits.
:func:`request_template` finds the template a request was written from, which the data report and the tests use to
check it on the written files.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence, TypeVar

from clova_train.datamodules.tool_llm.tool_conversations import (
    CHAIN_COMMANDS, CHAT, COMMANDS, CONDITIONS, SEEN_TOOLS, STYLES, UNSEEN_TOOLS, Templates,
)
from clova_train.synthetic.shapes import COLOURS, SHAPES

SPLITS = ("train", "val", "test")
RULE = ("request templates split per seen tool (and for chains and chit-chat): shuffled with "
        "random.Random(f'{seed}:{key}'), max(1, n // 5) to test, as many to validation, the rest to training; unseen "
        "tools split by tool: shuffled with random.Random(f'{seed}:unseen'), max(1, 3 * n // 8) to validation, "
        "the rest to test, none to training")
Item = TypeVar("Item")


def held_out(items: Sequence[Item], key: str, seed: int) -> dict[str, list[Item]]:
    """``items`` split into train / val / test by the module's rule (``key`` names the group in the seed)."""
    if len(items) < 3:
        raise ValueError(f"{key}: {len(items)} templates cannot give train, validation and test one each")
    shuffled = list(items)
    random.Random(f"{seed}:{key}").shuffle(shuffled)
    count = max(1, len(items) // 5)
    return {"test": shuffled[:count], "val": shuffled[count:2 * count], "train": shuffled[2 * count:]}


def held_out_tools(tools: Sequence[str], seed: int) -> dict[str, list[str]]:
    """Unseen tools split between validation and test (none in training)."""
    shuffled = list(tools)
    random.Random(f"{seed}:unseen").shuffle(shuffled)
    count = max(1, 3 * len(shuffled) // 8)
    return {"train": [], "val": shuffled[:count], "test": shuffled[count:]}


@dataclass(frozen=True)
class TemplateSplit:
    """The templates and unseen tools of each split, for one seed."""

    seed: int
    templates: dict[str, Templates]
    unseen_tools: dict[str, list[str]]

    def describe(self) -> dict[str, Any]:
        """The split as JSON (the rule, the seed, and each split's templates and unseen tools)."""
        return {
            "rule": RULE, "seed": self.seed,
            "splits": {split: {
                "requests": {tool: [r.text for r in requests] for tool, requests in t.commands.items()},
                "chain_requests": list(t.chains), "chat": [question for question, _ in t.chat],
                "unseen_tools": self.unseen_tools[split],
            } for split, t in self.templates.items()},
        }


def split_templates(seed: int) -> TemplateSplit:
    """The template split of ``seed`` (module docstring)."""
    per_tool = {tool: held_out(COMMANDS[tool], tool, seed) for tool in SEEN_TOOLS if tool in COMMANDS}
    chains, chat = held_out(CHAIN_COMMANDS, "chains", seed), held_out(CHAT, "chat", seed)
    unseen = held_out_tools(list(UNSEEN_TOOLS), seed)
    templates = {split: Templates(
        commands={**{tool: parts[split] for tool, parts in per_tool.items()},
                  **{tool: list(COMMANDS[tool]) for tool in unseen[split]}},
        chains=chains[split], chat=chat[split],
    ) for split in SPLITS}
    return TemplateSplit(seed, templates, unseen)


_PLACEHOLDERS = {
    "obj": f"(?:{'|'.join(map(re.escape, COLOURS))}) (?:{'|'.join(map(re.escape, SHAPES))})",
    "shape": "|".join(map(re.escape, SHAPES)),
    "style": "|".join(map(re.escape, STYLES)),
    "condition": "|".join(map(re.escape, CONDITIONS.values())),
}
_PLACEHOLDERS["obj2"] = _PLACEHOLDERS["obj"]


def _pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("".join(re.escape(part) if i % 2 == 0 else f"(?:{_PLACEHOLDERS[part]})"
                              for i, part in enumerate(parts)))


@lru_cache(maxsize=1)
def _patterns() -> tuple[tuple[re.Pattern[str], str], ...]:
    templates = [r.text for requests in COMMANDS.values() for r in requests] + CHAIN_COMMANDS
    templates += [question for question, _ in CHAT]
    return tuple((_pattern(t), t) for t in templates)


def request_template(request: str) -> str | None:
    """The template ``request`` was written from (a :data:`COMMANDS` / :data:`CHAIN_COMMANDS` text or a
    :data:`CHAT` question), or None for a request written from none of them."""
    found = [template for pattern, template in _patterns() if pattern.fullmatch(request)]
    return found[0] if len(found) == 1 else None


_REQUEST = re.compile(r"^New input: (.*)$", re.MULTILINE)
_ACTION = re.compile(r"^Action: ", re.MULTILINE)


def record_template(record: dict[str, str]) -> tuple[str | None, int]:
    """A record's (request template, tool steps already taken since the request): what a chain's context samples
    share with their request."""
    text = record.get("instruction", "")
    matches = list(_REQUEST.finditer(text))
    if not matches:
        return None, 0
    return request_template(matches[-1].group(1).strip()), len(_ACTION.findall(text[matches[-1].end():]))


__all__ = ["RULE", "SPLITS", "TemplateSplit", "held_out", "held_out_tools", "record_template",
           "request_template", "split_templates"]
