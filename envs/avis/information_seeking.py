"""AVIS's information-seeking loop as a Gymnasium environment (the ``avis`` option of the reasoning-loop family).

One episode answers one question (AVIS Algorithm 2). The state starts at the graph's ``START``; each step
the agent picks an action (a tool, or ``agent:<name>`` to call another agent, HAMMR); then

1. the planner LLM writes the action's query from the question and the working memory;
2. the tool (or the called agent) runs and returns one line of output;
3. the reasoner LLM labels it ``answer`` (the episode **terminates** with that answer, if the action is one of
   the graph's answer actions), ``informative`` (the state moves to the action's name) or ``uninformative``
   (**backtrack**: the state stays where it was, and that action is excluded there);
4. the result goes into the working memory, which the observation encodes.

Feasible actions (:meth:`action_masks`, sb3-contrib's convention, also ``info["action_mask"]``) are the graph's
edges from the state, minus the actions excluded there by backtracking, minus the actions whose result was
already informative (AVIS's phi(state, G, M)). When none is left the search backs up to the state before
(recorded as a ``dead end`` backtrack); with none left at ``START`` the episode is truncated. An infeasible
action (an agent that ignores the mask) costs ``infeasible_penalty`` and changes nothing. The episode is
truncated after ``max_iterations`` steps, or when the LLM-call budget is spent (``info["stopped"]``).

Reward: ``answer_reward`` for a correct answer, minus ``step_cost`` every step, minus ``infeasible_penalty`` for an
infeasible action, minus the world file's cost of the tool or agent called (``tools.call_costs``; a tool the world
``requires`` another's result for says ``no results`` until memory holds it). On a benchmark's task files
(``tasks``; :mod:`clova_train.envs.avis.task_episodes`) the tools run on the task's image through the model-backed
tool exports and an answer earns ``answer_reward * m``, m the benchmark's metric (VQA accuracy's 0.3 steps, GQA's
exact match...), reported as ``info["score"]``.

Observation (float32 in [-1, 1]): ``[embed(question), embed(working memory), one-hot state, excluded-here bits,
planner's suggestion one-hot, action mask]``; the mask is last (``describe()`` says where each part sits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from clova_train.core.checks import Problems
from clova_train.core.errors import ClovaTrainError
from clova_train.envs.avis.agents import (
    AGENT_PREFIX, AgentSpec, AgentTools, as_specs, policy_problems, spec_problems,
)
from clova_train.envs.avis.parts import (
    Example, MemoryEntry, SeekingPlanner, SeekingReasoner, WorkingMemory, clip_output,
)
from clova_train.envs.avis.scripted import ScriptedSeekingLLM
from clova_train.envs.avis.task_episodes import TaskFileEpisodes, episode_terms
from clova_train.envs.avis.seeking_world import SEEKING_KINDS, SeekingWorld, load_seeking_world
from clova_train.envs.avis.transition_graph import TransitionGraph, load_graph, restrict
from clova_train.envs.avis.world import GOOD_PATHS, WEB_PREFIXES, SeekingTools, check_kinds, task_from_options
from clova_train.envs.common.budget import BudgetedChat, BudgetSpent, CallBudget
from clova_train.envs.common.config import coerce_models, observation_embedder, shared_problems
from clova_train.envs.common.selection import MEMORY_TEXT_HELP, ObservationTail, observation_with_mask, part_offsets
from clova_train.envs.common.world import Task, normalise_answer
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.envs.tasks.source import BenchmarkTasksConfig
from clova_train.envs.hydra.scripted import ScriptedReasoningLLM
from clova_train.llm.backends import BackendError, ChatBackend, EmbeddingBackend
from clova_train.llm.cache import CacheMode, CachedChat, CallCache, ReplayMiss
from clova_train.llm.config import EmbedderConfig, LLMConfig
from clova_train.llm.search import CachedSearch, SearchBackend, WebSearchConfig

TOOLS = ("caption", "vqa", "detect", "select", "classify", "image_search", "text_search")
DEFAULT_EXAMPLE_QUESTIONS = {
    "count": "How many blue squares are there?",
    "exists": "Is there a red triangle?",
    "colour": "What colour is the leftmost circle?",
    "entity": "Which guild has the leftmost triangle as its emblem?",
    "fact": "In which year was the guild with the leftmost square as its emblem founded?",
}


def default_examples(kinds: tuple[str, ...] = SEEKING_KINDS) -> list[dict[str, Any]]:
    """One in-context example per question kind: a question and its good tool path."""
    return [{"question": DEFAULT_EXAMPLE_QUESTIONS[k], "path": list(GOOD_PATHS[k])} for k in kinds]


class MaskedObservation:
    """What the AVIS and HAMMR configs say of their observation: it ends with the action mask and holds no planner
    probabilities, so only ``argmax_q`` (over the feasible actions) reads it."""

    def observation_tail(self) -> ObservationTail:
        """The observation ends with the action mask; it has no planner probabilities."""
        return ObservationTail(mask=True)

    def selection_problem(self, rule: str, prefix: str = "") -> str:
        """Why the greedy ``rule`` cannot read this environment's observation ("" when it can)."""
        if rule == "eq2":
            return "eq2 weights the planner's N sample probabilities: only the hydra environment has them"
        return ""


