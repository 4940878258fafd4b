"""Serve an export on unseen images: CLASSIFY with and without the prompt pool.

``python -m clova_train.quickstart.demos.clip <export dir>`` loads the export the way a serving process would (no
Lightning), classifies test images over all concept names, and prints per-concept accuracy of the
unmodified tool, of the tool with its prompt pool, and of the zero-prompt control (the same pool with every
prompt zero: what the per-label prompted scoring gives with nothing learned), with 95% intervals and the
paired difference pool - control. The test images are every image under ``--data``
(a concept-folder root of your own test set) or, by default, a freshly rendered synthetic set of the
run's concepts with a seed the run never used (the run's validation images chose which prompts were kept,
so they would flatter the pool). ``image_size`` and the concepts are read from the export's config.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import tempfile

from clova_train.core.evaluation_report import SampleTable, format_report
from clova_train.core.pool import control_pool
from clova_train.core.safe_files import read_yaml
from clova_train.tools.images import list_images, load_image
from clova_train.synthetic.shapes import write_concept_folders
from clova_train.tools.serving import PromptToolServer


def _data_defaults(export_dir: Path) -> dict:
    config = export_dir / "config.yaml"
    if not config.is_file():
        return {}
    data = read_yaml(config, "run config").get("data", {})
    return data.get("init_args", data) or {}


def evaluate(server: PromptToolServer, root: Path, image_size: int, batch_size: int = 64) -> list[dict]:
    """Per concept folder of ``root`` and over all: CLASSIFY accuracy of the unmodified tool, of the pool and of
    the zero-prompt control of the same pool structure, with 95% intervals (``SampleTable.report``)."""
    concepts = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(f, c) for c in concepts for f in list_images(root / c)]
    control = PromptToolServer(server.tool, control_pool(server.pool, "zero"), server.top_k)
    table = SampleTable(list(COLUMNS))
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        batch = {"images": torch.stack([load_image(f, image_size) for f, _ in chunk]),
                 "labels": [c for _, c in chunk], "names": concepts}
        with torch.no_grad():
            values = server.tool.evaluate(server, batch)
            values["accuracy_zero_prompt"] = server.tool.evaluate(control, batch)["accuracy_pool"]
        table.add([str(f) for f, _ in chunk], batch["labels"], {k: v.tolist() for k, v in values.items()})
    return table.report("accuracy_pool", "accuracy_zero_prompt")


COLUMNS = ("accuracy_no_prompt", "accuracy_pool", "accuracy_zero_prompt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.quickstart.demos.clip", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--data", type=Path, default=None, help="concept-folder root of test images")
    parser.add_argument("--test-images", type=int, default=100, help="rendered test images per concept")
    parser.add_argument("--image-size", type=int, default=None, help="image side used in training")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble only the k most similar prompts")
    args = parser.parse_args(argv)
    defaults = _data_defaults(args.export)
    image_size = args.image_size or defaults.get("image_size", 224)
    server = PromptToolServer.from_export(args.export, top_k=args.top_k)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.data
        if root is None:
            concepts = defaults.get("synthetic_concepts") or server.pool.concepts
            root = write_concept_folders(
                Path(scratch), concepts, args.test_images, defaults.get("render_size", 64), seed=987_654
            )
        report = evaluate(server, root, image_size)
    source = args.data or "freshly rendered synthetic images"
    print(f"\nCLASSIFY on test images ({source}), {len(server.pool)} prompts in the pool, top-k {server.top_k}")
    print("no prompt: the unmodified CLIP; pool: the learned prompts; zero prompt: the same pool with every prompt")
    print("zero (what the prompted scoring does with nothing learned). Mean [95% interval].")
    for entry in report:
        entry["prompts"] = server.pool.num_prompts(entry["concept"]) if entry["concept"] != "all" else len(server.pool)
    print(format_report(report))


if __name__ == "__main__":
    main()
