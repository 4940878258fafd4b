"""What LoRA tuning teaches the tool-LLM quickstart's tiny Llama, against the untuned model, in one run.

The quickstart (``configs/quickstart/tool_llm_lora.yaml``) is fitted once; the untuned model (the same
PEFT model with its LoRA B matrices at zero, i.e. the pretrained base) and the tuned one are scored on
the same held-out samples: validation (seen tools, other scenes) and test (the unseen tools of GPT4Tools
Table 6, never trained on). SR_t / SR_act / SR_args / SR per group (paper mode); 95% Wilson intervals for
SR. Target (issue 13): seen-tool SR >= 0.6 and unseen-tool SR >= 0.3 after tuning, from near 0 before.

    python benchmarks/tool_llm_learning.py [--model checkpoints/models/tiny-llama] [--no-record]

The model directory is built with ``clova-train tiny-model llama`` first if it is missing (about 8 minutes
on 2 cores); the fit takes about 4 minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import machine, publish  # noqa: E402

CONFIG = REPO / "configs/quickstart/tool_llm_lora.yaml"
GROUPS = (("val", "seen", "seen tools (validation)"), ("test", "unseen", "unseen tools (test)"),
          ("val", "no_tool", "no tool (validation)"))
RATES = ("SR_t", "SR_act", "SR_args", "SR")


def evaluate(stage: str, common: list[str], logs: Path, name: str, checkpoint: Path | None) -> dict[str, float]:
    """``clova-train validate`` / ``test`` with a CSV logger; the logged metrics of that run."""
    logger = logs / f"{name}.yaml"
    logger.write_text(json.dumps({"trainer": {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                         "init_args": {"save_dir": str(logs), "name": name}}}}))
    clova_train(stage, *common, "--config", str(logger), *([f"--ckpt_path={checkpoint}"] if checkpoint else []))
    with (logs / name / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return {k: float(v) for row in rows for k, v in row.items() if v not in ("", None) and "/" in k}


def counts(data_root: Path) -> dict[tuple[str, str], int]:
    """Samples per (split, group), grouped as the metric groups them."""
    from clova_train.datamodules.tool_llm.tool_conversations import SEEN_TOOLS
    from clova_train.tooluse.metrics import ToolUsageSuccessRate

    metric = ToolUsageSuccessRate(seen_tools=list(SEEN_TOOLS))
    return Counter((split, metric.category(record["output"]))
                   for split in ("val", "test") for record in json.loads((data_root / f"{split}.json").read_text()))


def main() -> None:
    from clova_train.core.evaluation_report import wilson_interval

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/models/tiny-llama", help="base model directory")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    model = (REPO / args.model).resolve()
    if not (model / "config.json").is_file():
        clova_train("tiny-model", "llama", str(model))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = ["--config", str(CONFIG), f"--model.init_args.model_name_or_path={model}",
                  f"--data.init_args.tokenizer={model}", f"--data.init_args.root={work / 'data'}",
                  f"--trainer.default_root_dir={work / 'run'}"]
        before = {**evaluate("validate", common, work, "before_val", None),
                  **evaluate("test", common, work, "before_test", None)}
        clova_train("fit", *common, "--trainer.logger=false")
        last = work / "run" / "checkpoints" / "last.ckpt"
        after = {**evaluate("validate", common, work, "after_val", last),
                 **evaluate("test", common, work, "after_test", last)}
        sizes = counts(work / "data")
    rows = []
    for split, group, label in GROUPS:
        n = sizes[split, group]
        for name, metrics in (("untuned", before), ("LoRA-tuned", after)):
            values = [metrics.get(f"{split}/{group}/{rate}", float("nan")) for rate in RATES]
            low, high = wilson_interval(values[-1] * n, n)
            rows.append(f"| {label} | {n} | {name} | " + " | ".join(f"{v:.3f}" for v in values[:-1])
                        + f" | {values[-1]:.3f} [{low:.3f}, {high:.3f}] |")
    publish("tool_llm_learning", "Tool LLM quickstart: untuned vs LoRA-tuned", f"cpu: {machine()}",
            "GPT4Tools success rates (paper mode) of the quickstart's tiny Llama before and after LoRA tuning, "
            "on held-out samples; SR with its 95% Wilson interval. Command: `python benchmarks/tool_llm_learning.py`",
            ["samples", "n", "model", "SR_t", "SR_act", "SR_args", "SR"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()
