"""The loop's offline world: scenes of coloured shapes, tasks about their colours, and a scripted LLM.

* **Tasks** (:func:`make_task`, written by :func:`prepare_world` as task files): a scene of two or three shapes
  of different kinds, each in one of six colours, and a question: "What colour is the circle?", "Is the square
  orange?" or "Are the circle and the triangle the same colour?". The quickstart's tiny CLIP knows red, green,
  blue and yellow and mistakes purple and orange for blue and yellow, so tasks about those fail until CLASSIFY
  learns them: the loop has something to learn.
* **Scenes** are rows of 64-pixel tiles, one shape on a noisy background each, drawn as the CLIP quickstart's
  images are; LOC's box for an object is its tile, so CLASSIFY sees what the tiny CLIP was tuned on in that
  quickstart. (With shapes scattered over one canvas and crops around them, tuned prompts did not carry over
  from the image source to the crops: 11 accepted purple prompts moved crop accuracy from 24 to 20 of 58.)
* **Image source** (what CLOVA searches the Internet for): ``image_source/<colour>/*.png``, single shapes of
  each colour; ``mislabel_rate`` of each folder's images show another colour (noisy search results).
* **LOC and the captioner** read the scene's annotations (``objects`` in the task file): LOC is not what this
  world tests, and the captions stand in for BLIP's.
* :class:`ScriptedLoopLLM` stands in for the LLM. It plans and writes the program a competent model writes
  for each question form; global reflection blames the CLASSIFY call that gave the answer and names the
  colour the caption gives that object (right for one-object questions, and for two-object ones only when
  that object was the misread one); local reflection checks one step against the caption. Replies follow the
  templates' formats, so they go through the same parsing as a real model's.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from clova_train.closedloop.tasks import LoopTask
from clova_train.core.atomic import write_text_atomic
from clova_train.llm.backends import ChatBackend, Message
from clova_train.sandbox import PatchRef
from clova_train.synthetic.shapes import COLOURS, SHAPES, generated_before, record_generation, render_scene

LABELS = tuple(COLOURS)
QUESTION_FORMS = ("colour", "verify", "same")
FORM_WEIGHTS = (0.5, 0.25, 0.25)
HARD_COLOURS = ("purple", "orange")  # the quickstart's tiny CLIP mistakes them for blue and yellow
EASY_COLOURS = tuple(c for c in LABELS if c not in HARD_COLOURS)
HARD_SHARE = 0.5
TILE = 64  # a scene is a row of 64-pixel tiles, one shape each
CROP_MARGIN = 1.0  # LOC's box is the object's tile, and CLASSIFY's crop is that box


def _random_colour(rng: np.random.Generator) -> str:
    # Half the objects take one of the colours the tiny CLIP gets wrong, so most tasks need them.
    return str(rng.choice(HARD_COLOURS if rng.random() < HARD_SHARE else EASY_COLOURS))


def _tile(rng: np.random.Generator, colour: str, shape: str) -> np.ndarray:
    """One shape on its own noisy background, drawn as the CLIP quickstart's images are."""
    return render_scene([(colour, shape)], size=TILE, rng=rng).image


def _scene(rng: np.random.Generator) -> tuple[np.ndarray, list[dict[str, Any]]]:
    shapes = [str(s) for s in rng.permutation(SHAPES)[: int(rng.integers(2, 4))]]
    colours = [_random_colour(rng) for _ in shapes]
    image = np.concatenate([_tile(rng, c, s) for c, s in zip(colours, shapes)], axis=1)
    objects = [{"name": s, "colour": c, "box": [TILE * i, 0, TILE * (i + 1), TILE]}  # the tile, y from the bottom
               for i, (c, s) in enumerate(zip(colours, shapes))]
    return image, objects


def make_task(task_id: int, seed: int = 0) -> tuple[dict[str, Any], np.ndarray]:
    """Task ``task_id`` as a task-file record without its image path, and the scene's image (HxWx3 uint8)."""
    rng = np.random.default_rng([seed, task_id])
    image, objects = _scene(rng)
    form = str(rng.choice(QUESTION_FORMS, p=FORM_WEIGHTS))
    first = objects[0]
    if form == "colour":
        instruction, answer = f"What colour is the {first['name']}?", first["colour"]
    elif form == "verify":
        asked = first["colour"] if rng.random() < 0.5 else str(rng.choice([c for c in LABELS if c != first["colour"]]))
        instruction, answer = f"Is the {first['name']} {asked}?", "yes" if asked == first["colour"] else "no"
    else:
        second = objects[1]
        instruction = f"Are the {first['name']} and the {second['name']} the same colour?"
        answer = "yes" if first["colour"] == second["colour"] else "no"
    record = {"id": f"task-{seed}-{task_id}", "instruction": instruction, "feedback": {"answer": answer},
              "objects": objects}
    return record, image


