"""The GPU check (``make gpu-check``): everything the README claims of a GPU, run on one, in one script.

Stages, in the order they run by default (``--stages`` picks and orders them):

1. ``smoke``: the paper configs at their real size for a few steps in bf16 on the GPU (``smoke_real.py --device
   cuda``, one whole chunk or batch of the config's, Vicuna-13B at its own sizes): fit, export and serve, seconds per
   step, peak GPU memory (the whole fit's and each phase's), next to the memory tables (docs/tool-llm.md,
   docs/prompt-tools.md). The LLM cases run in a queue beside the prompt tools' (one GPU holds both; their timings are
   marked) and the models are built several at once. ``--smoke-cases`` picks the configs.
2. ``serving``: p50/p99 latency and requests/s of the smoke run's CLIP and Vicuna-13B exports behind ``clova-train
   serve`` at 1 and 8 concurrent clients, against the same model answering in-process (``serving_latency.py``).
3. ``prompt``: the prompt-tuning engine against the fair per-instance loop at the paper chunk size, CLIP ViT-L/14
   (chunk 32) and OWL-ViT B/32 LOC (chunk 32) on the smoke run's real-size models (``prompt_tuning.py``).
4. ``lora``: LoraToolLLM against the Hugging Face Trainer + PEFT with dynamic padding, bf16, 2048 x 16 Llama, a few
   hundred steps with the steady-state rate over the second half (``lora_finetune.py``).

The serving and prompt stages use what the smoke stage built (the exports and the real-size models), so they come
after it; the timing stages run alone, each in its own process. Built to fit the device time it is given
(``--budget-minutes``): each stage has a cap, a stage that would start with under a minute left is skipped and
listed, and the smoke run stops its own cases in time to write its table. Every table goes to its results file under
``benchmarks/results/``. Without a GPU (or without a package a stage needs) it stops before starting anything and
says why.

    python benchmarks/gpu_check.py [--budget-minutes 6.5] [--stages smoke serving prompt lora]
    python benchmarks/gpu_check.py --stages smoke lora --smoke-cases vqa replace controller llm-sharded
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NEEDED = ("torch", "lightning", "transformers", "peft", "open_clip", "diffusers", "gymnasium", "stable_baselines3",
          "jsonargparse", "safetensors", "scipy", "litserve", "clova_train")
SMOKE_OUTPUT = REPO / "checkpoints" / "gpu-check"
MODELS = REPO / "checkpoints" / "models" / "real-size"

# The order the smoke cases run in, most telling first: LOC (never yet run on a GPU), SEG and CLIP (the phase table's
# open questions) in the prompt tools' queue; the 13B LLM (whose export the serving stage loads) in the other. Any other
# case smoke_real.py has (a tool recipe's not listed here, a plug-in's) runs after these.
SMOKE_CASES = ["loc", "seg", "clip", "llm", "vqa", "replace", "controller", "llm-sharded", "hydra-gqa", "hydra-okvqa"]


@dataclass
class Command:
    """One benchmark run of a stage: its arguments after the python executable, the real-size models it tunes (built
    first when missing, as the smoke run builds them), the smoke run's exports it loads (skipped when one is missing:
    that smoke case did not run or failed) and the tool or export it measures (what ``--tools`` names)."""

    args: list[str]
    models: tuple[str, ...] = ()
    exports: tuple[str, ...] = ()
    name: str = ""


@dataclass
class Stage:
    """One stage: what it measures, the commands it runs, and at most how many minutes it may take."""

    what: str
    commands: list[Command]
    minutes: float


def prompt_benchmark(tool: str, model: str, chunk: int, *extra: str) -> Command:
    """The engine against the fair per-instance loop on one real-size model, one whole chunk at the paper size."""
    return Command([str(HERE / "prompt_tuning.py"), "--device", "cuda", "--tool", tool, "--model-dir",
                    str(MODELS / model), "--instances", str(chunk), "--chunk-size", str(chunk), "--steps", "5",
                    "--prompt-tokens", "100", "--repeats", "1", "--methods", "engine", "sequential", *extra],
                   models=(model,), name=tool)


def stages(smoke_cases: list[str]) -> dict[str, Stage]:
    clip_image = SMOKE_OUTPUT / "clip" / "data" / "concepts" / "purple" / "purple_001.png"
    return {
        "smoke": Stage("every chosen paper config at real size, bf16, one GPU: fit, export, serve",
                       [Command([str(HERE / "smoke_real.py"), "--device", "cuda", "--llm", "vicuna-13b", "--output",
                                 str(SMOKE_OUTPUT), "--models", str(MODELS), "--beside", "--build-jobs", "6",
                                 "--no-activation-modes", "--configs", *smoke_cases])], 4.0),
        "prompt": Stage("prompt tuning: engine vs fair loop at the paper chunk size (OWL-ViT B/32 LOC, CLIP ViT-L/14)",
                        [prompt_benchmark("loc", "owlvit-base-patch32", 32),
                         prompt_benchmark("clip", "clip-vit-l14", 32, "--image-size", "224")], 2.5),
        "serving": Stage("serving latency at 1 and 8 clients: CLIP ViT-L/14 and Vicuna-13B exports vs in-process",
                         [Command([str(HERE / "serving_latency.py"), str(SMOKE_OUTPUT / "clip" / "export"), "--device",
                                   "cuda", "--label", "CLIP ViT-L/14 (real size, random weights, pool of one chunk)",
                                   "--request", json.dumps({"images": [str(clip_image)], "labels": ["purple", "red"]}),
                                   "--requests", "64", "--baseline-requests", "32", "--log-dir",
                                   str(SMOKE_OUTPUT / "serving-clip")], exports=("clip",), name="clip"),
                          # the smoke run's LoRA export, or (no LLM smoke case this time) random adapter weights on
                          # the real-size base, exported without a fit
                          Command([str(HERE / "serving_latency.py"), str(SMOKE_OUTPUT / "llm" / "export"), "--device",
                                   "cuda", "--random-lora-on", str(MODELS / "vicuna-13b"), "--label",
                                   "Vicuna-13B LoRA (real size, random weights, adapter on the bf16 base)",
                                   "--max-tokens", "16", "--requests", "16", "--baseline-requests", "4",
                                   "--log-dir", str(SMOKE_OUTPUT / "serving-llm")], models=("vicuna-13b",),
                                  name="llm")], 3.0),
        "lora": Stage("LoRA: LoraToolLLM vs HF Trainer + PEFT (dynamic padding), bf16, 2048 x 16 Llama, steady state",
                      [Command([str(HERE / "lora_finetune.py"), "--device", "cuda", "--bf16", "--hidden-size", "2048",
                                "--layers", "16", "--steps", "150", "--steady-from", "50", "--batch-size", "8",
                                "--methods", "clova-train", "hf-dynamic"])], 3.0),
    }


def build_model(name: str, seconds: float) -> int | None:
    """Build one real-size model as the smoke run does (reused when finished); its exit code, None when stopped."""
    MODELS.mkdir(parents=True, exist_ok=True)
    return run_within([sys.executable, str(HERE / "real_size" / "models.py"), name, str(MODELS)], seconds)


def smoke_case_names() -> list[str]:
    """Every case of ``smoke_real.py`` (each tool recipe's, the LLM's and the controller's): those of
    :data:`SMOKE_CASES` in its order, then the others in ``smoke_real.py``'s."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import smoke_real

    known = list(smoke_real.cases(MODELS))
    return [name for name in SMOKE_CASES if name in known] + [name for name in known if name not in SMOKE_CASES]


def why_not() -> str | None:
    """Why the check cannot run here (None when it can): no CUDA device, or packages missing."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        return (f"these packages are not importable: {', '.join(missing)} (install the project first: `make install`, "
                "or `pip install -e .` into the device's Python)")
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU-only build)"
        return (f"torch {torch.__version__} sees no CUDA device (CUDA build: {build}; CUDA_VISIBLE_DEVICES and the "
                "driver decide what it sees). The check measures GPU time and GPU memory, so it runs only on a machine "
                "with a GPU; `make smoke-real` runs the same configs on CPU.")
    return None


def run_within(command: list[str], seconds: float, cwd: Path = REPO) -> int | None:
    """Run ``command`` in the repository; its exit code, or None when it was stopped at ``seconds``: SIGTERM first (the
    serving benchmark then stops its server's process group), SIGKILL 15 s later."""
    process = subprocess.Popen(command, cwd=cwd)
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=12.0, help="device time the whole check may take")
    parser.add_argument("--stages", nargs="+", choices=["smoke", "prompt", "serving", "lora"],
                        default=["smoke", "prompt", "serving", "lora"], help="which stages, in order")
    parser.add_argument("--tools", nargs="+", default=None,
                        help="the prompt stage's tools (default: loc clip), the serving stage's exports (clip, llm)")
    parser.add_argument("--smoke-cases", nargs="+", default=None,
                        help="the smoke stage's paper configs: smoke_real.py's case names, a tool recipe's name among "
                             f"them (default: all of them, {', '.join(SMOKE_CASES)} first)")
    parser.add_argument("--smoke-minutes", type=float, default=None, help="the smoke stage's cap (default 4)")
    parsed = parser.parse_args(argv)
    print(f"gpu-check: stages {', '.join(parsed.stages)}; budget {parsed.budget_minutes:g} min", flush=True)
    reason = why_not()
    if reason is not None:
        print(f"gpu-check: not run: {reason}", file=sys.stderr, flush=True)
        return 2
    import torch

    known = smoke_case_names()
    unknown = [name for name in parsed.smoke_cases or [] if name not in known]
    if unknown:
        parser.error(f"unknown smoke case(s) {', '.join(unknown)} (known: {', '.join(known)})")
    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    planned = stages(parsed.smoke_cases or known)
    if parsed.tools:
        for stage_name in ("prompt", "serving"):
            planned[stage_name].commands = [c for c in planned[stage_name].commands if c.name in parsed.tools]
    if parsed.smoke_minutes is not None:
        planned["smoke"].minutes = parsed.smoke_minutes
    deadline = time.monotonic() + parsed.budget_minutes * 60
    outcomes = []
    for name in parsed.stages:
        stage = planned[name]
        left = deadline - time.monotonic()
        if left < 60:
            outcomes.append(f"{name}: skipped ({left:.0f} s of the budget left): {stage.what}")
            continue
        allowed = min(left, stage.minutes * 60)
        print(f"gpu-check: {name}: {stage.what} (at most {allowed / 60:.1f} min)", flush=True)
        start = time.monotonic()
        notes: list[str] = []
        for command in stage.commands:
            script = Path(command.args[0]).name
            absent = [case for case in command.exports if not (SMOKE_OUTPUT / case / "export").is_dir()]
            if absent:
                notes.append(f"{script} skipped: no {', '.join(absent)} export from the smoke run")
                continue
            remaining = allowed - (time.monotonic() - start)
            for model in command.models:
                if not (MODELS / model / "real_size.json").is_file():
                    built = build_model(model, max(remaining, 1))
                    if built != 0:
                        notes.append(f"building {model} failed or ran out of time")
            args = command.args
            remaining = allowed - (time.monotonic() - start)
            if name == "smoke":  # it stops its own cases in time to write its table
                args = [*args, "--budget-minutes", f"{(remaining - 20) / 60:.2f}"]
            if remaining < 20:
                notes.append(f"{script} {' '.join(args[1:6])} ...: no time left")
                continue
            returncode = run_within([sys.executable, *args], remaining)
            if returncode is None:
                notes.append(f"{script} stopped at the stage's time limit")
                break
            if returncode != 0:
                notes.append(f"{script} FAILED (exit {returncode})")
        status = "ok" if not notes else "; ".join(notes)
        outcomes.append(f"{name}: {status} in {(time.monotonic() - start) / 60:.1f} min: {stage.what}")
    print("gpu-check summary:\n  " + "\n  ".join(outcomes), flush=True)
    return 0 if all(": ok " in line for line in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
