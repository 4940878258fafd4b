"""The model card (``README.md``) of a LoRA export's ``adapter/`` and ``merged/`` directories: Hugging Face's
front matter (``base_model``, ``library_name``, ``tags``) and what the run was: base, data, metrics, how to load."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import yaml

from clova_train.export.common import run_config_section
from clova_train.tools.pretrained import local_model_path

METRICS_SHOWN = ("SR", "SR_t", "SR_act", "SR_args", "loss")


def run_directory(source: Path) -> Path | None:
    """The run directory of an export source: the directory itself, or the run a checkpoint under
    ``<run>/checkpoints/`` (or a sharded checkpoint there) was written into."""
    if source.is_dir() and (source / "adapter").is_dir():
        return source
    for parent in source.parents:
        if parent.name == "checkpoints":
            return parent.parent
    return None


def last_validation_metrics(run_dir: Path | None) -> dict[str, float]:
    """The last logged value of each ``val/...`` metric in the run's CSV logs (newest ``metrics.csv``)."""
    if run_dir is None:
        return {}
    files = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    last: dict[str, float] = {}
    with files[-1].open(newline="") as handle:
        for row in csv.DictReader(handle):
            for key, value in row.items():
                if key and key.startswith("val/") and value not in ("", None):
                    try:
                        last[key] = float(value)
                    except ValueError:
                        continue
    return last


def training_data(run_dir: Path | None) -> list[str]:
    """Lines on the data the run was trained on: its data module and arguments, and the data report's counts."""
    lines: list[str] = []
    if run_dir is None:
        return lines
    data = run_config_section(run_dir, "data")
    if data.get("class_path"):
        init_args = data.get("init_args") if isinstance(data.get("init_args"), dict) else {}
        arguments = {k: v for k, v in init_args.items() if k not in ("tokenizer",)}
        lines.append(f"- data module: `{data['class_path']}` with `{json.dumps(arguments, default=str)}`")
    report = run_dir / "data_report.json"
    if report.is_file():
        try:
            counts = json.loads(report.read_text())
        except json.JSONDecodeError:
            counts = {}
        for split, entry in counts.items() if isinstance(counts, dict) else ():
            if isinstance(entry, dict) and "records" in entry:
                lines.append(f"- {split}: {entry.get('kept', entry['records'])} of {entry['records']} records kept"
                             f"{left_out_counts(entry)} (the run's data_report.json lists the others and why)")
    return lines


def left_out_counts(entry: dict[str, Any]) -> str:
    """``"; left out: 2 too long, 1 invalid"`` from a split of the data report (empty when none was left out)."""
    counts = [f"{len(entry[key])} {key.replace('_', ' ').replace('mis ', 'mis-')}"
              for key in ("too_long", "mis_tokenised", "invalid") if isinstance(entry.get(key), list) and entry[key]]
    return f"; left out: {', '.join(counts)}" if counts else ""


def metrics_table(metrics: dict[str, float]) -> str:
    rows = [(key, value) for key, value in sorted(metrics.items())
            if key.rsplit("/", 1)[-1] in METRICS_SHOWN]
    if not rows:
        return "No validation metrics were logged with this run (the CSV logger writes them to metrics.csv)."
    body = "\n".join(f"| `{key}` | {value:.3f} |" for key, value in rows)
    return ("Last validation of the run (GPT4Tools' success rates: SR_t thought, SR_act action, SR_args "
            f"arguments, SR all of them):\n\n| metric | value |\n| --- | --- |\n{body}")


GENERATE_INTRO = """With `model` and `tokenizer` loaded as above. `tools` are OpenAI function tools; the chat template
puts them, with the conversation, into the GPT4Tools instruction exactly as `clova-train serve` does (a `system`
message is not part of that instruction, as on the server). The reply is a ReAct step: a call is the
`Action:` / `Action Input:` lines (the inputs comma-separated, in the order of the tool's parameters), an answer is
`AI: ...`. Give the call back as an assistant `tool_calls` entry (its `arguments` a dict, as chat templates take
them) and the tool's result as a `tool` message."""

GENERATE = """```python
import re

def reply(messages, tools=None):
    inputs = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=128, do_sample=False, stop_strings=["Observation:"],
                            tokenizer=tokenizer)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

# without tools
print(reply([{"role": "user", "content": "Describe image/cat.png in one sentence."}]))

# with tools
tools = [{"type": "function", "function": {
    "name": "Detect the Given Object",
    "description": "useful when you only want to detect or find out given objects in the picture",
    "parameters": {"type": "object", "properties": {
        "image": {"type": "string", "description": "image path"},
        "object": {"type": "string", "description": "the object to find"}}}}}]
messages = [{"role": "user", "content": "Find the cat in image/cat.png"}]
step = reply(messages, tools)
action = re.search(r"^Action: *(.+)$", step, re.MULTILINE)
given = re.search(r"^Action Input: *(.*)$", step, re.MULTILINE)
if action and given:  # a call: run the tool, give its result back, ask for the next step
    values = [value.strip() for value in given.group(1).split(",")]
    call = {"id": "call_0", "type": "function",
            "function": {"name": action.group(1).strip(), "arguments": dict(zip(["image", "object"], values))}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_0", "content": "a cat at [12, 30, 200, 180]"}]
    step = reply(messages, tools)
print(step.split("AI:", 1)[-1].strip())  # the answer (or the step itself when the model wrote neither)
```"""

