"""Serve an export on unseen images: CLASSIFY with and without the prompt pool.

``python -m clova_train.demo <export dir>`` loads the export the way a serving process would (no
Lightning), classifies test images over all concept names, and prints per-concept accuracy of the
unmodified tool and of the tool with its prompt pool. The test images are every image under ``--data``
(a concept-folder root of your own test set) or, by default, a freshly rendered synthetic set of the
run's concepts with a seed the run never used (the run's validation images chose which prompts were kept,
so they would flatter the pool). ``image_size`` and the concepts are read from the export's config.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

import tempfile

from clova_train.tools.images import list_images, load_image
from clova_train.synthetic.shapes import write_concept_folders
from clova_train.tools.serving import PromptToolServer


def _data_defaults(export_dir: Path) -> dict:
    config = export_dir / "config.yaml"
    if not config.is_file():
        return {}
    data = yaml.safe_load(config.read_text()).get("data", {})
    return data.get("init_args", data) or {}


def evaluate(server: PromptToolServer, root: Path, image_size: int) -> list[tuple[str, int, int, int]]:
    """Per concept folder of ``root``: (concept, images, correct without prompts, correct with the pool)."""
    concepts = sorted(p.name for p in root.iterdir() if p.is_dir())
    rows = []
    text = server.tool.encode_text(concepts)
    for concept in concepts:
        files = list_images(root / concept)
        images = torch.stack([load_image(f, image_size) for f in files])
        with torch.no_grad():
            base = (server.tool.encode_image(images) @ text.T).argmax(-1).tolist()
        pooled, _ = server.classify(images, concepts)
        rows.append(
            (concept, len(files), sum(concepts[i] == concept for i in base), sum(p == concept for p in pooled))
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.demo", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--data", type=Path, default=None, help="concept-folder root of test images")
    parser.add_argument("--test-images", type=int, default=10, help="rendered test images per concept")
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
        rows = evaluate(server, root, image_size)
    source = args.data or "freshly rendered synthetic images"
    print(f"\nCLASSIFY on test images ({source}), {len(server.pool)} prompts in the pool")
    print(f"{'concept':<12}{'prompts':>8}{'images':>8}{'no prompt':>11}{'with pool':>11}")
    for concept, n, base, pooled in rows:
        print(f"{concept:<12}{server.pool.num_prompts(concept):>8}{n:>8}{base / n:>11.2f}{pooled / n:>11.2f}")
    total = sum(r[1] for r in rows)
    print(f"{'all':<12}{len(server.pool):>8}{total:>8}{sum(r[2] for r in rows) / total:>11.2f}"
          f"{sum(r[3] for r in rows) / total:>11.2f}")


if __name__ == "__main__":
    main()
