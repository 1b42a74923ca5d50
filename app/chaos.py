"""`gyre chaos [CONFIG] [--json] [--steps N] [--seed S] [--run-dir D]`: kill anything, lose nothing.

Runs one job of CONFIG (default: the quickstart) exactly as `gyre run` does — every service its own
supervised process, embedded NATS and Postgres — and meanwhile, one fault at a time:

    for target in scheduler, rollout, trajectory, trainer, nats, postgres:
        wait for trainer step s_target (spread over the run) + a random delay (seeded); a rollout
        kill then also waits for a live execution (started, not ended), so resuming is exercised
        SIGKILL the target's process (postgres: a fast shutdown, i.e. a restart of the server)
        wait until the supervisor brought it back and every service reports SERVING  -> recovery_s
        wait until the trainer publishes its next weight version                     -> progress_resumed_s

Then, over the whole run, from the event log (events.jsonl), the services' final counters and the
trainer's final checkpoint:

    steps_emitted        distinct step events on the bus (what every rollout incarnation published)
    steps_stored         calls the trajectory service holds in Postgres
    steps_lost           steps_emitted - steps_stored (floor 0)
    batches_lost         batches the trajectory service handed to the trainer (delivered, or acked as
                         trained) that the trainer's final model never trained, except one still in
                         flight when the job stopped (batches_dissolved: announced batches the
                         trajectory later released as stale or too big; their groups were re-packed
                         or dropped as stale, which the trajectory counts)
    paths_trained_twice  paths of batches the trainer trained more than once
    double_leases        a device acquired by a holder while another holder's lease was not released,
                         or with an epoch not above the previous acquisition's
    executions_lost      executions of a rollout process that died (killed here or exiting by itself;
                         started, no end event when it died) whose group was never scored: neither
                         ended nor trained as partial (executions_orphaned: all of them, scored or not)
    executions_live_at_kill / _resumed / _restarted   of those, the ones the restarted rollout resumed
                         under their own id and finished (RESUMED event, then FINISHED or TRUNCATED),
                         and the ones it ended FAILED instead (their tasks ran again in new groups);
                         executions_resumed_fraction = resumed / live at kill (execution_fates)
    completed            the job reached its steps; `learned` (+ reward delta): the report's verdict
    trainer_bitwise_equal  the exactly-once probe (app.exactly_once): a trainer SIGKILLed and
                         restarted ends bitwise equal to an uninterrupted one fed the same batches

Exit status 0 when completed, every loss counter is 0, every fault recovered and the trainer is
bitwise equal; 1 otherwise; 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError, GyreError

TARGETS = ("scheduler", "rollout", "trajectory", "trainer", "nats", "postgres")
DEFAULT_CONFIG = Path("examples/quickstart.yaml")
RECOVERY_TIMEOUT_S = 300.0
LOSS_COUNTERS = ("steps_lost", "paths_trained_twice", "batches_lost", "double_leases", "executions_lost")


@dataclass
class Fault:
    """One injected fault and how the deployment came back from it (times: Unix seconds)."""

    target: str
    at_step: int  # trainer step (weight version) after which it is injected
    delay_s: float  # random delay after that step
    injected_at: float = 0.0
    step_at_kill: int = 0
    recovered: bool = False
    recovery_s: float | None = None  # kill -> target back and every service SERVING
    progress_resumed_s: float | None = None  # kill -> next weight version published
    restarts: list[str] = field(default_factory=list)  # services/servers restarted because of it
    error: str = ""


def plan_faults(targets: list[str], num_steps: int, rng: random.Random) -> list[Fault]:
    """One fault per target, in order, at steps spread over the run (the last one at least two steps
    before the end, so its recovery is observed), each after a random delay of 0-3 s."""
    span = max(1, num_steps - 3)
    faults = []
    for i, target in enumerate(targets):
        step = 1 + (i * span) // max(1, len(targets))
        faults.append(Fault(target, step, round(rng.uniform(0.0, 3.0), 2)))
    return faults


def _all_serving(deployment: Any) -> bool:
    from app.launcher.healthcheck import check

    return all(
        check(ep.grpc_address, timeout_s=2.0) == "SERVING"
        for name, ep in deployment.endpoints.services.items()
        if name not in deployment.stopped_services
    )


def _kill(deployment: Any, target: str) -> None:
    if target in ("nats", "postgres"):
        server = deployment.embedded(target)
        if server is None or server.pid is None:
            raise GyreError(f"no embedded {target} to kill (an external server is not ours to kill)")
        # nats: SIGKILL; postgres: a fast shutdown (SIGINT), which the supervisor turns into a restart.
        os.kill(server.pid, signal.SIGKILL if target == "nats" else signal.SIGINT)
        return
    proc = deployment.process(target)
    if proc is None or proc.returncode is not None:
        raise GyreError(f"service {target} is not running")
    os.kill(proc.pid, signal.SIGKILL)


async def _until_version(tracker: Any, version: int, deadline_unix_s: float) -> bool:
    """Poll every 0.2 s until the trainer published `version` (True) or the deadline passed (False)."""
    while True:
        if tracker.version >= version:
            return True
        if time.time() > deadline_unix_s:
            return False
        await asyncio.sleep(0.2)


LIVE_WAIT_S = 60.0  # longest wait for live executions before a rollout kill


async def _until_live_executions(tracker: Any, deadline_unix_s: float) -> bool:
    """Poll every 0.1 s until the event stream shows an execution started and not ended (True) or
    the deadline passed (False). Executions start in bursts after a weights version and most end
    within seconds: a rollout killed between bursts has nothing to resume and tests nothing."""
    while True:
        if tracker.executions["started"] > tracker.executions["ended"]:
            return True
        if time.time() > deadline_unix_s:
            return False
        await asyncio.sleep(0.1)


async def inject(deployment: Any, tracker: Any, faults: list[Fault]) -> None:
    """Inject `faults` one after the other (module docstring); never raises, errors are recorded.
    A rollout kill waits (up to LIVE_WAIT_S) for live executions, so that resuming is exercised."""
    for fault in faults:
        try:
            await _until_version(tracker, fault.at_step, math.inf)
            await asyncio.sleep(fault.delay_s)
            if fault.target == "rollout":
                await _until_live_executions(tracker, time.time() + LIVE_WAIT_S)
            fault.step_at_kill = tracker.version
            fault.injected_at = time.time()
            _kill(deployment, fault.target)
            deadline = fault.injected_at + RECOVERY_TIMEOUT_S
            while time.time() < deadline:
                back = any(
                    r.service == fault.target and r.serving_at and r.exited_at >= fault.injected_at - 1.0
                    for r in deployment.restarts
                )
                if back and await asyncio.to_thread(_all_serving, deployment):
                    fault.recovered = True
                    fault.recovery_s = round(time.time() - fault.injected_at, 2)
                    break
                await asyncio.sleep(0.2)
            fault.restarts = [
                r.service for r in deployment.restarts if r.exited_at >= fault.injected_at - 1.0
            ]
            if not fault.recovered:
                fault.error = f"not recovered within {RECOVERY_TIMEOUT_S:.0f} s"
                continue
            if await _until_version(tracker, fault.step_at_kill + 1, deadline):
                fault.progress_resumed_s = round(time.time() - fault.injected_at, 2)
        except Exception as exc:  # recorded and reported; the next fault still runs
            fault.error = repr(exc)


# -- the numbers -------------------------------------------------------------------------------


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
    again in a new group) or "unended" (no end event at all). Events as the event log holds them."""
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
            fates[eid] = "unended"
        elif end_kind != "KIND_FAILED" and any(r > hit[-1] for r in resumed_at.get(eid, [])):
            fates[eid] = "resumed"
        else:
            fates[eid] = "restarted"
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
    steps_stored = int(float(trajectory.get("stored_calls", 0)))

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
    lost_executions = [eid for eid in orphaned if started[eid].get("group_id") not in scored]
    rerun_groups = {ev.get("group_id", "") for ev in started.values() if "-r" in ev.get("group_id", "")}
    return {
        "steps_emitted": steps_emitted,
        "steps_stored": steps_stored,
        "steps_lost": max(0, steps_emitted - steps_stored),
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
        "executions_resumed_fraction": (
            round(sum(1 for f in fates.values() if f == "resumed") / len(fates), 4) if fates else None
        ),
        "executions_lost": len(lost_executions),
        "groups_rerun_after_rollout_restart": len(rerun_groups),
    }


