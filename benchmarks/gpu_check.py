"""The GPU check (``make gpu-check``): everything the README claims of a GPU, run on one, in one script.

1. The LoRA benchmark on the GPU in bf16: LoraToolLLM against the Hugging Face Trainer + PEFT with dynamic padding
   (and the public recipe's padding), same run, at the stand-in's 2048 x 16 sizes (``lora_finetune.py``).
2. The prompt-tuning benchmark on the GPU at CLIP ViT-L/14 sizes: the chunked engine against the fair per-instance
   loop, same run (``prompt_tuning.py``).
3. Every paper config at its real size for a few steps in bf16 on the GPU (``smoke_real.py --device cuda``, one whole
   chunk or batch of the config's, Vicuna-13B at its own sizes): seconds per step, instances or tokens per second
   and peak GPU memory (the whole fit's and each phase's), next to the README's memory table (docs/tool-llm.md,
   docs/prompt-tools.md). The LLM cases run in a queue beside the prompt tools' (one GPU holds both; their timings
   are marked), the models are built several at once, and the cases go in order of what the memory tables rest on
   most.

The two benchmarks run first and alone, since they compare timings. Built to fit the device time it is given
(``--budget-minutes``, 25 by default): the benchmarks have their own caps, the smoke run the rest, and a case that
would start with under a minute left is skipped and listed. Every table goes to its results file under
``benchmarks/results/``. Without a GPU (or without a package a stage needs) it stops before starting anything and says
why.

    python benchmarks/gpu_check.py [--budget-minutes 25] [--stages smoke prompt lora]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEEDED = ("torch", "lightning", "transformers", "peft", "open_clip", "diffusers", "gymnasium", "stable_baselines3",
          "jsonargparse", "safetensors", "scipy", "clova_train")

# the smoke cases, most telling first: the 13B LLM and the controller in one queue, the prompt tools in the other
SMOKE_CASES = ["llm", "controller", "llm-sharded", "replace", "clip", "loc", "seg", "vqa"]

STAGES: dict[str, tuple[str, list[str], float]] = {
    # name: (what it measures, its arguments after the python executable, its share of the budget: at most that many
    # minutes, None for what is left)
    "lora": ("LoRA: LoraToolLLM vs HF Trainer + PEFT (dynamic padding and padded), bf16, 2048 x 16 Llama",
             [str(HERE / "lora_finetune.py"), "--device", "cuda", "--bf16", "--hidden-size", "2048", "--layers", "16",
              "--steps", "20", "--batch-size", "8"], 2.5),
    # 32 instances x 20 steps, best of 2, did not finish in 2.5 minutes on an H100 (the per-instance loops dominate)
    "prompt": ("prompt tuning: engine vs fair loop, CLIP ViT-L/14 at 224 px, 100 x 3 prompt tokens",
               [str(HERE / "prompt_tuning.py"), "--device", "cuda", "--model", "ViT-L-14", "--image-size", "224",
                "--instances", "16", "--chunk-size", "16", "--steps", "10", "--prompt-tokens", "100", "--repeats", "1"],
               4.0),
    "smoke": ("every paper config at real size, bf16, one GPU",
              [str(HERE / "smoke_real.py"), "--device", "cuda", "--llm", "vicuna-13b", "--output",
               "checkpoints/gpu-check", "--models", "checkpoints/models/real-size", "--beside", "--build-jobs", "6",
               "--configs", *SMOKE_CASES], None),
}


def why_not(stages: list[str]) -> str | None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=25.0, help="device time the whole check may take")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES), help="which stages, in order")
    parsed = parser.parse_args(argv)
    print(f"gpu-check: stages {', '.join(parsed.stages)}; budget {parsed.budget_minutes:g} min", flush=True)
    reason = why_not(parsed.stages)
    if reason is not None:
        print(f"gpu-check: not run: {reason}", file=sys.stderr, flush=True)
        return 2
    import torch

    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    deadline = time.monotonic() + parsed.budget_minutes * 60
    outcomes = []
    for name in parsed.stages:
        what, args, share = STAGES[name]
        left = deadline - time.monotonic()
        if left < 60:
            outcomes.append(f"{name}: skipped ({left:.0f} s of the budget left): {what}")
            continue
        allowed = left if share is None else min(left, share * 60)
        if name == "smoke":  # it stops its own cases in time to write its table
            args = [*args, "--budget-minutes", f"{(allowed - 20) / 60:.2f}"]
        print(f"gpu-check: {name}: {what} (at most {allowed / 60:.1f} min)", flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run([sys.executable, *args], timeout=allowed)
            status = "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = "stopped at the budget"
        outcomes.append(f"{name}: {status} in {(time.monotonic() - start) / 60:.1f} min: {what}")
    print("gpu-check summary:\n  " + "\n  ".join(outcomes), flush=True)
    return 0 if all(": ok " in line for line in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
