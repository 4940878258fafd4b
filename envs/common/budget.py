"""The limits of one top-level episode that every nested agent call shares: depth and LLM calls.

:class:`CallBudget` holds them; :class:`BudgetedChat` charges each LLM call to it before making it (the call
cache sits below it, so a cache hit still counts as a call the agent made); a spent budget raises
:class:`BudgetSpent` inside a step, which the environment reports as a stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clova_train.core.errors import ClovaTrainError
from clova_train.llm.backends import ChatBackend, Message


class BudgetSpent(ClovaTrainError):
    """The LLM-call budget of the episode is spent (raised inside a step, turned into a reported stop)."""


@dataclass
class CallBudget:
    """Limits shared by an episode and every agent call nested in it.

    Args:
        max_depth: deepest nesting of agent calls (the top-level agent is depth 0).
        max_llm_calls: LLM calls for the whole episode, nested calls included.
        llm_calls: LLM calls made so far.
        deepest: the deepest nesting reached so far.
        calls: one record per agent call (agent, depth, and how it ended).
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
