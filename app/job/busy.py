"""Busy time of a run: when each device computed, next to when it was leased.

A lease says which role a device serves; it does not say the device worked. The rollout's engines
log each interval their decode batch held a sequence, and the trainer each micro-batch it computed
(on all its data-parallel devices), to `<run_dir>/pacing/<worker>.jsonl` (gyre/pacing.py, paced or
not). This module reads those intervals back, relative to the run's start, so the report can show
busy device-seconds per role beside leased ones and the idle share by busy time (the simulator's
definition: 1 - busy device-seconds / (devices x duration)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gyre.pacing import load_busy_log


@dataclass(frozen=True)
class BusyInterval:
    """`devices` devices busy in `role` from `start_s` to `end_s` (seconds since the run's start).
    `device` is the engine's device for rollout, "trainer" for training (every training device)."""

    role: str
    device: str
    start_s: float
    end_s: float
    devices: int = 1


@dataclass
class BusyTime:
    """Every logged busy interval of a run, clipped to [0, duration_s]."""

    intervals: list[BusyInterval] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def logged(self) -> bool:
        """Whether any worker logged busy time (false for runs from before busy logs existed)."""
        return bool(self.intervals)

    def device_s(self) -> dict[str, float]:
        """Busy device-seconds per role ("rollout", "train")."""
        out: dict[str, float] = {}
        for b in self.intervals:
            out[b.role] = out.get(b.role, 0.0) + (b.end_s - b.start_s) * b.devices
        return out

    def idle_fraction(self, num_devices: int) -> float | None:
        """1 - busy device-seconds / (devices x duration); None without a log or a duration."""
        if not self.logged or num_devices <= 0 or self.duration_s <= 0:
            return None
        return max(0.0, 1.0 - sum(self.device_s().values()) / (num_devices * self.duration_s))


def load_busy_time(run_dir: Path, start_unix_s: float, duration_s: float) -> BusyTime:
    """The busy intervals of `run_dir`, relative to `start_unix_s` and clipped to the run."""
    out = BusyTime(duration_s=duration_s)
    for row in load_busy_log(run_dir):
        start = max(0.0, float(row["start"]) - start_unix_s)
        end = min(duration_s, float(row["end"]) - start_unix_s)
        if end > start:
            devices = int(float(row.get("devices", 1)))
            out.intervals.append(BusyInterval(str(row["role"]), str(row["device"]), start, end, devices))
    return out
