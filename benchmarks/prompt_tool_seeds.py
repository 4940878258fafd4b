"""The prompt tools' quickstarts over data and training seeds: what each prompt pool adds against the unmodified tool
and against control policies (a pool of random prompts, an untuned token...), with intervals from the seed-to-seed
variation.

For each tool whose benchmark settings carry a seed measurement (``SEEDS`` in the module its recipe's ``benchmark``
names: :class:`~clova_train.tools.benchmark_settings.SeedMeasurement`) and each seed ``s``, the recipe's quickstart
config is fitted with its data rendered by ``s`` (``--data.init_args.render_seed=s``, and the measurement's other
seeded data arguments: grounding's ``split_seed``) and its prompts initialised by ``s`` (``--seed_everything=s``),
exported, and measured the way ``make demo-<tool>`` measures it, on images never trained or gated on, through the
serving code (``PromptToolServer``). The shipped measurements:

* VQA: exact-match accuracy on the run's ``eval.jsonl`` per answer group (the colours the tiny BLIP has to learn,
  the colours it knows, all, and each answer), without prompts, with the pool, with the random-prompt pool (every
  prompt replaced by a random one of its norm: the same retrieval, nothing learned);
* LOC / SEG: the share of the held-out images of the concept found (LOC: its box at mean IoU above ``gate_iou``;
  SEG: every mask covered at IoU >= ``gate_iou``) without prompts, with the pool as served and with the random-prompt
  pool under the same rule; over all images, those the unmodified tool finds (what the pool can lose) and those it
  misses; and how many images the served pool prompts. SEG is served by the paper's rule (the concept's prompts
  under which it scores above ``score_threshold``, ensembled); LOC at the ``detection_margin`` its calibration
  chose on validation scenes rendered with seeds the run never used (``clova_train.tools.loc.margin``: until the
  unmodified detector has found 149), and also under the paper's rule alone;
* REPLACE: the distance of a repainted region's mean colour from the concept's colour (RGB, lower is better) over
  24 new green squares repainted as the concept (repaint seeds ``s``..), with the words, the exported token, the
  untuned token, the ungated pool (every tuned token) and a random token of the exported token's norm.

A tool without a seed measurement (CLIP has its own seeded benchmarks; a plug-in may have none) is skipped with a
printed line. The tiny models are built once, where the quickstart configs expect them, by ``clova-train tiny-model``
in a process started with the recipe's build environment (as ``make demo-<tool>`` builds them), and shared by every
seed: the seeds vary data and training, not the pretrained tool. Runs use ATen's portable kernels, as the demos do.

    python benchmarks/prompt_tool_seeds.py [--tools vqa loc seg replace] [--seeds 0 1 2 3 4] [--runs-dir DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # before torch loads: the demos' kernels

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

from clova_train.quickstart.demo import quickstart_paths  # noqa: E402
from clova_train.tools.benchmark_settings import SeedMeasurement, seed_measurement  # noqa: E402
from clova_train.tools.recipes import ToolRecipe, tool_recipe, tool_recipes  # noqa: E402


def quickstart_config(recipe: ToolRecipe) -> Path:
    """The recipe's quickstart config (relative to the repository, or absolute)."""
    return REPO / recipe.quickstart_config


def build_model(recipe: ToolRecipe) -> None:
    """The tool's tiny model where its quickstart config expects it, built unless it exists."""
    model_dir, _ = quickstart_paths(dataclasses.replace(recipe, quickstart_config=str(quickstart_config(recipe))))
    model_dir = REPO / model_dir
    if model_dir.is_dir() and any(model_dir.iterdir()):
        return
    clova_train("tiny-model", recipe.tiny_model.kind, str(model_dir), env=dict(recipe.tiny_model.environment))


def fit_and_export(recipe: ToolRecipe, measurement: SeedMeasurement, seed: int, runs: Path) -> Path:
    """Fit and export one seed's run (reusing a finished one); the export directory."""
    tool = recipe.name
    run_dir = runs / f"{tool}-{seed}"
    export = run_dir / "export"
    if (export / "export.json").is_file():
        return export
    overrides = [f"--data.init_args.render_seed={seed}", f"--data.init_args.root={runs / f'data-{tool}-{seed}'}",
                 *(f"--data.init_args.{name}={seed}" for name in measurement.seeded_data)]
    clova_train("fit", "--config", str(quickstart_config(recipe)), f"--seed_everything={seed}",
                f"--trainer.default_root_dir={run_dir}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                "--model.init_args.keep_rejected_prompts=true", "--model.init_args.on_existing_pool=overwrite",
                *overrides)
    clova_train("export", str(run_dir), "--output", str(export))
    return export


