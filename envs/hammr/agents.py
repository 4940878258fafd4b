"""HAMMR's agents as tools: an agent (an environment configuration plus a policy) that other agents call.

* :class:`AgentSpec`: what a config file says of an agent: name, description (what the dispatcher's LLM reads),
  its transition graph and in-context examples, its policy (``planner``: the LLM's own choices, the prompted
  agent of HAMMR; ``scripted``: a fixed tool path; ``controller``: an exported SB3 DQN zip of this package).
* :class:`CallBudget`: the depth limit and the LLM-call budget of one top-level episode, shared by every
  nested call; :class:`BudgetedChat` charges each LLM call to it (the cache sits below it, so a cache hit
  still counts as a call the agent made).
* :class:`AgentTools`: runs a named agent on a (sub-)question about the caller's scene, one level deeper. An
  ``avis`` agent is an :class:`~clova_train.envs.avis.information_seeking.InformationSeekingEnv` (tools called by
  name); a ``hydra`` agent is a :class:`~clova_train.envs.hydra.reasoning_loop.ReasoningLoopEnv` whose LLM-written
  programs run in the sandbox, exactly as at top level. Both share the caller's LLM call cache and budget.
  Past the depth limit or the budget the call is stopped and reported; any failure of the callee (no
  answer, truncated, stopped, an error) comes back as a failure the caller observes, never an exception.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from clova_train.agents.backends import ChatBackend, Message
from clova_train.core.errors import ClovaTrainError

if TYPE_CHECKING:
    from clova_train.envs.avis.information_seeking import InformationSeekingEnv

AGENT_PREFIX = "agent:"
AGENT_NAME = re.compile(r"[A-Za-z0-9_-]+")


class BudgetSpent(ClovaTrainError):
    """The LLM-call budget of the episode is spent (raised inside a step, turned into a reported stop)."""


@dataclass
class CallBudget:
    """Limits shared by an episode and every agent call nested in it.

    Args:
        max_depth: deepest nesting of agent calls (the top-level agent is depth 0).
        max_llm_calls: LLM calls for the whole episode, nested calls included.
    """

    max_depth: int = 2
    max_llm_calls: int = 200
    llm_calls: int = 0
    deepest: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def spent(self) -> bool:
        return self.llm_calls >= self.max_llm_calls

    @property
    def spent_message(self) -> str:
        return f"the budget of {self.max_llm_calls} LLM calls is spent"

    def charge(self) -> None:
        if self.spent:
            raise BudgetSpent(self.spent_message)
        self.llm_calls += 1


class BudgetedChat(ChatBackend):
    """A chat backend that charges every call to the current :class:`CallBudget` before making it.

    Args:
        backend: the backend (possibly behind the call cache).
        shares_budget_of: another ``BudgetedChat`` whose budget this one charges (a ``hydra`` agent's planner
            and coder, which speak another prompt protocol, under the same episode budget).
    """

    def __init__(self, backend: ChatBackend, shares_budget_of: BudgetedChat | None = None) -> None:
        self.backend = backend
        self.owner = shares_budget_of
        self._budget = CallBudget()

    @property
    def budget(self) -> CallBudget:
        return self.owner.budget if self.owner is not None else self._budget

    @budget.setter
    def budget(self, value: CallBudget) -> None:
        if self.owner is not None:
            self.owner.budget = value
        else:
            self._budget = value

    def identity(self) -> dict[str, Any]:
        return self.backend.identity()

    def chat(self, messages: list[Message]) -> str:
        self.budget.charge()
        return self.backend.chat(messages)


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
            ``controller`` (a DQN zip exported by ``clova-train controller`` for the same environment).
        path: ``scripted``: the tools to use, in order.
        controller: ``controller``: the ``.zip`` file.
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


Policy = Callable[[np.ndarray, "InformationSeekingEnv"], int]


def masked_greedy(q_values: np.ndarray, mask: np.ndarray) -> int:
    return int(np.argmax(np.where(mask > 0.5, q_values, -np.inf)))


def load_controller_policy(path: str, env: Any, agent: str) -> Policy:
    """The greedy policy of a DQN zip, over the feasible actions when the environment has a mask; the zip must
    take ``env``'s observations and actions."""
    from stable_baselines3 import DQN

    from clova_train.agents.sb3_files import zip_custom_objects
    from clova_train.core.errors import UnsafeFileError

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

    def act(obs: np.ndarray, env: Any) -> int:
        q = model.q_net(model.policy.obs_to_tensor(obs)[0]).detach().cpu().numpy()[0]
        mask = env.action_masks() if hasattr(env, "action_masks") else np.ones(len(q), dtype=bool)
        return masked_greedy(q, mask.astype(np.float32))

    return act


