"""Per-instance prompt tuning of any tool with a recipe: our engine against two sequential baselines, in one run.

Methods (same model, data, steps, learning rate, initial prompts and threads):

* ``engine``: clova-train's ``PromptTuning`` with the tool under a Lightning ``Trainer`` (chunks of
  instances in lockstep, frozen weights, prompt-independent work done once per instance, a checkpoint per
  chunk).
* ``reference``: the public procedure the tool is compared with, as its benchmark settings carry it
  (``clova_train/tools/<name>/benchmark.py``: for CLOVA's tools their public prompt training, one instance at a
  time with weights that still require gradients, the whole model re-run every step and the public code's per-step
  checks). A tool whose recipe has no benchmark settings (a plug-in) is not offered it.
* ``sequential``: a fair sequential loop: one instance at a time, but with frozen weights, the
  prompt-independent work done once per instance and the same prompted forward as the engine.

The tool's benchmark settings (:mod:`clova_train.tools.benchmark_settings`) pick the small model of its real
architecture, the data, the learning rate and the table's description; a recipe without them is timed on its tiny
model built without pretraining and its synthetic datamodule's data, with its quickstart config's settings.

All methods run in float32. Each is timed ``--repeats`` times (fresh process each time) and the best
run counts, which damps the noise of a shared machine.

Each method runs in its own spawned process so that its peak memory (RSS above the loaded model on the
CPU, ``max_memory_allocated`` on a GPU) is its own. The learned prompts of all methods are compared with
the engine's (max absolute difference). Results are appended to ``benchmarks/results/prompt_tuning.md``.

    python benchmarks/prompt_tuning.py                      # the default tool, CPU defaults
    python benchmarks/prompt_tuning.py --tool NAME          # any recipe (python -m clova_train.quickstart.demo --list)
    python benchmarks/prompt_tuning.py --device cuda --chunk-size 32 --instances 64 --model ViT-B-16
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clova_train.tools.benchmark_settings import PromptTuningBenchmark, prompt_tuning_settings
from clova_train.tools.recipes import tool_recipe, tool_recipes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402

DEFAULT_TOOL = "clip"
METHODS = ("engine", "sequential", "reference")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _settings(args: argparse.Namespace) -> PromptTuningBenchmark:
    return prompt_tuning_settings(tool_recipe(args.tool))


def _datamodule_class(settings: PromptTuningBenchmark) -> type:
    return settings.recipe.datamodule_class(synthetic=settings.synthetic_data)


def _build(args: argparse.Namespace, workdir: Path) -> tuple[str, Path]:
    """The tool's model name (``--model-dir``, else a small model of the real architecture built here) and its data."""
    settings = _settings(args)
    if args.model_dir is not None:
        model_name = settings.model_dir_name(args.model_dir)
    else:
        model_name = settings.build_small_model(workdir, args)
    return model_name, settings.write_data(workdir, args, _datamodule_class(settings))


class FirstInstances:
    """The first ``count`` instances of a dataset: every method tunes exactly ``--instances``."""

    def __init__(self, dataset: Any, count: int) -> None:
        if len(dataset) < count:
            raise SystemExit(f"the benchmark's data has {len(dataset)} instances, fewer than --instances {count}")
        self.dataset = dataset
        self.instance_ids = list(dataset.instance_ids[:count])

    def __len__(self) -> int:
        return len(self.instance_ids)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.dataset[index]


def _module(settings: PromptTuningBenchmark, args: argparse.Namespace, model_name: str):
    from clova_train.models import PromptTuning

    tool = settings.make_tool(model_name, args)
    return PromptTuning(tool, lr=args.lr, steps=args.steps, keep_rejected_prompts=True, on_existing_pool="overwrite")


def _datamodule(settings: PromptTuningBenchmark, args: argparse.Namespace, data: Path, chunk_size: int):
    datamodule = settings.make_datamodule(_datamodule_class(settings), data, chunk_size, args)
    datamodule.instances = FirstInstances(datamodule.instances, args.instances)
    return datamodule


def run_engine(args: argparse.Namespace, model_name: str, data: Path, out: Path) -> dict:
    from lightning import Trainer

    settings = _settings(args)
    module = _module(settings, args, model_name).to(args.device)
    dm = _datamodule(settings, args, data, args.chunk_size)
    trainer = Trainer(
        accelerator="gpu" if args.device.startswith("cuda") else "cpu", devices=1, max_epochs=1, logger=False,
        limit_val_batches=0, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
    )
    base = _peak_rss_mb()
    _reset_cuda(args)
    start = time.perf_counter()
    trainer.fit(module, dm)
    _sync(args)
    seconds = time.perf_counter() - start
    prompts = {i: module.records[i].prompt for i in dm.instances.instance_ids}
    return _result(args, seconds, base, prompts)


def run_loop(args: argparse.Namespace, model_name: str, data: Path, kind: str) -> dict:
    from lightning.pytorch.utilities import move_data_to_device

    settings = _settings(args)
    module = _module(settings, args, model_name).to(args.device)
    dm = _datamodule(settings, args, data, 1)
    step = settings.reference_prompt if kind == "reference" else settings.fair_prompt
    base = _peak_rss_mb()
    _reset_cuda(args)
    start = time.perf_counter()
    prompts = {}
    for index in range(len(dm.instances)):
        item = settings.loop_item(dm.instances[index])
        if item.keep_unchanged:  # the engine stores a zero prompt without tuning it
            prompts[item.instance_id] = torch.zeros(module.tool.prompt_shape)
            continue
        # on the device as Lightning moves the engine's chunks (boxes, masks and targets too, not only the images)
        item = move_data_to_device(item, torch.device(args.device))
        prompts[item.instance_id] = step(module, item, args.device)
    _sync(args)
    return _result(args, time.perf_counter() - start, base, prompts)


