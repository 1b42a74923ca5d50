"""`longhorizon`: a procedurally generated long-horizon task family a tiny model can learn on a CPU.

Each task (seeded by its id) is a path of `horizon` cues. Every turn the environment shows the
current cue as ONE letter (`A` + cue); the agent's action is its FIRST generated token modulo
`num_actions`. The right action is a fixed function of the cue, the same for every task
(`(3 * cue + 1) mod num_actions`), so a policy can learn it from reward alone: a random policy is
right 1/num_actions of the time and RL can push that to 1. A right action advances the path, a
wrong one leaves the cue in place. The episode has a budget of `horizon` turns, so only a perfect
policy finishes (`done`, reward 1.0); otherwise it is `truncated` with partial progress.

Horizons are heavy-tailed (Pareto, clipped to [min_turns, max_turns]): most tasks take a few
turns, a few take hundreds. Milestones split the path evenly (`num_milestones`, at most one per
position); reward = fraction of milestones reached. `oracle_reward` (in every progress signal's `extra`) is
what a perfect policy gets on the task, by the same rules. Observations are 4 tokens per turn under the
byte chat template (`<user> X <eos> <assistant>`), so a CPU run stays fast.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from gyre.errors import InvalidArgument

from .base import Action, Environment, Progress, StepResult, TaskFamily

_TASK_RE = re.compile(r"^lh-(\d+)$")


@dataclass(frozen=True)
class LongHorizonSpec:
    """Parameters of the task family (all counts)."""

    num_actions: int = 4
    num_cues: int = 8
    min_turns: int = 3
    max_turns: int = 200
    pareto_alpha: float = 1.2
    num_milestones: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not (2 <= self.num_actions <= 256 and 1 <= self.num_cues <= 26):
            raise InvalidArgument("longhorizon: num_actions must be in [2, 256] and num_cues in [1, 26]")
        if not 1 <= self.min_turns <= self.max_turns:
            raise InvalidArgument("longhorizon: need 1 <= min_turns <= max_turns")


def correct_action(cue: int, num_actions: int) -> int:
    """The action that advances past `cue` (same rule for every task)."""
    return (3 * cue + 1) % num_actions


def parse_action(token_ids: list[int], num_actions: int) -> int | None:
    """The agent's action: its first generated token modulo num_actions (None if it generated nothing)."""
    return token_ids[0] % num_actions if token_ids else None


@dataclass(frozen=True)
class LongHorizonTask:
    task_id: str
    cues: tuple[int, ...]

    @property
    def horizon(self) -> int:
        return len(self.cues)


def generate_task(spec: LongHorizonSpec, index: int) -> LongHorizonTask:
    """Task number `index`: horizon from a clipped Pareto, cues uniform (deterministic in seed, index)."""
    rng = random.Random(f"longhorizon/{spec.seed}/{index}")
    horizon = int(
        min(spec.max_turns, max(spec.min_turns, spec.min_turns * rng.paretovariate(spec.pareto_alpha)))
    )
    cues = tuple(rng.randrange(spec.num_cues) for _ in range(horizon))
    return LongHorizonTask(task_id=f"lh-{index:05d}", cues=cues)


FINISHED_REWARD = 1.0


def transition(
    task: LongHorizonTask, position: int, turns: int, chosen: int | None, num_actions: int
) -> tuple[int, int]:
    """The rule of one turn: (position, turns) after the agent chose `chosen` at `position`."""
    if chosen == correct_action(task.cues[position], num_actions):
        position += 1
    return position, turns + 1


def is_over(task: LongHorizonTask, position: int, turns: int) -> tuple[bool, bool]:
    """(done, truncated): done when the path is finished, truncated when the turn budget is spent."""
    done = position >= task.horizon
    return done, not done and turns >= task.horizon


def oracle_reward(spec: LongHorizonSpec, task: LongHorizonTask) -> float:
    """The reward a perfect policy gets on `task`: it plays `correct_action` at every cue under the
    same rules (`transition`, `is_over`) as an agent. Reported as `progress.extra["oracle_reward"]`,
    so a run shows how far its policy is from the optimum (1.0 on every task of this family)."""
    position, turns = 0, 0
    while True:
        done, truncated = is_over(task, position, turns)
        if done:
            return FINISHED_REWARD
        if truncated:
            return (position * min(spec.num_milestones, task.horizon) // task.horizon) / min(
                spec.num_milestones, task.horizon
            )
        action = correct_action(task.cues[position], spec.num_actions)
        position, turns = transition(task, position, turns, action, spec.num_actions)


class LongHorizonEnv(Environment):
    name = "longhorizon"
    resumable = True  # a pure function of the task and the actions: resumes by action replay

    def __init__(self, spec: LongHorizonSpec, task: LongHorizonTask) -> None:
        self.spec, self.task, self.task_id = spec, task, task.task_id
        self.position = 0
        self.turns = 0
        self.num_milestones = min(spec.num_milestones, task.horizon)
        self.oracle_reward = oracle_reward(spec, task)

    def _cue_message(self) -> dict[str, Any]:
        return {"role": "user", "content": chr(ord("A") + self.task.cues[self.position])}

    async def reset(self) -> list[dict[str, Any]]:
        self.position, self.turns = 0, 0
        return [self._cue_message()]

    @property
    def progress(self) -> Progress:
        reached = self.position * self.num_milestones // self.task.horizon
        return Progress(
            milestones_reached=reached,
            milestones_total=self.num_milestones,
            extra={
                "position": float(self.position),
                "horizon": float(self.task.horizon),
                "turns": float(self.turns),
                "oracle_reward": self.oracle_reward,
            },
        )

    async def step(self, action: Action) -> StepResult:
        chosen = parse_action(action.token_ids, self.spec.num_actions)
        self.position, self.turns = transition(
            self.task, self.position, self.turns, chosen, self.spec.num_actions
        )
        progress = self.progress
        done, truncated = is_over(self.task, self.position, self.turns)
        if done:
            return StepResult([], progress, done=True, reward=FINISHED_REWARD)
        if truncated:
            return StepResult([], progress, truncated=True)
        return StepResult([self._cue_message()], progress)


class LongHorizonFamily(TaskFamily):
    name = "longhorizon"

    def __init__(self, spec: LongHorizonSpec | None = None) -> None:
        self.spec = spec or LongHorizonSpec()

    def task_ids(self, num_tasks: int) -> list[str]:
        return [f"lh-{i:05d}" for i in range(num_tasks)]

    def task(self, task_id: str) -> LongHorizonTask:
        m = _TASK_RE.match(task_id)
        if not m:
            raise InvalidArgument(f"longhorizon task ids look like 'lh-00042', got {task_id!r}")
        return generate_task(self.spec, int(m.group(1)))

    def make(self, task_id: str) -> LongHorizonEnv:
        return LongHorizonEnv(self.spec, self.task(task_id))
