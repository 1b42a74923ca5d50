"""Elastic's home split, chosen and revised online from what the scheduler measures, never from a sweep.

The home split is where Elastic returns its borrowed devices when training is on the critical path
(policies.py). Which split is best depends on the workload (lengths, turns, environment latency,
model size) and drifts as training goes on, and no formula of the workers' load reports predicts it
well: rollout time per step is set by the slowest executions, not by device-seconds (a busy engine
holding two latency-bound sequences is as busy as one holding thirty). So the meter measures the one
thing that matters, the wall time of each trainer step under a home split, and searches:

- it starts at half the pool; after `probe_steps` steps measured at a split it tries a neighbour
  `stride` devices away (an eighth of the pool at first): towards more rollout devices if
  generations queued for an engine during those steps, else towards fewer; it keeps moving while
  the step time falls, and when both neighbours are slower it halves the stride, down to one
  device, and then stays (the online form of the sweep's refined grid, one step per probe);
- a step counts for a split only if the whole step ran under it (the step after a change is not
  counted), and the first steps of a run (`warmup_steps`: the pipeline filling) count for none;
- measurements older than `memory_steps` steps are forgotten, so a split that was best early is
  probed again when the workload drifts;
- the trainer's share follows its busy time: over the remembered steps the trainer computed
  `busy` device-seconds a second (`PoolSnapshot.trainer_busy_device_s`, the workers' reports), and
  the home leaves it at most max(`min_train_devices`, ceil(`busy_headroom` x busy)) devices. A
  trainer busy a third of the time on one device does not hold two, whatever the step times say
  (they are noisy where the trainer is not on the critical path, which is exactly then); a
  saturated trainer (busy = its devices) is never capped.

The meter is the policy's only state and lives beside it: the policy stays pure and reads the
result from the snapshot (`PoolSnapshot.measured_home_rollout`). The live plan loop (service.py,
monotonic seconds) and the simulator (sim/engine.py, virtual seconds) run one meter each over the
same snapshots. A weight version that goes back (a trainer restarted from an older checkpoint)
starts the search again from the current split.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from services.scheduler.policies import PoolSnapshot


class SplitMeter:
    """Step times per home split and the home they point to (see the module docstring)."""

    def __init__(
        self,
        probe_steps: int = 2,
        warmup_steps: int = 1,
        memory_steps: int = 16,
        busy_headroom: float = 3.0,
        min_train_devices: int = 1,
        min_gain: float = 0.02,
    ) -> None:
        if probe_steps < 1 or warmup_steps < 0 or memory_steps < probe_steps:
            raise ValueError("need probe_steps >= 1, warmup_steps >= 0 and memory_steps >= probe_steps")
        if busy_headroom < 1 or min_train_devices < 1:
            raise ValueError("need busy_headroom >= 1 and min_train_devices >= 1")
        self.probe_steps = probe_steps
        self.warmup_steps = warmup_steps
        self.memory_steps = memory_steps
        self.busy_headroom = busy_headroom
        self.min_gain = min_gain
        self.min_train_devices = min_train_devices
        # (version, seconds, trainer busy device-seconds) at each step boundary since warmup
        self._busy_marks: list[tuple[int, float, float]] = []
        self.home = 0  # rollout devices at home; 0 = not chosen yet (half the pool)
        self.direction = 0  # where the last probe went (+1: more rollout devices); 0 = none yet
        self.stride = 0  # devices between probed splits; 0 = not chosen yet (an eighth of the pool)
        self._queued_seen = False  # a generation waited for an engine since the last decision
        self._version = -1
        self._version_t = 0.0
        self._home_since_version = 0
        # home -> [(version the step ended at, seconds)] of steps that ran wholly under that home
        self._steps: dict[int, list[tuple[int, float]]] = {}

    def observe(self, snapshot: PoolSnapshot, now_s: float) -> PoolSnapshot:
        """`snapshot` with the home split measured so far (`measured_home_rollout`, 0 = none yet)."""
        total = len(snapshot.devices)
        if total < 2:
            return snapshot
        if self.home == 0:
            self.home = max(1, total // 2)
            self.stride = max(1, total // 8)
        self.home = max(1, min(total - 1, self.home))
        self._queued_seen = self._queued_seen or snapshot.queued_generations > 0
        v = snapshot.latest_version
        if v < self._version:
            self._steps.clear()
            self._busy_marks.clear()
            self._version, self._version_t, self._home_since_version = v, now_s, v
        elif v > self._version:
            if self._version >= 0 and v == self._version + 1 and self._counts(self._version):
                self._steps.setdefault(self.home, []).append((v, now_s - self._version_t))
            self._version, self._version_t = v, now_s
            if v >= self.warmup_steps:
                self._busy_marks.append((v, now_s, snapshot.trainer_busy_device_s))
            self._forget(v)
            floor = self.busy_floor(total)
            if self.home < floor:
                self._move(floor)  # the trainer holds more than its busy time needs
            else:
                self._decide(total, floor)
        return dataclasses.replace(snapshot, measured_home_rollout=self.home)

    def _counts(self, started_at: int) -> bool:
        """Whether the step that started at version `started_at` ran wholly under the current home."""
        return started_at >= max(self.warmup_steps, self._home_since_version + 1)

    def trainer_busy_devices(self) -> float | None:
        """Device-seconds the trainer computed per second over the remembered steps (None: < 2 marks)."""
        if len(self._busy_marks) < 2:
            return None
        (_, t0, b0), (_, t1, b1) = self._busy_marks[0], self._busy_marks[-1]
        return max(0.0, b1 - b0) / (t1 - t0) if t1 > t0 else None

    def busy_floor(self, total: int) -> int:
        """The fewest rollout devices at home: the pool less what the trainer's busy time needs."""
        busy = self.trainer_busy_devices()
        if busy is None:
            return 1
        need = max(self.min_train_devices, math.ceil(self.busy_headroom * busy - 1e-9))
        return max(1, min(total - 1, total - need))

    def _forget(self, version: int) -> None:
        self._busy_marks = [m for m in self._busy_marks if m[0] > version - self.memory_steps]
        for home in list(self._steps):
            kept = [(v, s) for v, s in self._steps[home] if v > version - self.memory_steps]
            if kept:
                self._steps[home] = kept
            else:
                del self._steps[home]

    def _mean(self, home: int) -> float | None:
        steps = self._steps.get(home, [])
        if len(steps) < self.probe_steps:
            return None
        return statistics.fmean(s for _, s in steps[-self.probe_steps :])

    def _decide(self, total: int, floor: int) -> None:
        here = self._mean(self.home)
        if here is None:
            return  # still measuring the current split
        if self.direction == 0:
            self.direction = 1 if self._queued_seen else -1
        self._queued_seen = False
        while True:
            ahead = [self.home + d * self.stride for d in (self.direction, -self.direction)]
            neighbours = [h for h in ahead if max(1, floor) <= h < total]
            known = {h: m for h in neighbours if (m := self._mean(h)) is not None}
            faster = [h for h, m in known.items() if m < here * (1 - self.min_gain)]
            if faster:  # a measured neighbour is clearly faster: go there
                self._move(min(faster, key=lambda h: known[h]))
                return
            if not any(m * (1 - self.min_gain) <= here for m in known.values()):
                # This split clearly beats every measured neighbour: probe the others, the last
                # direction that paid first. (Never probe on from a split no better than its neighbour.)
                for h in neighbours:
                    if h not in known:
                        self._move(h)
                        return
            if self.stride == 1:
                return  # no neighbour one device away is clearly faster: stay
            self.stride = max(1, self.stride // 2)

    def _move(self, home: int) -> None:
        self.direction = 1 if home > self.home else -1
        self.home = home
        self._home_since_version = self._version
