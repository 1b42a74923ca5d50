"""Scheduler tables: workers, devices, leases, lease events (outbox), settings.

Revision ID: sched_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sched_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sched_workers",
        sa.Column("worker_id", sa.String(128), primary_key=True),
        sa.Column("service", sa.String(32), nullable=False),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("last_heartbeat_unix_s", sa.Double, nullable=False),
        sa.Column("alive", sa.Boolean, nullable=False),
    )
    op.create_table(
        "sched_devices",
        sa.Column("device_id", sa.String(128), primary_key=True),
        sa.Column("node", sa.String(128), nullable=False),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
    )
    op.create_table(
        "sched_leases",
        sa.Column("device_id", sa.String(128), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("target_role", sa.String(16), nullable=False),
        sa.Column("target_holder", sa.String(128), nullable=False),
        sa.Column("deadline_unix_s", sa.Double, nullable=False),
        sa.Column("updated_unix_s", sa.Double, nullable=False),
    )
    op.create_table(
        "sched_lease_events",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(64), nullable=False, unique=True),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("published", sa.Boolean, nullable=False),
        sa.Column("created_unix_s", sa.Double, nullable=False),
    )
    op.create_index("ix_sched_lease_events_device_id", "sched_lease_events", ["device_id"])
    op.create_index("ix_sched_lease_events_published", "sched_lease_events", ["published"])
    op.create_table(
        "sched_settings",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )


def downgrade() -> None:
    for table in ("sched_settings", "sched_lease_events", "sched_leases", "sched_devices", "sched_workers"):
        op.drop_table(table)
