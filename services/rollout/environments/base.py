"""The one interface every environment implements, and the values it exchanges with the agent.

An environment is one task instance for one execution. The agent loop calls `reset()` once, then
`step(action)` until a result is `done` (the task says it is over: reward final) or `truncated`
(a turn/time budget ran out: scored from progress). `progress` is valid at any time, so an
unfinished execution still carries signal.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gyre.tokenizer import AssistantTurn, parse_assistant
from gyre.tokenizers import Tokenizer
from gyre.v1 import common_pb2


@dataclass
class Progress:
    """Partial-progress signals (mirrors gyre.v1.ProgressSignal)."""

    milestones_reached: int = 0
    milestones_total: int = 0
    tests_passed_fraction: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def to_proto(self) -> common_pb2.ProgressSignal:
        msg = common_pb2.ProgressSignal(
            milestones_reached=self.milestones_reached,
            milestones_total=self.milestones_total,
            extra=self.extra,
        )
        if self.tests_passed_fraction is not None:
            msg.tests_passed_fraction = self.tests_passed_fraction
        return msg

    def score(self) -> float:
        """Partial score in [0, 1]: tests fraction if there are tests, else milestone fraction."""
        if self.tests_passed_fraction is not None:
            return self.tests_passed_fraction
        return self.milestones_reached / self.milestones_total if self.milestones_total else 0.0


@dataclass
class Action:
    """What the model produced in one call: the raw completion ids and their parsed form."""

    token_ids: list[int]
    turn: AssistantTurn

    @classmethod
    def from_ids(cls, ids: Sequence[int], tokenizer: Tokenizer | None = None) -> Action:
        """The action of completion `ids`, parsed by the run's tokenizer (default: the byte one)."""
        turn = tokenizer.parse_assistant(ids) if tokenizer is not None else parse_assistant(ids)
        return cls(token_ids=list(ids), turn=turn)


@dataclass
class StepResult:
    """The environment's answer to one action.

    `messages` are appended to the agent's conversation (OpenAI-style dicts, role user or tool).
    `reward` is set when `done` (final); otherwise the caller scores from `progress`.
    """

    messages: list[dict[str, Any]]
    progress: Progress
    done: bool = False
    truncated: bool = False
    reward: float | None = None


class Environment(abc.ABC):
    """One task instance. Methods are async so slow tools (sandboxed commands) never block the loop."""

    name: ClassVar[str]
    task_id: str
    # True: a fresh instance given the same task and the same actions (through `replay`) answers
    # them exactly as the first instance did, so a restarted rollout can resume the execution by
    # replaying its stored actions (services/rollout/resume.py). False: it is ended instead.
    resumable: ClassVar[bool] = False

    @abc.abstractmethod
    async def reset(self) -> list[dict[str, Any]]:
        """Start the task; return the opening messages (system/user) of the conversation."""

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Apply one action; never raises for a bad action (that is an observation), only for crashes."""

    async def replay(self, action: Action) -> StepResult:
        """Apply an action the execution already took before a restart (resume by replay). Default:
        `step`. An environment overrides it to skip what only mattered the first time (modelled
        tool latency); the result must be the one `step` gave then."""
        return await self.step(action)

    @property
    @abc.abstractmethod
    def progress(self) -> Progress:
        """Progress so far (valid before, during and after the episode)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (temp directories, processes). Idempotent."""


class TaskFamily(abc.ABC):
    """A source of tasks: stable task ids and a factory of fresh environments per execution."""

    name: ClassVar[str]

    @abc.abstractmethod
    def task_ids(self, num_tasks: int) -> list[str]:
        """The first `num_tasks` task ids (canonical: letters, digits, '-', '_')."""

    @abc.abstractmethod
    def make(self, task_id: str) -> Environment:
        """A fresh environment for one execution of `task_id`."""

    def group_number(self, task_id: str, task_group: int, ordinal: int) -> int:
        """The number n in a new group's id `<task>-g<n>`: by default `task_group`, the task's own
        count of groups started by this rollout process (from 0). A family whose environments take
        something from the id may use `ordinal` instead: the group's place among all the groups this
        process started (from 0, in admission order). Unique per task within a process either way."""
        del task_id, ordinal
        return task_group
