"""The scheduler service: gRPC Scheduler API, the plan loop, and LeaseEvents on NATS.

    workers --gRPC--> RegisterWorker / Heartbeat / ReportLoad / Release / Acquire --> LeaseBook (Postgres)
    plan loop (every plan_interval_s):  enforce deadlines -> policy.plan(snapshot) -> reassign -> publish
    outbox (sched_lease_events) --> gyre.leases.<run_id>.<device_id>   (msg_id = event_id)

Guarantees:
- Every lease change is committed together with its event (outbox); events are published in commit
  order after each change and by the plan loop, so a crash between commit and publish only delays
  them. Redelivery is possible (at-least-once); the event_id is the JetStream dedup key, and
  consumers fence on `lease.epoch`.
- The service keeps no lease state in memory: a restarted scheduler serves the pool stored in
  Postgres. Worker loads are kept in memory only, so after a (re)start the plan loop waits until
  every live worker has reported its load before planning (no plan on missing information).
- Errors are mapped to gRPC status codes at one boundary (gyre.rpc.error_boundary): unknown
  device/worker NOT_FOUND, stale epoch / wrong state FAILED_PRECONDITION, bad input INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from gyre.bus import subjects
from gyre.config import CommonConfig
from gyre.errors import Conflict, InvalidArgument, NotFound
from gyre.rpc import error_boundary
from gyre.service import Runtime, Service
from gyre.v1 import events_pb2, scheduler_pb2, scheduler_pb2_grpc, waits_pb2
from gyre.waits import wait
from services.scheduler.config import SchedulerConfig
from services.scheduler.handoff_clock import HandoffClock
from services.scheduler.lease_store import PostgresLeaseStore
from services.scheduler.leases import ROLE_SERVICE, DeviceInfo, Lease, LeaseBook, LeaseState
from services.scheduler.policies import (
    POLICY_NAMES,
    DeviceState,
    Policy,
    PoolSnapshot,
    Reassignment,
    Role,
    make_policy,
)
from services.scheduler.pool_metrics import PoolMetrics, metrics_event
from services.scheduler.snapshot import pool_snapshot
from services.scheduler.split_meter import SplitMeter
from services.scheduler.wire import PB_TO_ROLE, device_from_pb, device_pb, lease_pb

log = logging.getLogger("gyre.scheduler")
DEFAULT_ROLE_CHANGE_S = 15.0  # a handoff direction this run has not timed yet (handoff_clock.py)
T = TypeVar("T")


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, common: CommonConfig, cfg: SchedulerConfig) -> None:
        self.common = common
        self.cfg = cfg
        self.loads: dict[str, scheduler_pb2.WorkerLoad] = {}
        self.split_meter = SplitMeter()  # Elastic's measured home split (split_meter.py)
        self._publish_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self.handoffs = HandoffClock(window=20)  # this run's handoff times per direction (handoff_clock.py)
        self.pool_metrics = PoolMetrics()
        # event ids of this process's MetricsEvents: a restarted scheduler counts intervals from 0 again
        self._metrics_tag = f"{time.time_ns():x}"
        self._leases_seen: list[Lease] = []  # the pool as of the plan loop's last snapshot (waits())
        self._unreported: list[str] = []  # live workers the last snapshot had no load report from
        self._next_metrics_s = 0.0  # time.monotonic() at which the next pool MetricsEvent is due

    # --- lifecycle -----------------------------------------------------------------------------------
    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        self.store = PostgresLeaseStore(rt.engine, self.common.run_id)
        self.book = LeaseBook(
            self.store,
            drain_timeout_s=self.cfg.drain_timeout_s,
            grant_timeout_s=self.cfg.grant_timeout_s,
            worker_timeout_s=self.cfg.worker_timeout_s,
        )
        stored = await self._db(self.store.get_setting, "policy")
        self.policy_name = stored or self.cfg.policy
        logical = [DeviceInfo(f"cpu0-{i}", "cpu0", i, "cpu") for i in range(self.cfg.num_logical_devices)]
        await self._db(self.book.add_devices, logical, time.time())
        await self.publish_pending()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self), rt.server)
        rt.spawn(self.plan_loop(), "plan-loop")
        recovered = await self._db(self.book.leases)
        log.info("scheduler started: policy %s, %d leases recovered", self.policy_name, len(recovered))

    async def stop(self) -> None:
        self._stopping.set()
        await self.publish_pending()

    def waits(self) -> list[waits_pb2.Wait]:
        """Handoffs not finished (a device between holders) and workers whose load the plan waits for,
        as of the plan loop's last round."""
        out = [
            wait(
                "handoff",
                f"device {x.device_id} {x.state}: {x.holder or 'nobody'} -> "
                f"{x.target_holder or 'nobody'} ({x.target_role or x.role}), deadline in "
                f"{x.deadline_unix_s - time.time():.0f} s",
                x.updated_unix_s,
            )
            for x in self._leases_seen
            if x.state != LeaseState.ACTIVE
        ]
        if self._unreported:
            out.append(wait("plan", f"no load report yet from {', '.join(self._unreported)}"))
        return out

    # --- the plan loop -------------------------------------------------------------------------------------
    async def plan_loop(self) -> None:
        """Enforce handoff deadlines, ask the policy, start the moves it wants, publish the events."""
        while not self._stopping.is_set():
            await self._db(self.book.tick, time.time())
            snapshot = await self._db(self.snapshot)
            if snapshot is not None:
                for move in self.policy(len(snapshot.devices)).plan(snapshot):
                    try:
                        await self._db(self.start_move, move)
                    except (Conflict, NotFound) as exc:  # the pool changed since the snapshot: next round
                        self.rt.count_error("start_move", exc)
                        log.info("move of %s to %s skipped: %s", move.device_id, move.to_role, exc)
            await self.publish_pending()
            if snapshot is not None:
                await self.publish_pool_metrics(snapshot)
            try:
                await asyncio.wait_for(self._stopping.wait(), self.cfg.plan_interval_s)
            except TimeoutError:
                pass

    def policy(self, num_devices: int) -> Policy:
        # Async needs a split (half the pool unless configured); Elastic measures its home online
        # (split_meter.py) unless the operator fixes one.
        split = self.cfg.async_rollout_devices
        if self.policy_name == "async":
            split = split or max(1, num_devices // 2)
        return make_policy(
            self.policy_name,
            staleness_bound=self.cfg.staleness_bound,
            num_rollout_devices=split,
            role_change_s=self.role_change_s(),
            min_step_over_switch=self.cfg.elastic_min_step_over_switch,
        )

    def role_change_s(self) -> float:
        """The configured role-change time, else half this run's measured round trip: the mean of the
        median handoff (REASSIGN -> ACQUIRED, seconds) to training and back to rollout, a direction
        not yet timed counting 15 s (handoff_clock.py)."""
        if self.cfg.role_change_s is not None:
            return self.cfg.role_change_s
        return self.handoffs.role_change_s(DEFAULT_ROLE_CHANGE_S)

    def snapshot(self) -> PoolSnapshot | None:
        """The pool as a policy sees it, or None while a live worker has not reported its load yet."""
        workers = [w for w in self.book.workers() if w.alive]
        self._unreported = [w.worker_id for w in workers if w.worker_id not in self.loads]
        if not workers or self._unreported:
            return None
        leases = self._leases_seen = self.book.leases()
        rollout = [self.loads[w.worker_id] for w in workers if w.service == "rollout"]
        trainer = [self.loads[w.worker_id] for w in workers if w.service == "trainer"]
        return self.split_meter.observe(
            pool_snapshot(
                [DeviceState(x.device_id, _planned_role(x), x.state != LeaseState.ACTIVE) for x in leases],
                rollout,
                trainer,
                default_engine_capacity=self.cfg.default_engine_capacity,
                staleness_bound=self.cfg.staleness_bound,
            ),
            time.monotonic(),
        )

    def start_move(self, move: Reassignment) -> None:
        """Turn one planned move into a handoff to a live worker of the target role (skipped if none)."""
        holder = ""
        if move.to_role != Role.IDLE:
            service = ROLE_SERVICE[move.to_role]
            candidates = sorted(w.worker_id for w in self.book.workers() if w.alive and w.service == service)
            if not candidates:
                return
            held = {c: 0 for c in candidates}
            for lease in self.book.leases():
                if lease.holder in held:
                    held[lease.holder] += 1
            holder = min(candidates, key=lambda c: (held[c], c))
        self.book.reassign(
            move.device_id, move.to_role, holder, time.time(), policy=self.policy_name, reason=move.reason
        )

    # --- events ----------------------------------------------------------------------------------------------
    async def publish_pending(self) -> None:
        """Publish committed, unpublished lease events in commit order (one publisher at a time)."""
        async with self._publish_lock:
            while rows := await self._db(self.store.unpublished, 500):
                for _, device_id, payload in rows:
                    event = events_pb2.LeaseEvent.FromString(payload)
                    self._time_handoff(event)
                    subject = subjects.leases(self.common.run_id, device_id)
                    await self.rt.bus.publish(subject, event, msg_id=event.event_id)
                await self._db(self.store.mark_published, [seq for seq, _, _ in rows])

    async def publish_pool_metrics(self, snapshot: PoolSnapshot) -> None:
        """One pool MetricsEvent when `metrics_interval_s` has passed since the last (pool_metrics.py)."""
        now = time.monotonic()
        if self.cfg.metrics_interval_s <= 0 or now < self._next_metrics_s:
            return
        self._next_metrics_s = now + self.cfg.metrics_interval_s
        event = metrics_event(self.common.run_id, self._metrics_tag, self.pool_metrics.sample(snapshot, now))
        await self.rt.bus.publish(
            subjects.metrics(self.common.run_id, "scheduler"), event, msg_id=event.event_id
        )

    def _time_handoff(self, event: events_pb2.LeaseEvent) -> None:
        lease = event.lease
        if event.kind == events_pb2.LeaseEvent.KIND_REASSIGN and lease.target_role in PB_TO_ROLE:
            self.handoffs.reassigned(
                lease.device_id, lease.epoch, PB_TO_ROLE[lease.target_role], event.created_unix_s
            )
        elif event.kind == events_pb2.LeaseEvent.KIND_ACQUIRED:
            self.handoffs.acquired(lease.device_id, lease.epoch, event.created_unix_s)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)