def measure(measurement: SeedMeasurement, export: Path, seed: int) -> dict[str, dict[str, float]]:
    """group -> column -> score of one seed's export, and how many prompts the run accepted."""
    from clova_train.tools.prompt_server import PromptToolServer

    server = PromptToolServer.from_export(export)
    accepted = float(json.loads((export.parent / "summary.json").read_text())["accepted"])
    return {**measurement.measure(server, export, seed), "prompts accepted": {"count": accepted}}


def table_rows(tool: str, measurement: SeedMeasurement, per_seed: list[dict[str, dict[str, float]]]) -> list[str]:
    """One row per group and column: mean [t interval], paired difference against the first column, per seed; then
    the learned prompts against each control (the measurement's ``contrasts``), paired per seed."""
    rows = []
    reference_column = measurement.columns[0]
    limits = (0.0, 1.0) if measurement.bounded else None
    for name in per_seed[0]:
        if name == "prompts accepted":
            counts = [int(s[name]["count"]) for s in per_seed]
            rows.append(f"| {tool} | prompts accepted | - | - | - | {', '.join(map(str, counts))} |")
            continue
        if reference_column not in per_seed[0][name]:  # quantities, not policies (the served operating point)
            for quantity in per_seed[0][name]:
                values = [s[name][quantity] for s in per_seed]
                rows.append(f"| {tool} | {name} | {quantity} | {seed_interval(values, limits=None)} | - | "
                            f"{', '.join(f'{v:g}' for v in values)} |")
            continue
        reference = [s[name][reference_column] for s in per_seed]
        for column in measurement.columns:
            values = [s[name][column] for s in per_seed]
            difference = "-" if column == reference_column else seed_interval(
                [round(a - b, 9) + 0.0 for a, b in zip(values, reference)], True, limits)
            rows.append(f"| {tool} | {name} | {column} | {seed_interval(values, limits=limits)} | {difference} | "
                        f"{', '.join(measurement.score_format.format(v) for v in values)} |")
        for learned, control in measurement.contrasts:
            differences = [round(s[name][learned] - s[name][control], 9) + 0.0 for s in per_seed]
            rows.append(f"| {tool} | {name} | {learned} - {control} | - | {seed_interval(differences, True, limits)} | "
                        f"{', '.join(f'{v:+.2f}' for v in differences)} |")
    return rows + served_rows(tool, measurement, per_seed)


def served_rows(tool: str, measurement: SeedMeasurement, per_seed: list[dict[str, dict[str, float]]]) -> list[str]:
    """With an ``operating point`` group that says how many items the served pool changed (the measurement's
    ``changed``): how many seeds' served pools answer anything differently from the unmodified tool, and the served
    pool's gain on ``all`` over those seeds."""
    changed = measurement.changed
    if changed is None or "operating point" not in per_seed[0] or "all" not in per_seed[0]:
        return []
    differs = [k for k, s in enumerate(per_seed) if s["operating point"].get(changed, 0) > 0]
    unmodified, served = measurement.columns[0], measurement.columns[1]
    gains = [round(per_seed[k]["all"][served] - per_seed[k]["all"][unmodified], 9) + 0.0 for k in differs]
    return [f"| {tool} | all | seeds whose {served} differs from the {unmodified} tool | - | - | {len(differs)} of "
            f"{len(per_seed)} |",
            f"| {tool} | all | {served} - {unmodified}, seeds where it differs | - | "
            f"{seed_interval(gains, True) if gains else '-'} | {', '.join(f'{v:+.2f}' for v in gains) or '-'} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seeded_run_arguments(parser, "data and training seeds")
    recipes = tool_recipes()
    parser.add_argument("--tools", nargs="+", choices=list(recipes), default=list(recipes),
                        help="which quickstarts (default: every tool; those without a seed measurement are skipped)")
    args = parser.parse_args()
    with runs_directory(args.runs_dir) as runs:
        for tool in args.tools:
            recipe = tool_recipe(tool)
            measurement = seed_measurement(recipe)
            if measurement is None:
                print(f"{tool}: skipped, its recipe's benchmark settings have no seed measurement", flush=True)
                continue
            build_model(recipe)
            per_seed = [measure(measurement, fit_and_export(recipe, measurement, s, runs), s) for s in args.seeds]
            seeds = " ".join(map(str, args.seeds))
            publish("prompt_tool_seeds", "Prompt tools' pools over seeds", f"{tool}, cpu: {machine()}",
                    f"{measurement.metric} on held-out images of `{recipe.quickstart_config}`, seeds {seeds} (data "
                    f"and training; one tiny model build): mean [95% t interval over seeds]; differences paired per "
                    f"seed against the {measurement.columns[0]!r} column. Command: "
                    f"`python benchmarks/prompt_tool_seeds.py --tools {tool} --seeds {seeds}`",
                    ["tool", "group", "policy", "score", "difference", "per seed"],
                    table_rows(tool, measurement, per_seed), record=not args.no_record)


if __name__ == "__main__":
    main()
