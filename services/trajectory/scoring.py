"""Scores of executions and GRPO-style group advantages.

A scorer turns what is known about an execution (how it ended, its final reward, its last
progress signals) into a ``Score``: a reward in the run's range and whether it is *partial*
(estimated from progress because the execution did not finish). Scorers are pluggable: the
config names one by dotted path (``package.module:ClassName``) or a built-in name.

Guarantees
- A NaN, infinite or out-of-range reward or progress value raises ``gyre.errors.InvalidArgument``
  naming the execution, the field and the allowed range; nothing is scored from it.
- Group statistics count every execution, so merging k exact duplicates into one path with
  multiplicity k leaves the group mean and standard deviation unchanged.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from gyre.errors import ConfigError, InvalidArgument


class Ending(StrEnum):
    """How an execution ended, as far as the trajectory service knows."""

    RUNNING = "running"  # no end event yet (scored only when train_unfinished_after_s allows it)
    FINISHED = "finished"
    TRUNCATED = "truncated"
    FAILED = "failed"


@dataclass(slots=True)
class ProgressSignals:
    """An execution's progress as the trajectory service stores it (from a StepEvent or ExecutionEvent).

    Named apart from the rollout's ``environments.base.Progress``, which an environment reports.
    """

    milestones_reached: int = 0
    milestones_total: int = 0
    tests_passed_fraction: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """What a scorer sees of one execution."""

    execution_id: str
    ending: Ending
    reward: float | None
    progress: ProgressSignals


@dataclass(slots=True)
class Score:
    reward: float
    partial: bool
    source: str  # "final", "tests", "milestones", "none"


class Scorer(Protocol):
    def score(self, outcome: Outcome) -> Score: ...


def check_value(value: float, *, what: str, execution_id: str, lo: float, hi: float) -> float:
    """Return ``value`` if finite and in [lo, hi]; else raise InvalidArgument with a clear message."""
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise InvalidArgument(
            f"execution {execution_id!r}: {what} is {v!r}; it must be a finite number in [{lo}, {hi}] "
            "(fix the environment's reward function; the event was rejected, nothing else was changed)"
        )
    if not lo <= v <= hi:
        raise InvalidArgument(
            f"execution {execution_id!r}: {what} = {v} is outside the allowed range [{lo}, {hi}] "
            "(set trajectory.reward_min / reward_max if the run's rewards use another range)"
        )
    return v


def validate_progress(progress: ProgressSignals, execution_id: str) -> None:
    """Reject progress signals that cannot be scored (NaN, fraction outside [0, 1], reached > total)."""
    if progress.tests_passed_fraction is not None:
        check_value(
            progress.tests_passed_fraction,
            what="tests_passed_fraction",
            execution_id=execution_id,
            lo=0,
            hi=1,
        )
    if progress.milestones_total < 0 or not 0 <= progress.milestones_reached <= max(
        progress.milestones_total, 0
    ):
        if progress.milestones_total or progress.milestones_reached:
            raise InvalidArgument(
                f"execution {execution_id!r}: milestones_reached={progress.milestones_reached} must lie in "
                f"[0, milestones_total={progress.milestones_total}]"
            )
    for name, value in progress.extra.items():
        if math.isnan(value) or math.isinf(value):
            raise InvalidArgument(
                f"execution {execution_id!r}: progress.extra[{name!r}] is {value!r}; it must be finite"
            )


class ProgressScorer:
    """Final reward when finished; otherwise partial progress scaled into the reward range.

    Partial reward = reward_min + partial_scale * fraction * (reward_max - reward_min), where
    fraction is ``tests_passed_fraction`` when the environment has tests, else
    ``milestones_reached / milestones_total``, else 0 (source "none").
    """

    def __init__(self, reward_min: float = 0.0, reward_max: float = 1.0, partial_scale: float = 1.0) -> None:
        if not reward_min < reward_max:
            raise ConfigError(f"reward_min ({reward_min}) must be smaller than reward_max ({reward_max})")
        self.lo, self.hi, self.partial_scale = reward_min, reward_max, partial_scale

    def score(self, outcome: Outcome) -> Score:
        validate_progress(outcome.progress, outcome.execution_id)
        if outcome.ending is Ending.FINISHED:
            if outcome.reward is None:
                raise InvalidArgument(f"execution {outcome.execution_id!r} FINISHED without a reward")
            r = check_value(
                outcome.reward, what="reward", execution_id=outcome.execution_id, lo=self.lo, hi=self.hi
            )
            return Score(r, False, "final")
        p = outcome.progress
        if p.tests_passed_fraction is not None:
            frac, source = p.tests_passed_fraction, "tests"
        elif p.milestones_total > 0:
            frac, source = p.milestones_reached / p.milestones_total, "milestones"
        else:
            frac, source = 0.0, "none"
        return Score(self.lo + self.partial_scale * frac * (self.hi - self.lo), True, source)


def load_scorer(name: str, reward_min: float, reward_max: float, partial_scale: float) -> Scorer:
    """Built-in "progress", or "package.module:Class" constructed with the same keyword arguments."""
    if name == "progress":
        return ProgressScorer(reward_min, reward_max, partial_scale)
    if ":" not in name:
        raise ConfigError(f"scorer {name!r}: use 'progress' or a dotted path 'package.module:ClassName'")
    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    scorer: Scorer = cls(reward_min=reward_min, reward_max=reward_max, partial_scale=partial_scale)
    return scorer


@dataclass(slots=True)
class GroupStats:
    mean: float
    std: float
    advantages: list[float]  # one per member, in input order


ZERO_VARIANCE_SPREAD = 1e-9  # rewards closer than this are the same reward


def group_advantages(
    rewards: Sequence[float], *, normalise_std: bool = True, eps: float = 1e-6
) -> GroupStats:
    """GRPO advantages: (r - mean) / (std + eps) over *every* member (duplicates included).

    Pass one reward per execution (not per deduplicated path), so multiplicity is counted; the
    advantage of a merged path is then the mean of its members' advantages. A group whose rewards
    all agree (zero variance: every member scored alike) gets advantages of exactly 0, not float
    noise amplified by 1/eps: it carries no learning signal (the run report counts such groups;
    many of them while the reward is below the oracle's is a stall).
    """
    n = len(rewards)
    if n == 0:
        return GroupStats(0.0, 0.0, [])
    mean = sum(rewards) / n
    if max(rewards) - min(rewards) <= ZERO_VARIANCE_SPREAD:
        return GroupStats(mean, 0.0, [0.0] * n)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    scale = (std + eps) if normalise_std else 1.0
    return GroupStats(mean, std, [(r - mean) / scale for r in rewards])


def node_values(paths: dict[str, list[int]], rewards: dict[str, float]) -> dict[int, float]:
    """Value of each node = mean reward of the executions whose paths pass through it."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for eid, nodes in paths.items():
        for nid in nodes:
            sums[nid] = sums.get(nid, 0.0) + rewards[eid]
            counts[nid] = counts.get(nid, 0) + 1
    return {nid: sums[nid] / counts[nid] for nid in sums}
