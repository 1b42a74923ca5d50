"""The role-change time Elastic weighs a move with, timed from this run's own handoffs.

A device lent to training comes back to rollout later: a lend costs the round trip, and the two
directions differ. On the CPU quickstart a device reaches the trainer in 0.02-0.05 s (it joins
between steps) and returns to rollout in 1.2-1.7 s (the trainer finishes its step first). A median
over all handoffs is the fast direction when most moves go that way, and a lend of 0.5 s of training
then looks cheap although the device it took needs 1.5 s to come back. `HandoffClock` keeps each
direction apart and prices one role change as the mean of the two directions' medians, so twice it
is one round trip.
"""

from __future__ import annotations

import collections
import statistics

from services.scheduler.policies import Role

DIRECTIONS = (Role.TRAIN, Role.ROLLOUT)  # the two ways a device changes role between the working roles


class HandoffClock:
    """Times handoffs (REASSIGN -> ACQUIRED, seconds) per direction, the last `window` of each.

    `role_change_s(default)` is the mean over the two directions of the median of each; a direction
    with no completed handoff yet counts as `default` (a lend's return is not assumed cheap before
    one has been seen). Moves to or from IDLE are not timed (no worker acquires an idle device).
    """

    def __init__(self, window: int = 20) -> None:
        self._started: dict[tuple[str, int], tuple[float, Role]] = {}  # (device, epoch) -> (REASSIGN s, to)
        self._done: dict[Role, collections.deque[float]] = {
            role: collections.deque(maxlen=window) for role in DIRECTIONS
        }

    def reassigned(self, device_id: str, epoch: int, to_role: Role, at_s: float) -> None:
        """A handoff of `device_id` under lease `epoch` towards `to_role` was committed at `at_s`."""
        if to_role in self._done:
            self._started[(device_id, epoch)] = (at_s, to_role)

    def acquired(self, device_id: str, epoch: int, at_s: float) -> None:
        """The new holder acquired `device_id` under `epoch` at `at_s` (ignored if not timed)."""
        started = self._started.pop((device_id, epoch), None)
        if started is not None:
            start_s, to_role = started
            self._done[to_role].append(max(0.0, at_s - start_s))

    def measured(self, to_role: Role) -> list[float]:
        """The timed handoffs towards `to_role`, oldest first (seconds)."""
        return list(self._done[to_role])

    def role_change_s(self, default: float) -> float:
        """Half a measured round trip: the mean of the two directions' medians (seconds)."""
        per_direction = [statistics.median(d) if d else default for d in self._done.values()]
        return sum(per_direction) / len(per_direction)
