"""HAMMR's question dispatcher as a Gymnasium environment (the ``hammr`` option of the reasoning-loop family).

One episode answers one question of any kind. Each action calls one registered agent (HAMMR: specialists, and
possibly a generic agent with every tool) on the question, at depth 1; the agent runs its own episode (its
graph, its examples, its policy; it may call other agents in turn, down to ``max_depth``) and

* returns an answer: the episode **terminates** (``answer_reward`` if it is right);
* fails (no answer in its steps, stopped by the depth limit or the LLM-call budget, an error): the failure
  goes into the dispatcher's memory, that agent is masked out, and the dispatcher may call another.

The episode is truncated when every agent has failed or the budget is spent. On a benchmark's task files (``tasks``,
as AVIS's: :mod:`clova_train.envs.avis.task_episodes`) every agent looks at the task's image through the
model-backed tool exports, and a correct answer earns ``answer_reward * m``, m the benchmark's metric. Reward:
``answer_reward`` for a correct answer, minus ``call_cost`` per call (plus the world file's ``tools.call_costs`` of
``agent:<name>``), minus ``llm_call_cost`` per LLM call the episode made (nested calls included), minus
``infeasible_penalty`` for calling a masked agent (nothing else happens).

Observation: ``[embed(question), embed(earlier calls), called-agent bits, the LLM dispatcher's choice one-hot,
action mask]``; the mask is last. ``info`` reports the nested calls (agent, depth, answer or reason, LLM calls),
the deepest depth reached and the LLM calls spent.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from clova_train.core.checks import Problems
from clova_train.envs.avis.agents import AgentSpec, AgentTools
from clova_train.envs.avis.information_seeking import (
    MaskedObservation, agent_env, build_chat, coerce_parts, default_examples, hydra_chat_for,
    seeking_problems, web_tools,
)
from clova_train.envs.avis.parts import Dispatcher, MemoryEntry, WorkingMemory
from clova_train.envs.avis.seeking_world import SEEKING_KINDS, load_seeking_world
from clova_train.envs.avis.task_episodes import TaskFileEpisodes, episode_terms
from clova_train.envs.avis.world import check_kinds, task_from_options
from clova_train.envs.common.budget import BudgetedChat, BudgetSpent, CallBudget
from clova_train.envs.common.config import observation_embedder
from clova_train.envs.common.selection import MEMORY_TEXT_HELP, observation_with_mask, part_offsets
from clova_train.envs.common.world import Task, normalise_answer
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.envs.tasks.source import BenchmarkTasksConfig
from clova_train.llm.backends import EmbeddingBackend
from clova_train.llm.cache import CacheMode, CallCache
from clova_train.llm.config import EmbedderConfig, LLMConfig
from clova_train.llm.search import WebSearchConfig


def default_agents() -> list[AgentSpec]:
    """The offline world's agents (as ``configs/quickstart/controller_hammr.yaml`` spells them out): one
    specialist per question kind, each with its tools and one example (``fact`` calls ``entity`` as a tool),
    and a generic agent with every tool and every example (HAMMR's flat baseline)."""
    examples = {e["path"][-1] if e["path"] else "": e for e in default_examples()}
    specialists = [
        ("counter", "Counts the objects of a colour and shape in the image.", ["detect"], "detect"),
        ("existence", "Checks whether an object is in the image.", ["vqa"], "vqa"),
        ("colour", "Tells the colour of an object.", ["detect", "select", "classify"], "classify"),
        ("entity", "Knows which guild an emblem belongs to.", ["detect", "select", "image_search"], "image_search"),
    ]
    agents = [AgentSpec(name, description, tools=tools, examples=[examples[last]])
              for name, description, tools, last in specialists]
    fact = dict(examples["text_search"], path=["agent:entity", "text_search"])
    agents.append(AgentSpec("fact", "Looks up facts about guilds on the web.", graph="fact_via_agent",
                            examples=[fact]))
    agents.append(AgentSpec("generic", "Answers any question about the image with every tool."))
    return agents


@dataclass
class AgentDispatchConfig(MaskedObservation):
    """The HAMMR dispatcher environment.

    Args:
        world: the offline world (``scripted`` LLM): a shipped preset (``seeking``, ``seeking-paraphrased``,
            ``seeking-delayed``) or a YAML/JSON world file: question kinds and weights, their wordings, the guessing
            tools, per-call costs, tools that need another's result first
            (``clova_train.envs.avis.seeking_world``).
        agents: the agents the dispatcher can call (its actions, in order); agents may call each other (default:
            :func:`default_agents`).
        kinds: question kinds the episodes draw, by the world's weights.
        answer_reward: reward of a correct answer.
        call_cost: subtracted for each agent called.
        llm_call_cost: subtracted for each LLM call of the episode, nested ones included.
        infeasible_penalty: subtracted for calling an agent that already failed this episode.
        max_depth: deepest nesting of agent calls (the dispatcher's calls are depth 1).
        max_llm_calls: LLM calls per episode, nested calls included.
        context_examples: ``scripted`` LLM only: how many of the last in-context examples its planner reads (null:
            all, as an LLM given them; a number is an ablation that handicaps the untrained planner).
        split: ``train`` draws tasks with id % 5 != 0, ``val`` and ``test`` the two halves of the held-out rest
            (``eval``: the old name of ``test``); with ``tasks``: the train, val or test task files.
        tasks: episodes from a benchmark's own task files, every agent's tools run on the task's image by the tool
            exports of ``tasks.tools``, answers scored by the benchmark's metric
            (``clova_train.envs.avis.task_episodes``); without task files: the offline world.
        llm: the LLM of the dispatcher and of every agent.
        embedder: observation embedder (default: 64-d hashing).
        cache_path: SQLite file recording every LLM call, nested ones included; none: no cache.
        cache_mode: ``record``, ``replay`` (a miss is an error) or ``off``.
        web: where the ``image_search`` / ``text_search`` actions of every ``avis`` agent go
            (:class:`~clova_train.llm.search.WebSearchConfig`: HTTP endpoints, through the call cache); both URLs null
            (the default): the offline world's knowledge base.
    """

    world: str = "seeking"
    agents: list[AgentSpec] = field(default_factory=default_agents)
    kinds: list[str] = field(default_factory=lambda: list(SEEKING_KINDS))
    answer_reward: float = 10.0
    call_cost: float = 0.5
    llm_call_cost: float = 0.0
    infeasible_penalty: float = 2.0
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
        """Every bad value, and whether the dispatcher builds (every agent's graph, tools and controller zip), as
        ``<prefix>.<field> = <value>: <rule>`` (``prefix``: where this section sits)."""
        return seeking_problems(self, prefix, AgentDispatchEnv,
                                costs=("infeasible_penalty", "call_cost", "llm_call_cost"),
                                counts=("max_depth", "max_llm_calls"),
                                extra=self.web.problems(Problems(prefix).key("web")))


class AgentDispatchEnv(gym.Env):
    """HAMMR's dispatcher (see the module docstring).

    Args:
        config: an :class:`AgentDispatchConfig` (or a dict of its fields).
        llm: a chat stack to use instead of ``config.llm``.
        embedder: an embedding backend to use instead of ``config.embedder``.
        hydra_chat: the chat stack of ``hydra`` agents (default: built with ``config.llm``).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, config: AgentDispatchConfig | dict | None = None, llm: BudgetedChat | None = None,
                 embedder: EmbeddingBackend | None = None, render_mode: str | None = None,
                 hydra_chat: BudgetedChat | None = None) -> None:
        if isinstance(config, dict):
            config = AgentDispatchConfig(**config)
        self.config = config = config or AgentDispatchConfig()
        self.render_mode = render_mode
        self.specs = config.agents  # AgentSpecs (the config's __post_init__ made them so)
        if not self.specs:
            raise ValueError("the dispatcher needs at least one agent (hammr.agents)")
        self.kinds = tuple(config.kinds)
        self.world = load_seeking_world(config.world)
        check_kinds(self.kinds, self.world)
        self.cache: CallCache | None = None
        if llm is None:
            llm, self.cache = build_chat(config.llm, config.context_examples, config.cache_path, config.cache_mode,
                                         self.world)
            hydra_chat = hydra_chat_for(config.llm, llm, self.cache)
        self.llm = llm
        self.web = web_tools(config.web, self.cache)
        self.episodes = TaskFileEpisodes(config.tasks, config.split) if config.tasks.given else None
        self.embedder = embedder or config.embedder.build()
        self.names = tuple(spec.name for spec in self.specs)
        self.agents = AgentTools(self.specs, llm, self.embedder, depth=0, hydra_chat=hydra_chat, seeking_env=agent_env,
                                 world=self.world, web=self.web, episodes=self.episodes)
        self.dispatcher = Dispatcher(llm, [(s.name, s.description) for s in self.specs],
                                     {s.name: [str(e.get("question", "")) for e in s.examples] for s in self.specs})
        n, d = len(self.names), self.embedder.dim
        self.dim = 2 * d + 3 * n
        self.action_space = gym.spaces.Discrete(n)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(self.dim,), dtype=np.float32)
        self.task: Task | BenchmarkTask | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        options = options or {}
        if self.episodes is not None and not isinstance(options.get("task"), (Task, BenchmarkTask)):
            self.task = self.episodes.draw(seed, options, self.np_random)
        elif isinstance(options.get("task"), BenchmarkTask):
            self.task = options["task"]
        else:
            self.task = task_from_options(options, self.np_random, self.config.split, self.kinds, self.world)
        self.llm.budget = CallBudget(self.config.max_depth, self.config.max_llm_calls)
        self.called: list[str] = []
        self.memory = WorkingMemory()
        self.iteration, self.stopped = 0, ""
        self.calls_counted = 0  # the reset's dispatcher call is counted with the first step
        self.choice = self._choose()
        return self._observation(), {"task_id": self.task.task_id, "question": self.task.question,
                                     "action_mask": self.action_masks()}

    def _choose(self) -> str:
        try:
            return self.dispatcher.choose(self.task.question, self.memory)
        except BudgetSpent as err:
            self.stopped = str(err)
            return ""

    def action_masks(self) -> np.ndarray:
        """Booleans over the agents: those not yet called this episode."""
        return np.asarray([name not in self.called for name in self.names], dtype=bool)

    def suggested_index(self) -> int:
        """The LLM dispatcher's own choice (the first uncalled agent when it named none usable)."""
        mask = self.action_masks()
        if self.choice in self.names and mask[self.names.index(self.choice)]:
            return self.names.index(self.choice)
        return int(np.flatnonzero(mask)[0]) if mask.any() else 0

    def _observation(self) -> np.ndarray:
        n = len(self.names)
        question, memory = self.embedder.embed([self.task.question, self.memory.text()])
        called = np.asarray([name in self.called for name in self.names], dtype=np.float32)
        choice = np.zeros(n, dtype=np.float32)
        if self.choice in self.names:
            choice[self.names.index(self.choice)] = 1.0
        return observation_with_mask([question, memory, called, choice], self.action_masks())

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        cfg, name = self.config, self.names[int(action)]
        self.iteration += 1
        reward, terminated, answer, result = -cfg.call_cost, False, None, None
        terms = episode_terms(self.task, None, self.episodes)  # no answer yet: what a step without one reports
        if not self.action_masks()[int(action)]:
            reward -= cfg.infeasible_penalty
        else:
            self.called.append(name)
            reward -= self.world.call_cost(f"agent:{name}")  # the world file's cost of this agent (default 0)
            result = self.agents.call(name, self.task.question, self.task)
            if result.ok:
                terminated, answer = True, normalise_answer(result.answer)
                terms = episode_terms(self.task, answer, self.episodes)
                reward += cfg.answer_reward * terms["score"]
            else:
                self.memory.add(MemoryEntry(f"agent:{name}", self.task.question, result.output(), "uninformative"))
                if self.llm.budget.spent:  # every level below stopped too; no agent can run now
                    self.stopped = self.llm.budget.spent_message
                else:
                    self.choice = self._choose()
        spent = self.llm.budget.llm_calls - self.calls_counted
        self.calls_counted = self.llm.budget.llm_calls
        reward -= cfg.llm_call_cost * spent
        truncated = not terminated and (not self.action_masks().any() or bool(self.stopped))
        budget = self.llm.budget
        info = {"task_id": self.task.task_id, "iteration": self.iteration, "answer": answer,
                **terms, "agent": name, "infeasible": result is None,
                "action_mask": self.action_masks(), "nested_calls": list(budget.calls),
                "max_depth_reached": budget.deepest, "stopped": self.stopped,
                "costs": {"llm_calls": spent,
                          "tool_calls": result.steps if result else 0}}
        return self._observation(), float(reward), terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self.task is not None:
            return f"Question: {self.task.question}\nCalled: {', '.join(self.called) or '(none)'}"
        return None

    def close(self) -> None:
        self.agents.close()
        if self.web is not None:
            self.web.close()

    def describe(self) -> dict[str, Any]:
        """What a serving stack needs to rebuild the observation and read the actions."""
        n, d = len(self.names), self.embedder.dim
        offsets = part_offsets([("question", d), ("memory", d), ("called", n), ("llm_choice", n), ("action_mask", n)])
        return {"environment": "hammr", "observation_dim": self.dim, "observation_parts": offsets,
                "text_parts": {"question": "the question", "memory": MEMORY_TEXT_HELP},
                "actions": {i: f"call agent {name}" for i, name in enumerate(self.names)},
                "agent_names": list(self.names),
                "action_mask": "the last len(actions) observation entries (1: not yet called)",
                "agents": [asdict(spec) for spec in self.specs], "embedder": self.embedder.identity(),
                "world": self.world.identity(), "config": asdict(self.config)}

    def reference_policies(self, random_seed: int) -> dict[str, Any]:
        """Rules without training: the LLM dispatcher's own choice, a random agent, and each agent always (the
        generic agent among them is HAMMR's flat baseline)."""
        rng = np.random.default_rng(random_seed)

        def random_agent(obs: np.ndarray, env: AgentDispatchEnv) -> int:
            return int(rng.choice(np.flatnonzero(env.action_masks())))

        def always(index: int) -> Any:
            def act(obs: np.ndarray, env: AgentDispatchEnv) -> int:
                mask = env.action_masks()
                return index if mask[index] else int(np.flatnonzero(mask)[0])
            return act

        policies: dict[str, Any] = {"LLM dispatcher's own choice (HAMMR without training)":
                                    lambda obs, env: env.suggested_index(), "random agent": random_agent}
        for index, name in enumerate(self.names):
            policies[f"always agent {name}"] = always(index)
        return policies
