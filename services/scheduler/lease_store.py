"""Postgres LeaseStore: one SQLAlchemy transaction per LeaseBook call, leases locked FOR UPDATE.

Each LeaseChange is stored in sched_lease_events (the outbox) in the same transaction as the lease
it describes; `unpublished()` / `mark_published()` let the service publish them after commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gyre.store import session_scope
from services.scheduler.leases import DeviceInfo, Lease, LeaseChange, LeaseState, LeaseTx, Worker
from services.scheduler.models import DeviceRow, LeaseEventRow, LeaseRow, SettingRow, WorkerRow
from services.scheduler.policies import Role
from services.scheduler.wire import lease_event


def _lease(row: LeaseRow) -> Lease:
    return Lease(
        device_id=row.device_id,
        role=Role(row.role),
        holder=row.holder,
        epoch=row.epoch,
        state=LeaseState(row.state),
        target_role=Role(row.target_role) if row.target_role else None,
        target_holder=row.target_holder,
        deadline_unix_s=row.deadline_unix_s,
        updated_unix_s=row.updated_unix_s,
    )


class _PgTx:
    def __init__(self, session: Session, run_id: str) -> None:
        self.s = session
        self.run_id = run_id

    def lease(self, device_id: str) -> Lease | None:
        row = self.s.get(LeaseRow, device_id, with_for_update=True)
        return None if row is None else _lease(row)

    def leases(self) -> list[Lease]:
        return [_lease(r) for r in self.s.scalars(sa.select(LeaseRow).order_by(LeaseRow.device_id))]

    def save_lease(self, lease: Lease) -> None:
        self.s.merge(
            LeaseRow(
                device_id=lease.device_id,
                role=str(lease.role),
                holder=lease.holder,
                epoch=lease.epoch,
                state=str(lease.state),
                target_role=str(lease.target_role) if lease.target_role else "",
                target_holder=lease.target_holder,
                deadline_unix_s=lease.deadline_unix_s,
                updated_unix_s=lease.updated_unix_s,
            )
        )
        self.s.flush()

    def save_device(self, device: DeviceInfo) -> None:
        self.s.merge(
            DeviceRow(device_id=device.device_id, node=device.node, index=device.index, kind=device.kind)
        )

    def devices(self) -> list[DeviceInfo]:
        return [
            DeviceInfo(r.device_id, r.node, r.index, r.kind) for r in self.s.scalars(sa.select(DeviceRow))
        ]

    def worker(self, worker_id: str) -> Worker | None:
        r = self.s.get(WorkerRow, worker_id)
        return (
            None if r is None else Worker(r.worker_id, r.service, r.address, r.last_heartbeat_unix_s, r.alive)
        )

    def workers(self) -> list[Worker]:
        return [
            Worker(r.worker_id, r.service, r.address, r.last_heartbeat_unix_s, r.alive)
            for r in self.s.scalars(sa.select(WorkerRow))
        ]

    def save_worker(self, worker: Worker) -> None:
        self.s.merge(
            WorkerRow(
                worker_id=worker.worker_id,
                service=worker.service,
                address=worker.address,
                last_heartbeat_unix_s=worker.last_heartbeat_unix_s,
                alive=worker.alive,
            )
        )
        self.s.flush()

    def record(self, change: LeaseChange) -> None:
        self.s.add(
            LeaseEventRow(
                event_id=change.event_id,
                device_id=change.lease.device_id,
                kind=str(change.kind),
                epoch=change.lease.epoch,
                payload=lease_event(self.run_id, change).SerializeToString(),
                published=False,
                created_unix_s=change.created_unix_s,
            )
        )


class PostgresLeaseStore:
    """LeaseStore on the scheduler's tables (run the migrations first)."""

    def __init__(self, engine: sa.Engine, run_id: str) -> None:
        self.engine = engine
        self.run_id = run_id

    @contextmanager
    def transaction(self) -> Iterator[LeaseTx]:
        with session_scope(self.engine) as s:
            yield _PgTx(s, self.run_id)

    def unpublished(self, limit: int = 1000) -> list[tuple[int, str, bytes]]:
        """(seq, device_id, payload) of events not yet published, oldest first."""
        with session_scope(self.engine) as s:
            rows = s.execute(
                sa.select(LeaseEventRow.seq, LeaseEventRow.device_id, LeaseEventRow.payload)
                .where(LeaseEventRow.published.is_(False))
                .order_by(LeaseEventRow.seq)
                .limit(limit)
            ).all()
            return [(r[0], r[1], r[2]) for r in rows]

    def mark_published(self, seqs: list[int]) -> None:
        if not seqs:
            return
        with session_scope(self.engine) as s:
            s.execute(sa.update(LeaseEventRow).where(LeaseEventRow.seq.in_(seqs)).values(published=True))

    def get_setting(self, key: str) -> str | None:
        with session_scope(self.engine) as s:
            row = s.get(SettingRow, key)
            return None if row is None else row.value

    def set_setting(self, key: str, value: str) -> None:
        with session_scope(self.engine) as s:
            s.merge(SettingRow(key=key, value=value))
