"""Scheduling policies: which role each device should serve next.

One small interface, `Policy.plan(snapshot) -> list[Reassignment]`, used unchanged by the live
scheduler (services/scheduler/service.py) and by the simulator (services/scheduler/sim/). A policy
is pure: it reads an immutable `PoolSnapshot` and returns the moves it wants; it never performs
them, never sleeps and never reads a clock. The caller turns each `Reassignment` into the lease
handoff (reassign -> drain -> release -> grant -> acquire).

Guarantees every policy keeps:
- It never asks for a device that is already moving (`DeviceState.moving`) to move again.
- Elastic never plans fewer rollout devices than its resident executions occupy (`engine_capacity`
  slots each), so a handoff never has to abort a live execution: in-flight generations are
  migrated (or parked until an engine has room).
- Staleness is bounded by admission, not by the plan: a batch may start generating only once
  `may_start_batch` allows it, and the live executions it counts are admitted ones only. Async and
  Elastic are built with the same bound; Colocate is synchronous (bound 0) by construction.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

# The admission rule every policy is built with (re-exported): one code path with the live rollout's.
from gyre.pipeline_rules import may_start_batch as may_start_batch


class Role(StrEnum):
    """What a device serves. Mirrors gyre.v1.DeviceRole (IDLE / ROLLOUT / TRAIN)."""

    IDLE = "idle"
    ROLLOUT = "rollout"
    TRAIN = "train"


@dataclass(frozen=True)
class DeviceState:
    """One device (or, in the simulator, one engine-sized unit of devices) as the policy sees it: its
    lease and the load of the rollout engine on it, as that engine's worker last reported it
    (`EngineLoad` in proto/gyre/v1/scheduler.proto, copied by `pool_snapshot`). The load fields are 0
    on a device that runs no rollout engine, or whose engine no report names (a device moving, an
    engine not started yet): the policy cannot tell "empty" from "unknown" there, and needs not,
    since it lends only settled rollout devices."""

    device_id: str
    # Role it serves now; while `moving`, the role it is moving TO.
    role: Role
    # A handoff is in progress (draining, migrating, switching); the policy must leave it alone.
    moving: bool = False
    # Executions resident on this device's engine: generation requests admitted or queued (count).
    executions: int = 0
    # Requests the engine is decoding right now (count).
    generating: int = 0
    # Tokens of context the engine's decoding requests hold (what lending it would migrate).
    context_tokens: int = 0


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything a policy may look at, frozen at one instant: the leases and the workers' load
    reports (`WorkerLoad` in proto/gyre/v1/scheduler.proto), built by `services.scheduler.snapshot.pool_snapshot` both live and
    in the simulator."""

    devices: tuple[DeviceState, ...]
    # Executions started and not finished (generating, waiting for an engine, or on the environment).
    live_executions: int
    # Live executions whose next generation waits for an engine (KV room or a free batch slot).
    queued_generations: int
    # Executions one rollout device can host at once (the engine's max batch), >= 1.
    engine_capacity: int
    # Batches with work waiting for the trainer (including the step being trained now).
    trainer_backlog: int
    # The trainer has work (a step running or scored groups waiting).
    trainer_busy: bool
    # Generations being decoded right now.
    running_generations: int = 0
    # Live executions waiting on their environment (their KV stays on the engine).
    waiting_on_environment: int = 0
    # Seconds between the trainer's last two optimizer steps: its cadence, waits for scored work
    # included (0 = none yet). The live trainer and the simulator report the same quantity.
    trainer_step_s: float = 0.0
    # Device-seconds of training the trainer can do now in its current step (0 = none runs, or it has
    # trained everything it has and waits for scored groups).
    trainer_remaining_work_device_s: float = 0.0
    # Devices training now (the trainer's data-parallel ranks); 0 = not reported.
    trainer_dp_size: int = 0
    # Newest weight version published by the trainer.
    latest_version: int = 0
    # Oldest weight version any live execution started under (equals latest when none).
    oldest_live_version: int = 0
    # Max allowed (train step - start version) of any trained execution.
    staleness_bound: int = 1
    # Device-seconds the rollout's engines / the trainer have computed since they started (summed
    # WorkerLoad.busy_device_s; cumulative): the busy time the report shows next to leased time.
    rollout_busy_device_s: float = 0.0
    trainer_busy_device_s: float = 0.0
    # Rollout devices at Elastic's home split as split_meter.SplitMeter chose it from the load
    # reports and step times of the run; 0 = not measured (half the pool before the first step, then
    # what the trainer holds).
    measured_home_rollout: int = 0

    def count(self, role: Role) -> int:
        """Devices serving (or moving to) `role`."""
        return sum(1 for d in self.devices if d.role == role)

    @property
    def rollout_demand(self) -> int:
        """Executions that need an engine: every live one (queued ones are live too)."""
        return self.live_executions

    @property
    def trainer_time_left_s(self) -> float:
        """Seconds the trainer needs, at its current size, for the work it can do now (0: none)."""
        devices = self.trainer_dp_size or self.count(Role.TRAIN)
        return self.trainer_remaining_work_device_s / max(1, devices)

    @property
    def trainer_wants_devices(self) -> bool:
        """The trainer has a step running or scored work waiting."""
        return self.trainer_busy or self.trainer_backlog > 0


