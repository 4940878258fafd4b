"""VQA's benchmark settings: the real-size smoke run's data (``benchmarks/smoke_real.py``), the prompt-tuning
benchmark's small model, data and public procedure (``benchmarks/prompt_tuning.py``) and the seed measurement of its
quickstart (``benchmarks/prompt_tool_seeds.py``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from clova_train.tools.base import PromptTool
from clova_train.tools.benchmark_settings import PromptTuningBenchmark, SeedMeasurement

if TYPE_CHECKING:
    from clova_train.tools.prompt_server import PromptToolServer


def smoke_real_data(workdir: Path, full: bool) -> dict[str, Any]:
    """The paper config's VQA records (``full``: one whole chunk); a request on the first held-out record."""
    from clova_train.core.safe_files import read_text
    from clova_train.tools.vqa.synthetic import write_vqa_records

    root = write_vqa_records(workdir / "data" / "vqa", ["orange"], [], images_per_colour=32 if full else 2,
                             wrong_answers=0, eval_per_colour=1, image_size=128)
    first = json.loads(read_text(root / "eval.jsonl", "VQA records").splitlines()[0])
    return {"image": str(Path("data") / "vqa" / first["image"]), "question": "what colour is the circle?"}


# ---------------------------------------------------------------------- benchmarks/prompt_tuning.py
# A BLIP of the real architecture at a CPU-friendly size (random weights: the timing does not need answers).
BENCH_BLIP = {"image_size": 64, "hidden_size": 128, "layers": 4}


class VqaPromptTuning(PromptTuningBenchmark):
    """BLIP VQA at a CPU-friendly size, one question about a coloured shape per instance.

    The fair loop runs the image and question encoders once per instance and only the answer decoder each step. The
    reference is the public CLOVA BLIP prompt training: one instance at a time, the whole model (image encoder,
    question encoder, answer decoder) re-run every step with weights that still require gradients, and greedy
    generation of the answer after every step (the public code's early-stop check; its result is ignored so that
    every method takes the same number of steps).
    """

    reference = "CLOVA's BLIP VQA prompt training"
    synthetic_data = False

    def build_small_model(self, workdir: Path, args: argparse.Namespace) -> str:
        from clova_train.tools.vqa.tiny import build_tiny_blip

        model, processor = build_tiny_blip(seed=0, **BENCH_BLIP)
        model.save_pretrained(workdir / "blip")
        processor.save_pretrained(workdir / "blip")
        return str(workdir / "blip")

    def write_data(self, workdir: Path, args: argparse.Namespace, datamodule_class: type) -> Path:
        from clova_train.tools.vqa.synthetic import write_vqa_records

        return write_vqa_records(workdir / "data", ["orange", "purple", "red", "green"], [],
                                 images_per_colour=args.instances // 4 + 1, wrong_answers=0, eval_per_colour=1,
                                 image_size=BENCH_BLIP["image_size"], seed=0)

    def make_tool(self, model_name: str, args: argparse.Namespace) -> PromptTool:
        from clova_train.tools.vqa.tool import BlipVqa

        return BlipVqa(model_name, num_prompt_tokens=args.prompt_tokens, max_answer_tokens=4)

    def make_datamodule(self, datamodule_class: type, data: Path, chunk_size: int, args: argparse.Namespace) -> Any:
        datamodule = datamodule_class(str(data / "train.jsonl"), chunk_size=chunk_size)
        datamodule.setup()
        return datamodule

    def reference_prompt(self, module: Any, item: Any, device: str) -> torch.Tensor:
        tool = module.tool
        tool.model.requires_grad_(True)  # the public code never froze the tool
        pixels = tool.pixel_values([item.image])
        ids, mask = tool.tokenize_questions([item.question])
        answers = tool.encode_answers([item.answer])
        prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
        optimizer = torch.optim.Adam([prompt], lr=module.lr)
        for _ in range(module.steps):
            encoded = tool.encode_questions(tool.image_embeddings(pixels), ids, mask)  # the whole model, every step
            loss = tool.instance_losses(SimpleNamespace(question=encoded, answers=answers), prompt).sum()
            optimizer.zero_grad()
            tool.model.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():  # greedy answer after every step (its early-stop check), from the images again
                tool.greedy(tool.encode_questions(tool.image_embeddings(pixels), ids, mask), prompt)
        return prompt.detach()[0].cpu()

    def describe(self, args: argparse.Namespace) -> str:
        b = BENCH_BLIP
        return (f"tool BLIP VQA (BlipForQuestionAnswering, hidden {b['hidden_size']}, {b['layers']} layers per tower, "
                f"image {b['image_size']}px, patch 8), {self.describe_prompt(args)}, {args.steps} steps, "
                f"{args.instances} instances (one question each)")


PROMPT_TUNING = VqaPromptTuning


# ---------------------------------------------------------------------- benchmarks/prompt_tool_seeds.py
LEARNED_COLOURS = ("orange", "purple")  # the quickstart's learn_colours


SERVED, RANDOM, ALWAYS = "pool, served", "random-prompt pool, same margin", "pool, always prompted"


def measure_seed(server: PromptToolServer, export: Path, seed: int) -> dict[str, dict[str, float]]:
    """The export's ``answer_margin`` chosen on validation records rendered with a seed of their own
    (``clova_train.tools.vqa.demo.VALIDATION_PER_ANSWER`` per answer, the fixed rule of
    ``clova_train.tools.operating_point``) and written into it; the export loaded again as a server loads it; then
    exact-match accuracy on the run's ``eval.jsonl`` per answer group (the colours the tiny BLIP has to learn, the
    colours it knows, all, each answer) without prompts, with the pool served at that margin, with the random-prompt
    pool at the same margin and with the pool always prompted (the paper's rule); and the operating point: the margin,
    the share of questions answered differently from the unmodified tool, and the share of its right answers lost."""
    from clova_train.tools.prompt_server import PromptToolServer
    from clova_train.tools.vqa.demo import (
        VALIDATION_PER_ANSWER, _default_records, evaluate, read_eval_records, render_validation_records,
    )
    from clova_train.tools.vqa.margin import calibrate_export

    records = _default_records(export)
    validation = render_validation_records(export, export.parent / "validation", VALIDATION_PER_ANSWER)
    calibrate_export(export, read_eval_records(validation), f"{VALIDATION_PER_ANSWER} rendered records per answer",
                     held_out=[records])
    server = PromptToolServer.from_export(export)
    table = evaluate(server, read_eval_records(records))
    groups = {"learned colours": [a for a in table if a in LEARNED_COLOURS],
              "known colours": [a for a in table if a not in LEARNED_COLOURS], "all": list(table),
              **{f"answer {a}": [a] for a in table}}
    scores: dict[str, dict[str, float]] = {}
    for name, answers in groups.items():
        total = sum(table[a][0] for a in answers)
        scores[name] = {column: sum(table[a][k] for a in answers) / total
                        for k, column in ((1, "no prompt"), (2, SERVED), (3, RANDOM), (4, ALWAYS))}
    right = sum(r[1] for r in table.values())
    scores["operating point"] = {
        "answer_margin": float(server.tool.answer_margin),
        "answers changed": sum(r[5] for r in table.values()) / sum(r[0] for r in table.values()),
        "right answers lost": sum(r[6] for r in table.values()) / right if right else 0.0,
    }
    return scores


SEEDS = SeedMeasurement(
    metric="exact-match accuracy",
    columns=("no prompt", SERVED, RANDOM, ALWAYS),
    contrasts=((SERVED, RANDOM),),
    measure=measure_seed,
    changed="answers changed",
)
