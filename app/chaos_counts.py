"""What `gyre chaos` counts over a run (app.chaos's docstring defines each counter): from the event
log (events.jsonl), the services' final counters, the trainer's final checkpoint and the
trajectory's batch table. Pure functions of those records, shared by app.chaos, app.chaos_resume and
app.chaos_soak (which passes each of its kills as a Fault: a rollout kill is a rollout death, an
engine kill an engine death, and every other exit of the rollout the supervisor saw counts too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from app.chaos_faults import Fault

LOSS_COUNTERS = (
    "steps_lost",
    "paths_trained_twice",
    "batches_lost",
    "double_leases",
    "executions_lost",
    "engine_kill_executions_lost",
)


def _int(value: Any) -> int:
    return int(value or 0)


def count_double_leases(lease_events: list[dict[str, Any]]) -> int:
    """Acquisitions of a device while another holder's acquisition was not released, or with an
    epoch not above the previous acquisition of that device (events in stream order)."""
    holder: dict[str, str] = {}
    epoch: dict[str, int] = {}
    doubles = 0
    for ev in lease_events:
        lease = ev.get("lease", {})
        device, kind = lease.get("device_id", ""), ev.get("kind", "")
        if kind in ("KIND_ACQUIRED", "KIND_REGISTERED") and lease.get("holder"):
            new_epoch = _int(lease.get("epoch"))
            current = holder.get(device)
            if (current and current != lease["holder"]) or (device in epoch and new_epoch <= epoch[device]):
                doubles += 1
            holder[device], epoch[device] = lease["holder"], new_epoch
        elif kind in ("KIND_RELEASED", "KIND_ROLLED_BACK") and not lease.get("holder"):
            holder.pop(device, None)
    return doubles


def execution_fates(execution_events: list[dict[str, Any]], kills: list[float]) -> dict[str, str]:
    """What became of each execution live when a rollout process died (started before a kill time in
    `kills`, no end event before it): "resumed" (a RESUMED event after that kill and an end that is
    not FAILED: it finished under its own id), "restarted" (ended FAILED: not resumed, its task ran
    again in a new group), "resumed_unended" (resumed after that kill, still running when the job
    stopped) or "unended" (no end event and not resumed). Events as the event log holds them."""
    started: dict[str, float] = {}
    ends: dict[str, tuple[float, str]] = {}
    resumed_at: dict[str, list[float]] = {}
    for ev in execution_events:
        eid, kind, at = ev["execution_id"], ev.get("kind", ""), float(ev.get("created_unix_s", 0))
        if kind == "KIND_STARTED":
            started.setdefault(eid, at)
        elif kind == "KIND_RESUMED":
            resumed_at.setdefault(eid, []).append(at)
        elif kind in ("KIND_FINISHED", "KIND_TRUNCATED", "KIND_FAILED"):
            ends.setdefault(eid, (at, kind))
    fates: dict[str, str] = {}
    for eid, t0 in started.items():
        end_at, end_kind = ends.get(eid, (math.inf, ""))
        hit = [k for k in kills if t0 < k < end_at]
        if not hit:
            continue
        if not end_kind:
            fates[eid] = "resumed_unended" if any(r > hit[-1] for r in resumed_at.get(eid, [])) else "unended"
        elif end_kind != "KIND_FAILED" and any(r > hit[-1] for r in resumed_at.get(eid, [])):
            fates[eid] = "resumed"
        else:
            fates[eid] = "restarted"
    return fates


def lost_execution_fates(
    fates: dict[str, str], started: dict[str, dict[str, Any]], scored_groups: set[str]
) -> dict[str, str]:
    """The executions a rollout death lost (id -> fate): live at the death, not resumed by the
    successor, and in a group that was never scored. One resumed and still running when the job
    stopped ("resumed_unended") is not lost: it is where every execution in flight at the job's end
    is, and its durable record lets `gyre run --resume` go on with it (counted apart as
    executions_resumed_unfinished)."""
    return {
        eid: fate
        for eid, fate in fates.items()
        if fate not in ("resumed", "resumed_unended") and started[eid].get("group_id") not in scored_groups
    }


def engine_kill_fates(execution_events: list[dict[str, Any]], kills: list[float]) -> dict[str, str]:
    """What became of each execution live when an engine was killed (started before a kill time in
    `kills`, no end event before it): "finished" (FINISHED or TRUNCATED: it lived through the kill),
    "failed" (ended FAILED) or "unended". The rollout process lived, so nothing is resumed: an
    execution whose engine died must simply go on (its calls migrate to the other engines)."""
    started: dict[str, float] = {}
    ends: dict[str, tuple[float, str]] = {}
    for ev in execution_events:
        eid, kind, at = ev["execution_id"], ev.get("kind", ""), float(ev.get("created_unix_s", 0))
        if kind == "KIND_STARTED":
            started.setdefault(eid, at)
        elif kind in ("KIND_FINISHED", "KIND_TRUNCATED", "KIND_FAILED"):
            ends.setdefault(eid, (at, kind))
    fates: dict[str, str] = {}
    for eid, t0 in started.items():
        end_at, end_kind = ends.get(eid, (math.inf, ""))
        if any(t0 < k < end_at for k in kills):
            fates[eid] = "unended" if not end_kind else "failed" if end_kind == "KIND_FAILED" else "finished"
    return fates


def final_trainer_state(run_dir: Path) -> dict[str, Any]:
    """state.json of the trainer's newest checkpoint (<run_dir>/trainer/checkpoints; {} if none)."""
    states = sorted((run_dir / "trainer").rglob("state.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(states):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if "trained_batch_ids" in data:
            return dict(data)
    return {}


def batch_states(database_url: str, run_id: str) -> dict[str, dict[str, Any]]:
    """batch_id -> {state, delivered_unix_s, trained_at_version} of the trajectory's batch table."""
    import sqlalchemy as sa

    from gyre import store

    engine = store.create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT batch_id, state, delivered_unix_s, trained_at_version FROM traj_batches "
                    "WHERE run_id = :run"
                ),
                {"run": run_id},
            ).all()
    finally:
        engine.dispose()
    return {r[0]: {"state": r[1], "delivered_unix_s": r[2], "trained_at_version": r[3]} for r in rows}