@dataclass
class InformationSeekingConfig(MaskedObservation):
    """The AVIS environment.

    Args:
        world: the offline world (``scripted`` LLM): a shipped preset (``seeking``, ``seeking-paraphrased``,
            ``seeking-delayed``) or a YAML/JSON world file: question kinds and weights, their wordings, the guessing
            tools, per-call costs, tools that need another's result first
            (``clova_train.envs.avis.seeking_world``).
        graph: transition graph: a preset name (``avis``: the paper's Figure 3, adapted) or a YAML/JSON file.
        tools: the graph's actions to keep (empty: all); the rest and their states are dropped.
        kinds: question kinds the episodes draw (count, exists, colour, entity, fact), by the world's weights.
        examples: the planner's in-context examples (``{"question", "path"}``); empty: one per kind.
        max_iterations: steps before the episode is truncated.
        answer_reward: reward of a correct answer.
        step_cost: subtracted every step.
        infeasible_penalty: subtracted for an action the mask forbids (nothing else happens).
        agents: agents callable as tools (``agent:<name>`` actions of the graph, HAMMR).
        max_depth: deepest nesting of agent calls.
        max_llm_calls: LLM calls per episode, nested agent calls included.
        context_examples: ``scripted`` LLM only: how many of the last in-context examples it reads (null: all, as
            an LLM given them; a number is an ablation that handicaps the untrained planner).
        split: ``train`` draws tasks with id % 5 != 0, ``val`` and ``test`` the two halves of the held-out rest
            (``eval``: the old name of ``test``); with ``tasks``: the train, val or test task files.
        tasks: episodes from a benchmark's own task files (OK-VQA, A-OKVQA, GQA, VQAv2...) with the tools run on
            each task's image by the tool exports of ``tasks.tools``, answers scored by the benchmark's metric
            (``clova_train.envs.avis.task_episodes``); without task files: the offline world.
        llm: planner/reasoner LLM (``scripted``: the offline world's).
        embedder: observation embedder (default: 64-d hashing).
        cache_path: SQLite file recording every LLM call (and every web search); none: no cache.
        cache_mode: ``record``, ``replay`` (a miss is an error) or ``off``.
        web: where ``image_search`` / ``text_search`` go (:class:`~clova_train.llm.search.WebSearchConfig`): HTTP
            endpoints (a search service, or a knowledge file served by ``python -m
            clova_train.llm.knowledge_server``), through the call cache; both URLs null (the default): the offline
            world's knowledge base. A failed search is the tool's output (``failed: <why>``), never an exception.
    """

    world: str = "seeking"
    graph: str = "avis"
    tools: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=lambda: list(SEEKING_KINDS))
    examples: list[dict[str, Any]] = field(default_factory=list)
    max_iterations: int = 8
    answer_reward: float = 10.0
    step_cost: float = 0.5
    infeasible_penalty: float = 2.0
    agents: list[AgentSpec] = field(default_factory=list)
    max_depth: int = 2
    max_llm_calls: int = 200
    context_examples: int | None = None
    split: Literal["train", "val", "test", "eval"] = "train"
    tasks: BenchmarkTasksConfig = field(default_factory=BenchmarkTasksConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    embedder: EmbedderConfig = field(default_factory=observation_embedder)
    cache_path: str | None = None
    cache_mode: CacheMode = "record"
    web: WebSearchConfig = field(default_factory=WebSearchConfig)

    def __post_init__(self) -> None:
        coerce_parts(self)
        if isinstance(self.web, dict):
            self.web = WebSearchConfig(**self.web)

    def problems(self, prefix: str = "") -> list[str]:
        """Every bad value, and whether the environment builds (graph, tools, agents and their controllers), as
        ``<prefix>.<field> = <value>: <rule>`` (``prefix``: where this section sits)."""
        web = self.web.problems(Problems(prefix).key("web"))
        return seeking_problems(self, prefix, InformationSeekingEnv, costs=("infeasible_penalty", "step_cost"),
                                counts=("max_depth", "max_llm_calls", "max_iterations"), extra=web)


def seeking_problems(config: Any, prefix: str, environment: Callable[[Any], Any], costs: tuple[str, ...],
                     counts: tuple[str, ...], extra: list[str] | None = None) -> list[str]:
    """The checks the AVIS and HAMMR configs share: question kinds, rewards (``costs``: fields >= 0), limits
    (``counts``: integers >= 1), the models, the agents; then, if those are sound, the ``environment`` is built
    from the config (and every agent's graph, tools and controller zip with it), nothing written."""
    found = Problems(prefix)
    if config.tasks.given:
        found.messages += config.tasks.problems(config.split, found.key("tasks"))
    unknown = [k for k in config.kinds if k not in SEEKING_KINDS]
    found.need(not unknown and bool(config.kinds), "kinds", config.kinds,
               f"each must be one of {', '.join(SEEKING_KINDS)}")
    found.finite("answer_reward", config.answer_reward)
    for key in costs:
        found.at_least(key, getattr(config, key), 0)
    for key in counts:
        found.integer_at_least(key, getattr(config, key), 1)
    problems = [*found.messages, *shared_problems(config, prefix), *spec_problems(config.agents, found.key("agents")),
                *(extra or [])]
    if problems:
        return problems
    try:
        built = environment(replace(config, cache_path=None))
        try:
            built.agents.prepare_all()
        finally:
            built.close()
    except (ClovaTrainError, ValueError, TypeError) as err:
        problems.append(f"{prefix}: {err}" if prefix else str(err))
    return [*problems, *policy_problems(config.agents, found.key("agents"))]


def build_chat(llm: LLMConfig, context_examples: int | None, cache_path: str | None,
               cache_mode: CacheMode, world: SeekingWorld) -> tuple[BudgetedChat, CallCache | None]:
    """The seeking worlds' chat stack: backend (the scripted one offline, speaking ``world``) -> call cache ->
    budget."""
    backend = llm.build(scripted=lambda: ScriptedSeekingLLM(context_examples, world))
    cache = CallCache(cache_path, cache_mode) if cache_path else None
    return BudgetedChat(CachedChat(backend, cache) if cache is not None else backend), cache


def hydra_chat_for(llm: LLMConfig, chat: BudgetedChat, cache: CallCache | None) -> BudgetedChat:
    """The chat stack of nested ``hydra`` agents: offline, HYDRA's scripted planner/coder (behind the same cache);
    a served LLM answers both protocols itself. Either way under ``chat``'s budget."""
    if llm.kind != "scripted":
        return chat
    backend: ChatBackend = ScriptedReasoningLLM()
    return BudgetedChat(CachedChat(backend, cache) if cache is not None else backend, shares_budget_of=chat)


@dataclass
class WebTools:
    """The search tools that go to a :class:`~clova_train.llm.search.SearchBackend` (``tools``), and the backend
    (cached or not). A called ``avis`` agent shares its caller's."""

    search: SearchBackend
    tools: tuple[str, ...]

    def answer(self, name: str, query: str) -> tuple[str, str]:
        """``(the tool's output line, "" or why the search failed)``. A failure is the output ``failed: <why>`` (as
        a called agent's), which the reasoner reads as uninformative; a replay cache's miss is raised (the run is
        not the recorded one: a configuration error)."""
        try:
            return f"{WEB_PREFIXES[name]}: {self.search.search(name, query)}", ""
        except ReplayMiss:
            raise
        except BackendError as err:
            return f"failed: {err}", str(err)

    def close(self) -> None:
        backend = getattr(self.search, "backend", self.search)
        if hasattr(backend, "close"):
            backend.close()


def web_tools(web: WebSearchConfig, cache: CallCache | None) -> WebTools | None:
    """The web tools of ``web`` behind ``cache`` (none: no URL set, the offline knowledge base answers)."""
    backend = web.build()
    if backend is None:
        return None
    return WebTools(CachedSearch(backend, cache) if cache is not None else backend, web.tools())


def coerce_parts(config: Any) -> None:
    """Nested parts of an AVIS or HAMMR config given as plain dicts (YAML, ``gymnasium.make`` kwargs) made typed."""
    coerce_models(config)
    config.agents = as_specs(config.agents)
    if config.tasks is None:  # "tasks: null" in a file: the offline world
        config.tasks = BenchmarkTasksConfig()
    elif isinstance(config.tasks, dict):
        config.tasks = BenchmarkTasksConfig(**config.tasks)


def examples_of(raw: list[dict[str, Any]], kinds: tuple[str, ...]) -> tuple[Example, ...]:
    return tuple(Example(str(e["question"]), tuple(e["path"])) for e in (raw or default_examples(kinds)))


def check_tools(graph: TransitionGraph, agents: list[AgentSpec]) -> None:
    names = {a.name for a in agents}
    for action in graph.actions:
        if action not in TOOLS and not (action.startswith(AGENT_PREFIX) and action[len(AGENT_PREFIX):] in names):
            raise ValueError(f"transition graph {graph.name}: action {action!r} is neither a tool ({', '.join(TOOLS)}) "
                             f"nor a registered agent ({', '.join(AGENT_PREFIX + n for n in sorted(names)) or 'none'})")


class InformationSeekingEnv(gym.Env):
    """AVIS's loop (see the module docstring).

    Args:
        config: an :class:`InformationSeekingConfig` (or a dict of its fields).
        llm: a chat stack to use instead of ``config.llm`` (a called agent shares its caller's).
        embedder: an embedding backend to use instead of ``config.embedder``.
        depth: nesting depth (0 at top level; agents called as tools run one deeper).
        hydra_chat: the chat stack of ``hydra`` agents (their planner/coder protocol), sharing this budget.
        world: the loaded world to use instead of ``config.world`` (a called agent shares its caller's).
        web: the web tools to use instead of ``config.web``'s (a called agent shares its caller's).
        episodes: the task files and tool client to use instead of ``config.tasks``' (a called agent shares its
            caller's).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: InformationSeekingConfig | dict | None = None, llm: BudgetedChat | None = None,
                 embedder: EmbeddingBackend | None = None, depth: int = 0, render_mode: str | None = None,
                 hydra_chat: BudgetedChat | None = None, world: SeekingWorld | None = None,
                 web: WebTools | None = None, episodes: TaskFileEpisodes | None = None) -> None:
        if isinstance(config, dict):
            config = InformationSeekingConfig(**config)
        self.config = config = config or InformationSeekingConfig()
        self.render_mode = render_mode
        self.kinds = tuple(config.kinds)
        self.world = world or load_seeking_world(config.world)
        check_kinds(self.kinds, self.world)
        self.graph = load_graph(config.graph)
        if config.tools:
            self.graph = restrict(self.graph, list(config.tools))
        self.specs = config.agents  # AgentSpecs (the config's __post_init__ made them so)
        check_tools(self.graph, self.specs)
        self.cache: CallCache | None = None
        if llm is None:
            llm, self.cache = build_chat(config.llm, config.context_examples, config.cache_path, config.cache_mode,
                                         self.world)
            hydra_chat = hydra_chat_for(config.llm, llm, self.cache)
        self.web = web or web_tools(config.web, self.cache)
        self.episodes = episodes or (TaskFileEpisodes(config.tasks, config.split) if config.tasks.given else None)
        self.llm, self.depth = llm, depth
        self.embedder = embedder or config.embedder.build()
        self.planner = SeekingPlanner(llm, examples_of(config.examples, self.kinds))
        self.reasoner = SeekingReasoner(llm)
        self.agents = AgentTools(self.specs, llm, self.embedder, depth, hydra_chat, seeking_env=agent_env,
                                 world=self.world, web=self.web, episodes=self.episodes)
        self.states = (self.graph.start, *self.graph.actions)
        n, d = len(self.graph.actions), self.embedder.dim
        self.dim = 2 * d + len(self.states) + 3 * n
        self.action_space = gym.spaces.Discrete(n)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(self.dim,), dtype=np.float32)
        self.task: Task | BenchmarkTask | None = None

    # ------------------------------------------------------------------ episode
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        options = options or {}
        if isinstance(options.get("task"), BenchmarkTask):
            self.task = options["task"]
        elif self.episodes is not None and not isinstance(options.get("task"), Task):
            self.task = self.episodes.draw(seed, options, self.np_random)
        else:
            self.task = task_from_options(options, self.np_random, self.config.split, self.kinds, self.world)
        if isinstance(self.task, BenchmarkTask):
            if self.episodes is None:
                raise ValueError("a benchmark task needs the environment's task files (tasks) for its tools")
            self.tools = self.episodes.seeking_tools(self.task, self.world)
        else:
            self.tools = SeekingTools(self.task, self.world)
        if not options.get("nested"):
            self.llm.budget = CallBudget(self.config.max_depth, self.config.max_llm_calls)
        self.state = self.graph.start
        self.trail: list[str] = [self.graph.start]  # states back to START, for dead-end backtracking
        self.excluded: dict[str, set[str]] = {}
        self.informative: set[str] = set()
        self.memory = WorkingMemory()
        self.iteration = 0
        self.path: list[dict[str, Any]] = []
        self.calls_counted = self.llm.budget.llm_calls  # the reset's planner call is counted with the first step
        self.stopped = ""
        self._suggest()
        return self._observation(), {"task_id": self.task.task_id, "question": self.task.question,
                                     "action_mask": self.action_masks()}

    def feasible(self) -> list[str]:
        gone = self.excluded.get(self.state, set()) | self.informative
        return [a for a in self.graph.feasible(self.state) if a not in gone]

    def action_masks(self) -> np.ndarray:
        """Booleans over the action space: which actions are feasible now (sb3-contrib's ``MaskablePPO`` reads it)."""
        feasible = set(self.feasible())
        return np.asarray([a in feasible for a in self.graph.actions], dtype=bool)

    def suggested_index(self) -> int:
        """The planner LLM's own next action (a feasible one)."""
        return self.graph.index(self.suggestion[0])

    def _suggest(self) -> None:
        feasible = self.feasible()
        self.suggestion = self.planner.propose(self.task.question, self.state, feasible, self.memory) if feasible \
            else ("", "")

    def _observation(self) -> np.ndarray:
        n = len(self.graph.actions)
        question, memory = self.embedder.embed([self.task.question, self.memory.text()])
        state = np.zeros(len(self.states), dtype=np.float32)
        state[self.states.index(self.state)] = 1.0
        excluded = np.asarray([a in self.excluded.get(self.state, ()) for a in self.graph.actions], dtype=np.float32)
        suggested = np.zeros(n, dtype=np.float32)
        if self.suggestion[0]:
            suggested[self.suggested_index()] = 1.0
        return observation_with_mask([question, memory, state, excluded, suggested], self.action_masks())

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        cfg = self.config
        name = self.graph.actions[int(action)]
        self.iteration += 1
        reward, terminated, answer = -cfg.step_cost, False, None
        event: dict[str, Any] = {"step": self.iteration, "state": self.state, "action": name}
        tool_calls = 0
        terms = episode_terms(self.task, None, self.episodes)  # no answer yet: what a step without one reports
        try:
            if not self.action_masks()[int(action)]:
                reward -= cfg.infeasible_penalty
                event["result"] = "infeasible"
            else:
                tool_calls = 1
                reward -= self.world.call_cost(name)  # the world file's cost of this tool or agent (default 0)
                label, answer = self._act(name, event)
                if label == "answer":
                    terminated, answer = True, normalise_answer(answer)
                    terms = episode_terms(self.task, answer, self.episodes)
                    reward += cfg.answer_reward * terms["score"]
                self._settle(event)
                if not terminated:
                    self._suggest()
        except BudgetSpent as err:
            self.stopped = str(err)
            event["result"] = "stopped"
        self.path.append(event)
        info_calls = self.llm.budget.llm_calls - self.calls_counted
        feasible_left = bool(self.feasible())
        truncated = not terminated and (self.iteration >= cfg.max_iterations or not feasible_left or bool(self.stopped))
        answer = answer if terminated else None
        info = {"task_id": self.task.task_id, "iteration": self.iteration, "answer": answer,
                **terms, "infeasible": event.get("result") == "infeasible", "state": self.state,
                "action_mask": self.action_masks(), "path": list(self.path),
                "costs": {"llm_calls": info_calls, "tool_calls": tool_calls},
                "nested_calls": list(self.llm.budget.calls) if self.depth == 0 else [],
                "max_depth_reached": self.llm.budget.deepest, "stopped": self.stopped,
                "tool_error": event.get("tool_error", "")}
        self.calls_counted = self.llm.budget.llm_calls
        return self._observation(), float(reward), terminated, truncated, info

    def _act(self, name: str, event: dict[str, Any]) -> tuple[str, str | None]:
        """Run one feasible action: query, tool or agent, reasoner, memory; returns (label, answer)."""
        _, query = self.suggestion if self.suggestion[0] == name else \
            self.planner.propose(self.task.question, self.state, self.feasible(), self.memory, chosen=name)
        missing = self.world.missing_prerequisite(name, [entry.action for entry in self.memory.entries])
        if missing:  # the world file's requires: this tool answers only once memory holds the other's result
            output = f"{name}: no results (needs a {missing} result first)"
        elif name.startswith(AGENT_PREFIX):
            result = self.agents.call(name[len(AGENT_PREFIX):], query, self.task)
            output = clip_output(result.output())
        elif self.web is not None and name in self.web.tools:
            output, error = self.web.answer(name, query)
            output = clip_output(output)
            if error:
                event["tool_error"] = error
        elif isinstance(self.tools, SeekingTools):
            output = clip_output(getattr(self.tools, name)(query))
        else:
            output, error = self.tools.run(name, query)
            output = clip_output(output)
            if error:
                event["tool_error"] = error
        label, answer = self.reasoner.judge(self.task.question, name, query, output, self.memory)
        if label == "answer" and name not in self.graph.answers:
            label, answer = "informative", None  # this action cannot end the search: its result is kept
        self.memory.add(MemoryEntry(name, query, output, label))
        event.update(query=query, output=output, result=label)
        if label == "informative":
            self.informative.add(name)
            self.state = name
            self.trail.append(name)
        elif label == "uninformative":
            self.excluded.setdefault(self.state, set()).add(name)
            event["backtrack_to"] = self.state
        return label, answer

    def _settle(self, event: dict[str, Any]) -> None:
        """Back up from states with nothing feasible left (AVIS's tree search), recording each backtrack."""
        while not self.feasible() and len(self.trail) > 1:
            dead = self.trail.pop()
            self.state = self.trail[-1]
            self.excluded.setdefault(self.state, set()).add(dead)
            event.setdefault("dead_ends", []).append(dead)

    # ------------------------------------------------------------------ helpers
    def render(self) -> str | None:
        if self.render_mode == "ansi" and self.task is not None:
            return f"Question: {self.task.question}\nState: {self.state}\nMemory:\n{self.memory.text()}"
        return None

    def close(self) -> None:
        self.agents.close()
        if self.web is not None and self.depth == 0:
            self.web.close()

    def describe(self) -> dict[str, Any]:
        """What a serving stack needs to rebuild the observation and read the actions."""
        n, d = len(self.graph.actions), self.embedder.dim
        offsets = part_offsets([("question", d), ("memory", d), ("state", len(self.states)), ("excluded", n),
                                ("suggested", n), ("action_mask", n)])
        return {"environment": "avis", "observation_dim": self.dim, "observation_parts": offsets,
                "text_parts": {"question": "the question", "memory": MEMORY_TEXT_HELP},
                "states": list(self.states), "actions": dict(enumerate(self.graph.actions)),
                "action_mask": "the last len(actions) observation entries (1: feasible)",
                "graph": self.graph.to_dict(), "embedder": self.embedder.identity(), "world": self.world.identity(),
                "config": asdict(self.config)}

    # ------------------------------------------------------------------ rules without training
    def reference_policies(self, random_seed: int) -> dict[str, Any]:
        """Rules that need no training, for the held-out comparison: the planner's own choice, a random feasible
        action, and an oracle that follows the good path of the question's kind (a ceiling)."""
        rng = np.random.default_rng(random_seed)

        def random_feasible(obs: np.ndarray, env: InformationSeekingEnv) -> int:
            return int(rng.choice(np.flatnonzero(env.action_masks())))

        def oracle(obs: np.ndarray, env: InformationSeekingEnv) -> int:
            mask = env.action_masks()
            called = {entry.action for entry in env.memory.entries}
            for action in env.world.with_prerequisites(good_path(env.task, env.world)):
                if action not in called and action in env.graph.actions and mask[env.graph.index(action)]:
                    return env.graph.index(action)
            return int(np.flatnonzero(mask)[0])

        oracle_name = ("the offline world's good path of the question's kind (with model tools: no ceiling)"
                       if self.episodes is not None else "oracle (the good path of the question's kind; a ceiling)")
        return {"planner's own choice (AVIS without a trained controller)": lambda obs, env: env.suggested_index(),
                "random feasible action": random_feasible, oracle_name: oracle}


def good_path(task: Task | BenchmarkTask, world: SeekingWorld) -> tuple[str, ...]:
    """The offline world's good path for the task's question kind (a benchmark question: the kind the world reads in
    its wording; asking VQA directly when it reads none)."""
    if isinstance(task, Task):
        return GOOD_PATHS[task.question_type]
    parsed = world.parse(task.question)
    return GOOD_PATHS[parsed[0]] if parsed else ("vqa",)


def agent_env(spec: AgentSpec, tools: AgentTools) -> InformationSeekingEnv:
    """The environment of the ``avis`` agent ``spec`` that ``tools`` runs: its graph, tools and examples, one level
    below ``tools``' owner, sharing its chat, embedder and budget, and able to call every agent ``tools`` knows."""
    config = InformationSeekingConfig(graph=spec.graph, tools=list(spec.tools), examples=list(spec.examples),
                                      max_iterations=spec.max_iterations, agents=list(tools.specs.values()))
    return InformationSeekingEnv(config, llm=tools.chat, embedder=tools.embedder, depth=tools.depth + 1,
                                 hydra_chat=tools.hydra_chat, world=tools.world, web=tools.web,
                                 episodes=tools.episodes)
