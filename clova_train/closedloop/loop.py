"""CLOVA's closed loop (Algorithm 1 of the supplementary): inference -> reflection -> learning, resumable.

For each training task: infer (plan, program, run). If the task is solved, its plan and program join the
demonstration pool as correct examples. If not: global reflection names the tool and concept at fault; the
tool's collector gathers data; the tool's prompt tuning runs (through the ``learner``: the same
LightningModules and Trainer as ``clova-train fit``) and its accepted prompts are merged into the tool's pool
if the pool, as served, then makes fewer errors on the tool's held-out images (:mod:`.pool_check`);
the plan and program join the pool as incorrect examples with the critique; the task is tried again. If it
still fails, local reflection checks the steps one by one and the first step it finds wrong is learned from
the same way.

Every decision is an event in the run directory's journal (:mod:`clova_train.closedloop.journal`); the pools and
the demonstration pool are rebuilt from it when the loop starts, so a killed loop resumes where it stopped and
never trains the same (tool, concept, data) twice. The test stage (:meth:`ClosedLoop.evaluate`) only infers,
with tools and demonstrations frozen.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from clova_train.closedloop.collectors import CollectionRequest, Collected, Collector, concept_folder
from clova_train.closedloop.demonstrations import Demonstration, DemonstrationPool
from clova_train.closedloop.inference import Inference, InferenceSettings, Trace
from clova_train.closedloop.journal import Journal
from clova_train.closedloop.pool_check import PoolCheck
from clova_train.closedloop.reflection import Critique, Templates, parse_local_verdict, parse_reflection
from clova_train.closedloop.tasks import LoopTask
from clova_train.closedloop.toolapi import Captioner
from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ClovaTrainError
from clova_train.core.evaluation_report import wilson_interval
from clova_train.core.pool import PromptPool
from clova_train.llm.backends import BackendError, ChatBackend, EmbeddingBackend, ask
from clova_train.sandbox import Sandbox, ToolAPI
from clova_train.tools.prompt_server import PromptToolServer

JOURNAL = "journal.jsonl"
REPORT = "report.json"
PROGRAM_TIMEOUT_S = 120.0  # a program's wall time, tool calls included


class LoopPaused(ClovaTrainError):
    """A backend (LLM, embedder, image source) failed; the state is saved and rerunning continues."""


@dataclass
class FitResult:
    """What one prompt-tuning fit left: its pool file and its summary (tried / accepted / rejected)."""

    pool_path: str
    summary: dict[str, Any]


class Learner(Protocol):
    """Runs one training-validation prompt tuning fit of ``tool`` on collected data into ``output_dir``."""

    def fit(self, tool: str, concept: str, fit_arguments: dict[str, Any], output_dir: Path) -> FitResult: ...


@dataclass
class LoopTool:
    """A visual tool the loop can update: its server (frozen tool + current pool), its data collector and,
    optionally, the check a fit's prompts must pass as served before they join the pool
    (:mod:`clova_train.closedloop.pool_check`)."""

    name: str
    server: PromptToolServer
    collector: Collector
    pool_check: PoolCheck | None = None


@dataclass
class LoopSettings:
    """How the loop reflects and learns.

    Args:
        local_reflection: after learning from global reflection, check a task that still fails step by step.
        max_collections_per_concept: collections (and fits) per (tool, concept) at most over the whole loop.
        inference: how many demonstrations each prompt gets.
        pool_validation: merge a fit's prompts only if the served pool then makes fewer errors on the
            collection's held-out images (tools with a ``pool_check``); off in the ungated ablation.
    """

    local_reflection: bool = True
    max_collections_per_concept: int = 3
    inference: InferenceSettings = field(default_factory=InferenceSettings)
    pool_validation: bool = True


class ClosedLoop:
    """The loop over a run directory (see the module docstring).

    Args:
        run_dir: where the journal, collected data, fits, pools, demonstrations and report live.
        llm: chat backend for plans, programs, reflection and VQA answers (wrap it in the call cache).
        embedder: embeds instructions for demonstration retrieval.
        tools: the visual tools the loop can update, by name (``CLASSIFY``, ...).
        tools_factory: the tool API a task's program calls, given the task and the current servers.
        captioner: turns a task's image into text for reflection.
        learner: runs prompt-tuning fits.
        labels: the labels CLASSIFY chooses among (shown to the LLM).
        templates: prompt templates.
        settings: reflection and learning settings.
        sandbox: where programs run (default: the sandbox's limits with ``PROGRAM_TIMEOUT_S``: a program's time
            includes its tool calls, model forwards that a busy machine slows down).
    """

    def __init__(self, run_dir: str | Path, llm: ChatBackend, embedder: EmbeddingBackend, tools: dict[str, LoopTool],
                 tools_factory: Callable[[LoopTask, dict[str, PromptToolServer]], ToolAPI], captioner: Captioner,
                 learner: Learner, labels: list[str], templates: Templates | None = None,
                 settings: LoopSettings | None = None, sandbox: Sandbox | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.llm, self.embedder, self.tools, self.tools_factory = llm, embedder, tools, tools_factory
        self.captioner, self.learner, self.labels = captioner, learner, labels
        self.templates = templates or Templates()
        self.settings = settings or LoopSettings()
        self.sandbox = sandbox or Sandbox(timeout_s=PROGRAM_TIMEOUT_S)
        self.journal = Journal(self.run_dir / JOURNAL)
        self.base_pools = {name: tool.server.pool for name, tool in tools.items()}
        self.demonstrations = DemonstrationPool(embedder)
        self.inference = Inference(llm, self.demonstrations, self.templates, self.sandbox, labels, self.settings.inference)
        self._rebuild()

    # ------------------------------------------------------------------ state from the journal
    def _rebuild(self) -> None:
        for name, tool in self.tools.items():
            pool = PromptPool(self.base_pools[name].spec)
            pool.merge(self.base_pools[name])
            for event in self.journal.events("fit_done", tool=name):
                if event.get("merged", True):
                    pool.merge(PromptPool.load(event["pool_path"], expected=pool.spec))
            tool.server = PromptToolServer(tool.server.tool, pool, tool.server.top_k)
        for event in self.journal.events("demonstration"):
            self.demonstrations.add(Demonstration(**event["example"]))

    def _save_state(self) -> None:
        for name, tool in self.tools.items():
            tool.server.pool.save(self.run_dir / "pools" / f"{name}.safetensors")
        self.demonstrations.save(self.run_dir / "demonstrations.json")

    @property
    def servers(self) -> dict[str, PromptToolServer]:
        return {name: tool.server for name, tool in self.tools.items()}

    # ------------------------------------------------------------------ phases
    def _attempt(self, task: LoopTask, phase: str) -> Trace:
        found = self.journal.last("attempt", task=task.task_id, phase=phase)
        if found is not None:
            return Trace.from_json(found["trace"])
        trace = self.inference.run(task, self.tools_factory(task, self.servers))
        self.journal.append("attempt", task=task.task_id, phase=phase, trace=trace.to_json())
        return trace

    def _reflect_global(self, task: LoopTask, trace: Trace) -> Critique:
        found = self.journal.last("reflection", task=task.task_id, kind="global")
        if found is not None:
            return Critique(**found["critique"])
        prompt = self.templates.render("global_reflection", instruction=task.instruction,
                                       caption=self.captioner.caption(task), feedback=task.feedback,
                                       answer=trace.answer or f"(none: {trace.error})", plan=trace.plan,
                                       program=trace.program, steps=trace.steps_text())
        critique = parse_reflection(ask(self.llm, [{"role": "user", "content": prompt}]), list(self.tools))
        self.journal.append("reflection", task=task.task_id, kind="global", critique=asdict(critique))
        return critique

    def _reflect_local(self, task: LoopTask, trace: Trace) -> Critique | None:
        found = self.journal.last("reflection", task=task.task_id, kind="local")
        if found is not None:
            return Critique(**found["critique"]) if found["critique"] else None
        caption, checked, critique = self.captioner.caption(task), [], None
        for index, call in enumerate(trace.calls, 1):
            prompt = self.templates.render("local_reflection", instruction=task.instruction, caption=caption,
                                           feedback=task.feedback, answer=trace.answer or "(none)",
                                           total=len(trace.calls), checked="\n".join(checked) or "(none)",
                                           index=index, step=call.text(index))
            critique = parse_local_verdict(ask(self.llm, [{"role": "user", "content": prompt}]), list(self.tools), index)
            if critique is not None:
                break
            checked.append(call.text(index))
        self.journal.append("reflection", task=task.task_id, kind="local", critique=asdict(critique) if critique else None)
        return critique

    def _learn(self, task: LoopTask, trace: Trace, critique: Critique, phase: str) -> bool:
        """Collect and fit for the critique's (tool, concept); whether the tool's pool changed."""
        tool_name, concept = critique.tool, critique.concept
        if tool_name is None:
            return False
        tool = self.tools[tool_name]
        collected_event = self.journal.last("collected", task=task.task_id, phase=phase)
        if collected_event is None:
            index = len(self.journal.events("collected", tool=tool_name, concept=concept))
            directory = self.run_dir / "data" / tool_name / f"{concept_folder(concept)}-{index:02d}"
            if index >= self.settings.max_collections_per_concept:
                collected = Collected(tool_name, concept, str(directory),
                                      skipped=f"at its cap of {self.settings.max_collections_per_concept} collections "
                                              "(max_collections_per_concept)")
            else:
                shutil.rmtree(directory, ignore_errors=True)  # a collection cut off by a kill
                request = CollectionRequest(tool_name, concept, index, task, trace, critique.step, self.captioner.caption(task))
                collected = tool.collector.collect(request, directory)
            collected_event = self.journal.append("collected", task=task.task_id, phase=phase, index=index,
                                                  tool=tool_name, concept=concept, collected=asdict(collected))
        collected = Collected(**collected_event["collected"])
        if collected.skipped:
            return False
        key = hashlib.sha256(json.dumps([tool_name, concept, collected.data_hash]).encode()).hexdigest()[:16]
        done = self.journal.last("fit_done", key=key)
        if done is not None:  # this (tool, concept, data) was trained on before: never twice
            # on a resumed run this is the fit this very phase ran before the interruption
            return done["task"] == task.task_id and done["phase"] == phase and done["added"] > 0
        output_dir = self.run_dir / "fits" / f"{tool_name}-{concept_folder(concept)}-{key}"
        if self.journal.last("fit_started", key=key) is not None:
            shutil.rmtree(output_dir, ignore_errors=True)  # cut off last time: fit again from the start
        self.journal.append("fit_started", key=key, tool=tool_name, concept=concept, directory=str(output_dir))
        result = self.learner.fit(tool_name, concept, collected.fit_arguments, output_dir)
        candidate = PromptPool(tool.server.pool.spec)
        candidate.merge(tool.server.pool)
        added = candidate.merge(PromptPool.load(result.pool_path, expected=candidate.spec))
        merged, check = added > 0, None
        if added and tool.pool_check is not None and self.settings.pool_validation:
            trial = PromptToolServer(tool.server.tool, candidate, tool.server.top_k)
            held_out = [Path(e["collected"]["directory"]) for e in self.journal.events("collected", tool=tool_name)
                        if not e["collected"]["skipped"]]  # this collection and the earlier ones
            now, then = (tool.pool_check.errors(s, held_out) for s in (tool.server, trial))
            merged = then.errors < now.errors
            check = {"images": now.images, "errors_before": now.errors, "errors_after": then.errors,
                     "wrong_after": list(then.wrong)}
        if merged:
            tool.server = PromptToolServer(tool.server.tool, candidate, tool.server.top_k)
        self.journal.append("fit_done", key=key, tool=tool_name, concept=concept, task=task.task_id, phase=phase,
                            added=added if merged else 0, merged=merged, pool_check=check,
                            pool_path=result.pool_path, summary=_summary_counts(result.summary))
        self._save_state()
        return merged

    def _remember(self, task: LoopTask, trace: Trace, correct: bool, critique: str = "") -> None:
        for kind, text in (("plan", trace.plan), ("program", trace.program)):
            example = Demonstration(kind, correct, task.instruction, text, critique, task.task_id)
            if example not in self.demonstrations.examples:
                self.journal.append("demonstration", task=task.task_id, example=asdict(example))
                self.demonstrations.add(example)

    def _process(self, task: LoopTask) -> str:
        first = self._attempt(task, "initial")
        if first.correct:
            self._remember(task, first, True)
            return "solved"
        critique = self._reflect_global(task, first)
        self._remember(task, first, False, critique.reason or critique.problem or f"wrong at {critique.location}")
        trace = self._attempt(task, "after_global") if self._learn(task, first, critique, "global") else first
        if not trace.correct and self.settings.local_reflection:
            local = self._reflect_local(task, trace)
            if local is not None and self._learn(task, trace, local, "local"):
                trace = self._attempt(task, "after_local")
        return "solved_after_learning" if trace.correct else "unsolved"

    # ------------------------------------------------------------------ stages
    def train(self, tasks: list[LoopTask], progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The training stage over ``tasks`` (skipping those the journal has done); returns the report."""
        done = {e["task"] for e in self.journal.events("task_done")}
        for number, task in enumerate(tasks, 1):
            if task.task_id in done:
                continue
            try:
                verdict = self._process(task)
            except BackendError as err:
                self.journal.append("paused", task=task.task_id, reason=str(err))
                self._save_state()
                raise LoopPaused(f"the loop paused at task {task.task_id} ({number}/{len(tasks)}): {err}. Its state "
                                 f"is saved in {self.run_dir}; rerun the same command to continue.") from None
            self.journal.append("task_done", task=task.task_id, verdict=verdict)
            if progress:
                progress(f"task {number}/{len(tasks)} {task.task_id}: {verdict}")
        self._save_state()
        report = self.report()
        write_json_atomic(self.run_dir / REPORT, report)
        return report

    def evaluate(self, tasks: list[LoopTask]) -> dict[str, Any]:
        """The test stage: accuracy on ``tasks`` with tools and demonstrations as they are (nothing is updated)."""
        results = []
        for task in tasks:
            try:
                trace = self.inference.run(task, self.tools_factory(task, self.servers))
            except BackendError as err:
                raise LoopPaused(f"the test stage stopped at task {task.task_id}: {err}. Nothing learned is lost; "
                                 "rerun the same command to continue.") from None
            results.append({"task": task.task_id, "answer": trace.answer, "correct": trace.correct, "error": trace.error})
        solved = sum(r["correct"] for r in results)
        low, high = wilson_interval(solved, len(results))
        return {"tasks": len(results), "correct": solved, "accuracy": solved / max(1, len(results)),
                "interval95": [low, high], "results": results}

    def report(self) -> dict[str, Any]:
        """What was learned, accepted and rejected, per tool and concept; reflections and task outcomes."""
        per: dict[str, dict[str, Any]] = {}
        for event in self.journal.events("collected"):
            entry = per.setdefault(f"{event['tool']}/{event['concept']}", _empty_entry())
            if event["collected"]["skipped"]:
                entry["skipped"].append(event["collected"]["skipped"])
            else:
                entry["collections"] += 1
        for event in self.journal.events("fit_done"):
            entry = per.setdefault(f"{event['tool']}/{event['concept']}", _empty_entry())
            entry["fits"] += 1
            for key in ("tried", "accepted", "rejected"):
                entry[key] += event["summary"].get(key, 0)
            entry["merged_fits"] += int(event.get("merged", True))
            entry["prompts_in_pool"] += event["added"]
        reflections = self.journal.events("reflection")
        verdicts = [e["verdict"] for e in self.journal.events("task_done")]
        return {
            "tasks": {v: verdicts.count(v) for v in ("solved", "solved_after_learning", "unsolved")},
            "reflections": {
                "global": sum(e["kind"] == "global" for e in reflections),
                "local": sum(e["kind"] == "local" for e in reflections),
                "unusable": [{"task": e["task"], "kind": e["kind"], "problem": e["critique"]["problem"]}
                             for e in reflections if e["critique"] and e["critique"]["problem"]],
            },
            "learned": dict(sorted(per.items())),
            "pools": {name: {c: tool.server.pool.num_prompts(c) for c in tool.server.pool.concepts}
                      for name, tool in self.tools.items()},
            "demonstrations": self.demonstrations.counts(),
        }

    def close(self) -> None:
        self.sandbox.close()


def _empty_entry() -> dict[str, Any]:
    return {"collections": 0, "fits": 0, "tried": 0, "accepted": 0, "rejected": 0, "merged_fits": 0,
            "prompts_in_pool": 0, "skipped": []}


def _summary_counts(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in ("tried", "accepted", "rejected", "per_concept", "rejection_reasons")}
