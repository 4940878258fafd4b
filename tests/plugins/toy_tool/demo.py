"""The toy tool's demo (``make demo-toy``, after the quickstart's fit and export): what the prompts changed.

``python -m toy_tool.demo <export dir>`` loads the export as a serving process does and classifies held-out vectors
(a noise seed no data file holds) of every class, without a concept (the unmodified classifier) and through the
purple prompts, and prints the share of each class called by its own name. Written the way docs/architecture.md ("A
tool is a folder") says a user writes a tool's demo.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from clova_train.tools.prompt_server import PromptToolServer
from .synthetic import TOY_CLASSES, held_out

QUERIES = 20


def accuracy_table(server: PromptToolServer, count: int = QUERIES) -> list[tuple[str, float, float]]:
    """Per class: the share of ``count`` held-out vectors called by their class, unprompted and through the purple
    prompts."""
    rows = []
    for concept in TOY_CLASSES:
        vectors = held_out(concept, count)
        plain = server.serve({"vectors": vectors})["labels"]
        prompted = server.serve({"vectors": vectors, "concept": "purple"})["labels"]
        rows.append((concept, plain.count(concept) / count, prompted.count(concept) / count))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toy_tool.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="the quickstart run's export")
    args = parser.parse_args(argv)
    server = PromptToolServer.from_export(args.export)
    print(f"{'class':<8} {'unprompted':>10} {'purple prompts':>15}")
    for concept, plain, prompted in accuracy_table(server):
        print(f"{concept:<8} {plain:>10.0%} {prompted:>15.0%}")


if __name__ == "__main__":
    main()
