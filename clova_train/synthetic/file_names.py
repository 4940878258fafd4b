"""The image file names of the synthetic GPT4Tools world: ``image/`` + 8 hex digits + ``.png``, as GPT4Tools
names its files, drawn from a fixed set of :data:`FILE_NAME_COUNT` names.

A fixed set lets the tiny Llama's tokenizer hold every name as one token (``quickstart.tiny_llama.tool_llama_tokens``):
copying a file name from the prompt is then a one-token copy, which a model of two layers learns in
minutes of pretraining, where an 8-token copy needs induction heads it does not form in that time.
"""

from __future__ import annotations

import random

FILE_NAME_COUNT = 256
FILE_NAMES: tuple[str, ...] = tuple(
    f"image/{value:08x}.png" for value in random.Random("clova-train synthetic files").sample(range(1 << 32), FILE_NAME_COUNT)
)


def file_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct file names."""
    return rng.sample(FILE_NAMES, count)
