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
    """Gyre's policy: a home split like Async's, left only when moving pays for itself.

    - Home split (`base_rollout_devices`, B): while executions wait for a slot, rollout holds at
      least B devices, sized the way an operator sizes Async (the simulator passes the best static
      split of its sweep, `services.scheduler.sim.compare.plan_split`). Without B the home is what
      the waiting executions need in KV slots (`engine_capacity` each).
    - Tail: when nothing waits and the live executions fit on fewer rollout devices, the emptiest
      ones are lent to training; their in-flight generations are migrated (never aborted). With
      `consolidate=False` (bandwidth-bound rollout, where packing executions onto fewer engines
      slows their decode) only a rollout with no live execution left is lent.
    - Lending is cost-aware: k devices move to training only if the training time they save
      exceeds two role changes (there and back), from `trainer_work_device_s` and `role_change_s`.
      On short steps this refuses every move, and Elastic behaves exactly like Async at B.
    - Return: when executions wait again, lent devices come back up to B (newest first); beyond B
      only from an idle trainer, up to what the waiting executions need in KV slots.
    - Hysteresis: nothing moves while nothing waits and the trainer has no work; moves smaller
      than `min_move` devices are skipped. With `spread_when_trainer_idle`, an idle trainer hands
      every device to rollout to spread the KV load (off by default: costs more than it saves).
    """

    name = "elastic"

    def __init__(
        self,
        staleness_bound: int = 1,
        min_move: int = 1,
        min_train_devices: int = 1,
        spread_when_trainer_idle: bool = False,
        base_rollout_devices: int | None = None,
        consolidate: bool = True,
    ) -> None:
        super().__init__(staleness_bound)
        if base_rollout_devices is not None and base_rollout_devices < 1:
            raise ValueError(f"base_rollout_devices must be >= 1, got {base_rollout_devices}")
        self.spread_when_trainer_idle = spread_when_trainer_idle
        self.min_move = max(1, min_move)
        self.min_train_devices = max(0, min_train_devices)
        self.base_rollout_devices = base_rollout_devices
        self.consolidate = consolidate

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
        cap = max(1, snapshot.engine_capacity)
        need = math.ceil(snapshot.rollout_demand / cap)
        # Live executions must always fit (never abort): that wins over every other bound.
        must = math.ceil(snapshot.live_executions / cap)
        have = snapshot.count(Role.ROLLOUT)
        ceiling = total - self.min_train_devices
        if self.base_rollout_devices is None:
            if not snapshot.trainer_wants_devices:
                return total if self.spread_when_trainer_idle else max(need, have)
            return max(must, min(need, ceiling))
        base = min(self.base_rollout_devices, ceiling)
        if not snapshot.trainer_wants_devices:
            # The trainer has nothing to do: lent devices come home; waiting work may take more.
            if self.spread_when_trainer_idle:
                return total
            grow = min(need, ceiling) if snapshot.queued_generations > 0 else 0
            return max(must, base, have, grow)
        if snapshot.queued_generations > 0:
            # Work waits while the trainer works: the home split, no more than what is held.
            return max(must, min(max(have, base), max(base, need)))
        return must  # tail: lend what the live executions do not need (plan checks the cost)

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
            if not self.consolidate and snapshot.live_executions > 0:
                return []
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
            home = self.base_rollout_devices is not None  # beyond the home split, idle devices train
            role = Role.TRAIN if snapshot.trainer_wants_devices or home else Role.ROLLOUT
            return [Reassignment(d.device_id, role, "elastic: idle device put to work") for d in idle]
        return []

    def describe(self) -> str:
        if self.base_rollout_devices is None:
            return self.name
        return f"elastic(base rollout={self.base_rollout_devices})"


POLICY_NAMES = ("colocate", "async", "elastic")


def make_policy(
    name: str,
    *,
    staleness_bound: int = 1,
    num_rollout_devices: int | None = None,
    elastic_base_rollout_devices: int | None = None,
) -> Policy:
    """Build a policy by name. `async` needs `num_rollout_devices` (its fixed split); `elastic`
    takes an optional home split `elastic_base_rollout_devices` (None: sized by KV need)."""
    if name == "colocate":
        return ColocatePolicy()
    if name == "elastic":
        return ElasticPolicy(
            staleness_bound=staleness_bound, base_rollout_devices=elastic_base_rollout_devices
        )
    if name == "async":
        if num_rollout_devices is None:
            raise ValueError("policy 'async' needs num_rollout_devices (its fixed rollout split)")
        return AsyncPolicy(num_rollout_devices, staleness_bound=staleness_bound)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