TOOLS_ELSEWHERE = """The chat template renders `tools` and `tool` messages as `clova-train serve` does, so any server
that renders this template (vLLM, TGI, transformers' pipelines) sends the model the same prompt. What only
`clova-train serve` does is read the reply back: it turns the `Action:` / `Action Input:` step into OpenAI
`tool_calls` and an `AI:` step into the content. vLLM has no parser for this ReAct format: `vllm serve` gives the
step back as text (`message.content`), which the client reads as in the example above; stop generation at
`Observation:` (`stop=["Observation:"]`). What the template cannot see: `tool_choice` (`"none"` on
`clova-train serve` renders without tools: leave `tools` out for that) and `arguments` sent as a JSON string
(give them as a dict, as vLLM and transformers do; a string is refused with a message saying so)."""


def lora_model_card(*, kind: str, base_name: str, base_copied: bool, source: Path, hparams: dict[str, Any],
                    adapter_config: dict[str, Any], dtype: str | None = None) -> str:
    """``README.md`` for ``adapter/`` (``kind="adapter"``) or ``merged/`` (``kind="merged"``): front matter, base,
    training, metrics, how to load, a ``generate`` example with and without tools, and tool calls elsewhere."""
    run_dir = run_directory(source)
    local = local_model_path(base_name) is not None
    front = {"library_name": "peft" if kind == "adapter" else "transformers", "pipeline_tag": "text-generation",
             "tags": ["clova-train", "gpt4tools", "lora", "tool-use"]}
    if not local:
        front["base_model"] = base_name
    if local and base_copied:
        base_line = (f"The base is the local model `{base_name}`, copied into this export as `base/`: load the base "
                     "from `base/` wherever the export is.")
    elif local:
        base_line = (f"The base is the local model directory `{base_name}`. On another machine, copy that "
                     "directory there and pass its path below (or re-export with `--base-model-id <hub id>` or "
                     "`--copy-base`); peft's error for a missing base reads as a bad repo id.")
    else:
        base_line = f"The base is `{base_name}` (Hugging Face hub id): `from_pretrained` fetches it."
    load_base = "base/" if (local and base_copied) else base_name
    if kind == "adapter":
        load = f"""```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base = AutoModelForCausalLM.from_pretrained("{load_base}")
model = PeftModel.from_pretrained(base, "adapter")
tokenizer = AutoTokenizer.from_pretrained("adapter")     # with the chat template training's prompt uses
```

vLLM: `vllm serve {load_base} --enable-lora --lora-modules tools=adapter`; or `clova-train serve <export>`
(see "Tool calls elsewhere" below)."""
    else:
        load = f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("merged")   # saved as {dtype}
tokenizer = AutoTokenizer.from_pretrained("merged")
```

vLLM: `vllm serve merged`; or `clova-train serve <export>` (see "Tool calls elsewhere" below)."""
    settings = {k: adapter_config[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules")
                if k in adapter_config}
    settings |= {k: hparams[k] for k in ("lr", "warmup_steps", "metric_mode") if k in hparams}
    data = training_data(run_dir) or ["- not recorded with this export's source (no config.yaml in the run)"]
    return f"""---
{yaml.safe_dump(front, sort_keys=True).strip()}
---

# Tool-using LLM: LoRA fine-tune of {Path(base_name).name if local else base_name}

A causal LM fine-tuned with LoRA by clova-train on ReAct-style tool-usage data (GPT4Tools' format): given the
tools and a request, it writes `Thought: Do I need to use a tool? Yes` / `Action:` / `Action Input:` /
`Observation:` steps, or `AI:` when no tool is needed. {"This directory holds the adapter only." if kind == "adapter"
else "This directory holds the adapter merged into its base, a plain transformers model."}

## Base model

{base_line}

## Training

- source: `{source}`
- LoRA and optimisation: `{json.dumps(settings, default=str)}`
{chr(10).join(data)}

## Metrics

{metrics_table(last_validation_metrics(run_dir))}

## How to load

Paths are relative to the export directory (the one holding `adapter/`{", `merged/`" if kind == "merged" else ""}).

{load}

Decoding as in training: greedy, stop at `Observation:` (the stop strings and defaults are in `serving.json`; the
prompt layout is in `prompt_template.json`, and the tokenizer's chat template renders it from a user message).

## Generate

{GENERATE_INTRO}

{GENERATE}

## Tool calls elsewhere

{TOOLS_ELSEWHERE}
"""
