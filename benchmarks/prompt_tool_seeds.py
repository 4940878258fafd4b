"""The VQA, LOC, SEG and REPLACE quickstarts over data and training seeds: what each prompt pool adds against the
unmodified tool and against a control pool of random prompts, with intervals from the seed-to-seed variation.

For each tool and seed ``s``, ``configs/quickstart/<tool>_prompt.yaml`` is fitted with its data rendered and split
by ``s`` (``--data.init_args.render_seed=s``, grounding also ``split_seed=s``) and its prompts initialised by ``s``
(``--seed_everything=s``), exported, and measured the way ``make demo-<tool>`` measures it, on images never
trained or gated on, through the serving code (``PromptToolServer``):

* VQA: exact-match accuracy on the run's ``eval.jsonl`` per answer group (the colours the tiny BLIP has to learn,
  the colours it knows, all, and each answer), without prompts, with the pool, with the random-prompt pool (every prompt replaced
  by a random one of its norm: the same retrieval, nothing learned);
* LOC / SEG: the share of the held-out images of the concept found (LOC: its box at mean IoU above ``gate_iou``;
  SEG: every mask covered at IoU >= ``gate_iou``), the same three columns;
* REPLACE: the distance of a repainted region's mean colour from the concept's colour (RGB, lower is better) over
  24 new green squares repainted as the concept (repaint seeds ``s``..), with the words, the exported token, the
  untuned token, the ungated pool (every tuned token) and a random token of the exported token's norm.

The tiny models are built once (the Makefile's ``tiny-model`` commands) and shared by every seed: the seeds vary
data and training, not the pretrained tool. Runs use ATen's portable kernels, as the demos do.

    python benchmarks/prompt_tool_seeds.py [--tools vqa loc seg replace] [--seeds 0 1 2 3 4] [--runs-dir DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # before torch loads: the demos' kernels

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

TOOLS = {  # tool -> (quickstart config, the Makefile target that builds its tiny model)
    "vqa": ("vqa_prompt.yaml", "checkpoints/models/tiny-blip/config.json"),
    "loc": ("loc_prompt.yaml", "checkpoints/models/tiny-owlvit/config.json"),
    "seg": ("seg_prompt.yaml", "checkpoints/models/tiny-maskformer/config.json"),
    "replace": ("replace_prompt.yaml", "checkpoints/models/tiny-sd-inpaint/model_index.json"),
}
VQA_LEARNED = ("orange", "purple")  # the quickstart's learn_colours
REPAINT_IMAGES = 24


def build_model(tool: str) -> None:
    """The tool's tiny model, built by the Makefile's rule unless it exists."""
    target = TOOLS[tool][1]
    if (REPO / target).is_file():
        return
    done = subprocess.run(["make", "-o", ".venv/.installed", target], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building {target} failed:\n{done.stderr[-3000:]}")


def fit_and_export(tool: str, seed: int, runs: Path) -> Path:
    """Fit and export one seed's run (reusing a finished one); the export directory."""
    run_dir = runs / f"{tool}-{seed}"
    export = run_dir / "export"
    if (export / "export.json").is_file():
        return export
    overrides = [f"--data.init_args.render_seed={seed}", f"--data.init_args.root={runs / f'data-{tool}-{seed}'}"]
    if tool in ("loc", "seg"):
        overrides.append(f"--data.init_args.split_seed={seed}")
    clova_train("fit", "--config", str(REPO / "configs/quickstart" / TOOLS[tool][0]), f"--seed_everything={seed}",
                f"--trainer.default_root_dir={run_dir}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                "--model.init_args.keep_rejected_prompts=true", "--model.init_args.on_existing_pool=overwrite",
                *overrides)
    clova_train("export", str(run_dir), "--output", str(export))
    return export


