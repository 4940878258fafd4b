"""What the CLIP quickstart's prompt pool adds, against controls, over data seeds; what the validation gate adds
when training labels are noisy (CLOVA Table 4's direction); and what CLASSIFY's decision margin trades.

For each seed ``s`` (the rendered data, the per-instance negatives and the prompt initialisation:
``--data.init_args.render_seed=s --data.init_args.seed=s --seed_everything=s``), two fits of
``configs/quickstart/clip_prompt.yaml`` (the tiny CLIP, pretrained on red, green, blue and yellow only: purple and
orange are the concepts it has to learn, blue is purple's look-alike):

* ``clean``: the quickstart as shipped; ``noisy``: ``label_noise`` of the training labels flipped to another
  learned concept (the gates still validate on clean held-out images);
* each is tested with ``clova-train test`` on its rendered test set (never used in training or gating): the
  unmodified CLIP, the gated pool, and the ungated pool (every tuned prompt, rejected ones included);
* the clean run's pool is also served with a random-prompt control (every prompt replaced by a random one of its
  norm: the same retrieval and decision rule, nothing learned), and with ``classify_margin`` chosen on a
  *validation* set rendered with another seed, ``VALIDATION_IMAGES`` per concept
  (``clova_train.tools.clip.margin.choose_margin``: the largest validation accuracy among the margins under which,
  with 95% confidence for all of them together, the pool takes at most 2% of each concept without prompts away from
  the unmodified tool's right answers), then scored on the test set.

Reported: per concept group and setting, the mean over seeds with a 95% Student t interval from the seed-to-seed
variation, and the paired per-seed differences (pool - unmodified, gated - ungated) with t intervals (scipy).

    python benchmarks/prompt_pool_controls.py [--seeds 0 1 2 3 4] [--label-noise 0.2] [--runs-dir DIR] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, clova_train  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

CONFIG = REPO / "configs/quickstart/clip_prompt.yaml"
LEARNED = ("purple", "orange")
LOOK_ALIKE = "blue"
VALIDATION_SEED_OFFSET = 4_441  # validation images for the margin: neither the training nor the test images' seed
IMAGE_SIZE = 32  # the quickstart's
VALIDATION_IMAGES = 300  # per concept: choose_margin needs 217 or more to show its 2% bound for 4 concepts together


def fit_and_test(name: str, seed: int, label_noise: float, runs: Path) -> Path:
    """Fit and test one setting (reusing a finished run); its run directory."""
    run_dir = runs / f"{name}-{seed}"
    if (run_dir / "evaluation" / "test.json").is_file():
        return run_dir
    common = ["--config", str(CONFIG), f"--trainer.default_root_dir={run_dir}", "--trainer.logger=false",
              "--trainer.enable_progress_bar=false", "--model.init_args.keep_rejected_prompts=true",
              f"--data.init_args.label_noise={label_noise}", f"--data.init_args.root={runs / f'data-{seed}'}",
              f"--data.init_args.render_seed={seed}", f"--data.init_args.seed={seed}", f"--seed_everything={seed}"]
    clova_train("fit", *common, "--model.init_args.on_existing_pool=overwrite")
    clova_train("test", *common, f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")
    return run_dir


def tested(run_dir: Path) -> dict[str, dict[str, float]]:
    """concept -> column -> accuracy, from ``clova-train test``'s report."""
    report = json.loads((run_dir / "evaluation" / "test.json").read_text())["per_concept"]
    return {e["concept"]: {k: v["mean"] for k, v in e.items() if isinstance(v, dict) and "mean" in v} for e in report}


def margin_study(run_dir: Path, seed: int, runs: Path) -> dict[str, dict[str, float]]:
    """The clean run's pool served at margin 0, at the margin chosen on validation images
    (``clova_train.tools.clip.margin.choose_margin``), and the random-prompt control, on the rendered test images;
    the chosen margin under ``"margin"``."""
    from clova_train.core.pool import control_pool
    from clova_train.tools.clip.demo import load_folder
    from clova_train.tools.clip.synthetic import write_concept_folders
    from clova_train.tools.clip.margin import choose_margin, classify_forwards, decide, per_label_accuracy
    from clova_train.tools.prompt_server import PromptToolServer

    server = PromptToolServer.from_export(run_dir)
    names = sorted(p.name for p in (runs / f"data-{seed}").iterdir() if p.is_dir())
    validation = runs / f"validation-{VALIDATION_IMAGES}-{seed}"
    if not validation.is_dir():
        write_concept_folders(validation, names, VALIDATION_IMAGES, 64, seed=seed + VALIDATION_SEED_OFFSET)
    concepts, _, images, truth = load_folder(validation, IMAGE_SIZE)
    chosen, _ = choose_margin(server, images, truth, concepts)
    concepts, _, images, truth = load_folder(Path(f"{runs / f'data-{seed}'}_test"), IMAGE_SIZE)
    controls = {kind: PromptToolServer(server.tool, control_pool(server.pool, kind, seed), server.top_k)
                for kind in ("random", "zero")}
    with torch.no_grad():
        forwards = classify_forwards(server, images, concepts)
        control_forwards = {kind: classify_forwards(c, images, concepts) for kind, c in controls.items()}
    score = lambda f, m: per_label_accuracy(decide(server.tool, f, m), truth, concepts)  # noqa: E731
    return {"pool, margin 0": score(forwards, 0.0), "pool, margin chosen on validation": score(forwards, chosen),
            "random-prompt control, margin 0": score(control_forwards["random"], 0.0),
            "zero-prompt control, margin 0": score(control_forwards["zero"], 0.0), "margin": {"chosen": chosen}}