def _write_tasks(root: Path, name: str, ids: range, seed: int) -> Path:
    lines = []
    for task_id in ids:
        record, image = make_task(task_id, seed)
        path = root / "images" / f"{record['id']}.png"
        Image.fromarray(image).save(path)
        lines.append(json.dumps({**record, "image": f"images/{path.name}"}))
    write_text_atomic(root / name, "\n".join(lines) + "\n")
    return root / name


def write_image_source(root: Path, images_per_concept: int, mislabel_rate: float, seed: int) -> Path:
    """``root/<colour>/<colour>_<k>.png``: single shapes of the colour; a share ``mislabel_rate`` of each folder
    shows another colour."""
    for colour in LABELS:
        folder = root / colour
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, zlib.crc32(colour.encode()), 1])
        wrong = set(rng.permutation(images_per_concept)[: round(mislabel_rate * images_per_concept)].tolist())
        for k in range(images_per_concept):
            shown = str(rng.choice([c for c in LABELS if c != colour])) if k in wrong else colour
            Image.fromarray(_tile(rng, shown, str(rng.choice(SHAPES)))).save(folder / f"{colour}_{k:03d}.png")
    return root


def prepare_world(root: str | Path, train_tasks: int = 24, test_tasks: int = 60, images_per_concept: int = 48,
                  mislabel_rate: float = 0.0, seed: int = 0) -> Path:
    """Write the world under ``root`` (once: a rerun with the same settings reuses it; other settings are an error):
    ``train_tasks.jsonl``, ``test_tasks.jsonl`` (ids never used in training), ``images/`` and ``image_source/``."""
    root = Path(root)
    parameters = {"world": "closedloop-shapes-v5", "train_tasks": train_tasks, "test_tasks": test_tasks,
                  "images_per_concept": images_per_concept, "mislabel_rate": mislabel_rate, "seed": seed}
    if generated_before(root, parameters):
        return root
    (root / "images").mkdir(parents=True, exist_ok=True)
    _write_tasks(root, "train_tasks.jsonl", range(train_tasks), seed)
    _write_tasks(root, "test_tasks.jsonl", range(100_000, 100_000 + test_tasks), seed)
    write_image_source(root / "image_source", images_per_concept, mislabel_rate, seed)
    record_generation(root, parameters)
    return root


def _inside(box: list[int], patch: PatchRef) -> bool:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return patch.left <= cx <= patch.right and patch.lower <= cy <= patch.upper


class AnnotationLocator:
    """LOC from the task's ``objects`` annotations: the boxes of objects named ``object_name`` (a shape,
    optionally with "the" or a plural) inside the patch."""

    def find(self, task: LoopTask, patch: PatchRef, object_name: str) -> list[tuple[int, int, int, int]]:
        name = re.sub(r"^(the|a|an)\s+", "", object_name.strip().lower()).rstrip("s")
        return [tuple(o["box"]) for o in task.extra.get("objects", []) if o["name"] == name and _inside(o["box"], patch)]


class AnnotationCaptioner:
    """Captions from the annotations ("a purple circle and a red square"), standing in for BLIP's."""

    def caption(self, task: LoopTask) -> str:
        objects = [f"a {o['colour']} {o['name']}" for o in task.extra.get("objects", [])]
        return " and ".join(objects) if objects else "an image"


_INSTRUCTION = re.compile(r"^Instruction: (.+)$", re.MULTILINE)
_STEP = re.compile(r"^Step(\d+) (\w+): (\w+)\((.*)\) on region \[.*?\] -> (.+)$", re.MULTILINE)
_CAPTION = re.compile(r"^Description of the input image: (.+)$", re.MULTILINE)


def _last_instruction(prompt: str) -> str:
    found = _INSTRUCTION.findall(prompt)
    return found[-1].strip() if found else ""


def _caption_colours(prompt: str) -> dict[str, str]:
    match = _CAPTION.search(prompt)
    pairs = re.findall(r"an? (\w+) (\w+)", match.group(1)) if match else []
    return {shape: colour for colour, shape in pairs}


