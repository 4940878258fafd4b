"""Activation memory per decoder layer of a LoRA-tuned causal LM, with and without gradient checkpointing.

The tool-LLM memory table (docs/tool-llm.md) is derived from per-layer figures: this measures them. A random Llama of
the given sizes (default: Vicuna-13B's layer: hidden 5120, MLP 13824, 40 heads; batch 4 x 2048 tokens) is built
twice, with ``--layers`` and with twice as many decoder layers, its frozen weights in bfloat16 and LoRA (r 16 on
q/k/v/o) in float32 as ``LoraToolLLM`` stores them under ``bf16-mixed``, and one training step (forward under bf16
autocast, backward) runs on each. Per layer = (measure at 2L - measure at L) / L, so the embedding, the head and the
loss cancel out. Measures:

* ``saved``: the bytes autograd keeps for the backward pass (every saved tensor's storage counted once, the frozen
  weights excluded): what the activations cost on any device;
* ``peak`` (CUDA only): ``torch.cuda.max_memory_allocated`` during the step minus the memory held before it;
* ``ms``: wall time of the step, per layer.

Rows: checkpointing off (the baseline) and on (``gradient_checkpointing: true``, what the Vicuna configs use). Only
transformers, peft and torch are needed. Results are appended to ``benchmarks/results/llm_layer_memory.md``.

    python benchmarks/llm_layer_memory.py [--device cuda] [--layers 2] [--batch 4] [--seq 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402

from clova_train.core.saved_tensors import SavedTensorBytes  # noqa: E402

VICUNA_13B = {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40,
              "vocab_size": 32000}


def build(layers: int, sizes: dict[str, int], device: str, checkpointing: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**sizes, num_hidden_layers=layers, max_position_embeddings=4096)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora).train()


def one_step(model: torch.nn.Module, batch: int, seq: int, response: int, device: str) -> dict[str, float]:
    """Saved bytes, peak CUDA memory above the start, and seconds of one forward + backward."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_memory = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    started = time.perf_counter()
    with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16), \
            SavedTensorBytes(p for p in model.parameters() if not p.requires_grad) as saved:
        # Only response positions get logits, as LoraToolLLM computes them (logits_to_keep).
        logits = model(input_ids=ids, logits_to_keep=response, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, -response:].flatten())
    loss.backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - start_memory if device.startswith("cuda") else float("nan")
    model.zero_grad(set_to_none=True)
    return {"saved": float(saved.total), "peak": float(peak), "seconds": seconds}


def measure(layers: int, sizes: dict[str, int], args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    """Per-layer figures from a model of ``layers`` and one of ``2 * layers`` decoder layers (the best of
    ``--repeats`` steps after a warm-up, for the time)."""
    results = []
    for count in (layers, 2 * layers):
        model = build(count, sizes, args.device, checkpointing)
        one_step(model, args.batch, args.seq, args.response, args.device)  # warm-up
        steps = [one_step(model, args.batch, args.seq, args.response, args.device) for _ in range(args.repeats)]
        results.append({"saved": steps[-1]["saved"], "peak": steps[-1]["peak"],
                        "seconds": min(s["seconds"] for s in steps)})
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    small, large = results
    return {key: (large[key] - small[key]) / layers for key in ("saved", "peak", "seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the smaller model (the other: twice)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--response", type=int, default=1200, help="response positions that get logits")
    parser.add_argument("--hidden", type=int, default=VICUNA_13B["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=VICUNA_13B["intermediate_size"])
    parser.add_argument("--heads", type=int, default=VICUNA_13B["num_attention_heads"])
    parser.add_argument("--vocab", type=int, default=VICUNA_13B["vocab_size"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    sizes = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_attention_heads": args.heads,
             "num_key_value_heads": args.heads, "vocab_size": args.vocab}
    rows = []
    for name, checkpointing in (("checkpointing off (baseline)", False), ("gradient_checkpointing: true", True)):
        per_layer = measure(args.layers, sizes, args, checkpointing)
        peak = "n/a (CPU)" if per_layer["peak"] != per_layer["peak"] else f"{per_layer['peak'] / 2**30:.3f}"
        rows.append(f"| {name} | {per_layer['saved'] / 2**30:.3f} | {peak} | {per_layer['seconds'] * 1e3:.1f} |")
        print(rows[-1], flush=True)
    description = (f"One LoRA training step (bf16 frozen weights, float32 LoRA r 16 on q/k/v/o, bf16 autocast) of a random "
                   f"Llama layer of hidden {args.hidden}, MLP {args.intermediate}, {args.heads} heads; batch {args.batch} "
                   f"x {args.seq} tokens, logits at {args.response} response positions; per decoder layer = (2L - L "
                   f"layers) / L with L = {args.layers}. Command: `python benchmarks/llm_layer_memory.py "
                   f"--device {args.device} --layers {args.layers} --batch {args.batch} --seq {args.seq}`")
    publish("llm_layer_memory", "Activation memory per decoder layer (LoRA, bf16)", f"{args.device}: {machine()}",
            description, ["per decoder layer", "GiB kept for backward", "GiB peak (CUDA)", "ms per step"], rows,
            record=not args.no_record)


if __name__ == "__main__":
    main()
