"""The pool's interval metrics: what each device is leased for and how busy each role kept them.

Every `SchedulerConfig.metrics_interval_s` the plan loop turns its latest `PoolSnapshot` into one
`MetricsEvent` (service "scheduler", `gyre.metrics.<run>.scheduler`) with these values:

- `interval`: the snapshot's number, 0, 1, 2 ... (the x axis of the `devices` series);
- `devices_<role>` (rollout, train, idle) and `devices_moving`: devices leased per role now, a device
  in a handoff counted as moving only;
- `<role>_busy_device_s` (rollout, train): device-seconds computed since the workers started
  (`WorkerLoad.busy_device_s`, cumulative);
- `<role>_busy_fraction`: the growth of that sum over the interval divided by the device-seconds
  leased to the role over it (seconds times the mean of the role's device counts at both ends), so
  1.0 means every leased device computed all the time; absent for the first snapshot and while
  a role holds no device;
- `busy.<device_id>`: 1 when that device computes right now (a rollout device decoding at least
  one request, a training device while a step runs), else 0 — the per-device lane of the dashboard;
- `live_executions`, `queued_generations`, `latest_version`.

A lost or repeated event only shifts a plot point (the metrics stream's guarantee).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gyre.v1 import events_pb2
from services.scheduler.policies import PoolSnapshot, Role

ROLES = (Role.ROLLOUT, Role.TRAIN, Role.IDLE)


@dataclass
class _Previous:
    t_s: float
    counts: dict[Role, int]
    busy_s: dict[Role, float]


def role_counts(snapshot: PoolSnapshot) -> tuple[dict[Role, int], int]:
    """Settled devices per role, and devices in a handoff."""
    counts = {role: 0 for role in ROLES}
    moving = 0
    for d in snapshot.devices:
        if d.moving:
            moving += 1
        else:
            counts[d.role] += 1
    return counts, moving


def device_busy(snapshot: PoolSnapshot) -> dict[str, float]:
    """1.0 per device computing now (see the module docstring), else 0.0."""
    step_running = snapshot.trainer_remaining_work_device_s > 0
    out: dict[str, float] = {}
    for d in snapshot.devices:
        busy = not d.moving and (
            (d.role == Role.ROLLOUT and d.generating > 0) or (d.role == Role.TRAIN and step_running)
        )
        out[d.device_id] = 1.0 if busy else 0.0
    return out


class PoolMetrics:
    """Turns successive snapshots into interval metrics (one instance per scheduler process)."""

    def __init__(self) -> None:
        self.interval = 0
        self._previous: _Previous | None = None

    def sample(self, snapshot: PoolSnapshot, now_s: float) -> dict[str, float]:
        """The values of the next MetricsEvent (`now_s`: seconds on any clock that only grows)."""
        counts, moving = role_counts(snapshot)
        busy_s = {Role.ROLLOUT: snapshot.rollout_busy_device_s, Role.TRAIN: snapshot.trainer_busy_device_s}
        values: dict[str, float] = {
            "interval": float(self.interval),
            "devices_moving": float(moving),
            "live_executions": float(snapshot.live_executions),
            "queued_generations": float(snapshot.queued_generations),
            "latest_version": float(snapshot.latest_version),
        }
        for role in ROLES:
            values[f"devices_{role.value}"] = float(counts[role])
        prev = self._previous
        for role, total in busy_s.items():
            values[f"{role.value}_busy_device_s"] = total
            if prev is not None and now_s > prev.t_s:
                leased_s = (now_s - prev.t_s) * (counts[role] + prev.counts[role]) / 2
                if leased_s > 0:
                    values[f"{role.value}_busy_fraction"] = max(0.0, total - prev.busy_s[role]) / leased_s
        for device_id, busy in device_busy(snapshot).items():
            values[f"busy.{device_id}"] = busy
        self._previous = _Previous(now_s, counts, busy_s)
        self.interval += 1
        return values


def metrics_event(run_id: str, process_tag: str, values: dict[str, float]) -> events_pb2.MetricsEvent:
    """The MetricsEvent of one sample; its id holds the scheduler process's tag and the interval, so
    two processes of one run (a restart counts intervals from 0 again) never share an id."""
    event_id = f"metrics.{run_id}.scheduler.{process_tag}.{int(values['interval'])}"
    return events_pb2.MetricsEvent(
        event_id=event_id, run_id=run_id, service="scheduler", values=values, created_unix_s=time.time()
    )
