"""Tables of the trajectory service (prefix ``traj_``), SQLAlchemy 2 declarative.

Token data is compact: a node's segment is one ``bytea`` of little-endian int32 ids, a call's
completion log-probs one ``bytea`` of float32 and its versions one ``bytea`` of int64; there is
never a row per token. Node ids are allocated by the service (max stored id + 1 at start).

Guarantees the schema enforces:
- a call is stored once: primary key (run_id, execution_id, call_seq);
- a group is packed into at most one batch: unique (run_id, group_id) in ``traj_batch_groups``;
- a path (execution, leaf node) is handed out at most once: unique key in ``traj_batch_paths``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "traj_runs"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    created_unix_s: Mapped[float] = mapped_column(sa.Float)


class Task(Base):
    __tablename__ = "traj_tasks"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    task_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)


class ExecutionGroup(Base):
    """One group of executions of a task (GRPO group). state: open -> scored -> batched | dropped_stale | rejected | empty (nothing generated to train)."""

    __tablename__ = "traj_execution_groups"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    group_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    task_id: Mapped[str] = mapped_column(sa.String(128))
    state: Mapped[str] = mapped_column(sa.String(16), default="open")
    scored_unix_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    min_version: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    max_version: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    reward_mean: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    reward_std: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    __table_args__ = (sa.Index("ix_traj_groups_state", "run_id", "state"),)


class Execution(Base):
    """ending: running | finished | truncated | failed. num_calls: from the end event (None until then)."""

    __tablename__ = "traj_executions"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    execution_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    group_id: Mapped[str] = mapped_column(sa.String(128))
    task_id: Mapped[str] = mapped_column(sa.String(128))
    ending: Mapped[str] = mapped_column(sa.String(16), default="running")
    reward: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    num_calls: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    environment: Mapped[str] = mapped_column(sa.String(128), default="")
    error: Mapped[str] = mapped_column(sa.Text, default="")
    ended_unix_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    __table_args__ = (sa.Index("ix_traj_executions_group", "run_id", "group_id"),)


class TreeNode(Base):
    """A token segment. ``start`` = position of its first token in every sequence through it."""

    __tablename__ = "traj_tree_nodes"
    node_id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(sa.String(128))
    task_id: Mapped[str] = mapped_column(sa.String(128))
    parent_id: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    start: Mapped[int] = mapped_column(sa.Integer)
    num_tokens: Mapped[int] = mapped_column(sa.Integer)
    tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int32 little-endian
    segment_hash: Mapped[bytes] = mapped_column(sa.LargeBinary(16))
    __table_args__ = (
        sa.Index("ix_traj_nodes_task", "run_id", "task_id"),
        sa.Index("ix_traj_nodes_hash", "segment_hash"),
    )


class Call(Base):
    """One LLM call: its sequence is the root-to-``end_node_id`` tokens; completion starts at ``prompt_len``."""

    __tablename__ = "traj_calls"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    execution_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    call_seq: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(sa.String(128))
    group_id: Mapped[str] = mapped_column(sa.String(128))
    end_node_id: Mapped[int] = mapped_column(sa.BigInteger)
    prompt_len: Mapped[int] = mapped_column(sa.Integer)
    total_len: Mapped[int] = mapped_column(sa.Integer)
    completion_logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)  # float32
    completion_versions: Mapped[bytes] = mapped_column(sa.LargeBinary)  # int64
    agent_id: Mapped[str] = mapped_column(sa.String(128), default="main")
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    context_event: Mapped[str] = mapped_column(sa.String(32), default="")
    num_migrations: Mapped[int] = mapped_column(sa.Integer, default=0)
    received_unix_s: Mapped[float] = mapped_column(sa.Float)
    __table_args__ = (sa.Index("ix_traj_calls_task", "run_id", "task_id"),)


class Score(Base):
    __tablename__ = "traj_scores"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    execution_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    group_id: Mapped[str] = mapped_column(sa.String(128))
    reward: Mapped[float] = mapped_column(sa.Float)
    partial: Mapped[bool] = mapped_column(sa.Boolean)
    source: Mapped[str] = mapped_column(sa.String(16))
    advantage: Mapped[float] = mapped_column(sa.Float)
    representative_id: Mapped[str] = mapped_column(sa.String(128))
    multiplicity: Mapped[int] = mapped_column(sa.Integer)
    dedup_weight: Mapped[float] = mapped_column(sa.Float)
    __table_args__ = (sa.Index("ix_traj_scores_group", "run_id", "group_id"),)


class DedupRecord(Base):
    __tablename__ = "traj_dedup_records"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(sa.String(128))
    group_id: Mapped[str] = mapped_column(sa.String(128))
    execution_id: Mapped[str] = mapped_column(sa.String(128))
    kind: Mapped[str] = mapped_column(sa.String(16))
    other_execution_id: Mapped[str] = mapped_column(sa.String(128))
    similarity: Mapped[float] = mapped_column(sa.Float)
    weight: Mapped[float] = mapped_column(sa.Float)
    reason: Mapped[str] = mapped_column(sa.Text)
    __table_args__ = (sa.Index("ix_traj_dedup_group", "run_id", "group_id"),)


class Batch(Base):
    """state: ready (built, announced; handed out but not confirmed) -> delivered (the consumer confirmed it holds every chunk) -> acked. Its chunks are rows of traj_batch_chunks; ``chunks`` (length-prefixed BatchChunk bytes, never loaded with the row) holds those of a batch stored before them."""

    __tablename__ = "traj_batches"
    batch_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(sa.String(128))
    state: Mapped[str] = mapped_column(sa.String(16))
    created_unix_s: Mapped[float] = mapped_column(sa.Float)
    consumer: Mapped[str] = mapped_column(sa.String(128), default="")
    delivered_unix_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    acked_unix_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    trained_at_version: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    num_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    num_flat_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    num_paths: Mapped[int] = mapped_column(sa.Integer)
    num_partial_paths: Mapped[int] = mapped_column(sa.Integer)
    min_version: Mapped[int] = mapped_column(sa.BigInteger)
    max_version: Mapped[int] = mapped_column(sa.BigInteger)
    chunks: Mapped[bytes | None] = mapped_column(sa.LargeBinary, nullable=True, deferred=True)
    __table_args__ = (sa.Index("ix_traj_batches_state", "run_id", "state", "created_unix_s"),)


class BatchChunkRow(Base):
    """One BatchChunk of a batch (proto gyre.v1.BatchChunk), framed (`packing.frame`), written as packing makes it."""

    __tablename__ = "traj_batch_chunks"
    batch_id: Mapped[str] = mapped_column(
        sa.String(64), sa.ForeignKey("traj_batches.batch_id", ondelete="CASCADE"), primary_key=True
    )
    chunk_index: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(sa.LargeBinary)


class BatchGroup(Base):
    __tablename__ = "traj_batch_groups"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    group_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)  # at most one batch per group
    batch_id: Mapped[str] = mapped_column(sa.String(64), index=True)


class BatchPath(Base):
    __tablename__ = "traj_batch_paths"
    run_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    execution_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    leaf_node_id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    batch_id: Mapped[str] = mapped_column(sa.String(64), index=True)


class Rejection(Base):
    """An event that could not be used (NaN reward, malformed step): kept whole, with the reason."""

    __tablename__ = "traj_rejections"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(sa.String(128))
    kind: Mapped[str] = mapped_column(sa.String(16))  # "step" | "execution"
    key: Mapped[str] = mapped_column(sa.String(256))
    error: Mapped[str] = mapped_column(sa.Text)
    payload: Mapped[bytes] = mapped_column(sa.LargeBinary)
    created_unix_s: Mapped[float] = mapped_column(sa.Float)
    __table_args__ = (sa.Index("ix_traj_rejections_run", "run_id"),)