def _arguments(text: str) -> list[str]:
    return re.findall(r"'([^']*)'", text)


class ScriptedLoopLLM(ChatBackend):
    """The offline world's LLM (see the module docstring). Deterministic: a prompt always gets the same reply."""

    def identity(self) -> dict[str, Any]:
        return {"kind": "scripted-closed-loop", "version": 1}

    def chat(self, messages: list[Message]) -> str:
        prompt = messages[-1]["content"]
        if prompt.startswith("You are a planner"):
            return self._plan(_last_instruction(prompt))
        if prompt.startswith("You write Python programs"):
            labels = re.search(r"CLASSIFY over the labels (.+?)\),", prompt)
            return self._program(_last_instruction(prompt), labels.group(1).split(", ") if labels else list(LABELS))
        if "Now you need to check Step" in prompt:
            return self._local(prompt)
        if prompt.startswith("You are a debugger"):
            return self._global(prompt)
        if "Correct answer:" in prompt:
            answer = re.search(r"^Human feedback: The correct answer is (.+)$", prompt, re.MULTILINE)
            return answer.group(1) if answer else "unknown"
        return "I cannot help with that."

    @staticmethod
    def _plan(instruction: str) -> str:
        names = re.findall(r"the (circle|square|triangle)", instruction)
        steps = [f"Step{i + 1}, locate the {n} and classify its colour." for i, n in enumerate(names)]
        return "\n".join(steps + [f"Step{len(steps) + 1}, answer the question from the colours."])

    @staticmethod
    def _program(instruction: str, labels: list[str]) -> str:
        colour_of = ("def colour_of(name):\n    for patch in image_patch.find(name):\n"
                     f"        for label in {labels!r}:\n"
                     "            if patch.verify_property(name, label):\n                return label\n"
                     "    return 'unknown'\n")
        if match := re.match(r"What colour is the (\w+)\?", instruction):
            code = colour_of + f"final_answer = colour_of({match.group(1)!r})"
        elif match := re.match(r"Is the (\w+) (\w+)\?", instruction):
            code = f"final_answer = 'yes' if image_patch.verify_property({match.group(1)!r}, {match.group(2)!r}) else 'no'"
        elif match := re.match(r"Are the (\w+) and the (\w+) the same colour\?", instruction):
            code = colour_of + (f"first = colour_of({match.group(1)!r})\nsecond = colour_of({match.group(2)!r})\n"
                                "final_answer = 'yes' if first == second else 'no'")
        else:
            code = f"final_answer = image_patch.simple_query({instruction!r})"
        return f"```python\n{code}\n```"

    @staticmethod
    def _judge(step: tuple[str, ...], colours: dict[str, str]) -> str | None:
        """The concept a CLASSIFY step got wrong, by the caption, or None if it agrees."""
        _, tool, method, arguments, result = step
        if tool != "CLASSIFY" or method != "verify_property":
            return None
        args = _arguments(arguments)
        if len(args) != 2 or args[0] not in colours:
            return None
        actual, said = colours[args[0]], result.strip() == "True"
        if said and args[1] != actual:
            return actual  # it took an `actual` object for `args[1]`
        if not said and args[1] == actual:
            return actual
        return None

    def _global(self, prompt: str) -> str:
        colours = _caption_colours(prompt)
        steps = [s for s in _STEP.findall(prompt) if s[1] == "CLASSIFY"]
        answered = [s for s in steps if s[4].strip() == "True"] or steps
        if not answered:
            return "program\nConcept:\nReason: the program never looked at the image."
        step = answered[-1]
        name = (_arguments(step[3]) or [""])[0]
        concept = colours.get(name, "")
        return (f"CLASSIFY\nConcept: {concept}\nReason: the answer came from CLASSIFY on the {name}, "
                f"which the description says is {concept}.")

    def _local(self, prompt: str) -> str:
        colours = _caption_colours(prompt)
        current = prompt.split("Now you need to check Step", 1)[1]
        steps = _STEP.findall(current)
        concept = self._judge(steps[0], colours) if steps else None
        if concept is None:
            return "yes"
        return (f"no\nError Location: CLASSIFY\nConcept: {concept}\nReason: the description says the "
                f"{_arguments(steps[0][3])[0]} is {concept}, and CLASSIFY answered {steps[0][4].strip()}.")
