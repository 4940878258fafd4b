"""Generic copy and lookup text: what the tiny Llama reads in pretraining, as a real LLM reads the web.

A real base LLM can copy a file name from its prompt and find the catalogue entry whose description
matches a request before any tool tuning; GPT4Tools' LoRA tuning only teaches it the tool format and
when to use these abilities. A tiny random Llama has neither, so LoRA tuning alone cannot make it call a
tool with the right image path (issue 13). These documents teach the two abilities in formats of their own:

* ``files``: objects with their image files, then questions answered by a file name (lookup, then copy);
* ``catalogue``: named entries described by "Useful to <verb> <object> ...", then requests answered by the
  entry's name (match a request to a description, copy the name written before it);
* ``quote`` and ``copy``: a phrase or a sequence of words and paths, then the same again (span copy).

Verbs and objects are drawn from word lists of their own; given the tool names as entry names, a catalogue
pairs them with random descriptions. No document holds a ReAct step or the ``Thought:`` / ``Action:``
format, so a model pretrained on them (and on tool prompts without responses) still scores near 0 before
tuning.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from clova_train.synthetic.file_names import FILE_NAMES

NAME_WORDS = (
    "Image", "Photo", "Picture", "Text", "Face", "Object", "Map", "Depth", "Edge", "Line", "Colour", "Shape",
    "Count", "Filter", "Blur", "Rotate", "Sharpen", "Flip", "Label", "Measure", "Caption", "Translate", "Audio",
    "Video", "Music", "Graph", "Detect", "Find", "Make", "Read", "Score", "Scale", "Crop", "Paint", "Draw", "Mask",
    "Layer", "Noise", "Tone", "Light", "Shadow", "Frame", "Border", "Pixel", "Style", "Sketch", "Model", "Asset",
    "Quality", "Person", "Name", "On", "From", "Of", "The", "Given", "Input", "User", "Get", "Predict", "Estimate",
    "Generate", "Answer", "Question",
)
VERBS = (
    "read", "detect", "enhance", "find", "crop", "remove", "draw", "estimate", "rotate", "flip", "blur", "count",
    "translate", "label", "measure", "describe", "paint", "sharpen", "score", "recognise", "segment", "replace",
    "make", "generate", "answer", "predict", "cut", "erase", "locate", "list", "name", "colour", "trace", "outline",
)
NOUNS = (
    "text", "faces", "objects", "resolution", "edges", "lines", "depth", "shapes", "colours", "people", "shadows",
    "border", "sky", "background", "letters", "numbers", "corners", "noise", "light", "style", "sketch", "poses",
    "map", "quality", "score", "model", "asset", "mask", "caption", "label", "tone", "frame", "layout", "pixels",
)
MODIFIERS = (
    "red", "green", "blue", "yellow", "purple", "orange", "small", "large", "bright", "dark", "all the", "every",
    "the main", "the hidden", "the old", "a new", "the named", "soft", "straight", "human",
)
THINGS = ("circle", "square", "triangle", "star", "cat", "dog", "car", "tree", "house", "cup", "chair", "bird")
PLACES = ("in the image", "of the picture", "in this photo", "from the image", "on the picture", "out of the image")
REQUESTS = ("{Verb} {modifier} {noun} {place}", "Please {verb} {modifier} {noun}", "Can you {verb} the {noun}?",
            "{Verb} {noun} {place}")


def image_file(rng: random.Random) -> str:
    """A file name of the synthetic world (:mod:`clova_train.synthetic.file_names`)."""
    return rng.choice(FILE_NAMES)


def files_document(rng: random.Random) -> str:
    count = rng.randint(2, 6)  # distinct objects in distinct files, so that every question has one answer
    objects = rng.sample([f"{modifier} {thing}" for modifier in MODIFIERS[:10] for thing in THINGS], count)
    items = list(zip(objects, rng.sample(FILE_NAMES, count)))
    lines = ["Files:"] + [f"the {thing} is in {path}" for thing, path in items]
    for thing, path in rng.choices(items, k=rng.randint(2, 5)):
        lines.append(f"Where is the {thing}? {path}")
    return "\n".join(lines)


def catalogue_document(rng: random.Random, names: tuple[str, ...] = ()) -> str:
    entries = []
    count = rng.randint(3, 8)
    chosen = rng.sample(names, count) if names else [" ".join(rng.sample(NAME_WORDS, rng.randint(1, 4))) for _ in range(count)]
    for name, verb in zip(chosen, rng.sample(VERBS, count)):  # one verb per entry, so every request has one answer
        entries.append((name, verb, rng.choice(MODIFIERS), rng.choice(NOUNS)))
    lines = ["Catalogue:"]
    lines += [f"> {name}: Useful to {verb} {mod} {noun} {rng.choice(PLACES)}." for name, verb, mod, noun in entries]
    for name, verb, mod, noun in rng.choices(entries, k=rng.randint(2, 5)):
        request = rng.choice(REQUESTS).format(Verb=verb.capitalize(), verb=verb, modifier=mod, noun=noun,
                                              place=rng.choice(PLACES))
        lines += [f"Request: {request}", f"Entry: {name}"]
    return "\n".join(lines)


def quote_document(rng: random.Random) -> str:
    words = (MODIFIERS, THINGS, NOUNS, VERBS)
    phrase = " ".join(rng.choice(rng.choice(words)) for _ in range(rng.randint(2, 6))) + " " + rng.choice(THINGS)
    return f"Say: {rng.choice(VERBS)} the {phrase}\nObject: {phrase}"


def copy_document(rng: random.Random, names: tuple[str, ...] = ()) -> str:
    """A sequence of file names, words and ``names`` (default: name words), then the same again."""
    def item() -> str:
        name = rng.choice(names) if names else rng.choice(NAME_WORDS)
        return rng.choice([image_file(rng), rng.choice(THINGS), rng.choice(NOUNS), rng.choice(VERBS), name])

    sequence = " ".join(item() for _ in range(rng.randint(3, 10)))
    return f"Copy: {sequence}\nAgain: {sequence}"


DOCUMENT_KINDS: dict[str, Callable[[random.Random], str]] = {
    "files": files_document, "catalogue": catalogue_document, "quote": quote_document, "copy": copy_document,
}
# Lookup by description is the hardest of the four, so it gets twice the share.
DOCUMENT_WEIGHTS = {"files": 1, "catalogue": 2, "quote": 1, "copy": 1}


def skill_documents(count: int, seed: int = 0, entry_names: tuple[str, ...] = ()) -> list[str]:
    """``count`` documents of the kinds above, mixed by :data:`DOCUMENT_WEIGHTS`.

    ``entry_names``: names for catalogue entries (default: random words). Given the tool names, the
    catalogues pair them with random descriptions.
    """
    rng = random.Random(seed)
    kinds = rng.choices(list(DOCUMENT_WEIGHTS), weights=list(DOCUMENT_WEIGHTS.values()), k=count)
    return [catalogue_document(rng, entry_names) if kind == "catalogue" else DOCUMENT_KINDS[kind](rng) for kind in kinds]
