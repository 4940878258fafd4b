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
        return self.prompt_format.format(system=self.system, instruction=instruction, input=self._input(input))

    def _input(self, input: str) -> str:  # noqa: A002
        return self.input_format.format(input=input) if input else ""

    def user_message(self, instruction: str, input: str = "") -> str:  # noqa: A002
        """The content of the chat ``user`` message whose chat-template rendering is :meth:`prompt`."""
        return instruction + self._input(input)

    def chat_template(self, bos_token: bool = False) -> str:
        """A Jinja chat template (``tokenizer.chat_template``) that renders exactly :meth:`prompt`.

        ``apply_chat_template([{"role": "user", "content": user_message(i, x)}], add_generation_prompt=True)``
        equals ``prompt(i, x)`` (preceded by the BOS token when ``bos_token``: set it when the tokenizer adds
        one on encoding, since ``apply_chat_template`` encodes without special tokens). A leading ``system``
        message replaces the default system text. Each assistant message is rendered as trained (its text,
        then the EOS token); a later user turn repeats the user part of the format. GPT4Tools puts the
        conversation history into the instruction, so the single user turn is the trained form.

        With ``tools`` (``apply_chat_template(messages, tools=...)``, OpenAI function tools) the template renders
        what ``clova-train serve`` renders for the same request: the conversation as one GPT4Tools instruction
        (:func:`clova_train.tooluse.tool_calls.instruction_from_chat`: tool list, ``Previous conversation:``,
        ``New input:``, each tool call and its ``tool`` reply as a finished step) under the default system text
        (the server does not put a ``system`` message into that instruction either), refusing with
        ``raise_exception`` what the server refuses. What a template cannot see: ``tool_choice`` (``"none"`` is
        the server rendering without tools: leave ``tools`` out) and arguments given as a JSON string (give
        them as a dict; see :mod:`clova_train.tooluse.tool_chat_template`).
        """
        head, sep, tail = self.prompt_format.partition("{instruction}")
        if not sep or not tail.startswith("{input}") or head.count("{system}") != 1:
            raise ValueError(
                "a chat template needs a prompt_format of the form '...{system}...{instruction}{input}...', "
                f"got {self.prompt_format!r}"
            )
        before_system, _, user_prefix = head.partition("{system}")
        user_suffix = tail[len("{input}") :]
        from clova_train.tooluse.tool_chat_template import instruction, literal, tools_checked

        return "".join([
            "{%- if tools -%}", tools_checked(), "{%- endif -%}",
            "{%- if messages and messages[0]['role'] == 'system' and not tools -%}",
            "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}",
            "{%- else -%}",
            f"{{%- set system = {literal(self.system)} -%}}{{%- set turns = messages -%}}",
            "{%- endif -%}",
            "{{ bos_token }}" if bos_token else "",
            f"{{{{ {literal(before_system)} }}}}{{{{ system }}}}",
            "{%- if tools -%}",
            f"{{{{ {literal(user_prefix)} }}}}", instruction(), f"{{{{ {literal(user_suffix)} }}}}",
            "{%- else -%}",
            "{%- for message in turns -%}",
            "{%- if message['role'] == 'user' -%}",
            f"{{{{ {literal(user_prefix)} }}}}{{{{ message['content'] }}}}{{{{ {literal(user_suffix)} }}}}",
            "{%- elif message['role'] == 'assistant' -%}",
            "{{ message['content'] }}{{ eos_token }}",
            "{%- endif -%}",
            "{%- endfor -%}",
            "{%- endif -%}",
        ])

    def to_dict(self) -> dict:
        return {**asdict(self), "stop_strings": list(self.stop_strings)}

    @classmethod
    def from_dict(cls, data: dict) -> PromptTemplate:
        return cls(**{**data, "stop_strings": tuple(data.get("stop_strings", ("Observation:",)))})
