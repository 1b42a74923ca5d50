"""Scoring: a group of executions is scored once it is ready, with its dedup decisions and advantages.

A group is ready when it has ``group_size`` members (if set) and every member has ended with all
its calls stored, or when ``train_unfinished_after_s`` has passed since its first member ended
(partial-progress scoring: members still running are scored on their latest progress signals).
Scoring (services/trajectory/grouping.py) runs under the state lock, in a worker thread; its rows (scores, dedup
decisions, the group's state and version range) are one Postgres transaction, and the group's
state changes in memory only after that commit. A group that cannot be scored (a reward outside
the configured range...) is marked ``rejected`` and logged; one with no generated token is
``empty`` and never packed. Each scored group yields one GroupScoredEvent (event_id
``scored.<group_id>``, so a republished one is deduplicated by JetStream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import numpy as np

from gyre.errors import InvalidArgument
from gyre.pipeline_rules import group_ready
from gyre.v1 import events_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.grouping import GroupResult, score_group
from services.trajectory.packing import trainable_tokens
from services.trajectory.scoring import Ending, Outcome, ProgressSignals, Scorer
from services.trajectory.state import CommitQueue, GroupInfo, TrajectoryState
from services.trajectory.store import TrajectoryStore
from services.trajectory.tree import TaskTree

log = logging.getLogger("gyre.trajectory")


class GroupScoring:
    """Finds ready groups and scores them, over the shared state and the store."""

    def __init__(
        self,
        run_id: str,
        cfg: TrajectoryConfig,
        state: TrajectoryState,
        store: TrajectoryStore,
        commits: CommitQueue,
        scorer: Scorer,
        counters: Counter[str],
    ) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.state = state
        self.store = store
        self.commits = commits
        self.scorer = scorer
        self.counters = counters

    def ready(self, gid: str, g: GroupInfo, now: float) -> bool:
        """Whether an open group can be scored now (``now`` in unix seconds)."""
        if g.state != "open" or not g.members:
            return False
        if self.cfg.group_size and len(g.members) < self.cfg.group_size:
            return False
        tree = self.state.trees.get(g.task_id)
        complete = True
        for eid in g.members:
            info = self.state.executions[eid]
            stored = len(tree.calls_by_execution.get(eid, {})) if tree else 0
            if info.ending is Ending.RUNNING or (info.num_calls is not None and stored < info.num_calls):
                complete = False
        # gyre.pipeline_rules.group_ready: the rule the simulator scores groups by.
        return group_ready(complete, self.state.first_end.get(gid), now, self.cfg.train_unfinished_after_s)

    def outcome(self, eid: str) -> Outcome:
        """What the scorer sees of one execution: its ending, or its latest progress while it runs."""
        info = self.state.executions[eid]
        if info.ending is Ending.RUNNING:
            prog = info.last_step_progress[1] if info.last_step_progress else ProgressSignals()
            return Outcome(eid, Ending.RUNNING, None, prog)
        return Outcome(eid, info.ending, info.reward, info.progress)

    async def score_ready_groups(self) -> list[events_pb2.GroupScoredEvent]:
        """Score every ready group (each committed on its own); the events to publish, in group order."""
        events: list[events_pb2.GroupScoredEvent] = []
        now = time.time()
        async with self.commits.lock:
            for gid, g in sorted(self.state.groups.items()):
                if not self.ready(gid, g, now):
                    continue
                tree = self.state.trees.get(g.task_id)
                if tree is None:  # no member stored a call (e.g. every agent crashed before its first)
                    await self._skip_callless(gid, g, now)
                    continue
                ev = await self._score(gid, g, tree, now)
                if ev is not None:
                    events.append(ev)
        return events

    async def _skip_callless(self, gid: str, g: GroupInfo, now: float) -> None:
        """A ready group whose task has no stored call at all: nothing to score or train. It is
        ``empty`` like a group that generated nothing (so its admission slot goes back,
        services/trajectory/drops.py); before, it stayed open for good and the run stalled."""
        extra = {"min_version": -1, "max_version": -1}
        await self.commits.commit(self.store.commit_group, gid, "empty", [], [], extra)
        g.state, g.scored_unix_s, g.min_version = "empty", now, -1
        log.warning("group %s has no stored call (its executions made none); skipped", gid)
        self.counters["groups_skipped_empty"] += 1

    async def _score(
        self, gid: str, g: GroupInfo, tree: TaskTree, now: float
    ) -> events_pb2.GroupScoredEvent | None:
        outcomes = {e: self.outcome(e) for e in g.members}
        step_progress = {e: self.state.executions[e].step_progress for e in g.members}

        def score() -> tuple[GroupResult, tuple[int, int], int]:
            res = score_group(
                tree,
                gid,
                outcomes,
                self.scorer,
                normalise_std=self.cfg.normalise_advantage_std,
                near_threshold=self.cfg.near_duplicate_threshold,
                num_perm=self.cfg.near_duplicate_num_perm,
                shingle_size=self.cfg.shingle_size,
                credit=self.cfg.credit_assignment,
                step_progress=step_progress,
                progress_discount=self.cfg.progress_discount,
                tree_local_coef=self.cfg.tree_local_coef,
                tree_global_coef=self.cfg.tree_global_coef,
            )
            return res, versions(tree, res), trainable_tokens(tree, res.group)

        try:
            # In a worker thread, lock held: no tree changes meanwhile, and the event loop goes on
            # acking, fetching and answering (a million-token group takes seconds to score).
            res, (vmin, vmax), trainable = await asyncio.to_thread(score)
        except InvalidArgument as exc:
            log.error("group %s cannot be scored: %s", gid, exc)
            self.counters["groups_rejected"] += 1
            await self.commits.commit(self.store.commit_group, gid, "rejected", [], [], {})
            g.state = "rejected"
            return None
        # Nothing generated (no completion tokens, no stored calls): recorded, never packed.
        state = "scored" if trainable > 0 else "empty"
        await self.commits.commit(
            self.store.commit_group,
            gid,
            state,
            score_rows(gid, res),
            dedup_rows(res),
            {
                "min_version": vmin,
                "max_version": vmax,
                "reward_mean": res.stats.mean,
                "reward_std": res.stats.std,
            },
        )
        g.state, g.scored, g.scored_unix_s, g.min_version = state, res.group, now, vmin
        self.counters["groups_scored"] += 1
        if state == "empty":
            log.warning("group %s has nothing to train (no generated token); skipped", gid)
            self.counters["groups_skipped_empty"] += 1
        self.counters["dedup_exact_merged"] += res.dedup.num_exact_merged
        self.counters["dedup_near_duplicates"] += res.dedup.num_near_duplicates
        return events_pb2.GroupScoredEvent(
            event_id=f"scored.{gid}",
            run_id=self.run_id,
            task_id=g.task_id,
            group_id=gid,
            num_paths=sum(len(tree.leaves_of(e.execution_id)) for e in res.group.executions),
            num_exact_merged=res.dedup.num_exact_merged,
            num_near_duplicates=res.dedup.num_near_duplicates,
            reward_mean=res.stats.mean,
            reward_std=res.stats.std,
            num_partial=sum(1 for s in res.scores.values() if s.partial),
            created_unix_s=now,
            advantage_abs_max=res.advantage_abs_max,
        )


def versions(tree: TaskTree, res: GroupResult) -> tuple[int, int]:
    """Lowest and highest policy version of the group's generated tokens ((-1, -1) if none)."""
    vs = [
        r.completion_versions
        for e in res.scores
        for r in tree.calls_by_execution.get(e, {}).values()
        if len(r.completion_versions)
    ]
    if not vs:
        return -1, -1
    allv = np.concatenate(vs)
    return int(allv.min()), int(allv.max())


def score_rows(gid: str, res: GroupResult) -> list[dict[str, Any]]:
    rep_of = {m: rep for rep, ms in res.dedup.members.items() for m in ms}
    return [
        {
            "execution_id": e,
            "group_id": gid,
            "reward": s.reward,
            "partial": s.partial,
            "source": s.source,
            "advantage": res.advantages[e],
            "representative_id": rep_of[e],
            "multiplicity": len(res.dedup.members[rep_of[e]]),
            "dedup_weight": res.dedup.weights[rep_of[e]],
        }
        for e, s in res.scores.items()
    ]


def dedup_rows(res: GroupResult) -> list[dict[str, Any]]:
    return [
        {
            "execution_id": d.execution_id,
            "kind": d.kind,
            "other_execution_id": d.other_execution_id,
            "similarity": d.similarity,
            "weight": d.weight,
            "reason": d.reason,
        }
        for d in res.dedup.decisions
    ]