def planner_policy(obs: np.ndarray, env: InformationSeekingEnv) -> int:
    """The LLM planner's own next action (AVIS without a learned controller)."""
    return env.suggested_index()


def scripted_policy(path: list[str]) -> Policy:
    def act(obs: np.ndarray, env: InformationSeekingEnv) -> int:
        mask = env.action_masks()
        for action in path:
            if action in env.graph.actions and mask[env.graph.index(action)] and action not in env.informative:
                return env.graph.index(action)
        return int(np.flatnonzero(mask)[0])

    return act


class AgentTools:
    """Calls registered agents for an environment at nesting depth ``depth`` (see the module docstring).

    Args:
        specs: every registered agent.
        chat: the caller's (budgeted, possibly cached) chat backend, shared with the callees.
        embedder: the caller's embedding backend, shared with the callees.
        depth: the caller's depth.
    """

    def __init__(self, specs: list[AgentSpec], chat: BudgetedChat, embedder: Any, depth: int,
                 hydra_chat: BudgetedChat | None = None) -> None:
        for spec in specs:
            if not AGENT_NAME.fullmatch(str(spec.name)):
                raise ValueError(f"agent name {spec.name!r}: use letters, digits, '_' and '-' only")
        self.specs = {spec.name: spec for spec in specs}
        self.chat, self.embedder, self.depth = chat, embedder, depth
        self.hydra_chat = hydra_chat or chat
        self._envs: dict[str, InformationSeekingEnv] = {}
        self._policies: dict[str, Policy] = {}

    def _env(self, name: str) -> tuple[Any, Policy]:
        """The agent's environment and policy, built on first use and kept."""
        if name not in self._envs:
            spec = self.specs[name]
            self._envs[name], self._policies[name] = self._hydra(spec) if spec.environment == "hydra" \
                else self._avis(spec)
        return self._envs[name], self._policies[name]

    def _avis(self, spec: AgentSpec) -> tuple[InformationSeekingEnv, Policy]:
        from clova_train.envs.avis.information_seeking import InformationSeekingConfig, InformationSeekingEnv

        config = InformationSeekingConfig(graph=spec.graph, tools=list(spec.tools), examples=list(spec.examples),
                                          max_iterations=spec.max_iterations, agents=list(self.specs.values()))
        env = InformationSeekingEnv(config, llm=self.chat, embedder=self.embedder, depth=self.depth + 1,
                                    hydra_chat=self.hydra_chat)
        if spec.policy == "controller":
            return env, load_controller_policy(spec.controller, env, spec.name)
        return env, planner_policy if spec.policy == "planner" else scripted_policy(spec.path)

    def _hydra(self, spec: AgentSpec) -> tuple[Any, Policy]:
        from clova_train.envs.hydra.reasoning_loop import ReasoningLoopConfig, ReasoningLoopEnv

        config = ReasoningLoopConfig(**{**spec.hydra_env, "max_iterations": spec.max_iterations, "cache_path": None})
        env = ReasoningLoopEnv(config, llm=self.hydra_chat)
        if spec.policy == "controller":
            return env, load_controller_policy(spec.controller, env, spec.name)
        return env, lambda obs, env: int(np.argmax(env.planner_probabilities()))

    def prepare_all(self) -> None:
        """Build every agent's environment and policy now (a config check: graphs, tools, controller zips)."""
        for name in self.specs:
            self._env(name)

    def call(self, name: str, question: str, task_id: int) -> AgentResult:
        """Run agent ``name`` on ``question`` about scene ``task_id``; a failure is a result, not an exception."""
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
            result = self._run(name, question, task_id)
        record.update(ok=result.ok, answer=result.answer, reason=result.reason, steps=result.steps,
                      llm_calls=result.llm_calls, path=result.path)
        return result

    def _run(self, name: str, question: str, task_id: int) -> AgentResult:
        budget = self.chat.budget
        before = budget.llm_calls
        try:
            from clova_train.envs.avis.world import make_seeking_task

            env, policy = self._env(name)
            obs, _ = env.reset(options={"task": make_seeking_task(task_id, question), "nested": True})
            done, info, steps, trace = False, {}, 0, []
            while not done:
                obs, _, terminated, truncated, info = env.step(policy(obs, env))
                done, steps = terminated or truncated, steps + 1
                if "status" in info:  # a hydra agent's step: what ran in the sandbox and how it ended
                    trace.append({"instruction": info["instruction"], "status": info["status"], "error": info["error"]})
            info.setdefault("path", trace)
        except BudgetSpent as err:
            return AgentResult(name, False, reason=f"stopped: {err}", llm_calls=budget.llm_calls - before)
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
