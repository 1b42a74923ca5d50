"""The trajectory service's state and operations, independent of transport (NATS, gRPC).

One ``asyncio.Lock`` serialises every change: the in-memory trees and the Postgres rows change
together, memory first, then one transaction; if the transaction fails the whole state is
reloaded from Postgres (so memory never holds what Postgres does not) and the error propagates
(the NATS batch is then redelivered). On start the state is loaded from Postgres, so a restarted
service continues where the old one stopped.

Idempotence: a step is keyed by (execution_id, call_seq); one already held is counted as a
duplicate and changes nothing. Execution end events keep the first ending.

Loops and what they wait on::

    NATS steps / gRPC IngestSteps --ingest_steps--> trees + traj_calls   (commit, then ack)
    NATS executions -------------ingest_executions--> traj_executions     (commit, then ack)
    poll (every ready_poll_s) --> score ready groups --> GroupScoredEvent
                              --> build batch when enough scored tokens --> BatchReadyEvent
    PullBatch --> claim a ready batch (or pack one now) --> mark delivered --> stream chunks
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa

from gyre.errors import InvalidArgument, NotFound
from gyre.v1 import common_pb2, events_pb2, trajectory_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.grouping import GroupResult, score_group
from services.trajectory.packing import (
    PackedBatch,
    PackedExecution,
    ScoredGroup,
    pack,
    select_groups,
    trainable_tokens,
)
from services.trajectory.scoring import Ending, Outcome, Progress, load_scorer, validate_progress
from services.trajectory.store import NewCall, StepBatch, TrajectoryStore, decode_chunks
from services.trajectory.tree import Node, NodeIds, TaskTree

log = logging.getLogger("gyre.trajectory")

_ENDINGS = {
    events_pb2.ExecutionEvent.KIND_FINISHED: Ending.FINISHED,
    events_pb2.ExecutionEvent.KIND_TRUNCATED: Ending.TRUNCATED,
    events_pb2.ExecutionEvent.KIND_FAILED: Ending.FAILED,
}


@dataclass(slots=True)
class ExecInfo:
    group_id: str
    task_id: str
    ending: Ending = Ending.RUNNING
    reward: float | None = None
    progress: Progress = field(default_factory=Progress)  # from the end event
    last_step_progress: tuple[int, Progress] | None = None  # (call_seq, progress) of the latest call
    num_calls: int | None = None
    ended_unix_s: float | None = None


@dataclass(slots=True)
class GroupInfo:
    task_id: str
    members: set[str] = field(default_factory=set)
    state: str = "open"  # open | scored | batched | dropped_stale | rejected | empty
    scored_unix_s: float | None = None
    min_version: int = -1
    scored: ScoredGroup | None = None
    tree_tokens: int | None = None  # tokens of the group's own nodes, computed once (batch-fill estimate)


def progress_from_pb(p: common_pb2.ProgressSignal) -> Progress:
    return Progress(
        p.milestones_reached,
        p.milestones_total,
        p.tests_passed_fraction if p.HasField("tests_passed_fraction") else None,
        dict(p.extra),
    )


def progress_to_json(p: Progress) -> dict[str, Any]:
    return {
        "milestones_reached": p.milestones_reached,
        "milestones_total": p.milestones_total,
        "tests_passed_fraction": p.tests_passed_fraction,
        "extra": p.extra,
    }


def progress_from_json(d: dict[str, Any] | None) -> Progress:
    if not d:
        return Progress()
    return Progress(
        d.get("milestones_reached", 0),
        d.get("milestones_total", 0),
        d.get("tests_passed_fraction"),
        d.get("extra") or {},
    )


def validate_step(step: events_pb2.StepEvent) -> np.ndarray:
    """Raise InvalidArgument naming the problem; return the completion log-probs (float32) of a valid step."""
    for name in ("run_id", "task_id", "group_id", "execution_id"):
        if not getattr(step, name):
            raise InvalidArgument(f"step {step.event_id!r}: {name} is empty")
    if step.call_seq < 0:
        raise InvalidArgument(f"step {step.execution_id}.{step.call_seq}: call_seq must be >= 0")
    n = len(step.completion_token_ids)
    if not (n == len(step.completion_logprobs) == len(step.completion_versions)):
        raise InvalidArgument(
            f"step {step.execution_id}.{step.call_seq}: completion_token_ids ({n}), completion_logprobs "
            f"({len(step.completion_logprobs)}) and completion_versions ({len(step.completion_versions)}) differ in length"
        )
    if n + len(step.prompt_token_ids) == 0:
        raise InvalidArgument(f"step {step.execution_id}.{step.call_seq}: no prompt and no completion tokens")
    lp = np.array(step.completion_logprobs, dtype=np.float32)
    if n and not (np.isfinite(lp.sum()) and lp.max() <= 1e-3):
        raise InvalidArgument(
            f"step {step.execution_id}.{step.call_seq}: completion_logprobs must be finite and <= 0"
        )
    if step.HasField("progress"):
        validate_progress(progress_from_pb(step.progress), step.execution_id)
    return lp


def _shared_with_previous_call(
    tree: TaskTree, execution_id: str, call_seq: int, prompt: np.ndarray
) -> tuple[Node, int] | None:
    """For a full prompt: (end node of the execution's previous call, tokens the prompt shares with it).

    Usually the prompt extends the previous call's sequence, so one vectorised comparison replaces
    the walk from the root that compares node by node (one numpy call per node of a deep path).
    The tree built is the same either way: the shared prefix is exactly the path to that node.
    """
    prev = tree.calls.get((execution_id, call_seq - 1))
    if prev is None or not len(prompt):
        return None
    seq = tree.sequence(prev.end_node)
    m = min(len(seq), len(prompt))
    same = seq[:m] == prompt[:m]
    k = m if bool(same.all()) else int(np.argmin(same))
    return (prev.end_node, k) if k > 0 else None


class TrajectoryCore:
    def __init__(self, run_id: str, cfg: TrajectoryConfig, engine: sa.Engine) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.store = TrajectoryStore(engine, run_id)
        self.scorer = load_scorer(cfg.scorer, cfg.reward_min, cfg.reward_max, cfg.partial_scale)
        self.lock = asyncio.Lock()
        self.counters: Counter[str] = Counter()
        self.batch_ready = asyncio.Event()
        # Publishes the BatchReadyEvent of a batch packed at pull time (set by the service; None in tests
        # that use the core alone).
        self.announce: Callable[[events_pb2.BatchReadyEvent], Awaitable[None]] | None = None
        self._reset()

    def _reset(self) -> None:
        self.ids = NodeIds()
        self.trees: dict[str, TaskTree] = {}
        self.executions: dict[str, ExecInfo] = {}
        self.groups: dict[str, GroupInfo] = {}
        self.first_end: dict[str, float] = {}

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        """(Re)build the in-memory state from Postgres (sync; call at start or via to_thread)."""
        self._reset()
        trees, execs, groups, calls, scores = self.store.load(self.ids)
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
            self._group(e.group_id, e.task_id).members.add(e.execution_id)
            if info.ended_unix_s is not None:
                self.first_end[e.group_id] = min(self.first_end.get(e.group_id, math.inf), info.ended_unix_s)
        for c in calls:
            cinfo = self.executions.get(c.execution_id)
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

    def _group(self, gid: str, task_id: str) -> GroupInfo:
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = GroupInfo(task_id)
        return g

    # ------------------------------------------------------------------ ingest
    async def ingest_steps(self, steps: list[events_pb2.StepEvent]) -> trajectory_pb2.IngestSummary:
        """Store new steps once (commit before returning); duplicates and invalid ones change no tree."""
        summary = trajectory_pb2.IngestSummary(num_received=len(steps))
        async with self.lock:
            batch = StepBatch()
            # Call order within an execution, so a compact step's base call (earlier) comes first.
            for step in sorted(steps, key=lambda st: (st.execution_id, st.call_seq)):
                key = (step.execution_id, step.call_seq)
                try:
                    logprobs = validate_step(step)
                    if step.run_id != self.run_id:
                        raise InvalidArgument(
                            f"step {step.event_id!r} belongs to run {step.run_id!r}, this service serves {self.run_id!r}"
                        )
                    known = self.executions.get(step.execution_id)
                    if known is not None and (known.group_id, known.task_id) != (step.group_id, step.task_id):
                        raise InvalidArgument(
                            f"step {step.execution_id}.{step.call_seq}: execution belongs to group {known.group_id!r} of task "
                            f"{known.task_id!r}, not {step.group_id!r}/{step.task_id!r}"
                        )
                except InvalidArgument as exc:
                    summary.num_rejected += 1
                    summary.errors.append(str(exc))
                    batch.rejections.append(
                        ("step", f"{step.execution_id}.{step.call_seq}", str(exc), step.SerializeToString())
                    )
                    continue
                tree = self.trees.get(step.task_id)
                if tree is None:
                    tree = self.trees[step.task_id] = TaskTree(step.task_id, self.ids)
                    batch.tasks.add(step.task_id)
                if key in tree.calls:
                    summary.num_duplicates += 1
                    continue
                prompt = np.array(step.prompt_token_ids, dtype=np.int32)
                known_prefix = None
                if step.HasField("prompt_base_call_seq"):
                    base = tree.calls.get((step.execution_id, step.prompt_base_call_seq))
                    if base is None:
                        summary.num_waiting += 1
                        continue
                    if (
                        not 0 <= step.prompt_base_len <= base.total_len
                        or step.prompt_base_call_seq >= step.call_seq
                    ):
                        bad = InvalidArgument(
                            f"step {step.execution_id}.{step.call_seq}: prompt_base_len {step.prompt_base_len} must lie in "
                            f"[0, {base.total_len}] and prompt_base_call_seq {step.prompt_base_call_seq} must be an earlier call"
                        )
                        summary.num_rejected += 1
                        summary.errors.append(str(bad))
                        batch.rejections.append(
                            (
                                "step",
                                f"{step.execution_id}.{step.call_seq}",
                                str(bad),
                                step.SerializeToString(),
                            )
                        )
                        continue
                    head = tree.sequence(base.end_node)[: step.prompt_base_len]
                    prompt = np.concatenate([head, prompt])
                    known_prefix = (base.end_node, step.prompt_base_len)
                else:
                    known_prefix = _shared_with_previous_call(tree, step.execution_id, step.call_seq, prompt)
                rec, changes = tree.insert_call(
                    step.execution_id,
                    step.call_seq,
                    prompt,
                    np.array(step.completion_token_ids, dtype=np.int32),
                    logprobs,
                    np.array(step.completion_versions, dtype=np.int64),
                    step.agent_id or "main",
                    known_prefix,
                )
                assert rec is not None
                for n in changes.created:
                    batch.nodes[n.node_id] = (step.task_id, n)
                    batch.created.add(n.node_id)
                for n in changes.modified:
                    batch.nodes[n.node_id] = (step.task_id, n)
                progress = progress_from_pb(step.progress)
                batch.calls.append(
                    NewCall(
                        step.task_id,
                        step.group_id,
                        rec,
                        progress_to_json(progress),
                        step.context_event,
                        step.num_migrations,
                    )
                )
                info = self.executions.get(step.execution_id)
                if info is None:
                    info = self.executions[step.execution_id] = ExecInfo(step.group_id, step.task_id)
                    batch.executions[step.execution_id] = (step.group_id, step.task_id)
                    batch.groups[step.group_id] = step.task_id
                    batch.tasks.add(step.task_id)
                    self._group(step.group_id, step.task_id).members.add(step.execution_id)
                if info.last_step_progress is None or step.call_seq > info.last_step_progress[0]:
                    info.last_step_progress = (step.call_seq, progress)
                summary.num_stored += 1
            await self._commit(self.store.commit_steps, batch)
        self.counters["steps_received"] += summary.num_received
        self.counters["steps_stored"] += summary.num_stored
        self.counters["steps_duplicate"] += summary.num_duplicates
        self.counters["steps_rejected"] += summary.num_rejected
        self.counters["steps_waiting_for_base"] += summary.num_waiting
        return summary

    async def _commit(self, fn: Any, *args: Any) -> None:
        try:
            await asyncio.to_thread(fn, *args)
        except Exception:
            log.exception("commit failed; reloading the trajectory state from Postgres")
            await asyncio.to_thread(self.load)
            raise

    async def ingest_executions(self, events: list[events_pb2.ExecutionEvent]) -> int:
        """Record execution lifecycle events; invalid ones (NaN reward...) are kept as rejections. Returns #rejected."""
        rows: list[dict[str, Any]] = []
        rejections: list[tuple[str, str, str, bytes]] = []
        async with self.lock:
            for ev in events:
                try:
                    row = self._execution_row(ev)
                except InvalidArgument as exc:
                    log.warning("rejected execution event %s: %s", ev.event_id, exc)
                    rejections.append(
                        ("execution", ev.event_id or ev.execution_id, str(exc), ev.SerializeToString())
                    )
                    continue
                if row is not None:
                    rows.append(row)
            await self._commit(self.store.commit_executions, rows, rejections)
            for row in rows:
                info = self.executions.get(row["execution_id"])
                if info is None:
                    info = self.executions[row["execution_id"]] = ExecInfo(row["group_id"], row["task_id"])
                self._group(row["group_id"], row["task_id"]).members.add(row["execution_id"])
                if row["ending"] != "running" and info.ending is Ending.RUNNING:
                    info.ending = Ending(row["ending"])
                    info.reward, info.num_calls = row["reward"], row["num_calls"]
                    info.progress, info.ended_unix_s = (
                        progress_from_json(row["progress"]),
                        row["ended_unix_s"],
                    )
                    self.first_end[row["group_id"]] = min(
                        self.first_end.get(row["group_id"], math.inf), row["ended_unix_s"]
                    )
        self.counters["execution_events"] += len(events)
        self.counters["execution_events_rejected"] += len(rejections)
        return len(rejections)

    def _execution_row(self, ev: events_pb2.ExecutionEvent) -> dict[str, Any] | None:
        for name in ("task_id", "group_id", "execution_id"):
            if not getattr(ev, name):
                raise InvalidArgument(f"execution event {ev.event_id!r}: {name} is empty")
        if ev.run_id != self.run_id:
            raise InvalidArgument(
                f"execution event {ev.event_id!r} belongs to run {ev.run_id!r}, not {self.run_id!r}"
            )
        ending = _ENDINGS.get(ev.kind, Ending.RUNNING)
        progress = progress_from_pb(ev.progress)
        reward = ev.reward if ev.HasField("reward") else None
        if ending is not Ending.RUNNING:
            # Validate now, with the scorer's own rules, so a bad reward is refused at the door.
            self.scorer.score(Outcome(ev.execution_id, ending, reward, progress))
        return {
            "execution_id": ev.execution_id,
            "group_id": ev.group_id,
            "task_id": ev.task_id,
            "ending": ending.value,
            "reward": reward,
            "progress": progress_to_json(progress),
            "num_calls": ev.num_calls if ending is not Ending.RUNNING else None,
            "environment": ev.environment,
            "error": ev.error,
            "ended_unix_s": (ev.created_unix_s or time.time()) if ending is not Ending.RUNNING else None,
        }

    # ------------------------------------------------------------------ readiness and scoring
    def _ready(self, gid: str, g: GroupInfo, now: float) -> bool:
        if g.state != "open" or not g.members:
            return False
        if self.cfg.group_size and len(g.members) < self.cfg.group_size:
            return False
        tree = self.trees.get(g.task_id)
        complete = True
        for eid in g.members:
            info = self.executions[eid]
            stored = len(tree.calls_by_execution.get(eid, {})) if tree else 0
            if info.ending is Ending.RUNNING or (info.num_calls is not None and stored < info.num_calls):
                complete = False
        if complete:
            return True
        waited = now - self.first_end.get(gid, math.inf)
        return self.cfg.train_unfinished_after_s is not None and waited >= self.cfg.train_unfinished_after_s

    def _outcome(self, eid: str) -> Outcome:
        info = self.executions[eid]
        if info.ending is Ending.RUNNING:
            prog = info.last_step_progress[1] if info.last_step_progress else Progress()
            return Outcome(eid, Ending.RUNNING, None, prog)
        return Outcome(eid, info.ending, info.reward, info.progress)

    async def score_ready_groups(self) -> list[events_pb2.GroupScoredEvent]:
        events: list[events_pb2.GroupScoredEvent] = []
        now = time.time()
        async with self.lock:
            for gid, g in sorted(self.groups.items()):
                if not self._ready(gid, g, now):
                    continue
                tree = self.trees.get(g.task_id)
                if tree is None:
                    continue
                try:
                    res = score_group(
                        tree,
                        gid,
                        {e: self._outcome(e) for e in g.members},
                        self.scorer,
                        normalise_std=self.cfg.normalise_advantage_std,
                        near_threshold=self.cfg.near_duplicate_threshold,
                        num_perm=self.cfg.near_duplicate_num_perm,
                        shingle_size=self.cfg.shingle_size,
                    )
                except InvalidArgument as exc:
                    log.error("group %s cannot be scored: %s", gid, exc)
                    self.counters["groups_rejected"] += 1
                    await self._commit(self.store.commit_group, gid, "rejected", [], [], {})
                    g.state = "rejected"
                    continue
                vmin, vmax = self._versions(tree, res)
                # Nothing generated (no completion tokens, no stored calls): recorded, never packed.
                state = "scored" if trainable_tokens(tree, res.group) > 0 else "empty"
                await self._commit(
                    self.store.commit_group,
                    gid,
                    state,
                    self._score_rows(gid, res),
                    self._dedup_rows(res),
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
                events.append(
                    events_pb2.GroupScoredEvent(
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
                    )
                )
        return events

    @staticmethod
    def _versions(tree: TaskTree, res: GroupResult) -> tuple[int, int]:
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

    @staticmethod
    def _score_rows(gid: str, res: GroupResult) -> list[dict[str, Any]]:
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

    @staticmethod
    def _dedup_rows(res: GroupResult) -> list[dict[str, Any]]:
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

    # ------------------------------------------------------------------ batches
    def _scored_groups(self, current_version: int | None) -> tuple[list[ScoredGroup], list[str]]:
        fresh, stale = [], []
        for gid, g in sorted(self.groups.items(), key=lambda kv: (kv[1].scored_unix_s or 0, kv[0])):
            if g.state != "scored" or g.scored is None:
                continue
            if (
                current_version is not None
                and g.min_version >= 0
                and g.min_version < current_version - self.cfg.max_staleness
            ):
                stale.append(gid)
            else:
                fresh.append(g.scored)
        return fresh, stale

    async def _build(
        self, max_tokens: int, current_version: int | None, state: str, consumer: str = ""
    ) -> PackedBatch | None:
        """Pack scored groups into a batch and persist it (lock held by caller)."""
        fresh, stale = self._scored_groups(current_version)
        if stale:
            await self._commit(self.store.mark_groups, stale, "dropped_stale")
            for gid in stale:
                self.groups[gid].state = "dropped_stale"
            self.counters["groups_dropped_stale"] += len(stale)
        if not fresh:
            return None
        chosen = select_groups(self.trees, fresh, max_tokens)
        packed = pack(self.trees, chosen, batch_id=uuid.uuid4().hex[:16])
        if not packed.chunks:
            # Groups scored before the 'empty' check existed (loaded from Postgres): never an empty batch.
            await self._skip_empty([g.group_id for g in chosen])
            return None
        await self._commit(self.store.create_batch, packed, state, consumer)
        for g in chosen:
            self.groups[g.group_id].state = "batched"
        self.counters["batches_built"] += 1
        self.counters["batched_tokens"] += packed.num_tokens
        self.counters["batched_flat_tokens"] += packed.num_flat_tokens
        return packed

    def _tree_tokens(self, info: GroupInfo, group: ScoredGroup) -> int:
        if info.tree_tokens is None:
            tree = self.trees[group.task_id]
            info.tree_tokens = sum(
                len(tree.nodes[n].tokens) for n in tree.nodes_of(e.execution_id for e in group.executions)
            )
        return info.tree_tokens

    async def _skip_empty(self, group_ids: list[str]) -> None:
        """Groups with no generated token to train (no completions, no stored calls): state ``empty``, counted."""
        log.warning("groups with nothing to train are skipped (state 'empty'): %s", ", ".join(group_ids))
        await self._commit(self.store.mark_groups, group_ids, "empty")
        for gid in group_ids:
            self.groups[gid].state = "empty"
        self.counters["groups_skipped_empty"] += len(group_ids)

    async def build_announced_batch(self) -> events_pb2.BatchReadyEvent | None:
        """Build a batch when scored groups fill min_batch_fill of the budget or waited batch_max_wait_s."""
        async with self.lock:
            fresh, _ = self._scored_groups(None)
            if not fresh:
                return None
            oldest = min(self.groups[g.group_id].scored_unix_s or 0 for g in fresh)
            # Sum of each group's own tree tokens, computed once per group: an over-estimate of the union
            # when groups share a task, which only builds a batch a little earlier.
            tokens = sum(self._tree_tokens(self.groups[g.group_id], g) for g in fresh)
            if (
                tokens < self.cfg.min_batch_fill * self.cfg.max_batch_tokens
                and time.time() - oldest < self.cfg.batch_max_wait_s
            ):
                return None
            packed = await self._build(self.cfg.max_batch_tokens, None, "ready")
        if packed is None:
            return None
        self.batch_ready.set()
        return self._ready_event(packed)

    def _ready_event(self, p: PackedBatch) -> events_pb2.BatchReadyEvent:
        return events_pb2.BatchReadyEvent(
            event_id=f"batch.{p.batch_id}",
            run_id=self.run_id,
            batch_id=p.batch_id,
            num_trees=len(p.chunks),
            num_paths=p.num_paths,
            num_tokens=p.num_tokens,
            num_flat_tokens=p.num_flat_tokens,
            min_policy_version=p.min_policy_version,
            max_policy_version=p.max_policy_version,
            num_partial_paths=p.num_partial_paths,
            created_unix_s=time.time(),
        )

    async def pull(self, req: trajectory_pb2.PullBatchRequest) -> list[trajectory_pb2.BatchChunk]:
        """Chunks of one batch, marked delivered in Postgres before they are returned; [] if none by wait_s."""
        if req.run_id and req.run_id != self.run_id:
            raise NotFound(f"run {req.run_id!r} is not served here (this service serves {self.run_id!r})")
        if req.resume_batch_id:
            b = await asyncio.to_thread(self.store.get_batch, req.resume_batch_id)
            if b is None or b.run_id != self.run_id:
                raise NotFound(f"batch {req.resume_batch_id!r} does not exist in run {self.run_id!r}")
            if b.state == "ready":
                await asyncio.to_thread(self.store.mark_delivered, b.batch_id, req.consumer)
            self.counters["batches_resent"] += 1
            return decode_chunks(b.chunks)
        max_tokens = int(req.max_tokens) or self.cfg.max_batch_tokens
        current = int(req.current_version) if req.current_version else None
        deadline = time.monotonic() + max(0.0, req.wait_s)
        while True:
            chunks, packed = await self._pull_once(max_tokens, current, req.consumer)
            if packed is not None:
                await self._announce(packed)
            if chunks:
                self.counters["batches_delivered"] += 1
                return chunks
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self.batch_ready.clear()
            try:
                await asyncio.wait_for(self.batch_ready.wait(), timeout=min(left, self.cfg.ready_poll_s))
            except TimeoutError:
                pass

    async def _announce(self, packed: PackedBatch) -> None:
        """Publish the BatchReadyEvent of a batch built at pull time (those built by the poll loop are
        published there). A failed publish is logged and counted; the batch is still handed out."""
        if self.announce is None:
            return
        try:
            await self.announce(self._ready_event(packed))
        except Exception:
            log.exception("BatchReadyEvent of batch %s could not be published", packed.batch_id)
            self.counters["batch_events_failed"] += 1
        else:
            self.counters["batch_events_published"] += 1

    async def _pull_once(
        self, max_tokens: int, current: int | None, consumer: str
    ) -> tuple[list[trajectory_pb2.BatchChunk], PackedBatch | None]:
        """Chunks of a claimed batch and, when it was packed now, the batch (to announce)."""
        async with self.lock:
            while True:
                b = await asyncio.to_thread(self.store.next_ready_batch)
                if b is None:
                    break
                stale = (
                    current is not None
                    and b.min_version >= 0
                    and b.min_version < current - self.cfg.max_staleness
                )
                if b.num_tokens > max_tokens or stale:
                    # Does not fit this request: give its groups back and pack anew below.
                    groups = await asyncio.to_thread(self.store.release_batch, b.batch_id)
                    for gid in groups:
                        self.groups[gid].state = "scored"
                    continue
                if await asyncio.to_thread(self.store.mark_delivered, b.batch_id, consumer):
                    return decode_chunks(b.chunks), None
            packed = await self._build(max_tokens, current, "delivered", consumer)
            return (packed.chunks, packed) if packed is not None else ([], None)

    async def ack(self, req: trajectory_pb2.AckBatchRequest) -> None:
        if not await asyncio.to_thread(
            self.store.ack_batch, req.batch_id, req.consumer, req.trained_at_version
        ):
            raise NotFound(f"batch {req.batch_id!r} does not exist in run {self.run_id!r}")
        self.counters["batches_acked"] += 1

    # ------------------------------------------------------------------ queries
    def export(self, execution_id: str) -> trajectory_pb2.ExportExecutionResponse:
        info = self.executions.get(execution_id)
        tree = self.trees.get(info.task_id) if info else None
        if info is None or tree is None or execution_id not in tree.calls_by_execution:
            raise NotFound(f"execution {execution_id!r} has no stored calls in run {self.run_id!r}")
        resp = trajectory_pb2.ExportExecutionResponse(
            execution_id=execution_id, task_id=info.task_id, group_id=info.group_id
        )
        for c in tree.export_execution(execution_id):
            resp.calls.append(
                trajectory_pb2.ExportedCall(
                    call_seq=c.call_seq,
                    prompt_token_ids=c.prompt_token_ids.tolist(),
                    completion_token_ids=c.completion_token_ids.tolist(),
                    completion_logprobs=c.completion_logprobs.tolist(),
                    completion_versions=c.completion_versions.tolist(),
                    agent_id=c.agent_id,
                )
            )
        return resp

    async def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["tree_tokens"] = float(sum(t.num_tokens for t in self.trees.values()))
        out["tree_nodes"] = float(sum(len(t.nodes) for t in self.trees.values()))
        out["executions"] = float(len(self.executions))
        for state in ("open", "scored", "batched", "dropped_stale", "rejected", "empty"):
            out[f"groups_state_{state}"] = float(sum(1 for g in self.groups.values() if g.state == state))
        out.update(await asyncio.to_thread(self.store.counts))
        return out
