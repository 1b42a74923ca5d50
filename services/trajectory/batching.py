"""Batching: scored groups packed into tree batches, handed to the trainer by PullBatch and acked.

A batch's lifecycle (state in Postgres, table traj_batches)::

    scored groups --pack--> ready (announced: BatchReadyEvent) --PullBatch--> delivered --AckBatch--> acked

- The poll loop builds and announces a batch once scored groups fill ``min_batch_fill`` of
  ``max_batch_tokens`` or the oldest waited ``batch_max_wait_s``.
- PullBatch claims the oldest ready batch within the staleness bound (a stale one is released: its
  groups are dropped or packed anew), whatever its size: the request's token budget shapes only a
  batch packed now, so a ready batch is never repacked because a trainer asked for a different
  budget (a streamed step's strict budget skips a batch that does not fit, leaving it ready). With
  none ready it packs one now (and announces it). The chunks (each at most ``max_chunk_bytes``)
  are streamed from the stored bytes one at a time.
- Delivery (``PullBatchRequest.confirm_receipt``, what the trainer sends): a batch handed out is
  *claimed* for its consumer in memory and stays ``ready`` in Postgres until the consumer acks
  that it holds every chunk (``AckBatch.received``, sent after the trainer journaled it): only then
  is it ``delivered``. A stream that breaks (trainer killed mid-stream, connection lost) drops the
  claim at once; a consumer that pulls again without resuming gives up its unconfirmed claims (it
  restarted, or never got them). Either way the batch is handed out again, same id, same chunks,
  and the trainer's journal (keyed by batch id) trains it once. A service restart forgets claims:
  the batch is still ``ready``. Without confirm_receipt (older clients) the batch becomes delivered
  once its last chunk was sent. A trainer that restarts resumes a journaled batch with
  ``resume_batch_id`` and gets the same chunks.
- A batch that cannot be packed (packing raised, or a chunk over the gRPC message limit) is
  *quarantined*: its groups go to state ``quarantined``, the reason is logged once and counted
  (``batches_quarantined``, in GetStats), and the service goes on with the next groups.
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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from gyre.errors import NotFound
from gyre.rpc import MAX_MESSAGE_BYTES
from gyre.v1 import events_pb2, trajectory_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.packing import ScoredGroup, TreeBatch, iter_framed, pack, select_groups
from services.trajectory.state import CommitQueue, GroupInfo, TrajectoryState
from services.trajectory.store import ChunkWriter, PackFailed, TrajectoryStore

log = logging.getLogger("gyre.trajectory")


@dataclass
class Handout:
    """A batch handed to a consumer by one PullBatch: its stored chunks, read and streamed one at a time."""

    batch_id: str
    consumer: str
    confirm_receipt: bool  # delivered on AckBatch(received), not when the last chunk is sent
    store: TrajectoryStore

    async def chunks(self) -> AsyncIterator[trajectory_pb2.BatchChunk]:
        """The batch's chunks in order, each read from Postgres when the previous one was sent."""
        index = 0
        while (data := await asyncio.to_thread(self.store.read_chunk, self.batch_id, index)) is not None:
            for chunk in iter_framed(data):  # one chunk a row
                yield chunk
            index += 1
        if index == 0:  # a batch stored before traj_batch_chunks: its chunks framed in one value
            for chunk in iter_framed(await asyncio.to_thread(self.store.legacy_chunks, self.batch_id)):
                yield chunk


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
        # batch id -> consumer it is handed to, until it confirms receipt (module docstring, Delivery)
        self.claims: dict[str, str] = {}

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
        batch_id = uuid.uuid4().hex[:16]

        def build(write: ChunkWriter) -> TreeBatch:
            def checked(chunk: trajectory_pb2.BatchChunk) -> None:
                if (size := chunk.ByteSize()) > MAX_MESSAGE_BYTES:
                    raise ValueError(f"a chunk of {size} bytes exceeds the gRPC limit of {MAX_MESSAGE_BYTES}")
                write(chunk)

            return pack(
                self.state.trees,
                chosen,
                batch_id=batch_id,
                max_chunk_bytes=self.cfg.max_chunk_bytes,
                sink=checked,
            )

        built: list[TreeBatch | PackFailed] = []

        def persist() -> None:
            # Packed in the commit's worker thread (lock held: no tree changes meanwhile) and written chunk
            # by chunk in the batch's transaction; the event loop goes on meanwhile.
            try:
                built.append(self.store.create_batch(batch_id, build, state, consumer))
            except PackFailed as exc:  # never a crash: the groups are set aside with the reason
                built.append(exc)

        await self.commits.commit(persist)
        (packed,) = built
        if isinstance(packed, PackFailed):
            await self._quarantine([g.group_id for g in chosen], str(packed))
            return None
        if not packed.num_chunks:
            # Groups scored before the 'empty' check existed (loaded from Postgres): never an empty batch.
            await self._skip_empty([g.group_id for g in chosen])
            return None
        for g in chosen:
            groups[g.group_id].state = "batched"
        self.counters["batches_built"] += 1
        self.counters["batched_tokens"] += packed.num_tokens
        self.counters["batched_flat_tokens"] += packed.num_flat_tokens
        return packed

    async def _quarantine(self, group_ids: list[str], reason: str) -> None:
        """Groups whose batch cannot be built: state ``quarantined``, logged once, counted (lock held)."""
        log.error("batch of groups %s quarantined, not handed out: %s", ", ".join(group_ids), reason)
        await self.commits.commit(self.store.mark_groups, group_ids, "quarantined")
        for gid in group_ids:
            self.state.groups[gid].state = "quarantined"
        self.counters["batches_quarantined"] += 1
        self.counters["groups_quarantined"] += len(group_ids)

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
            num_trees=p.num_trees,
            num_paths=p.num_paths,
            num_tokens=p.num_tokens,
            num_flat_tokens=p.num_flat_tokens,
            min_policy_version=p.min_policy_version,
            max_policy_version=p.max_policy_version,
            num_partial_paths=p.num_partial_paths,
            created_unix_s=time.time(),
        )

    # ------------------------------------------------------------------ pull and ack
    async def pull(self, req: trajectory_pb2.PullBatchRequest) -> Handout | None:
        """The batch handed to ``req.consumer`` (claimed, see Delivery), or None if none by wait_s.
        The caller streams its chunks and then calls `sent`."""
        if req.run_id and req.run_id != self.run_id:
            raise NotFound(f"run {req.run_id!r} is not served here (this service serves {self.run_id!r})")
        if req.resume_batch_id:
            b = await asyncio.to_thread(self.store.get_batch, req.resume_batch_id)
            if b is None or b.run_id != self.run_id:
                raise NotFound(f"batch {req.resume_batch_id!r} does not exist in run {self.run_id!r}")
            if b.state == "ready":
                self.claims[b.batch_id] = req.consumer
            self.counters["batches_resent"] += 1
            return Handout(b.batch_id, req.consumer, req.confirm_receipt, self.store)
        self._give_up_claims(req.consumer)
        max_tokens = int(req.max_tokens) or self.cfg.max_batch_tokens
        current = int(req.current_version) if req.current_version else None
        deadline = time.monotonic() + max(0.0, req.wait_s)
        while True:
            if req.stream_part:
                got, packed, full = await self._pull_part_once(
                    max_tokens, int(req.step_tokens), current, req.consumer
                )
            else:
                (got, packed), full = await self._pull_once(max_tokens, current, req.consumer), False
            if packed is not None:
                await self._announce(packed)
            if got is not None:
                self.counters["batches_handed_out"] += 1
                self.counters["batch_parts_delivered"] += int(req.stream_part)
                return Handout(got, req.consumer, req.confirm_receipt, self.store)
            left = deadline - time.monotonic()
            if left <= 0 or full:
                return None
            self.batch_ready.clear()
            try:
                await asyncio.wait_for(self.batch_ready.wait(), timeout=min(left, self.cfg.ready_poll_s))
            except TimeoutError:
                pass

    async def sent(self, handout: Handout, complete: bool) -> None:
        """After streaming `handout`: a stream that broke gives the batch back (handed out again);
        a complete one without confirm_receipt makes it delivered now."""
        if not complete:
            if self.claims.get(handout.batch_id) == handout.consumer:
                del self.claims[handout.batch_id]
                self.counters["batch_streams_broken"] += 1
                log.warning(
                    "batch %s: stream to %s broke; handed out again", handout.batch_id, handout.consumer
                )
                self.batch_ready.set()
            return
        if not handout.confirm_receipt:
            await self._mark_delivered(handout.batch_id, handout.consumer)

    def _give_up_claims(self, consumer: str) -> None:
        """A consumer pulling anew gives up the batches it never confirmed (Delivery)."""
        for batch_id in [b for b, c in self.claims.items() if c == consumer]:
            del self.claims[batch_id]
            self.counters["batch_claims_given_up"] += 1
            self.batch_ready.set()

    async def _mark_delivered(self, batch_id: str, consumer: str) -> None:
        self.claims.pop(batch_id, None)
        if await asyncio.to_thread(self.store.mark_delivered, batch_id, consumer):
            self.counters["batches_delivered"] += 1

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
        self, max_tokens: int, current: int | None, consumer: str, strict: bool = False
    ) -> str | None:
        """The id of the oldest unclaimed ready batch within the staleness bound, claimed
        for `consumer`; None when there is none. A stale ready batch gives its groups back (dropped
        or packed anew by the caller); with `strict`, one over `max_tokens` is skipped (left ready).
        The budget never releases a ready batch. Lock held by the caller."""
        skip: set[str] = set()
        while True:
            b = await asyncio.to_thread(self.store.next_ready_batch, set(self.claims) | skip)
            if b is None:
                return None
            stale = (
                current is not None
                and b.min_version >= 0
                and b.min_version < current - self.cfg.max_staleness
            )
            if stale:
                groups = await asyncio.to_thread(self.store.release_batch, b.batch_id)
                for gid in groups:
                    self.state.groups[gid].state = "scored"
                continue
            if strict and b.num_tokens > max_tokens:
                skip.add(b.batch_id)
                continue
            self.claims[b.batch_id] = consumer
            return b.batch_id

    async def _pull_once(
        self, max_tokens: int, current: int | None, consumer: str
    ) -> tuple[str | None, TreeBatch | None]:
        """A claimed batch's id and, when it was packed now, the batch (to announce). A batch
        is packed at pull time only from enough scored groups (`_enough`), as the poll loop builds
        one: the trajectory's min_batch_fill and batch_max_wait_s shape every step, and wait_s is only
        how long the request may wait for such a batch."""
        async with self.commits.lock:
            claimed = await self._claim_ready_batch(max_tokens, current, consumer)
            if claimed is not None:
                return claimed, None
            if not self._enough(max_tokens, current):
                await self._drop_stale(current)
                return None, None
            packed = await self._build(max_tokens, current, "ready", consumer)
            if packed is None:
                return None, None
            self.claims[packed.batch_id] = consumer
            return packed.batch_id, packed

    async def _pull_part_once(
        self, max_tokens: int, step_tokens: int, current: int | None, consumer: str
    ) -> tuple[str | None, TreeBatch | None, bool]:
        """One part of a streamed step (PullBatchRequest.stream_part): a ready batch that fits, or the
        fresh scored groups that fit packed now, even a single group (no min_batch_fill wait). With
        `step_tokens` > 0 the budget is strict, and the third value says the step is full: it already
        holds what a whole batch would (``min_batch_fill`` of its budget, the poll loop's rule, so a
        streamed step trains as many groups as a batch would), or scored groups wait but none fits
        what is left of the budget."""
        budget = min(step_tokens + max_tokens, self.cfg.max_batch_tokens)
        if step_tokens > 0 and step_tokens >= self.cfg.min_batch_fill * budget:
            return None, None, True
        async with self.commits.lock:
            strict = step_tokens > 0
            claimed = await self._claim_ready_batch(max_tokens, current, consumer, strict)
            if claimed is not None:
                return claimed, None, False
            packed = await self._build(max_tokens, current, "ready", consumer, strict=strict)
            if packed is not None:
                self.claims[packed.batch_id] = consumer
                return packed.batch_id, packed, False
            waiting = strict and bool(self._scored_groups(current)[0])
            return None, None, waiting

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
        """Record that the consumer holds the whole batch (``received``: it becomes delivered) or
        trained it (at ``trained_at_version``); NotFound if unknown."""
        if req.received:
            b = await asyncio.to_thread(self.store.get_batch, req.batch_id)
            if b is None or b.run_id != self.run_id:
                raise NotFound(f"batch {req.batch_id!r} does not exist in run {self.run_id!r}")
            await self._mark_delivered(req.batch_id, req.consumer)
            return
        self.claims.pop(req.batch_id, None)
        if not await asyncio.to_thread(
            self.store.ack_batch, req.batch_id, req.consumer, req.trained_at_version
        ):
            raise NotFound(f"batch {req.batch_id!r} does not exist in run {self.run_id!r}")
        self.counters["batches_acked"] += 1
