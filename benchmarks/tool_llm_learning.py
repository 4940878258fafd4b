"""What LoRA tuning teaches the tool-LLM quickstart's tiny Llama, against the untuned model, over seeds.

For each seed ``s`` the quickstart (``configs/quickstart/tool_llm_lora.yaml``) is fitted on data rendered with
``s`` (``--data.init_args.render_seed=s``: other scenes, conversations and held-out samples) and trained with
``--seed_everything=s`` (LoRA initialisation, dropout, order); the untuned model (the same PEFT model with its LoRA
B matrices at zero, i.e. the pretrained base) and the tuned one are scored on that seed's held-out samples:
validation (seen tools, other scenes) and test (the unseen tools of GPT4Tools Table 6, never trained on).
Beside them, on the same records, the nearest-record control (``clova_train.tooluse.retrieval_baseline``: the
response of the training record whose request shares the most words, with image paths and request words carried
over; it reads everything the LLM reads and learns from the same training file, with no language model).
SR_t / SR_act / SR_args / SR per group (paper mode): the mean over seeds with a 95% Student t interval from the
seed-to-seed variation, and the paired per-seed differences tuned - untuned and tuned - nearest record. One
tiny-model build for every seed.
Target (issue 13): seen-tool SR >= 0.6 and unseen-tool SR >= 0.3 after tuning, from near 0 before.

    python benchmarks/tool_llm_learning.py [--seeds 0 1 2 3 4] [--runs-dir DIR] [--model DIR] [--no-record]

The model directory is built with ``clova-train tiny-model llama`` first if it is missing (about 8 minutes
on 2 cores); each seed takes about 6 minutes (fit and four evaluations).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

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


def nearest_record_metrics(data_root: Path) -> dict[str, float]:
    """The nearest-record control's rates on the held-out splits, keyed as the LLM's logged metrics."""
    from clova_train.datamodules.tool_llm.tool_conversations import SEEN_TOOLS
    from clova_train.tooluse.metrics import ToolUsageSuccessRate
    from clova_train.tooluse.retrieval_baseline import NearestRecordBaseline

    baseline = NearestRecordBaseline(json.loads((data_root / "train.json").read_text()))
    metrics = {}
    for split in ("val", "test"):
        records = json.loads((data_root / f"{split}.json").read_text())
        rates = ToolUsageSuccessRate("paper", list(SEEN_TOOLS))
        rates.update([baseline.predict(r) for r in records], [r["output"] for r in records])
        metrics.update({f"{split}/{k}": float(v) for k, v in rates.compute().items()})
    return metrics


def run_seed(model: Path, seed: int, runs: Path) -> tuple[dict[str, float], dict[str, float], Counter]:
    """Metrics before and after tuning of one seed's run (reused when it finished) and its sample counts."""
    work = runs / f"seed-{seed}"
    done = work / "metrics.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        return saved["before"], saved["after"], Counter({tuple(k.split("/")): v for k, v in saved["sizes"].items()})
    work.mkdir(parents=True, exist_ok=True)
    common = ["--config", str(CONFIG), f"--model.init_args.model_name_or_path={model}",
              f"--data.init_args.tokenizer={model}", f"--data.init_args.root={work / 'data'}",
              f"--data.init_args.render_seed={seed}", f"--seed_everything={seed}",
              f"--trainer.default_root_dir={work / 'run'}", "--trainer.enable_progress_bar=false"]
    before = {**evaluate("validate", common, work, "before_val", None),
              **evaluate("test", common, work, "before_test", None)}
    clova_train("fit", *common, "--trainer.logger=false")
    last = work / "run" / "checkpoints" / "last.ckpt"
    after = {**evaluate("validate", common, work, "after_val", last),
             **evaluate("test", common, work, "after_test", last)}
    sizes = counts(work / "data")
    done.write_text(json.dumps({"before": before, "after": after, "sizes": {"/".join(k): v for k, v in sizes.items()}}))
    return before, after, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/models/tiny-llama", help="base model directory")
    add_seeded_run_arguments(parser, "data and training seeds")
    args = parser.parse_args()
    model = (REPO / args.model).resolve()
    if not (model / "config.json").is_file():
        clova_train("tiny-model", "llama", str(model))
    with runs_directory(args.runs_dir) as runs:
        results = [(*run_seed(model, s, runs), nearest_record_metrics(runs / f"seed-{s}" / "data")) for s in args.seeds]
    models = ((0, "untuned"), (1, "LoRA-tuned"), (3, "nearest training record (no LLM)"))
    rows = []
    for split, group, label in GROUPS:
        n = ", ".join(str(r[2][split, group]) for r in results)
        per_model = {name: [[r[k].get(f"{split}/{group}/{rate}", float("nan")) for rate in RATES] for r in results]
                     for k, name in models}
        for name, values in per_model.items():
            cells = [seed_interval([v[i] for v in values]) for i in range(len(RATES))]
            rows.append(f"| {label} | {n} | {name} | " + " | ".join(cells) + " | "
                        + ", ".join(f"{v[-1]:.2f}" for v in values) + " |")
        for other in ("untuned", "nearest training record (no LLM)"):
            gains = [seed_interval([round(a[i] - b[i], 9) + 0.0 for a, b in zip(per_model["LoRA-tuned"], per_model[other])],
                                   True) for i in range(len(RATES))]
            rows.append(f"| {label} | {n} | LoRA-tuned - {other} (paired) | " + " | ".join(gains) + " | - |")
    seeds = " ".join(map(str, args.seeds))
    publish("tool_llm_learning", "Tool LLM quickstart: untuned vs LoRA-tuned", f"cpu: {machine()}",
            f"GPT4Tools success rates (paper mode) of the quickstart's tiny Llama before and after LoRA tuning, and of "
            f"the nearest-training-record control (no LLM), on each seed's held-out samples, seeds {seeds} (data and training; one model build): mean [95% t interval over "
            f"seeds]. Command: `python benchmarks/tool_llm_learning.py --seeds {seeds}`",
            ["samples", "n per seed", "model", *RATES, "SR per seed"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()