def _reset_cuda(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _sync(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def _result(args: argparse.Namespace, seconds: float, base_rss: float, prompts: dict) -> dict:
    if args.device.startswith("cuda"):
        memory = torch.cuda.max_memory_allocated() / 2**20
    else:
        memory = _peak_rss_mb() - base_rss
    # numpy, not tensors: tensors cross processes as shared-memory handles that die with the child
    return {"seconds": seconds, "memory_mb": memory, "prompts": {k: v.numpy() for k, v in prompts.items()}}


def _child(kind: str, args: argparse.Namespace, model_name: str, data: str, out: str, queue: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if kind == "engine":
        queue.put(run_engine(args, model_name, Path(data), Path(out)))
    else:
        queue.put(run_loop(args, model_name, Path(data), kind))


def measure(kind: str, args: argparse.Namespace, model_name: str, data: Path, workdir: Path) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, args, model_name, str(data), str(workdir / kind), queue))
    proc.start()
    while True:  # a child that dies (out of memory, a crash) must not leave the parent waiting forever
        try:
            result = queue.get(timeout=5)
            break
        except Exception:
            if not proc.is_alive():
                raise SystemExit(f"the {kind} run died (exit code {proc.exitcode})")
    proc.join()
    result["prompts"] = {k: torch.from_numpy(v) for k, v in result["prompts"].items()}
    return result


def _model_label(model_dir: Path) -> str:
    """A saved model's name: its real-size build record's, else the directory's."""
    record = model_dir / "real_size.json"
    if record.is_file():
        import json

        described = json.loads(record.read_text())
        return (f"{model_dir.name}, {described.get('checkpoint', '?')}'s architecture at "
                f"{described.get('parameters', 0) / 1e6:,.1f} M parameters")
    return model_dir.name


def _description(settings: PromptTuningBenchmark, args: argparse.Namespace) -> str:
    """The table's description of the tool, its model and data."""
    if args.model_dir is None:
        return settings.describe(args)
    return (f"tool {args.tool}, model {_model_label(args.model_dir)} (random weights), "
            f"{settings.describe_prompt(args)}, {args.steps} steps, {args.instances} instances")


def parse_arguments(argv: list[str] | None = None) -> tuple[argparse.Namespace, PromptTuningBenchmark]:
    """The command line, with the tool's defaults filled in, and the tool's benchmark settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=list(tool_recipes()), default=DEFAULT_TOOL,
                        help="which prompt tool to tune (any tool with a recipe)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None,
                        help="default: the tool's own (the paper's learning rate, its tool class's default_lr)")
    parser.add_argument("--image-size", type=int, default=64, help="the images' size, where the tool's data takes one")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="runs per method; the fastest counts")
    parser.add_argument("--model", default=None,
                        help="a named architecture for the small model, where the tool's settings take one (an "
                             "open_clip architecture; random weights); default: the tool's small benchmark model")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a saved model of the tool's architecture to tune on instead of the small benchmark one "
                             "(for example a real-size build of benchmarks/smoke_real.py); random weights do for timing")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                        help="which methods to time (engine first; default: all the tool offers)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    args = parser.parse_args(argv)
    settings = _settings(args)
    offered = [m for m in METHODS if m != "reference" or settings.reference is not None]
    if args.methods is None:
        args.methods = offered
    if args.methods[0] != "engine":
        parser.error("--methods: the engine comes first (every other method is compared with it)")
    if "reference" in args.methods and settings.reference is None:
        parser.error(f"--methods: the {args.tool} tool's recipe has no benchmark settings naming a public procedure "
                     f"to compare with, so there is no reference method (offered: {' '.join(offered)})")
    if args.lr is None:
        args.lr = settings.lr
    return args, settings


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_arguments(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_name, data = _build(args, workdir)
        results = {}
        for _ in range(args.repeats):
            for kind in args.methods:
                run = measure(kind, args, model_name, data, workdir)
                if kind not in results or run["seconds"] < results[kind]["seconds"]:
                    results[kind] = run

    engine = results["engine"]
    rows = []
    for kind in args.methods:
        r = results[kind]
        diff = max(float((r["prompts"][i] - engine["prompts"][i]).abs().max()) for i in engine["prompts"])
        rows.append(
            f"| {kind} | {args.instances / r['seconds']:.2f} | {r['seconds'] / engine['seconds']:.2f}x | "
            f"{r['memory_mb']:.0f} | {diff:.2e} |"
        )
    publish(
        "prompt_tuning", "Prompt-tuning benchmark results", f"{args.device}: {machine()}",
        f"{_description(settings, args)}, engine chunk size {args.chunk_size}, {args.threads} threads, best of "
        f"{args.repeats} runs per method"
        + ("" if args.device == "cpu" else ", peak memory: torch's max_memory_allocated"),
        ["method", "instances/s", "engine speed-up over it", "peak memory MB", "max abs prompt diff vs engine"],
        rows, record=not args.no_record,
    )


if __name__ == "__main__":
    sys.exit(main())
