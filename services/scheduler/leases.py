"""Device leases and the handoff state machine (DESIGN: "Lease handoff without interrupting executions").

    ACTIVE(role, holder, e) --reassign--> DRAINING(e+1) --release(e+1)--> RELEASED --> GRANTED(e+1)
        --acquire(e+1)--> ACTIVE(target role, target holder, e+1)

An idle device (no holder) skips draining: reassign goes straight to GRANTED.

Guarantees (checked by tests/scheduler/test_leases_property.py over random interleavings):
- A device has at most one holder, and `holder` is set only in ACTIVE and DRAINING: the new holder
  can acquire only after the old one released or was fenced out.
- The epoch (fencing token) never decreases and increases on every change of role or holder
  (reassign, rollback, fencing of a dead holder). Release and acquire carry the epoch of the
  handoff; an older one raises `gyre.errors.StaleEpoch`, a wrong state or holder `Conflict`.
- Timeouts: a holder that does not release by `drain_timeout_s` keeps the device (ROLLED_BACK,
  epoch + 1); a grantee that does not acquire by `grant_timeout_s`, or dies, loses the grant (the
  device goes IDLE, epoch + 1). A holder silent for `worker_timeout_s` is declared dead and fenced:
  its devices lose their holder (epoch + 1), a handoff it was draining proceeds to the grant.
- Every change is written, with its LeaseEvent, in one store transaction; after a restart the
  pool is whatever the store holds (`LeaseBook` keeps no state of its own).
- Retried calls are idempotent: acquiring an ACTIVE lease one already holds at that epoch, or
  releasing a lease already released at that epoch, returns the lease unchanged.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from gyre.errors import Conflict, InvalidArgument, NotFound, StaleEpoch
from services.scheduler.policies import Role


class LeaseState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    RELEASED = "released"
    GRANTED = "granted"


class ChangeKind(StrEnum):
    REASSIGN = "reassign"
    RELEASED = "released"
    GRANTED = "granted"
    ACQUIRED = "acquired"
    ROLLED_BACK = "rolled_back"
    REGISTERED = "registered"


# Which service holds a device in each role.
ROLE_SERVICE = {Role.ROLLOUT: "rollout", Role.TRAIN: "trainer"}
SERVICE_ROLE = {v: k for k, v in ROLE_SERVICE.items()}


@dataclass
class Lease:
    device_id: str
    role: Role
    holder: str
    epoch: int
    state: LeaseState
    target_role: Role | None = None
    target_holder: str = ""
    deadline_unix_s: float = 0.0
    updated_unix_s: float = 0.0


@dataclass
class Worker:
    worker_id: str
    service: str
    address: str
    last_heartbeat_unix_s: float
    alive: bool = True


@dataclass(frozen=True)
class DeviceInfo:
    device_id: str
    node: str = ""
    index: int = 0
    kind: str = "cpu"


@dataclass
class LeaseChange:
    """One lease change; becomes one LeaseEvent on `subjects.leases(run_id, device_id)`."""

    kind: ChangeKind
    lease: Lease
    from_role: Role | None
    policy: str
    reason: str
    created_unix_s: float
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class LeaseTx(Protocol):
    """One transaction on the lease store. Reads of a lease lock it until the end (FOR UPDATE)."""

    def lease(self, device_id: str) -> Lease | None: ...
    def leases(self) -> list[Lease]: ...
    def save_lease(self, lease: Lease) -> None: ...
    def save_device(self, device: DeviceInfo) -> None: ...
    def devices(self) -> list[DeviceInfo]: ...
    def worker(self, worker_id: str) -> Worker | None: ...
    def workers(self) -> list[Worker]: ...
    def save_worker(self, worker: Worker) -> None: ...
    def record(self, change: LeaseChange) -> None: ...


class LeaseStore(Protocol):
    def transaction(self) -> AbstractContextManager[LeaseTx]: ...


class LeaseBook:
    """The handoff protocol over a LeaseStore. Stateless: every call is one store transaction and
    returns what changed; `now` (Unix seconds) is passed in so tests control time."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        drain_timeout_s: float = 60.0,
        grant_timeout_s: float = 30.0,
        worker_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.drain_timeout_s = drain_timeout_s
        self.grant_timeout_s = grant_timeout_s
        self.worker_timeout_s = worker_timeout_s

    # --- workers and devices ---------------------------------------------------------------------
    def register_worker(
        self, worker_id: str, service: str, address: str, devices: list[DeviceInfo], now: float
    ) -> tuple[list[Lease], list[LeaseChange]]:
        """Add or refresh a worker (idempotent). A device it brings that the pool does not know yet
        becomes ACTIVE in the worker's role, held by it (REGISTERED); known devices keep their lease."""
        if not worker_id or service not in SERVICE_ROLE:
            raise InvalidArgument(
                f"worker_id must be non-empty and service one of {sorted(SERVICE_ROLE)}; got {worker_id!r}, {service!r}"
            )
        changes: list[LeaseChange] = []
        with self.store.transaction() as tx:
            tx.save_worker(Worker(worker_id, service, address, now, True))
            for d in devices:
                if tx.lease(d.device_id) is None:
                    tx.save_device(d)
                    lease = Lease(
                        d.device_id,
                        SERVICE_ROLE[service],
                        worker_id,
                        1,
                        LeaseState.ACTIVE,
                        updated_unix_s=now,
                    )
                    tx.save_lease(lease)
                    changes.append(
                        self._record(tx, ChangeKind.REGISTERED, lease, None, "worker", "registered", now)
                    )
            mine = [copy.copy(x) for x in tx.leases() if worker_id in (x.holder, x.target_holder)]
        return mine, changes

    def add_devices(self, devices: list[DeviceInfo], now: float) -> list[LeaseChange]:
        """Devices the scheduler itself brings (logical CPU slots): IDLE, no holder. Idempotent."""
        changes = []
        with self.store.transaction() as tx:
            for d in devices:
                if tx.lease(d.device_id) is None:
                    tx.save_device(d)
                    lease = Lease(d.device_id, Role.IDLE, "", 1, LeaseState.ACTIVE, updated_unix_s=now)
                    tx.save_lease(lease)
                    changes.append(
                        self._record(
                            tx, ChangeKind.REGISTERED, lease, None, "scheduler", "logical device", now
                        )
                    )
        return changes

    def heartbeat(self, worker_id: str, now: float) -> list[Lease]:
        """Refresh liveness; returns the leases the worker holds or must act on (to catch up on events)."""
        with self.store.transaction() as tx:
            w = tx.worker(worker_id)
            if w is None:
                raise NotFound(f"unknown worker {worker_id!r}; call RegisterWorker first")
            w.last_heartbeat_unix_s = now
            w.alive = True
            tx.save_worker(w)
            return [copy.copy(x) for x in tx.leases() if worker_id in (x.holder, x.target_holder)]

    # --- the handoff --------------------------------------------------------------------------------
    def reassign(
        self, device_id: str, to_role: Role, to_holder: str, now: float, *, policy: str, reason: str
    ) -> list[LeaseChange]:
        """Start moving `device_id` to `to_role` held by `to_holder` ("" for IDLE). New epoch."""
        if (to_role == Role.IDLE) != (to_holder == ""):
            raise InvalidArgument("to_holder must be empty exactly when to_role is IDLE")
        with self.store.transaction() as tx:
            lease = self._get(tx, device_id)
            if lease.state != LeaseState.ACTIVE:
                raise Conflict(
                    f"device {device_id!r} is already moving ({lease.state}); wait for the handoff to end"
                )
            if lease.role == to_role and lease.holder == to_holder:
                return []
            if to_holder:
                target = tx.worker(to_holder)
                if target is None or not target.alive:
                    raise Conflict(f"cannot grant {device_id!r} to {to_holder!r}: worker unknown or dead")
            from_role = lease.role
            lease.epoch += 1
            lease.target_role, lease.target_holder = to_role, to_holder
            lease.updated_unix_s = now
            changes = []
            if lease.holder:
                lease.state = LeaseState.DRAINING
                lease.deadline_unix_s = now + self.drain_timeout_s
                tx.save_lease(lease)
                changes.append(self._record(tx, ChangeKind.REASSIGN, lease, from_role, policy, reason, now))
            else:
                lease.state = LeaseState.RELEASED
                changes.append(self._record(tx, ChangeKind.REASSIGN, lease, from_role, policy, reason, now))
                changes += self._grant(tx, lease, from_role, policy, now)
            return changes

    def release(
        self, worker_id: str, device_id: str, epoch: int, now: float
    ) -> tuple[Lease, list[LeaseChange]]:
        """The draining holder gave the device up; it is granted to the target right away."""
        with self.store.transaction() as tx:
            lease = self._get(tx, device_id)
            self._check_epoch(lease, epoch)
            if lease.state in (LeaseState.RELEASED, LeaseState.GRANTED) or (
                lease.state == LeaseState.ACTIVE and lease.holder != worker_id
            ):
                return copy.copy(lease), []  # a retried release: the handoff of this epoch went on
            if lease.state != LeaseState.DRAINING or lease.holder != worker_id:
                raise Conflict(
                    f"{worker_id!r} cannot release {device_id!r}: state {lease.state}, holder {lease.holder!r}"
                )
            from_role = lease.role
            lease.holder, lease.state, lease.updated_unix_s = "", LeaseState.RELEASED, now
            changes = [self._record(tx, ChangeKind.RELEASED, lease, from_role, "", "drained", now)]
            changes += self._grant(tx, lease, from_role, "", now)
            return copy.copy(lease), changes

    def acquire(
        self, worker_id: str, device_id: str, epoch: int, now: float
    ) -> tuple[Lease, list[LeaseChange]]:
        """The grantee takes the device; the lease becomes ACTIVE in the new role."""
        with self.store.transaction() as tx:
            lease = self._get(tx, device_id)
            self._check_epoch(lease, epoch)
            if lease.state == LeaseState.ACTIVE and lease.holder == worker_id:
                return copy.copy(lease), []  # a retried acquire
            if lease.state != LeaseState.GRANTED or lease.target_holder != worker_id:
                raise Conflict(
                    f"{worker_id!r} cannot acquire {device_id!r}: state {lease.state}, granted to {lease.target_holder!r}"
                )
            from_role = lease.role
            assert lease.target_role is not None
            lease.role, lease.holder, lease.state = lease.target_role, worker_id, LeaseState.ACTIVE
            lease.target_role, lease.target_holder, lease.deadline_unix_s, lease.updated_unix_s = (
                None,
                "",
                0.0,
                now,
            )
            tx.save_lease(lease)
            return copy.copy(lease), [
                self._record(tx, ChangeKind.ACQUIRED, lease, from_role, "", "acquired", now)
            ]

    def tick(self, now: float) -> list[LeaseChange]:
        """Declare silent workers dead and enforce handoff deadlines (rollback / fencing)."""
        changes: list[LeaseChange] = []
        with self.store.transaction() as tx:
            dead = set()
            for w in tx.workers():
                if w.alive and now - w.last_heartbeat_unix_s > self.worker_timeout_s:
                    w.alive = False
                    tx.save_worker(w)
                if not w.alive:
                    dead.add(w.worker_id)
            for lease in tx.leases():
                lease = self._get(tx, lease.device_id)
                changes += self._enforce(tx, lease, dead, now)
        return changes

    def leases(self) -> list[Lease]:
        with self.store.transaction() as tx:
            return sorted((copy.copy(x) for x in tx.leases()), key=lambda x: x.device_id)

    def workers(self) -> list[Worker]:
        with self.store.transaction() as tx:
            return sorted((copy.copy(w) for w in tx.workers()), key=lambda w: w.worker_id)

    def devices(self) -> list[DeviceInfo]:
        with self.store.transaction() as tx:
            return sorted(tx.devices(), key=lambda d: d.device_id)

    def validate(self, worker_id: str, device_id: str, epoch: int) -> Lease:
        """Raise unless `worker_id` may use `device_id` under `epoch` right now (the fencing check)."""
        with self.store.transaction() as tx:
            lease = self._get(tx, device_id)
            self._check_epoch(lease, epoch)
            if lease.holder != worker_id or lease.state not in (LeaseState.ACTIVE, LeaseState.DRAINING):
                raise Conflict(f"{worker_id!r} does not hold {device_id!r} (holder {lease.holder!r})")
            return copy.copy(lease)

    # --- internals -------------------------------------------------------------------------------------
    def _enforce(self, tx: LeaseTx, lease: Lease, dead: set[str], now: float) -> list[LeaseChange]:
        from_role = lease.role
        if lease.holder and lease.holder in dead:
            who = lease.holder
            lease.epoch += 1
            lease.holder, lease.updated_unix_s = "", now
            if lease.state == LeaseState.DRAINING:
                lease.state = LeaseState.RELEASED
                ch = [
                    self._record(
                        tx, ChangeKind.ROLLED_BACK, lease, from_role, "", f"holder {who} died; fenced", now
                    )
                ]
                return ch + self._grant(tx, lease, from_role, "", now)
            lease.role, lease.state = Role.IDLE, LeaseState.ACTIVE
            tx.save_lease(lease)
            return [
                self._record(
                    tx, ChangeKind.ROLLED_BACK, lease, from_role, "", f"holder {who} died; fenced", now
                )
            ]
        if lease.state == LeaseState.DRAINING and now > lease.deadline_unix_s:
            lease.epoch += 1
            lease.state, lease.target_role, lease.target_holder = LeaseState.ACTIVE, None, ""
            lease.deadline_unix_s, lease.updated_unix_s = 0.0, now
            tx.save_lease(lease)
            return [
                self._record(
                    tx, ChangeKind.ROLLED_BACK, lease, from_role, "", "drain timed out; holder keeps it", now
                )
            ]
        if lease.state == LeaseState.GRANTED and (lease.target_holder in dead or now > lease.deadline_unix_s):
            why = "grantee died" if lease.target_holder in dead else "acquire timed out"
            self._to_idle(lease, now)
            tx.save_lease(lease)
            return [
                self._record(tx, ChangeKind.ROLLED_BACK, lease, from_role, "", why + "; device idle", now)
            ]
        if lease.state == LeaseState.RELEASED:
            return self._grant(tx, lease, from_role, "", now)
        return []

    def _grant(
        self, tx: LeaseTx, lease: Lease, from_role: Role, policy: str, now: float
    ) -> list[LeaseChange]:
        """RELEASED -> GRANTED to the target (or ACTIVE IDLE when the target is IDLE or gone)."""
        if lease.target_role in (None, Role.IDLE):
            self._to_idle(lease, now, bump=False)
            tx.save_lease(lease)
            return [self._record(tx, ChangeKind.ACQUIRED, lease, from_role, policy, "now idle", now)]
        target = tx.worker(lease.target_holder)
        if target is None or not target.alive:
            self._to_idle(lease, now)
            tx.save_lease(lease)
            return [
                self._record(
                    tx, ChangeKind.ROLLED_BACK, lease, from_role, policy, "grantee gone; device idle", now
                )
            ]
        lease.state, lease.deadline_unix_s, lease.updated_unix_s = (
            LeaseState.GRANTED,
            now + self.grant_timeout_s,
            now,
        )
        tx.save_lease(lease)
        return [
            self._record(
                tx, ChangeKind.GRANTED, lease, from_role, policy, f"granted to {lease.target_holder}", now
            )
        ]

    @staticmethod
    def _to_idle(lease: Lease, now: float, bump: bool = True) -> None:
        if bump:
            lease.epoch += 1
        lease.role, lease.holder, lease.state = Role.IDLE, "", LeaseState.ACTIVE
        lease.target_role, lease.target_holder, lease.deadline_unix_s, lease.updated_unix_s = (
            None,
            "",
            0.0,
            now,
        )

    @staticmethod
    def _get(tx: LeaseTx, device_id: str) -> Lease:
        lease = tx.lease(device_id)
        if lease is None:
            raise NotFound(f"unknown device {device_id!r}; see GetPool for the devices of the pool")
        return lease

    @staticmethod
    def _check_epoch(lease: Lease, epoch: int) -> None:
        if epoch < lease.epoch:
            raise StaleEpoch(lease.device_id, epoch, lease.epoch)
        if epoch > lease.epoch:
            raise Conflict(f"epoch {epoch} for {lease.device_id!r} was never issued (current {lease.epoch})")

    @staticmethod
    def _record(
        tx: LeaseTx,
        kind: ChangeKind,
        lease: Lease,
        from_role: Role | None,
        policy: str,
        reason: str,
        now: float,
    ) -> LeaseChange:
        change = LeaseChange(kind, copy.copy(lease), from_role, policy, reason, now)
        tx.record(change)
        return change


