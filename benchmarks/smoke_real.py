"""Real-size smoke check (``make smoke-real``): every paper config at its real architecture and size, offline.

For each paper config (every tool recipe's with a smoke-real case: ``clova_train/tools/<name>/recipe.py``, or a
plug-in's; then the tool-use LLM's and the controllers'): build its model at the real size with random weights in the
real checkpoint's layout (:mod:`real_size.models` beside this file, or the plug-in recipe's own builder; cached under
``--models``), write a little synthetic data in the real formats at the paths the config names (the recipe's writer,
which also gives the request its export serves; for HYDRA's controller on a benchmark's task files, the shapes world's
scenes in the benchmark's formats and the exports its ImagePatch tools load, see :func:`hydra_benchmark`), run
``clova-train fit`` (``controller fit``) with the config as shipped plus the overrides listed in the table (local
model paths, a few steps, a few samples; nothing that changes a shape), export the run and load the export for
serving (one request answered, one chat reply generated, the TorchScript and SB3 controller loaded). Each step runs in
its own process, as a user runs it; the table gives seconds per step, peak resident memory, parameters and the
activations one training instance (one sample) keeps, measured, next to whether each stage succeeded. Not part of
``make test``; ``tests/project/test_smoke_real.py`` runs one config.

The same runner serves ``make gpu-check`` (``--device cuda``: bf16-mixed on one GPU, peak GPU memory recorded).

    python benchmarks/smoke_real.py                      # every config, CPU (27 minutes on 2 cores, models built)
    python benchmarks/smoke_real.py --configs loc vqa    # some of them
    python benchmarks/smoke_real.py --device cuda --build-jobs 6 --beside --budget-minutes 6   # as gpu-check runs it

``--build-jobs`` builds a queue's models first, that many at once (the CPU's threads shared among them). ``--beside`` runs
the LLM cases in a second queue beside the others (one GPU holds both): their s/step are then marked as measured with
a neighbour. ``--budget-minutes`` caps the whole run: a case that would start with under a minute left is skipped and
listed as such, and every process is stopped at the deadline, so the table is always written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_size import model_folder  # noqa: E402
from results_file import machine, publish  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "paper"
# the fits import these through PYTHONPATH (run_stage puts this folder on it): benchmark code, not in the package
PROBE = "real_size.probe.StepProbe"
MEMORY_PROBE = "real_size.probe.ActivationMemory"
HERE = Path(__file__).resolve().parent
MEMORY_MODES = ("fp32", "fp32 checkpointed", "bf16", "bf16 checkpointed")
ACTIVATIONS_LINE = re.compile(r"prompt tuning: ([\d,.]+) MB of activations per instance \(\+([\d,.]+) MB shared\)")


@dataclass
class Case:
    """One paper config as the smoke run drives it.

    Args:
        name: short name (``--configs``): the tool recipe's name for a prompt tool.
        config: the config file, relative to the repository or absolute (a recipe's ``paper_config``).
        model: the real-size model it runs on: a :data:`~real_size.models.REAL_SIZES` name or a plug-in's
            ``"module:function"`` builder (None: no model file).
        overrides: what the run changes, ``{model}`` standing for the model directory.
        data: writes the synthetic data under the working directory, at the config's own paths (``full``: one whole
            chunk of the config's), and returns the JSON request a prompt tool's export serves (paths relative to the
            working directory; None for the other kinds).
        kind: ``prompt`` (PromptTuning), ``lora`` (LoraToolLLM) or ``controller``.
        inner_steps: prompt tuning's optimisation steps per instance (the ``steps`` override).
        ranks: processes the run uses on CPU (the sharded config: 2 data-parallel ranks).
        stand_in: what differs from the config's own models, where ``model`` does not say (printed in the table).
    """

    name: str
    config: str
    model: str | None
    overrides: list[str]
    data: Callable[[Path, bool], dict | None]
    kind: str = "prompt"
    inner_steps: int = 0
    ranks: int = 1
    stand_in: str = ""

    @property
    def path(self) -> Path:
        """The config file."""
        return REPO / self.config

    @property
    def label(self) -> str:
        """The config as the table names it: its path under ``configs/paper``, else the path as given."""
        try:
            return self.path.relative_to(CONFIGS).as_posix()
        except ValueError:
            return self.config


# ------------------------------------------------------------------------------------------------- synthetic data
# A prompt tool's writer is its recipe's (clova_train/tools/<name>/). Each takes the working directory and whether to
# write one whole chunk of the config's (the GPU check, whose memory figures must be the config's own) or the fewest
# instances that run every stage (CPU).
def recipe_data(spec: str) -> Callable[[Path, bool], dict | None]:
    """A recipe's ``"module:function"`` data writer, imported when the case runs."""
    def write(workdir: Path, full: bool) -> dict | None:
        from clova_train.tools.recipes import resolve

        return resolve(spec)(workdir, full)
    return write


def tool_instructions(model_dir: Path) -> Callable[[Path, bool], None]:
    def write(workdir: Path, full: bool) -> None:
        from clova_train.datamodules import SyntheticToolDataModule

        scratch = workdir / "data" / "synthetic"
        SyntheticToolDataModule(str(scratch), str(model_dir), conversations_per_tool=1, negatives=4,
                                eval_conversations_per_tool=1).prepare_data()
        target = workdir / "data" / "gpt4tools"
        target.mkdir(parents=True, exist_ok=True)
        for source, name, keep in (("train.json", "gpt4tools_71k.json", None), ("val.json", "gpt4tools_val_seen.json", 2),
                                   ("test.json", "gpt4tools_test_unseen.json", 2)):
            records = json.loads((scratch / source).read_text(encoding="utf-8"))
            (target / name).write_text(json.dumps(records[:keep] if keep else records), encoding="utf-8")
    return write


def no_data(workdir: Path, full: bool) -> None:
    return None


# HYDRA's controller on a benchmark's task files: the shapes world's scenes (its training tasks for training, its
# held-out ones for evaluation, each walked once by eval_episodes 10) in the files' formats, at 512 px (8 x 64: about
# a GQA or COCO image's size); its ImagePatch tools: ImageToolsConfig field -> tool recipe. The tools are the recipes'
# tiny random-weight models, not the real-size ones: on 2 CPU cores a real-size OWL-ViT B/32 + CLIP ViT-L/14 + BLIP
# VQA program takes several seconds per environment step (the case would run for most of an hour).
HYDRA_TRAIN_IDS = [i for i in range(1, 50) if i % 5]
HYDRA_EVAL_IDS = list(range(5, 55, 5))
HYDRA_SCALE = 8
HYDRA_TOOLS = {"loc": "loc", "classify": "clip", "vqa": "vqa"}
HYDRA_TOOL_EXPORTS = "tool-exports"  # under the working directory; the overrides point hydra.tasks.tools here
HYDRA_DEPTH = f"{HYDRA_TOOL_EXPORTS}/tiny-depth-anything"
HYDRA_STAND_IN = ("ImagePatch tools: tiny random-weight OWL-ViT, CLIP and BLIP VQA exports and a tiny Depth Anything, "
                  "not the real-size tools")


def _place(source: str | Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def hydra_benchmark(config: str) -> Callable[[Path, bool], None]:
    """Writes the benchmark a HYDRA controller config reads (``hydra.tasks.train`` / ``eval``: each split's files in
    its format, at its paths, with its images) from the offline shapes world, and the tools the case's overrides name:
    unprompted exports (an empty prompt pool) of the LOC, CLASSIFY and VQA tools on their recipes' tiny random-weight
    models (built under ``tool-models/``), as ``make demo-hydra-benchmark`` writes them, and a tiny random Depth
    Anything."""
    def write(workdir: Path, full: bool) -> None:
        import yaml

        from clova_train.envs.tasks.formats import load_tasks
        from clova_train.envs.tasks.offline import write_offline_benchmark
        from clova_train.quickstart.hydra_benchmark import write_unprompted_export
        from clova_train.tools.depth.tiny import make_tiny_depth_anything
        from clova_train.tools.recipes import tool_recipe

        tasks = yaml.safe_load((REPO / config).read_text(encoding="utf-8"))["hydra"]["tasks"]
        scratch = workdir / "data" / "offline-scenes"
        written = write_offline_benchmark(scratch, HYDRA_TRAIN_IDS, HYDRA_EVAL_IDS, HYDRA_SCALE,
                                          train_format=tasks["train"]["format"], eval_format=tasks["eval"]["format"])
        for split in ("train", "eval"):
            source, target = written[f"{tasks[split]['format']}-{split}"], tasks[split]
            for key in ("questions", "annotations"):
                if target.get(key):
                    _place(getattr(source, key), workdir / target[key])
            for task in load_tasks(source)[0]:
                _place(task.image, workdir / target["images"] / task.image.name)
        shutil.rmtree(scratch)
        for field, name in HYDRA_TOOLS.items():
            tiny = tool_recipe(name).tiny_model
            model_dir = tiny.build(workdir / "tool-models" / tiny.kind, seed=0, pretrain_steps=0)
            write_unprompted_export(name, model_dir, workdir / HYDRA_TOOL_EXPORTS / field)
        make_tiny_depth_anything(workdir / HYDRA_DEPTH)
    return write


# ------------------------------------------------------------------------------------------------------ the cases
# validation_gate false: random weights pass no gate, and the export's pool must hold prompts for serving to run the
# prompt ensemble (the gate still runs, its verdicts recorded, its time and memory measured)
PROMPT_RUN = ["--data.init_args.num_workers=0", "--model.init_args.max_memory_gb=1000",
              "--model.init_args.validation_gate=false"]
LLM_RUN = ["--model.init_args.model_name_or_path={model}", "--data.init_args.tokenizer={model}",
           "--data.init_args.eval_batch_size=2", "--data.init_args.num_workers=0", "--model.init_args.max_new_tokens=8",
           "--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.accumulate_grad_batches=2",
           "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0"]


def prompt_tool_cases() -> list[Case]:
    """A case for every tool recipe with a smoke-real case (the package's tool folders, installed plug-ins, run-time
    registrations): its paper config, its model, its overrides and the generic prompt-run ones."""
    from clova_train.tools.recipes import tool_recipes

    return [Case(recipe.name, recipe.paper_config, recipe.smoke_real.model,
                 [*recipe.smoke_real.overrides, *PROMPT_RUN], recipe_data(recipe.smoke_real.data),
                 inner_steps=recipe.smoke_real.inner_steps)
            for recipe in tool_recipes().values() if recipe.smoke_real is not None]


def other_cases(models_dir: Path, llm: str) -> list[Case]:
    """The paper configs that are not prompt tools: the tool-use LLM (one rank and sharded) and the controllers: the
    offline world's, and HYDRA's on GQA's and on OK-VQA's files (:func:`hydra_benchmark`), its tools in-process instead
    of the configs' shared ``clova-train serve``, so its environments in one process (``vec_env: dummy``: subprocess
    environments would each load their own copy of the tools)."""
    llm_data = tool_instructions(models_dir / llm)
    tools = [*(f"--hydra.tasks.tools.{field}={HYDRA_TOOL_EXPORTS}/{field}" for field in HYDRA_TOOLS),
             f"--hydra.tasks.tools.depth={HYDRA_DEPTH}", "--hydra.tasks.tools.server_url=null"]
    hydra_run = ["--hydra.llm.kind=scripted", "--hydra.embedder.kind=hashing", *tools, "--train.vec_env=dummy", "--train.total_timesteps=240",
                 "--dqn.learning_starts=120", "--train.eval_every=0", "--train.eval_episodes=10",
                 "--train.checkpoint_every=240", "--train.control_steps=0", "--train.progress_bar=false"]
    return [
        Case("llm", "configs/paper/tool_llm_vicuna13b.yaml", llm, [*LLM_RUN], llm_data, kind="lora"),
        Case("llm-sharded", "configs/paper/tool_llm_vicuna13b_sharded.yaml", llm, [*LLM_RUN], llm_data, kind="lora",
             ranks=2),
        Case("controller", "configs/paper/controller_dqn_hydra.yaml", None,
             ["--hydra.llm.kind=scripted", "--hydra.embedder.kind=hashing", "--train.total_timesteps=2000",
              "--train.eval_every=0", "--train.eval_episodes=20", "--train.checkpoint_every=2000",
              "--train.control_steps=0", "--train.progress_bar=false"],
             no_data, kind="controller"),
        *(Case(name, config, None, hydra_run, hydra_benchmark(config), kind="controller", stand_in=HYDRA_STAND_IN)
          for name, config in (("hydra-gqa", "configs/paper/controller_dqn_hydra_gqa.yaml"),
                               ("hydra-okvqa", "configs/paper/controller_dqn_hydra_okvqa.yaml"))),
    ]


def cases(models_dir: Path, llm: str = "vicuna-stand-in") -> dict[str, Case]:
    """Every case by name: the prompt tools' (from their recipes), then the LLM's and the controller's."""
    chosen: dict[str, Case] = {}
    for case in (*prompt_tool_cases(), *other_cases(models_dir, llm)):
        if case.name in chosen:
            raise ValueError(f"two smoke-real cases are named {case.name!r}: {chosen[case.name].config} and "
                             f"{case.config}")
        chosen[case.name] = case
    return chosen


# ------------------------------------------------------------------------------------------------------- running
@dataclass
class Stage:
    """One process's outcome: exit status, wall seconds, peak resident memory of its largest process (GB) and the tail
    of its output."""

    returncode: int
    seconds: float
    peak_rss_gb: float
    tail: str
    stopped: bool = False  # killed at its time limit (``--timeout`` or the budget's deadline)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def high_water_marks(root: int, marks: dict[int, int]) -> None:
    """Record ``VmHWM`` (kB) of ``root`` and its descendants. The kernel's ``ru_maxrss`` is no use here: a child
    started by fork or vfork inherits the parent's high-water mark through exec."""
    tree, pending = _children(), [root]
    while pending:
        pid = pending.pop()
        pending += tree.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    marks[pid] = max(marks.get(pid, 0), int(line.split()[1]))
        except OSError:
            continue


def with_benchmarks_path() -> str:
    """PYTHONPATH with this folder first, so that a fit finds the probes its ``--trainer.callbacks`` name."""
    return os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))


