"""Scheduling policies: which role each device should serve next.

One small interface, `Policy.plan(snapshot) -> list[Reassignment]`, used unchanged by the live
scheduler (services/scheduler/service.py) and by the simulator (services/scheduler/sim/). A policy
is pure: it reads an immutable `PoolSnapshot` and returns the moves it wants; it never performs
them, never sleeps and never reads a clock. The caller turns each `Reassignment` into the lease
handoff (reassign -> drain -> release -> grant -> acquire).

Guarantees every policy keeps:
- It never asks for a device that is already moving (`DeviceState.moving`) to move again.
- It never plans fewer rollout devices than the live executions need (`engine_capacity` slots
  each), so a handoff never has to abort a live execution: in-flight generations are migrated.
- Staleness is bounded by admission, not by the plan: a batch may start generating only once
  `may_start_batch` allows it, and `queued_generations` counts admissible work only. Async and
  Elastic are built with the same bound; Colocate is synchronous (bound 0) by construction.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar


class Role(StrEnum):
    """What a device serves. Mirrors gyre.v1.DeviceRole (IDLE / ROLLOUT / TRAIN)."""

    IDLE = "idle"
    ROLLOUT = "rollout"
    TRAIN = "train"


@dataclass(frozen=True)
class DeviceState:
    """One device (or, in the simulator, one engine-sized unit of devices) as the policy sees it."""

    device_id: str
    # Role it serves now; while `moving`, the role it is moving TO.
    role: Role
    # A handoff is in progress (draining, migrating, switching); the policy must leave it alone.
    moving: bool = False
    # Executions resident on this device's engine (rollout only): what a move would migrate.
    live_executions: int = 0


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything a policy may look at, frozen at one instant."""

    devices: tuple[DeviceState, ...]
    # Executions started and not finished (decoding, prefilling or waiting on the environment).
    live_executions: int
    # Admissible executions / generation requests waiting for an engine slot (staleness allows them).
    queued_generations: int
    # Executions one rollout device can host at once (KV memory bound), >= 1.
    engine_capacity: int
    # Complete batches waiting to be trained (not counting the step being trained now).
    trainer_backlog: int
    # A training step is running.
    trainer_busy: bool
    # Newest weight version published by the trainer.
    latest_version: int = 0
    # Oldest weight version any live execution started under (equals latest when none).
    oldest_live_version: int = 0
    # Max allowed (train step - start version) of any trained execution.
    staleness_bound: int = 1
    # Training work waiting or running, in device-seconds (0 = unknown: no cost check).
    trainer_work_device_s: float = 0.0
    # Seconds one device needs to change role (drain, offload, load, warm up).
    role_change_s: float = 0.0

    def count(self, role: Role) -> int:
        """Devices serving (or moving to) `role`."""
        return sum(1 for d in self.devices if d.role == role)

    @property
    def rollout_demand(self) -> int:
        """Executions that need an engine slot now: live ones plus admissible queued ones."""
        return self.live_executions + self.queued_generations

    @property
    def trainer_wants_devices(self) -> bool:
        """The trainer has a step running or a complete batch waiting."""
        return self.trainer_busy or self.trainer_backlog > 0


@dataclass(frozen=True)
class Reassignment:
    """Move `device_id` to `to_role`; `reason` ends up in the LeaseEvent for logs and plots."""

    device_id: str
    to_role: Role
    reason: str


