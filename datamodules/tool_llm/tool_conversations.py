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
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

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

# Commands per tool: {obj}, {obj2}, {shape}, {style} are filled from the scene.
COMMANDS: dict[str, list[str]] = {
    "Generate Image From User Input Text": ["Draw a picture of a {obj} on a beach", "Create an image of a {obj}"],
    "Instruct Image Using Text": ["Make the image look like a {style}", "Turn this picture into a {style}"],
    "Replace Something From The Photo": ["Replace the {obj} with a {obj2}", "Swap the {obj} for a {obj2}"],
    "Remove Something From The Photo": ["Remove the {obj} from the picture", "Erase the {obj}"],
    "Detect the Given Object": ["Where is the {obj}?", "Find the {obj} in the image"],
    "Segment the Image": ["Segment this image", "Give me a segmentation of the picture"],
    "Get Photo Description": ["Describe this image", "What does the picture show?"],
    "Edge Detection On Image": ["Detect the edges of this image"],
    "Predict Depth On Image": ["Estimate the depth of this image"],
    "Line Detection On Image": ["Find the straight lines in the picture"],
    "Answer Question About The Image": ["What colour is the {shape}?", "Is there a {obj} in the image?"],
    "Sketch Detection On Image": ["Make a sketch of this picture"],
    "Pose Detection On Image": ["Detect the human poses in this image"],
    "Hed Detection On Image": ["Detect the soft boundaries of this image"],
    "Predict Normal Map On Image": ["Estimate the normal map of the picture"],
    "Segment the Given Object": ["Segment the {obj} in the image", "Cut out the mask of the {obj}"],
    "Text Detection On Image": ["Read the text in this image"],
    "Detection": ["Detect all the objects in this image"],
    "Image Super-Resolution": ["Enhance the resolution of this image"],
    "Generate 3D Asset From User Input Text": ["Make a 3D model of a {obj}"],
    "Crop the Given Object": ["Crop the {obj} out of the image"],
    "Assess the Image Quality": ["Give a quality score for this image"],
    "Recognize Face": ["Who is in this photo?"],
    "Detect Face": ["Find all the faces in the picture"],
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
CHAT = [
    ("Hello, how are you?", "I am fine, thank you. How can I help you?"),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tell me a joke.", "Why did the scarecrow win an award? He was outstanding in his field."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Thanks for your help!", "You are welcome."),
    ("What is two plus three?", "Two plus three is five."),
]
STYLES = ["watercolor painting", "pencil drawing", "oil painting", "pixel art picture"]


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


def make_conversation(tool: str, tools_in_prompt: list[str], rng: random.Random) -> Conversation:
    """A synthetic conversation whose answer uses ``tool`` (and its detector first, for chained tools)."""
    image, caption, fill = _scene(rng)
    if tool in CHAINS:
        detector = CHAINS[tool]
        kind = detector.split(" On ")[0].lower()
        command = f"Generate a new image of a {fill['obj']} from the {kind} of this picture"
        first, second = [name for name in file_names(rng, 3) if name != image][:2]
        steps = [(detector, image, first), (tool, f"{first}, a {fill['obj']}", second)]
        return Conversation(tools_in_prompt, image, caption, command, steps, f"Here is the image: {second}")
    command = rng.choice(COMMANDS[tool]).format(**fill)
    kinds = ALL_TOOLS[tool][1]
    text_args = {
        1: command.rstrip("?").lower() if tool == "Answer Question About The Image" else fill["obj"],
        2: fill["obj2"],
    }
    if tool == "Instruct Image Using Text":
        text_args[1] = fill["style"]
    if tool == "Generate Image From User Input Text":
        args = f"a {fill['obj']} on a beach" if "beach" in command else f"a {fill['obj']}"
    elif kinds == (TEXT,):
        args = fill["obj"]
    else:
        args = ", ".join([image] + [text_args[k] for k in range(1, len(kinds))])
    observation = next(name for name in file_names(rng, 2) if name != image)
    return Conversation(tools_in_prompt, image, caption, command, [(tool, args, observation)], f"Done: {observation}")


def generate_dataset(
    tools: list[str], conversations_per_tool: int, negatives: int, tools_per_prompt: int, seed: int
) -> tuple[list[Conversation], list[dict[str, str]]]:
    """Conversations using each of ``tools`` and negative (no-tool) records.

    Each prompt lists ``tools_per_prompt`` tools: the ones the answer needs plus random others.
    """
    rng = random.Random(seed)
    conversations = []
    for tool in tools:
        for _ in range(conversations_per_tool):
            needed = [CHAINS[tool], tool] if tool in CHAINS else [tool]
            others = [t for t in tools if t not in needed]
            listed = needed + rng.sample(others, max(0, min(len(others), tools_per_prompt - len(needed))))
            rng.shuffle(listed)
            conversations.append(make_conversation(tool, listed, rng))
    negative_records = []
    for _ in range(negatives):
        image, caption, _ = _scene(rng)
        question, answer = rng.choice(CHAT)
        listed = rng.sample(tools, min(len(tools), tools_per_prompt))
        negative_records.append(negative_record(listed, image, caption, question, answer))
    return conversations, negative_records


def write_synthetic_split(
    path: str | Path, tools: list[str], conversations_per_tool: int, negatives: int, tools_per_prompt: int,
    seed: int, context: bool = True,
) -> Path:
    """Write a JSON list of records (positive, context and negative samples) to ``path``."""
    from clova_train.core.atomic import write_text_atomic

    conversations, negative_records = generate_dataset(tools, conversations_per_tool, negatives, tools_per_prompt, seed)
    records = [r for c in conversations for r in records_from_conversation(c, context)] + negative_records
    random.Random(seed).shuffle(records)
    write_text_atomic(path, json.dumps(records, indent=1))
    return Path(path)