def run_stage(args: list[str], cwd: Path, log: Path, timeout: float, env: dict[str, str] | None = None) -> Stage:
    """Run ``args`` in ``cwd`` with output to ``log``, sampling the process tree's memory high-water marks."""
    start = time.perf_counter()
    marks: dict[int, int] = {}
    stopped = False
    with log.open("w") as out:
        process = subprocess.Popen(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": with_benchmarks_path(),
                                        **(env or {})})
        while process.poll() is None:
            high_water_marks(process.pid, marks)
            if time.perf_counter() - start > timeout:
                process.kill()
                process.wait()
                stopped = True
                break
            time.sleep(0.25)
    text = log.read_text(errors="replace")
    return Stage(process.returncode, time.perf_counter() - start, max(marks.values(), default=0) / 1e6, text[-3000:],
                 stopped=stopped)


def clova(*args: str) -> list[str]:
    return [sys.executable, "-m", "clova_train", *args]


def device_overrides(case: Case, device: str) -> list[str]:
    if case.kind == "controller":
        return ["--dqn.device=cuda" if device == "cuda" else "--dqn.device=cpu"]
    if device == "cuda":
        run = ["--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed"]
        return run + (["--trainer.strategy.init_args.data_parallel_size=1"] if case.ranks > 1 else ["--trainer.strategy=auto"])
    run = ["--trainer.accelerator=cpu", f"--trainer.devices={case.ranks}"]
    return run + ([f"--trainer.strategy.init_args.data_parallel_size={case.ranks}"] if case.ranks > 1
                  else ["--trainer.strategy=auto"])


