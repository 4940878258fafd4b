"""Synthetic VQA records about rendered shapes, in the JSONL format the VQA datamodule reads.

``write_vqa_records(root, ...)`` writes ``root/images/*.png`` and:

* ``root/train.jsonl``: one record per image, ``{"id", "image", "question", "answer", "val_question",
  "val_answer", "correct"}``. Images of ``learn_colours`` carry their true colour as the answer (what the
  closed loop would infer); ``wrong_answers`` of them carry a wrong inferred answer (the validation answer
  stays the gold one, so the gate must reject them); images of ``known_colours`` are marked
  ``correct: true`` (examples the tool already gets right, stored with a zero prompt).
* ``root/eval.jsonl``: fresh images of every colour with their gold answers, for ``validate`` / ``test``
  and the serving demo (never trained on, never used by the gate).
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from clova_train.core.atomic import default_mode
from clova_train.synthetic.shapes import COLOURS, SHAPES, render_scene


VQA_OBJECT_SIZE = (0.6, 0.9)  # one large shape per image: the question is about it


def _question(shape: str) -> str:
    return f"what colour is the {shape}?"


def write_vqa_records(
    root: str | Path,
    learn_colours: list[str],
    known_colours: list[str],
    images_per_colour: int = 6,
    wrong_answers: int = 2,
    eval_per_colour: int = 10,
    image_size: int = 32,
    seed: int = 0,
) -> Path:
    """Write the images and ``train.jsonl`` / ``eval.jsonl`` under ``root`` (see module docstring)."""
    root = Path(root)
    for colour in (*learn_colours, *known_colours):
        if colour not in COLOURS:
            raise ValueError(f"synthetic VQA colour {colour!r} is not one of {sorted(COLOURS)}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vqa.", dir=root))
    os.chmod(staging, default_mode(directory=True))
    (staging / "images").mkdir()

    def render(colour: str, k: int, split: str) -> tuple[str, str]:
        rng = np.random.default_rng([seed, zlib.crc32(f"{split}:{colour}".encode()), k])
        shape = SHAPES[k % len(SHAPES)]
        scene = render_scene([(colour, shape)], size=image_size, rng=rng, object_size=VQA_OBJECT_SIZE)
        name = f"images/{split}_{colour}_{k:03d}.png"
        Image.fromarray(scene.image).save(staging / name)
        return name, shape

    train = []
    for colour in learn_colours:
        for k in range(images_per_colour):
            image, shape = render(colour, k, "train")
            wrong = k >= images_per_colour - wrong_answers
            answer = sorted(c for c in COLOURS if c != colour)[k % (len(COLOURS) - 1)] if wrong else colour
            train.append({"id": f"{colour}_{k:03d}", "image": image, "question": _question(shape), "answer": answer,
                          "val_question": _question(shape), "val_answer": colour, "correct": False})
    for colour in known_colours:
        for k in range(images_per_colour):
            image, shape = render(colour, k, "train")
            train.append({"id": f"{colour}_{k:03d}", "image": image, "question": _question(shape), "answer": colour,
                          "correct": True})
    evaluation = []
    for colour in sorted({*learn_colours, *known_colours}):
        for k in range(eval_per_colour):
            image, shape = render(colour, k, "eval")
            evaluation.append({"id": f"eval_{colour}_{k:03d}", "image": image, "question": _question(shape),
                               "answer": colour})
    for name, records in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        (staging / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    for entry in staging.iterdir():
        target = root / entry.name
        if target.is_dir():
            for old in target.iterdir():
                old.unlink()
            target.rmdir()
        os.replace(entry, target)
    staging.rmdir()
    return root