# -- the command -------------------------------------------------------------------------------


def run_chaos(
    config_path: Path, *, steps: int | None, seed: int, run_dir: Path | None, targets: list[str]
) -> dict[str, Any]:
    """Run the job with faults injected and return every number (module docstring)."""
    import yaml

    from app.exactly_once import run_probe
    from app.job.config import JobConfig
    from app.job.run import (
        CONFIG_NAME,
        drive,
        effective_config,
        finish_run,
        prepare_run_dir,
        service_wiring,
    )
    from app.launcher.deployment import Deployment
    from gyre.config import load_common, load_section

    raw = effective_config(config_path, policy=None, steps=steps, run_dir=run_dir)
    raw.setdefault("job", {})["timeout_s"] = max(float(raw["job"].get("timeout_s", 0)), 3600.0)
    common = load_common(data=raw)
    job = load_section(JobConfig, "job", data=raw)
    if job.num_steps < 4:
        raise ConfigError(f"gyre chaos needs at least 4 trainer steps (job.num_steps), got {job.num_steps}")
    out_dir = Path(common.run_dir).resolve()
    prepare_run_dir(out_dir)
    raw["run_dir"] = str(out_dir)
    effective = out_dir / CONFIG_NAME
    effective.write_text(yaml.safe_dump(raw, sort_keys=False))
    faults = plan_faults(targets, job.num_steps, random.Random(seed))

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    started = time.time()
    service_args, extra_env = service_wiring(raw)
    with Deployment(
        effective, run_dir=out_dir, service_args=service_args, extra_env=extra_env, on_progress=progress
    ) as dep:

        async def sidecar(tracker: Any) -> None:
            await inject(dep, tracker, faults)

        outcome = asyncio.run(drive(dep, common, job, out_dir, started=started, sidecar=sidecar))
        try:
            in_store: dict[str, dict[str, Any]] | None = batch_states(
                dep.endpoints.database_url, common.run_id
            )
        except Exception as exc:  # reported: without it batches_lost cannot be judged
            progress(f"could not read the trajectory's batches: {exc!r}")
            in_store = None
    wall_s = time.time() - started
    report = finish_run(out_dir, outcome, wall_s=wall_s, seed=common.seed)
    counters = tally(out_dir, outcome.final_stats, faults, in_store)
    probe = run_probe(out_dir / "exactly_once", effective, steps=8, seed=seed)
    summary = report.summary
    result: dict[str, Any] = {
        "config": str(config_path),
        "run_dir": str(out_dir),
        "seed": seed,
        "num_steps": job.num_steps,
        "wall_s": round(wall_s, 1),
        "completed": outcome.reached_steps,
        "end_reason": outcome.reason,
        "faults": [asdict(f) for f in faults],
        "all_faults_recovered": all(f.recovered for f in faults),
        **counters,
        "restarts": outcome.final_stats.get("launcher", {}).get("restarts", {}),
        "learned": bool(summary.get("learned")),
        "reward_first20": summary.get("reward_first20"),
        "reward_last20": summary.get("reward_last20"),
        "reward_delta": summary.get("reward_delta"),
        "learned_rule": summary.get("learned_rule"),
        **probe,
    }
    result["ok"] = bool(
        result["completed"]
        and result["all_faults_recovered"]
        and all(result[c] == 0 for c in LOSS_COUNTERS)
        and result["trainer_bitwise_equal"]
    )
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print_text(result: dict[str, Any]) -> None:
    print(f"gyre chaos: {result['config']} ({result['num_steps']} steps, seed {result['seed']})")
    for f in result["faults"]:
        state = f"recovered in {f['recovery_s']} s" if f["recovered"] else f"NOT recovered ({f['error']})"
        print(
            f"  kill {f['target']:<10} after step {f['step_at_kill']:>3}: {state}; "
            f"progress resumed after {f['progress_resumed_s']} s; restarted {f['restarts']}"
        )
    for key in (
        "completed",
        "steps_emitted",
        "steps_stored",
        "executions_live_at_kill",
        "executions_resumed",
        "executions_restarted",
        *LOSS_COUNTERS,
        "learned",
        "trainer_bitwise_equal",
    ):
        print(f"  {key}: {result[key]}")
    print(f"  ok: {result['ok']}  (details: {result['run_dir']}/chaos.json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre chaos", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "config", type=Path, nargs="?", default=DEFAULT_CONFIG, help="run YAML (default: quickstart)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--steps", type=int, help="trainer steps (overrides job.num_steps)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault points and delays")
    parser.add_argument(
        "--run-dir", type=Path, help="run directory (default: the config's run_dir + '-chaos')"
    )
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated faults, in order (default {','.join(TARGETS)})",
    )
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"gyre chaos: unknown target(s) {unknown}; choose from {list(TARGETS)}", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    if run_dir is None:
        from gyre.config import load_common, load_yaml

        try:
            run_dir = Path(f"{load_common(data=load_yaml(args.config)).run_dir}-chaos")
        except (ConfigError, OSError) as exc:
            print(f"gyre chaos: {exc}", file=sys.stderr)
            return 2
    try:
        # stdout carries only the result: the job's progress lines go to stderr meanwhile.
        with contextlib.redirect_stdout(sys.stderr):
            result = run_chaos(
                args.config, steps=args.steps, seed=args.seed, run_dir=run_dir, targets=targets
            )
    except ConfigError as exc:
        print(f"gyre chaos: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_text(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
