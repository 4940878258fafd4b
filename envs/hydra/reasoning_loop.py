"""HYDRA's planner -> controller -> reasoner -> textualizer loop as a Gymnasium environment.

One episode answers one question. Each step the agent sees the planner's N instruction samples (embedded
with the question, the memory bank and the task description, see
:class:`~clova_train.envs.hydra.parts.ObservationEncoder`) and acts:

* action ``i < N``: the reasoner writes code for sample ``i``, the sandbox runs it with the variables kept
  from earlier steps; if it assigns ``final_answer`` the episode **terminates**, otherwise the textualizer
  writes the outcome into the memory bank and the planner proposes new samples;
* action ``N``: reject all samples; the planner is asked again (its prompt's attempt number goes up).

The episode is **truncated** at ``max_iterations`` steps without an answer.

Reward (HYDRA Eq. 3, delivered per step as ``R^t - R^{t-1}``, never as a running sum): the first step
also carries the constant ``R^1``; then each step adds

* ``-t`` for a step that does not end the episode (a reject, an intermediate result, an error),
* ``+alpha * m`` for a final answer related to the question (m = 1 if it equals the gold answer, else 0),
* ``-alpha`` for a final answer unrelated to the question (not of the question's answer type), and for
  running out of iterations with no answer (the truncating step gets ``-alpha`` instead of ``-t``);

plus ``-error_penalty`` on a step whose code failed (exception, sandbox violation, timeout, memory) and
``-reject_penalty`` on a reject (the cost of another planner call; 0 gives Eq. 3 as published). The
paper's ``t = 1: R^1`` case is read as the starting credit, so that the first step's outcome still counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from clova_train.llm.backends import ChatBackend, EmbeddingBackend, ask
from clova_train.llm.config import EmbedderConfig, LLMConfig
from clova_train.llm.cache import CacheMode, CachedChat, CachedEmbedding, CallCache
from clova_train.sandbox import Sandbox, ToolAPI
from clova_train.core.checks import Problems, is_integer
from clova_train.envs.common.config import coerce_models, observation_embedder, shared_problems
from clova_train.envs.hydra.parts import MemoryBank, ObservationEncoder, Planner, Reasoner, Textualizer, short_repr
from clova_train.core.errors import DataError
from clova_train.envs.hydra.reasoning_world import ReasoningWorld, load_world
from clova_train.envs.hydra.scripted import ScriptedReasoningLLM
from clova_train.envs.common.selection import ObservationTail, part_offsets
from clova_train.envs.common.world import (
    COLOURS, SIZE, SceneTools, Split, Task, make_task, normalise_answer, task_id_option,
)
from clova_train.envs.tasks.formats import TaskFiles
from clova_train.envs.tasks.metrics import eq3_answer_terms
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.envs.tasks.source import (
    BenchmarkTasksConfig, as_benchmark_answer, episode_index, gold_text, image_dimensions, score_answer,
    task_by_id,
)

MAX_ANSWER_CHARS = 200
PAPER_REWARDS = {"r1": 100.0, "alpha": 100.0, "error_penalty": 10.0, "reject_penalty": 0.0}  # HYDRA Sec. 4 (r1, alpha)
Outcome = Literal["continue", "related", "unrelated", "truncated"]


def eq3_step_reward(t: int, outcome: Outcome, r1: float, alpha: float, m: float = 0.0, failed: bool = False,
                    error_penalty: float = 0.0, rejected: bool = False, reject_penalty: float = 0.0) -> float:
    """The reward of step ``t`` (1-based): ``R^t - R^{t-1}`` of Eq. 3 as read in the module docstring."""
    term = {"continue": -float(t), "related": alpha * m, "unrelated": -alpha, "truncated": -alpha}[outcome]
    penalties = (error_penalty if failed else 0.0) + (reject_penalty if rejected else 0.0)
    return (r1 if t == 1 else 0.0) + term - penalties


def is_related(task: Task, answer: str) -> bool:
    """Whether ``answer`` is of the kind the question asks for (a number, yes/no, a colour)."""
    if task.question_type == "count":
        return answer.isdigit()
    if task.question_type == "colour":
        return answer in COLOURS
    return answer in ("yes", "no")


@dataclass
class ReasoningLoopConfig:
    """Everything that defines the environment.

    Args:
        num_samples: N, instruction samples per planner call (actions 0..N-1 pick one, N rejects all).
        max_iterations: steps before the episode is truncated.
        world: the offline world (``scripted`` LLM and scene tools): a shipped preset (``shapes``,
            ``shapes-replan``, ``shapes-paraphrased``) or a YAML/JSON world file
            (``clova_train.envs.hydra.reasoning_world`` documents it: question kinds and their wordings, how the
            planner misleads, tool behaviour, default rewards).
        r1: Eq. 3's R^1 (paper: 100); null: the world's (paper value unless the world file sets one).
        alpha: Eq. 3's alpha (paper: 100); null: the world's.
        error_penalty: subtracted on a step whose code failed or broke a sandbox rule (default 10); null: the
            world's.
        reject_penalty: subtracted on a reject (cost of a re-plan; 0 is Eq. 3 as published); null: the world's.
        layout: observation layout, ``per_part`` or ``joint`` (see ObservationEncoder).
        probability_features: ``joint`` layout: append the N planner probabilities to the embedding (what HYDRA's
            Eq. 2 selection reads; the ``per_part`` layout always ends with them).
        split: ``train`` draws tasks with id % 5 != 0, ``val`` and ``test`` the two halves of the held-out rest
            (``clova_train.envs.common.world.task_split``; ``eval``: the old name of ``test``); with ``tasks``: the
            train, val or test task files.
        tasks: episodes from a benchmark's own task files (GQA, OK-VQA, A-OKVQA, RefCOCO...) with model-backed
            ``ImagePatch`` tools, scored by the benchmark's metric (``clova_train.envs.tasks.source``); without task
            files: the offline world's scenes and annotation tools.
        llm: planner/reasoner LLM (``scripted``: the offline world's).
        embedder: observation embedder (default: 64-d hashing).
        cache_path: SQLite file recording every LLM call (and embedding call if cache_embeddings); none: no cache.
        cache_mode: ``record``, ``replay`` (a miss is an error) or ``off``.
        cache_embeddings: also cache embedding calls (worth it for remote embedders, not for hashing).
        sandbox_timeout_s: wall-time limit of one code run.
        sandbox_memory_mb: memory the sandbox worker may allocate.
    """

    num_samples: int = 5
    max_iterations: int = 5
    world: str = "shapes"
    r1: float | None = None
    alpha: float | None = None
    error_penalty: float | None = None
    reject_penalty: float | None = None
    layout: Literal["per_part", "joint"] = "per_part"
    probability_features: bool = False
    split: Split = "train"
    tasks: BenchmarkTasksConfig = field(default_factory=BenchmarkTasksConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    embedder: EmbedderConfig = field(default_factory=observation_embedder)
    cache_path: str | None = None
    cache_mode: CacheMode = "record"
    cache_embeddings: bool = False
    sandbox_timeout_s: float = 2.0
    sandbox_memory_mb: int = 256

    def __post_init__(self) -> None:
        coerce_models(self)
        if self.tasks is None:  # "tasks: null" in a file: the offline world
            self.tasks = BenchmarkTasksConfig()
        elif isinstance(self.tasks, dict):
            self.tasks = BenchmarkTasksConfig(**self.tasks)
        # only while a reward is unresolved: copies of a resolved config (dataclasses.replace) read no file
        if isinstance(self.world, str) and any(getattr(self, key) is None for key in PAPER_REWARDS):
            try:
                world = self.load_world()
            except DataError:
                world = None
            for key, paper in PAPER_REWARDS.items():
                if getattr(self, key) is None:
                    setattr(self, key, world.rewards.get(key, paper) if world else paper)

    def load_world(self) -> ReasoningWorld:
        """The world this config names (a :class:`DataError` naming the file when it cannot be read), read and
        checked once per config and value of ``world``: resolving the rewards, :meth:`problems` and the
        environment built from this config share it."""
        loaded = self.__dict__.get("_loaded_world")  # not a field: asdict, replace and the CLI do not see it
        if loaded is None or loaded[0] != self.world:
            loaded = self._loaded_world = (self.world, load_world(self.world))
        return loaded[1]

    def observation_tail(self) -> ObservationTail:
        """The observation ends with the N planner probabilities (``per_part``, or ``joint`` with them); no mask."""
        has_probabilities = self.layout == "per_part" or self.probability_features
        return ObservationTail(probabilities=self.num_samples if has_probabilities else 0)

    def selection_problem(self, rule: str, prefix: str = "") -> str:
        """Why the greedy ``rule`` cannot read this environment's observation ("" when it can)."""
        if rule == "eq2" and not self.observation_tail().probabilities:
            key = Problems(prefix).key
            return (f"eq2 reads the planner probabilities from the observation: use {key('layout')} per_part, or "
                    f"set {key('probability_features')} true with the joint layout")
        return ""

    def problems(self, prefix: str = "") -> list[str]:
        """Every bad value, as ``<prefix>.<field> = <value>: <rule>`` (``prefix``: where this section sits)."""
        found = Problems(prefix)
        for key in ("num_samples", "max_iterations"):
            found.at_least(key, getattr(self, key), 1)
        for key in ("r1", "alpha"):
            found.finite(key, getattr(self, key))
        for key in ("error_penalty", "reject_penalty"):
            found.at_least(key, getattr(self, key), 0)
        found.one_of("layout", self.layout, ("per_part", "joint"))
        try:
            world = self.load_world()
        except DataError as err:
            found.add(f"{found.key('world')}: {err}")
        else:
            if is_integer(self.num_samples) and self.num_samples >= 1:
                found.messages += world.sample_count_problems(self.num_samples, f"{found.key('world')}: {self.world}")
        if self.tasks.given:
            found.messages += self.tasks.problems(self.split, found.key("tasks"))
        found.positive("sandbox_timeout_s", self.sandbox_timeout_s)
        found.at_least("sandbox_memory_mb", self.sandbox_memory_mb, 32)
        return [*found.messages, *shared_problems(self, prefix)]


TEXT_PARTS = {"text": "observation.hydra_samples_text(context, samples) (the joint layout's one text)",
              "context": "observation.hydra_context_text(question, iteration, max_iterations, memory entries)"}


class ReasoningLoopEnv(gym.Env):
    """The reasoning loop (see the module docstring).

    Args:
        config: a :class:`ReasoningLoopConfig` (or a dict of its fields).
        llm: a chat backend to use instead of ``config.llm`` (still cached if ``cache_path`` is set).
        embedder: an embedding backend to use instead of ``config.embedder``.
        render_mode: ``ansi`` returns the observation text from ``render()``.
        tools_factory: builds the tool API for a task (default: :class:`SceneTools`, the annotation oracle, with
            the world's guessers; with ``config.tasks``, the model-backed ``ImagePatchTools`` of its ``tools``).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: ReasoningLoopConfig | dict | None = None, llm: ChatBackend | None = None,
                 embedder: EmbeddingBackend | None = None, render_mode: str | None = None,
                 tools_factory: Callable[[Any], ToolAPI] | None = None) -> None:
        if isinstance(config, dict):
            config = ReasoningLoopConfig(**config)
        self.config = config = config or ReasoningLoopConfig()
        self.world = world = config.load_world()
        self.render_mode = render_mode
        self.tools_factory = tools_factory or (lambda task: SceneTools(task, world.guess_right_one_in))
        chat = llm or config.llm.build(scripted=lambda: ScriptedReasoningLLM(world))
        embed = embedder or config.embedder.build()
        self.cache: CallCache | None = None
        if config.cache_path:
            self.cache = CallCache(config.cache_path, config.cache_mode)
            chat = CachedChat(chat, self.cache)
            if config.cache_embeddings:
                embed = CachedEmbedding(embed, self.cache)
        self.llm, self.embedder = chat, embed
        self.planner = Planner(chat, config.num_samples)
        self.reasoner = Reasoner(chat)
        self.textualizer = Textualizer()
        self.encoder = ObservationEncoder(embed, config.num_samples, config.layout, config.probability_features)
        self.sandbox = Sandbox(config.sandbox_timeout_s, config.sandbox_memory_mb)
        self.action_space = gym.spaces.Discrete(config.num_samples + 1)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(self.encoder.dim,), dtype=np.float32)
        self.task: Task | BenchmarkTask | None = None
        self.image_size = (SIZE, SIZE)
        self.benchmark_tasks: tuple[BenchmarkTask, ...] | None = None
        self.task_files: TaskFiles | None = None
        if config.tasks.given:
            chosen = config.tasks.split_tasks(config.split)
            self.task_files, self.benchmark_tasks, self.skipped_records = chosen.files, chosen.tasks, chosen.skipped
            self._tasks_where = chosen.where
            if tools_factory is None:
                # loaded (or connected) now, once per process: a program's time limit must not pay for it
                self._tool_client = config.tasks.tools.client()
                self.tools_factory = self._image_patch_tools

    def _image_patch_tools(self, task: BenchmarkTask) -> ToolAPI:
        """Model-backed tools over the task's image (the process's shared models or tool server)."""
        from clova_train.tools.image_patch import ImagePatchTools

        tools = self.config.tasks.tools
        return ImagePatchTools(task.image, self._tool_client, tools.labels, tools.crop_margin, llm=self._llm_query)

    def _llm_query(self, question: str) -> str:
        """``llm_query``: the environment's LLM (through its call cache), asked one question."""
        return ask(self.llm, [{"role": "user", "content": question}])

    # ------------------------------------------------------------------ episode
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        options = options or {}
        if isinstance(options.get("task"), (Task, BenchmarkTask)):  # given whole (an agent calling this one as a tool)
            self.task = options["task"]
        elif self.benchmark_tasks is not None:
            self.task = self._benchmark_task(seed, options)
        else:
            self.task = make_task(task_id_option(options, self.np_random, self.config.split), self.world.questions,
                                  self.world.phrasings)
        self.image_size = image_dimensions(self.task) if isinstance(self.task, BenchmarkTask) else (SIZE, SIZE)
        self.tools = self.tools_factory(self.task)
        self.iteration, self.attempt, self.rejects = 0, 0, 0
        self.memory = MemoryBank()
        self.variables: dict[str, Any] = {}
        self._propose()
        return self._observation(), {"task_id": self.task.task_id, "question": self.task.question}

    def _benchmark_task(self, seed: int | None, options: dict[str, Any]) -> BenchmarkTask:
        tasks = self.benchmark_tasks
        if options.get("task_id") is not None:
            return task_by_id(tasks, options["task_id"], self._tasks_where)
        return tasks[episode_index(len(tasks), self.config.split, seed, self.np_random.integers)]

    def _judge(self, final: Any) -> tuple[str, bool, float]:
        """A program's ``final_answer`` as shown, whether it is related to the question, and Eq. 3's ``m``."""
        if isinstance(final, str):
            final = normalise_answer(final[:MAX_ANSWER_CHARS])
        task = self.task
        if isinstance(task, BenchmarkTask):
            answer = as_benchmark_answer(final, task, self.image_size[1])
            if not isinstance(answer, (str, tuple)):
                answer = normalise_answer(short_repr(answer))
            related, m = score_answer(self.task_files, task, answer) if self.task_files is not None else \
                eq3_answer_terms(task.benchmark, answer, task)  # a called agent's task: scored by its benchmark
            return (answer if isinstance(answer, str) else str(list(answer))), related, m
        answer = final if isinstance(final, str) else normalise_answer(short_repr(final))
        return answer, is_related(task, answer), float(answer == task.answer)

    def _propose(self) -> None:
        self.samples = self.planner.propose(self.task.question, self.memory, self.attempt)

    def _context(self) -> str:
        return ObservationEncoder.context_text(self.task.question, self.iteration + 1, self.config.max_iterations,
                                               self.memory)

    def _observation(self) -> np.ndarray:
        return np.clip(self.encoder.encode(self._context(), self.samples), -1.0, 1.0)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        action = int(action)
        calls_before = self._backend_calls()
        cfg = self.config
        self.iteration += 1
        t = self.iteration
        gold = gold_text(self.task) if isinstance(self.task, BenchmarkTask) else self.task.answer
        info: dict[str, Any] = {"task_id": self.task.task_id, "iteration": t, "answer": None, "gold": gold,
                                "correct": False, "score": 0.0, "instruction": None, "code": None,
                                "status": None, "error": "", "rejected": action == cfg.num_samples}
        terminated, failed, outcome, m = False, False, "continue", 0.0
        if action == cfg.num_samples:
            self.rejects += 1
            self.attempt += 1
        else:
            instruction = self.samples[action][0]
            code = self.reasoner.write_code(self.task.question, instruction, self.variables, self.memory)
            image_id = self.task.image.name if isinstance(self.task, BenchmarkTask) else self.task.image_id
            result = self.sandbox.run(code, self.variables, self.tools, image_id, self.image_size)
            failed = not result.ok
            info.update(instruction=instruction, code=code, status=result.status, error=result.error,
                        tool_calls=result.tool_calls)
            if result.ok and "final_answer" in result.variables:
                answer, related, m = self._judge(result.variables["final_answer"])
                info.update(answer=answer, correct=m >= 1.0, score=m)
                terminated = True
                outcome = "related" if related else "unrelated"
            else:
                if result.ok:
                    self.variables = result.variables
                self.memory.add(self.textualizer.describe(t, instruction, result))
                self.attempt = 0
        truncated = not terminated and t >= cfg.max_iterations
        if truncated:
            outcome = "truncated"
        reward = eq3_step_reward(t, outcome, cfg.r1, cfg.alpha, m, failed, cfg.error_penalty,
                                 action == cfg.num_samples, cfg.reject_penalty)
        if not (terminated or truncated):
            self._propose()
        info["rejects"] = self.rejects
        info["costs"] = {"llm_calls": self._backend_calls() - calls_before, "tool_calls": info.get("tool_calls", 0)}
        if self.cache is not None:
            info["cache_hit_rate"] = self.cache.stats.hit_rate
        return self._observation(), reward, terminated, truncated, info

    def _backend_calls(self) -> int:
        if self.cache is not None:
            return self.cache.stats.backend_calls
        return getattr(self.llm, "calls", 0)

    # ------------------------------------------------------------------ helpers
    def asks_held_out_wording(self) -> bool:
        """Whether the current task's question is in a wording that only test tasks are asked in (a world whose
        question kind has three wordings or more; :mod:`clova_train.envs.common.wordings`)."""
        task = self.task
        return isinstance(task, Task) and self.world.held_out_wording(task.question_type, task.question)

    def planner_probabilities(self) -> np.ndarray:
        """The current samples' planner probabilities (for the HYDRA-without-RL baseline)."""
        return np.asarray([p for _, p in self.samples], dtype=np.float32)

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self.task is not None:
            return self.encoder.text(self._context(), self.samples)
        return None

    def close(self) -> None:
        self.sandbox.close()

    def describe(self) -> dict[str, Any]:
        """What a serving stack needs to rebuild the observation: template, layout, embedder, sizes."""
        return {
            "environment": "hydra",
            "observation_template": ObservationEncoder.__doc__,
            "observation_parts": part_offsets(self.encoder.parts()),
            "text_parts": {name: TEXT_PARTS.get(name, f"the planner's instruction {name.split('_')[-1]}")
                           for name, _ in self.encoder.parts() if name != "probabilities"},
            "layout": self.config.layout,
            "probabilities_in_last_entries": self.encoder.has_probabilities,
            "observation_dim": self.encoder.dim,
            "num_samples": self.config.num_samples,
            "actions": {str(i): f"run sample {i + 1}" for i in range(self.config.num_samples)}
            | {str(self.config.num_samples): "reject all samples and re-plan"},
            "embedder": self.embedder.identity(),
            "world": self.world.as_dict(),
            "config": asdict(self.config),
        }
