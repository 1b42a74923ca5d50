"""Batching: scored groups packed into tree batches, handed to the trainer by PullBatch and acked.

A batch's lifecycle (state in Postgres, table traj_batches)::

    scored groups --pack--> ready (announced: BatchReadyEvent) --PullBatch--> delivered --AckBatch--> acked

- The poll loop builds and announces a batch once scored groups fill ``min_batch_fill`` of
  ``max_batch_tokens`` or the oldest waited ``batch_max_wait_s``.
- PullBatch claims the oldest ready batch that fits the request's token budget and staleness
  bound (one that does not is released: its groups are packed anew), or packs one now (and
  announces it). The batch is marked delivered in Postgres before its chunks are returned, so a
  trainer that restarts resumes it with ``resume_batch_id`` and gets the same chunks.
- Groups older than ``max_staleness`` versions behind the trainer's version are dropped
  (``dropped_stale``, counted), never packed.
- A streaming trainer (``PullBatchRequest.stream_part``) pulls a step as several *parts*: each
  part is a batch like any other (same lifecycle, staleness, whole trees, announced, acked), packed
  as soon as one fresh scored group fits the step's remaining budget rather than at
  ``min_batch_fill``; the step is full once its parts hold ``min_batch_fill`` of the budget (what a
  whole batch holds). Every chunk carries its batch's ``normaliser`` so that the trainer can
  re-normalise the step's parts as one batch (services/trainer/loop.py).
Everything runs under the state lock; a batch and its groups' ``batched`` state are one commit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable

from gyre.errors import NotFound
from gyre.v1 import events_pb2, trajectory_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.packing import ScoredGroup, TreeBatch, pack, select_groups
from services.trajectory.state import CommitQueue, GroupInfo, TrajectoryState
from services.trajectory.store import TrajectoryStore, decode_chunks

log = logging.getLogger("gyre.trajectory")


class Batcher:
    """Builds, hands out and acknowledges batches, over the shared state and the store."""

    def __init__(
        self,
        run_id: str,
        cfg: TrajectoryConfig,
        state: TrajectoryState,
        store: TrajectoryStore,
        commits: CommitQueue,
        counters: Counter[str],
    ) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.state = state
        self.store = store
        self.commits = commits
        self.counters = counters
        self.batch_ready = asyncio.Event()
        # Publishes the BatchReadyEvent of a batch packed at pull time (set by the service; None in tests
        # that use the core alone).
        self.announce: Callable[[events_pb2.BatchReadyEvent], Awaitable[None]] | None = None

    # ------------------------------------------------------------------ building
    def _scored_groups(self, current_version: int | None) -> tuple[list[ScoredGroup], list[str]]:
        fresh, stale = [], []
        for gid, g in sorted(self.state.groups.items(), key=lambda kv: (kv[1].scored_unix_s or 0, kv[0])):
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
        self,
        max_tokens: int,
        current_version: int | None,
        state: str,
        consumer: str = "",
        strict: bool = False,
    ) -> TreeBatch | None:
        """Pack scored groups into a batch and persist it (lock held by caller). Without `strict` the
        first group is taken even when alone over `max_tokens` (a tree is never split); with it, a
        group over `max_tokens` is left for a later batch."""
        groups = self.state.groups
        fresh = await self._drop_stale(current_version)
        if strict:
            fresh = [g for g in fresh if self._tree_tokens(groups[g.group_id], g) <= max_tokens]
        if not fresh:
            return None
        chosen = select_groups(self.state.trees, fresh, max_tokens)
        packed = pack(self.state.trees, chosen, batch_id=uuid.uuid4().hex[:16])
        for c in packed.chunks:  # stored with the chunks: a resumed batch carries it too
            c.normaliser = packed.normaliser
        if not packed.chunks:
            # Groups scored before the 'empty' check existed (loaded from Postgres): never an empty batch.
            await self._skip_empty([g.group_id for g in chosen])
            return None
        await self.commits.commit(self.store.create_batch, packed, state, consumer)
        for g in chosen:
            groups[g.group_id].state = "batched"
        self.counters["batches_built"] += 1
        self.counters["batched_tokens"] += packed.num_tokens
        self.counters["batched_flat_tokens"] += packed.num_flat_tokens
        return packed

    def _tree_tokens(self, info: GroupInfo, group: ScoredGroup) -> int:
        if info.tree_tokens is None:
            tree = self.state.trees[group.task_id]
            info.tree_tokens = sum(
                len(tree.nodes[n].tokens) for n in tree.nodes_of(e.execution_id for e in group.executions)
            )
        return info.tree_tokens

    async def _skip_empty(self, group_ids: list[str]) -> None:
        """Groups with no generated token to train (no completions, no stored calls): state ``empty``, counted."""
        log.warning("groups with nothing to train are skipped (state 'empty'): %s", ", ".join(group_ids))
        await self.commits.commit(self.store.mark_groups, group_ids, "empty")
        for gid in group_ids:
            self.state.groups[gid].state = "empty"
        self.counters["groups_skipped_empty"] += len(group_ids)

    async def build_announced_batch(self) -> events_pb2.BatchReadyEvent | None:
        """Build a batch when scored groups fill min_batch_fill of the budget or waited batch_max_wait_s."""
        async with self.commits.lock:
            fresh, _ = self._scored_groups(None)
            if not fresh:
                return None
            groups = self.state.groups
            oldest = min(groups[g.group_id].scored_unix_s or 0 for g in fresh)
            # Sum of each group's own tree tokens, computed once per group: an over-estimate of the union
            # when groups share a task, which only builds a batch a little earlier.
            tokens = sum(self._tree_tokens(groups[g.group_id], g) for g in fresh)
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

    def _ready_event(self, p: TreeBatch) -> events_pb2.BatchReadyEvent:
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

    # ------------------------------------------------------------------ pull and ack
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
            if req.stream_part:
                chunks, packed, full = await self._pull_part_once(
                    max_tokens, int(req.step_tokens), current, req.consumer
                )
            else:
                (chunks, packed), full = await self._pull_once(max_tokens, current, req.consumer), False
            if packed is not None:
                await self._announce(packed)
            if chunks:
                self.counters["batches_delivered"] += 1
                self.counters["batch_parts_delivered"] += int(req.stream_part)
                return chunks
            left = deadline - time.monotonic()
            if left <= 0 or full:
                return []
            self.batch_ready.clear()
            try:
                await asyncio.wait_for(self.batch_ready.wait(), timeout=min(left, self.cfg.ready_poll_s))
            except TimeoutError:
                pass

    async def _announce(self, packed: TreeBatch) -> None:
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

    async def _claim_ready_batch(
        self, max_tokens: int, current: int | None, consumer: str
    ) -> list[trajectory_pb2.BatchChunk] | None:
        """The chunks of the oldest ready batch that fits `max_tokens` and the staleness bound, marked
        delivered to `consumer`; None when there is none. A ready batch that does not fit this request
        gives its groups back (scored again, packed anew by the caller). Lock held by the caller."""
        while True:
            b = await asyncio.to_thread(self.store.next_ready_batch)
            if b is None:
                return None
            stale = (
                current is not None
                and b.min_version >= 0
                and b.min_version < current - self.cfg.max_staleness
            )
            if b.num_tokens > max_tokens or stale:
                groups = await asyncio.to_thread(self.store.release_batch, b.batch_id)
                for gid in groups:
                    self.state.groups[gid].state = "scored"
                continue
            if await asyncio.to_thread(self.store.mark_delivered, b.batch_id, consumer):
                return decode_chunks(b.chunks)

    async def _pull_once(
        self, max_tokens: int, current: int | None, consumer: str
    ) -> tuple[list[trajectory_pb2.BatchChunk], TreeBatch | None]:
        """Chunks of a claimed batch and, when it was packed now, the batch (to announce). A batch is
        packed at pull time only from enough scored groups (`_enough`), as the poll loop builds one:
        the trajectory's min_batch_fill and batch_max_wait_s shape every step, and wait_s is only
        how long the request may wait for such a batch."""
        async with self.commits.lock:
            claimed = await self._claim_ready_batch(max_tokens, current, consumer)
            if claimed is not None:
                return claimed, None
            if not self._enough(max_tokens, current):
                await self._drop_stale(current)
                return [], None
            packed = await self._build(max_tokens, current, "delivered", consumer)
            return (packed.chunks, packed) if packed is not None else ([], None)

    async def _pull_part_once(
        self, max_tokens: int, step_tokens: int, current: int | None, consumer: str
    ) -> tuple[list[trajectory_pb2.BatchChunk], TreeBatch | None, bool]:
        """One part of a streamed step (PullBatchRequest.stream_part): a ready batch that fits, or the
        fresh scored groups that fit packed now, even a single group (no min_batch_fill wait). With
        `step_tokens` > 0 the budget is strict, and the third value says the step is full: it already
        holds what a whole batch would (``min_batch_fill`` of its budget, the poll loop's rule, so a
        streamed step trains as many groups as a batch would), or scored groups wait but none fits
        what is left of the budget."""
        budget = min(step_tokens + max_tokens, self.cfg.max_batch_tokens)
        if step_tokens > 0 and step_tokens >= self.cfg.min_batch_fill * budget:
            return [], None, True
        async with self.commits.lock:
            claimed = await self._claim_ready_batch(max_tokens, current, consumer)
            if claimed is not None:
                return claimed, None, False
            strict = step_tokens > 0
            packed = await self._build(max_tokens, current, "delivered", consumer, strict=strict)
            if packed is not None:
                return packed.chunks, packed, False
            waiting = strict and bool(self._scored_groups(current)[0])
            return [], None, waiting

    async def _drop_stale(self, current_version: int | None) -> list[ScoredGroup]:
        """Mark scored groups too old for `current_version` dropped; return the fresh ones (lock held)."""
        fresh, stale = self._scored_groups(current_version)
        if stale:
            await self.commits.commit(self.store.mark_groups, stale, "dropped_stale")
            for gid in stale:
                self.state.groups[gid].state = "dropped_stale"
            self.counters["groups_dropped_stale"] += len(stale)
        return fresh

    def _enough(self, max_tokens: int, current: int | None) -> bool:
        """Scored groups fill min_batch_fill of `max_tokens`, or the oldest waited batch_max_wait_s."""
        fresh, _ = self._scored_groups(current)
        if not fresh:
            return False
        groups = self.state.groups
        tokens = sum(self._tree_tokens(groups[g.group_id], g) for g in fresh)
        oldest = min(groups[g.group_id].scored_unix_s or 0 for g in fresh)
        return (
            tokens >= self.cfg.min_batch_fill * max_tokens
            or time.time() - oldest >= self.cfg.batch_max_wait_s
        )

    async def ack(self, req: trajectory_pb2.AckBatchRequest) -> None:
        """Record that the trainer trained the batch (at ``trained_at_version``); NotFound if unknown."""
        if not await asyncio.to_thread(
            self.store.ack_batch, req.batch_id, req.consumer, req.trained_at_version
        ):
            raise NotFound(f"batch {req.batch_id!r} does not exist in run {self.run_id!r}")
        self.counters["batches_acked"] += 1
