"""The report's pictures (matplotlib, no display needed). Each function draws one figure into ``path`` and returns
the markdown table of the numbers it shows, so the page reads without the pictures too."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from clova_train.report.runs import Series

ACCEPTED, REJECTED, UNTUNED = "#2a7f3f", "#b8322a", "#9a9a9a"
MAX_WIDTH_INCHES = 40.0  # matplotlib refuses images over 2**16 pixels a side; wide tables stay in the page
MAX_CURVES_DRAWN = 300  # per group: thousands of thin lines only slow the drawing
MAX_CONCEPTS_DRAWN = 60  # bars in the gate picture; the table lists every concept


METRIC_WORDS = {
    "rollout/ep_rew_mean": "mean return of training episodes",
    "rollout/accuracy": "accuracy of training episodes",
    "eval/accuracy": "trained controller",
    "train/loss": "training loss",
    "SR_t": "SR_t (decided to use a tool, or not, rightly)",
    "SR_act": "SR_act (right tool)",
    "SR_args": "SR_args (right arguments)",
    "SR": "SR (the whole step right)",
}
TITLE_CHARACTERS = 70  # a title longer than this is wrapped onto more lines, never cut


def metric_words(name: str) -> str:
    """A logged metric's key (``eval/baseline_question_rule_accuracy``, ``val/seen/SR``) in words for a legend."""
    if name in METRIC_WORDS:
        return METRIC_WORDS[name]
    baseline = re.fullmatch(r"eval/baseline_(.+)_accuracy", name)
    if baseline:
        return baseline.group(1).replace("_", " ")
    grouped = re.fullmatch(r"(val|test)/([^/]+)/([^/]+)", name)
    if grouped:
        stage, group, metric = grouped.groups()
        words = {"val": "validation", "test": "test"}[stage]
        return f"{METRIC_WORDS.get(metric, metric)}, {group.replace('_', ' ')} ({words})"
    return name.rsplit("/", 1)[-1].replace("_", " ")


