"""Starts and counts executions: a group of `group_size` executions per task, each an agent run.

Admission (continuous mode): with `groups_per_version` = G > 0 and staleness bound S, the manager
has started at most G * (latest_version + 1 + S) groups in total, counting the groups started at
boot. A group that wants to start beyond that waits until the trainer publishes a newer version.
This is what bounds rollout to the data the trainer can take within the staleness bound
(AReaL-style), instead of flooding the pipeline with executions nobody will train on.
A group the trajectory service will never train (nothing generated, unscorable, or stale before it
was packed: a GroupDroppedEvent) gives its slot back (`on_group_dropped`): the bound counts groups
that can still reach the trainer. Without that, every such group shrank the pipeline's slack of
G * S groups for good, and once it was spent the trainer waited for a batch the rollout would not
generate while the rollout waited for a version that needed that batch (the stall of
`gyre chaos` after a Postgres restart delayed ingest past the partial-scoring cut-off).

Group ids are `<task>-g<n>`, n the task's own count of groups unless the family numbers groups in
admission order (`TaskFamily.group_number`; the `workload` environment does, so that its groups
follow the simulator's steps in the order they are admitted).
Restarts: group ids are `<task>-g<n>` in the first process of a run and `<task>-r<k>g<n>` in its
k-th restart (`incarnation`, from GYRE_INCARNATION, which the supervisor sets), so a restarted
process never reuses the id of a group its predecessor started. What the predecessor left running
is resumed (`resume`, services/rollout/resume.py): the same execution ids continue from their stored
calls, and the boot start skips every task that has a resumed group (its next group starts when that
one ends, as it would have). An execution that cannot resume (an environment that is not
`resumable`, the external harness) is ended FAILED with the reason, scored as unfinished from its
progress, and its task runs again in a new group.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass
from typing import Any, Protocol

from gyre.pipeline_rules import groups_allowed
from gyre.v1 import events_pb2

from .agent import Agent, ExecutionOutcome, ExecutionSpec
from .environments.base import Environment, TaskFamily
from .resume import ResumePlan, end_unresumable, resumed_event
from .steps import StepSink


class ExecutionRunner(Protocol):
    """Runs one execution to its end: the built-in `Agent` or the external harness (harness.py)."""

    async def run(self, spec: ExecutionSpec, env: Environment) -> ExecutionOutcome: ...


@dataclass
class ExecutionCounters:
    started: int = 0
    completed: int = 0
    interrupted: int = 0  # FAILED: the agent or environment crashed (never a migration)
    migrations: int = 0
    resumed: int = 0  # executions a predecessor process left running, continued by this one


class ExecutionManager:
    def __init__(
        self,
        agent: Agent | ExecutionRunner,
        family: TaskFamily,
        *,
        run_id: str,
        seed: int,
        max_live: int,
        continuous: bool,
        groups_per_version: int = 0,
        staleness_bound: int = 0,
        incarnation: int | None = None,
    ) -> None:
        self.agent, self.family, self.run_id, self.seed = agent, family, run_id, seed
        # Starts of this rollout process before this one in the run (0: first; None: GYRE_INCARNATION).
        self.incarnation = (
            int(os.environ.get("GYRE_INCARNATION", "0")) if incarnation is None else incarnation
        )
        self.continuous = continuous
        self.counters = ExecutionCounters()
        self.live: dict[str, asyncio.Task[ExecutionOutcome]] = {}
        self._slots = asyncio.Semaphore(max_live)
        self._groups: dict[str, itertools.count[int]] = {}
        self._stopping = False
        self.groups_per_version = groups_per_version
        self.staleness_bound = max(0, staleness_bound)
        self.latest_version = 0
        self.groups_started = 0
        self.groups_refunded = 0  # groups of this process dropped untrained: their slots came back
        self._own_groups: set[str] = set()  # groups this process started, not yet refunded
        self._admission = asyncio.Condition()
        self._waiting: set[asyncio.Task[None]] = set()
        self.resumed_tasks: set[str] = set()  # tasks with a group resumed from a predecessor

    def groups_allowed(self) -> int | None:
        """Groups that may have been started in total at the current version; None: unbounded
        (gyre.pipeline_rules.groups_allowed, the rule the simulator admits batches by)."""
        return groups_allowed(self.groups_per_version, self.latest_version, self.staleness_bound)

    async def on_version(self, version: int) -> None:
        """A newer weight version is loaded: admit the groups it makes room for."""
        async with self._admission:
            self.latest_version = max(self.latest_version, version)
            self._admission.notify_all()

    async def on_group_dropped(self, group_id: str) -> bool:
        """The trajectory service will never train `group_id`: give its admission slot back, once,
        if this process started it (a predecessor's groups were never counted here). Returns
        whether a slot came back."""
        async with self._admission:
            if group_id not in self._own_groups:
                return False
            self._own_groups.discard(group_id)
            self.groups_refunded += 1
            self._admission.notify_all()
            return True

    def groups_in_flight(self) -> int:
        """Groups started by this process that may still reach the trainer (what admission counts)."""
        return self.groups_started - self.groups_refunded

    def admission_wait(self) -> str:
        """What admission waits for now, in words ("" when a group may start)."""
        allowed = self.groups_allowed()
        if allowed is None or self.groups_in_flight() < allowed:
            return ""
        return (
            f"admission: {self.groups_in_flight()} groups in flight (started {self.groups_started}, "
            f"refunded {self.groups_refunded}) of {allowed} allowed at version {self.latest_version}; "
            "waiting for a newer weight version"
        )

    async def _start_when_admitted(self, task_id: str, group_size: int) -> None:
        async with self._admission:
            await self._admission.wait_for(
                lambda: (
                    self._stopping
                    or (allowed := self.groups_allowed()) is None
                    or self.groups_in_flight() < allowed
                )
            )
            if not self._stopping:
                self.start_group(task_id, group_size)

    def start_group(self, task_id: str, group_size: int) -> list[str]:
        n = self.family.group_number(
            task_id, next(self._groups.setdefault(task_id, itertools.count())), self.groups_started
        )
        group_id = f"{task_id}-g{n}" if self.incarnation == 0 else f"{task_id}-r{self.incarnation}g{n}"
        self.groups_started += 1
        self._own_groups.add(group_id)
        ids = []
        for k in range(group_size):
            spec = ExecutionSpec(
                self.run_id, task_id, group_id, f"{group_id}-e{k}", self.family.name, seed=self.seed
            )
            self.live[spec.execution_id] = asyncio.create_task(
                self._run(spec, group_size), name=spec.execution_id
            )
            ids.append(spec.execution_id)
        return ids

    def start(self, num_tasks: int, group_size: int, *, skip_resumed: bool = False) -> list[str]:
        """Start one group per task of the first `num_tasks`; `skip_resumed`: not for tasks that have a
        resumed group (the boot start of a restarted process)."""
        tasks = [t for t in self.family.task_ids(num_tasks) if not (skip_resumed and t in self.resumed_tasks)]
        return [e for t in tasks for e in self.start_group(t, group_size)]

    async def resume(self, plan: ResumePlan, sink: StepSink, group_size: int) -> tuple[list[str], list[str]]:
        """Continue every execution of `plan` under its own id (RESUMED event, then the agent replays
        its stored calls and goes on), or end it FAILED with the reason it cannot resume.
        Returns (resumed ids, ended ids)."""
        resumed, ended = [], []
        for point in plan.points:
            spec = point.spec(self.seed)
            env = self.family.make(spec.task_id)
            reason = ""
            if not isinstance(self.agent, Agent):
                reason = "the external harness cannot resume: its agent process and state are the user's"
            elif not env.resumable:
                reason = f"environment {env.name!r} cannot resume (not deterministic under replay)"
            if reason:
                await end_unresumable(sink, point.started, f"rollout process died; {reason}")
                ended.append(spec.execution_id)
                continue
            await sink.publish_execution(resumed_event(point, self.incarnation))
            if point.steps:  # its next call is sent compact against the last replayed one
                sink.remember(point.steps[-1])
            self.resumed_tasks.add(spec.task_id)
            self.counters.resumed += 1
            self.live[spec.execution_id] = asyncio.create_task(
                self._run(spec, group_size, env=env, resume_from=point.steps), name=spec.execution_id
            )
            resumed.append(spec.execution_id)
        return resumed, ended

    async def _run(
        self,
        spec: ExecutionSpec,
        group_size: int,
        *,
        env: Environment | None = None,
        resume_from: list[events_pb2.StepEvent] | None = None,
    ) -> ExecutionOutcome:
        async with self._slots:
            self.counters.started += 1
            env = env or self.family.make(spec.task_id)
            if resume_from is not None and isinstance(self.agent, Agent):
                out = await self.agent.run(spec, env, resume_from=resume_from)
            else:
                out = await self.agent.run(spec, env)
        self.live.pop(spec.execution_id, None)
        self.counters.migrations += out.num_migrations
        if out.kind == events_pb2.ExecutionEvent.KIND_FAILED:
            self.counters.interrupted += 1
        else:
            self.counters.completed += 1
        last_of_group = not any(e.startswith(spec.group_id + "-e") for e in self.live)
        if self.continuous and not self._stopping and last_of_group:
            waiter = asyncio.create_task(
                self._start_when_admitted(spec.task_id, group_size), name=f"admit-{spec.task_id}"
            )
            self._waiting.add(waiter)
            waiter.add_done_callback(self._waiting.discard)
        return out

    async def stop(self) -> None:
        """Let live executions finish (the caller bounds the wait)."""
        self._stopping = True
        async with self._admission:
            self._admission.notify_all()
        if self.live:
            await asyncio.gather(*self.live.values(), return_exceptions=True)


async def end_orphaned_executions(
    bus: Any, sink: StepSink, run_id: str, *, idle_timeout_s: float = 5.0
) -> list[str]:
    """End, without resuming, what a killed predecessor left running: every execution of `run_id`
    with a STARTED event and no end event on the bus gets a FAILED end event ("rollout process
    died"), so the trajectory service scores it as unfinished (partial progress) instead of waiting
    for it forever. Returns their ids. For a rollout that cannot resume anything (the external
    harness); the service resumes instead (`ExecutionManager.resume`). Idempotent: the event id
    `<execution_id>.orphaned` is deduplicated by JetStream."""
    plan = await ResumePlan.load(bus, run_id, idle_timeout_s=idle_timeout_s)
    for point in plan.points:
        await end_unresumable(
            sink,
            point.started,
            "rollout process died while the execution ran (ended by its restarted successor)",
        )
    return [p.execution_id for p in plan.points]
