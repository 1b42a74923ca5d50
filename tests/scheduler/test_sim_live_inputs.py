"""The simulator gives the policy exactly what the live scheduler gives it.

Every snapshot the simulator built during a run is rebuilt by the live `SchedulerService.snapshot()`
from the same lease table (an in-memory LeaseBook, the store the lease tests use) and the same
WorkerLoad reports; the two must be equal and the live policy object must decide the same moves.
No NATS, Postgres or gRPC is needed: `snapshot()` reads only the book and the reported loads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gyre.config import CommonConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.leases import DeviceInfo, LeaseBook, MemoryLeaseStore
from services.scheduler.policies import ElasticPolicy, Role
from services.scheduler.service import SchedulerService
from services.scheduler.sim import load_workload_file
from services.scheduler.sim.compare import elastic_policy_with_home, simulate

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"
OTHER = {Role.ROLLOUT: Role.TRAIN, Role.TRAIN: Role.ROLLOUT}


def _live_service(
    devices, rollout_load, trainer_load, bound: int, home: int, role_change_s: float
) -> SchedulerService:
    cfg = SchedulerConfig(
        policy="elastic", staleness_bound=bound, async_rollout_devices=home, role_change_s=role_change_s
    )
    svc = SchedulerService(CommonConfig(), cfg)
    book = LeaseBook(MemoryLeaseStore(), drain_timeout_s=60, grant_timeout_s=60, worker_timeout_s=60)
    # Each device registers with the worker of the role it serves; a moving one with the other role's
    # worker, then the scheduler reassigns it (DRAINING toward its target, as the live handoff does).
    for worker, role in (("rollout-0", Role.ROLLOUT), ("trainer-0", Role.TRAIN)):
        mine = [
            DeviceInfo(d.device_id)
            for d in devices
            if (d.role == role and not d.moving) or (d.moving and OTHER.get(d.role) == role)
        ]
        book.register_worker(worker, "rollout" if role == Role.ROLLOUT else "trainer", "", mine, 0.0)
    for d in devices:
        if d.moving:
            holder = "rollout-0" if d.role == Role.ROLLOUT else "trainer-0"
            book.reassign(d.device_id, d.role, holder, 1.0, policy="elastic", reason="test")
    svc.book = book
    svc.policy_name = "elastic"  # what start() reads back from the store
    svc.loads = {"rollout-0": rollout_load, "trainer-0": trainer_load}
    return svc


@pytest.fixture(scope="module")
def recorded():
    w = load_workload_file(SMALL)
    home = 2  # the operator's split (in units: one sim device is one engine), as `gyre sim` gives it
    policy = elastic_policy_with_home(w, home)
    r = simulate(w, policy, record_snapshots=True)
    assert len(r.snapshots) > 50
    return w, policy, r.snapshots


def test_live_snapshot_of_the_same_pool_and_loads_equals_the_simulated_one(recorded) -> None:
    w, sim_policy, snapshots = recorded
    checked = 0
    for sim_snap, (devices, rollout_load, trainer_load) in snapshots[:: max(1, len(snapshots) // 60)]:
        if any(d.role == Role.IDLE for d in devices):
            continue  # t = 0, before the first plan
        svc = _live_service(
            devices, rollout_load, trainer_load, w.staleness_bound, 2, w.costs.elastic_role_change_s
        )
        live = svc.snapshot()
        assert live is not None
        assert sorted(live.devices, key=lambda d: d.device_id) == sorted(
            sim_snap.devices, key=lambda d: d.device_id
        )
        # The measured home split comes from the meter's history of step times (split_meter.py), which a
        # fresh service has not seen; every field read from this one pool and its loads must be equal.
        history = {"devices": None, "measured_home_rollout": None}
        assert live.__dict__ | history == sim_snap.__dict__ | history
        live_policy = svc.policy(len(devices))  # built from the live config, as the plan loop does
        assert isinstance(live_policy, ElasticPolicy)
        assert vars(live_policy) == vars(sim_policy)
        same_history = dataclasses.replace(live, measured_home_rollout=sim_snap.measured_home_rollout)
        assert live_policy.plan(same_history) == sim_policy.plan(sim_snap)
        checked += 1
    assert checked > 20


def test_the_simulated_trainer_reports_the_work_it_can_do_now_as_the_live_one(recorded) -> None:
    """`trainer_remaining_work_device_s` (proto WorkerLoad): positive while the trainer has scored work to
    train, 0 while a step waits for scored groups; the data-parallel size is the training devices."""
    w, _, snapshots = recorded
    working = [s for s, _ in snapshots if s.trainer_remaining_work_device_s > 0]
    waiting = [s for s, _ in snapshots if s.trainer_backlog > 0 and s.trainer_remaining_work_device_s == 0]
    assert working and waiting
    for s, (_, _, trainer_load) in snapshots:
        assert trainer_load.trainer_dp_size == s.trainer_dp_size
        assert s.trainer_dp_size % w.devices_per_unit == 0


def test_the_simulated_rollout_reports_one_engine_load_per_settled_rollout_unit(recorded) -> None:
    """`WorkerLoad.engines`: one entry per rollout unit not moving, which the snapshot copies onto that
    device; so the equality above compares real per-engine loads, not zeros."""
    _, _, snapshots = recorded
    for s, (devices, rollout_load, _) in snapshots:
        settled = {d.device_id for d in devices if d.role == Role.ROLLOUT and not d.moving}
        assert [e.device_id for e in rollout_load.engines] == sorted(settled)
        assert sum(e.generating for e in rollout_load.engines) <= rollout_load.running_generations
        by_id = {d.device_id: d for d in s.devices}
        for e in rollout_load.engines:
            d = by_id[e.device_id]
            assert (d.executions, d.generating, d.context_tokens) == (
                e.executions,
                e.generating,
                e.context_tokens,
            )
            assert e.executions <= rollout_load.live_executions
            assert (e.context_tokens > 0) == (e.executions > 0)
    loaded = {d.executions for s, _ in snapshots for d in s.devices}
    assert len(loaded) > 2  # engines differ in load, so the lending order is exercised
