"""What a run measured about its devices, defined as the simulator defines it.

`measure_run(run_dir)` reads a run directory (events.jsonl, config.yaml, final_stats.json and, for
paced runs, the busy log of gyre/pacing.py under pacing/) and returns, over the same window the
simulator uses (from the publication of weight version `warmup_steps` to that of the last version):

- `s_per_step`: wall seconds per trainer step in that window;
- `busy_device_s` (per role) and `idle_fraction_busy`: 1 - busy device-seconds / (devices x window),
  where a device is busy while it generates (an engine holding a sequence) or trains (a rank in a
  micro-batch) — the simulator's `1 - device_utilization`. Only paced runs log busy time; otherwise
  these are None;
- `lease_device_s` (per role: rollout, train, switching, idle) and `idle_fraction_lease`: the share
  of device-time no worker held a lease or a handoff was under way. This is what the run report has
  always called "device idle fraction"; it is not the simulator's quantity (a leased engine with
  nothing to decode is busy by lease and idle by work), so the two are never compared;
- `reassignments`, `live_migrations`, `executions_interrupted` and `train_handoffs` (ACQUIRED leases
  of role train: a device that completed its move to the trainer);
- `parts_per_step`: the mean number of parts the trainer's steps were trained from (its weights
  events' `num_parts`): above 1 only where a streaming trainer (`trainer.streaming`) began a step
  before all of its groups were scored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from app.job.analysis import analyse, event_time
from app.job.eventlog import read_events
from gyre.pacing import busy_device_s, load_busy_log


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _warmup_steps(raw: dict[str, Any], run_dir: Path, num_steps: int) -> int:
    """The workload file's warm-up (paced runs), else 1; never more than num_steps - 1."""
    pacing = ((raw.get("devices") or {}).get("pacing")) or {}
    warmup = 1
    ref = pacing.get("workload_file")
    if ref:
        from gyre.workload import load_workload_file

        path = Path(ref) if Path(ref).is_absolute() else run_dir / ref
        if path.is_file():
            warmup = load_workload_file(path).warmup_steps
    return max(0, min(warmup, num_steps - 1))


def measure_run(run_dir: Path, warmup_steps: int | None = None) -> dict[str, Any]:
    """The device measurements of one run (see the module doc). Raises ValueError without events."""
    run_dir = Path(run_dir)
    records = read_events(run_dir / "events.jsonl")
    a = analyse(records)
    raw = _config(run_dir)
    published: dict[int, float] = {}
    parts: list[float] = []
    for r in records:
        if r["type"] == "WeightsPublishedEvent":
            v = int((r["event"].get("weights") or {}).get("version") or 0)
            published[v] = min(published.get(v, math.inf), event_time(r))
            parts.append(float((r["event"].get("metrics") or {}).get("num_parts") or 1.0))
    n = max(published, default=0)
    job_steps = (raw.get("job") or {}).get("num_steps")
    if job_steps:  # the job's steps; versions trained while it stopped are not in the window
        n = min(n, int(job_steps))
    warmup = _warmup_steps(raw, run_dir, n) if warmup_steps is None else warmup_steps
    t_start = min(event_time(r) for r in records)
    t0 = published.get(warmup, t_start) if warmup > 0 else t_start
    t1 = published.get(n, t0)
    window = t1 - t0
    steps = n - warmup
    devices = sorted({s.device_id for s in a.segments})
    num_devices = len(devices) or int(((raw.get("rollout") or {}).get("num_devices")) or 0)

    lease_s: dict[str, float] = {"rollout": 0.0, "train": 0.0, "switching": 0.0, "idle": 0.0}
    for seg in a.segments:
        lo, hi = max(seg.start_s + a.start_unix_s, t0), min(seg.end_s + a.start_unix_s, t1)
        if hi > lo:
            lease_s[seg.role] += hi - lo
    lease_total = sum(lease_s.values())
    busy_rows = load_busy_log(run_dir)
    busy = busy_device_s(busy_rows, t0, t1) if busy_rows else None

    handoffs = {
        (str(ev.get("lease", {}).get("device_id")), str(ev.get("lease", {}).get("epoch")))
        for r in records
        if r["type"] == "LeaseEvent"
        and (ev := r["event"]).get("kind") == "KIND_ACQUIRED"
        and (ev.get("lease") or {}).get("role") == "DEVICE_ROLE_TRAIN"
    }
    stats_path = run_dir / "final_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    rollout = stats.get("rollout") or {}
    interrupted = int(rollout.get("executions_interrupted") or 0)
    interrupted = max(interrupted, int(a.execution_counts.get("failed", 0)))
    outcome_path = run_dir / "outcome.json"
    completed = json.loads(outcome_path.read_text()).get("completed") if outcome_path.is_file() else None
    return {
        "run_dir": str(run_dir),
        "policy": (raw.get("scheduler") or {}).get("policy") or a.policy,
        "completed": completed,
        "num_steps": n,
        "warmup_steps": warmup,
        "num_devices": num_devices,
        "window_s": window,
        "s_per_step": window / steps if steps > 0 and window > 0 else None,
        "reassignments": a.num_reassignments,
        # Moves made after the warm-up steps: a policy that re-splits only at start has none here.
        "reassignments_in_window": sum(
            1
            for r in records
            if r["type"] == "LeaseEvent"
            and r["event"].get("kind") == "KIND_REASSIGN"
            and t0 < event_time(r) <= t1
        ),
        "live_migrations": max(a.num_migrations, int(rollout.get("migrations") or 0)),
        "executions_interrupted": interrupted,
        "train_handoffs": len(handoffs),
        "parts_per_step": sum(parts) / len(parts) if parts else None,
        "lease_device_s": dict(lease_s),
        "idle_fraction_lease": (lease_s["idle"] + lease_s["switching"]) / lease_total
        if lease_total
        else None,
        "busy_device_s": busy,
        "idle_fraction_busy": (
            1 - sum(busy.values()) / (num_devices * window)
            if busy is not None and window > 0 and num_devices
            else None
        ),
    }
