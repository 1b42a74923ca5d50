"""batch chunks: one row per BatchChunk, written as packing makes them

A batch's chunks were one bytea (traj_batches.chunks): packing a million-token group held the whole
framed batch in memory, and every read of the batch row loaded it. Each chunk is now its own row,
written as it is packed and streamed back one at a time; traj_batches.chunks stays for batches
stored before (NULL for new ones).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-08 02:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "traj_batch_chunks",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("chunk_index", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),  # length-prefixed (packing.frame)
        sa.ForeignKeyConstraint(["batch_id"], ["traj_batches.batch_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "chunk_index"),
    )
    op.alter_column("traj_batches", "chunks", existing_type=sa.LargeBinary(), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE traj_batches SET chunks = '' WHERE chunks IS NULL")
    op.alter_column("traj_batches", "chunks", existing_type=sa.LargeBinary(), nullable=False)
    op.drop_table("traj_batch_chunks")