class MemoryLeaseStore:
    """In-memory LeaseStore (tests, simulator): a transaction works on copies, committed at the end
    of the block only if it did not raise; one transaction at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._devices: dict[str, DeviceInfo] = {}
        self._workers: dict[str, Worker] = {}
        self.changes: list[LeaseChange] = []

    @contextmanager
    def transaction(self) -> Iterator[LeaseTx]:
        with self._lock:
            tx = _MemoryTx(copy.deepcopy(self._leases), dict(self._devices), copy.deepcopy(self._workers))
            yield tx
            self._leases, self._devices, self._workers = tx.leases_, tx.devices_, tx.workers_
            self.changes.extend(tx.changes)


class _MemoryTx:
    def __init__(
        self, leases: dict[str, Lease], devices: dict[str, DeviceInfo], workers: dict[str, Worker]
    ) -> None:
        self.leases_, self.devices_, self.workers_ = leases, devices, workers
        self.changes: list[LeaseChange] = []

    def lease(self, device_id: str) -> Lease | None:
        return self.leases_.get(device_id)

    def leases(self) -> list[Lease]:
        return list(self.leases_.values())

    def save_lease(self, lease: Lease) -> None:
        self.leases_[lease.device_id] = copy.copy(lease)

    def save_device(self, device: DeviceInfo) -> None:
        self.devices_[device.device_id] = device

    def devices(self) -> list[DeviceInfo]:
        return list(self.devices_.values())

    def worker(self, worker_id: str) -> Worker | None:
        return self.workers_.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self.workers_.values())

    def save_worker(self, worker: Worker) -> None:
        self.workers_[worker.worker_id] = copy.copy(worker)

    def record(self, change: LeaseChange) -> None:
        self.changes.append(change)
