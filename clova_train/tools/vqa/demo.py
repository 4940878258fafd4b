"""Serve a BLIP VQA export on held-out questions: answers without prompts and with the prompt pool.

``python -m clova_train.tools.vqa.demo <export dir> [--records eval.jsonl]`` loads the export the way a serving
process would (no Lightning), answers every question of the records (default: the ``eval.jsonl`` of the
synthetic data the run used, read from the export's config.yaml; those images were never trained on and
never gated on) and prints exact-match accuracy per gold answer, for the unmodified tool, with the pool,
and with a control pool of the same structure: the same features, zero prompts kept, and every learned
prompt replaced by a random one of the same norm (what the prompts add beyond "some prompt").
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from clova_train.core.pool import control_pool
from clova_train.core.safe_files import read_yaml
from clova_train.tools.base import NoPrompt
from clova_train.tools.vqa.tool import normalise_answer
from clova_train.tools.images import load_image_uint8
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.tools.vqa.records import read_records, record_image


def _default_records(export_dir: Path) -> Path | None:
    config = export_dir / "config.yaml"
    if not config.is_file():
        return None
    data = read_yaml(config, "run config").get("data", {})
    args = data.get("init_args", data) or {}
    if args.get("eval_records"):
        return Path(args["eval_records"])
    return Path(args["root"]) / "eval.jsonl" if args.get("root") else None


def read_eval_records(path: Path) -> list[dict]:
    """The ``{image, question, answer}`` records of a JSON or JSONL file, image paths resolved."""
    return [{**r, "image": record_image(path, r["image"])} for r in read_records(path)]


def evaluate(server: PromptToolServer, records: list[dict], batch_size: int = 32) -> dict[str, list[int]]:
    """Per gold answer: [questions, right without prompts, with the pool, with the random-prompt control]."""
    control = PromptToolServer(server.tool, control_pool(server.pool, "random"), server.top_k)
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        images = [load_image_uint8(r["image"]) for r in batch]
        questions = [r["question"] for r in batch]
        with torch.no_grad():
            plain = server.tool.answer(NoPrompt(), images, questions)
            pooled = server.answer(images, questions)
            random = control.answer(images, questions)
        for record, a, b, c in zip(batch, plain, pooled, random):
            gold = normalise_answer(record["answer"])
            row = table[gold]
            row[0] += 1
            row[1] += a == gold
            row[2] += b == gold
            row[3] += c == gold
    return dict(sorted(table.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.vqa.demo", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--records", type=Path, default=None, help="JSONL of {image, question, answer}")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble the k most similar stored prompts")
    args = parser.parse_args(argv)
    server = PromptToolServer.from_export(args.export, top_k=args.top_k)
    records_path = args.records or _default_records(args.export)
    if records_path is None:
        raise SystemExit("no --records given and the export's config names no eval records")
    table = evaluate(server, read_eval_records(records_path))
    print(f"\nVQA on {records_path} ({len(server.pool)} prompts in the pool, top-{server.top_k} ensemble)")
    print(f"{'answer':<12}{'questions':>10}{'no prompt':>11}{'with pool':>11}{'random-prompt pool':>20}")
    for answer, (n, plain, pooled, random) in table.items():
        print(f"{answer:<12}{n:>10}{plain / n:>11.2f}{pooled / n:>11.2f}{random / n:>20.2f}")
    total = sum(r[0] for r in table.values())
    columns = [sum(r[k] for r in table.values()) / total for k in (1, 2, 3)]
    print(f"{'all':<12}{total:>10}{columns[0]:>11.2f}{columns[1]:>11.2f}{columns[2]:>20.2f}")
    assert "lightning" not in sys.modules, "serving imported Lightning"


if __name__ == "__main__":
    main()
