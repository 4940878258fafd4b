"""LoRA fine-tuning throughput: clova-train's LoraToolLLM against the Hugging Face Trainer + PEFT, in one run.

Same model (a small random Llama), tokenizer, data (synthetic GPT4Tools records), LoRA config, optimizer,
learning rate schedule, batch size, number of steps and threads. Methods:

* ``clova-train``: ``LoraToolLLM`` + ``ToolInstructionDataModule`` under a Lightning ``Trainer`` (padding
  to the longest sample of the batch, length-grouped batches, response-only loss computed from the
  logits at response positions only, no attention mask on right-padded batches: exact, same precision);
* ``hf-padded``: the public GPT4Tools recipe: every sample padded to ``max_length``, HF ``Trainer``;
* ``hf-dynamic``: HF ``Trainer`` with dynamic padding (``DataCollatorForSeq2Seq``) and
  ``train_sampling_strategy="group_by_length"``.

All three train on the same token ids and labels (the clova-train encoding). Reported per method:
trained (non-padding) tokens per second, timed from the end of the first step to the end of the last
(model loading and the first step's warm-up excluded for every method), mean loss over the last 10
steps, and peak RSS above the process's size before training. Each runs in its own spawned process. Results are appended to ``benchmarks/results/lora_finetune.md``.

    python benchmarks/lora_finetune.py [--steps 30] [--batch-size 8] [--max-length 2048]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as queue_module
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402

BENCH_LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "max_position_embeddings": 4096}
LORA = {"r": 16, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


METHODS = ("clova-train", "hf-dynamic", "hf-padded")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_memory_mb(base: float) -> float:
    """Peak GPU memory allocated on a GPU run; else the peak RSS above ``base``."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
        return torch.cuda.max_memory_allocated() / 1e6
    return _rss_mb() - base


