"""Postgres persistence of the trajectory service (sync; async code calls it via asyncio.to_thread).

Every write of one ingest batch, one scored group or one batch is a single transaction, so a
crash leaves either all of it or none of it. Inserts of calls use ON CONFLICT DO NOTHING on
(run_id, execution_id, call_seq): a redelivered step is a no-op even if two writers race.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlalchemy.dialects.postgresql import insert as pg_insert

from gyre.store import session_scope
from gyre.v1 import trajectory_pb2
from services.trajectory import models as m
from services.trajectory.packing import TreeBatch, frame
from services.trajectory.tree import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    CallRecord,
    Node,
    NodeIds,
    TaskTree,
)


@dataclass(slots=True)
class NewCall:
    """A call inserted in memory, waiting to be committed."""

    task_id: str
    group_id: str
    record: CallRecord
    progress: dict[str, Any] | None
    context_event: str
    num_migrations: int


@dataclass(slots=True)
class StepBatch:
    tasks: set[str] = field(default_factory=set)
    groups: dict[str, str] = field(default_factory=dict)  # group -> task
    executions: dict[str, tuple[str, str]] = field(default_factory=dict)  # execution -> (group, task)
    calls: list[NewCall] = field(default_factory=list)
    nodes: dict[int, tuple[str, Node]] = field(
        default_factory=dict
    )  # node id -> (task, node), created or modified
    created: set[int] = field(default_factory=set)
    rejections: list[tuple[str, str, str, bytes]] = field(default_factory=list)  # kind, key, error, payload


class PackFailed(Exception):
    """Packing raised inside `TrajectoryStore.create_batch`: nothing was written; the packer's error
    is the cause (the batch is quarantined, not retried)."""


class _WriteFailed(Exception):
    """A chunk's write failed (a Postgres error, not the packer's): re-raised as that error."""


class _NothingPacked(Exception):
    def __init__(self, packed: TreeBatch) -> None:
        self.packed = packed


ChunkWriter = Callable[[trajectory_pb2.BatchChunk], None]


_NODE_COLS = "node_id, run_id, task_id, parent_id, start, num_tokens, tokens, segment_hash"
_CALL_COLS = (
    "run_id, execution_id, call_seq, task_id, group_id, end_node_id, prompt_len, total_len, completion_logprobs, "
    "completion_versions, agent_id, progress, context_event, num_migrations, received_unix_s"
)

_NODE_TYPES = ["int8", "varchar", "varchar", "int8", "int4", "int4", "bytea", "bytea"]
_CALL_TYPES = [
    "varchar",
    "varchar",
    "int4",
    "varchar",
    "varchar",
    "int8",
    "int4",
    "int4",
    "bytea",
    "bytea",
    "varchar",
    "jsonb",
    "varchar",
    "int4",
    "float8",
]


def _insert_new(model: Any) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` on the model's table, for executemany (compiled once, cached)."""
    return pg_insert(model.__table__).on_conflict_do_nothing()