def config_setting(case: Case, dotted: str) -> object:
    import yaml

    node: object = yaml.safe_load(case.path.read_text(encoding="utf-8"))
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


class Budget:
    """Seconds each process may run: ``--timeout``, or less where the run's deadline comes sooner."""

    def __init__(self, per_process: float, minutes: float | None) -> None:
        self.per_process = per_process
        self.deadline = None if minutes is None else time.monotonic() + minutes * 60

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def __call__(self) -> float:
        return max(1.0, min(self.per_process, self.left()))


def build_stage(model: str, models_dir: Path, timeout: float, env: dict[str, str] | None = None) -> Stage:
    """Build one real-size model (a :data:`~real_size.models.REAL_SIZES` name or a plug-in's ``"module:function"``)
    in its own process (the runner stays small, and holds no GPU memory the runs need); a finished build is reused."""
    models_dir.mkdir(parents=True, exist_ok=True)
    return run_stage([sys.executable, str(HERE / "real_size" / "models.py"), model, str(models_dir)],
                     models_dir, models_dir / f"{model_folder(model)}.log", timeout, env=env)


def build_ahead(models: list[str], models_dir: Path, jobs: int, timeout: Callable[[], float]) -> dict[str, Stage]:
    """Build ``models`` ``jobs`` at a time, each in its own process with its share of the CPU's threads; a finished
    build is reused. Each case's own build stage then finds its model ready."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))

    def build(name: str) -> Stage:
        return build_stage(name, models_dir, timeout(), env={"OMP_NUM_THREADS": threads})

    with ThreadPoolExecutor(jobs) as pool:
        return dict(zip(models, pool.map(build, models)))


def run_case(case: Case, models_dir: Path, out: Path, device: str, timeout: Callable[[], float],
             activation_modes: bool = True) -> dict:
    """Build, fit, export and serve one case; returns its table row's values. ``timeout()`` gives the seconds the next
    process may run."""
    from real_size.models import REAL_SIZES

    row: dict = {"case": case.name, "config": case.label, "stages": {}, "stand_in": case.stand_in}
    model_dir = None
    if case.model is not None:
        model_dir = models_dir / model_folder(case.model)
        build = build_stage(case.model, models_dir, timeout())
        row["stages"]["build"] = build
        row["build_s"] = build.seconds
        if build.returncode != 0:
            return row
        row["parameters_m"] = json.loads((model_dir / "real_size.json").read_text())["parameters"] / 1e6
        listed = REAL_SIZES.get(case.model)
        row["stand_in"] = listed.stand_in if listed else ""  # a plug-in's own builder states nothing
    workdir = out / case.name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    request = case.data(workdir, device == "cuda")
    overrides = [o.replace("{model}", str(model_dir)) for o in case.overrides] + device_overrides(case, device)
    row["overrides"] = [o.replace(str(model_dir), "<model>") for o in overrides] if model_dir else overrides
    probe = workdir / "probe.json"
    if case.kind == "controller":
        fit = clova("controller", "fit", "--config", str(case.path), *overrides)
    else:
        init = {"output": str(probe), "measure_activations": case.kind == "lora" and case.ranks == 1}
        fit = clova("fit", "--config", str(case.path), *overrides,
                    "--trainer.callbacks+=" + json.dumps({"class_path": PROBE, "init_args": init}))
    stage = run_stage(fit, workdir, workdir / "fit.log", timeout())
    row["stages"]["fit"] = stage
    if stage.returncode != 0:
        return row
    text = (workdir / "fit.log").read_text(errors="replace")
    if case.kind == "prompt":
        measured = ACTIVATIONS_LINE.search(text)
        if measured:
            row["activations_mb"] = float(measured.group(1).replace(",", ""))
    if probe.is_file():
        row["probe"] = json.loads(probe.read_text())
    if case.kind == "controller":
        row["probe"] = controller_speed(workdir / str(config_setting(case, "train.output_dir")))
    export_and_serve(case, row, workdir, overrides, timeout, device, request)
    if case.kind == "prompt" and activation_modes:
        measure_activation_modes(case, row, workdir, overrides, timeout)
    return row


def measure_activation_modes(case: Case, row: dict, workdir: Path, overrides: list[str],
                             timeout: Callable[[], float]) -> None:
    """What one inner step keeps per instance in float32 and bfloat16, with and without activation checkpointing
    (:class:`~real_size.probe.ActivationMemory`; a fit that stops before its first step)."""
    output = workdir / "activation_memory.json"
    callback = {"class_path": MEMORY_PROBE, "init_args": {"output": str(output)}}
    stage = run_stage(clova("fit", "--config", str(case.path), *overrides, "--trainer.max_steps=0",
                            "--trainer.precision=32-true", "--trainer.default_root_dir=activation-memory",
                            "--trainer.callbacks+=" + json.dumps(callback)),
                      workdir, workdir / "activation_memory.log", timeout())
    row["stages"]["memory"] = stage
    if stage.returncode == 0 and output.is_file():
        row["activation_modes"] = json.loads(output.read_text())["modes"]


def controller_speed(run_dir: Path) -> dict:
    import csv

    rows = []
    for path in run_dir.rglob("progress.csv"):
        with path.open() as handle:
            rows += [r for r in csv.DictReader(handle) if r.get("time/fps")]
    fps = float(rows[-1]["time/fps"]) if rows else None
    return {"env_steps_per_s": fps}


def export_and_serve(case: Case, row: dict, workdir: Path, overrides: list[str], timeout: Callable[[], float],
                     device: str, request: dict | None = None) -> None:
    """Export the run and load the export in its own process: a prompt tool answers ``request`` (run in the working
    directory, which its paths are relative to), the LLM writes a chat reply, the controller's networks load."""
    run_dir = workdir / str(config_setting(case, "trainer.default_root_dir") or config_setting(case, "train.output_dir"))
    export = workdir / "export"
    if case.kind == "controller":
        stage = run_stage(clova("controller", "export", "--config", str(case.path), *overrides,
                                "--output", str(export)), workdir, workdir / "export.log", timeout())
    else:
        source = run_dir / "checkpoints" / "last.ckpt" if case.ranks > 1 else run_dir
        stage = run_stage(clova("export", str(source), "--output", str(export)), workdir, workdir / "export.log", timeout())
    row["stages"]["export"] = stage
    if stage.returncode != 0:
        return
    if case.kind == "prompt":
        serve = clova("serve", str(export), "--device", device, "--request", json.dumps(request))
    elif case.kind == "lora":
        serve = [sys.executable, "-c", (
            "import sys\nfrom clova_train.tooluse.served_llm import ServedToolLLM, ChatRequest\n"
            f"served = ServedToolLLM.from_export({str(export)!r}, device={device!r})\n"
            "reply = served.chat_batch([ChatRequest(messages=[{'role': 'user', 'content': 'What is in image.png?'}], "
            "max_tokens=8)])[0]\nprint('reply tokens', reply.completion_tokens)\n")]
    else:
        serve = [sys.executable, "-c", (
            "import json, torch\nfrom stable_baselines3 import DQN\n"
            f"export = {str(export)!r}\n"
            "size = json.load(open(export + '/controller.json'))['observation_dim']\n"
            "net = torch.jit.load(export + '/q_network.pt')\n"
            "print('q values', net(torch.zeros(1, size)).shape, 'parameters', sum(p.numel() for p in net.parameters()))\n"
            "DQN.load(export + '/controller.zip', device='cpu')\n")]
    stage = run_stage(serve, workdir, workdir / "serve.log", timeout())
    row["stages"]["serve"] = stage
    found = re.search(r"parameters (\d+)", stage.tail)
    if case.kind == "controller" and found:
        row["parameters_m"] = int(found.group(1)) / 1e6