def measure(tool: str, export: Path, seed: int) -> dict[str, dict[str, float]]:
    """group -> column -> score of one seed's export."""
    from clova_train.tools.prompt_server import PromptToolServer

    server = PromptToolServer.from_export(export)
    accepted = float(json.loads((export.parent / "summary.json").read_text())["accepted"])
    if tool == "vqa":
        from clova_train.tools.vqa.demo import _default_records, evaluate, read_eval_records

        table = evaluate(server, read_eval_records(_default_records(export)))
        groups = {"learned colours": [a for a in table if a in VQA_LEARNED],
                  "known colours": [a for a in table if a not in VQA_LEARNED], "all": list(table),
                  **{f"answer {a}": [a] for a in table}}
        scores = {}
        for name, answers in groups.items():
            total = sum(table[a][0] for a in answers)
            scores[name] = {column: sum(table[a][k] for a in answers) / total
                            for k, column in ((1, "no prompt"), (2, "pool"), (3, "random-prompt pool"))}
    elif tool in ("loc", "seg"):
        from clova_train.core.pool import control_pool
        from clova_train.tools.grounding.demo import eval_images

        concept, images = eval_images(export)
        control = PromptToolServer(server.tool, control_pool(server.pool, "random", seed), server.top_k)
        batch = [(image, concept) for image in images]
        with torch.no_grad():
            measured, random = server.tool.evaluate(server, batch), server.tool.evaluate(control, batch)
        plain_key, pool_key = server.tool.evaluation_metrics
        scores = {concept: {"no prompt": float(measured[plain_key].float().mean()),
                            "pool": float(measured[pool_key].float().mean()),
                            "random-prompt pool": float(random[pool_key].float().mean())}}
    else:
        from clova_train.core.pool import random_prompts_like
        from clova_train.core.safe_files import read_yaml
        from clova_train.tools.replace.demo import repaint_table, ungated_token
        from clova_train.tools.replace.tool import concept_words

        data = read_yaml(export / "config.yaml", "run config")["data"]
        scores = {}
        for concept in data.get("init_args", data).get("synthetic_concepts") or server.pool.concepts:
            exported = server.token_for(concept)  # None when no token passed the gate: the words are served
            untuned = server.tool.initial_token(concept_words(concept))
            ungated = ungated_token(export, concept)
            tokens = {"words": None, "exported token": exported, "untuned token": untuned,
                      "ungated pool": ungated[0] if ungated else exported,
                      "random token": random_prompts_like((untuned if exported is None else exported)[None],
                                                          torch.Generator().manual_seed(seed))[0]}
            with torch.no_grad():
                scores[concept] = repaint_table(server, concept, tokens, REPAINT_IMAGES, seed)
    return {**scores, "prompts accepted": {"count": accepted}}


COLUMNS = {"vqa": ("no prompt", "pool", "random-prompt pool"), "loc": ("no prompt", "pool", "random-prompt pool"),
           "seg": ("no prompt", "pool", "random-prompt pool"),
           "replace": ("words", "exported token", "untuned token", "ungated pool", "random token")}
CONTRASTS = {  # tool -> (learned, control) pairs reported as paired differences besides those against the first column
    "vqa": (("pool", "random-prompt pool"),), "loc": (("pool", "random-prompt pool"),),
    "seg": (("pool", "random-prompt pool"),),
    "replace": (("exported token", "untuned token"), ("exported token", "ungated pool"), ("exported token", "random token")),
}
METRIC = {"vqa": "exact-match accuracy", "loc": "share of images whose concept is detected",
          "seg": "share of images whose concept is segmented",
          "replace": "repainted region's RGB distance from the concept's colour (lower is better)"}


def table_rows(tool: str, per_seed: list[dict[str, dict[str, float]]]) -> list[str]:
    """One row per group and column: mean [t interval], paired difference against the first column, per seed; then
    the learned prompts against each control (:data:`CONTRASTS`), paired per seed."""
    rows = []
    reference_column = COLUMNS[tool][0]
    limits = None if tool == "replace" else (0.0, 1.0)  # REPLACE's scores are RGB distances
    for name in per_seed[0]:
        if name == "prompts accepted":
            counts = [int(s[name]["count"]) for s in per_seed]
            rows.append(f"| {tool} | prompts accepted | - | - | - | {', '.join(map(str, counts))} |")
            continue
        reference = [s[name][reference_column] for s in per_seed]
        for column in COLUMNS[tool]:
            values = [s[name][column] for s in per_seed]
            difference = "-" if column == reference_column else seed_interval(
                [round(a - b, 9) + 0.0 for a, b in zip(values, reference)], True, limits)
            form = "{:.0f}" if tool == "replace" else "{:.2f}"
            rows.append(f"| {tool} | {name} | {column} | {seed_interval(values, limits=limits)} | {difference} | "
                        f"{', '.join(form.format(v) for v in values)} |")
        for learned, control in CONTRASTS[tool]:
            differences = [round(s[name][learned] - s[name][control], 9) + 0.0 for s in per_seed]
            rows.append(f"| {tool} | {name} | {learned} - {control} | - | {seed_interval(differences, True, limits)} | "
                        f"{', '.join(f'{v:+.2f}' for v in differences)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seeded_run_arguments(parser, "data and training seeds")
    parser.add_argument("--tools", nargs="+", choices=sorted(TOOLS), default=list(TOOLS), help="which quickstarts")
    args = parser.parse_args()
    with runs_directory(args.runs_dir) as runs:
        for tool in args.tools:
            build_model(tool)
            per_seed = [measure(tool, fit_and_export(tool, s, runs), s) for s in args.seeds]
            seeds = " ".join(map(str, args.seeds))
            publish("prompt_tool_seeds", "VQA, LOC, SEG and REPLACE prompt pools over seeds", f"{tool}, cpu: {machine()}",
                    f"{METRIC[tool]} on held-out images of `configs/quickstart/{TOOLS[tool][0]}`, seeds {seeds} (data "
                    f"and training; one tiny model build): mean [95% t interval over seeds]; differences paired per "
                    f"seed against the {COLUMNS[tool][0]!r} column. Command: `python benchmarks/prompt_tool_seeds.py "
                    f"--tools {tool} --seeds {seeds}`",
                    ["tool", "group", "policy", "score", "difference", "per seed"], table_rows(tool, per_seed),
                    record=not args.no_record)


if __name__ == "__main__":
    main()
