"""``report.md`` and its pictures for one run directory (written to ``<run>/report/`` unless told otherwise,
staged and swapped in whole, so a rerun replaces the old report and a failed one leaves it as it was)."""

from __future__ import annotations

import os
from pathlib import Path

from clova_train.core.errors import DataError
from clova_train.core.manifest import staged_directory
from clova_train.report import figures
from clova_train.report.runs import Run, read_run

CONTROLLER_CURVES = ("rollout/ep_rew_mean", "rollout/accuracy")
LORA_LOSS = ("train/loss", "loss")


def _section(title: str, picture: str | None, body: str, note: str = "") -> str:
    image = f"![{title}]({picture})\n\n" if picture else ""
    return f"## {title}\n\n{note + chr(10) + chr(10) if note else ''}{image}{body}\n"


def prompt_tuning_sections(run: Run, out: Path) -> list[str]:
    sections = []
    instances = (run.summary or {}).get("instances") or []
    if any(item.get("loss_curve") for item in instances):
        body = figures.instance_learning_curves(instances, out / "learning_curves.png")
        sections.append(_section("Learning curves", "learning_curves.png", body,
                                 "Each instance's prompt is tuned on its own; its loss at every inner step."))
    elif "loss" in run.metrics:
        body = figures.curves(run.metrics, ["loss"], out / "learning_curves.png", "chunk of instances",
                              "Mean final loss per chunk", "mean final loss")
        sections.append(_section("Learning curves", "learning_curves.png", body,
                                 "This run's summary has no per-step curves (written before they were recorded)."))
    if instances:
        body = figures.gate_acceptance(instances, out / "gate_acceptance.png")
        sections.append(_section("Validation gate per concept", "gate_acceptance.png", body))
    for stage, evaluation in run.evaluations.items():
        name = f"evaluation_{stage}.png"
        body = figures.per_concept_evaluation(evaluation, out / name)
        sections.append(_section(f"Evaluation ({stage}): the tool, the pool and the controls", name, body,
                                 "Differences are paired per sample, with Newcombe's interval."))
    return sections


def lora_sections(run: Run, out: Path) -> list[str]:
    sections = []
    loss = [name for name in LORA_LOSS if name in run.metrics]
    if loss:
        body = figures.curves(run.metrics, loss[:1], out / "learning_curves.png", "optimizer step", "Training loss",
                              "loss (mean token cross-entropy)")
        sections.append(_section("Learning curves", "learning_curves.png", body))
    for stage in ("val", "test"):
        if any(name.startswith(f"{stage}/") and name.count("/") == 2 for name in run.metrics):
            name = f"success_rates_{stage}.png"
            body = figures.grouped_last_values(run.metrics, stage, out / name,
                                               f"{stage}: GPT4Tools success rates per group (last evaluation)")
            sections.append(_section(f"Success rates per group ({stage})", name, body))
            over = sorted(n for n in run.metrics if n.startswith(f"{stage}/") and n.endswith("/SR") and n.count("/") == 2)
            if over and max(len(run.metrics[n].y) for n in over) > 1:
                picture = f"success_rates_{stage}_over_training.png"
                body = figures.curves(run.metrics, over, out / picture, "optimizer step", f"{stage} SR over training",
                                      "success rate (0-1)")
                sections.append(_section(f"Success rate over training ({stage})", picture, body))
    return sections


def controller_sections(run: Run, out: Path) -> list[str]:
    sections = []
    rollout = [name for name in CONTROLLER_CURVES if name in run.metrics]
    if rollout:
        body = figures.curves(run.metrics, rollout, out / "reward_curves.png", "environment steps",
                              "Training episodes: mean return and accuracy", "accuracy of training episodes (0-1)",
                              right=("rollout/ep_rew_mean", "mean episode return (reward units)"))
        sections.append(_section("Reward curves", "reward_curves.png", body))
    evaluation = sorted(n for n in run.metrics if n == "eval/accuracy" or (n.startswith("eval/baseline_")
                                                                          and n.endswith("_accuracy")))
    if evaluation:
        body = figures.curves(run.metrics, evaluation, out / "evaluation_curves.png", "environment steps",
                              "Periodic evaluation on the validation tasks: the controller and the rules beside it",
                              "accuracy on the validation tasks (0-1)")
        sections.append(_section("Evaluation curves", "evaluation_curves.png", body))
    for name, evaluation_table in run.evaluations.items():
        body = figures.policy_comparison(evaluation_table, out / "controls.png", name)
        sections.append(_section(f"Controls ({name})", "controls.png", body))
    return sections


SECTIONS = {"prompt_tuning": prompt_tuning_sections, "lora": lora_sections, "controller": controller_sections}
TITLES = {"prompt_tuning": "Prompt tuning", "lora": "LoRA tool-LLM fine-tuning", "controller": "DQN controller"}


def check_output(run_dir: Path, output: Path) -> None:
    """Refuse an output that would replace the run (or a folder holding it) or an unrelated non-empty folder: the
    report directory is replaced whole."""
    run, out = run_dir.resolve(), output.resolve()
    if run == out or run.is_relative_to(out):
        raise DataError(f"--output {output} would replace the run directory {run_dir}: give a folder of its own")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "report.md").is_file())):
        raise DataError(f"--output {output} exists and is not an earlier report (no report.md): it would be replaced; "
                        "give a new or empty folder")


def write_report(run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    """Write the report of ``run_dir`` to ``output`` (default ``<run_dir>/report``); returns ``report.md``'s path."""
    run = read_run(Path(run_dir))
    output = Path(output) if output is not None else run.directory / "report"
    check_output(run.directory, output)
    with staged_directory(output) as staging:
        sections = SECTIONS[run.kind](run, staging)
        if not sections:
            sections = ["Nothing to draw yet: the run has logged no metrics, summary or evaluation.\n"]
        (staging / "report.md").write_text(
            f"# {TITLES[run.kind]} run: {run.directory.name}\n\nRun directory: `{run.directory.resolve()}`\n\n"
            + "\n".join(sections))
    return output / "report.md"