# ------------------------------------------------------------------------------------------------------- the table
def step_figures(case: Case, row: dict) -> tuple[str, str]:
    """(seconds per step, throughput) from the probe: prompt tuning's chunk time over its inner steps (gate and
    validation included), the LLM's micro-batch time after the first, the controller's environment steps."""
    probe = row.get("probe") or {}
    if case.kind == "controller":
        fps = probe.get("env_steps_per_s")
        return ("-", f"{fps:,.0f} env steps/s") if fps else ("-", "-")
    seconds = probe.get("batch_seconds") or []
    if not seconds:
        return "-", "-"
    if case.kind == "prompt":
        instances = sum(probe.get("batch_samples") or [0])
        per_step = sum(seconds) / (len(seconds) * case.inner_steps)
        return f"{per_step:.2f}", f"{instances / sum(seconds) * 60:.1f} instances/min"
    timed = seconds[1:] or seconds
    tokens = (probe.get("batch_tokens") or [0])[1:] or probe.get("batch_tokens") or [0]
    return f"{sum(timed) / len(timed):.2f}", f"{sum(tokens) / sum(timed):,.0f} tokens/s"


def activations(case: Case, row: dict) -> str:
    if "activations_mb" in row:
        return f"{row['activations_mb']:,.1f} MB / instance"
    probe = row.get("probe") or {}
    saved, samples = probe.get("first_batch_activation_bytes"), (probe.get("batch_samples") or [0])[0]
    if saved and samples:
        tokens = (probe.get("batch_tokens") or [0])[0]
        return f"{saved / samples / 1e6:,.1f} MB / sample ({tokens // samples} tokens)"
    return "-"