@dataclass(frozen=True)
class Reassignment:
    """Move `device_id` to `to_role`; `reason` ends up in the LeaseEvent for logs and plots."""

    device_id: str
    to_role: Role
    reason: str


class Policy(abc.ABC):
    """Decides device roles. Subclasses implement `plan`; they are stateless apart from parameters."""

    name: ClassVar[str]

    def __init__(self, staleness_bound: int = 1) -> None:
        if staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
        self.staleness_bound = staleness_bound

    @abc.abstractmethod
    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        """Moves wanted now, given the snapshot. Pure: same snapshot, same answer."""

    def describe(self) -> str:
        return self.name


def _still(snapshot: PoolSnapshot) -> list[DeviceState]:
    """Devices a policy may move (not already moving), in a stable order."""
    return sorted((d for d in snapshot.devices if not d.moving), key=lambda d: d.device_id)


def _emptiest_first(devices: list[DeviceState]) -> list[DeviceState]:
    """`devices` in lending order: fewest resident executions, then fewest context tokens, then the
    highest device ID (a stable order when the loads tie, e.g. when none is reported)."""
    by_id = sorted(devices, key=lambda d: d.device_id, reverse=True)
    return sorted(by_id, key=lambda d: (d.executions, d.context_tokens))  # stable: keeps the ID order


class ColocatePolicy(Policy):
    """The whole pool alternates: rollout until the batch is done, then train, then rollout again.

    Synchronous by construction (staleness 0): the next batch is admitted only after the step that
    trains the previous one has published its weights, so rollout and training never overlap.
    """

    name = "colocate"

    def __init__(self, staleness_bound: int = 0) -> None:
        super().__init__(staleness_bound=0)

    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        if snapshot.rollout_demand > 0:
            want, why = Role.ROLLOUT, f"colocate: {snapshot.rollout_demand} executions to roll out"
        elif snapshot.trainer_wants_devices:
            want, why = Role.TRAIN, "colocate: batch complete, whole pool trains"
        else:
            return []
        return [Reassignment(d.device_id, want, why) for d in _still(snapshot) if d.role != want]


