"""What LoRA tuning teaches the tool-LLM quickstart's tiny Llama, against the untuned model and no-LLM controls, over
seeds, on requests written from templates no training request was written from.

For each seed ``s`` the quickstart (``configs/quickstart/tool_llm_lora.yaml``) is fitted on data rendered with
``s`` (``--data.init_args.render_seed=s``: other scenes and conversations, and another template split) and trained
with ``--seed_everything=s`` (LoRA initialisation, dropout, order). The data module splits by request template, and
by tool for the unseen tools (``clova_train.datamodules.tool_llm.template_split``): training, validation (the run's
own checks; the quickstart's settings were chosen there) and test, reported here once. The untuned model (the
same PEFT model with its LoRA B matrices at zero, i.e. the pretrained base) and the tuned one (``last.ckpt``: no
checkpoint is chosen) are scored on that seed's test file: seen tools (test templates), unseen tools (the test
share of GPT4Tools Table 6, never trained on) and no-tool samples (test chit-chat).
Beside them, on the same records, the nearest-record controls (``clova_train.tooluse.retrieval_baseline``: the
response of the training record whose request shares the most words, with image paths and request words carried
over; they read everything the LLM reads and learn from the same training file, with no language model):

* plain: the neighbour's tool as it is;
* + renaming rule (hand-written): a tool the prompt does not list becomes the listed one whose name is most alike;
* + tool descriptions (learned): ... the listed one whose description is most alike the request, by word
  associations learned from the training records.

SR_t / SR_act / SR_args / SR per group (paper mode): the mean over seeds with a 95% Student t interval from the
seed-to-seed variation, and the paired per-seed differences tuned - untuned and tuned - each control. One
tiny-model build for every seed.
Target (issue 13): seen-tool SR >= 0.6 and unseen-tool SR >= 0.3 after tuning, from near 0 before.

    python benchmarks/tool_llm_learning.py [--seeds 0 1 2 3 4] [--runs-dir DIR] [--model DIR] [--no-record]
    python benchmarks/tool_llm_learning.py --controls-only   # the controls alone, seconds per seed, no LLM

The model directory is built with ``clova-train tiny-model llama`` first if it is missing (about 8 minutes
on 2 cores); each seed takes about 5 minutes (fit and two evaluations).
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
GROUPS = (("test", "seen", "seen tools (test templates)"), ("test", "unseen", "unseen tools (test tools)"),
          ("test", "no_tool", "no tool (test chit-chat)"))
RATES = ("SR_t", "SR_act", "SR_args", "SR")
CONTROLS = {"copy": "nearest training record (no LLM)",
            "renaming rule": "nearest record + renaming rule (hand-written)",
            "descriptions": "nearest record + tool descriptions (learned)"}


def evaluate(stage: str, common: list[str], logs: Path, name: str, checkpoint: Path | None) -> dict[str, float]:
    """``clova-train validate`` / ``test`` with a CSV logger; the logged metrics of that run."""
    logger = logs / f"{name}.yaml"
    logger.write_text(json.dumps({"trainer": {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                         "init_args": {"save_dir": str(logs), "name": name}}}}))
    clova_train(stage, *common, "--config", str(logger), *([f"--ckpt_path={checkpoint}"] if checkpoint else []))
    with (logs / name / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return {k: float(v) for row in rows for k, v in row.items() if v not in ("", None) and "/" in k}


def counts(data_root: Path) -> Counter:
    """Test samples per (split, group), grouped as the metric groups them (seen: tools of the training file)."""
    from clova_train.tooluse.metrics import ToolUsageSuccessRate

    metric = ToolUsageSuccessRate(seen_tools=trained_tools(data_root))
    return Counter(("test", metric.category(record["output"]))
                   for record in json.loads((data_root / "test.json").read_text()))


def trained_tools(data_root: Path) -> list[str]:
    """The tools the training file calls (what the LLM's metrics call seen)."""
    from clova_train.tooluse.react import parse_react

    records = json.loads((data_root / "train.json").read_text())
    return sorted({step.action for r in records for step in parse_react(r["output"]).tool_steps})


def control_metrics(data_root: Path) -> dict[str, dict[str, float]]:
    """Each nearest-record control's rates on the test split, keyed as the LLM's logged metrics."""
    from clova_train.tooluse.metrics import ToolUsageSuccessRate
    from clova_train.tooluse.retrieval_baseline import NearestRecordBaseline

    train = json.loads((data_root / "train.json").read_text())
    records = json.loads((data_root / "test.json").read_text())
    seen = trained_tools(data_root)
    metrics = {}
    for choice in CONTROLS:
        baseline = NearestRecordBaseline(train, tool_choice=choice)
        rates = ToolUsageSuccessRate("paper", seen)
        rates.update([baseline.predict(r) for r in records], [r["output"] for r in records])
        metrics[choice] = {f"test/{k}": float(v) for k, v in rates.compute().items()}
    return metrics


def render_data(seed: int, runs: Path) -> Path:
    """The quickstart's data for ``seed`` (for the controls alone: no model, no tokenizer read)."""
    import yaml

    from clova_train.datamodules import SyntheticToolDataModule

    data = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]
    root = runs / f"seed-{seed}" / "data"
    keys = ("conversations_per_tool", "eval_conversations_per_tool", "negatives", "tools_per_prompt")
    SyntheticToolDataModule(str(root), "unused", render_seed=seed, **{k: data[k] for k in keys}).prepare_data()
    return root