def tally(
    run_dir: Path,
    final_stats: dict[str, Any],
    faults: list[Fault],
    batches_in_store: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run's loss counters (module docstring) from its event log, counters, checkpoint and the
    trajectory's batch table (`batches_in_store`, read before the deployment stopped)."""
    from app.job.eventlog import read_events

    by_type: dict[str, list[dict[str, Any]]] = {}
    for record in read_events(run_dir / "events.jsonl"):
        by_type.setdefault(record["type"], []).append(record["event"])
    steps_emitted = len({ev["event_id"] for ev in by_type.get("StepEvent", [])})
    trajectory = final_stats.get("trajectory", {}).get("values", {})
    # None: the trajectory's counters could not be read at the end (unknown, not "all lost")
    steps_stored = int(float(trajectory["stored_calls"])) if "stored_calls" in trajectory else None

    trained = list(final_trainer_state(run_dir).get("trained_batch_ids", []))
    batches = {ev["batch_id"]: ev for ev in by_type.get("BatchReadyEvent", [])}
    twice = {b for b in trained if trained.count(b) > 1}
    weights = by_type.get("WeightsPublishedEvent", [])
    last_step_unix = max((float(w.get("weights", {}).get("created_unix_s", 0)) for w in weights), default=0.0)
    stored = batches_in_store or {}
    handed = {
        b: row
        for b, row in stored.items()
        if row["state"] == "delivered" or (row["state"] == "acked" and (row["trained_at_version"] or 0) >= 0)
    }
    lost_batches = [
        b
        for b, row in handed.items()
        if b not in trained and float(row["delivered_unix_s"] or 0) < last_step_unix
    ]
    dissolved = [b for b in batches if b not in stored] if batches_in_store is not None else []

    started = {
        ev["execution_id"]: ev for ev in by_type.get("ExecutionEvent", []) if ev.get("kind") == "KIND_STARTED"
    }
    scored = {ev["group_id"] for ev in by_type.get("GroupScoredEvent", [])}
    # Every time a rollout process died: the injected kills and any other exit the supervisor saw.
    restart_events = final_stats.get("launcher", {}).get("restart_events", [])
    kills = sorted(
        {f.injected_at for f in faults if f.target == "rollout" and f.injected_at}
        | {float(r["exited_at"]) for r in restart_events if r.get("service") == "rollout"}
    )
    fates = execution_fates(by_type.get("ExecutionEvent", []), kills)
    orphaned = list(fates)
    lost_executions = lost_execution_fates(fates, started, scored)
    rerun_groups = {ev.get("group_id", "") for ev in started.values() if "-r" in ev.get("group_id", "")}
    engine_fates = engine_kill_fates(
        by_type.get("ExecutionEvent", []),
        [f.injected_at for f in faults if f.target == "engine" and f.injected_at],
    )
    return {
        "steps_emitted": steps_emitted,
        "steps_stored": steps_stored,
        "steps_lost": None if steps_stored is None else max(0, steps_emitted - steps_stored),
        "batches_announced": len(batches),
        "batches_trained": len(set(trained)),
        "batches_lost": len(lost_batches) if batches_in_store is not None else None,  # None: unknown
        "batches_dissolved": len(dissolved),
        "batches_quarantined": sum(1 for row in stored.values() if row["trained_at_version"] == -1),
        "paths_trained_twice": sum(_int(batches.get(b, {}).get("num_paths")) for b in twice),
        "double_leases": count_double_leases(by_type.get("LeaseEvent", [])),
        "executions_started": len(started),
        "executions_orphaned": len(orphaned),
        "executions_live_at_kill": len(fates),
        "executions_resumed": sum(1 for f in fates.values() if f == "resumed"),
        "executions_restarted": sum(1 for f in fates.values() if f == "restarted"),
        "executions_resumed_unfinished": sum(1 for f in fates.values() if f == "resumed_unended"),
        "executions_resumed_fraction": (
            round(sum(1 for f in fates.values() if f == "resumed") / len(fates), 4) if fates else None
        ),
        "executions_lost": len(lost_executions),
        "executions_lost_fates": lost_executions,  # execution id -> its fate, to say which and how
        "groups_rerun_after_rollout_restart": len(rerun_groups),
        "engine_kill_executions_live": len(engine_fates),
        "engine_kill_executions_finished": sum(1 for f in engine_fates.values() if f == "finished"),
        "engine_kill_executions_lost": sum(1 for f in engine_fates.values() if f != "finished"),
    }
