"""Property tests of the lease handoff: random interleavings of reassignments, releases, acquires
(with current, stale and never-issued epochs), heartbeats, worker crashes and partitions, timeouts
and scheduler restarts. After every step: no two workers believe they hold a device at its current
epoch, holders only exist in ACTIVE/DRAINING, epochs never decrease, and a restarted scheduler
sees exactly the pool that was stored. The workers are test code following the protocol (the
outermost edge); the state machine and the stores are the real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from gyre.errors import Conflict, InvalidArgument, NotFound, StaleEpoch
from services.scheduler.leases import DeviceInfo, LeaseBook, LeaseState, MemoryLeaseStore
from services.scheduler.policies import Role

WORKERS = {"r0": "rollout", "r1": "rollout", "t0": "trainer", "t1": "trainer"}
DEVICES = ["d0", "d1", "d2"]
MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "scheduler" / "migrations"
REFUSED = (Conflict, StaleEpoch, InvalidArgument, NotFound)


class HandoffMachine(RuleBasedStateMachine):
    store_factory: Any = staticmethod(MemoryLeaseStore)

    def __init__(self) -> None:
        super().__init__()
        self.store = self.store_factory()
        self.book = self._new_book()
        self.now = 1000.0
        self.up: dict[str, bool] = {w: False for w in WORKERS}
        self.beliefs: dict[str, dict[str, int]] = {w: {} for w in WORKERS}
        self.grants: dict[str, dict[str, int]] = {w: {} for w in WORKERS}
        self.max_epoch: dict[str, int] = {}

    def _new_book(self) -> LeaseBook:
        return LeaseBook(self.store, drain_timeout_s=20, grant_timeout_s=15, worker_timeout_s=10)

    @initialize()
    def pool(self) -> None:
        self.book.add_devices([DeviceInfo(d) for d in DEVICES[1:]], self.now)
        self.up["r0"] = True
        leases, _ = self.book.register_worker("r0", "rollout", "", [DeviceInfo("d0")], self.now)
        self._learn("r0", leases)

    def _learn(self, w: str, leases: list[Any]) -> None:
        """What a protocol-following worker does with the leases the scheduler returns to it."""
        held = {
            x.device_id: x.epoch
            for x in leases
            if x.holder == w and x.state in (LeaseState.ACTIVE, LeaseState.DRAINING)
        }
        self.beliefs[w] = held
        self.grants[w] = {
            x.device_id: x.epoch for x in leases if x.target_holder == w and x.state == LeaseState.GRANTED
        }

    @rule(w=st.sampled_from(sorted(WORKERS)))
    def register(self, w: str) -> None:
        self.up[w] = True
        leases, _ = self.book.register_worker(w, WORKERS[w], "", [], self.now)
        self._learn(w, leases)

    @rule(w=st.sampled_from(sorted(WORKERS)))
    def heartbeat(self, w: str) -> None:
        if not self.up[w]:
            return
        try:
            self._learn(w, self.book.heartbeat(w, self.now))
        except NotFound:
            pass

    @rule(d=st.sampled_from(DEVICES), to=st.sampled_from(["r0", "r1", "t0", "t1", ""]))
    def reassign(self, d: str, to: str) -> None:
        role = Role.IDLE if not to else (Role.ROLLOUT if WORKERS[to] == "rollout" else Role.TRAIN)
        try:
            self.book.reassign(d, role, to, self.now, policy="test", reason="random")
        except REFUSED:
            pass

    @rule(
        w=st.sampled_from(sorted(WORKERS)),
        d=st.sampled_from(DEVICES),
        which=st.sampled_from(["mine", "stale", "future"]),
    )
    def release(self, w: str, d: str, which: str) -> None:
        if not self.up[w] or d not in self.beliefs[w]:
            return
        epoch = self.beliefs[w][d] + {"mine": 0, "stale": -1, "future": 5}[which]
        try:
            self.book.release(w, d, epoch, self.now)
        except REFUSED:
            return
        assert which == "mine"
        del self.beliefs[w][d]

    @rule(
        w=st.sampled_from(sorted(WORKERS)),
        d=st.sampled_from(DEVICES),
        which=st.sampled_from(["granted", "stale", "guess"]),
    )
    def acquire(self, w: str, d: str, which: str) -> None:
        if not self.up[w]:
            return
        current = next(x.epoch for x in self.book.leases() if x.device_id == d)
        epoch = {"granted": self.grants[w].get(d, current), "stale": current - 1, "guess": current}[which]
        try:
            lease, _ = self.book.acquire(w, d, epoch, self.now)
        except REFUSED:
            return
        assert lease.holder == w and lease.state == LeaseState.ACTIVE and epoch == lease.epoch
        self.beliefs[w][d] = lease.epoch

    @rule(w=st.sampled_from(sorted(WORKERS)))
    def eager_grantee_acquires_everything_it_is_named_for(self, w: str) -> None:
        """A grantee that reacts to the REASSIGN event (not GRANTED) and tries to take the device at once."""
        if not self.up[w]:
            return
        for lease in self.book.leases():
            if lease.target_holder == w:
                try:
                    got, _ = self.book.acquire(w, lease.device_id, lease.epoch, self.now)
                except REFUSED:
                    continue
                self.beliefs[w][lease.device_id] = got.epoch

    @rule(w=st.sampled_from(sorted(WORKERS)), keeps_beliefs=st.booleans())
    def crash(self, w: str, keeps_beliefs: bool) -> None:
        """The worker stops heartbeating: a crash forgets everything; a partition (zombie) does not."""
        self.up[w] = False
        if not keeps_beliefs:
            self.beliefs[w] = {}
            self.grants[w] = {}

    @rule(dt=st.sampled_from([1.0, 5.0, 12.0, 30.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.book.tick(self.now)

    @rule()
    def scheduler_restarts(self) -> None:
        before = self.book.leases()
        self.book = self._new_book()
        assert self.book.leases() == before

    @invariant()
    def only_the_recorded_holder_believes_it_holds_a_device(self) -> None:
        """Among workers the scheduler considers alive, only the lease's holder believes it holds
        the device (whatever epoch it knows): nobody is granted a device its holder still uses.
        Workers declared dead are fenced: their stale epochs are refused (checked below)."""
        alive = {w.worker_id for w in self.book.workers() if w.alive}
        for lease in self.book.leases():
            believers = [w for w in alive if lease.device_id in self.beliefs[w]]
            assert believers in ([], [lease.holder]), (lease, believers)
        for w in WORKERS:
            if w in alive:
                continue
            for d, epoch in self.beliefs[w].items():
                with pytest.raises((StaleEpoch, Conflict)):
                    self.book.validate(w, d, epoch)

    @invariant()
    def no_two_workers_hold_a_device_at_its_current_epoch(self) -> None:
        for lease in self.book.leases():
            believers = [w for w in WORKERS if self.beliefs[w].get(lease.device_id) == lease.epoch]
            assert len(believers) <= 1, (lease, believers)
            for w in believers:
                # A current belief is exactly what the scheduler says: the fencing check passes.
                assert lease.holder == w
                self.book.validate(w, lease.device_id, lease.epoch)

    @invariant()
    def holders_only_in_active_or_draining_and_epochs_never_decrease(self) -> None:
        for lease in self.book.leases():
            if lease.holder:
                assert lease.state in (LeaseState.ACTIVE, LeaseState.DRAINING)
            if lease.state == LeaseState.GRANTED:
                assert lease.target_holder and not lease.holder
            if lease.state == LeaseState.ACTIVE:
                assert lease.target_role is None and not lease.target_holder
            assert lease.epoch >= self.max_epoch.get(lease.device_id, 0)
            self.max_epoch[lease.device_id] = lease.epoch


def test_handoff_invariants_hold_over_random_interleavings_in_memory() -> None:
    run_state_machine_as_test(
        HandoffMachine,
        settings=settings(max_examples=100, stateful_step_count=30, deadline=None),
    )


@pytest.mark.integration
def test_handoff_invariants_hold_over_random_interleavings_in_postgres(database_url: str) -> None:
    from gyre import store
    from services.scheduler.lease_store import PostgresLeaseStore
    from services.scheduler.models import Base

    store.upgrade(database_url, MIGRATIONS, "alembic_version_scheduler")
    engine = store.create_engine(database_url)

    def fresh_store() -> PostgresLeaseStore:
        with engine.begin() as conn:
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(sa.delete(table))
        return PostgresLeaseStore(engine, "test")

    class PgMachine(HandoffMachine):
        store_factory = staticmethod(fresh_store)

    try:
        run_state_machine_as_test(
            PgMachine,
            settings=settings(
                max_examples=12,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        engine.dispose()
