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

``--operating-point`` reports the pool where it is served instead (issue 55): each clean run is exported, its
``classify_margin`` chosen by the fixed rule (``clova_train.tools.operating_point``: ``MARGIN_RULE`` below, declared
before any run) on ``VALIDATION_IMAGES`` validation images per concept and written into the export, the export loaded
again the way ``clova-train serve`` loads it, and the test images classified at the margin it carries: how often the
served pool differs from the unmodified CLIP, the gain when it does, the pool against random prompts at the same
margin, and the share of the unmodified CLIP's right answers on concepts without prompts that the served pool loses.

    python benchmarks/prompt_pool_controls.py [--seeds 0 1 2 3 4] [--label-noise 0.2] [--runs-dir DIR] [--no-record]
    python benchmarks/prompt_pool_controls.py --operating-point --seeds 10 11 12 ...
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
MARGIN_RULE = ("classify_margin: the most accurate of 0, 0.025, ..., 0.5 and 1 (never) on the validation images under "
               "which, with 95% confidence for all concepts without prompts together (Clopper-Pearson, Bonferroni), "
               f"the pool takes at most 2% of each one's images from the unmodified CLIP's right answers; "
               f"{VALIDATION_IMAGES} validation images per concept, rendered with the run's seed + "
               f"{VALIDATION_SEED_OFFSET}")


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


def export_run(run_dir: Path) -> Path:
    """``clova-train export`` of a run (reusing a finished one); the export directory."""
    export = run_dir / "export"
    if not (export / "export.json").is_file():
        clova_train("export", str(run_dir), "--output", str(export))
    return export


def served_study(run_dir: Path, seed: int, runs: Path) -> dict:
    """The clean run's export calibrated (its ``classify_margin`` chosen on validation images and written into it),
    loaded again as a server loads it, and measured on the test images at the margin it carries."""
    import dataclasses

    from served_point import ServedSeed

    from clova_train.core.pool import control_pool
    from clova_train.tools.clip.demo import load_folder
    from clova_train.tools.clip.margin import choose_margin, classify_forwards, decide
    from clova_train.tools.clip.synthetic import write_concept_folders
    from clova_train.tools.operating_point import operating_point_record, write_operating_point
    from clova_train.tools.prompt_server import PromptToolServer

    measured = run_dir / "served_operating_point.json"
    if measured.is_file():  # a finished study of this run (its export already calibrated)
        return {name: ServedSeed(**values) for name, values in json.loads(measured.read_text()).items()}
    export = export_run(run_dir)
    names = sorted(p.name for p in (runs / f"data-{seed}").iterdir() if p.is_dir())
    validation = runs / f"validation-{VALIDATION_IMAGES}-{seed}"
    if not validation.is_dir():
        write_concept_folders(validation, names, VALIDATION_IMAGES, 64, seed=seed + VALIDATION_SEED_OFFSET)
    concepts, _, images, truth = load_folder(validation, IMAGE_SIZE)
    chosen, _ = choose_margin(PromptToolServer.from_export(export), images, truth, concepts)
    write_operating_point(export, "classify_margin", chosen,
                          operating_point_record("classify_margin", chosen, str(validation), len(images)))
    server = PromptToolServer.from_export(export)  # as clova-train serve loads it
    margin = server.tool.classify_margin
    assert margin == chosen, f"the export serves at {margin}, calibrated {chosen}"
    concepts, _, images, truth = load_folder(Path(f"{runs / f'data-{seed}'}_test"), IMAGE_SIZE)
    control = PromptToolServer(server.tool, control_pool(server.pool, "random", seed), server.top_k)
    with torch.no_grad():
        forwards = classify_forwards(server, images, concepts)
        served = server.classify(images, concepts)[1].argmax(-1)  # the served operation itself
        random = decide(server.tool, classify_forwards(control, images, concepts), margin)
    unmodified = forwards.unprompted.argmax(-1)
    assert torch.equal(served, decide(server.tool, forwards, margin))
    without = torch.tensor([concepts[int(t)] not in server.pool for t in truth])
    result = {}
    for name, rows in (("all", torch.ones_like(truth, dtype=torch.bool)),
                       ("purple+orange", torch.tensor([concepts[int(t)] in LEARNED for t in truth]))):
        known = rows & without & (unmodified == truth)
        result[name] = ServedSeed(
            seed, margin, float((served[rows] != unmodified[rows]).float().mean()),
            float((unmodified[rows] == truth[rows]).float().mean()), float((served[rows] == truth[rows]).float().mean()),
            float((random[rows] == truth[rows]).float().mean()),
            float((known & (served != truth)).sum() / known.sum()) if bool(known.any()) else 0.0)
    measured.write_text(json.dumps({name: dataclasses.asdict(value) for name, value in result.items()}))
    return result


def operating_point_main(args: argparse.Namespace) -> None:
    """``--operating-point``: the pool reported where it is served (module docstring)."""
    from served_point import HEADER, operating_point_rows

    with runs_directory(args.runs_dir) as runs:
        studies = [served_study(fit_and_test("clean", s, 0.0, runs), s, runs) for s in args.seeds]
    rows = [row for name in ("all", "purple+orange") for row in operating_point_rows("clip", name, [s[name] for s in studies])]
    publish("prompt_pool_controls", "CLIP prompt pool against controls", f"served operating point, cpu: {machine()}",
            f"CLASSIFY on the quickstart's test images (100 per concept) at the margin the export carries. Fixed before "
            f"the run: {MARGIN_RULE}. Seeds {', '.join(map(str, args.seeds))} (data, negatives and prompt "
            f"initialisation). The last row's items: test images of concepts without prompts that the unmodified CLIP "
            f"classifies right. Command: `python benchmarks/prompt_pool_controls.py --operating-point --seeds "
            f"{' '.join(map(str, args.seeds))}`", HEADER, rows, record=not args.no_record)


def group(scores: dict[str, float], name: str) -> float:
    if name == "purple+orange":
        return (scores["purple"] + scores["orange"]) / 2
    return scores[name]


GROUPS = ("purple", "orange", "purple+orange", LOOK_ALIKE, "all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seeded_run_arguments(parser, "data and training seeds")
    parser.add_argument("--label-noise", type=float, default=0.2, help="share of flipped training labels (noisy)")
    parser.add_argument("--operating-point", action="store_true",
                        help="report the clean pools at the margin their exports carry (module docstring)")
    args = parser.parse_args()
    if args.operating_point:
        operating_point_main(args)
        return
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
