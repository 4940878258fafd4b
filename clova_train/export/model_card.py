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


def lora_model_card(*, kind: str, base_name: str, base_copied: bool, source: Path, hparams: dict[str, Any],
                    adapter_config: dict[str, Any], dtype: str | None = None) -> str:
    """``README.md`` for ``adapter/`` (``kind="adapter"``) or ``merged/`` (``kind="merged"``)."""
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

vLLM: `vllm serve {load_base} --enable-lora --lora-modules tools=adapter`; or `clova-train serve <export>`."""
    else:
        load = f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("merged")   # saved as {dtype}
tokenizer = AutoTokenizer.from_pretrained("merged")
```

vLLM: `vllm serve merged`; or `clova-train serve <export>`."""
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
"""
