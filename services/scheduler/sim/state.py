"""The simulator's vocabulary: its events, the state of a unit and of an execution, and the result.

Units and executions are mutable records owned by one `Simulation` (engine.py); events are frozen and
carry a `token` where a later change of plan can make them stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.scheduler.policies import PoolSnapshot, Role
from services.scheduler.sim.sample import ExecutionPlan

SWITCHING = "switching"


# --- events (typed; the loop dispatches on the class) --------------------------------------------------
@dataclass(frozen=True)
class GenDone:
    """Execution `eid` finished decoding its turn (stale when `token` no longer matches)."""

    eid: int
    token: int


@dataclass(frozen=True)
class EnvDone:
    """The environment answered execution `eid` (stale when `token` no longer matches)."""

    eid: int
    token: int


@dataclass(frozen=True)
class CopyDone:
    """One KV copy out of draining unit `uid` finished."""

    uid: int


@dataclass(frozen=True)
class Switched:
    """Unit `uid` finished its role change (stale when `token` no longer matches)."""

    uid: int
    token: int


@dataclass(frozen=True)
class RoundDone:
    """The trainer finished one micro-batch round (stale when `token` no longer matches)."""

    token: int


@dataclass(frozen=True)
class GroupCutoff:
    """`train_unfinished_after_s` passed since the first execution of group (step, task) ended."""

    step: int
    task: int


@dataclass(frozen=True)
class Place:
    """The router places queued executions, after every event of the same instant (so units that
    finish a role change together are all seen, not the first one alone)."""


@dataclass(frozen=True)
class PlanTick:
    """The plan loop runs: the policy is asked once for every change since the last run."""


Event = GenDone | EnvDone | CopyDone | Switched | RoundDone | GroupCutoff | Place | PlanTick


class Phase(StrEnum):
    """Where an execution is."""

    PENDING = "pending"  # admitted, never placed
    GEN = "gen"  # prefilling / decoding a turn on its unit
    ENV = "env"  # waiting on the environment, KV resident on its unit
    WAITING = "waiting"  # queued for a unit (preempted or parked), `resume_tokens` left of its turn
    DONE = "done"


@dataclass
class Unit:
    uid: int
    role: Role
    moving: bool = False
    target: Role | None = None
    residents: set[int] = field(default_factory=set)
    kv_reserved: float = 0.0
    decoding_ctx: float = 0.0
    num_generating: int = 0
    stall_until: float = 0.0
    token: int = 0
    pending_copies: int = 0
    leaving_trainer: bool = False  # asked to leave; goes at the trainer's next resize point
    device_id: str = ""

    def __post_init__(self) -> None:
        self.device_id = f"u{self.uid:03d}"


@dataclass
class Execution:
    eid: int
    step: int
    plan: ExecutionPlan
    turn: int = 0
    ctx: float = 0.0  # tokens in its KV (prompt + observations + generated so far)
    generated: float = 0.0  # generated tokens so far
    unit: int | None = None
    phase: Phase = Phase.PENDING
    token: int = 0
    start_version: int = -1
    reserved: float = 0.0  # KV bytes reserved on its unit
    gen_start: float = 0.0
    gen_rate_s: float = 0.0
    gen_tokens: float = 0.0
    resume_tokens: float = 0.0  # tokens of the current turn still to generate (WAITING in a turn)
    in_turn: bool = False  # WAITING with its current turn's prompt already prefilled
    ready_at: float = 0.0  # KV copy to its current unit done at this time
    cut: bool = False  # scored partially; what it generates from now on is not trained
    ended_at: float | None = None  # when its last turn ended


@dataclass
class SimResult:
    """Outcome of one simulated run. Times in virtual seconds; measured after the warm-up steps."""

    policy: str
    step_done_s: list[float]
    time_per_step_s: float
    device_utilization: float
    max_staleness: int
    rollout_share: float  # rollout span / (rollout span + training span) per batch, mean
    tail_share: float  # share of rollout time taken by the last 10% of executions (per step, mean)
    tokens_trained_per_step: float  # context tokens trained per step (equal work check)
    generated_trained_share: float  # share of generated tokens that got trained
    kv_peak_share: float  # highest reserved KV of any unit over its budget (never above 1)
    num_migrations: int
    num_role_changes: int
    num_parked: int  # executions offloaded to host (no unit had room)
    num_preemptions: int  # turns that did not fit their unit's KV budget
    timeline: list[tuple[int, float, float, str]]  # (unit, t0, t1, role label)
    utilization_series: list[tuple[float, float]]  # (t, busy share of devices)
    snapshots: list[tuple[PoolSnapshot, tuple[Any, ...]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def integrate(events: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Integral over [t0, t1] of the step function given by (time, value-from-then-on) events."""
    total = 0.0
    value = 0
    last = t0
    for t, v in events:
        if t > t1:
            break
        if t > t0:
            total += value * (t - last)
            last = t
        value = v
    total += value * (t1 - last)
    return total