def model_sizes(args: argparse.Namespace) -> dict:
    """The benchmark Llama's sizes: :data:`BENCH_LLAMA` at ``--hidden-size`` wide and ``--layers`` deep (head size 32 as
    there; at 2048 wide, 16 heads of 128 as the real-size stand-in)."""
    heads = 16 if args.hidden_size >= 2048 else max(1, args.hidden_size // 32)
    return {**BENCH_LLAMA, "hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
            "num_attention_heads": heads, "num_key_value_heads": heads if args.hidden_size >= 2048 else max(1, heads // 2),
            "intermediate_size": args.hidden_size * 688 // 256}


def build(workdir: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    import clova_train.quickstart.tiny_llama as tiny
    from clova_train.datamodules.tool_llm.tool_conversations import SEEN_TOOLS, write_synthetic_split

    texts, _ = tiny.tool_corpus(0)
    tiny.TINY_LLAMA_CONFIG.update(model_sizes(args))
    model_dir = tiny.make_tiny_llama(workdir / "model", texts)
    train = write_synthetic_split(workdir / "train.json", list(SEEN_TOOLS), 6, 30, args.tools_per_prompt, seed=0)
    return model_dir, train


def _encoded(model_dir: Path, train: Path, max_length: int):
    from clova_train.datamodules import ToolInstructionDataModule

    dm = ToolInstructionDataModule(str(train), str(model_dir), max_length=max_length, group_by_length=True)
    dm.setup()
    return dm


def run_clova(model_dir: Path, train: Path, args: argparse.Namespace, out: Path) -> dict:
    from lightning import Trainer

    from clova_train.models import LoraToolLLM

    dm = _encoded(model_dir, train, args.max_length)
    dm.batch_size = args.batch_size
    module = LoraToolLLM(str(model_dir), lr=args.lr, warmup_steps=args.warmup, lora_r=LORA["r"],
                         lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"])
    losses, tokens, times = [], [], []

    class Record(__import__("lightning").pytorch.callbacks.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            tokens.append(int(batch["attention_mask"].sum()))
            times.append(time.perf_counter())

    trainer = Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                      precision="bf16-mixed" if args.bf16 else "32-true", max_steps=args.steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      default_root_dir=str(out), callbacks=[Record()])
    base = _rss_mb()
    trainer.fit(module, dm)
    return _summary(times, tokens, losses, _peak_memory_mb(base))


def _summary(times: list[float], tokens: list[int], losses: list[float], memory: float) -> dict:
    """``times[i]`` ends step i and ``tokens[i]`` is its batch's non-padding tokens; the steady-state figures are
    taken in the parent from the same lists."""
    return {"seconds": times[-1] - times[0], "tokens": sum(tokens[1:len(times)]), "losses": losses, "memory": memory,
            "times": times, "step_tokens": tokens[:len(times)]}


def steady_rate(result: dict, start: int) -> float | None:
    """Non-padding tokens per second from the end of step ``start`` to the end of the last step (None when the run
    had no steps after it)."""
    times, tokens = result["times"], result["step_tokens"]
    if start < 0 or start >= len(times) - 1:
        return None
    return sum(tokens[start + 1:]) / (times[-1] - times[start])


def run_hf(model_dir: Path, train: Path, args: argparse.Namespace, out: Path, padded: bool) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    dm = _encoded(model_dir, train, args.max_length)
    tokenizer = dm.tokenizer
    samples = dm.splits["train"].samples
    pad = tokenizer.pad_token_id
    if padded:
        rows = [{"input_ids": s.input_ids + [pad] * (args.max_length - len(s.input_ids)),
                 "attention_mask": [1] * len(s.input_ids) + [0] * (args.max_length - len(s.input_ids)),
                 "labels": s.labels + [-100] * (args.max_length - len(s.labels))} for s in samples]
    else:
        rows = [{"input_ids": s.input_ids, "attention_mask": [1] * len(s.input_ids), "labels": s.labels} for s in samples]
    # bf16: the base stored in bf16 (as LoraToolLLM stores it under bf16-mixed), PEFT's adapters upcast to float32
    base_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16 if args.bf16 else torch.float32)
    model = get_peft_model(base_model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    losses, tokens, times = [], [], []

    class Record(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            times.append(time.perf_counter())

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)

    def counting_collator(features):
        batch = collator(features)
        tokens.append(int(batch["attention_mask"].sum()))
        return batch

    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        warmup_steps=args.warmup, weight_decay=0.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=args.device != "cuda", bf16=args.bf16, disable_tqdm=True, remove_unused_columns=False, lr_scheduler_type="linear",
        train_sampling_strategy="random" if padded else "group_by_length",
    )
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=counting_collator,
                      callbacks=[Record()])
    base = _rss_mb()
    trainer.train()
    return _summary(times, tokens, losses, _peak_memory_mb(base))


def _child(kind: str, model_dir: str, train: str, args: argparse.Namespace, out: str, queue: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir_p, train_p, out_p = Path(model_dir), Path(train), Path(out)
    if kind == "clova-train":
        queue.put(run_clova(model_dir_p, train_p, args, out_p))
    else:
        queue.put(run_hf(model_dir_p, train_p, args, out_p, padded=kind == "hf-padded"))


def measure(kind: str, model_dir: Path, train: Path, args: argparse.Namespace, workdir: Path) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, str(model_dir), str(train), args, str(workdir / kind), queue))
    proc.start()
    while True:  # a child that dies before it reports must end the benchmark, not leave it waiting
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                raise SystemExit(f"lora_finetune: the {kind} run ended (exit {proc.exitcode}) without a result; "
                                 "its error is above") from None
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048, help="the public recipe pads every sample to this")
    parser.add_argument("--tools-per-prompt", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every method trains")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 for every method (Lightning bf16-mixed with the base stored in bf16; HF bf16=True, "
                             "base loaded in bf16)")
    parser.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"], help="the random Llama's width")
    parser.add_argument("--layers", type=int, default=BENCH_LLAMA["num_hidden_layers"], help="its decoder layers")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="which methods to time (clova-train first: the others are compared with it)")
    parser.add_argument("--steady-from", type=int, default=None,
                        help="also report the rate from the end of this step on (the steady state: every sequence "
                             "length met, allocator and kernels warm)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.methods[0] != "clova-train":
        parser.error("--methods: clova-train comes first (the others are compared with it)")
    if args.steady_from is not None and not 0 <= args.steady_from < args.steps - 1:
        parser.error(f"--steady-from must be between 0 and --steps - 2 ({args.steps - 2})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir, train = build(workdir, args)
        results = {kind: measure(kind, model_dir, train, args, workdir) for kind in args.methods}

    ours = results["clova-train"]
    ours_rate = ours["tokens"] / ours["seconds"]
    ours_steady = steady_rate(ours, args.steady_from) if args.steady_from is not None else None
    rows = []
    for kind, r in results.items():
        rate = r["tokens"] / r["seconds"]
        final = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        steady = ""
        if args.steady_from is not None:
            theirs = steady_rate(r, args.steady_from)
            steady = (f" {theirs:.0f} | {ours_steady / theirs:.2f}x |" if theirs and ours_steady else " - | - |")
        rows.append(f"| {kind} | {rate:.0f} | {ours_rate / rate:.2f}x |{steady} {final:.3f} | {r['memory']:.0f} | "
                    f"{r['seconds']:.1f} |")
    sizes = model_sizes(args)
    where = f"{args.device}{' bf16' if args.bf16 else ''}: {machine()}" + ("" if args.device == "cuda" else f", {args.threads} threads")
    publish(
        "lora_finetune", "LoRA fine-tuning benchmark results", where,
        f"Llama {sizes['hidden_size']}d x {sizes['num_hidden_layers']} layers (random weights), "
        f"LoRA r 16 on q/k/v/o, {args.steps} steps of batch {args.batch_size}, lr {args.lr}, synthetic GPT4Tools "
        f"records with {args.tools_per_prompt} tools per prompt, max_length {args.max_length}",
        ["method", "trained tokens/s (non-padding)", "clova-train speed-up",
         *([f"tokens/s after step {args.steady_from}", "speed-up there"] if args.steady_from is not None else []),
         "loss (last 10 steps)",
         "peak GPU MB" if args.device == "cuda" else "peak RSS MB",
         "timed seconds"],
        rows, record=not args.no_record,
    )

if __name__ == "__main__":
    main()