def may_start_batch(batch_index: int, latest_version: int, staleness_bound: int) -> bool:
    """Admission rule shared by every policy: batch k is trained by step k (which publishes version
    k + 1) and may start generating under version v only if k - v <= bound. Bound 0 is synchronous."""
    return batch_index - latest_version <= staleness_bound


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
    """Gyre's policy: rollout gets exactly the devices its live + admissible executions need; the
    rest train while the trainer has work; all return to rollout when the trainer has none.

    - Tail: when live executions fit on fewer rollout devices (`engine_capacity` each), the
      emptiest rollout devices are lent to training; their in-flight generations are migrated to
      the remaining engines (never aborted).
    - Lending is cost-aware: k devices move to training only if the training time they save
      exceeds two role changes (there and back), from `trainer_work_device_s` and `role_change_s`.
    - Demand rises (a new batch became admissible, or the trainer is starved and rollout needs
      more slots): devices come back from training, newest first. With
      `spread_when_trainer_idle`, an idle trainer hands every device back to rollout to spread the
      KV load (off by default: in the simulator it costs more role changes than it saves).
    Moves smaller than `min_move` devices are skipped (hysteresis against flapping).
    """

    name = "elastic"

    def __init__(
        self,
        staleness_bound: int = 1,
        min_move: int = 1,
        min_train_devices: int = 1,
        spread_when_trainer_idle: bool = False,
    ) -> None:
        super().__init__(staleness_bound)
        self.spread_when_trainer_idle = spread_when_trainer_idle
        self.min_move = max(1, min_move)
        self.min_train_devices = max(0, min_train_devices)

    def _worth_lending(self, snapshot: PoolSnapshot, k: int) -> bool:
        """Lend k devices only if the training time they save exceeds the round trip of role
        changes (there and back) they cost; a trainer without devices always gets them."""
        training = snapshot.count(Role.TRAIN)
        if training == 0 or snapshot.trainer_work_device_s <= 0 or snapshot.role_change_s <= 0:
            return True
        work = snapshot.trainer_work_device_s
        saved = work / training - work / (training + k)
        return saved > 2 * snapshot.role_change_s

    def target_rollout(self, snapshot: PoolSnapshot) -> int:
        """How many devices should serve rollout now."""
        total = len(snapshot.devices)
        if not snapshot.trainer_wants_devices:
            if not self.spread_when_trainer_idle:
                need = math.ceil(snapshot.rollout_demand / max(1, snapshot.engine_capacity))
                return max(need, snapshot.count(Role.ROLLOUT))
            return total
        need = math.ceil(snapshot.rollout_demand / max(1, snapshot.engine_capacity))
        # Live executions must always fit (never abort): that need wins over the trainer's floor.
        must = math.ceil(snapshot.live_executions / max(1, snapshot.engine_capacity))
        return max(must, min(need, total - self.min_train_devices))

    def plan(self, snapshot: PoolSnapshot) -> list[Reassignment]:
        target = self.target_rollout(snapshot)
        have = snapshot.count(Role.ROLLOUT)
        still = _still(snapshot)
        if target > have and target - have >= self.min_move:
            # Idle devices first, then training devices (highest IDs first: stable choice).
            donors = [d for d in still if d.role == Role.IDLE] + sorted(
                (d for d in still if d.role == Role.TRAIN), key=lambda d: d.device_id, reverse=True
            )
            why = f"elastic: {snapshot.rollout_demand} executions need {target} rollout devices"
            return [Reassignment(d.device_id, Role.ROLLOUT, why) for d in donors[: target - have]]
        if target < have and have - target >= self.min_move:
            # Emptiest engines first: fewest generations to migrate. Only settled rollout devices
            # may give up work, and the settled ones that stay must host every live execution
            # (devices still moving to rollout cannot take migrated generations yet).
            settled = sorted(
                (d for d in still if d.role == Role.ROLLOUT), key=lambda d: (d.live_executions, d.device_id)
            )
            cap = max(1, snapshot.engine_capacity)
            room = max(0, len(settled) - math.ceil(snapshot.live_executions / cap))
            k = min(have - target, room)
            if k < self.min_move or not self._worth_lending(snapshot, k):
                return []
            donors = settled[:k]
            why = (
                f"elastic: tail, {snapshot.live_executions} live executions fit on {target} devices; "
                "lending the rest to training"
            )
            return [Reassignment(d.device_id, Role.TRAIN, why) for d in donors]
        idle = [d for d in still if d.role == Role.IDLE]
        if idle:
            role = Role.TRAIN if snapshot.trainer_wants_devices else Role.ROLLOUT
            return [Reassignment(d.device_id, role, "elastic: idle device put to work") for d in idle]
        return []


POLICY_NAMES = ("colocate", "async", "elastic")


def make_policy(name: str, *, staleness_bound: int = 1, num_rollout_devices: int | None = None) -> Policy:
    """Build a policy by name. `async` needs `num_rollout_devices` (its fixed split)."""
    if name == "colocate":
        return ColocatePolicy()
    if name == "elastic":
        return ElasticPolicy(staleness_bound=staleness_bound)
    if name == "async":
        if num_rollout_devices is None:
            raise ValueError("policy 'async' needs num_rollout_devices (its fixed rollout split)")
        return AsyncPolicy(num_rollout_devices, staleness_bound=staleness_bound)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