def outcome(row: dict) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    parts = []
    for name in ("build", "fit", "export", "serve", "memory"):
        stage = row["stages"].get(name)
        parts.append(f"{name} " + ("-" if stage is None else "ok" if stage.returncode == 0 else
                                   "stopped at its time limit" if stage.stopped else f"FAILED ({stage.returncode})"))
    return ", ".join(parts)


def table_row(case: Case, row: dict) -> str:
    per_step, throughput = step_figures(case, row)
    if row.get("beside") and per_step != "-":
        per_step, throughput = f"{per_step} (b)", f"{throughput} (b)"
    fit = row["stages"].get("fit")
    if fit is None:
        return f"| {case.label} | - | - | - | - | - | - | - | - | {outcome(row)} |"
    serve = row["stages"].get("serve")
    gpu = (row.get("probe") or {}).get("peak_gpu_bytes")
    parameters = f"{row['parameters_m']:,.1f} M" if "parameters_m" in row else "-"
    model = f"{parameters}" + (f" ({row['stand_in']})" if row.get("stand_in") else "")
    return (f"| {case.label} | {model} | {per_step} | {throughput} | "
            f"{fit.peak_rss_gb:.1f} | {f'{serve.peak_rss_gb:.1f}' if serve else '-'} | "
            f"{f'{gpu / 1e9:.1f}' if gpu else '-'} | {activations(case, row)} | {fit.seconds:.0f} | {outcome(row)} |")