def _planned_role(lease: Lease) -> Role:
    """The role a device serves or is moving to (what the policy plans against)."""
    if lease.state != LeaseState.ACTIVE and lease.target_role is not None:
        return lease.target_role
    return lease.role


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """gRPC boundary: validates input, calls the LeaseBook, publishes the resulting events."""

    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc

    async def _changed(self) -> None:
        await self.svc.publish_pending()

    @error_boundary
    async def RegisterWorker(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        devices = [device_from_pb(d) for d in request.devices]
        if any(not d.device_id for d in devices):
            raise InvalidArgument("every device needs a device_id")
        leases, _ = await self.svc._db(
            self.svc.book.register_worker,
            request.worker_id,
            request.service,
            request.address,
            devices,
            time.time(),
        )
        await self._changed()
        return scheduler_pb2.RegisterWorkerResponse(
            leases=[lease_pb(x) for x in leases], heartbeat_interval_s=self.svc.cfg.heartbeat_interval_s
        )

    @error_boundary
    async def Heartbeat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        leases = await self.svc._db(self.svc.book.heartbeat, request.worker_id, time.time())
        return scheduler_pb2.HeartbeatResponse(leases=[lease_pb(x) for x in leases])

    @error_boundary
    async def ReportLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        known = {w.worker_id for w in await self.svc._db(self.svc.book.workers)}
        if request.worker_id not in known:
            raise NotFound(f"unknown worker {request.worker_id!r}; call RegisterWorker first")
        self.svc.loads[request.worker_id] = request.load
        return scheduler_pb2.ReportLoadResponse()

    @error_boundary
    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        lease, _ = await self.svc._db(
            self.svc.book.release, request.worker_id, request.device_id, request.epoch, time.time()
        )
        await self._changed()
        return scheduler_pb2.LeaseResponse(lease=lease_pb(lease))

    @error_boundary
    async def Acquire(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        lease, _ = await self.svc._db(
            self.svc.book.acquire, request.worker_id, request.device_id, request.epoch, time.time()
        )
        await self._changed()
        return scheduler_pb2.LeaseResponse(lease=lease_pb(lease))

    @error_boundary
    async def GetPool(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        leases = await self.svc._db(self.svc.book.leases)
        devices = await self.svc._db(self.svc.book.devices)
        return scheduler_pb2.GetPoolResponse(
            leases=[lease_pb(x) for x in leases],
            devices=[device_pb(d) for d in devices],
            policy=self.svc.policy_name,
        )

    @error_boundary
    async def SetPolicy(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.policy not in POLICY_NAMES:
            raise InvalidArgument(
                f"unknown policy {request.policy!r}; choose one of {', '.join(POLICY_NAMES)}"
            )
        previous = self.svc.policy_name
        await self.svc._db(self.svc.store.set_setting, "policy", request.policy)
        self.svc.policy_name = request.policy
        log.info("policy %s -> %s (operator)", previous, request.policy)
        return scheduler_pb2.SetPolicyResponse(previous_policy=previous)


def build(common: CommonConfig, cfg: SchedulerConfig) -> SchedulerService:
    """Factory for gyre.service.run_service."""
    return SchedulerService(common, cfg)
