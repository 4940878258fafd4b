"""Agents as tools (HAMMR): an agent is an environment configuration plus a policy, and other agents call it.

The AVIS environment's ``agent:<name>`` actions and HAMMR's dispatcher both call agents through this module.

* :class:`AgentSpec`: what a config file says of an agent: name, description (what the dispatcher's LLM reads),
  its transition graph and in-context examples, its policy (``planner``: the LLM's own choices, the prompted
  agent of HAMMR; ``scripted``: a fixed tool path; ``controller``: a DQN zip trained by ``clova-train
  controller``, run by the greedy rule it was trained with).
* :class:`AgentTools`: runs a named agent on a (sub-)question about the caller's scene, one level deeper. An
  ``avis`` agent is an :class:`~clova_train.envs.avis.information_seeking.InformationSeekingEnv` (tools called by
  name; the caller passes the function that builds it, that module being the caller); a ``hydra`` agent is a
  :class:`~clova_train.envs.hydra.reasoning_loop.ReasoningLoopEnv` whose LLM-written programs run in the sandbox,
  exactly as at top level. Both share the caller's LLM call cache and budget
  (:mod:`clova_train.envs.common.budget`). Past the depth limit or the budget the call is stopped and reported;
  any failure of the callee (no answer, truncated, stopped, an error) comes back as a failure the caller
  observes, never an exception.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clova_train.core.errors import ClovaTrainError
from clova_train.envs.avis.seeking_world import DEFAULT_WORLD, SeekingWorld
from clova_train.envs.avis.task_episodes import sub_task
from clova_train.envs.avis.world import make_seeking_task
from clova_train.envs.common.budget import BudgetedChat, BudgetSpent
from clova_train.envs.common.selection import RULES, select_actions
from clova_train.envs.common.world import Task
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.envs.hydra.reasoning_loop import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.llm.backends import EmbeddingBackend
from clova_train.llm.cache import ReplayMiss

AGENT_PREFIX = "agent:"
AGENT_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class AgentSpec:
    """An agent that can be called as a tool (action ``agent:<name>``) or dispatched to.

    Args:
        name: the agent's name (letters, digits, ``_`` and ``-``).
        description: one sentence on what it answers (the dispatcher's LLM reads it).
        graph: its transition graph: a preset name (``avis``) or a YAML/JSON file.
        tools: the graph's actions this agent may use (empty: all of them); a specialist gets a few.
        examples: its planner's in-context examples, each ``{"question": ..., "path": [tool, ...]}``.
        environment: ``avis`` (tools within a transition graph) or ``hydra`` (LLM-written programs run in the
            sandbox; answers count, existence and colour questions).
        policy: ``planner`` (the LLM's own next action; ``hydra``: the planner's top-probability sample),
            ``scripted`` (``avis`` only: the first feasible action of ``path`` not yet informative) or
            ``controller`` (a DQN zip exported by ``clova-train controller`` for the same environment, run by the
            greedy rule it was trained with, which the zip keeps: argmax Q or HYDRA Eq. 2).
        path: ``scripted``: the tools to use, in order.
        controller: ``controller``: the ``.zip`` file (see :func:`load_controller_policy`).
        max_iterations: steps before its episode is cut.
        hydra_env: ``hydra``: ReasoningLoopConfig fields (those the controller was trained with).
    """

    name: str
    description: str = ""
    environment: Literal["avis", "hydra"] = "avis"
    graph: str = "avis"
    tools: list[str] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    policy: Literal["planner", "scripted", "controller"] = "planner"
    path: list[str] = field(default_factory=list)
    controller: str = ""
    max_iterations: int = 8
    hydra_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentResult:
    """What a called agent gives back: its answer, or why it has none."""

    agent: str
    ok: bool
    answer: str = ""
    reason: str = ""
    steps: int = 0
    llm_calls: int = 0
    path: list[dict[str, Any]] = field(default_factory=list)

    def output(self) -> str:
        return f"answer: {self.answer}" if self.ok else f"failed: {self.reason}"


Policy = Callable[[np.ndarray, Any], int]


def load_controller_policy(path: str, env: Any, agent: str) -> Policy:
    """The greedy policy of a DQN zip, by the rule it was trained with, over the feasible actions when the
    environment's observation ends with an action mask; the zip must take ``env``'s observations and actions.

    The rule comes from the zip itself: a controller trained by ``clova-train controller`` keeps its
    ``action_selection`` (and, for HYDRA's Eq. 2, ``num_samples``: N, the planner probabilities at the end of the
    observation) among the fields SB3 saves, so an agent runs it exactly as training evaluated it; a plain SB3 DQN
    zip has none and is run by ``argmax_q``, as SB3 runs it. An Eq. 2 controller needs an environment whose
    observation ends with the same N probabilities (the agent's ``hydra_env`` must be the one it was trained in).
    """
    from stable_baselines3 import DQN

    from clova_train.core.errors import UnsafeFileError
    from clova_train.sb3.files import zip_custom_objects

    if not Path(path).is_file():
        raise ClovaTrainError(f"agent {agent}: controller {path} does not exist")
    try:
        model = DQN.load(path, device="cpu", custom_objects=zip_custom_objects(path))  # SB3 unpickles nothing
    except UnsafeFileError as err:
        raise ClovaTrainError(f"agent {agent}: {err}") from None
    except Exception as err:  # noqa: BLE001 (any unreadable zip is one message)
        raise ClovaTrainError(f"agent {agent}: controller {path} cannot be loaded: {str(err)[:200]}") from None
    if model.observation_space.shape != env.observation_space.shape or model.action_space != env.action_space:
        raise ClovaTrainError(
            f"agent {agent}: controller {path} takes observations {model.observation_space.shape} and actions "
            f"{model.action_space}, its environment gives {env.observation_space.shape} and {env.action_space}: "
            "give the agent the graph, tools and settings the controller was trained with")
    rule = getattr(model, "action_selection", "argmax_q")  # DQN.load sets every saved field as an attribute
    num_samples = getattr(model, "num_samples", 0)
    if rule not in RULES:
        raise ClovaTrainError(f"agent {agent}: controller {path} was trained with the action selection {rule!r:.60}, "
                              f"not one of {', '.join(RULES)}")
    tail = env.config.observation_tail()
    if rule == "eq2" and (isinstance(num_samples, bool) or num_samples != tail.probabilities or not num_samples):
        raise ClovaTrainError(
            f"agent {agent}: controller {path} selects by HYDRA Eq. 2 over {num_samples!r:.20} planner probabilities "
            f"at the end of the observation; its environment's observation ends with {tail.probabilities or 'none'}: "
            "give the agent the hydra_env the controller was trained with")
    mask_size = int(env.action_space.n) if tail.mask else 0

    def act(obs: np.ndarray, env: Any) -> int:
        import torch

        tensor = model.policy.obs_to_tensor(obs)[0]
        with torch.no_grad():
            q_values = model.q_net(tensor)
        return int(select_actions(q_values, tensor, rule, num_samples, mask_size)[0])

    return act


def planner_policy(obs: np.ndarray, env: Any) -> int:
    """The LLM planner's own next action (AVIS without a learned controller)."""
    return env.suggested_index()


def scripted_policy(path: list[str]) -> Policy:
    def act(obs: np.ndarray, env: Any) -> int:
        mask = env.action_masks()
        for action in path:
            if action in env.graph.actions and mask[env.graph.index(action)] and action not in env.informative:
                return env.graph.index(action)
        return int(np.flatnonzero(mask)[0])

    return act


def as_specs(agents: list[Any]) -> list[AgentSpec]:
    """Agents given as plain dicts (YAML, ``gymnasium.make`` kwargs) made :class:`AgentSpec`s."""
    return [a if isinstance(a, AgentSpec) else AgentSpec(**a) for a in agents]


def spec_problems(specs: list[AgentSpec], prefix: str) -> list[str]:
    """What is wrong with the agents as written, before any is built: a name used twice."""
    names = [agent.name for agent in specs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    return [f"{prefix}: the name {duplicated[0]!r} is used twice"] if duplicated else []


def policy_problems(specs: list[AgentSpec], prefix: str) -> list[str]:
    """What is wrong with the agents' policies: a missing controller zip, a scripted policy without its path or
    on a ``hydra`` agent."""
    problems = []
    for agent in specs:
        where = f"{prefix}[{agent.name}]"
        if agent.policy == "controller" and not Path(agent.controller).is_file():
            problems.append(f"{where}.controller = {agent.controller!r}: no such file")
        if agent.environment == "hydra" and agent.policy == "scripted":
            problems.append(f"{where}.policy = 'scripted': a hydra agent takes planner or controller")
        if agent.policy == "scripted" and not agent.path:
            problems.append(f"{where}.path: a scripted agent needs its tool path")
    return problems


SeekingEnvFactory = Callable[[AgentSpec, "AgentTools"], Any]


class AgentTools:
    """Calls registered agents for an environment at nesting depth ``depth`` (see the module docstring).

    Args:
        specs: every registered agent.
        chat: the caller's (budgeted, possibly cached) chat backend, shared with the callees.
        embedder: the caller's embedding backend, shared with the callees.
        depth: the caller's depth.
        hydra_chat: the chat stack of ``hydra`` agents (their planner/coder protocol), under the same budget
            (default: ``chat``).
        seeking_env: builds an ``avis`` agent's environment from its spec and these tools (one level deeper,
            sharing their chat, embedder and budget).
        world: the information-seeking world the agents' questions belong to.
        web: the caller's web search tools (``avis`` agents share them; none: the offline knowledge base).
        episodes: the caller's task files and model-backed tools (a
            :class:`~clova_train.envs.avis.task_episodes.TaskFileEpisodes`; agents look at the caller's benchmark
            image through them); none: the offline world.
    """

    def __init__(self, specs: list[AgentSpec], chat: BudgetedChat, embedder: EmbeddingBackend, depth: int,
                 hydra_chat: BudgetedChat | None = None, *, seeking_env: SeekingEnvFactory,
                 world: SeekingWorld = DEFAULT_WORLD, web: Any = None, episodes: Any = None) -> None:
        for spec in specs:
            if not AGENT_NAME.fullmatch(str(spec.name)):
                raise ValueError(f"agent name {spec.name!r}: use letters, digits, '_' and '-' only")
        self.specs = {spec.name: spec for spec in specs}
        self.chat, self.embedder, self.depth = chat, embedder, depth
        self.hydra_chat = hydra_chat or chat
        self.seeking_env = seeking_env
        self.world = world
        self.web = web
        self.episodes = episodes
        self._envs: dict[str, Any] = {}
        self._policies: dict[str, Policy] = {}

    def resolve(self, name: str) -> tuple[Any, Policy]:
        """Agent ``name``'s environment and policy, built on first use and kept."""
        if name not in self._envs:
            spec = self.specs[name]
            self._envs[name], self._policies[name] = self._hydra(spec) if spec.environment == "hydra" \
                else self._avis(spec)
        return self._envs[name], self._policies[name]

    def _avis(self, spec: AgentSpec) -> tuple[Any, Policy]:
        env = self.seeking_env(spec, self)
        if spec.policy == "controller":
            return env, load_controller_policy(spec.controller, env, spec.name)
        return env, planner_policy if spec.policy == "planner" else scripted_policy(spec.path)

    def _hydra(self, spec: AgentSpec) -> tuple[ReasoningLoopEnv, Policy]:
        config = ReasoningLoopConfig(**{**spec.hydra_env, "max_iterations": spec.max_iterations, "cache_path": None})
        tools_factory = self.episodes.hydra_tools if self.episodes is not None else None
        env = ReasoningLoopEnv(config, llm=self.hydra_chat, tools_factory=tools_factory)
        if spec.policy == "controller":
            return env, load_controller_policy(spec.controller, env, spec.name)
        return env, lambda obs, env: int(np.argmax(env.planner_probabilities()))

    def prepare_all(self) -> None:
        """Build every agent's environment and policy now (a config check: graphs, tools, controller zips)."""
        for name in self.specs:
            self.resolve(name)

    def call(self, name: str, question: str, task: Task | BenchmarkTask) -> AgentResult:
        """Run agent ``name`` on ``question`` about the image of ``task`` (the caller's); a failure is a result, not an
        exception."""
        budget = self.chat.budget
        depth = self.depth + 1
        record: dict[str, Any] = {"agent": name, "depth": depth}
        budget.calls.append(record)
        if name not in self.specs:
            result = AgentResult(name, False, reason=f"no agent named {name!r}")
        elif depth > budget.max_depth:
            result = AgentResult(name, False, reason=f"stopped: depth limit {budget.max_depth} reached")
        else:
            budget.deepest = max(budget.deepest, depth)
            result = self._run(name, question, task)
        record.update(ok=result.ok, answer=result.answer, reason=result.reason, steps=result.steps,
                      llm_calls=result.llm_calls, path=result.path)
        return result

    def _run(self, name: str, question: str, task: Task | BenchmarkTask) -> AgentResult:
        budget = self.chat.budget
        before = budget.llm_calls
        try:
            env, policy = self.resolve(name)
            asked = sub_task(task, question, lambda task_id, text: make_seeking_task(task_id, text, world=self.world))
            obs, _ = env.reset(options={"task": asked, "nested": True})
            done, info, steps, trace = False, {}, 0, []
            while not done:
                obs, _, terminated, truncated, info = env.step(policy(obs, env))
                done, steps = terminated or truncated, steps + 1
                if "status" in info:  # a hydra agent's step: what ran in the sandbox and how it ended
                    trace.append({"instruction": info["instruction"], "status": info["status"], "error": info["error"]})
            info.setdefault("path", trace)
        except BudgetSpent as err:
            return AgentResult(name, False, reason=f"stopped: {err}", llm_calls=budget.llm_calls - before)
        except ReplayMiss:
            raise  # the run is not the recorded one: a configuration error, not the callee's failure
        except (ClovaTrainError, ValueError) as err:
            return AgentResult(name, False, reason=f"error: {str(err)[:200]}", llm_calls=budget.llm_calls - before)
        used = budget.llm_calls - before
        if info.get("stopped"):
            return AgentResult(name, False, reason=f"stopped: {info['stopped']}", steps=steps, llm_calls=used,
                               path=info.get("path", []))
        if info.get("answer") is None:
            return AgentResult(name, False, reason="no answer within its steps", steps=steps, llm_calls=used,
                               path=info.get("path", []))
        return AgentResult(name, True, answer=info["answer"], steps=steps, llm_calls=used, path=info.get("path", []))

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