COLUMNS = ["config", "parameters", "s/step", "throughput", "fit peak RSS GB", "serve peak RSS GB", "peak GPU GB",
           "activations kept", "fit s", "stages"]


PHASES = ["prepare", "inner steps", "gate", "training step", "validation"]
PHASE_COLUMNS = ["config", *PHASES, "whole fit"]


def phase_peak_row(case: Case, row: dict) -> str | None:
    """The config's peak GPU memory by phase of the fit (GB), or None where the probe measured none (the CPU)."""
    probe = row.get("probe") or {}
    peaks = probe.get("phase_peak_bytes")
    if not peaks:
        return None
    cells = [f"{peaks[p] / 1e9:.1f}" if p in peaks else "-" for p in PHASES]
    whole = probe.get("peak_gpu_bytes")
    return f"| {case.label} | " + " | ".join(cells) + f" | {f'{whole / 1e9:.1f}' if whole else '-'} |"


def queues(chosen: dict[str, Case], names: list[str], beside: bool) -> list[list[str]]:
    """The order cases run in: one queue, or with ``beside`` the LLM cases in a second queue next to the others."""
    if not beside:
        return [names]
    split = [[n for n in names if chosen[n].kind == "lora"], [n for n in names if chosen[n].kind != "lora"]]
    return [queue for queue in split if queue]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every paper config at its real model size (random weights) for a "
                                     "few steps, export and serve it; print and record the table.")
    parser.add_argument("--configs", nargs="+", default=None, help="which cases (default: all): " + ", ".join(cases(Path("."))))
    parser.add_argument("--models", default="checkpoints/models/real-size",
                        help="where the real-size models are built (reused when finished)")
    parser.add_argument("--output", default="checkpoints/smoke-real", help="working directories of the runs")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu, or one GPU in bf16-mixed")
    parser.add_argument("--llm", default="vicuna-stand-in", choices=("vicuna-stand-in", "vicuna-13b"),
                        help="the LLM configs' model: the 0.9B stand-in (CPU) or Vicuna-13B's own sizes (a GPU)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each process may run")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="the whole run's limit: cases that would start with under a minute left are skipped")
    parser.add_argument("--build-jobs", type=int, default=1,
                        help="build the models first, this many at once (1: each case builds its own when it starts)")
    parser.add_argument("--beside", action="store_true",
                        help="run the LLM cases in a second queue beside the others; their timings are marked (b)")
    parser.add_argument("--activation-modes", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure prompt tuning's activations per instance in fp32/bf16, with and without "
                             "checkpointing (one more short fit per prompt tool)")
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=True,
                        help="append the table to benchmarks/results/smoke_real.md")
    parsed = parser.parse_args(argv)
    models_dir, out = Path(parsed.models).resolve(), Path(parsed.output).resolve()
    chosen = cases(models_dir, parsed.llm)
    names = parsed.configs or list(chosen)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)} (known: {', '.join(chosen)})")
    budget = Budget(parsed.timeout, parsed.budget_minutes)
    started = time.perf_counter()
    plan = queues(chosen, names, parsed.beside)
    beside = len(plan) > 1
    finished: dict[str, dict] = {}
    lock = threading.Lock()

    def run_queue(queue: list[str]) -> None:
        models = list(dict.fromkeys(chosen[n].model for n in queue if chosen[n].model is not None))
        if parsed.build_jobs > 1 and len(models) > 1:
            with lock:
                print(f"smoke-real: building {', '.join(models)}, {parsed.build_jobs} at once ...", flush=True)
            for model, stage in build_ahead(models, models_dir, parsed.build_jobs, budget).items():
                with lock:
                    print(f"smoke-real: built {model} in {stage.seconds:.0f} s (exit {stage.returncode})", flush=True)
        for name in queue:
            case = chosen[name]
            if budget.left() < 60:
                row = {"case": name, "config": case.label, "stages": {},
                       "skipped": f"{max(budget.left(), 0):.0f} s of the {parsed.budget_minutes:g}-minute budget left"}
            else:
                with lock:
                    print(f"smoke-real: {name} ({case.label}) ...", flush=True)
                row = run_case(case, models_dir, out, parsed.device, budget, parsed.activation_modes)
            row["beside"] = beside
            with lock:
                finished[name] = row
                print(table_row(case, row), flush=True)
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "row.json").write_text(json.dumps(
                {**{k: v for k, v in row.items() if k != "stages"},
                 "stages": {k: {"returncode": s.returncode, "seconds": s.seconds, "peak_rss_gb": s.peak_rss_gb}
                            for k, s in row["stages"].items()}}, indent=1))

    with ThreadPoolExecutor(len(plan)) as pool:
        list(pool.map(run_queue, plan))
    rows, failed, skipped, memory_rows, phase_rows = [], [], [], [], []
    for name in names:
        case, row = chosen[name], finished[name]
        rows.append(table_row(case, row))
        phase_row = phase_peak_row(case, row)
        if phase_row:
            phase_rows.append(phase_row)
        if row.get("activation_modes"):
            modes = row["activation_modes"]
            memory_rows.append(f"| {case.label} | " + " | ".join(
                f"{modes[m]['mb_per_instance']:,.1f}" if m in modes else "-" for m in MEMORY_MODES) + " |")
        bad = [s for s in row["stages"].values() if s.returncode != 0]
        if row.get("skipped") or any(s.stopped for s in bad):
            skipped.append(name)
        elif bad or not {"fit", "export", "serve"} <= set(row["stages"]):
            failed.append(name)
            print(f"smoke-real: {name} failed; log tail:\n{bad[0].tail if bad else ''}", flush=True)
    total = time.perf_counter() - started
    llm_batches = "4 batches with gradient accumulation 2 and 8 new tokens" + (
        ", at Vicuna-13B's own sizes" if parsed.llm == "vicuna-13b" else ", on the 0.9B stand-in")
    description = (
        f"Machine: {machine()}. Device: {parsed.device}" + (" (bf16-mixed)" if parsed.device == "cuda" else "") +
        ". Every config as shipped, models at the real sizes with random weights (built offline, the real checkpoints' "
        "layouts), synthetic data in the real formats, a few steps; the overrides are in each run's row.json (local "
        "model paths, steps, sample counts, workers 0; " +
        ("CPU: one device, the sharded config at 2 data-parallel ranks; " if parsed.device == "cpu" else
         "one GPU; prompt tuning on one whole chunk of the config's; ") +
        f"the LLM at {llm_batches}). s/step: prompt tuning's chunk time over its inner steps (gate and validation "
        "included); the LLM's micro-batch after the first. Activations: prompt tuning's own measure (bytes autograd "
        "keeps per instance, 1 vs 2 instances); the LLM's first micro-batch (checkpointed layers recompute theirs). "
        "Peak RSS: the largest process; peak GPU: torch's peak allocated in the fit." +
        (" (b): measured while the LLM queue ran beside the others on the same machine (--beside), so a shared GPU "
         "and CPU: an upper bound on s/step." if beside else "") +
        (f" Skipped or stopped at the time limits: {', '.join(skipped)}." if skipped else "") +
        f" Total {total / 60:.1f} min.")
    publish("smoke_real", "Real-size smoke check (make smoke-real, make gpu-check)", f"{len(rows)} configs on {parsed.device}",
            description, COLUMNS, rows, parsed.record)
    if memory_rows:
        publish("smoke_real", "Real-size smoke check (make smoke-real, make gpu-check)",
                "prompt tuning's activations per instance at real size",
                f"Machine: {machine()}. What autograd keeps for one inner step, per instance (MB; one and two instances "
                "of the run's data, the tool's weights excluded), with the tool stored in float32 or in bfloat16 under "
                "autocast (as bf16-mixed trains), and with activation_checkpointing off or on. Memory of a chunk = "
                "weights + chunk x per instance + 16 bytes per prompt number (prompt, gradient, two Adam moments).",
                ["config", *MEMORY_MODES], memory_rows, parsed.record)
    if phase_rows:
        publish("smoke_real", "Real-size smoke check (make smoke-real, make gpu-check)", "peak GPU memory by phase of the fit",
                f"Machine: {machine()}. torch's peak allocated GB in each phase of the fit (StepProbe, the largest over "
                "the phase's occurrences): prompt tuning's prepare (the chunk's inputs, once), inner steps (forward and "
                "backward through the frozen tool, the optimizer), gate (and the records after it); the LLM's training "
                "step; validation; and the whole fit (setup included).",
                PHASE_COLUMNS, phase_rows, parsed.record)
    if failed or skipped:
        print(f"smoke-real: failed: {', '.join(failed) or 'none'}; skipped: {', '.join(skipped) or 'none'} "
              f"(logs under {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
