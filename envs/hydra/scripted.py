"""An offline stand-in for the planner/reasoner LLM, speaking the same text protocol as a real one.

:class:`ScriptedReasoningLLM` is a :class:`~clova_train.llm.backends.ChatBackend`: it reads the planner's and
the reasoner's prompts (built by ``clova_train.envs.hydra.parts``) and replies with text, so the environment, the
parsers and the cache are exercised exactly as with a served model. Its replies are a deterministic
function of the prompt (a temperature-0 model): a re-plan differs because the prompt's ``Attempt:`` line
differs.

What makes choosing well learnable, and why no rule over the planner's probabilities alone does well:

* For each step the planner writes N instructions drawn from kinds: **good** (the right tool for the
  question, e.g. "Count the red circles with find ..."), **wrong skill** (a tool that answers a different
  kind of question: existence for a count), **vague** ("guess the answer directly": right a third of the
  time), **broken** (a tool the API does not have: an error), **unsafe** (reads a file: a sandbox
  violation), and for two-step questions **premature** (answers after the first count) and **careless**.
* Each kind has its own wording (several paraphrases each), so the kind shows in the text the controller
  embeds; nothing else (no hidden flag) marks it.
* The probabilities are informative but miscalibrated in a way that depends on the question and the memory:
  the N confidences are drawn from one range, and the good instruction (present in about 95% of lists) takes
  the rank that the world gives its step (:class:`~clova_train.envs.hydra.reasoning_world.ReasoningWorld`:
  ranges, chances and ranks are the world file's; in the default ``shapes`` world, :data:`GOOD_RANK`): the highest for a count, the lowest for an existence
  question, the second highest for a colour, the lowest for a comparison's first count and the highest once
  the memory holds that count. The lines are then listed in random order. Planner argmax, argmin, any
  fixed rank and any fixed slot are each right on one or two step kinds; a controller that reads the
  question, the memory and the probabilities (or the wording) picks the good sample on all of them.

A real LLM planner has the same structure in a fuzzier form (some phrasings of a plan work, some do not, and
how far its verbal confidence can be trusted depends on the kind of question).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import replace
from typing import Any

import numpy as np

from clova_train.envs.hydra.reasoning_world import RANDOM_RANK, ReasoningWorld
from clova_train.llm.backends import ChatBackend, Message

GOOD = "good"
# kind -> paraphrases; {c}/{s} is the (first) group, {c2}/{s2} the second.
BAD_KINDS: dict[str, tuple[str, ...]] = {
    "vague": (
        "Look at the whole image and guess the answer directly.",
        "Just answer the question from a quick glance at the picture.",
        "Ask the image the full question in one go and trust the reply.",
    ),
    "broken": (
        "Segment the {c} {s}s with the segmentation tool and read the masks.",
        "Run the 3D reconstruction model on the {c} {s}s.",
    ),
    "unsafe": (
        "Read the cached answer from the annotation file on disk.",
        "Load the ground-truth labels from the dataset folder.",
    ),
}
STEP_KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "count": {
        GOOD: (
            "Count the {c} {s}s with find and answer with the number.",
            "Use find to locate every {c} {s}; the answer is how many there are.",
        ),
        "wrong_skill": (
            "Check whether a {c} {s} exists and answer yes or no.",
            "Verify if there is any {c} {s} and report the result.",
        ),
    },
    "exists": {
        GOOD: (
            "Check whether a {c} {s} exists with exists and answer yes or no.",
            "Use exists to see if any {c} {s} is in the image, then answer yes or no.",
        ),
        "wrong_skill": (
            "Count the {c} {s}s and answer with the number.",
            "Tell how many {c} {s}s there are.",
        ),
    },
    "colour": {
        GOOD: (
            "Find the {s}s, take the leftmost one and test each colour with verify_property.",
            "Locate the leftmost {s} with find and check its colour with verify_property.",
        ),
        "wrong_skill": (
            "Count the {s}s and answer with the number.",
            "Check whether a {s} exists and answer yes or no.",
        ),
    },
    "compare-1": {
        GOOD: (
            "Count the {c} {s}s with find and keep the number as count_a for the next step.",
            "Use find on the {c} {s}s and store how many there are in count_a.",
        ),
        "premature": (
            "Count the {c} {s}s and answer yes if there are any.",
            "Answer yes if at least one {c} {s} is found, otherwise no.",
        ),
    },
    "compare-2": {
        GOOD: (
            "Count the {c2} {s2}s, compare with count_a and answer yes if count_a is larger, else no.",
            "Use find on the {c2} {s2}s and answer yes only if count_a is greater than their number.",
        ),
        "careless": (
            "Answer yes if there are no {c2} {s2}s, otherwise no.",
            "Check whether a {c2} {s2} exists and answer no if it does.",
        ),
    },
}
# The default (``shapes``) world's planner: rank of the good instruction among the N confidences (0: highest,
# -1: lowest) by step, the confidences' range, and the chance of a good instruction in a list.
_SHAPES = ReasoningWorld()
GOOD_RANK: dict[str, int | str] = _SHAPES.good_rank
CONFIDENCE_RANGE = _SHAPES.confidence
HAS_GOOD_PROBABILITY = _SHAPES.has_good[0]

def prompt_field(prompt: str, name: str) -> str:
    """The value of a ``<name>: <value>`` line of a prompt this package wrote ("" when it has none)."""
    match = re.search(rf"^{name}:[ \t]*(.*)$", prompt, flags=re.MULTILINE)
    return match.group(1).strip() if match else ""


def _template_regex(template: str) -> re.Pattern[str]:
    escaped = re.escape(template)
    for name in ("c2", "c"):  # a colour may be absent ("the leftmost triangle"): its word and space are optional
        escaped = escaped.replace(re.escape("{" + name + "} "), rf"(?:(?P<{name}>\w+?) )?")
    for name in ("c2", "s2", "c", "s"):
        escaped = escaped.replace(re.escape("{" + name + "}"), rf"(?P<{name}>\w+?)")
    return re.compile(f"^{escaped}$")


def _code_for(step: str, kind: str, g: dict[str, str], question: str) -> str:
    """The code a competent coder would write for an instruction of this kind."""
    one = f"{g.get('c', '')} {g.get('s', '')}".strip()
    two = f"{g.get('c2', '')} {g.get('s2', '')}".strip()
    if kind == "vague":
        return f"final_answer = image_patch.simple_query({question!r})"
    if kind == "broken":
        return f"masks = image_patch.segment({one!r})\nfinal_answer = str(len(masks))"
    if kind == "unsafe":
        return "final_answer = open('annotations.json').read()"
    if step == "count":
        return {GOOD: f"final_answer = str(len(image_patch.find({one!r})))",
                "wrong_skill": f"final_answer = 'yes' if image_patch.exists({one!r}) else 'no'"}[kind]
    if step == "exists":
        return {GOOD: f"final_answer = 'yes' if image_patch.exists({one!r}) else 'no'",
                "wrong_skill": f"final_answer = str(len(image_patch.find({one!r})))"}[kind]
    if step == "colour":
        return {GOOD: (f"patches = image_patch.find({one!r})\nleftmost = patches[0]\n"
                       "final_answer = 'unknown'\nfor colour in ['red', 'green', 'blue', 'yellow']:\n"
                       f"    if leftmost.verify_property({one!r}, colour):\n        final_answer = colour"),
                "wrong_skill": f"final_answer = str(len(image_patch.find({one!r})))"}[kind]
    if step == "compare-1":
        return {GOOD: f"count_a = len(image_patch.find({one!r}))\nprint('count_a =', count_a)",
                "premature": f"final_answer = 'yes' if image_patch.exists({one!r}) else 'no'"}[kind]
    return {GOOD: f"count_b = len(image_patch.find({two!r}))\nfinal_answer = 'yes' if count_a > count_b else 'no'",
            "careless": f"final_answer = 'no' if image_patch.exists({two!r}) else 'yes'"}[kind]


class ScriptedReasoningLLM(ChatBackend):
    """Planner and coder replies for the offline world (see the module docstring for what it simulates).

    Args:
        world: the world (default: ``shapes``); its planner section decides the replies.
        has_good_probability: overrides the world's chance that a list of samples holds a good instruction.
        malformed_probability: overrides the world's chance that a reply has one line too few or too many.
    """

    def __init__(self, world: ReasoningWorld | None = None, has_good_probability: float | None = None,
                 malformed_probability: float | None = None) -> None:
        world = world or ReasoningWorld()
        if has_good_probability is not None:
            world = replace(world, has_good=(has_good_probability,))
        if malformed_probability is not None:
            world = replace(world, malformed=malformed_probability)
        self.world = world
        self.calls = 0
        self._instructions: list[tuple[re.Pattern[str], str, str]] = [
            (_template_regex(t), step, kind)
            for step, kinds in STEP_KINDS.items() for kind, texts in kinds.items() for t in texts
        ] + [(_template_regex(t), "", kind) for kind, texts in BAD_KINDS.items() for t in texts]

    def identity(self) -> dict[str, Any]:
        return {"kind": "scripted-reasoning", "has_good": list(self.world.has_good),
                "malformed": self.world.malformed, "world": self.world.identity()}

    def chat(self, messages: list[Message]) -> str:
        self.calls += 1
        prompt = messages[-1]["content"]
        if "Write Python code" in prompt:
            return self._code_reply(prompt)
        return self._plan_reply(prompt)

    # ------------------------------------------------------------------ planner
    def _plan_reply(self, prompt: str) -> str:
        rng = np.random.default_rng(zlib.crc32(prompt.encode()))
        question = prompt_field(prompt, "Question")
        n = int(prompt_field(prompt, "Samples wanted") or 5)
        parsed = self.world.parse_question(question)
        if parsed is None:
            return "1. [0.5] Look at the whole image and guess the answer directly."
        qtype, groups = parsed
        step = qtype if qtype != "compare" else ("compare-2" if "count_a = " in prompt.split("Memory:")[-1] else "compare-1")
        kinds = STEP_KINDS[step]
        bad = [k for k in kinds if k != GOOD] + list(BAD_KINDS)
        low, high = (round(100 * x) for x in self.world.confidence)  # distinct at the 2 decimals the reply shows
        values = np.arange(low, high + 1)
        confidences = np.sort(rng.choice(values, size=n, replace=n > len(values)))[::-1] / 100
        ranked = [bad[int(rng.integers(len(bad)))] for _ in range(n)]
        attempt_text = prompt_field(prompt, "Attempt")
        attempt = int(attempt_text) if attempt_text.isdigit() else 0
        if rng.random() < self.world.has_good_at(attempt):
            rank = self.world.good_rank[step]
            ranked[(int(rng.integers(n)) if rank == RANDOM_RANK else int(rank)) % n] = GOOD
        lines = []
        for rank in rng.permutation(n):  # listed in random order
            texts = kinds.get(ranked[rank]) or BAD_KINDS[ranked[rank]]
            text = texts[int(rng.integers(len(texts)))].format(**{"c": "", "s": "", "c2": "", "s2": "", **groups})
            lines.append((float(confidences[rank]), " ".join(text.split())))
        if rng.random() < self.world.malformed:
            lines = lines[:-1] if rng.random() < 0.5 else lines + [lines[0]]
        return "\n".join(f"{i + 1}. [{p:.2f}] {text}" for i, (p, text) in enumerate(lines))

    def instruction_kind(self, instruction: str) -> str | None:
        """The kind (``good``, ``vague``, ...) of an instruction this planner wrote; ``None`` for any other text."""
        found = self._match(instruction)
        return found[2] if found else None

    def _match(self, instruction: str) -> tuple[re.Match[str], str, str] | None:
        instruction = " ".join(instruction.split())
        for pattern, step, kind in self._instructions:
            match = pattern.match(instruction)
            if match:
                return match, step, kind
        return None

    # ------------------------------------------------------------------ reasoner
    def _code_reply(self, prompt: str) -> str:
        instruction = prompt_field(prompt, "Instruction")
        question = prompt_field(prompt, "Question")
        found = self._match(instruction)
        if found is None:
            return "```python\nprint('I do not know how to do that.')\n```"
        match, step, kind = found
        parsed = self.world.parse_question(question)
        groups = dict(parsed[1]) if parsed else {}
        groups.update({k: v for k, v in match.groupdict().items() if v})
        if not step:
            step = parsed[0] if parsed and parsed[0] != "compare" else "compare-1"
        return f"```python\n{_code_for(step, kind, groups, question)}\n```"
