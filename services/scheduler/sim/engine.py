"""Discrete-event simulation, in virtual seconds, of one policy running one workload.

The simulated cluster is a pool of scheduling units (one inference engine = `devices_per_unit`
devices). The REAL policy class (services/scheduler/policies.py) is asked for a plan whenever
something it looks at changes (an execution finishes or is admitted, a training step ends, a unit
finishes a handoff); the simulator carries the plan out the way the live system does:

- rollout -> train: the unit stops taking work, each resident execution is live-migrated (KV copy,
  `CostModel.migration_s`) to the least-loaded other rollout unit with a free slot (or parked when
  none has one), then the unit pays the role-change cost and joins the trainer;
- train -> rollout: the unit leaves the trainer, pays the role-change cost, then takes executions.

Executions: turn j = incremental prefill of obs[j], decode of gen[j] tokens at the unit's current
memory-bound step time (fixed for the turn: quasi-static), then environment latency env_s[j] (the
KV cache stays resident, holding a slot). Training: step k trains exactly batch k once all of its
executions finished (equal work for every policy), as a fluid over the devices currently training
(the trainer re-partitions the remaining micro-batches when its data-parallel group changes).
Admission: batch k starts generating only when `may_start_batch(k, version, bound)` holds.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.policies import DeviceState, Policy, PoolSnapshot, Role, may_start_batch
from services.scheduler.sim.cost import CostModel
from services.scheduler.sim.sample import ExecutionPlan

SWITCHING = "switching"


@dataclass
class _Unit:
    uid: int
    role: Role
    moving: bool = False
    target: Role | None = None
    residents: set[int] = field(default_factory=set)
    decoding_ctx: float = 0.0
    num_generating: int = 0
    stall_until: float = 0.0
    token: int = 0
    pending_copies: int = 0

    @property
    def device_id(self) -> str:
        return f"u{self.uid:03d}"


@dataclass
class _Exec:
    eid: int
    step: int
    plan: ExecutionPlan
    turn: int = 0
    ctx: float = 0.0
    unit: int | None = None
    phase: str = "pending"  # pending | gen | env | done
    token: int = 0
    start_version: int = -1
    gen_ctx: float = 0.0
    gen_start: float = 0.0
    gen_rate_s: float = 0.0
    gen_tokens: float = 0.0
    resume_tokens: float = 0.0  # tokens of the current turn still to generate after a park
    ready_at: float = 0.0  # KV copy to its current unit done at this time


@dataclass
class SimResult:
    """Outcome of one simulated run."""

    policy: str
    step_done_s: list[float]
    time_per_step_s: float
    device_utilization: float
    max_staleness: int
    rollout_share: float  # colocate only meaningful: rollout time / step time
    tail_share: float  # share of rollout time taken by the last 10% of executions (per step, mean)
    num_migrations: int
    num_role_changes: int
    num_parked: int
    timeline: list[tuple[int, float, float, str]]  # (unit, t0, t1, role label)
    utilization_series: list[tuple[float, float]]  # (t, busy share of devices)
    extra: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """One policy against one sampled workload. `run()` returns a SimResult."""

    def __init__(self, policy: Policy, cost: CostModel, executions: list[list[ExecutionPlan]]) -> None:
        self.policy = policy
        self.cost = cost
        self.w = cost.workload
        self.bound = policy.staleness_bound
        self.colocate = policy.name == "colocate"
        self.slots = cost.engine_slots()
        self.units = [_Unit(i, Role.IDLE) for i in range(self.w.num_units)]
        self.execs: list[_Exec] = []
        self.batches: list[list[int]] = []
        for k, plans in enumerate(executions):
            ids = []
            for p in plans:
                e = _Exec(len(self.execs), k, p)
                self.execs.append(e)
                ids.append(e.eid)
            self.batches.append(ids)
        self.remaining = [len(b) for b in self.batches]
        self.batch_flops = [
            sum(cost.train_flops(self.execs[i].plan.final_context) for i in b) for b in self.batches
        ]
        self.next_batch = 0  # first batch not yet admitted
        self.queue: list[int] = []  # admitted, waiting for a slot (parked ones at the front)
        self.live = 0
        self.version = 0
        self.complete: list[int] = []  # complete batches not trained yet
        self.train_step: int | None = None
        self.train_left = 0.0
        self.train_last = 0.0
        self.train_token = 0
        self.step_done: list[float] = []
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        # accounting
        self.busy_devices = 0
        self.busy_gpu_s = 0.0
        self.busy_since = 0.0
        self.util_events: list[tuple[float, int]] = []
        self.role_since = [0.0] * len(self.units)
        self.timeline: list[tuple[int, float, float, str]] = []
        self.first_start: dict[int, float] = {}
        self.finish_times: list[list[float]] = [[] for _ in self.batches]
        self.num_migrations = 0
        self.num_role_changes = 0
        self.num_parked = 0
        self.staleness: list[int] = []
        self.rollout_spans: list[float] = []
        self.train_spans: list[float] = []
        self.train_started = 0.0

    # --- event plumbing ---------------------------------------------------------------------------
    def _push(self, t: float, kind: str, a: int, b: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, a, b))

    def _busy(self, delta_devices: int) -> None:
        self.busy_gpu_s += self.busy_devices * (self.now - self.busy_since)
        self.busy_since = self.now
        self.busy_devices += delta_devices
        self.util_events.append((self.now, self.busy_devices))

    def _set_role(self, u: _Unit, label: Role | str) -> None:
        prev = self._label(u)
        if self.now > self.role_since[u.uid]:
            self.timeline.append((u.uid, self.role_since[u.uid], self.now, prev))
        self.role_since[u.uid] = self.now
        if isinstance(label, Role):
            u.role = label

    @staticmethod
    def _label(u: _Unit) -> str:
        return SWITCHING if u.moving else str(u.role)

    # --- main loop --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._admit()
        self._initial_roles()
        self._fill_slots()
        self._plan()
        n = self.w.num_steps
        while len(self.step_done) < n:
            if not self.heap:
                raise RuntimeError(f"simulation of {self.policy.describe()} stalled at t={self.now:.0f}s")
            t, _, kind, a, b = heapq.heappop(self.heap)
            self.now = t
            getattr(self, "_on_" + kind)(a, b)
        return self._result()

    def _initial_roles(self) -> None:
        """Roles at t=0 are set for free (the job starts in the policy's preferred layout)."""
        for _ in range(3):
            moves = self.policy.plan(self._snapshot())
            for m in moves:
                self.units[int(m.device_id[1:])].role = m.to_role
            if not moves:
                break

    # --- admission and placement ------------------------------------------------------------------
    def _admit(self) -> None:
        while self.next_batch < len(self.batches) and may_start_batch(
            self.next_batch, self.version, self.bound
        ):
            self.queue.extend(self.batches[self.next_batch])
            self.next_batch += 1

    def _free_units(self) -> list[_Unit]:
        return [
            u for u in self.units if u.role == Role.ROLLOUT and not u.moving and len(u.residents) < self.slots
        ]

    def _fill_slots(self) -> None:
        while self.queue:
            free = self._free_units()
            if not free:
                return
            u = min(free, key=lambda x: (len(x.residents), x.decoding_ctx, x.uid))
            e = self.execs[self.queue.pop(0)]
            self._place(e, u)

    def _place(self, e: _Exec, u: _Unit) -> None:
        u.residents.add(e.eid)
        e.unit = u.uid
        if e.phase == "pending":
            e.start_version = self.version
            self.live += 1
            self.first_start.setdefault(e.step, self.now)
            e.ready_at = self.now
            self._start_turn(e, self.now)
        else:  # parked earlier: its KV comes back from host memory
            self._resume_parked(e, u)

    def live_versions(self) -> list[int]:
        return [self.execs[i].start_version for u in self.units for i in u.residents]

    # --- execution life -----------------------------------------------------------------------------
    def _start_turn(self, e: _Exec, t: float) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        o = e.plan.obs[e.turn]
        prefill = self.cost.prefill_s(o, e.ctx)
        e.ctx += o
        self._begin_gen(e, u, max(t, u.stall_until, e.ready_at) + prefill, e.plan.gen[e.turn])

    def _begin_gen(self, e: _Exec, u: _Unit, start: float, tokens: float) -> None:
        step_s = self.cost.decode_step_s(u.decoding_ctx + e.ctx)
        e.phase = "gen"
        e.gen_ctx = e.ctx
        e.gen_start = start
        e.gen_rate_s = step_s
        e.gen_tokens = tokens
        u.decoding_ctx += e.ctx
        u.num_generating += 1
        if u.num_generating == 1:
            self._busy(self.w.devices_per_unit)
        e.token += 1
        self._push(start + tokens * step_s, "gen_done", e.eid, e.token)

    def _end_gen(self, e: _Exec) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        u.decoding_ctx -= e.gen_ctx
        u.num_generating -= 1
        if u.num_generating == 0:
            self._busy(-self.w.devices_per_unit)

    def _on_gen_done(self, eid: int, token: int) -> None:
        e = self.execs[eid]
        if token != e.token:
            return
        self._end_gen(e)
        e.ctx += e.gen_tokens
        e.turn += 1
        if e.turn >= len(e.plan.gen):
            self._finish(e)
            return
        e.phase = "env"
        e.token += 1
        self._push(self.now + e.plan.env_s[e.turn - 1], "env_done", e.eid, e.token)

    def _on_env_done(self, eid: int, token: int) -> None:
        e = self.execs[eid]
        if token != e.token:
            return
        if e.unit is None:  # parked: the next turn starts when it is placed again
            e.phase = "parked_ready"
            return
        self._start_turn(e, self.now)

    def _finish(self, e: _Exec) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        u.residents.discard(e.eid)
        e.unit = None
        e.phase = "done"
        self.live -= 1
        k = e.step
        self.finish_times[k].append(self.now)
        self.staleness.append(k - e.start_version)
        self.remaining[k] -= 1
        if self.remaining[k] == 0:
            self.rollout_spans.append(self.now - self.first_start[k])
            self.complete.append(k)
            self._maybe_start_training()
        self._fill_slots()
        self._plan()

    # --- live migration -------------------------------------------------------------------------------
    def _migrate_out(self, u: _Unit) -> None:
        """Move every execution resident on `u` elsewhere; nothing is aborted, tokens so far are kept."""
        for eid in sorted(u.residents):
            e = self.execs[eid]
            left = 0.0
            if e.phase == "gen":
                done = min(e.gen_tokens, max(0.0, (self.now - e.gen_start) / e.gen_rate_s))
                left = e.gen_tokens - done
                self._end_gen(e)
                e.token += 1
                e.ctx += done
            u.residents.discard(eid)
            dests = [x for x in self._free_units() if x.uid != u.uid]
            if not dests:  # parked until a slot exists (DESIGN: "or parked until one exists")
                e.unit = None
                self.num_parked += 1
                e.resume_tokens = left
                e.phase = "parked_gen" if e.phase == "gen" else "parked_env"
                self.queue.insert(0, eid)
                continue
            d = min(dests, key=lambda x: (len(x.residents), x.decoding_ctx, x.uid))
            copy = self.cost.migration_s(e.ctx)
            self.num_migrations += 1
            d.residents.add(eid)
            e.unit = d.uid
            e.ready_at = self.now + copy
            if e.phase == "gen":
                self._begin_gen(e, d, max(e.ready_at, d.stall_until), left)
            # env phase: the copy overlaps the environment; the next turn waits for ready_at.
            u.pending_copies += 1
            self._push(e.ready_at, "copy_done", u.uid, 0)

    def _resume_parked(self, e: _Exec, u: _Unit) -> None:
        e.ready_at = self.now + self.cost.migration_s(e.ctx)
        if e.phase == "parked_gen":
            self._begin_gen(e, u, max(e.ready_at, u.stall_until), e.resume_tokens)
        elif e.phase == "parked_ready":
            self._start_turn(e, self.now)
        else:  # parked_env: env_done starts the next turn
            e.phase = "env"

    def _on_copy_done(self, uid: int, _: int) -> None:
        u = self.units[uid]
        u.pending_copies -= 1
        if u.pending_copies == 0 and not u.residents and u.moving:
            self._drained(u)

    # --- handoffs ---------------------------------------------------------------------------------------
    def _apply(self, uid: int, to: Role) -> None:
        u = self.units[uid]
        if u.moving or u.role == to:
            return
        self.num_role_changes += 1
        self._set_role(u, u.role)
        was = u.role
        if was == Role.TRAIN:
            self._trainer_book()
            if self.train_step is not None:
                self._busy(-self.w.devices_per_unit)
        u.moving = True
        u.target = to
        if was == Role.TRAIN:
            self._trainer_update()
            self._drained(u)
        elif was == Role.ROLLOUT:
            self._migrate_out(u)
            if not u.residents and u.pending_copies == 0:
                self._drained(u)
        else:
            self._drained(u)

    def _drained(self, u: _Unit) -> None:
        c = self.w.costs
        if self.colocate:
            cost = c.switch_rollout_to_train_s if u.target == Role.TRAIN else c.switch_train_to_rollout_s
        else:
            cost = c.elastic_role_change_s
        u.token += 1
        self._push(self.now + cost, "switched", u.uid, u.token)

    def _on_switched(self, uid: int, token: int) -> None:
        u = self.units[uid]
        if token != u.token:
            return
        to = u.target or Role.IDLE
        if to == Role.TRAIN:
            self._trainer_book()
        self._set_role(u, to)
        u.moving = False
        u.target = None
        if to == Role.TRAIN:
            if self.train_step is not None:
                self._busy(self.w.devices_per_unit)
            self._trainer_update()
        self._fill_slots()
        self._plan()

    def _plan(self) -> None:
        for m in self.policy.plan(self._snapshot()):
            self._apply(int(m.device_id[1:]), m.to_role)

    def _snapshot(self) -> PoolSnapshot:
        devices = tuple(
            DeviceState(u.device_id, (u.target or u.role) if u.moving else u.role, u.moving, len(u.residents))
            for u in self.units
        )
        oldest = min(self.live_versions(), default=self.version)
        return PoolSnapshot(
            devices=devices,
            live_executions=self.live,
            queued_generations=sum(1 for i in self.queue if self.execs[i].phase == "pending"),
            engine_capacity=self.slots,
            trainer_backlog=self._trainable_backlog(),
            trainer_busy=self.train_step is not None,
            latest_version=self.version,
            oldest_live_version=oldest,
            staleness_bound=self.bound,
            trainer_work_device_s=self._trainer_work_unit_s(),
            role_change_s=self.w.costs.elastic_role_change_s,
        )

    def _trainer_work_unit_s(self) -> float:
        """Training work running or waiting in order, in scheduling-unit-seconds."""
        flops = 0.0
        if self.train_step is not None:
            rate = self.cost.train_flops_per_s(self._train_devices())
            flops += max(0.0, self.train_left - rate * (self.now - self.train_last))
        first = len(self.step_done) + (1 if self.train_step is not None else 0)
        for k in range(first, first + self._trainable_backlog()):
            flops += self.batch_flops[k]
        return flops / self.cost.train_flops_per_s(self.w.devices_per_unit)

    def _trainable_backlog(self) -> int:
        """Complete batches the trainer could train in order (step k needs batch k)."""
        done = set(self.complete)
        k = len(self.step_done) + (1 if self.train_step is not None else 0)
        n = 0
        while k + n in done:
            n += 1
        return n

    # --- training -------------------------------------------------------------------------------------------
    def _train_devices(self) -> int:
        return sum(self.w.devices_per_unit for u in self.units if u.role == Role.TRAIN and not u.moving)

    def _trainer_book(self) -> None:
        """Book the work done at the old rate up to now."""
        if self.train_step is not None:
            rate = self.cost.train_flops_per_s(self._train_devices())
            self.train_left -= rate * (self.now - self.train_last)
        self.train_last = self.now

    def _trainer_update(self) -> None:
        """(Re)schedule the end of the current step at the current number of training devices."""
        self.train_last = self.now
        self.train_token += 1
        if self.train_step is None:
            return
        rate = self.cost.train_flops_per_s(self._train_devices())
        if rate > 0:
            self._push(self.now + max(0.0, self.train_left) / rate, "train_done", self.train_token)

    def _maybe_start_training(self) -> None:
        if self.train_step is not None or not self.complete:
            return
        k = min(self.complete)
        if k != len(self.step_done):
            return
        self.complete.remove(k)
        self.train_step = k
        self.train_started = self.now
        self.train_left = sum(
            self.cost.train_flops(self.execs[i].plan.final_context) for i in self.batches[k]
        )
        self._busy(self._train_devices())
        self._trainer_update()

    def _on_train_done(self, token: int, _: int) -> None:
        if token != self.train_token or self.train_step is None:
            return
        self._busy(-self._train_devices())
        self.train_spans.append(self.now - self.train_started)
        self.step_done.append(self.now)
        self.train_step = None
        self.version += 1
        if not self.colocate:
            for u in self.units:
                if u.role == Role.ROLLOUT and not u.moving:
                    u.stall_until = self.now + self.w.costs.weight_sync_s
        self._admit()
        self._maybe_start_training()
        self._plan()
        self._fill_slots()

    # --- results ---------------------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        w = self.w
        self._busy(0)
        for u in self.units:
            self._set_role(u, u.role)
        t0 = self.step_done[w.warmup_steps - 1] if w.warmup_steps > 0 else 0.0
        t1 = self.step_done[-1]
        n = w.num_steps - w.warmup_steps
        busy = _integrate(self.util_events, t0, t1)
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
        spans = [r / (r + t) for r, t in zip(self.rollout_spans, self.train_spans, strict=False)]
        series = [(t, b / w.num_devices) for t, b in self.util_events]
        return SimResult(
            policy=self.policy.describe(),
            step_done_s=self.step_done,
            time_per_step_s=(t1 - t0) / n,
            device_utilization=util,
            max_staleness=max(self.staleness) if self.staleness else 0,
            rollout_share=sum(spans) / len(spans) if spans else 0.0,
            tail_share=sum(tails) / len(tails) if tails else 0.0,
            num_migrations=self.num_migrations,
            num_role_changes=self.num_role_changes,
            num_parked=self.num_parked,
            timeline=self.timeline,
            utilization_series=series,
            extra={"engine_slots": self.slots},
        )


def _integrate(events: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Integral over [t0, t1] of the step function given by (time, value-from-then-on) events."""
    total = 0.0
    value = 0
    last = t0
    for t, v in events:
        if t > t1:
            break
        if t > t0:
            total += value * (t - last)
            last = t
        value = v
    total += value * (t1 - last)
    return total
