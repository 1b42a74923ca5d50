"""The simulated trainer and the reports the simulator gives the policy and the caller.

`TrainerSide` is the half of `Simulation` (engine.py) that trains: micro-batch rounds over the scored
groups of the current step, the step's end (a new weight version), the load reports the live trainer
and rollout send the scheduler (`WorkerLoad`, so the snapshot is built by the live function), and the
run's `SimResult`. The rollout half (admission, placement, turns, migration, role changes) lives in
engine.py and provides the hooks declared at the end of the attribute list.
"""

from __future__ import annotations

import math
from typing import Any

from gyre.costmodel import CostModel
from gyre.v1 import scheduler_pb2
from gyre.workload import ServiceSemantics, Workload
from services.scheduler.policies import DeviceState, Policy, PoolSnapshot, Role
from services.scheduler.sim.state import Event, Execution, RoundDone, SimResult, Unit, integrate
from services.scheduler.snapshot import pool_snapshot
from services.scheduler.split_meter import SplitMeter


class TrainerSide:
    """Training, load reports and the result of one simulated run (see the module docstring)."""

    # State that Simulation.__init__ sets (engine.py); listed so this half type-checks on its own.
    policy: Policy
    w: Workload
    cost: CostModel
    sem: ServiceSemantics
    bound: int
    colocate: bool
    slots: int
    record: bool
    units: list[Unit]
    execs: list[Execution]
    batches: list[list[int]]
    groups_left: list[int]
    groups_total: list[int]
    queue: list[int]
    live: int
    version: int
    scored_flops: list[float]
    trained_flops: float
    round_token: int
    round_units: set[int]
    round_work: float
    step_units: set[int] | None
    step_started: float | None
    last_step_s: float
    step_done: list[float]
    tokens_trained: list[float]
    gen_trained: list[float]
    batch_tokens: list[float]
    batch_flops: list[float]
    now: float
    util_events: list[tuple[float, int]]
    busy_by_role: dict[Role, float]
    split_meter: SplitMeter
    timeline: list[tuple[int, float, float, str]]
    first_start: dict[int, float]
    finish_times: list[list[float]]
    num_migrations: int
    num_role_changes: int
    num_parked: int
    num_preemptions: int
    kv_peak: float
    staleness: list[int]
    rollout_spans: list[float]
    train_spans: list[float]
    snapshots: list[tuple[PoolSnapshot, tuple[Any, ...]]]
    live_per_batch: list[int]
    batch_version: list[int]
    num_env: int
    num_rebalanced: int

    # Hooks of the rollout half (engine.py).
    def _push(self, t: float, event: Event) -> None:
        raise NotImplementedError

    def _busy(self, delta_devices: int, role: Role) -> None:
        raise NotImplementedError

    def _settle_busy(self) -> None:
        raise NotImplementedError

    def _set_role(self, u: Unit, role: Role) -> None:
        raise NotImplementedError

    def _plan(self) -> None:
        raise NotImplementedError

    def _admit(self) -> None:
        raise NotImplementedError

    def _fill_slots(self) -> None:
        raise NotImplementedError

    def _rollout_units(self) -> list[Unit]:
        raise NotImplementedError

    def _in_use_by_trainer(self, uid: int) -> bool:
        raise NotImplementedError

    def _drained(self, u: Unit) -> None:
        raise NotImplementedError

    # --- the policy's inputs: the live fields, through the live function -------------------------------------
    def loads(self) -> tuple[scheduler_pb2.WorkerLoad, scheduler_pb2.WorkerLoad]:
        """What the rollout and the trainer would report to the scheduler now (proto WorkerLoad): the
        rollout reports one EngineLoad per settled rollout unit (a moving one has no serving engine,
        as a live engine being drained or started is not in the router), its context in tokens being
        the KV the unit reserves over the KV bytes of one token."""
        oldest = next(
            (self.batch_version[k] for k, n in enumerate(self.live_per_batch) if n > 0), self.version
        )
        kv_per_token = self.cost.model.kv_bytes_per_token
        self._settle_busy()
        rollout = scheduler_pb2.WorkerLoad(
            busy_device_s=self.busy_by_role[Role.ROLLOUT],
            live_executions=self.live,
            queued_generations=len(self.queue),
            running_generations=sum(u.num_generating for u in self.units),
            waiting_on_environment=self.num_env,
            weight_version=oldest,
            engine_capacity=self.slots,
            engines=[
                scheduler_pb2.EngineLoad(
                    device_id=u.device_id,
                    executions=len(u.residents),
                    generating=u.num_generating,
                    context_tokens=round(u.kv_reserved / kv_per_token),
                )
                for u in self.units
                if u.role == Role.ROLLOUT and not u.moving
            ],
        )
        trainer = scheduler_pb2.WorkerLoad(
            busy_device_s=self.busy_by_role[Role.TRAIN],
            trainer_backlog_batches=self._trainer_backlog(),
            trainer_step_s=self.last_step_s,
            weight_version=self.version,
            trainer_step_in_progress=self.step_started is not None,
            trainer_remaining_work_device_s=self._trainable_device_s(),
            trainer_dp_size=len(self._train_units()) * self.w.devices_per_unit,
        )
        return rollout, trainer

    def devices(self) -> list[DeviceState]:
        return [
            DeviceState(u.device_id, (u.target or u.role) if u.moving else u.role, u.moving)
            for u in self.units
        ]

    def _snapshot(self) -> PoolSnapshot:
        rollout, trainer = self.loads()
        devices = self.devices()
        snap = self.split_meter.observe(
            pool_snapshot(
                devices, [rollout], [trainer], default_engine_capacity=self.slots, staleness_bound=self.bound
            ),
            self.now,
        )
        if self.record:
            self.snapshots.append((snap, (devices, rollout, trainer)))
        return snap

    def _trainer_backlog(self) -> int:
        """What the live trainer reports as `trainer_backlog_batches` (services/trainer/service.py):
        scored groups not trained yet, in batches (rounded up), plus one while a step is in progress."""
        k = len(self.step_done)
        waiting = 0.0
        for j in range(k, len(self.batches)):
            avail = self._available(j)
            if avail > 0:  # scored groups the trainer has; the current step's partly trained
                waiting += (self.groups_total[j] - self.groups_left[j]) * avail / self.scored_flops[j]
        per_batch = max(1, self.groups_total[k] if k < len(self.batches) else 1)
        return math.ceil(waiting / per_batch - 1e-9) + int(self.step_started is not None)

    def _trainable_device_s(self) -> float:
        """What the live trainer reports as `trainer_remaining_work_device_s`: device-seconds of the
        current step's work it can train now (the running round and the scored groups not yet in
        one); 0 when it has trained all it has and waits for scored groups."""
        k = len(self.step_done)
        if k >= len(self.batches):
            return 0.0
        flops = max(0.0, self._available(k)) + (self.round_work if self.round_units else 0.0)
        return flops / self.cost.train_flops_per_s(1)

    # --- training -------------------------------------------------------------------------------------------
    def _available(self, k: int) -> float:
        """FLOPs of batch k the trainer may train now (streaming: scored groups; else whole batch)."""
        if not self.sem.trainer_streaming and self.groups_left[k] > 0:
            return 0.0
        trained = self.trained_flops if k == len(self.step_done) else 0.0
        return self.scored_flops[k] - trained

    def _train_units(self) -> set[int]:
        return {u.uid for u in self.units if u.role == Role.TRAIN and not u.moving}

    def _train(self) -> None:
        """Start a micro-batch round if the trainer is free, has replicas and has work."""
        if self.round_units or len(self.step_done) >= len(self.batches):
            return
        k = len(self.step_done)
        avail = self._available(k)
        if avail <= 0:
            return
        if self.sem.trainer_resize == "step":
            if self.step_units is None and any(u.moving and u.target == Role.TRAIN for u in self.units):
                return  # a step starts with the whole group it is being given, not with the first arrival
            if self.step_units is None:
                self.step_units = self._train_units()
            units = set(self.step_units)
        else:
            units = self._train_units()
        if not units:
            if self.step_units is not None and not self.step_units:
                self.step_units = None  # a step cannot start without replicas: decide again later
            return
        if self.step_started is None:
            self.step_started = self.now
        per_token = self.batch_flops[k] / self.batch_tokens[k]
        quantum = per_token * self.w.costs.train_microbatch_tokens
        work = min(avail, len(units) * quantum)
        rate = self.cost.train_flops_per_s(len(units) * self.w.devices_per_unit)
        self.round_units = units
        self.round_work = work
        self.trained_flops += work
        self.round_token += 1
        self._busy(len(units) * self.w.devices_per_unit, Role.TRAIN)
        self._push(self.now + work / rate, RoundDone(self.round_token))

    def _on_round_done(self, token: int) -> None:
        if token != self.round_token:
            return
        self._busy(-len(self.round_units) * self.w.devices_per_unit, Role.TRAIN)
        self.round_units = set()
        k = len(self.step_done)
        if self.groups_left[k] == 0 and self.trained_flops >= self.scored_flops[k] * (1 - 1e-12):
            self._end_step(k)
        if self.sem.trainer_resize == "microbatch" or self.step_units is None:
            self._leave_trainer()
        self._train()
        self._plan()

    def _leave_trainer(self) -> None:
        for u in self.units:
            if u.leaving_trainer and not self._in_use_by_trainer(u.uid):
                u.leaving_trainer = False
                self._drained(u)

    def _end_step(self, k: int) -> None:
        self.train_spans.append(self.now - (self.step_started or self.now))
        # What the trainer reports as trainer_step_s: seconds between its last two optimizer steps.
        self.last_step_s = self.now - (self.step_done[-1] if self.step_done else 0.0)
        self.step_done.append(self.now)
        self.step_started = None
        self.step_units = None
        self.trained_flops = 0.0
        self.version += 1
        if not self.colocate:
            for u in self._rollout_units():
                u.stall_until = self.now + self.w.costs.weight_sync_s
        self._admit()
        self._fill_slots()

    # --- results ---------------------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        w = self.w
        for u in self.units:
            self._set_role(u, u.role)
        t0 = self.step_done[w.warmup_steps - 1] if w.warmup_steps > 0 else 0.0
        t1 = self.step_done[-1]
        n = w.num_steps - w.warmup_steps
        busy = integrate(self.util_events, t0, t1)
        util = busy / (w.num_devices * (t1 - t0)) if t1 > t0 else 0.0
        tails = []
        for k, times in enumerate(self.finish_times):
            if len(times) < 10 or k not in self.first_start:
                continue
            ts = sorted(times)
            start, end = self.first_start[k], ts[-1]
            p90 = ts[int(0.9 * len(ts)) - 1]
            if end > start:
                tails.append((end - p90) / (end - start))
        spans = [r / (r + t) for r, t in zip(self.rollout_spans, self.train_spans, strict=False) if r + t > 0]
        measured = range(w.warmup_steps, w.num_steps)
        planned_gen = sum(sum(self.execs[i].plan.gen) for k in measured for i in self.batches[k])
        return SimResult(
            policy=self.policy.describe(),
            step_done_s=self.step_done,
            time_per_step_s=(t1 - t0) / n,
            device_utilization=util,
            max_staleness=max(self.staleness) if self.staleness else 0,
            rollout_share=sum(spans) / len(spans) if spans else 0.0,
            tail_share=sum(tails) / len(tails) if tails else 0.0,
            tokens_trained_per_step=sum(self.tokens_trained[k] for k in measured) / n,
            generated_trained_share=sum(self.gen_trained[k] for k in measured) / planned_gen
            if planned_gen
            else 1.0,
            kv_peak_share=self.kv_peak,
            num_migrations=self.num_migrations,
            num_role_changes=self.num_role_changes,
            num_parked=self.num_parked,
            num_preemptions=self.num_preemptions,
            timeline=self.timeline,
            utilization_series=[(t, b / w.num_devices) for t, b in self.util_events],
            snapshots=self.snapshots,
            extra={"engine_slots": self.slots, "num_rebalanced": self.num_rebalanced},
        )
