"""Postgres tables of the scheduler (its own declarative Base; names prefixed `sched_`).

- sched_workers: registered workers and their last heartbeat (liveness).
- sched_devices: the pool; one row per device (or logical CPU slot).
- sched_leases: who may use each device, with the fencing epoch and the handoff in progress.
- sched_lease_events: every lease change, written in the same transaction as the change (an
  outbox): the service publishes unpublished rows to NATS after commit, with event_id as the
  JetStream message ID, so a crash between commit and publish loses no event and duplicates none.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Double, Integer, LargeBinary, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class WorkerRow(Base):
    __tablename__ = "sched_workers"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    service: Mapped[str] = mapped_column(String(32))
    address: Mapped[str] = mapped_column(String(256), default="")
    last_heartbeat_unix_s: Mapped[float] = mapped_column(Double)
    alive: Mapped[bool] = mapped_column(Boolean, default=True)


class DeviceRow(Base):
    __tablename__ = "sched_devices"

    device_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), default="")
    index: Mapped[int] = mapped_column(Integer, default=0)
    kind: Mapped[str] = mapped_column(String(32), default="")


class LeaseRow(Base):
    __tablename__ = "sched_leases"

    device_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    holder: Mapped[str] = mapped_column(String(128), default="")
    epoch: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    target_role: Mapped[str] = mapped_column(String(16), default="")
    target_holder: Mapped[str] = mapped_column(String(128), default="")
    deadline_unix_s: Mapped[float] = mapped_column(Double, default=0.0)
    updated_unix_s: Mapped[float] = mapped_column(Double, default=0.0)


class LeaseEventRow(Base):
    __tablename__ = "sched_lease_events"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64), unique=True)
    device_id: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    epoch: Mapped[int] = mapped_column(BigInteger)
    # The serialized gyre.v1.LeaseEvent, ready to publish.
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    published: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    created_unix_s: Mapped[float] = mapped_column(Double)


class SettingRow(Base):
    """Scheduler settings that survive restarts (the policy set by SetPolicy)."""

    __tablename__ = "sched_settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
