"""The trajectory service's in-memory state, and the ordered queue of its Postgres commits.

`TrajectoryState` holds what the ingest, scoring and batching parts share: the task trees, the
executions and the groups. It is a mirror of Postgres: every change is made in memory first and
then committed (see `CommitQueue`); a failed commit reloads it whole from Postgres, so memory never
keeps what Postgres does not.

`CommitQueue` is what lets the ingest pipeline: a batch of steps changes memory under the lock,
queues its commit, and releases the lock, so the next batch can be decoded and matched while the
first is written. Guarantees:

- commits run one at a time, in the order they were queued (the order memory changed);
- a commit queued before a failed commit's reload fails too, without writing (its memory change
  was built on state that Postgres never got), and the caller redelivers it;
- the first caller to see the failure reloads the state (under the lock) before anything else
  changes memory; commits queued after the reload run normally.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import Unavailable
from gyre.v1 import common_pb2
from services.trajectory.packing import PackedExecution, ScoredGroup
from services.trajectory.scoring import Ending, ProgressSignals
from services.trajectory.store import TrajectoryStore
from services.trajectory.tree import NodeIds, TaskTree

log = logging.getLogger("gyre.trajectory")


@dataclass(slots=True)
class ExecInfo:
    """One execution as the service knows it: its group, its ending and its progress signals."""

    group_id: str
    task_id: str
    ending: Ending = Ending.RUNNING
    reward: float | None = None
    progress: ProgressSignals = field(default_factory=ProgressSignals)  # from the end event
    last_step_progress: tuple[int, ProgressSignals] | None = None  # (call_seq, progress) of the latest call
    num_calls: int | None = None
    ended_unix_s: float | None = None
    step_progress: dict[int, ProgressSignals] = field(default_factory=dict)  # call_seq -> progress after it


@dataclass(slots=True)
class GroupInfo:
    """One group of executions of a task and where it is in its lifecycle."""

    task_id: str
    members: set[str] = field(default_factory=set)
    state: str = "open"  # open | scored | batched | dropped_stale | rejected | empty
    scored_unix_s: float | None = None
    min_version: int = -1
    scored: ScoredGroup | None = None
    tree_tokens: int | None = None  # tokens of the group's own nodes, computed once (batch-fill estimate)


def progress_from_pb(p: common_pb2.ProgressSignal) -> ProgressSignals:
    return ProgressSignals(
        p.milestones_reached,
        p.milestones_total,
        p.tests_passed_fraction if p.HasField("tests_passed_fraction") else None,
        dict(p.extra),
    )


def progress_to_json(p: ProgressSignals) -> dict[str, Any]:
    return {
        "milestones_reached": p.milestones_reached,
        "milestones_total": p.milestones_total,
        "tests_passed_fraction": p.tests_passed_fraction,
        "extra": p.extra,
    }


def progress_from_json(d: dict[str, Any] | None) -> ProgressSignals:
    if not d:
        return ProgressSignals()
    return ProgressSignals(
        d.get("milestones_reached", 0),
        d.get("milestones_total", 0),
        d.get("tests_passed_fraction"),
        d.get("extra") or {},
    )


class TrajectoryState:
    """Trees, executions and groups of one run, in memory (a mirror of the Postgres rows)."""

    def __init__(self) -> None:
        self.ids = NodeIds()
        self.trees: dict[str, TaskTree] = {}
        self.executions: dict[str, ExecInfo] = {}
        self.groups: dict[str, GroupInfo] = {}
        self.first_end: dict[str, float] = {}  # group -> unix seconds its first execution ended

    def group(self, gid: str, task_id: str) -> GroupInfo:
        """The group, created (state open) when first seen."""
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = GroupInfo(task_id)
        return g

    def load(self, store: TrajectoryStore) -> None:
        """Replace the whole state with what Postgres holds (sync; call via asyncio.to_thread)."""
        self.__init__()  # type: ignore[misc]
        trees, execs, groups, calls, scores = store.load(self.ids)
        self.trees = trees
        for g in groups:
            self.groups[g.group_id] = GroupInfo(
                g.task_id,
                state=g.state,
                scored_unix_s=g.scored_unix_s,
                min_version=g.min_version if g.min_version is not None else -1,
            )
        for e in execs:
            info = ExecInfo(
                e.group_id,
                e.task_id,
                Ending(e.ending),
                e.reward,
                progress_from_json(e.progress),
                None,
                e.num_calls,
                e.ended_unix_s,
            )
            self.executions[e.execution_id] = info
            self.group(e.group_id, e.task_id).members.add(e.execution_id)
            if info.ended_unix_s is not None:
                self.first_end[e.group_id] = min(self.first_end.get(e.group_id, math.inf), info.ended_unix_s)
        for c in calls:
            cinfo = self.executions.get(c.execution_id)
            if cinfo is not None:
                cinfo.step_progress[c.call_seq] = progress_from_json(c.progress)
            if cinfo is not None and (
                cinfo.last_step_progress is None or c.call_seq > cinfo.last_step_progress[0]
            ):
                cinfo.last_step_progress = (c.call_seq, progress_from_json(c.progress))
        by_group: dict[str, list[Any]] = {}
        for s in scores:
            by_group.setdefault(s.group_id, []).append(s)
        for gid, rows in by_group.items():
            ginfo = self.groups.get(gid)
            if ginfo is not None and ginfo.state == "scored":
                reps: dict[str, list[Any]] = {}
                for r in rows:
                    reps.setdefault(r.representative_id, []).append(r)
                ginfo.scored = ScoredGroup(
                    gid,
                    ginfo.task_id,
                    [
                        PackedExecution(
                            rep,
                            sum(r.advantage for r in ms) / len(ms),
                            len(ms),
                            next(r.dedup_weight for r in ms if r.execution_id == rep),
                            sum(r.reward for r in ms),
                            sum(1 for r in ms if r.partial),
                        )
                        for rep, ms in sorted(reps.items())
                    ],
                )


class CommitQueue:
    """Postgres writes, one at a time, in the order memory changed (see the module docstring).

    ``lock`` is the lock every change of ``state`` is made under.
    """

    def __init__(self, state: TrajectoryState, store: TrajectoryStore, lock: asyncio.Lock) -> None:
        self.state = state
        self.store = store
        self.lock = lock
        self.generation = 0  # +1 at every reload
        self._tail: asyncio.Future[None] | None = None
        self._tail_generation = 0  # generation the last queued commit was queued in

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[int, asyncio.Future[None]]:
        """Queue ``fn(*args)`` (sync, run in a worker thread) behind every commit queued before.

        Call it with the lock held, right after the memory change it persists.
        """
        prev, prev_gen, gen = self._tail, self._tail_generation, self.generation

        async def run() -> None:
            if prev is not None:
                try:
                    await prev
                except Exception as exc:
                    if prev_gen == gen:  # queued before the reload that failure causes: built on it
                        raise Unavailable(
                            "an earlier Postgres commit failed and the state is being reloaded; retry"
                        ) from exc
            await asyncio.to_thread(fn, *args)

        fut = self._tail = asyncio.ensure_future(run())
        self._tail_generation = gen
        return gen, fut

    async def wait(self, gen: int, fut: asyncio.Future[None], *, lock_held: bool) -> None:
        """Wait for a queued commit; if it failed, reload the state from Postgres (once) and raise."""
        try:
            await fut
        except Exception:
            if lock_held:
                await self._reload(gen)
            else:
                async with self.lock:
                    await self._reload(gen)
            raise

    async def commit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue and wait (lock held by the caller): the write of a change made under the lock."""
        gen, fut = self.submit(fn, *args)
        await self.wait(gen, fut, lock_held=True)

    async def _reload(self, gen: int) -> None:
        if gen != self.generation:
            return  # another caller already reloaded after this failure
        log.exception("commit failed; reloading the trajectory state from Postgres")
        self.generation += 1
        await asyncio.to_thread(self.state.load, self.store)
