"""Elastic's home split, chosen and revised online from what the scheduler measures, never from a sweep.

The home split is where Elastic returns its borrowed devices when training is on the critical path
(policies.py). Which split is best depends on the workload (lengths, turns, environment latency,
model size) and drifts as training goes on. On most workloads the step time is flat over a wide
range of splits around the best one, while every change of the home costs role changes and steps
measured at a worse split; a run measures few steps. So the meter moves the home only on evidence
that one side is short of devices, measured within the steps themselves from the workers' reports
(never from a sweep), and then checks each move against the measured step wall time:

- It starts at half the pool. A step counts for a home only if the whole step ran under it (the
  step after a change is not counted), and the first steps of a run (`warmup_steps`: the pipeline
  filling) count for none. For each counted step it keeps the wall time and, integrated over the
  load reports of the step, three signals:
  - *rollout contention*: the mean over rollout engines of (g - 1) / g, g the generations the engine
    decodes at once (`EngineLoad.generating`): the share of decode slowed by sharing an engine;
  - *queueing*: the share of the step during which generations waited for an engine
    (`queued_generations` > 0): engines short of KV room or batch slots;
  - *trainer load*: its busy device-seconds (`WorkerLoad.busy_device_s`) over the devices it held,
    and its *tail*, the seconds from the last scored work reaching it (`trainer_remaining_work_device_s`
    rising) to the step's end: training that nothing overlaps, which fewer devices lengthen.
- After `probe_steps` counted steps at a home it decides: towards more rollout devices when the
  rollout shows pressure (contention >= `contention_share` or queueing >= `queued_share`) and the
  trainer, given fewer devices, stays below `saturated_share` busy; towards more training devices
  when the trainer is busy `saturated_share` or more; else it stays. Towards rollout it also needs
  the expected gain (the pressure's share of the step, shrinking as n / (n + stride)) to beat the
  longer trainer tail by `min_gain` of a step. A move is `stride` devices (an eighth of the pool at
  first). The first decision reads one counted step, every later one `probe_steps`.
- Homes are compared by *pace*, step seconds per device-second the trainer computed, so that a
  batch of longer executions (or lengths drifting) is not taken for a slower split; only homes
  measured next to each other are compared. A move whose home paces clearly slower (by `min_gain`)
  than the one it left is undone; a second move the same way needs the first to have paid; a step
  onto a split already measured no faster is not taken, the stride halves instead, down to one
  device, and then it stays.
- The trainer's share follows its busy time: the home leaves it at most
  max(`min_train_devices`, ceil(`busy_headroom` x busy devices)) devices, but never so few that its
  tail (the device-seconds it computes after the last scored work reached it: training nothing
  overlaps, which fewer devices lengthen) would exceed `tail_share` of the step on them. A light
  trainer (busy under `light_trainer_devices` devices: its whole step's training takes under that
  share of a step on one device) keeps one device whatever its tail.
- Until it has measured the trainer (its busy time, and its tail unless it is light) the meter
  tells the policy no home (`measured_home_rollout` 0); the policy then lets the trainer keep what
  it holds after its first step instead of lending it half the pool on a guess.
- Measurements older than `memory_steps` steps are forgotten, so the home follows a drifting
  workload.

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
from dataclasses import dataclass

from services.scheduler.policies import PoolSnapshot, Role


@dataclass(frozen=True)
class StepRecord:
    """One counted trainer step: when it ended, how long it took and what the reports showed."""

    version: int  # the weight version the step published
    seconds: float  # wall time of the step
    train_devices: int  # devices the trainer held at home during the step
    trainer_busy_device_s: float  # the trainer's busy device-seconds over the step
    contention_s: float  # integral over the step of the rollout contention (seconds)
    queued_s: float  # seconds of the step during which generations waited for an engine
    # device-seconds the trainer computed from the last scored work reaching it to the step's end:
    # the training nothing overlaps. Compute, not wall time: a trainer that trains 0.1 s of a 3 s step
    # and then waits for the weights to publish has a 0.1 s tail, which more devices would shorten.
    tail_device_s: float


@dataclass(frozen=True)
class Signals:
    """Means over the counted steps at one home."""

    step_s: float
    # Seconds per device-second the trainer computed: the step time per unit of the step's work.
    # What homes are compared by: a batch of longer executions makes a longer step and more training
    # work alike, so the pace follows the split, not the batch (nor a drift of the lengths).
    pace: float
    trainer_busy_share: float  # busy device-seconds over (devices held x seconds)
    contention: float
    queued: float
    tail_device_s: float  # the tail's busy device-seconds (StepRecord.tail_device_s)


class SplitMeter:
    """Step times and in-step signals per home split and the home they point to (module docstring)."""

    def __init__(
        self,
        probe_steps: int = 2,
        warmup_steps: int = 1,
        memory_steps: int = 16,
        busy_headroom: float = 3.0,
        min_train_devices: int = 1,
        min_gain: float = 0.02,
        contention_share: float = 0.5,
        queued_share: float = 0.2,
        saturated_share: float = 0.9,
        tail_share: float = 0.02,
        light_trainer_devices: float = 0.1,
    ) -> None:
        if probe_steps < 1 or warmup_steps < 0 or memory_steps < probe_steps:
            raise ValueError("need probe_steps >= 1, warmup_steps >= 0 and memory_steps >= probe_steps")
        if busy_headroom < 1 or min_train_devices < 1:
            raise ValueError("need busy_headroom >= 1 and min_train_devices >= 1")
        if not 0 < saturated_share <= 1 or tail_share <= 0:
            raise ValueError("need 0 < saturated_share <= 1 and tail_share > 0")
        self.probe_steps = probe_steps
        self.warmup_steps = warmup_steps
        self.memory_steps = memory_steps
        self.busy_headroom = busy_headroom
        self.min_gain = min_gain
        self.min_train_devices = min_train_devices
        self.contention_share = contention_share
        self.queued_share = queued_share
        self.saturated_share = saturated_share
        self.tail_share = tail_share
        self.light_trainer_devices = light_trainer_devices
        # (version, seconds, trainer busy device-seconds) at each step boundary since warmup
        self._busy_marks: list[tuple[int, float, float]] = []
        self.home = 0  # rollout devices at home; 0 = not chosen yet (half the pool)
        self.stride = 0  # devices between probed splits; 0 = not chosen yet (an eighth of the pool)
        self._bound = 1  # the staleness bound (from the snapshot): the pipeline fills in bound + 1 steps
        self._moved = False  # the home has moved since the start (the first decision needs one step)
        self._came_from: int | None = None  # the home before the last move
        self._version = -1
        self._version_t = 0.0
        self._version_busy = 0.0
        self._home_since_version = 0
        # the running step: integrals since its start and when scored work last reached the trainer
        self._last_t: float | None = None
        self._last_contention = 0.0
        self._last_queued = False
        self._contention_s = 0.0
        self._queued_s = 0.0
        self._last_work = 0.0
        self._busy_at_arrival = 0.0  # the trainer's busy device-seconds when scored work last arrived
        # home -> records of steps that ran wholly under that home
        self._steps: dict[int, list[StepRecord]] = {}

    def observe(self, snapshot: PoolSnapshot, now_s: float) -> PoolSnapshot:
        """`snapshot` with the home split measured so far (`measured_home_rollout`, 0 = none yet)."""
        total = len(snapshot.devices)
        if total < 2:
            return snapshot
        if self.home == 0:
            self.home = max(1, total // 2)
            self.stride = max(1, total // 8)
        self.home = max(1, min(total - 1, self.home))
        self._bound = snapshot.staleness_bound
        self._integrate(snapshot, now_s)
        v = snapshot.latest_version
        if v < self._version:
            self._steps.clear()
            self._busy_marks.clear()
            self._version, self._home_since_version = v, v
            self._start_step(snapshot, now_s)
        elif v > self._version:
            if self._version >= 0 and v == self._version + 1 and self._counts(self._version):
                self._record(v, total, snapshot, now_s)
            self._version = v
            self._start_step(snapshot, now_s)
            if v >= self.warmup_steps:
                self._busy_marks.append((v, now_s, snapshot.trainer_busy_device_s))
            self._forget(v)
            floor = self.busy_floor(total)
            if self.home < floor:
                self._move(floor)  # the trainer holds more than its busy time needs
                self._came_from = None  # a lease rule, not a probe: never undone by step times
            else:
                self._decide(total)
        else:
            self._note_work(snapshot, now_s)
        return dataclasses.replace(snapshot, measured_home_rollout=self.home if self.measured() else 0)

    # --- measuring ----------------------------------------------------------------------------------
    def _integrate(self, snapshot: PoolSnapshot, now_s: float) -> None:
        """Add the time since the last snapshot to the running step's integrals (the previous
        snapshot's values held until now)."""
        if self._last_t is not None and now_s > self._last_t:
            dt = now_s - self._last_t
            self._contention_s += dt * self._last_contention
            self._queued_s += dt * self._last_queued
        self._last_t = now_s
        engines = [d for d in snapshot.devices if d.role == Role.ROLLOUT and not d.moving]
        shared = sum((d.generating - 1) / d.generating for d in engines if d.generating > 0)
        self._last_contention = shared / len(engines) if engines else 0.0
        self._last_queued = snapshot.queued_generations > 0

    def _note_work(self, snapshot: PoolSnapshot, now_s: float) -> None:
        """Note scored work reaching the trainer within the running step (its reported remaining work
        rising); the step's own start counts as an arrival."""
        work = snapshot.trainer_remaining_work_device_s
        if work > self._last_work + 1e-9:
            self._busy_at_arrival = snapshot.trainer_busy_device_s
        self._last_work = work

    def _start_step(self, snapshot: PoolSnapshot, now_s: float) -> None:
        self._version_t = now_s
        self._version_busy = snapshot.trainer_busy_device_s
        self._contention_s = self._queued_s = 0.0
        self._busy_at_arrival = snapshot.trainer_busy_device_s
        self._last_work = snapshot.trainer_remaining_work_device_s

    def _record(self, v: int, total: int, snapshot: PoolSnapshot, now_s: float) -> None:
        seconds = now_s - self._version_t
        if seconds <= 0:
            return
        record = StepRecord(
            version=v,
            seconds=seconds,
            train_devices=total - self.home,
            trainer_busy_device_s=max(0.0, snapshot.trainer_busy_device_s - self._version_busy),
            contention_s=self._contention_s,
            queued_s=self._queued_s,
            tail_device_s=max(0.0, snapshot.trainer_busy_device_s - self._busy_at_arrival),
        )
        self._steps.setdefault(self.home, []).append(record)

    def _counts(self, started_at: int) -> bool:
        """Whether the step that started at version `started_at` ran wholly under the current home and
        after the pipeline filled: with staleness bound b the first b + 1 batches are all admitted at
        once, so the first steps train work rolled out together and are no sample of the run."""
        fill = max(self.warmup_steps, self._bound + 1)
        return started_at >= max(fill, self._home_since_version + 1)

    def signals(self, home: int, steps_needed: int | None = None) -> Signals | None:
        """Means over the last `probe_steps` counted steps at `home` (None: fewer than `steps_needed`,
        by default `probe_steps`, measured)."""
        steps = self._steps.get(home, [])[-self.probe_steps :]
        if len(steps) < (steps_needed or self.probe_steps):
            return None
        seconds = sum(s.seconds for s in steps)
        return Signals(
            step_s=seconds / len(steps),
            pace=seconds / max(1e-9, sum(s.trainer_busy_device_s for s in steps)),
            trainer_busy_share=sum(s.trainer_busy_device_s for s in steps)
            / sum(s.seconds * max(1, s.train_devices) for s in steps),
            contention=sum(s.contention_s for s in steps) / seconds,
            queued=sum(s.queued_s for s in steps) / seconds,
            tail_device_s=statistics.fmean(s.tail_device_s for s in steps),
        )

    def trainer_busy_devices(self) -> float | None:
        """Device-seconds the trainer computed per second over the remembered steps (None: < 2 marks)."""
        if len(self._busy_marks) < 2:
            return None
        (_, t0, b0), (_, t1, b1) = self._busy_marks[0], self._busy_marks[-1]
        return max(0.0, b1 - b0) / (t1 - t0) if t1 > t0 else None

    def tail_devices(self) -> int | None:
        """The fewest training devices that keep the trainer's tail within `tail_share` of a step,
        over every remembered step (each tail scaled by the devices that trained it); None: no step
        counted yet."""
        records = [s for steps in self._steps.values() for s in steps]
        if not records:
            return None
        tail = statistics.fmean(s.tail_device_s for s in records)
        step = statistics.fmean(s.seconds for s in records)
        return math.ceil(tail / (self.tail_share * step) - 1e-9)

    def measured(self) -> bool:
        """Whether the home rests on a measurement: the meter moved it, or it has measured the
        trainer's busy time and (unless the trainer is light) its tail. Until then the policy is told
        no home (0) and the trainer keeps what it holds."""
        if self._moved:
            return True
        busy = self.trainer_busy_devices()
        return busy is not None and (busy < self.light_trainer_devices or self.tail_devices() is not None)

    def busy_floor(self, total: int) -> int:
        """The fewest rollout devices at home: the pool less what the trainer's busy time needs and
        what keeps its tail short (`tail_devices`)."""
        busy = self.trainer_busy_devices()
        tail = self.tail_devices()
        if busy is not None and busy < self.light_trainer_devices:
            tail = 1  # its whole step's training takes a small share of a step on one device
        if busy is None or tail is None:
            return 1  # not measured yet: the trainer keeps what it holds
        need = max(self.min_train_devices, math.ceil(self.busy_headroom * busy - 1e-9), tail)
        return max(1, min(total - 1, total - need))

    def _forget(self, version: int) -> None:
        self._busy_marks = [m for m in self._busy_marks if m[0] > version - self.memory_steps]
        for home in list(self._steps):
            kept = [s for s in self._steps[home] if s.version > version - self.memory_steps]
            if kept:
                self._steps[home] = kept
            else:
                del self._steps[home]

    # --- deciding -----------------------------------------------------------------------------------
    def _direction(self, total: int, here: Signals) -> int:
        """+1: rollout is short of devices; -1: the trainer is; 0: neither shows it."""
        train = total - self.home
        if here.trainer_busy_share >= self.saturated_share:
            # A short step is trainer-bound by itself (consecutive steps alternate long and short
            # under a staleness bound): one step of it is no evidence.
            return -1 if len(self._steps.get(self.home, [])) >= self.probe_steps else 0
        pressure = here.contention >= self.contention_share or here.queued >= self.queued_share
        if not pressure:
            return 0
        # Fewer training devices must leave the trainer below saturation, and the rollout's expected
        # gain must beat the longer tail by `min_gain` of a step. The gain is bounded above by the
        # pressure: at most that share of the rollout's part of the step is slowed by sharing engines
        # (or waiting for one), and it shrinks as n / (n + stride) with n engines; the tail, training
        # no rollout overlaps, grows as the trainer's devices shrink.
        fewer = train - self.stride
        if fewer < self.min_train_devices:
            return 0
        if here.trainer_busy_share * train / fewer >= self.saturated_share:
            return 0
        tail_s = here.tail_device_s / max(1, train)
        share = min(1.0, max(here.contention, here.queued))
        gain = max(0.0, here.step_s - tail_s) * share * self.stride / (self.home + self.stride)
        cost = tail_s * (train / fewer - 1)
        return 1 if gain - cost >= self.min_gain * here.step_s else 0

    def _comparable(self) -> list[int]:
        """Other homes whose step times may be compared with the current home's: measured just before
        it (their last counted step at most `probe_steps` + 1 versions before its first). Step times
        measured further apart differ by the workload's drift as much as by the split."""
        mine = self._steps.get(self.home, [])
        if not mine:
            return []
        first = mine[0].version
        return [
            h for h, steps in self._steps.items()
            if h != self.home and steps[-1].version >= first - self.probe_steps - 1
        ]  # fmt: skip

    def _decide(self, total: int) -> None:
        # The first decision reads one counted step (the start is half the pool, a guess, and a run
        # may be short); a home reached by a move is measured `probe_steps` steps so it can be compared.
        here = self.signals(self.home, None if self._moved else 1)
        if here is None:
            return  # still measuring the current split
        known = {h: s.pace for h in self._comparable() if (s := self.signals(h)) is not None}
        came_from = self._came_from
        if came_from in known and known[came_from] < here.pace * (1 - self.min_gain):
            self._move(came_from)  # the last move made steps clearly slower: undo it
            return
        direction = self._direction(total, here)
        if direction == 0:
            return  # no side is short of devices: stay
        if came_from is not None and (direction > 0) == (self.home > came_from):
            # On the way the last move went: only if that move paid, measured over `probe_steps` steps
            # at both homes (one step is no evidence: consecutive steps differ by more than the
            # gains at stake); the in-step signals say where to go, not how much it gains. Once the
            # home it left is forgotten, the signals alone decide again.
            before = self.signals(came_from) if came_from in self._comparable() else None
            if came_from in self._steps and (before is None or here.pace > before.pace * (1 - self.min_gain)):
                return
        while True:
            target = self.home + direction * self.stride
            if 1 <= target < total and target not in known:
                self._move(target)
                return
            if self.stride == 1:
                return  # the next split that way was measured no faster: stay
            self.stride = max(1, self.stride // 2)

    def _move(self, home: int) -> None:
        self._moved = True
        self._came_from = self.home
        self.home = home
        self._home_since_version = self._version
