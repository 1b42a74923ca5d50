"""Discrete-event simulation, in virtual seconds, of one policy running one workload.

The simulated cluster is a pool of scheduling units (one inference engine or one data-parallel
trainer replica = `devices_per_unit` devices). The REAL policy class (services/scheduler/policies.py)
is asked for a plan whenever something it looks at changes, on a snapshot built by the same
function as the live plan loop's (services/scheduler/snapshot.py) from the same `WorkerLoad`
fields; the simulator carries the plan out the way the live services do:

- rollout -> train: the unit stops taking work, each resident execution is live-migrated (KV copy,
  `CostModel.migration_s`) to another rollout unit with room for its KV, or parked (KV offloaded to
  host, paid both ways on resume) when none has room; then the unit pays the role change and joins
  the trainer;
- train -> rollout: the unit leaves the trainer at the trainer's next resize point (the end of the
  current micro-batch round, or of the step with `trainer_resize: step`), pays the role change,
  then takes executions.

Executions. Turn j = incremental prefill of obs[j], decode of gen[j] tokens at the unit's
memory-bound step time when the turn starts (quasi-static), then environment latency env_s[j] (the
KV stays resident). Admission is against each execution's actual KV size: before a turn, the
execution reserves the KV of its context at the end of the turn; a unit never holds more reserved
KV than its budget (`CostModel.kv_budget_bytes`) nor more executions than its max batch
(`engine_capacity`). An execution whose next turn does not fit is preempted: migrated to a unit with
room, else parked (offloaded to host and reloaded, both copies paid). The placement queue is FIFO
(parked executions first) without bypass, so no execution starves; it is served after every event
of the same instant (units that finish a role change together all take work). At each turn start
after an environment wait the router may move the execution to the rollout unit where that turn
decodes fastest, when the decode time saved (at the units' loads then) exceeds its KV copy. Batch k starts generating only
when `may_start_batch(k, version, bound)` holds.

Scoring (as the trajectory service): a group (one task's executions) is scored when all of them
ended, or `train_unfinished_after_s` after its first one ended, whichever comes first; then the
unfinished ones are trained on the tokens they have so far and keep running (the rollout is not told;
what they generate later is not trained). Training: step k trains the scored groups of batch k, in
micro-batch rounds of `train_microbatch_tokens` per data-parallel replica; streaming (the default)
trains groups as they are scored, batch-synchronous waits for the whole batch.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from gyre.costmodel import CostModel
from gyre.pipeline_rules import cutoff_due_s, group_ready, may_start_batch
from gyre.workload import Workload
from services.scheduler.policies import Policy, PoolSnapshot, Role
from services.scheduler.sim.sample import ExecutionPlan
from services.scheduler.sim.state import (
    SWITCHING,
    CopyDone,
    EnvDone,
    Event,
    Execution,
    GenDone,
    GroupCutoff,
    Phase,
    Place,
    PlanTick,
    RoundDone,
    SimResult,
    Switched,
    Unit,
)
from services.scheduler.sim.trainer_side import TrainerSide
from services.scheduler.split_meter import SplitMeter


class Simulation(TrainerSide):
    """One policy against one sampled workload. `run()` returns a SimResult."""

    def __init__(
        self,
        policy: Policy,
        workload: Workload,
        executions: list[list[ExecutionPlan]],
        engine_capacity: int,
        record_snapshots: bool = False,
        plan_interval_s: float = 1.0,
        split_meter: SplitMeter | None = None,
    ) -> None:
        self.policy = policy
        self.w = workload
        self.cost: CostModel = workload.cost_model()
        self.sem = workload.service
        self.bound = policy.staleness_bound
        self.colocate = policy.name == "colocate"
        self.slots = engine_capacity
        self.kv_budget = self.cost.kv_budget_bytes()
        self.record = record_snapshots
        self.units = [Unit(i, Role.IDLE) for i in range(workload.num_units)]
        self.execs: list[Execution] = []
        self.batches: list[list[int]] = []
        self.groups: dict[tuple[int, int], list[int]] = {}
        for k, plans in enumerate(executions):
            ids = []
            for p in plans:
                e = Execution(len(self.execs), k, p)
                self.execs.append(e)
                ids.append(e.eid)
                self.groups.setdefault((k, p.task), []).append(e.eid)
            self.batches.append(ids)
        self.groups_left = [len({self.execs[i].plan.task for i in b}) for b in self.batches]
        self.groups_total = list(self.groups_left)
        self.group_scored: set[tuple[int, int]] = set()
        self.cutoff_armed: set[tuple[int, int]] = set()
        self.first_end: dict[tuple[int, int], float] = {}  # group -> when its first execution ended
        self.scored_log: list[tuple[int, int, float]] = []  # (step, task, time) of each group scored
        self.next_batch = 0
        self.queue: list[int] = []  # executions waiting for a unit, in order (no bypass)
        self.live = 0
        self.version = 0
        # trainer
        self.scored_flops = [0.0] * len(self.batches)  # flops of scored groups per batch
        self.trained_flops = 0.0  # flops of the current step trained or in the running round
        self.round_token = 0
        self.round_units: set[int] = set()
        self.round_work = 0.0
        self.step_units: set[int] | None = None  # 'step' resize: the replicas of the running step
        self.step_started: float | None = None
        self.last_step_s = 0.0
        self.step_done: list[float] = []
        self.tokens_trained = [0.0] * len(self.batches)
        self.gen_trained = [0.0] * len(self.batches)
        self.batch_tokens = [sum(self.execs[i].plan.final_context for i in b) for b in self.batches]
        self.batch_flops = [
            sum(self.cost.train_flops(self.execs[i].plan.final_context) for i in b) for b in self.batches
        ]
        self.heap: list[tuple[float, int, Event]] = []
        self.seq = itertools.count()
        self.now = 0.0
        # accounting
        self.busy_devices = 0
        self.util_events: list[tuple[float, int]] = []
        # Cumulative busy unit-seconds per role, as the workers report them (WorkerLoad.busy_device_s; a
        # policy device is one unit here, as in the snapshot).
        self.busy_by_role = {Role.ROLLOUT: 0.0, Role.TRAIN: 0.0}
        self.busy_now = {Role.ROLLOUT: 0.0, Role.TRAIN: 0.0}
        self.busy_mark = 0.0
        self.split_meter = split_meter if split_meter is not None else SplitMeter()
        self.role_since = [0.0] * len(self.units)
        self.timeline: list[tuple[int, float, float, str]] = []
        self.first_start: dict[int, float] = {}
        self.finish_times: list[list[float]] = [[] for _ in self.batches]
        self.scored_at: dict[int, float] = {}
        self.num_migrations = 0
        self.num_role_changes = 0
        self.num_parked = 0
        self.num_preemptions = 0
        self.kv_peak = 0.0
        self.staleness: list[int] = []
        self.rollout_spans: list[float] = []
        self.train_spans: list[float] = []
        self.snapshots: list[tuple[PoolSnapshot, tuple[Any, ...]]] = []
        self.plan_interval_s = plan_interval_s
        self.plan_pending = False
        self.last_plan = -plan_interval_s
        self.live_per_batch = [0] * len(self.batches)
        self.batch_version = [0] * len(self.batches)
        self.num_env = 0
        self.place_pending = False
        self.num_rebalanced = 0

    # --- event plumbing ---------------------------------------------------------------------------
    def _push(self, t: float, event: Event) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), event))

    def _busy(self, delta_devices: int, role: Role) -> None:
        self._settle_busy()
        # Busy is reported per policy device, which the simulator's snapshot makes one unit.
        self.busy_now[role] += delta_devices / self.w.devices_per_unit
        self.busy_devices += delta_devices
        self.util_events.append((self.now, self.busy_devices))

    def _settle_busy(self) -> None:
        """Bring the per-role busy device-seconds up to now."""
        for role, n in self.busy_now.items():
            self.busy_by_role[role] += n * (self.now - self.busy_mark)
        self.busy_mark = self.now

    def _set_role(self, u: Unit, role: Role) -> None:
        prev = SWITCHING if u.moving else str(u.role)
        if self.now > self.role_since[u.uid]:
            self.timeline.append((u.uid, self.role_since[u.uid], self.now, prev))
        self.role_since[u.uid] = self.now
        u.role = role

    # --- main loop --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._admit()
        self._initial_roles()
        self._fill_slots()
        self._plan()
        while len(self.step_done) < self.w.num_steps:
            if not self.heap:
                raise RuntimeError(f"simulation of {self.policy.describe()} stalled at t={self.now:.0f}s")
            t, _, event = heapq.heappop(self.heap)
            self.now = t
            match event:
                case GenDone(eid, token):
                    self._on_gen_done(eid, token)
                case EnvDone(eid, token):
                    self._on_env_done(eid, token)
                case CopyDone(uid):
                    self._on_copy_done(uid)
                case Switched(uid, token):
                    self._on_switched(uid, token)
                case RoundDone(token):
                    self._on_round_done(token)
                case GroupCutoff(step, task):
                    if self._group_ready((step, task)):
                        self._score_group(step, task)
                case Place():
                    self.place_pending = False
                    self._fill_slots()
                case PlanTick():
                    self._plan_now()
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
            self.batch_version[self.next_batch] = self.version
            self.live_per_batch[self.next_batch] = len(self.batches[self.next_batch])
            for eid in self.batches[self.next_batch]:
                e = self.execs[eid]
                e.start_version = self.version
                self.live += 1
                self.queue.append(eid)
            self.first_start.setdefault(self.next_batch, self.now)
            self.next_batch += 1

    def _need(self, e: Execution) -> float:
        """KV bytes `e` must hold on a unit to go on: to the end of its current or next turn."""
        if e.phase == Phase.ENV:
            return self.cost.kv_bytes(e.ctx)
        if e.in_turn:
            return self.cost.kv_bytes(e.ctx + e.resume_tokens)
        return self.cost.kv_bytes(e.ctx + e.plan.obs[e.turn] + e.plan.gen[e.turn])

    def _rollout_units(self) -> list[Unit]:
        return [u for u in self.units if u.role == Role.ROLLOUT and not u.moving]

    def _room(self, u: Unit, need: float) -> bool:
        return len(u.residents) < self.slots and u.kv_reserved + need <= self.kv_budget

    def _pick(self, need: float, exclude: int | None = None) -> Unit | None:
        """The router's choice: the unit with room and the least KV, lowest ID on ties."""
        fits = [u for u in self._rollout_units() if u.uid != exclude and self._room(u, need)]
        return min(fits, key=lambda x: (x.kv_reserved, x.uid)) if fits else None

    def _reserve(self, e: Execution, u: Unit, need: float) -> None:
        u.kv_reserved += need - e.reserved
        e.reserved = need
        self.kv_peak = max(self.kv_peak, u.kv_reserved / self.kv_budget)

    def _attach(self, e: Execution, u: Unit, need: float) -> None:
        u.residents.add(e.eid)
        e.unit = u.uid
        self._reserve(e, u, need)

    def _detach(self, e: Execution) -> Unit:
        u = self.units[e.unit]  # type: ignore[index]
        u.residents.discard(e.eid)
        u.kv_reserved -= e.reserved
        e.reserved = 0.0
        e.unit = None
        return u

    def _fill_slots(self) -> None:
        while self.queue:
            e = self.execs[self.queue[0]]
            need = self._need(e)
            u = self._pick(need)
            if u is None:
                return  # FIFO without bypass: the head waits for room, nobody overtakes it
            self.queue.pop(0)
            self._attach(e, u, need)
            if e.phase == Phase.PENDING:
                e.ready_at = self.now
                self._start_turn(e)
            else:  # parked: its KV comes back from host memory first
                e.ready_at = self.now + 2 * self.cost.offload_s(e.ctx)  # copied out, then back
                self._resume(e)

    def _resume(self, e: Execution) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        if e.in_turn:
            e.in_turn = False
            self._begin_gen(e, u, max(e.ready_at, u.stall_until), e.resume_tokens)
        elif e.phase == Phase.ENV:
            pass  # its environment is still running; EnvDone starts the next turn
        else:
            self._start_turn(e)

    # --- execution life -----------------------------------------------------------------------------
    def _start_turn(self, e: Execution) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        need = self.cost.kv_bytes(e.ctx + e.plan.obs[e.turn] + e.plan.gen[e.turn])
        if u.kv_reserved - e.reserved + need > self.kv_budget:
            self._preempt(e, u, need)
            return
        self._reserve(e, u, need)
        o = e.plan.obs[e.turn]
        prefill = self.cost.prefill_s(o, e.ctx)
        e.ctx += o
        self._begin_gen(e, u, max(self.now, u.stall_until, e.ready_at) + prefill, e.plan.gen[e.turn])

    def _preempt(self, e: Execution, u: Unit, need: float) -> None:
        """The next turn of `e` does not fit on `u`: move it to a unit with room, else park it."""
        self.num_preemptions += 1
        self._detach(e)
        e.phase = Phase.WAITING
        d = self._pick(need, exclude=u.uid)
        if d is not None and not self.queue:
            self.num_migrations += 1
            self._attach(e, d, need)
            e.ready_at = self.now + self.cost.migration_s(e.ctx)
            self._start_turn(e)
            return
        self.num_parked += 1
        self.queue.insert(self._parked_end(), e.eid)
        self._fill_slots()

    def _parked_end(self) -> int:
        """Queue position after the parked executions (they go before never-started ones)."""
        n = 0
        while n < len(self.queue) and self.execs[self.queue[n]].phase != Phase.PENDING:
            n += 1
        return n

    def _begin_gen(self, e: Execution, u: Unit, start: float, tokens: float) -> None:
        step_s = self.cost.decode_step_s(u.decoding_ctx + e.ctx)
        e.phase = Phase.GEN
        e.gen_start = start
        e.gen_rate_s = step_s
        e.gen_tokens = tokens
        u.decoding_ctx += e.ctx
        u.num_generating += 1
        if u.num_generating == 1:
            self._busy(self.w.devices_per_unit, Role.ROLLOUT)
        e.token += 1
        self._push(start + tokens * step_s, GenDone(e.eid, e.token))

    def _end_gen(self, e: Execution, done_tokens: float) -> None:
        u = self.units[e.unit]  # type: ignore[index]
        u.decoding_ctx -= e.ctx
        u.num_generating -= 1
        if u.num_generating == 0:
            self._busy(-self.w.devices_per_unit, Role.ROLLOUT)
        e.ctx += done_tokens
        e.generated += done_tokens

    def _on_gen_done(self, eid: int, token: int) -> None:
        e = self.execs[eid]
        if token != e.token:
            return
        self._end_gen(e, e.gen_tokens)
        e.turn += 1
        if e.turn >= len(e.plan.gen):
            self._finish(e)
            return
        e.phase = Phase.ENV
        self.num_env += 1
        e.token += 1
        self._push(self.now + e.plan.env_s[e.turn - 1], EnvDone(e.eid, e.token))

    def _on_env_done(self, eid: int, token: int) -> None:
        e = self.execs[eid]
        if token != e.token:
            return
        self.num_env -= 1
        if e.unit is None:  # parked during its environment wait: the next turn starts once placed
            e.phase = Phase.WAITING
            return
        self._rebalance(e)
        self._start_turn(e)

    def _rebalance(self, e: Execution) -> None:
        """The router's turn-start choice (the live router sends each generation request to the
        engine decoding the least context): move `e` to the rollout unit where its next turn decodes fastest when
        the decode time saved, at the units' loads now, exceeds the KV copy it waits for. So an
        engine that joins rollout takes work from crowded ones, and the longest contexts (the
        costliest to keep together) spread first."""
        u = self.units[e.unit]  # type: ignore[index]
        obs, gen = e.plan.obs[e.turn], e.plan.gen[e.turn]
        ctx = e.ctx + obs
        need = self.cost.kv_bytes(ctx + gen)
        here = self.cost.decode_step_s(u.decoding_ctx + ctx) * gen + max(0.0, u.stall_until - self.now)
        copy = self.cost.migration_s(e.ctx)
        best, best_s = None, here - copy
        for d in self._rollout_units():
            if d is u or not self._room(d, need):
                continue
            there = self.cost.decode_step_s(d.decoding_ctx + ctx) * gen + max(0.0, d.stall_until - self.now)
            if there < best_s:
                best, best_s = d, there
        if best is None:
            return
        self._detach(e)
        self._attach(e, best, need)
        self.num_migrations += 1
        self.num_rebalanced += 1
        e.ready_at = self.now + copy

    def _finish(self, e: Execution) -> None:
        self._detach(e)
        e.phase = Phase.DONE
        e.ended_at = self.now
        self.live -= 1
        k = e.step
        self.live_per_batch[k] -= 1
        self.finish_times[k].append(self.now)
        key = (k, e.plan.task)
        if key not in self.group_scored:
            self.first_end.setdefault(key, self.now)
            if self._group_ready(key):
                self._score_group(*key)
            elif key not in self.cutoff_armed:
                due = cutoff_due_s(self.first_end[key], self.sem.train_unfinished_after_s)
                if due is not None:
                    self.cutoff_armed.add(key)
                    self._push(due, GroupCutoff(*key))
        self._fill_slots()
        self._plan()

    # --- scoring (as the trajectory service) -----------------------------------------------------------
    def _group_ready(self, key: tuple[int, int]) -> bool:
        """The trajectory service's rule (gyre.pipeline_rules.group_ready) on this group now."""
        all_ended = all(self.execs[i].phase == Phase.DONE for i in self.groups[key])
        return group_ready(all_ended, self.first_end.get(key), self.now, self.sem.train_unfinished_after_s)

    def _tokens_so_far(self, e: Execution) -> tuple[float, float]:
        """(context tokens, generated tokens) of `e` now, counting the current turn's decoded part."""
        if e.phase != Phase.GEN:
            return e.ctx, e.generated
        done = min(e.gen_tokens, max(0.0, (self.now - e.gen_start) / e.gen_rate_s))
        return e.ctx + done, e.generated + done

    def _score_group(self, k: int, task: int) -> None:
        key = (k, task)
        if key in self.group_scored:
            return
        self.group_scored.add(key)
        self.scored_log.append((k, task, self.now))
        flops = 0.0
        for i in self.groups[key]:
            e = self.execs[i]
            ctx, gen = self._tokens_so_far(e)
            if e.phase != Phase.DONE:
                e.cut = True
            flops += self.cost.train_flops(ctx)
            self.tokens_trained[k] += ctx
            self.gen_trained[k] += gen
            self.staleness.append(k - e.start_version)
        self.scored_flops[k] += flops
        self.groups_left[k] -= 1
        if self.groups_left[k] == 0:
            self.scored_at[k] = self.now
            self.rollout_spans.append(self.now - self.first_start[k])
        self._train()
        self._plan()

    # --- live migration -------------------------------------------------------------------------------
    def _migrate_out(self, u: Unit) -> None:
        """Move every execution resident on `u` elsewhere; nothing is aborted, tokens so far are kept."""
        for eid in sorted(u.residents):
            e = self.execs[eid]
            if e.phase == Phase.GEN:
                done = min(e.gen_tokens, max(0.0, (self.now - e.gen_start) / e.gen_rate_s))
                left = e.gen_tokens - done
                self._end_gen(e, done)
                e.token += 1
                e.in_turn = True
                e.resume_tokens = left
                e.phase = Phase.WAITING
            need = self._need(e)
            self._detach(e)
            d = self._pick(need, exclude=u.uid) if not self.queue else None
            if d is None:  # parked until a unit has room (DESIGN: "or parked until one exists");
                # one waiting on its environment keeps waiting meanwhile
                self.num_parked += 1
                self.queue.insert(self._parked_end(), eid)
                continue
            self.num_migrations += 1
            self._attach(e, d, need)
            e.ready_at = self.now + self.cost.migration_s(e.ctx)
            if e.in_turn:
                e.in_turn = False
                self._begin_gen(e, d, max(e.ready_at, d.stall_until), e.resume_tokens)
            # ENV phase: the copy overlaps the environment; the next turn waits for ready_at.
            u.pending_copies += 1
            self._push(e.ready_at, CopyDone(u.uid))

    def _on_copy_done(self, uid: int) -> None:
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
        was = u.role
        self._set_role(u, was)
        u.moving = True
        u.target = to
        if was == Role.TRAIN:
            if self._in_use_by_trainer(uid):
                u.leaving_trainer = True  # it goes at the trainer's next resize point (_leave_trainer)
            else:
                self._drained(u)
        elif was == Role.ROLLOUT:
            self._migrate_out(u)
            if not u.residents and u.pending_copies == 0:
                self._drained(u)
            self._fill_slots()
        else:
            self._drained(u)

    def _in_use_by_trainer(self, uid: int) -> bool:
        if self.sem.trainer_resize == "step" and self.step_units is not None:
            return uid in self.step_units
        return uid in self.round_units

    def _drained(self, u: Unit) -> None:
        c = self.w.costs
        if self.colocate:
            cost = c.switch_rollout_to_train_s if u.target == Role.TRAIN else c.switch_train_to_rollout_s
        else:
            cost = c.elastic_role_change_s
        u.token += 1
        self._push(self.now + cost, Switched(u.uid, u.token))

    def _on_switched(self, uid: int, token: int) -> None:
        u = self.units[uid]
        if token != u.token:
            return
        to = u.target or Role.IDLE
        self._set_role(u, to)
        u.moving = False
        u.target = None
        if to == Role.ROLLOUT and not self.colocate:
            u.stall_until = self.now  # it loads the newest weights while switching
        if to == Role.ROLLOUT and not self.place_pending:
            self.place_pending = True
            self._push(self.now, Place())
        self._train()
        self._plan()

    def _plan(self) -> None:
        """Something the policy looks at changed: the plan loop runs at its next tick (it runs at most
        once per `plan_interval_s`, as the live loop; changes in between are seen together)."""
        if self.plan_pending:
            return
        self.plan_pending = True
        self._push(max(self.now, self.last_plan + self.plan_interval_s), PlanTick())

    def _plan_now(self) -> None:
        self.plan_pending = False
        self.last_plan = self.now
        for m in self.policy.plan(self._snapshot()):
            self._apply(int(m.device_id[1:]), m.to_role)


__all__ = [
    "Event",
    "GenDone",
    "EnvDone",
    "CopyDone",
    "Switched",
    "RoundDone",
    "GroupCutoff",
    "Simulation",
    "SimResult",
]
