"""``clova-train loop``: CLOVA's closed loop from a YAML config, with ``clova-train fit`` as its learner.

Read top to bottom:

* :class:`LoopConfig` and its parts: what the YAML holds (every field documented; ``--help`` shows them);
* :class:`CliFitLearner`: each (tool, concept) fit is ``clova-train fit --config <the tool's fit config>`` in a
  child process, with the collected data and the run directory as overrides, so the same LightningModules,
  datamodules and Trainer options (devices, strategy, precision) apply as to any fit;
* :func:`build_loop`: backends (behind the LLM call cache), tools (each frozen tool built from its fit config,
  its pool empty at the start), collectors, the tool API and the loop;
* :func:`run`: the offline world when configured, the test stage before training (kept in the run directory),
  the training stage (resumable), the test stage after it, and a table.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal


from clova_train.llm.config import EmbedderConfig, LLMConfig
from clova_train.llm.cache import CachedChat, CachedEmbedding, CallCache
from clova_train.sandbox import Sandbox
from clova_train.closedloop import world as offline_world
from clova_train.closedloop.collectors import FolderImageSource, GroundingCollector, HttpImageSource, ImageCollector, VqaCollector
from clova_train.closedloop.inference import InferenceSettings
from clova_train.closedloop.loop import PROGRAM_TIMEOUT_S, ClosedLoop, FitResult, LoopSettings, LoopTool
from clova_train.closedloop.pool_check import HeldOutClassification
from clova_train.closedloop.reflection import Templates
from clova_train.closedloop.tasks import read_tasks
from clova_train.closedloop.toolapi import ServerLocator, VisualTools, VqaCaptioner
from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.pool import PromptPool
from clova_train.core.safe_files import read_json_object, read_yaml
from clova_train.tools.base import PromptTool
from clova_train.core.run_manifest import POOL_FILE, write_run_manifest
from clova_train.tools.prompt_server import PromptToolServer

BEFORE = "evaluation_before.json"
AFTER = "evaluation_after.json"


@dataclass
class ToolConfig:
    """A visual tool the loop updates.

    Args:
        fit_config: the ``clova-train fit`` YAML of the tool's prompt tuning (its ``model.init_args.tool`` is the
            frozen tool the loop serves; its data section is completed with each collection's folder).
        collector: ``images`` (SELECT, CLASSIFY, REPLACE: an image source), ``grounding`` (LOC, SEG: a COCO / LVIS
            file) or ``vqa`` (answers inferred by the LLM).
        source_dir: ``images``: a folder with one sub-folder of images per concept.
        source_url: ``images``: an image-search endpoint instead (see ``HttpImageSource``).
        train_images: ``images``: images of the concept trained on per collection (one prompt each).
        val_images: ``images``: further images of the concept for the validation gate.
        negatives_per_label: ``images``: train and validation images of each other label.
        annotations: ``grounding``: the COCO / LVIS annotation file.
        image_root: ``grounding``: its image folder.
        images_per_collection: ``grounding``: images of the concept per collection.
        top_k: ensemble the k most similar prompts when serving (default: the tool's paper value).
    """

    fit_config: str
    collector: Literal["images", "grounding", "vqa"] = "images"
    source_dir: str = ""
    source_url: str = ""
    train_images: int = 8
    val_images: int = 4
    negatives_per_label: int = 3
    annotations: str = ""
    image_root: str = ""
    images_per_collection: int = 50
    top_k: int | None = None


@dataclass
class OfflineWorldConfig:
    """The synthetic world of the quickstart (``clova_train.closedloop.world``), written once under ``root``.

    Args:
        root: where the tasks, images and image source are written; empty: no offline world.
        train_tasks: tasks of the training stage.
        test_tasks: held-out tasks of the test stage.
        images_per_concept: images per colour in the image source.
        mislabel_rate: share of each image-source folder showing another colour (noisy search results).
        seed: generation seed.
    """

    root: str = ""
    train_tasks: int = 24
    test_tasks: int = 100
    images_per_concept: int = 48
    mislabel_rate: float = 0.0
    seed: int = 0


@dataclass
class LoopConfig:
    """``clova-train loop`` (CLOVA's closed loop).

    Args:
        run_dir: the loop's run directory (journal, collected data, fits, pools, demonstrations, reports); a
            rerun resumes it.
        tasks: task file of the training stage (default: the offline world's).
        test_tasks: task file of the test stage, run before and after training (default: the offline world's).
        labels: the labels CLASSIFY chooses among.
        tools: the tools the loop updates, by name (``CLASSIFY``).
        llm: the chat model that plans, programs, reflects and infers VQA answers.
        embedder: the text embedder of demonstration retrieval (the paper uses BERT; default: 256-d hashing).
        cache_path: SQLite cache of every LLM and embedding call (default: ``<run_dir>/llm_cache.sqlite``).
        cache_mode: ``record`` (replay hits, store misses), ``replay`` (misses are errors) or ``off``.
        validation_gate: keep only prompts that pass validation: each prompt on its own (the fit's gate), then the
            fit's prompts together as the pool serves them (merged only if the served pool makes fewer errors on
            the collection's held-out images). ``false``: the ungated ablation, every tuned prompt merged.
        local_reflection: check a still-failing task step by step after learning from global reflection.
        max_collections_per_concept: collections (and fits) per (tool, concept) over the loop at most.
        correct_examples: correct demonstrations per prompt.
        incorrect_examples: incorrect demonstrations (with critiques) per prompt.
        templates_dir: a folder of prompt templates overriding the packaged ones.
        fit_arguments: extra ``clova-train fit`` arguments for every fit (``--trainer.devices=2``, ...).
        crop_margin: CLASSIFY crops are this many times a found object's side.
        program_timeout_s: wall-time limit of one program in the sandbox, its tool calls (model forwards)
            included; a program over it fails its task. Generous: a run must not fail because a machine is busy.
        world: the offline world.
    """

    run_dir: str = "checkpoints/loop"
    tasks: str = ""
    test_tasks: str = ""
    labels: list[str] = field(default_factory=lambda: list(offline_world.LABELS))
    tools: dict[str, ToolConfig] = field(default_factory=dict)
    llm: LLMConfig = field(default_factory=LLMConfig)
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    cache_path: str = ""
    cache_mode: str = "record"
    validation_gate: bool = True
    local_reflection: bool = True
    max_collections_per_concept: int = 3
    correct_examples: int = 3
    incorrect_examples: int = 2
    templates_dir: str = ""
    fit_arguments: list[str] = field(default_factory=list)
    crop_margin: float = offline_world.CROP_MARGIN
    program_timeout_s: float = PROGRAM_TIMEOUT_S
    world: OfflineWorldConfig = field(default_factory=OfflineWorldConfig)


# The tools a program reaches through ViperGPT's ImagePatch API (VisualTools): verify_property is CLASSIFY,
# find / exists are LOC, simple_query is VQA. SEG, SELECT and REPLACE have no ImagePatch method yet.
SERVED_TOOLS = ("CLASSIFY", "LOC", "VQA")


def validate(config: LoopConfig) -> None:
    """Every value checked before anything starts; one message naming each bad key."""
    problems = []
    if "CLASSIFY" not in config.tools:
        problems.append("tools: the loop needs CLASSIFY (verify_property); LOC and VQA are optional")
    for name, tool in config.tools.items():
        if name not in SERVED_TOOLS:
            problems.append(f"tools.{name}: the loop's program API (ViperGPT's ImagePatch) calls {', '.join(SERVED_TOOLS)}; "
                            f"{name} has no method there yet")
        if not Path(tool.fit_config).is_file():
            problems.append(f"tools.{name}.fit_config: file not found: {tool.fit_config}")
        if tool.collector == "images" and not (tool.source_dir or tool.source_url or config.world.root):
            problems.append(f"tools.{name}: an images collector needs source_dir or source_url")
        if tool.collector == "grounding" and not tool.annotations:
            problems.append(f"tools.{name}.annotations: a grounding collector needs the COCO / LVIS file")
    if not (config.tasks or config.world.root):
        problems.append("tasks: give a task file (or world.root for the offline world)")
    if config.cache_mode not in ("record", "replay", "off"):
        problems.append(f"cache_mode: {config.cache_mode!r} is not record, replay or off")
    if not 0 <= config.world.mislabel_rate < 1:
        problems.append(f"world.mislabel_rate: {config.world.mislabel_rate} is not in [0, 1)")
    if config.max_collections_per_concept < 1:
        problems.append("max_collections_per_concept: must be >= 1")
    if not 0 < config.program_timeout_s < float("inf"):
        problems.append(f"program_timeout_s: must be a positive number of seconds, not {config.program_timeout_s}")
    problems += [*config.llm.problems("llm"), *config.embedder.problems("embedder")]
    if problems:
        raise ClovaTrainError("bad loop config: " + "; ".join(problems))


def _die_with_parent() -> None:  # runs in the fit's child process: a killed loop takes its fit with it
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class CliFitLearner:
    """Runs ``clova-train fit`` for each (tool, concept) in a child process (see the module docstring).

    Args:
        fit_configs: each tool's fit YAML.
        validation_gate: passed as ``model.init_args.validation_gate``.
        extra_arguments: appended to every fit's command line.
    """

    def __init__(self, fit_configs: dict[str, str], validation_gate: bool = True, extra_arguments: list[str] | None = None) -> None:
        self.fit_configs, self.validation_gate = fit_configs, validation_gate
        self.extra_arguments = list(extra_arguments or [])

    def command(self, tool: str, fit_arguments: dict[str, Any], output_dir: Path) -> list[str]:
        overrides = [f"--{key}={json.dumps(value) if not isinstance(value, str) else value}"
                     for key, value in fit_arguments.items()]
        return [sys.executable, "-m", "clova_train", "fit", "--config", self.fit_configs[tool], *overrides,
                f"--trainer.default_root_dir={output_dir}", f"--model.init_args.validation_gate={str(self.validation_gate).lower()}",
                *self.extra_arguments]

    def fit(self, tool: str, concept: str, fit_arguments: dict[str, Any], output_dir: Path) -> FitResult:
        output_dir.mkdir(parents=True, exist_ok=True)
        log_path = output_dir / "fit.log"
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.run(self.command(tool, fit_arguments, output_dir), stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None, check=False)
        if process.returncode != 0:
            lines = [line for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            raise ClovaTrainError(f"the {tool} fit for {concept!r} failed (exit {process.returncode}): "
                                  f"{lines[-1] if lines else 'no output'} (log: {log_path})")
        summary_path = output_dir / "summary.json"
        summary = read_json_object(summary_path, "fit summary") if summary_path.is_file() else {}
        if not (output_dir / POOL_FILE).is_file():
            raise ClovaTrainError(f"the {tool} fit for {concept!r} wrote no {POOL_FILE} in {output_dir}")
        return FitResult(str(output_dir / POOL_FILE), summary)


def frozen_tool(fit_config: str) -> PromptTool:
    """The tool a fit config's ``model.init_args.tool`` describes, built through the export loading code."""
    try:
        config = read_yaml(fit_config, "fit config")
        section = config["model"]["init_args"]["tool"]
    except (KeyError, TypeError) as err:
        raise DataError(f"fit config {fit_config}: no model.init_args.tool ({type(err).__name__}: {err})") from None
    return PromptTool.from_description({"class_path": section["class_path"], "init_args": section.get("init_args", {})})


def build_loop(config: LoopConfig, validation_gate: bool | None = None, run_dir: str | None = None) -> ClosedLoop:
    """The loop a config describes (``validation_gate`` / ``run_dir`` override the config's)."""
    validate(config)
    run_dir_path = Path(run_dir or config.run_dir)
    run_dir_path.mkdir(parents=True, exist_ok=True)
    write_run_manifest(run_dir_path, "closed_loop", learner="clova_train.closedloop.ClosedLoop",
                       config={**asdict(config), "validation_gate": validation_gate, "run_dir": str(run_dir_path)})
    cache = None if config.cache_mode == "off" else CallCache(config.cache_path or run_dir_path / "llm_cache.sqlite", config.cache_mode)  # type: ignore[arg-type]
    llm, embedder = config.llm.build(scripted=offline_world.ScriptedLoopLLM), config.embedder.build()
    if cache is not None:
        llm, embedder = CachedChat(llm, cache), CachedEmbedding(embedder, cache)
    templates = Templates(config.templates_dir or None)
    tools = {}
    for name, tool_config in config.tools.items():
        tool = frozen_tool(tool_config.fit_config)
        server = PromptToolServer(tool, PromptPool(tool.pool_spec()), tool_config.top_k)
        if tool_config.collector == "images":
            source_dir = tool_config.source_dir or str(Path(config.world.root) / "image_source")
            source = HttpImageSource(tool_config.source_url) if tool_config.source_url else FolderImageSource(source_dir)
            collector: Any = ImageCollector(source, config.labels, tool_config.train_images, tool_config.val_images,
                                            tool_config.negatives_per_label)
        elif tool_config.collector == "grounding":
            collector = GroundingCollector(tool_config.annotations, tool_config.image_root or None, tool_config.images_per_collection)
        else:
            collector = VqaCollector(llm, templates)
        # SELECT and REPLACE would need checks of their own; CLASSIFY is the one the program API serves
        check = HeldOutClassification(config.labels) if name == "CLASSIFY" and tool_config.collector == "images" else None
        tools[name] = LoopTool(name, server, collector, check)
    gate = config.validation_gate if validation_gate is None else validation_gate
    learner = CliFitLearner({n: t.fit_config for n, t in config.tools.items()}, gate, config.fit_arguments)
    labels, margin = list(config.labels), config.crop_margin
    settings = LoopSettings(config.local_reflection, config.max_collections_per_concept,
                            InferenceSettings(config.correct_examples, config.incorrect_examples), pool_validation=gate)

    def tool_api(task: Any, servers: dict[str, PromptToolServer]) -> VisualTools:
        # without a LOC tool, boxes come from the task file's annotations (the offline world's)
        locator = ServerLocator(servers["LOC"]) if "LOC" in servers else offline_world.AnnotationLocator()
        return VisualTools(task, locator, servers["CLASSIFY"], labels, margin, servers.get("VQA"))

    annotations = offline_world.AnnotationCaptioner()

    class Captions:  # the task file's annotations where it has them (the offline world), else the VQA tool
        def caption(self, task: Any) -> str:
            if task.extra.get("objects") or "VQA" not in tools:
                return annotations.caption(task)
            return VqaCaptioner(tools["VQA"].server).caption(task)  # the server with the pool as it is now

    return ClosedLoop(run_dir_path, llm, embedder, tools, tool_api, Captions(), learner, labels, templates, settings,
                      Sandbox(timeout_s=config.program_timeout_s))


def task_files(config: LoopConfig) -> tuple[Path, Path | None]:
    """The training and test task files, writing the offline world first when it is configured."""
    if config.world.root:
        w = config.world
        offline_world.prepare_world(w.root, w.train_tasks, w.test_tasks, w.images_per_concept, w.mislabel_rate, w.seed)
    train = Path(config.tasks) if config.tasks else Path(config.world.root) / "train_tasks.jsonl"
    test = Path(config.test_tasks) if config.test_tasks else (Path(config.world.root) / "test_tasks.jsonl" if config.world.root else None)
    return train, test


def run(config: LoopConfig, progress: Any = print) -> dict[str, Any]:
    """Test stage before, training stage, test stage after (see the module docstring); the results."""
    validate(config)  # before the world, the run directory or anything else is written
    train_file, test_file = task_files(config)
    train_tasks = read_tasks(train_file)
    test_tasks = read_tasks(test_file) if test_file else []
    loop = build_loop(config)
    try:
        run_dir = loop.run_dir
        before = None
        if test_tasks:
            if (run_dir / BEFORE).is_file():
                before = read_json_object(run_dir / BEFORE, "earlier evaluation")
            elif len(loop.journal) == 0:  # the tools and demonstrations as they are before any learning
                before = loop.evaluate(test_tasks)
                write_json_atomic(run_dir / BEFORE, before)
        report = loop.train(train_tasks, progress)
        after = loop.evaluate(test_tasks) if test_tasks else None
        if after is not None:
            write_json_atomic(run_dir / AFTER, after)
    finally:
        loop.close()
    return {"report": report, "before": before, "after": after, "run_dir": str(run_dir)}


def _count_reasons(reasons: list[str]) -> str:
    counts = Counter(reasons)
    return "; ".join(f"{n}x ({reason})" for reason, n in counts.items())


def format_results(results: dict[str, Any]) -> str:
    """A short text table of the test stage before and after, and what was learned."""
    lines = []
    for name in ("before", "after"):
        r = results.get(name)
        if r:
            low, high = r["interval95"]
            lines.append(f"test accuracy {name:>6} training: {r['accuracy']:.3f} [{low:.3f}, {high:.3f}] ({r['correct']}/{r['tasks']} tasks)")
    report = results["report"]
    lines.append(f"training tasks: {report['tasks']}")
    for key, entry in report["learned"].items():
        lines.append(f"  {key}: {entry['collections']} collection(s), {entry['fits']} fit(s), prompts tried "
                     f"{entry['tried']}, accepted {entry['accepted']}, rejected {entry['rejected']}; "
                     f"{entry['merged_fits']} fit(s) merged into the pool ({entry['prompts_in_pool']} prompts)"
                     + (f"; skipped {_count_reasons(entry['skipped'])}" if entry["skipped"] else ""))
    if report["reflections"]["unusable"]:
        lines.append(f"  unusable reflections: {len(report['reflections']['unusable'])}")
    lines.append(f"demonstrations: {report['demonstrations']}")
    lines.append(f"run directory: {results['run_dir']} (report.json, journal.jsonl)")
    return "\n".join(lines)