def _title(text: str, width: int = TITLE_CHARACTERS) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def _figure(width: float, height: float) -> tuple[Figure, Any]:
    """A figure of its own (no pyplot, no global backend change: a notebook importing this keeps its plots)."""
    figure = Figure(figsize=(min(width, MAX_WIDTH_INCHES), height))
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _save(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def instance_learning_curves(instances: list[dict[str, Any]], path: Path) -> str:
    """Each tuned instance's loss at every inner step (thin), and the median of accepted and of rejected ones."""
    figure, axes = _figure(7, 4)
    rows = []
    drawn = [item["loss_curve"] for item in instances if item.get("loss_curve")]
    for accepted, colour, label in ((True, ACCEPTED, "accepted"), (False, REJECTED, "rejected")):
        curves = [item["loss_curve"] for item in instances if item.get("loss_curve") and item["accepted"] == accepted]
        for curve in curves[:: max(1, len(curves) // MAX_CURVES_DRAWN)]:
            axes.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.15, linewidth=0.8)
        if curves:
            length = max(len(c) for c in curves)
            # An instance that stopped early (its prompt passed the quick gate) keeps its last loss, so the median
            # over the later steps is not the median of the slow instances alone.
            padded = np.array([c + [c[-1]] * (length - len(c)) for c in curves], dtype=float)
            median = np.median(padded, axis=0)
            axes.plot(range(1, length + 1), median, color=colour, linewidth=2.2, label=f"{label} (median of {len(curves)})")
            rows.append([label, len(curves), float(np.median([c[0] for c in curves])),
                         float(np.median([c[-1] for c in curves])), float(np.median([len(c) for c in curves]))])
    axes.set(xlabel="inner optimisation step of the instance", ylabel="instance loss (the tool's training loss)",
             title=_title("Each instance's learning curve (a stopped one keeps its last loss in the median)"))
    if drawn and all(min(c) > 0 for c in drawn):
        axes.set_yscale("log")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if rows:
        axes.legend()
    _save(figure, path)
    return table(["instances", "count", "median first loss", "median last loss", "median steps"], rows)


def gate_acceptance(instances: list[dict[str, Any]], path: Path) -> str:
    """Accepted and rejected instances per concept, and the rejection reasons; instances stored without tuning (a
    zero prompt: the tool was already right, e.g. VQA's ``correct`` records) are counted apart, not as accepted."""
    def name(item: dict[str, Any]) -> str:  # a tool without concepts (VQA) stores every prompt under None
        return "(all)" if item.get("concept") is None else str(item["concept"])

    tally: dict[str, Counter] = {}
    reasons: dict[str, Counter] = {}
    for item in instances:  # one pass: a summary may hold a hundred thousand concepts
        counts = tally.setdefault(name(item), Counter())
        tuned = item.get("steps", 1) > 0
        counts["untuned"] += not tuned
        counts["accepted"] += item["accepted"] and tuned
        counts["rejected"] += not item["accepted"]
        reasons.setdefault(name(item), Counter()).update(r["kind"] for r in item.get("rejections", []))
    concepts = sorted(tally)
    # the picture shows the concepts with most instances (a bar each); the table below lists every concept
    drawn = sorted(sorted(concepts, key=lambda c: -sum(tally[c].values()))[:MAX_CONCEPTS_DRAWN])
    accepted = [tally[c]["accepted"] for c in drawn]
    rejected = [tally[c]["rejected"] for c in drawn]
    untuned = [tally[c]["untuned"] for c in drawn]
    figure, axes = _figure(max(4, 0.9 * len(drawn) + 2), 3.6)
    ticks = [textwrap.fill(c, 12) for c in drawn]  # long names wrapped onto lines, never cut
    axes.bar(ticks, accepted, color=ACCEPTED, label="accepted")
    axes.bar(ticks, rejected, bottom=accepted, color=REJECTED, label="rejected")
    if any(untuned):
        axes.bar(ticks, untuned, bottom=np.add(accepted, rejected), color=UNTUNED, label="stored without tuning")
    shown = "" if len(drawn) == len(concepts) else f" ({len(drawn)} of {len(concepts)} concepts, most instances)"
    axes.set(xlabel="concept", ylabel="tuned instances (count)", title=_title(f"Validation gate per concept{shown}"))
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
    axes.set_ylim(0, max([a + r + u for a, r, u in zip(accepted, rejected, untuned)] + [1]) * 1.1)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # beside the bars, never over them
    axes.tick_params(axis="x", labelsize=8)
    _save(figure, path)
    rows = []
    for concept in concepts:
        yes, no, kept = tally[concept]["accepted"], tally[concept]["rejected"], tally[concept]["untuned"]
        rows.append([concept, yes + no, yes, yes / (yes + no) if yes + no else 0.0, kept,
                     ", ".join(f"{kind} ({n})" for kind, n in reasons[concept].most_common(3)) or "-"])
    return table(["concept", "tuned", "accepted", "share", "stored without tuning", "rejections"], rows)


def per_concept_evaluation(evaluation: dict[str, Any], path: Path) -> str:
    """Each evaluation column (unmodified tool, pool, controls) per concept, with its 95% interval; the paired
    differences in the table."""
    entries = evaluation.get("per_concept") or []
    columns = sorted({k for e in entries for k, v in e.items() if isinstance(v, dict) and "mean" in v and " - " not in k})
    differences = sorted({k for e in entries for k, v in e.items() if isinstance(v, dict) and " - " in k})
    concepts = [str(e.get("concept")) for e in entries]
    figure, axes = _figure(max(5, 1.2 * len(concepts) + 2), 3.8)
    width = 0.8 / max(len(columns), 1)
    for j, column in enumerate(columns):
        means = np.array([e.get(column, {}).get("mean", np.nan) for e in entries], dtype=float)
        low = np.array([e.get(column, {}).get("ci95", [np.nan, np.nan])[0] for e in entries], dtype=float)
        high = np.array([e.get(column, {}).get("ci95", [np.nan, np.nan])[1] for e in entries], dtype=float)
        axes.bar(np.arange(len(concepts)) + j * width, means, width, label=column.replace("_", " "),
                 yerr=np.vstack([means - low, high - means]), capsize=2)
    axes.set_xticks(np.arange(len(concepts)) + 0.4 - width / 2, concepts, rotation=30, ha="right")
    axes.set(ylim=(0, 1.05), xlabel="concept", ylabel="accuracy (0-1)",
             title=_title(f"{evaluation.get('stage', 'evaluation')}: accuracy per concept, with 95% intervals"))
    axes.legend(fontsize=7)
    _save(figure, path)

    def shown(entry: dict[str, Any], key: str) -> str:
        value = entry.get(key)
        if not isinstance(value, dict):
            return "-"
        low, high = value.get("ci95", [float("nan")] * 2)
        return f"{value['mean']:+.3f} [{low:+.3f}, {high:+.3f}]" if " - " in key else f"{value['mean']:.3f}"

    rows = [[str(e.get("concept")), e.get("n", "-"), *(shown(e, k) for k in columns + differences)] for e in entries]
    return table(["concept", "n", *columns, *differences], rows)


def curves(series: dict[str, Series], names: list[str], path: Path, xlabel: str, title: str, ylabel: str,
           right: tuple[str, str] | None = None) -> str:
    """Line plot of the named series, named in words (:func:`metric_words`); ``right``: (a series' name, its axis
    label) drawn against an axis of its own on the right, for a series on another scale (a return beside an
    accuracy). The table gives each one's first, best and last value."""
    figure, axes = _figure(7, 4)
    other = axes.twinx() if right is not None and right[0] in names else None
    rows, lines = [], []
    for name in names:
        if name in series and series[name].y:
            s = series[name]
            target, style = (other, "--") if other is not None and name == right[0] else (axes, "-")
            lines += target.plot(s.x, s.y, style, marker="o" if len(s.y) < 30 else None, markersize=3,
                                 label=metric_words(name))
            rows.append([name, len(s.y), s.y[0], max(s.y), s.y[-1]])
    axes.set(xlabel=xlabel, ylabel=ylabel, title=_title(title))
    if other is not None:
        other.set_ylabel(right[1])
    if lines:
        axes.legend(lines, [line.get_label() for line in lines], fontsize=7)
    _save(figure, path)
    return table(["metric", "points", "first", "highest", "last"], rows)


def grouped_last_values(series: dict[str, Series], prefix: str, path: Path, title: str) -> str:
    """The last value of every ``<prefix>/<group>/<metric>`` series, bars grouped by group (LoRA: SR per group)."""
    found: dict[str, dict[str, float]] = {}
    for name, s in series.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == prefix and parts[2] != "samples" and s.y:
            found.setdefault(parts[1], {})[parts[2]] = s.y[-1]
    groups = sorted(found)
    metrics = sorted({m for values in found.values() for m in values})
    figure, axes = _figure(max(5, 1.4 * len(groups) + 2), 3.8)
    width = 0.8 / max(len(metrics), 1)
    for j, metric in enumerate(metrics):
        axes.bar(np.arange(len(groups)) + j * width, [found[g].get(metric, np.nan) for g in groups], width,
                 label=METRIC_WORDS.get(metric, metric))
    axes.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, [g.replace("_", " ") for g in groups])
    axes.set(ylim=(0, 1.05), xlabel="sample group", ylabel="success rate (0-1)", title=_title(title))
    if metrics:
        axes.legend(fontsize=7)
    _save(figure, path)
    return table(["group", *metrics], [[g, *(found[g].get(m, "-") for m in metrics)] for g in groups])


def policy_comparison(evaluation: dict[str, Any], path: Path, tasks: str = "test tasks") -> str:
    """Accuracy of the trained controller and of every rule and control on ``tasks`` (the test split)."""
    policies = sorted(evaluation, key=lambda name: evaluation[name].get("accuracy", 0.0))
    accuracy = [float(evaluation[p].get("accuracy", np.nan)) for p in policies]
    names = [textwrap.fill(p, 48) for p in policies]  # wrapped, never cut
    height = 0.28 * sum(name.count("\n") + 1 for name in names) + 0.2 * len(names) + 1.5
    figure, axes = _figure(10, min(height, MAX_WIDTH_INCHES))
    colours = [ACCEPTED if p == "trained controller" else "#5b6f8f" for p in policies]
    axes.barh(names, accuracy, color=colours)
    axes.tick_params(axis="y", labelsize=7)
    axes.set(xlim=(0, 1.05), xlabel=f"accuracy on the {tasks} (0-1)", ylabel="policy",
             title="Trained controller and controls")
    _save(figure, path)
    keys = ("accuracy", "steps", "rejects", "llm_calls", "return")
    return table(["policy", *keys], [[p, *(evaluation[p].get(k, "-") for k in keys)] for p in reversed(policies)])
