"""Examples of the handoff protocol on the in-memory store (the property tests cover interleavings)."""

from __future__ import annotations

import pytest

from gyre.errors import Conflict, NotFound, StaleEpoch
from services.scheduler.leases import ChangeKind, DeviceInfo, LeaseBook, LeaseState, MemoryLeaseStore
from services.scheduler.policies import Role


@pytest.fixture
def book() -> LeaseBook:
    b = LeaseBook(MemoryLeaseStore(), drain_timeout_s=20, grant_timeout_s=15, worker_timeout_s=10)
    b.register_worker("rollout-0", "rollout", "", [DeviceInfo("cpu0-0")], 0.0)
    b.register_worker("trainer-0", "trainer", "", [], 0.0)
    return b


def test_full_handoff_moves_device_from_rollout_to_trainer(book: LeaseBook) -> None:
    changes = book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    assert [c.kind for c in changes] == [ChangeKind.REASSIGN]
    epoch = changes[0].lease.epoch
    assert epoch == 2 and changes[0].lease.state == LeaseState.DRAINING
    lease, changes = book.release("rollout-0", "cpu0-0", epoch, 2.0)
    assert [c.kind for c in changes] == [ChangeKind.RELEASED, ChangeKind.GRANTED]
    lease, _ = book.acquire("trainer-0", "cpu0-0", epoch, 3.0)
    assert (lease.role, lease.holder, lease.state, lease.epoch) == (
        Role.TRAIN,
        "trainer-0",
        LeaseState.ACTIVE,
        2,
    )


def test_release_with_the_old_epoch_is_refused_as_stale(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    with pytest.raises(StaleEpoch, match="current epoch is 2"):
        book.release("rollout-0", "cpu0-0", 1, 2.0)


def test_grantee_cannot_acquire_before_the_holder_released(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    with pytest.raises(Conflict):
        book.acquire("trainer-0", "cpu0-0", 2, 2.0)


def test_holder_that_misses_the_drain_deadline_keeps_the_device(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    book.heartbeat("rollout-0", 20.0)
    book.heartbeat("trainer-0", 20.0)
    changes = book.tick(22.0)
    assert [c.kind for c in changes] == [ChangeKind.ROLLED_BACK]
    lease = book.leases()[0]
    assert (lease.holder, lease.role, lease.state, lease.epoch) == (
        "rollout-0",
        Role.ROLLOUT,
        LeaseState.ACTIVE,
        3,
    )


def test_dead_holder_is_fenced_and_the_handoff_proceeds(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    book.heartbeat("trainer-0", 9.0)
    changes = book.tick(11.0)
    assert [c.kind for c in changes] == [ChangeKind.ROLLED_BACK, ChangeKind.GRANTED]
    lease = book.leases()[0]
    assert lease.holder == "" and lease.state == LeaseState.GRANTED and lease.epoch == 3
    with pytest.raises(StaleEpoch):
        book.release("rollout-0", "cpu0-0", 2, 12.0)


def test_grant_that_is_never_acquired_returns_the_device_to_idle(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    book.release("rollout-0", "cpu0-0", 2, 2.0)
    for t in (8.0, 16.0):
        book.heartbeat("trainer-0", t)
        book.heartbeat("rollout-0", t)
    book.tick(18.0)
    lease = book.leases()[0]
    assert (lease.role, lease.holder, lease.state) == (Role.IDLE, "", LeaseState.ACTIVE)


def test_unknown_device_and_worker_are_not_found(book: LeaseBook) -> None:
    with pytest.raises(NotFound):
        book.acquire("trainer-0", "nope", 1, 1.0)
    with pytest.raises(NotFound):
        book.heartbeat("ghost", 1.0)


def test_retried_acquire_and_release_change_nothing(book: LeaseBook) -> None:
    book.reassign("cpu0-0", Role.TRAIN, "trainer-0", 1.0, policy="elastic", reason="tail")
    book.release("rollout-0", "cpu0-0", 2, 2.0)
    assert book.release("rollout-0", "cpu0-0", 2, 2.5)[1] == []
    book.acquire("trainer-0", "cpu0-0", 2, 3.0)
    assert book.acquire("trainer-0", "cpu0-0", 2, 3.5)[1] == []