class AsyncPolicy(Policy):
    """A fixed split: the first `num_rollout_devices` (by device ID) roll out, the rest train.

    Rollout and training run concurrently; staleness is bounded by admission (`may_start_batch`).
    """

    name = "async"

    def __init__(self, num_rollout_devices: int, staleness_bound: int = 1) -> None:
        super().__init__(staleness_bound)
        if num_rollout_devices < 1:
            raise ValueError(f"num_rollout_devices must be >= 1, got {num_rollout_devices}")
        self.num_rollout_devices = num_rollout_devices

    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        ordered = sorted(snapshot.devices, key=lambda d: d.device_id)
        n = min(self.num_rollout_devices, max(1, len(ordered) - 1)) if len(ordered) > 1 else len(ordered)
        out = []
        for i, d in enumerate(ordered):
            want = Role.ROLLOUT if i < n else Role.TRAIN
            if d.role != want and not d.moving:
                out.append(Reassignment(d.device_id, want, f"async: fixed split {n} rollout"))
        return out

    def describe(self) -> str:
        return f"async(rollout={self.num_rollout_devices})"


class ElasticPolicy(Policy):
    """Gyre's policy: a device that one side leaves idle serves the other, and comes back when needed.

    It reads only the live snapshot (leases, worker and per-engine load reports) and keeps no state beyond the roles in
    the lease table; the same class runs in the scheduler service and in the simulator, with the
    same parameters on every workload (no per-workload tuning). Per snapshot, with L live
    executions, engine capacity c (the engine's max batch) and P devices:

    - Executions first: rollout holds ceil(L / c) devices when it can (the trainer keeps
      `min_train_devices`), so no execution waits for a batch slot, and never fewer than its
      resident executions occupy: a handoff migrates in-flight generations, it never aborts one.
    - Trainer idle (no scored work): rollout keeps what it holds and takes back its home share; it does
      not spread over the idle trainer's devices unless `spread_idle` is set (one engine per live
      execution; off by default: the trainer's next scored group often arrives within a round trip,
      and in the simulator spreading lost on every workload it changed, docs/scheduler.md).
    - Trainer busy: rollout keeps what it holds while no later batch waits for the trainer; once one
      does (training is on the critical path, `trainer_backlog >= 2`), borrowed devices go back down
      to the home split (`home_rollout`): chosen online from the load reports and step times
      (split_meter.py; half the pool at first), unless the operator fixes one
      (`home_rollout_devices`). No input comes from a sweep. In the tail (L below what rollout holds) rollout lends every device
      a live execution does not need, one engine per execution, emptiest engines first (fewest
      resident executions, then fewest context tokens, from the rollout's per-engine load reports;
      ties by device ID, highest first), so an empty engine is lent before one whose executions
      would have to be live-migrated. It does not pack executions to lend more unless `pack_tail`
      is set (off by default: consolidating the tail slowed its slowest executions more than the
      lent devices sped the trainer, docs/scheduler.md).
    - A move must pay for itself: optional moves (lending, and spreading when on) happen only when the
      trainer's step cadence (`trainer_step_s`, or the step in progress: at least the training it
      still has, `trainer_time_left_s`) exceeds `min_step_over_switch` role changes (`role_change_s`;
      2 by default: a lent device goes and comes back, so a step shorter than that round trip cannot
      repay it); on shorter steps Elastic holds its split like Async. Lending in the tail also needs trainer
      work that extra devices can speed up now: the work it can train at once
      (`trainer_remaining_work_device_s` over its data-parallel size) must outlast as many role
      changes; a trainer waiting for scored groups keeps its devices and rollout keeps its engines
      (lending them would pack the slowest executions together for no gain). A trainer with work
      and no device always gets one, and on a short cadence no more than its home share: a device
      the trainer would not use stays with rollout (its lease share follows its busy time).
    - Never strand the trainer: a trainer with work that holds fewer devices than its home share
      (pool - `home_rollout_devices`) gets its borrowed devices back (down to what live executions
      need) whatever the cadence, including before the first step, when the cadence is still
      unknown, once the training it has now outlasts two role changes (`trainer_time_left_s`; the
      live trainer measures it from its first micro-batch). So Elastic
      never trains a step that would use them on fewer devices than Async at the same split while
      rollout has devices to spare, and a step shorter than the round trip keeps one device.
    """

    name = "elastic"

    def __init__(
        self,
        staleness_bound: int = 1,
        min_train_devices: int = 1,
        home_rollout_devices: int | None = None,
        role_change_s: float = 15.0,
        min_step_over_switch: float = 2.0,
        spread_idle: bool = False,
        pack_tail: bool = False,
    ) -> None:
        super().__init__(staleness_bound)
        if role_change_s < 0 or min_step_over_switch < 0:
            raise ValueError("role_change_s and min_step_over_switch must be >= 0")
        self.min_train_devices = max(0, min_train_devices)
        self.home_rollout_devices = home_rollout_devices
        self.role_change_s = role_change_s
        self.min_step_over_switch = min_step_over_switch
        self.spread_idle = spread_idle
        self.pack_tail = pack_tail

    def target_rollout(self, snapshot: PoolSnapshot) -> int:
        """How many devices should serve rollout now (see the class docstring)."""
        total = len(snapshot.devices)
        live = snapshot.live_executions
        cap = max(1, snapshot.engine_capacity)
        ceiling = max(1, total - self.min_train_devices)
        # Every live execution gets a batch slot: queued ones are on their batch's critical path.
        must = min(ceiling, math.ceil(live / cap))
        # Never below what the resident executions occupy (a handoff migrates, it never aborts).
        must = max(must, math.ceil(max(0, live - snapshot.queued_generations) / cap))
        if self.spread_idle and not snapshot.trainer_wants_devices and self._moves_pay(snapshot):
            # Spread the rollout over the idle trainer's devices (one engine per live execution at most).
            return min(ceiling, max(must, live))
        home = self.home_rollout(snapshot)
        if snapshot.trainer_backlog < 2:
            # Training is not critical (no later batch waits for it): keep what rollout holds.
            home = max(home, snapshot.count(Role.ROLLOUT))
        target = max(must, min(live, home, ceiling))
        if self.pack_tail and snapshot.trainer_wants_devices and self._lend_pays(snapshot):
            # Consolidate the tail onto as few engines as its executions fill (live-migrating the
            # rest) so that more devices go to the trainer. Off by default: it lost (docs/scheduler.md).
            return min(target, max(1, must))
        return target

    def _moves_pay(self, snapshot: PoolSnapshot) -> bool:
        """Steps long enough that a round trip of role changes is small against them: the last step's
        cadence, or the step in progress, which lasts at least as long as the training it still has
        at the trainer's current size (so a first step, or a step that drifted longer than the last,
        counts from its own work; with neither known, no optional move)."""
        step_s = max(snapshot.trainer_step_s, snapshot.trainer_time_left_s)
        return step_s > self.min_step_over_switch * self.role_change_s

    def _lend_pays(self, snapshot: PoolSnapshot) -> bool:
        """A lend pays: the training the trainer can do now, at its current size, outlasts
        `min_step_over_switch` role changes (which also makes `_moves_pay` true: the step in
        progress lasts at least that long)."""
        return snapshot.trainer_time_left_s > self.min_step_over_switch * self.role_change_s

    def home_rollout(self, snapshot: PoolSnapshot) -> int:
        """Rollout devices at the home split: the operator's `home_rollout_devices` when set, else the
        split the scheduler measured (`measured_home_rollout`: from the load reports and step times,
        split_meter.py), else half the pool before the trainer's first step and what it holds after."""
        total = len(snapshot.devices)
        if self.home_rollout_devices:
            return self.home_rollout_devices
        if snapshot.measured_home_rollout > 0:
            return max(1, min(total - self.min_train_devices, snapshot.measured_home_rollout))
        if snapshot.latest_version > 0:
            # After its first step, until the meter has measured the trainer: it keeps what it holds
            # (at least `min_train_devices`, at most half the pool), nothing more on a guess.
            held = min(total // 2, max(self.min_train_devices, snapshot.count(Role.TRAIN)))
            return max(1, total - held)
        return max(1, total // 2)

    def home_train_devices(self, snapshot: PoolSnapshot) -> int:
        """The trainer's share at the home split: the pool less `home_rollout`."""
        total = len(snapshot.devices)
        return max(self.min_train_devices, total - self.home_rollout(snapshot))

    def lendable(self, snapshot: PoolSnapshot, spare: int) -> int:
        """How many of `spare` rollout devices (beyond the target) go to a trainer with work now:
        - all of them when a lend pays: the step cadence is long against role changes and the work
          the trainer can do now lasts, at its current size, longer than `min_step_over_switch`
          role changes (a trainer that has trained all it has and waits for scored groups gains
          nothing from more devices, while the engines they leave would pack live executions);
        - else those the trainer lent out, back up to its home share, when the training it has now
          outlasts two role changes at its current size (a stranded trainer then costs more than
          the round trip; unmeasured work, 0, does not: the live trainer measures it from its
          first micro-batch on, even with later batches queued), and at least one device: a
          trainer with work never waits for one. Never more on a short cadence, nor for a step too short to use them: a device the trainer
          would not use stays with rollout (its lease share follows its busy time)."""
        train = snapshot.count(Role.TRAIN)
        if self._lend_pays(snapshot):
            return spare
        stranded = snapshot.trainer_time_left_s > 2 * self.role_change_s
        share = max(1, self.home_train_devices(snapshot)) if stranded else 1
        return max(0, min(spare, share - train))

    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        target = self.target_rollout(snapshot)
        have = snapshot.count(Role.ROLLOUT)
        still = _still(snapshot)
        if target > have:
            donors = [d for d in still if d.role == Role.IDLE] + sorted(
                (d for d in still if d.role == Role.TRAIN), key=lambda d: d.device_id, reverse=True
            )
            why = f"elastic: {snapshot.live_executions} live executions need {target} rollout devices"
            return [Reassignment(d.device_id, Role.ROLLOUT, why) for d in donors[: target - have]]
        moves: list[Reassignment] = []
        lend = self.lendable(snapshot, have - target) if snapshot.trainer_wants_devices else 0
        if target < have and lend > 0:
            # Only settled rollout devices lend; the ones that stay must hold every live execution.
            settled = _emptiest_first([d for d in still if d.role == Role.ROLLOUT])
            cap = max(1, snapshot.engine_capacity)
            resident = max(0, snapshot.live_executions - snapshot.queued_generations)
            room = max(0, len(settled) - math.ceil(resident / cap))
            why = f"elastic: {snapshot.live_executions} live executions fit on {target} devices; lending the rest"
            moves = [Reassignment(d.device_id, Role.TRAIN, why) for d in settled[: min(lend, room)]]
        idle = [d for d in still if d.role == Role.IDLE]
        role = Role.TRAIN if snapshot.trainer_wants_devices or target <= have else Role.ROLLOUT
        moves += [Reassignment(d.device_id, role, "elastic: idle device put to work") for d in idle]
        return moves


POLICY_NAMES = ("colocate", "async", "elastic")


def make_policy(
    name: str,
    *,
    staleness_bound: int = 1,
    num_rollout_devices: int | None = None,
    role_change_s: float = 15.0,
    min_step_over_switch: float = 2.0,
) -> Policy:
    """Build a policy by name. `async` needs `num_rollout_devices` (its fixed split); `elastic`
    takes the same split as its home (None: half the pool) and the seconds one device needs to
    change role (its moves must pay for them)."""
    if name == "colocate":
        return ColocatePolicy()
    if name == "elastic":
        return ElasticPolicy(
            staleness_bound=staleness_bound,
            home_rollout_devices=num_rollout_devices,
            role_change_s=role_change_s,
            min_step_over_switch=min_step_over_switch,
        )
    if name == "async":
        if num_rollout_devices is None:
            raise ValueError("policy 'async' needs num_rollout_devices (its fixed rollout split)")
        return AsyncPolicy(num_rollout_devices, staleness_bound=staleness_bound)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
