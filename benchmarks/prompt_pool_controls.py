"""What the CLIP quickstart's prompt pool adds, against controls, on held-out test images; and what the
validation gate adds when training labels are noisy (CLOVA Table 4's direction), in one run.

Two fits of ``configs/quickstart/clip_prompt.yaml`` (the tiny CLIP, synthetic colour concepts; the tiny CLIP
was pretrained on red, green, blue and yellow only, so purple and orange are the concepts it has to learn):

* ``clean``: the quickstart as shipped;
* ``noisy``: the same with ``label_noise`` of the training labels flipped to another learned concept (the
  gates still validate on each labelled concept's clean held-out images).

Both keep their rejected prompts, so that each is then tested (``clova-train test``, the quickstart's rendered
test set, never used in training or gating) with every column on the same images: the unmodified CLIP, the
gated pool, the zero-prompt control (the pool's entries with every prompt zero), and the ungated pool (every
tuned prompt, rejected ones included). Means with 95% Wilson intervals, and the paired difference pool -
zero-prompt with its normal interval.

Targets (issue 13): on the held-out concepts the learned prompts beat the zero-prompt control by >= 10 points;
with noisy labels the gated pool beats the ungated one.

    python benchmarks/prompt_pool_controls.py [--label-noise 0.2] [--override KEY=VALUE ...] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import machine, publish  # noqa: E402

CONFIG = REPO / "configs/quickstart/clip_prompt.yaml"
HELD_OUT = ("purple", "orange")
COLUMNS = ("accuracy_no_prompt", "accuracy_pool", "accuracy_zero_prompt", "accuracy_ungated")


def run(name: str, workdir: Path, label_noise: float, overrides: list[str]) -> dict:
    """Fit and test one setting; the test report of its run directory."""
    run_dir = workdir / name
    common = ["--config", str(CONFIG), f"--trainer.default_root_dir={run_dir}",
              "--trainer.logger=false", "--model.init_args.keep_rejected_prompts=true",
              f"--data.init_args.label_noise={label_noise}", *(f"--{o}" for o in overrides)]
    clova_train("fit", *common, "--model.init_args.on_existing_pool=overwrite")
    clova_train("test", *common, f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")
    report = json.loads((run_dir / "evaluation" / "test.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"report": report, "summary": summary}


def cell(entry: dict, column: str) -> str:
    value = entry.get(column)
    if value is None:
        return "-"
    low, high = value["ci95"]
    sign = "+" if " - " in column else ""
    return f"{value['mean']:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


def held_out_entry(report: list[dict]) -> dict:
    """Pool the held-out concepts' samples: weighted means; intervals recomputed from the counts."""
    from clova_train.core.evaluation_report import wilson_interval

    entries = [e for e in report if e["concept"] in HELD_OUT]
    n = sum(e["n"] for e in entries)
    merged: dict = {"concept": "+".join(HELD_OUT), "n": n}
    for column in COLUMNS:
        if all(column in e for e in entries):
            hits = sum(e[column]["mean"] * e["n"] for e in entries)
            merged[column] = {"mean": hits / n, "ci95": list(wilson_interval(hits, n))}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label-noise", type=float, default=0.2, help="share of flipped training labels (noisy)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both fits, e.g. data.init_args.val_per_concept=4 (repeatable)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {"clean": run("clean", Path(tmp), 0.0, args.override), f"noisy ({args.label_noise:.0%} flipped)":
                   run("noisy", Path(tmp), args.label_noise, args.override)}
    rows = []
    for setting, result in results.items():
        report = result["report"]["per_concept"]
        summary = result["summary"]
        for entry in [*report[:-1], held_out_entry(report), report[-1]]:
            difference = next((k for k in entry if " - " in k), None)
            rows.append(f"| {setting} | {entry['concept']} | {entry['n']} | "
                        + " | ".join(cell(entry, c) for c in COLUMNS)
                        + f" | {cell(entry, difference) if difference else '-'} |")
        rows.append(f"| {setting} | (pool) | accepted {summary['accepted']} of {summary['tried']} | | | | | |")
    publish("prompt_pool_controls", "CLIP prompt pool against controls", f"cpu: {machine()}",
            "Test-set CLASSIFY accuracy, mean [95% interval], of the quickstart (`configs/quickstart/clip_prompt.yaml`), "
            "clean and with flipped training labels; zero prompt: the pool's entries with every prompt zero; "
            "ungated: every tuned prompt, rejected ones included. Command: `python benchmarks/prompt_pool_controls.py"
            + "".join(f" --override {o}" for o in args.override) + "`",
            ["training labels", "concept", "test images", "no prompt", "pool (gated)", "zero-prompt control",
             "ungated pool", "pool - zero prompt"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()
