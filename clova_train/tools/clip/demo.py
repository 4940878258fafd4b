"""Serve an export on unseen images: CLASSIFY with and without the prompt pool.

``python -m clova_train.tools.clip.demo <export dir>`` loads the export the way a serving process would (no
Lightning) and classifies test images over all concept names. It first chooses CLASSIFY's ``classify_margin`` on a
validation set (rendered with a seed of its own, 300 images per concept; ``clova_train.tools.clip.margin``: the most
accurate margin under which, with 95% confidence for all of them together, the pool takes at most 2% of each concept
without prompts away from the unmodified tool's right answers) and writes it into the export's ``tool.json``, so
that every later ``PromptToolServer.from_export`` / ``clova-train serve`` of the export serves at it
(``--no-write-margin``: leave the export as it is), then prints, on the test
images, per-concept accuracy of the unmodified tool, of the pool at margin 0 and at the chosen margin, and of the
random-prompt control (the pool with every prompt replaced by a random one of its norm: the same retrieval and
decision rule with nothing learned; a zero prompt is exactly the unmodified tool under CLASSIFY's rule), with 95%
intervals and the paired difference pool - unmodified, and the confusion matrices over all concepts. The test
images are every image under ``--data`` (a concept-folder root of your own test set) or, by default, a freshly
rendered synthetic set of the run's concepts with a seed the run never used (the run's validation images chose which
prompts were kept, so they would flatter the pool). ``image_size`` and the concepts are read from the export's
config.yaml.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from clova_train.core.evaluation_report import SampleTable, format_report
from clova_train.core.pool import control_pool
from clova_train.core.safe_files import read_yaml
from clova_train.tools.clip.synthetic import write_concept_folders
from clova_train.tools.clip.margin import (
    CONFIDENCE, NEVER, TOLERANCE, choose_margin, classify_forwards, decide, images_needed,
)
from clova_train.tools.images import list_images, load_image, text_named
from clova_train.tools.operating_point import operating_point_record, write_operating_point
from clova_train.tools.prompt_server import PromptToolServer

TEST_SEED, VALIDATION_SEED = 987_654, 123_457


def _data_defaults(export_dir: Path) -> dict:
    config = export_dir / "config.yaml"
    if not config.is_file():
        return {}
    data = read_yaml(config, "run config").get("data", {})
    return data.get("init_args", data) or {}


def load_folder(root: Path, image_size: int) -> tuple[list[str], list[Path], torch.Tensor, torch.Tensor]:
    """Concepts (sub-folders), files, images and true label indices of a concept-folder root."""
    concepts = sorted(p.name for p in text_named((p for p in root.iterdir() if p.is_dir()), root, "concept folder"))
    files = [(f, c) for c in concepts for f in list_images(root / c)]
    images = torch.stack([load_image(f, image_size) for f, _ in files])
    return concepts, [f for f, _ in files], images, torch.tensor([concepts.index(c) for _, c in files])


def evaluate(server: PromptToolServer, root: Path, image_size: int, margin: float,
             batch_size: int = 64) -> tuple[list[dict], dict[str, list[list[int]]], list[str]]:
    """Per concept folder of ``root`` and over all: CLASSIFY accuracy of the unmodified tool, of the pool at margin 0
    and at ``margin``, and of the random-prompt control, with 95% intervals (``SampleTable.report``); and the
    confusion matrices (rows: true concept, columns: predicted) of the unmodified tool and of the pool at each
    margin."""
    concepts, files, images, truth = load_folder(root, image_size)
    control = PromptToolServer(server.tool, control_pool(server.pool, "random"), server.top_k)
    columns = {"accuracy_no_prompt": None, "accuracy_pool_margin_0": 0.0, f"accuracy_pool_margin_{margin:g}": margin,
               "accuracy_random_prompt": 0.0}
    table = SampleTable(list(columns))
    confusion = {name: [[0] * len(concepts) for _ in concepts] for name in columns if name != "accuracy_random_prompt"}
    for start in range(0, len(files), batch_size):
        batch, labels = images[start:start + batch_size], truth[start:start + batch_size]
        with torch.no_grad():
            forwards = classify_forwards(server, batch, concepts)
            random_forwards = classify_forwards(control, batch, concepts)
        predicted = {name: (forwards.unprompted.argmax(-1) if m is None else
                            decide(server.tool, random_forwards if "random" in name else forwards, m))
                     for name, m in columns.items()}
        for name, rows in predicted.items():
            for label, row in zip(labels.tolist(), rows.tolist()):
                if name in confusion:
                    confusion[name][label][row] += 1
        table.add([str(f) for f in files[start:start + batch_size]], [concepts[i] for i in labels.tolist()],
                  {name: (rows == labels).float().tolist() for name, rows in predicted.items()})
    return table.report(f"accuracy_pool_margin_{margin:g}", "accuracy_no_prompt"), confusion, concepts


def format_confusion(matrix: list[list[int]], concepts: list[str]) -> str:
    """A markdown confusion matrix: one row per true concept, one column per predicted concept."""
    lines = ["| true \\ predicted | " + " | ".join(concepts) + " |", "| --- |" + " --- |" * len(concepts)]
    lines += [f"| {c} | " + " | ".join(str(n) for n in row) + " |" for c, row in zip(concepts, matrix)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.clip.demo", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--data", type=Path, default=None, help="concept-folder root of test images")
    parser.add_argument("--validation-data", type=Path, default=None,
                        help="concept-folder root of validation images for the margin (default: rendered)")
    parser.add_argument("--test-images", type=int, default=100, help="rendered test images per concept")
    parser.add_argument("--validation-images", type=int, default=300,
                        help=f"rendered validation images per concept (the {TOLERANCE:.0%} bound needs at least "
                             f"{images_needed(1)} for one concept without prompts, {images_needed(4)} for four)")
    parser.add_argument("--image-size", type=int, default=None, help="image side used in training")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble only the k most similar prompts")
    parser.add_argument("--no-write-margin", action="store_true",
                        help="do not write the chosen classify_margin into the export's tool.json")
    args = parser.parse_args(argv)
    defaults = _data_defaults(args.export)
    image_size = args.image_size or defaults.get("image_size", 224)
    server = PromptToolServer.from_export(args.export, top_k=args.top_k)
    with tempfile.TemporaryDirectory() as scratch:
        concepts = defaults.get("synthetic_concepts") or server.pool.concepts
        render = lambda name, seed, count: write_concept_folders(  # noqa: E731
            Path(scratch) / name, concepts, count, defaults.get("render_size", 64), seed=seed)
        if args.data is not None and args.validation_data is None:
            margin = server.tool.classify_margin  # your test set's concepts: no rendered stand-in to calibrate on
            calibrated_on = "not chosen: pass --validation-data to choose it; the export's own margin"
        else:
            validation = args.validation_data or render("validation", VALIDATION_SEED, args.validation_images)
            names, _, images, truth = load_folder(validation, image_size)
            margin, _ = choose_margin(server, images, truth, names)
            calibrated_on = (f"chosen on {len(images)} validation images "
                             f"({args.validation_data or 'rendered with another seed'})")
            if margin == NEVER:
                calibrated_on += ": no margin keeps every concept without prompts safe, so prompts never override"
            if not args.no_write_margin:
                write_operating_point(args.export, "classify_margin", margin, operating_point_record(
                    "classify_margin", margin, str(args.validation_data or "rendered with another seed"), len(images)))
                calibrated_on += "; written to the export's tool.json (served at it from now on)"
        report, confusion, concepts = evaluate(server, args.data or render("test", TEST_SEED, args.test_images), image_size, margin)
    source = args.data or "freshly rendered synthetic images"
    print(f"\nCLASSIFY on test images ({source}), {len(server.pool)} prompts in the pool, top-k {server.top_k}")
    print(f"classify_margin {margin:g}: {calibrated_on}")
    print(f"(chosen: the most accurate margin under which, with {CONFIDENCE:.0%} confidence for all of them together, "
          f"the pool takes at most {TOLERANCE:.0%} of each concept without prompts away from the unmodified tool's "
          "right answers).")
    print("no prompt: the unmodified CLIP; pool: the learned prompts at margin 0 and at the chosen margin; random")
    print("prompt: the pool with every prompt replaced by a random one of its norm (nothing learned). Mean [95% interval].")
    for entry in report:
        entry["prompts"] = server.pool.num_prompts(entry["concept"]) if entry["concept"] != "all" else len(server.pool)
    print(format_report(report))
    for name, matrix in confusion.items():
        print(f"\nConfusion matrix, {name.removeprefix('accuracy_').replace('_', ' ')} (rows: true concept; columns: "
              "predicted):")
        print(format_confusion(matrix, concepts))


if __name__ == "__main__":
    main()