def group(scores: dict[str, float], name: str) -> float:
    if name == "purple+orange":
        return (scores["purple"] + scores["orange"]) / 2
    return scores[name]


GROUPS = ("purple", "orange", "purple+orange", LOOK_ALIKE, "all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seeded_run_arguments(parser, "data and training seeds")
    parser.add_argument("--label-noise", type=float, default=0.2, help="share of flipped training labels (noisy)")
    args = parser.parse_args()
    rows: list[str] = []
    with runs_directory(args.runs_dir) as runs:
        clean = [fit_and_test("clean", s, 0.0, runs) for s in args.seeds]
        noisy = [fit_and_test("noisy", s, args.label_noise, runs) for s in args.seeds]
        studies = [margin_study(run, s, runs) for run, s in zip(clean, args.seeds)]
        clean_tests, noisy_tests = [tested(r) for r in clean], [tested(r) for r in noisy]
        accepted = [json.loads((r / "summary.json").read_text())["accepted"] for r in clean + noisy]

    def row(setting: str, policy: str, values: list[float], reference: list[float] | None) -> str:
        difference = "-" if reference is None else seed_interval([round(a - b, 6) + 0.0 for a, b in zip(values, reference)], True)
        return (f"| {setting} | {policy} | {seed_interval(values)} | {difference} | "
                f"{', '.join(f'{v:.2f}' for v in values)} |")

    for name in GROUPS:
        unmodified = [group({c: t[c]["accuracy_no_prompt"] for c in t}, name) for t in clean_tests]
        rows.append(row(f"clean, {name}", "unmodified CLIP", unmodified, None))
        for policy in ("pool, margin 0", "pool, margin chosen on validation", "random-prompt control, margin 0",
                       "zero-prompt control, margin 0"):
            rows.append(row(f"clean, {name}", policy, [group(s[policy], name) for s in studies], unmodified))
    for policy in ("pool, margin 0", "pool, margin chosen on validation"):
        losses = [round(min(s[policy][c] - t[c]["accuracy_no_prompt"] for c in t if c not in (*LEARNED, "all")), 6) + 0.0
                  for s, t in zip(studies, clean_tests)]
        rows.append(f"| clean, worst concept without prompts | {policy}: change against unmodified | "
                    f"{seed_interval(losses, True)} | - | {', '.join(f'{v:+.2f}' for v in losses)} |")
    rows.append(f"| clean | margin chosen on validation | - | - | "
                f"{', '.join(str(s['margin']['chosen']) for s in studies)} |")
    for name in ("purple+orange", "all"):
        gated = [group({c: t[c]["accuracy_pool"] for c in t}, name) for t in noisy_tests]
        ungated = [group({c: t[c].get("accuracy_ungated", t[c]["accuracy_pool"]) for c in t}, name)
                   for t in noisy_tests]
        unmodified = [group({c: t[c]["accuracy_no_prompt"] for c in t}, name) for t in noisy_tests]
        rows.append(row(f"noisy ({args.label_noise:.0%} flipped), {name}", "unmodified CLIP", unmodified, None))
        rows.append(row(f"noisy ({args.label_noise:.0%} flipped), {name}", "ungated pool", ungated, unmodified))
        rows.append(row(f"noisy ({args.label_noise:.0%} flipped), {name}", "gated pool (difference: - ungated)",
                        gated, ungated))
    n = len(args.seeds)
    rows.append(f"| prompts accepted | clean / noisy | - | - | {', '.join(map(str, accepted[:n]))} / "
                f"{', '.join(map(str, accepted[n:]))} |")
    publish("prompt_pool_controls", "CLIP prompt pool against controls", f"cpu: {machine()}",
            f"Test-set CLASSIFY accuracy of the quickstart (`configs/quickstart/clip_prompt.yaml`, 100 test images "
            f"per concept), seeds {', '.join(map(str, args.seeds))}: mean [95% t interval over seeds]; differences "
            f"paired per seed, against the unmodified CLIP unless the row says otherwise. Command: "
            f"`python benchmarks/prompt_pool_controls.py --seeds {' '.join(map(str, args.seeds))}`",
            ["setting", "policy", "accuracy", "difference", "per seed"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()