class TrajectoryStore:
    def __init__(self, engine: sa.Engine, run_id: str) -> None:
        self.engine = engine
        self.run_id = run_id

    # ------------------------------------------------------------------ ingest
    def commit_steps(self, batch: StepBatch) -> None:
        now = time.time()
        rid = self.run_id
        with session_scope(self.engine) as s:
            s.execute(pg_insert(m.Run).values(run_id=rid, created_unix_s=now).on_conflict_do_nothing())
            # executemany of one cached statement: a multi-VALUES insert of n rows is compiled anew for
            # every n (it was a third of the consumer's time).
            if batch.tasks:
                s.execute(_insert_new(m.Task), [{"run_id": rid, "task_id": t} for t in sorted(batch.tasks)])
            if batch.groups:
                s.execute(
                    _insert_new(m.ExecutionGroup),
                    [
                        {"run_id": rid, "group_id": g, "task_id": t, "state": "open"}
                        for g, t in sorted(batch.groups.items())
                    ],
                )
            if batch.executions:
                s.execute(
                    _insert_new(m.Execution),
                    [
                        {
                            "run_id": rid,
                            "execution_id": e,
                            "group_id": g,
                            "task_id": t,
                            "ending": "running",
                            "environment": "",
                            "error": "",
                        }
                        for e, (g, t) in sorted(batch.executions.items())
                    ],
                )
            node_new: list[tuple[Any, ...]] = []
            node_upd: list[tuple[Any, ...]] = []
            for nid, (task, node) in batch.nodes.items():
                row = (
                    nid,
                    rid,
                    task,
                    node.parent.node_id if node.parent is not None and node.parent.node_id >= 0 else None,
                    node.start,
                    len(node.tokens),
                    node.tokens.astype("<i4").tobytes(),
                    node.segment_hash(),
                )
                (node_new if nid in batch.created else node_upd).append(row)
            call_rows = [
                (
                    rid,
                    c.record.execution_id,
                    c.record.call_seq,
                    c.task_id,
                    c.group_id,
                    c.record.end_node.node_id,
                    c.record.prompt_len,
                    c.record.total_len,
                    c.record.completion_logprobs.astype("<f4").tobytes(),
                    c.record.completion_versions.astype("<i8").tobytes(),
                    c.record.agent_id,
                    Jsonb(c.progress) if c.progress is not None else None,
                    c.context_event,
                    c.num_migrations,
                    now,
                )
                for c in batch.calls
            ]
            # COPY, not INSERT: compiling thousands of bound parameters costs more than the write.
            cur = s.connection().connection.driver_connection.cursor()  # type: ignore[union-attr]
            if node_new:
                with cur.copy(f"COPY traj_tree_nodes ({_NODE_COLS}) FROM STDIN (FORMAT BINARY)") as cp:
                    cp.set_types(_NODE_TYPES)
                    for r in node_new:
                        cp.write_row(r)
            if node_upd:
                cur.execute(
                    "CREATE TEMP TABLE IF NOT EXISTS traj_tmp_nodes (LIKE traj_tree_nodes) ON COMMIT DELETE ROWS"
                )
                with cur.copy(f"COPY traj_tmp_nodes ({_NODE_COLS}) FROM STDIN (FORMAT BINARY)") as cp:
                    cp.set_types(_NODE_TYPES)
                    for r in node_upd:
                        cp.write_row(r)
                cur.execute(
                    "UPDATE traj_tree_nodes n SET parent_id = t.parent_id, start = t.start, num_tokens = t.num_tokens, "
                    "tokens = t.tokens, segment_hash = t.segment_hash FROM traj_tmp_nodes t WHERE n.node_id = t.node_id"
                )
            if call_rows:
                cur.execute(
                    "CREATE TEMP TABLE IF NOT EXISTS traj_tmp_calls (LIKE traj_calls) ON COMMIT DELETE ROWS"
                )
                with cur.copy(f"COPY traj_tmp_calls ({_CALL_COLS}) FROM STDIN (FORMAT BINARY)") as cp:
                    cp.set_types(_CALL_TYPES)
                    for r in call_rows:
                        cp.write_row(r)
                cur.execute(
                    f"INSERT INTO traj_calls ({_CALL_COLS}) SELECT {_CALL_COLS} FROM traj_tmp_calls ON CONFLICT DO NOTHING"
                )
            self._rejections(s, batch.rejections, now)

    def _rejections(self, s: Any, rejections: list[tuple[str, str, str, bytes]], now: float) -> None:
        if rejections:
            s.execute(
                sa.insert(m.Rejection),
                [
                    {
                        "run_id": self.run_id,
                        "kind": k,
                        "key": key,
                        "error": err,
                        "payload": p,
                        "created_unix_s": now,
                    }
                    for k, key, err, p in rejections
                ],
            )

    def commit_executions(
        self, rows: list[dict[str, Any]], rejections: list[tuple[str, str, str, bytes]]
    ) -> None:
        """Upsert execution rows; an execution that already ended keeps its first ending."""
        now = time.time()
        with session_scope(self.engine) as s:
            s.execute(
                pg_insert(m.Run).values(run_id=self.run_id, created_unix_s=now).on_conflict_do_nothing()
            )
            for r in rows:
                s.execute(
                    pg_insert(m.Task)
                    .values(run_id=self.run_id, task_id=r["task_id"])
                    .on_conflict_do_nothing()
                )
                s.execute(
                    pg_insert(m.ExecutionGroup)
                    .values(run_id=self.run_id, group_id=r["group_id"], task_id=r["task_id"], state="open")
                    .on_conflict_do_nothing()
                )
                stmt = pg_insert(m.Execution).values(run_id=self.run_id, **r)
                if r["ending"] != "running":
                    stmt = stmt.on_conflict_do_update(
                        index_elements=["run_id", "execution_id"],
                        set_={
                            k: stmt.excluded[k]
                            for k in (
                                "ending",
                                "reward",
                                "progress",
                                "num_calls",
                                "environment",
                                "error",
                                "ended_unix_s",
                            )
                        },
                        where=m.Execution.ending == "running",
                    )
                else:
                    stmt = stmt.on_conflict_do_nothing()
                s.execute(stmt)
            self._rejections(s, rejections, now)

    # ------------------------------------------------------------------ scoring
    def commit_group(
        self,
        group_id: str,
        state: str,
        scores: list[dict[str, Any]],
        dedup: list[dict[str, Any]],
        extra: dict[str, Any],
    ) -> None:
        with session_scope(self.engine) as s:
            if scores:
                s.execute(
                    pg_insert(m.Score)
                    .values([{"run_id": self.run_id, **r} for r in scores])
                    .on_conflict_do_nothing()
                )
            if dedup:
                s.execute(
                    sa.insert(m.DedupRecord),
                    [{"run_id": self.run_id, "group_id": group_id, **r} for r in dedup],
                )
            s.execute(
                sa.update(m.ExecutionGroup)
                .where(m.ExecutionGroup.run_id == self.run_id, m.ExecutionGroup.group_id == group_id)
                .values(state=state, scored_unix_s=time.time(), **extra)
            )

    # ------------------------------------------------------------------ batches
    def create_batch(
        self, batch_id: str, build: Callable[[ChunkWriter], TreeBatch], state: str, consumer: str = ""
    ) -> TreeBatch:
        """Pack and persist a batch in one transaction, claiming its groups and paths (IntegrityError if
        any was already claimed). ``build(write)`` packs it, handing each chunk to ``write`` as it is
        made: a chunk is one row, written at once, so memory holds one chunk, never the batch.
        A batch with no chunk writes nothing (returned as packed); PackFailed if `build` raised."""
        now = time.time()
        try:
            with session_scope(self.engine) as s:
                s.execute(
                    sa.insert(m.Batch).values(
                        batch_id=batch_id,
                        run_id=self.run_id,
                        state=state,
                        created_unix_s=now,
                        consumer=consumer,
                        delivered_unix_s=now if state == "delivered" else None,
                        num_tokens=0,
                        num_flat_tokens=0,
                        num_paths=0,
                        num_partial_paths=0,
                        min_version=-1,
                        max_version=-1,
                    )
                )
                cur = s.connection().connection.driver_connection.cursor()  # type: ignore[union-attr]

                def write(chunk: trajectory_pb2.BatchChunk) -> None:
                    # Framed (length first, as `packing.frame`): Postgres's pglz gives up on a value whose
                    # first KiB repeats nothing, which a chunk's leading token ids never do; the length's
                    # zero bytes get it going (a chunk row then takes ~8 bytes per token, not ~20).
                    # %b: the bytes go as binary, not as hex text twice their size.
                    try:
                        cur.execute(
                            "INSERT INTO traj_batch_chunks (batch_id, chunk_index, data) VALUES (%s, %s, %b)",
                            (batch_id, chunk.chunk_index, frame(chunk)),
                        )
                    except Exception as exc:
                        raise _WriteFailed from exc

                try:
                    packed = build(write)
                except _WriteFailed as exc:
                    assert exc.__cause__ is not None
                    raise exc.__cause__ from None
                except Exception as exc:
                    raise PackFailed(f"{type(exc).__name__}: {exc}") from exc
                if not packed.num_chunks:
                    raise _NothingPacked(packed)
                self._claim(s, packed)
        except _NothingPacked as nothing:
            return nothing.packed
        return packed

    def _claim(self, s: Any, packed: TreeBatch) -> None:
        """The batch row's figures, its groups (batched) and paths, in the batch's transaction."""
        s.execute(
            sa.update(m.Batch)
            .where(m.Batch.batch_id == packed.batch_id)
            .values(
                num_tokens=packed.num_tokens,
                num_flat_tokens=packed.num_flat_tokens,
                num_paths=packed.num_paths,
                num_partial_paths=packed.num_partial_paths,
                min_version=packed.min_policy_version,
                max_version=packed.max_policy_version,
            )
        )
        s.execute(
            sa.insert(m.BatchGroup),
            [{"run_id": self.run_id, "group_id": g, "batch_id": packed.batch_id} for g in packed.group_ids],
        )
        if packed.paths:
            s.execute(
                sa.insert(m.BatchPath),
                [
                    {"run_id": self.run_id, "execution_id": e, "leaf_node_id": n, "batch_id": packed.batch_id}
                    for e, n in packed.paths
                ],
            )
        s.execute(
            sa.update(m.ExecutionGroup)
            .where(m.ExecutionGroup.run_id == self.run_id, m.ExecutionGroup.group_id.in_(packed.group_ids))
            .values(state="batched")
        )

    def read_chunk(self, batch_id: str, index: int) -> bytes | None:
        """Chunk `index` of a batch, framed (`packing.iter_framed` decodes it); None past its last chunk."""
        with self.engine.connect() as conn:
            cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            cur.execute(
                "SELECT data FROM traj_batch_chunks WHERE batch_id = %s AND chunk_index = %s",
                (batch_id, index),
                binary=True,
            )
            row = cur.fetchone()
            return None if row is None else bytes(row[0])

    def legacy_chunks(self, batch_id: str) -> bytes:
        """The framed chunks of a batch stored before traj_batch_chunks existed (b"" for others)."""
        with session_scope(self.engine) as s:
            data = s.scalar(sa.select(m.Batch.chunks).where(m.Batch.batch_id == batch_id))
            return bytes(data or b"")

    def release_batch(self, batch_id: str) -> list[str]:
        """Delete a batch that was never delivered; its groups become scored (packable) again."""
        with session_scope(self.engine) as s:
            b = s.get(m.Batch, batch_id, with_for_update=True)
            if b is None or b.state != "ready":
                return []
            groups = list(
                s.scalars(sa.select(m.BatchGroup.group_id).where(m.BatchGroup.batch_id == batch_id))
            )
            s.execute(sa.delete(m.BatchChunkRow).where(m.BatchChunkRow.batch_id == batch_id))
            s.execute(sa.delete(m.BatchPath).where(m.BatchPath.batch_id == batch_id))
            s.execute(sa.delete(m.BatchGroup).where(m.BatchGroup.batch_id == batch_id))
            s.execute(
                sa.update(m.ExecutionGroup)
                .where(m.ExecutionGroup.run_id == self.run_id, m.ExecutionGroup.group_id.in_(groups))
                .values(state="scored")
            )
            s.delete(b)
            return groups

    def next_ready_batch(self, exclude: Collection[str] = ()) -> m.Batch | None:
        """The oldest ready batch whose id is not in `exclude` (batches claimed by a consumer)."""
        with session_scope(self.engine) as s:
            return s.scalars(
                sa.select(m.Batch)
                .where(
                    m.Batch.run_id == self.run_id,
                    m.Batch.state == "ready",
                    m.Batch.batch_id.not_in(list(exclude)),
                )
                .order_by(m.Batch.created_unix_s)
                .limit(1)
            ).first()

    def mark_delivered(self, batch_id: str, consumer: str) -> bool:
        """ready -> delivered, atomically; False if someone else took it first."""
        with session_scope(self.engine) as s:
            res = s.execute(
                sa.update(m.Batch)
                .where(m.Batch.batch_id == batch_id, m.Batch.state == "ready")
                .values(state="delivered", consumer=consumer, delivered_unix_s=time.time())
            )
            return bool(res.rowcount)  # type: ignore[attr-defined]

    def get_batch(self, batch_id: str) -> m.Batch | None:
        with session_scope(self.engine) as s:
            return s.get(m.Batch, batch_id)

    def ack_batch(self, batch_id: str, consumer: str, version: int) -> bool:
        with session_scope(self.engine) as s:
            b = s.get(m.Batch, batch_id)
            if b is None or b.run_id != self.run_id:
                return False
            b.state, b.acked_unix_s, b.trained_at_version = "acked", time.time(), version
            return True

    def mark_groups(self, group_ids: list[str], state: str) -> None:
        with session_scope(self.engine) as s:
            s.execute(
                sa.update(m.ExecutionGroup)
                .where(m.ExecutionGroup.run_id == self.run_id, m.ExecutionGroup.group_id.in_(group_ids))
                .values(state=state)
            )

    # ------------------------------------------------------------------ loading
    def load(
        self, ids: NodeIds
    ) -> tuple[dict[str, TaskTree], list[m.Execution], list[m.ExecutionGroup], list[m.Call], list[m.Score]]:
        """Everything needed to continue after a restart: trees (nodes in parent-first order), calls, states."""
        trees: dict[str, TaskTree] = {}
        with session_scope(self.engine) as s:
            max_id = s.scalar(sa.select(sa.func.max(m.TreeNode.node_id))) or 0
            ids.next_id = max(ids.next_id, int(max_id) + 1)
            rows = s.execute(
                sa.select(
                    m.TreeNode.node_id,
                    m.TreeNode.task_id,
                    m.TreeNode.parent_id,
                    m.TreeNode.start,
                    m.TreeNode.tokens,
                )
                .where(m.TreeNode.run_id == self.run_id)
                .order_by(m.TreeNode.start)
            ).all()
            pending = sorted(rows, key=lambda r: r.start)  # a parent always starts before its child
            for r in pending:
                tree = trees.setdefault(r.task_id, TaskTree(r.task_id, ids))
                tree.attach_node(
                    r.node_id, r.parent_id, np.frombuffer(r.tokens, dtype="<i4").astype(TOKEN_DTYPE), r.start
                )
            calls = list(s.scalars(sa.select(m.Call).where(m.Call.run_id == self.run_id)))
            for c in calls:
                tree = trees[c.task_id]
                end = tree.nodes[c.end_node_id]
                end.num_call_ends += 1
                tree.add_record(
                    CallRecord(
                        c.execution_id,
                        c.call_seq,
                        end,
                        c.prompt_len,
                        np.frombuffer(c.completion_logprobs, dtype="<f4").astype(LOGPROB_DTYPE),
                        np.frombuffer(c.completion_versions, dtype="<i8").astype(VERSION_DTYPE),
                        c.agent_id,
                    )
                )
            executions = list(s.scalars(sa.select(m.Execution).where(m.Execution.run_id == self.run_id)))
            groups = list(
                s.scalars(sa.select(m.ExecutionGroup).where(m.ExecutionGroup.run_id == self.run_id))
            )
            scores = list(s.scalars(sa.select(m.Score).where(m.Score.run_id == self.run_id)))
        return trees, executions, groups, calls, scores

    def counts(self) -> dict[str, float]:
        with session_scope(self.engine) as s:
            out: dict[str, float] = {}
            models: list[tuple[str, Any]] = [
                ("stored_calls", m.Call),
                ("stored_nodes", m.TreeNode),
                ("rejections", m.Rejection),
                ("dedup_records", m.DedupRecord),
            ]
            for name, model in models:
                out[name] = float(
                    s.scalar(sa.select(sa.func.count()).select_from(model).where(model.run_id == self.run_id))
                    or 0
                )
            for state, n in s.execute(
                sa.select(m.Batch.state, sa.func.count())
                .where(m.Batch.run_id == self.run_id)
                .group_by(m.Batch.state)
            ).all():
                out[f"batches_{state}"] = float(n)
            return out