def run_seed(model: Path, seed: int, runs: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Test metrics before and after tuning of one seed's run (reused when it finished under this data layout)."""
    from clova_train.datamodules import SyntheticToolDataModule

    work = runs / f"seed-{seed}"
    done = work / "metrics.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved.get("layout") == SyntheticToolDataModule.SPLIT_LAYOUT:
            return saved["before"], saved["after"]
        raise SystemExit(f"{work} holds a run on data of another split layout: remove it or choose another --runs-dir")
    work.mkdir(parents=True, exist_ok=True)
    common = ["--config", str(CONFIG), f"--model.init_args.model_name_or_path={model}",
              f"--data.init_args.tokenizer={model}", f"--data.init_args.root={work / 'data'}",
              f"--data.init_args.render_seed={seed}", f"--seed_everything={seed}",
              f"--trainer.default_root_dir={work / 'run'}", "--trainer.enable_progress_bar=false"]
    before = evaluate("test", common, work, "before_test", None)
    clova_train("fit", *common, "--trainer.logger=false")
    after = evaluate("test", common, work, "after_test", work / "run" / "checkpoints" / "last.ckpt")
    done.write_text(json.dumps({"layout": SyntheticToolDataModule.SPLIT_LAYOUT, "before": before, "after": after}))
    return before, after


def table_rows(results: list[dict[str, dict[str, float]]], sizes: list[Counter], learner: str | None) -> list[str]:
    """Markdown rows: per group, each model's rates over seeds and (with a ``learner``) its paired differences."""
    names = list(results[0])
    rows = []
    for split, group, label in GROUPS:
        n = ", ".join(str(size[split, group]) for size in sizes)
        per_model = {name: [[r[name].get(f"{split}/{group}/{rate}", float("nan")) for rate in RATES] for r in results]
                     for name in names}
        for name, values in per_model.items():
            cells = [seed_interval([v[i] for v in values]) for i in range(len(RATES))]
            rows.append(f"| {label} | {n} | {name} | " + " | ".join(cells) + " | "
                        + ", ".join(f"{v[-1]:.2f}" for v in values) + " |")
        for other in [name for name in names if name != learner] if learner else []:
            gains = [seed_interval([round(a[i] - b[i], 9) + 0.0 for a, b in zip(per_model[learner], per_model[other])],
                                   True) for i in range(len(RATES))]
            rows.append(f"| {label} | {n} | {learner} - {other} (paired) | " + " | ".join(gains) + " | - |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/models/tiny-llama", help="base model directory")
    parser.add_argument("--controls-only", action="store_true",
                        help="score the no-LLM controls alone (no model build, no fit), seconds per seed")
    add_seeded_run_arguments(parser, "data and training seeds")
    args = parser.parse_args()
    model = (REPO / args.model).resolve()
    if not args.controls_only and not (model / "config.json").is_file():
        clova_train("tiny-model", "llama", str(model))
    results, sizes = [], []
    with runs_directory(args.runs_dir) as runs:
        for seed in args.seeds:
            llm = {}
            if not args.controls_only:
                before, after = run_seed(model, seed, runs)
                llm = {"untuned": before, "LoRA-tuned": after}
            root = runs / f"seed-{seed}" / "data"
            if args.controls_only:
                render_data(seed, runs)
            controls = control_metrics(root)
            results.append({**llm, **{CONTROLS[choice]: metrics for choice, metrics in controls.items()}})
            sizes.append(counts(root))
    rows = table_rows(results, sizes, None if args.controls_only else "LoRA-tuned")
    seeds = " ".join(map(str, args.seeds))
    flags = " --controls-only" if args.controls_only else ""
    seeded = "data and template split" if args.controls_only else "data, template split and training; one model build"
    what = ("the nearest-training-record controls (no LLM; no LLM was run)" if args.controls_only else
            "the quickstart's tiny Llama before and after LoRA tuning, and of the nearest-training-record controls (no LLM)")
    publish("tool_llm_learning", "Tool LLM quickstart: untuned vs LoRA-tuned", f"cpu: {machine()}",
            f"GPT4Tools success rates (paper mode) of {what}, on each seed's test file (requests from templates, and "
            f"unseen tools, that neither training nor validation holds), seeds {seeds} ({seeded}): mean [95% t "
            f"interval over seeds]. Command: `python benchmarks/tool_llm_learning.py{flags} "
            f"--seeds {seeds}`",
            ["samples", "n per seed", "model", *RATES, "SR per seed"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()
