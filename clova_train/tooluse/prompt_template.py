"""The prompt template of the tool-using LLM: one object used for training, evaluation and serving.

``prompt(instruction, input)`` is the text the model sees; during training the response (the record's
``output``) follows it directly and is the only part with a loss. The default is Vicuna v1.1 style; the
prompt ends with a newline so that no token spans the prompt/response boundary with common tokenizers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TEMPLATE_FILE = "prompt_template.json"  # the file name a template is saved under next to a model or adapter

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


@dataclass(frozen=True)
class PromptTemplate:
    """How a record becomes model input.

    Args:
        system: system message put at the start of every prompt.
        prompt_format: the prompt; fields ``{system}``, ``{instruction}`` and ``{input}``.
        input_format: how a non-empty ``input`` is inserted (``{input}``); an empty input adds nothing.
        stop_strings: generation stops after any of these (the tool runner fills in the observation).
    """

    system: str = VICUNA_SYSTEM
    prompt_format: str = "{system}\n\nUSER: {instruction}{input}\nASSISTANT:\n"
    input_format: str = "\n{input}"
    stop_strings: tuple[str, ...] = ("Observation:",)

    def prompt(self, instruction: str, input: str = "") -> str:  # noqa: A002 (the records' field name)
        extra = self.input_format.format(input=input) if input else ""
        return self.prompt_format.format(system=self.system, instruction=instruction, input=extra)

    def to_dict(self) -> dict:
        return {**asdict(self), "stop_strings": list(self.stop_strings)}

    @classmethod
    def from_dict(cls, data: dict) -> PromptTemplate:
        return cls(**{**data, "stop_strings": tuple(data.get("stop_strings", ("Observation:",)))})
