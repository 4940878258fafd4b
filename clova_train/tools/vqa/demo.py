"""Serve a BLIP VQA export on held-out questions: answers without prompts and with the prompt pool.

``python -m clova_train.tools.vqa.demo <export dir> [--records eval.jsonl]`` loads the export the way a serving
process would (no Lightning), answers every question of the records (default: the ``eval.jsonl`` of the
synthetic data the run used, read from the export's config.yaml; those images were never trained on and
never gated on) and prints exact-match accuracy per gold answer, for the unmodified tool, with the pool,
and with a control pool of the same structure: the same features, zero prompts kept, and every learned
prompt replaced by a random one of the same norm (what the prompts add beyond "some prompt").

Before that it chooses the pool's operating point, ``answer_margin`` (``clova_train.tools.vqa.margin``), on validation
records rendered with a seed of their own (``VALIDATION_PER_ANSWER`` per answer, the run's colours; or
``--validation-records``), writes it into the export's ``tool.json`` (``--no-calibrate``: serve at the export's own),
and reports the pool and the random-prompt control both served at that margin, beside the pool with the prompted
answer always served (the paper's rule).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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


VALIDATION_SEED_OFFSET = 4_441  # the validation records' render seed: the run's plus this (never its own)
VALIDATION_PER_ANSWER = 220  # images_needed(4): 217 show the 2% bound for four known answers together


def _data_args(export_dir: Path) -> dict:
    config = export_dir / "config.yaml"
    if not config.is_file():
        return {}
    data = read_yaml(config, "run config").get("data", {})
    return data.get("init_args", data) or {}


def render_validation_records(export_dir: Path, directory: Path, per_answer: int = VALIDATION_PER_ANSWER) -> Path:
    """Validation records of the run's synthetic colours (from the export's config.yaml), rendered with a seed the run
    never used; the records file."""
    from clova_train.tools.vqa.synthetic import write_vqa_records

    args = _data_args(export_dir)
    if not args.get("learn_colours") and not args.get("known_colours"):
        raise SystemExit("the export's config names no synthetic colours to render validation records of: pass "
                         "--validation-records")
    root = write_vqa_records(directory, list(args.get("learn_colours") or []), list(args.get("known_colours") or []),
                             images_per_colour=1, wrong_answers=0, eval_per_colour=per_answer,
                             image_size=int(args.get("render_size", 32)),
                             seed=int(args.get("render_seed", 0)) + VALIDATION_SEED_OFFSET)
    return root / "eval.jsonl"


def read_eval_records(path: Path) -> list[dict]:
    """The ``{image, question, answer}`` records of a JSON or JSONL file, image paths resolved."""
    return [{**r, "image": record_image(path, r["image"])} for r in read_records(path)]


def evaluate(server: PromptToolServer, records: list[dict], batch_size: int = 32) -> dict[str, list[int]]:
    """Per gold answer: [questions, right without prompts, with the pool, with the random-prompt control, with the
    pool always prompted, answered differently by the pool than without prompts, right without prompts and wrong
    with the pool]; the pool and the control are served at the tool's ``answer_margin``."""
    control = PromptToolServer(server.tool, control_pool(server.pool, "random"), server.top_k)
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 0])
    margin = server.tool.answer_margin
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        images = [load_image_uint8(r["image"]) for r in batch]
        questions = [r["question"] for r in batch]
        with torch.no_grad():
            plain = server.tool.answer(NoPrompt(), images, questions)
            pooled = server.answer(images, questions)
            random = control.answer(images, questions)
            server.tool.answer_margin = None
            always = server.answer(images, questions)
            server.tool.answer_margin = margin
        for record, *answers in zip(batch, plain, pooled, random, always):
            gold = normalise_answer(record["answer"])
            row = table[gold]
            row[0] += 1
            for k, answer in enumerate(answers, 1):
                row[k] += answer == gold
            row[5] += answers[1] != answers[0]
            row[6] += answers[0] == gold and answers[1] != gold
    return dict(sorted(table.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clova_train.tools.vqa.demo", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--records", type=Path, default=None, help="JSONL of {image, question, answer}")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble the k most similar stored prompts")
    parser.add_argument("--validation-records", type=Path, default=None,
                        help="JSONL of {image, question, answer} to choose answer_margin on (default: rendered)")
    parser.add_argument("--validation-per-answer", type=int, default=VALIDATION_PER_ANSWER,
                        help="rendered validation questions per answer")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="serve at the export's own answer_margin instead of choosing and writing one")
    args = parser.parse_args(argv)
    records_path = args.records or _default_records(args.export)
    if records_path is None:
        raise SystemExit("no --records given and the export's config names no eval records")
    if not args.no_calibrate:
        from clova_train.tools.vqa.margin import calibrate_export

        with tempfile.TemporaryDirectory() as scratch:
            validation = args.validation_records or render_validation_records(
                args.export, Path(scratch) / "validation", args.validation_per_answer)
            source = str(args.validation_records or "rendered with another seed")
            margin, _ = calibrate_export(args.export, read_eval_records(validation), source, held_out=[records_path])
        print(f"answer_margin {margin:g}: chosen on validation records ({source}), written to the export's tool.json")
    server = PromptToolServer.from_export(args.export, top_k=args.top_k)
    table = evaluate(server, read_eval_records(records_path))
    print(f"\nVQA on {records_path} ({len(server.pool)} prompts in the pool, top-{server.top_k} ensemble), served at "
          f"answer_margin {server.tool.answer_margin}")
    print(f"{'answer':<12}{'questions':>10}{'no prompt':>11}{'with pool':>11}{'random-prompt pool':>20}"
          f"{'pool, always prompted':>23}")
    for answer, (n, *right) in ((a, r[:5]) for a, r in table.items()):
        print(f"{answer:<12}{n:>10}{right[0] / n:>11.2f}{right[1] / n:>11.2f}{right[2] / n:>20.2f}{right[3] / n:>23.2f}")
    total = sum(r[0] for r in table.values())
    columns = [sum(r[k] for r in table.values()) / total for k in (1, 2, 3, 4)]
    print(f"{'all':<12}{total:>10}{columns[0]:>11.2f}{columns[1]:>11.2f}{columns[2]:>20.2f}{columns[3]:>23.2f}")
    assert "lightning" not in sys.modules, "serving imported Lightning"


if __name__ == "__main__":
    main()
