"""GPT4Tools-style tool-usage data: the tool catalogue, a synthetic generator, and the augmentations.

Records are ``{"instruction", "input", "output"}`` (GPT4Tools' format). ``instruction`` holds the whole
tool prompt: the tool list, the format rules, the previous conversation, the new user input and any
earlier steps of the chain; ``output`` is the next step (a tool call ending in ``Observation:``, or a
"No" thought with the ``AI:`` reply).

The generator writes *conversations*: a command about a synthetic scene and the full chain that answers
it, observations included. :func:`records_from_conversation` turns a conversation into training records:
the first step (a positive sample) and, with ``context=True``, one context sample per later step (the
chain cut there, earlier steps and their observations moved into the instruction, GPT4Tools Sec. 3.1).
:func:`negative_record` makes a no-tool sample from a chit-chat exchange.

Tool names are those of GPT4Tools Table 5: 23 from Visual ChatGPT (``SEEN_TOOLS``, used for training) and
8 new ones (``UNSEEN_TOOLS``, Table 6). The descriptions are short paraphrases in the same style.

Requests come from templates worded as users word them (:data:`COMMANDS`: five per seen tool, three per unseen
tool; :data:`CHAIN_COMMANDS` for the chains; :data:`CHAT` for the no-tool exchanges). The generator draws them from
a :class:`Templates` selection, so a split can be given templates of its own
(:mod:`~clova_train.datamodules.tool_llm.template_split`); the default is every template.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from clova_train.synthetic.file_names import file_names
from clova_train.synthetic.shapes import COLOURS, SHAPES
from clova_train.tooluse.react import THOUGHT_PREFIX
from clova_train.tooluse.tool_calls import ToolSpec, tool_list_prompt

IMAGE = "image path"
TEXT = "text"

# name: (description, argument kinds)
SEEN_TOOLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Generate Image From User Input Text": ("Useful to draw a new image from a text description.", (TEXT,)),
    "Generate Image Condition On Canny Image": ("Useful to generate an image from a canny edge map and a text.", (IMAGE, TEXT)),
    "Generate Image Condition On Depth": ("Useful to generate an image from a depth map and a text.", (IMAGE, TEXT)),
    "Instruct Image Using Text": ("Useful to change the style of an image as the text says.", (IMAGE, TEXT)),
    "Generate Image Condition On Sketch Image": ("Useful to generate an image from a sketch and a text.", (IMAGE, TEXT)),
    "Replace Something From The Photo": ("Useful to replace an object in the image by another one.", (IMAGE, TEXT, TEXT)),
    "Generate Image Condition On Segmentations": ("Useful to generate an image from a segmentation map and a text.", (IMAGE, TEXT)),
    "Generate Image Condition On Pose Image": ("Useful to generate an image from a human pose image and a text.", (IMAGE, TEXT)),
    "Generate Image Condition On Soft Hed Boundary Image": ("Useful to generate an image from a soft HED boundary map and a text.", (IMAGE, TEXT)),
    "Generate Image Condition On Normal Map": ("Useful to generate an image from a normal map and a text.", (IMAGE, TEXT)),
    "Remove Something From The Photo": ("Useful to remove an object from the image.", (IMAGE, TEXT)),
    "Detect the Given Object": ("Useful to find where a named object is in the image.", (IMAGE, TEXT)),
    "Segment the Image": ("Useful to segment everything in the image.", (IMAGE,)),
    "Get Photo Description": ("Useful to describe what the image shows.", (IMAGE,)),
    "Edge Detection On Image": ("Useful to detect the edges of the image.", (IMAGE,)),
    "Predict Depth On Image": ("Useful to estimate the depth map of the image.", (IMAGE,)),
    "Line Detection On Image": ("Useful to detect straight lines in the image.", (IMAGE,)),
    "Answer Question About The Image": ("Useful to answer a question about the image.", (IMAGE, TEXT)),
    "Sketch Detection On Image": ("Useful to turn the image into a sketch.", (IMAGE,)),
    "Pose Detection On Image": ("Useful to detect human poses in the image.", (IMAGE,)),
    "Hed Detection On Image": ("Useful to detect soft HED boundaries in the image.", (IMAGE,)),
    "Predict Normal Map On Image": ("Useful to estimate the normal map of the image.", (IMAGE,)),
    "Segment the Given Object": ("Useful to segment a named object in the image.", (IMAGE, TEXT)),
}
UNSEEN_TOOLS: dict[str, tuple[str, ...]] = {
    "Text Detection On Image": ("Useful to read the text in the image.", (IMAGE,)),
    "Detection": ("Useful to detect all objects in the image.", (IMAGE,)),
    "Image Super-Resolution": ("Useful to enhance the resolution of the image.", (IMAGE,)),
    "Generate 3D Asset From User Input Text": ("Useful to make a 3D asset from a text description.", (TEXT,)),
    "Crop the Given Object": ("Useful to crop a named object out of the image.", (IMAGE, TEXT)),
    "Assess the Image Quality": ("Useful to give a quality score for the image.", (IMAGE,)),
    "Recognize Face": ("Useful to recognise who is in the picture.", (IMAGE,)),
    "Detect Face": ("Useful to find all the faces in the picture.", (IMAGE,)),
}
ALL_TOOLS = {**SEEN_TOOLS, **UNSEEN_TOOLS}

class Request(NamedTuple):
    """A request template: its wording and the text arguments of the tool call it asks for ("" for the tool's own).

    Placeholders: ``{obj}``, ``{obj2}`` (a colour and a shape of the scene), ``{shape}``, ``{style}`` (one of
    :data:`STYLES`) and, in chain requests, ``{condition}`` (:data:`CONDITIONS`)."""

    text: str
    arguments: str = ""


# Requests per tool, worded as users write them (GPT4Tools' instructions come from ChatGPT, not from numbered
# variants). Every seen tool has five, so each of train, validation and test gets its own (template_split.py).
COMMANDS: dict[str, list[Request]] = {
    "Generate Image From User Input Text": [
        Request("Draw a picture of a {obj} on a beach", "a {obj} on a beach"),
        Request("Create an image of a {obj}", "a {obj}"),
        Request("Can you generate a photo of a {obj} in a forest?", "a {obj} in a forest"),
        Request("I would like a drawing of a {obj} floating in space", "a {obj} floating in space"),
        Request("Please paint a {obj} sitting on a wooden table", "a {obj} sitting on a wooden table"),
    ],
    "Instruct Image Using Text": [
        Request("Make the image look like a {style}"), Request("Turn this picture into a {style}"),
        Request("Could you restyle the photo as a {style}?"), Request("I want this image to become a {style}"),
        Request("Change the style of the picture to a {style}"),
    ],
    "Replace Something From The Photo": [
        Request("Replace the {obj} with a {obj2}"), Request("Swap the {obj} for a {obj2}"),
        Request("Can you put a {obj2} where the {obj} is?"), Request("I want the {obj} changed into a {obj2}"),
        Request("Please substitute a {obj2} for the {obj} in this photo"),
    ],
    "Remove Something From The Photo": [
        Request("Remove the {obj} from the picture"), Request("Erase the {obj}"),
        Request("Could you get rid of the {obj} in this image?"), Request("Please delete the {obj} from the photo"),
        Request("I don't want the {obj} in the picture any more"),
    ],
    "Detect the Given Object": [
        Request("Where is the {obj}?"), Request("Find the {obj} in the image"),
        Request("Can you locate the {obj} in this picture?"), Request("Show me where the {obj} is in the photo"),
        Request("Draw a box around the {obj}"),
    ],
    "Segment the Image": [
        Request("Segment this image"), Request("Give me a segmentation of the picture"),
        Request("Can you split this photo into its segments?"),
        Request("I need a segmentation map of everything in the image"),
        Request("Please segment all the regions of this picture"),
    ],
    "Get Photo Description": [
        Request("Describe this image"), Request("What does the picture show?"),
        Request("Can you tell me what is in this photo?"), Request("Please give me a caption for the image"),
        Request("I would like a description of this picture"),
    ],
    "Edge Detection On Image": [
        Request("Detect the edges of this image"), Request("Can you find the edges in the picture?"),
        Request("Give me the canny edge map of this photo"), Request("Please extract the edges from the image"),
        Request("I need an edge map of this picture"),
    ],
    "Predict Depth On Image": [
        Request("Estimate the depth of this image"), Request("How far away are the things in this picture?"),
        Request("Can you give me a depth map of the photo?"), Request("Please predict the depth of the image"),
        Request("I want to see the depth of this picture"),
    ],
    "Line Detection On Image": [
        Request("Find the straight lines in the picture"), Request("Detect the lines of this image"),
        Request("Can you show me the straight lines in this photo?"),
        Request("Please extract the line segments from the image"),
        Request("I need the straight line map of this picture"),
    ],
    "Answer Question About The Image": [
        Request("What colour is the {shape}?", "what colour is the {shape}"),
        Request("Is there a {obj} in the image?", "is there a {obj} in the image"),
        Request("Can you tell me how many shapes are in this picture?", "how many shapes are in the picture"),
        Request("I wonder what is next to the {shape} in the photo", "what is next to the {shape}"),
        Request("Is the {shape} bigger than the other shape?", "is the {shape} bigger than the other shape"),
    ],
    "Sketch Detection On Image": [
        Request("Make a sketch of this picture"), Request("Turn the image into a sketch"),
        Request("Can you draw the outlines of this photo like a sketch?"),
        Request("Please give me a sketch of the image"), Request("I want a pencil sketch version of this picture"),
    ],
    "Pose Detection On Image": [
        Request("Detect the human poses in this image"),
        Request("Can you find the body pose of the people in the picture?"),
        Request("Give me the pose keypoints of this photo"), Request("Please estimate the human pose in the image"),
        Request("I need a pose map of this picture"),
    ],
    "Hed Detection On Image": [
        Request("Detect the soft boundaries of this image"), Request("Give me the HED boundary map of the picture"),
        Request("Can you find the soft edges in this photo?"), Request("Please extract the hed boundaries from the image"),
        Request("I want a soft boundary map of this picture"),
    ],
    "Predict Normal Map On Image": [
        Request("Estimate the normal map of the picture"), Request("Can you predict the surface normals of this image?"),
        Request("Give me the normal map of this photo"), Request("Please compute the normals of the image"),
        Request("I need to see the surface orientation in this picture"),
    ],
    "Segment the Given Object": [
        Request("Segment the {obj} in the image"), Request("Cut out the mask of the {obj}"),
        Request("Can you give me a mask of the {obj} in this picture?"),
        Request("Please segment only the {obj} in the photo"), Request("I need the outline of the {obj} as a mask"),
    ],
    "Text Detection On Image": [
        Request("Read the text in this image"), Request("What does the writing in the picture say?"),
        Request("Can you recognise the words in this photo?"),
    ],
    "Detection": [
        Request("Detect all the objects in this image"), Request("What objects can you find in the picture?"),
        Request("Can you box every object in this photo?"),
    ],
    "Image Super-Resolution": [
        Request("Enhance the resolution of this image"), Request("Can you make this picture sharper and larger?"),
        Request("Please upscale the photo"),
    ],
    "Generate 3D Asset From User Input Text": [
        Request("Make a 3D model of a {obj}", "a {obj}"), Request("Can you build a 3D asset of a {obj}?", "a {obj}"),
        Request("I need a three-dimensional {obj} object", "a {obj}"),
    ],
    "Crop the Given Object": [
        Request("Crop the {obj} out of the image"), Request("Can you cut the {obj} region out of this picture?"),
        Request("Please give me a crop of the {obj}"),
    ],
    "Assess the Image Quality": [
        Request("Give a quality score for this image"), Request("How good is the quality of this picture?"),
        Request("Can you rate the quality of the photo?"),
    ],
    "Recognize Face": [
        Request("Who is in this photo?"), Request("Can you tell me whose face this is?"),
        Request("Please recognise the person in the picture"),
    ],
    "Detect Face": [
        Request("Find all the faces in the picture"), Request("How many faces are in this image?"),
        Request("Can you locate the faces in the photo?"),
    ],
}
# The text arguments of a tool call when its request names none ("" for image-only tools).
DEFAULT_ARGUMENTS: dict[str, str] = {
    "Instruct Image Using Text": "{style}",
    "Replace Something From The Photo": "{obj}, {obj2}",
    "Remove Something From The Photo": "{obj}",
    "Detect the Given Object": "{obj}",
    "Segment the Given Object": "{obj}",
    "Crop the Given Object": "{obj}",
}
# Two-step chains: a detector whose output conditions a generator (GPT4Tools Fig. 3a).
CHAINS: dict[str, str] = {
    "Generate Image Condition On Canny Image": "Edge Detection On Image",
    "Generate Image Condition On Depth": "Predict Depth On Image",
    "Generate Image Condition On Sketch Image": "Sketch Detection On Image",
    "Generate Image Condition On Segmentations": "Segment the Image",
    "Generate Image Condition On Pose Image": "Pose Detection On Image",
    "Generate Image Condition On Soft Hed Boundary Image": "Hed Detection On Image",
    "Generate Image Condition On Normal Map": "Predict Normal Map On Image",
}
# What each chained generator keeps of the picture: the ``{condition}`` of its requests.
CONDITIONS: dict[str, str] = {
    "Generate Image Condition On Canny Image": "edges",
    "Generate Image Condition On Depth": "depth",
    "Generate Image Condition On Sketch Image": "sketch",
    "Generate Image Condition On Segmentations": "segmentation",
    "Generate Image Condition On Pose Image": "human pose",
    "Generate Image Condition On Soft Hed Boundary Image": "soft boundaries",
    "Generate Image Condition On Normal Map": "normal map",
}
# Requests of every chain (the tool is in ``{condition}``); the second step's text argument is ``a {obj}``.
CHAIN_COMMANDS: list[str] = [
    "Generate a new image of a {obj} from the {condition} of this picture",
    "Use the {condition} of this image to draw a {obj}",
    "Can you make a picture of a {obj} that follows the {condition} of this photo?",
    "Please create a {obj} image based on the {condition} of the picture",
    "I want a new {obj} picture that keeps the {condition} of this image",
]
CHAT = [
    ("Hello, how are you?", "I am fine, thank you. How can I help you?"),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tell me a joke.", "Why did the scarecrow win an award? He was outstanding in his field."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Thanks for your help!", "You are welcome."),
    ("What is two plus three?", "Two plus three is five."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Good morning!", "Good morning! What can I do for you?"),
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("Can you recommend a good book?", "You might enjoy Pride and Prejudice by Jane Austen."),
    ("What is ten minus four?", "Ten minus four is six."),
]
STYLES = ["watercolor painting", "pencil drawing", "oil painting", "pixel art picture"]


@dataclass(frozen=True)
class Templates:
    """The request templates one split may use: per tool, for every chain, and the chit-chat exchanges."""

    commands: dict[str, list[Request]]
    chains: list[str]
    chat: list[tuple[str, str]]


ALL_TEMPLATES = Templates(COMMANDS, CHAIN_COMMANDS, CHAT)


def tool_prompt(tools: list[str]) -> str:
    """The prefix of every instruction: the role, the tool list and the format rules."""
    return tool_list_prompt([ToolSpec(name, ALL_TOOLS[name][0], ALL_TOOLS[name][1]) for name in tools])


def user_turn(image: str, caption: str, command: str, history: str = "") -> str:
    """The conversation part of an instruction: the image, the new input, and earlier steps."""
    text = (
        "Previous conversation:\n"
        f"Human: Provide an image named {image}. Description: {caption}. Understand the image using tools.\n"
        "AI: Received.\n\n"
        f"New input: {command}\n"
    )
    return text + history


@dataclass
class Conversation:
    """A command about an image and the full chain that answers it (observations included)."""

    tools: list[str]
    image: str
    caption: str
    command: str
    steps: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, action input, observation)
    reply: str = ""
    template: str = ""  # the request template the command was written from

    def step_text(self, index: int, with_observation: bool) -> str:
        tool, args, observation = self.steps[index]
        text = f"{THOUGHT_PREFIX} Yes\nAction: {tool}\nAction Input: {args}\nObservation:"
        return f"{text} {observation}" if with_observation else text

    def final_text(self) -> str:
        return f"{THOUGHT_PREFIX} No\nAI: {self.reply}"


def records_from_conversation(conversation: Conversation, context: bool = True) -> list[dict[str, str]]:
    """Training records: the first step, and (``context``) one record per later step of the chain."""
    prefix = tool_prompt(conversation.tools)
    outputs = [conversation.step_text(i, False) for i in range(len(conversation.steps))]
    outputs.append(conversation.final_text())
    records = []
    for cut, output in enumerate(outputs):
        if cut > 0 and not context:
            break
        history = "".join(conversation.step_text(i, True) + "\n" for i in range(cut))
        instruction = prefix + user_turn(conversation.image, conversation.caption, conversation.command, history)
        records.append({"instruction": instruction, "input": "", "output": output})
    return records


def negative_record(tools: list[str], image: str, caption: str, question: str, answer: str) -> dict[str, str]:
    """A no-tool sample: a chit-chat exchange in the tool template (GPT4Tools Fig. 3b)."""
    instruction = tool_prompt(tools) + user_turn(image, caption, question)
    return {"instruction": instruction, "input": "", "output": f"{THOUGHT_PREFIX} No\nAI: {answer}"}


def _scene(rng: random.Random) -> tuple[str, str, dict[str, str]]:
    colours, shapes = rng.sample(sorted(COLOURS), 2), rng.sample(SHAPES, 2)
    objects = [f"{c} {s}" for c, s in zip(colours, shapes)]
    image = file_names(rng, 1)[0]
    caption = f"a {objects[0]} and a {objects[1]} on a grey background"
    fill = {"obj": objects[0], "obj2": objects[1], "shape": shapes[0], "style": rng.choice(STYLES)}
    return image, caption, fill


def make_conversation(
    tool: str, tools_in_prompt: list[str], rng: random.Random, templates: Templates = ALL_TEMPLATES
) -> Conversation:
    """A synthetic conversation whose answer uses ``tool`` (and its detector first, for chained tools), its request
    drawn from ``templates``."""
    image, caption, fill = _scene(rng)
    if tool in CHAINS:
        detector = CHAINS[tool]
        template = rng.choice(templates.chains)
        command = template.format(condition=CONDITIONS[tool], **fill)
        first, second = [name for name in file_names(rng, 3) if name != image][:2]
        steps = [(detector, image, first), (tool, f"{first}, a {fill['obj']}", second)]
        return Conversation(tools_in_prompt, image, caption, command, steps, f"Here is the image: {second}", template)
    if not templates.commands.get(tool):
        raise ValueError(f"no request template for tool {tool!r} in this split")
    request = rng.choice(templates.commands[tool])
    command = request.text.format(**fill)
    text = (request.arguments or DEFAULT_ARGUMENTS.get(tool, "")).format(**fill)
    if ALL_TOOLS[tool][1] == (TEXT,):
        args = text
    else:
        args = ", ".join([image, text]) if text else image
    observation = next(name for name in file_names(rng, 2) if name != image)
    return Conversation(tools_in_prompt, image, caption, command, [(tool, args, observation)], f"Done: {observation}",
                        request.text)


def generate_dataset(
    tools: list[str], conversations_per_tool: int, negatives: int, tools_per_prompt: int, seed: int,
    templates: Templates = ALL_TEMPLATES, prompt_tools: list[str] | None = None,
) -> tuple[list[Conversation], list[dict[str, str]]]:
    """Conversations using each of ``tools`` and negative (no-tool) records, their requests from ``templates``.

    Each prompt lists ``tools_per_prompt`` tools: the ones the answer needs plus random others of ``prompt_tools``
    (default: ``tools``).
    """
    rng = random.Random(seed)
    catalogue = list(prompt_tools) if prompt_tools is not None else list(tools)
    conversations = []
    for tool in tools:
        for _ in range(conversations_per_tool):
            needed = [CHAINS[tool], tool] if tool in CHAINS else [tool]
            others = [t for t in catalogue if t not in needed]
            listed = needed + rng.sample(others, max(0, min(len(others), tools_per_prompt - len(needed))))
            rng.shuffle(listed)
            conversations.append(make_conversation(tool, listed, rng, templates))
    negative_records = []
    if negatives and not templates.chat:
        raise ValueError("no chit-chat exchange in this split for its negative samples")
    for _ in range(negatives):
        image, caption, _ = _scene(rng)
        question, answer = rng.choice(templates.chat)
        listed = rng.sample(catalogue, min(len(catalogue), tools_per_prompt))
        negative_records.append(negative_record(listed, image, caption, question, answer))
    return conversations, negative_records


def synthetic_records(
    tools: list[str], conversations_per_tool: int, negatives: int, tools_per_prompt: int, seed: int,
    context: bool = True, templates: Templates = ALL_TEMPLATES, prompt_tools: list[str] | None = None,
) -> list[dict[str, str]]:
    """The records of :func:`generate_dataset` (positive, context and negative samples), shuffled with ``seed``."""
    conversations, negative_records = generate_dataset(tools, conversations_per_tool, negatives, tools_per_prompt,
                                                       seed, templates, prompt_tools)
    records = [r for c in conversations for r in records_from_conversation(c, context)] + negative_records
    random.Random(seed).shuffle(records)
    return records


def write_records(path: str | Path, records: list[dict[str, str]]) -> Path:
    """Write ``records`` as a GPT4Tools JSON list to ``path`` (atomically)."""
    from clova_train.core.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(records, indent=1))
    return Path(path)


def write_synthetic_split(
    path: str | Path, tools: list[str], conversations_per_tool: int, negatives: int, tools_per_prompt: int,
    seed: int, context: bool = True, templates: Templates = ALL_TEMPLATES,
) -> Path:
    """Write a JSON list of records (positive, context and negative samples) to ``path``."""
    return write_records(path, synthetic_records(tools, conversations_per_tool, negatives, tools_per_prompt, seed,
                                                 context, templates))
