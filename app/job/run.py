"""`gyre run CONFIG [--policy colocate|async|elastic] [--steps N] [--run-dir D] [--resume]`: one training job.

The job, on one screen:

    config   = effective config (CONFIG + command-line overrides) -> <run_dir>/config.yaml
    with Deployment(config):                 # NATS, Postgres, every service its own process
        collector.start()                    # every event of the run -> <run_dir>/events.jsonl
        keep `job.live_groups` groups of executions in flight (Rollout.StartExecutions)
        until weight version `job.num_steps` is published (or `job.timeout_s`, or a service is down
        for good: the launcher restarts a service that exits, within its restart budget)
        read every service's counters (the rollout's before it is stopped), stop the rollout, wait
        for ingest, read the others again -> <run_dir>/final_stats.json (+ the launcher's restarts)
        collector.stop()                     # final sweep: nothing published is missing
    report   = report.md + plots + summary.json from events.jsonl alone
    print reward_first20 / reward_last20 with their 95% intervals and the verdict

Losing the bus (nats-server killed and restarted by the launcher) is ridden out: the job's NATS
connection reconnects, a live tail that stalls is resubscribed from the start of its stream (the
event log drops duplicates), and closing the connection never raises, so the report is written.

`--resume` continues a run whose processes all died (the machine went down, Ctrl-C, a timeout) on
its run directory instead of moving it aside: the same run_id (checked against
<run_dir>/config.yaml), embedded NATS and Postgres on their data in the run_dir (streams, durable
consumers, leases, the trajectory store), the trainer from its checkpoint + journal (no batch
trained twice), the rollout as a later incarnation (launcher's start counts in the run_dir) that
resumes the executions left running, and the job's step count from the weight versions on the bus.
The event log is continued (each event once), so the report covers the whole run; its wall time
is the sum of the job's segments (<run_dir>/job_segments.json).

Exit status: 0 when the job reached its steps and the report was written; 1 when it stopped early
(timeout, a service down for good) — the report of what happened is still written, and says the
run did not complete; 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from app.job.config import JobConfig

if TYPE_CHECKING:
    from app.job.report import Report
from gyre.config import load_common, load_section, load_yaml
from gyre.errors import ConfigError, GyreError

POLICIES = ("colocate", "async", "elastic")
CONFIG_NAME = "config.yaml"
FINAL_STATS_NAME = "final_stats.json"
SEGMENTS_NAME = "job_segments.json"  # [[started_unix_s, ended_unix_s], ...]: one per `gyre run` of the run
RESYNC_INTERVAL_S = 10.0  # how often the drive loop checks that the live event tail keeps up


@dataclass
class JobOutcome:
    """What the drive loop ended with."""

    reached_steps: bool
    reason: str
    final_stats: dict[str, Any] = field(default_factory=dict)


_SECRET_WORDS = {"token", "key", "password", "secret"}
_SECRET_NAMES = {"database_url", "nats_url"}


def _secret(name: str) -> bool:
    """Names of credentials (and of server URLs that carry them): kept out of config.yaml when they
    come from the environment; the services still get them from it."""
    return name in _SECRET_NAMES or bool(_SECRET_WORDS & set(name.split("_")))


def _public(overrides: dict[str, Any]) -> dict[str, Any]:
    return {k: _public(v) if isinstance(v, dict) else v for k, v in overrides.items() if not _secret(k)}


def _with_env_overrides(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the GYRE_* environment laid over it as the services will read it (gyre.config):
    common fields (the run id...) and every section's `GYRE_<SECTION>__...`, credentials left out."""
    import os

    from gyre.config import CommonConfig, _env_overrides, deep_merge

    out = dict(raw)
    out.update({k: v for k, v in _public(_env_overrides(None)).items() if k in CommonConfig.model_fields})
    sections = {
        key.split("__", 1)[0][len("GYRE_") :].lower()
        for key in os.environ
        if key.startswith("GYRE_") and "__" in key
    }
    for section in sorted(sections | {k for k, v in raw.items() if isinstance(v, dict)}):
        overrides = _public(_env_overrides(section))
        if overrides and isinstance(out.get(section, {}), dict):
            out[section] = deep_merge(out.get(section) or {}, overrides)
    return out


def effective_config(
    config_path: Path, *, policy: str | None, steps: int | None, run_dir: Path | None
) -> dict[str, Any]:
    """The run YAML with the GYRE_* environment (credentials apart) and the command-line overrides
    applied (validated as far as the job's own parts): what the run's services run with, so
    RUN_DIR/config.yaml names the run id and the commands that actually ran."""
    raw = _with_env_overrides(load_yaml(config_path))
    if policy is not None:
        raw.setdefault("scheduler", {})
        if not isinstance(raw["scheduler"], dict):
            raise ConfigError("section 'scheduler' must be a mapping")
        raw["scheduler"]["policy"] = policy
    if steps is not None:
        raw.setdefault("job", {})["num_steps"] = steps
    if run_dir is not None:
        raw["run_dir"] = str(run_dir)
    load_common(data=raw)
    load_section(JobConfig, "job", data=raw)
    return raw


def prepare_run_dir(run_dir: Path) -> Path | None:
    """An empty run directory; a previous run's directory is kept, renamed with its time. Returns that name."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        run_dir.mkdir(parents=True, exist_ok=True)
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
    old = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while old.exists():
        old = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
        n += 1
    shutil.move(str(run_dir), str(old))
    run_dir.mkdir(parents=True)
    return old


def check_resumable(run_dir: Path, run_id: str) -> None:
    """ConfigError unless `run_dir` holds a run of `run_id` to resume (its config.yaml)."""
    config = run_dir / CONFIG_NAME
    if not config.is_file():
        raise ConfigError(
            f"--resume: {run_dir} holds no run to resume (no {CONFIG_NAME}); run without --resume"
        )
    previous = load_common(data=load_yaml(config)).run_id
    if previous != run_id:
        raise ConfigError(
            f"--resume: {run_dir} holds run {previous!r}, the config names run {run_id!r}; "
            "resume with the same run_id (or choose another --run-dir)"
        )


def record_segment(run_dir: Path, started: float, ended: float) -> float:
    """Append this `gyre run`'s [started, ended] to the run's segments; return the seconds of all of them."""
    path = run_dir / SEGMENTS_NAME
    try:
        segments = [list(map(float, seg)) for seg in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        segments = []
    segments.append([started, ended])
    path.write_text(json.dumps(segments) + "\n")
    return sum(b - a for a, b in segments)


# (section, field) -> the service whose gRPC address it needs
_ADDRESS_FIELDS = {
    ("rollout", "scheduler_address"): "scheduler",
    ("trainer", "scheduler_address"): "scheduler",
    ("trainer", "trajectory_address"): "trajectory",
}


def service_wiring(raw: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Ports chosen up front and the address fields that point services at each other.

    Each started service gets `--port P` (a free port now), and every `<section>.<x>_address` field
    the config leaves unset is given that address through `GYRE_<SECTION>__<FIELD>` in the services'
    environment. Returns (service_args, extra_env) for `Deployment`.
    """
    from app.launcher.config import LauncherConfig
    from gyre.embedded import free_port

    launcher = load_section(LauncherConfig, "launcher", data=raw)
    ports = {name: free_port(launcher.host.strip("[]")) for name in launcher.services}
    service_args = {name: ["--port", str(port)] for name, port in ports.items()}
    extra_env: dict[str, str] = {}
    for (section, fld), target in _ADDRESS_FIELDS.items():
        if target in ports and section in ports and not (raw.get(section) or {}).get(fld):
            extra_env[f"GYRE_{section.upper()}__{fld.upper()}"] = f"{launcher.host}:{ports[target]}"
    return service_args, extra_env


# ---------------------------------------------------------------------------------------------
# the drive loop (asyncio, inside a started Deployment)


async def _keep_executions_live(rollout_address: str, job: JobConfig) -> None:
    """Start tasks whenever fewer than live_groups * group_size executions are live (until cancelled)."""
    import grpc

    from gyre import rpc
    from gyre.v1 import rollout_pb2, rollout_pb2_grpc

    target = job.live_groups * job.group_size
    async with rpc.channel(rollout_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        while True:
            try:
                status = await stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
                deficit = target - status.live_executions
                if deficit >= job.group_size:
                    await stub.StartExecutions(
                        rollout_pb2.StartExecutionsRequest(
                            num_tasks=deficit // job.group_size, group_size=job.group_size
                        ),
                        timeout=30,
                    )
            except grpc.aio.AioRpcError:  # the rollout is being restarted: ask again next poll
                pass
            await asyncio.sleep(job.poll_interval_s)


async def collect_final_stats(
    endpoints: Any, run_id: str, *, skip: frozenset[str] | set[str] = frozenset()
) -> dict[str, Any]:
    """Counters of every service (but `skip`) at the end of the run (whatever answers within 10 s)."""
    from google.protobuf import json_format

    from gyre import rpc
    from gyre.v1 import (
        rollout_pb2,
        rollout_pb2_grpc,
        scheduler_pb2,
        scheduler_pb2_grpc,
        trainer_pb2,
        trainer_pb2_grpc,
        trajectory_pb2,
        trajectory_pb2_grpc,
    )

    calls = {
        "trajectory": (
            trajectory_pb2_grpc.TrajectoryStub,
            "GetStats",
            trajectory_pb2.GetStatsRequest(run_id=run_id),
        ),
        "trainer": (trainer_pb2_grpc.TrainerStub, "GetStatus", trainer_pb2.TrainerStatusRequest()),
        "rollout": (rollout_pb2_grpc.RolloutStub, "GetStatus", rollout_pb2.GetStatusRequest()),
        "scheduler": (scheduler_pb2_grpc.SchedulerStub, "GetPool", scheduler_pb2.GetPoolRequest()),
    }
    out: dict[str, Any] = {}
    for name, (stub_cls, method, request) in calls.items():
        service = endpoints.services.get(name)
        if service is None or name in skip:
            continue
        try:
            async with rpc.channel(service.grpc_address) as channel:
                reply = await getattr(stub_cls(channel), method)(request, timeout=10)
            out[name] = json_format.MessageToDict(reply, preserving_proto_field_name=True)
        except Exception as exc:  # a counter we cannot read is reported, not fatal
            out[name] = {"error": repr(exc)}
    return out


async def _stored_calls(address: str, run_id: str) -> int:
    from gyre import rpc
    from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc

    async with rpc.channel(address) as channel:
        reply = await trajectory_pb2_grpc.TrajectoryStub(channel).GetStats(
            trajectory_pb2.GetStatsRequest(run_id=run_id), timeout=10
        )
    return int(reply.stats.stored_calls)


async def stop_producers_and_wait_for_ingest(
    deployment: Any, collector: Any, tracker: Any, job: JobConfig
) -> None:
    """Stop the rollout service on purpose (no new steps; the supervisor does not restart it), then
    wait until the trajectory service has stored every step event published, so the final counters
    describe a settled run.

    Waits at most `job.ingest_wait_s`; a trajectory service still behind then is reported as is.
    """
    if "rollout" in deployment.endpoints.services:
        await asyncio.to_thread(deployment.stop_service, "rollout")
    await asyncio.sleep(job.drain_s)
    await collector.sweep()
    trajectory = deployment.endpoints.services.get("trajectory")
    if trajectory is None:
        return
    deadline = time.monotonic() + job.ingest_wait_s
    while time.monotonic() < deadline:
        try:
            stored = await _stored_calls(trajectory.grpc_address, tracker.run_id)
        except Exception:
            return  # the final counters will say what is wrong
        if stored >= tracker.num_steps_seen:
            return
        await asyncio.sleep(1.0)


async def drive(
    deployment: Any,
    common: Any,
    job: JobConfig,
    run_dir: Path,
    *,
    started: float,
    sidecar: Callable[[Any], Coroutine[Any, Any, None]] | None = None,
    listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> JobOutcome:
    """Record events, keep executions live and wait for the last step (see the module docstring).

    `sidecar(tracker)` (e.g. `gyre chaos`'s fault injector) runs beside the job from the start; the
    job counts as done only once it has returned too (an exception of it ends the job)."""
    from app.job.collector import EventCollector
    from app.job.progress import LiveProgress, RunTracker
    from app.job.watchdog import Watchdog, record
    from gyre.bus import Bus

    endpoints = deployment.endpoints
    bus = await Bus.connect(endpoints.nats_url, name="job")
    tracker = RunTracker(job.num_steps, common.run_id)
    collector = EventCollector(bus, common.run_id, run_dir)
    collector.on_event(tracker.update)
    for listener in listeners:  # e.g. the metrics sinks (app/job/tracking.py)
        collector.on_event(listener)
    tasks: list[asyncio.Task[Any]] = []
    outcome = JobOutcome(False, "")
    next_resync = time.monotonic() + RESYNC_INTERVAL_S
    try:
        await collector.start()
        with LiveProgress(tracker) as live:
            tasks.append(asyncio.create_task(live.run(), name="progress"))
            rollout = endpoints.services.get("rollout")
            side: asyncio.Task[None] | None = None
            if sidecar is not None:
                side = asyncio.create_task(sidecar(tracker), name="sidecar")
            if side is not None:
                tasks.append(side)
            if rollout is not None and job.live_groups > 0:
                tasks.append(
                    asyncio.create_task(_keep_executions_live(rollout.grpc_address, job), name="driver")
                )
            deadline = started + job.timeout_s
            watchdog = Watchdog(tracker, job.stall_timeout_s)
            while True:
                if tracker.steps_done.is_set() and (side is None or side.done()):
                    outcome = JobOutcome(True, f"weight version {tracker.version} published")
                    break
                if time.time() > deadline:
                    outcome = JobOutcome(
                        False, f"timeout after {job.timeout_s:.0f} s at step {tracker.version}"
                    )
                    break
                stall = await watchdog.check(endpoints)
                if stall is not None:
                    path = record(stall, run_dir)
                    print(f"watchdog: {stall.reason()} (written to {path})", file=sys.stderr, flush=True)
                    outcome = JobOutcome(False, stall.reason())
                    outcome.final_stats["watchdog"] = stall.to_json()
                    break
                failed = deployment.failed_services()
                if failed:
                    names = "; ".join(f"{name} {why}" for name, why in failed.items())
                    outcome = JobOutcome(False, f"service down for good: {names}")
                    break
                if time.monotonic() > next_resync:
                    next_resync = time.monotonic() + RESYNC_INTERVAL_S
                    await collector.resync()
                for task in tasks:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            # Every counter is read while its service still runs: the rollout's before it is stopped.
            before = await collect_final_stats(endpoints, common.run_id)
            if outcome.reached_steps:
                await stop_producers_and_wait_for_ingest(deployment, collector, tracker, job)
            else:
                await asyncio.sleep(job.drain_s)
            after = await collect_final_stats(endpoints, common.run_id, skip=deployment.stopped_services)
            outcome.final_stats = {**outcome.final_stats, **before, **after}
    finally:
        for task in tasks:
            task.cancel()
        outcome.final_stats["launcher"] = deployment.supervision_stats()
        try:
            await collector.stop()
        except Exception as exc:  # the log keeps what it has; the report is still written
            print(f"warning: final sweep of the event streams failed: {exc!r}", file=sys.stderr)
        await bus.close()
    return outcome


# ---------------------------------------------------------------------------------------------
# the command


def _print_headline(lines: list[str]) -> None:
    for line in lines:
        print(line, flush=True)


def finish_run(out_dir: Path, outcome: JobOutcome, *, wall_s: float, seed: int) -> Report:
    """Write final_stats.json and the outcome file, then the report (returned; ValueError when there
    is nothing to report on). The one ending of a job, for `gyre run` and `gyre chaos` alike."""
    from app.job.report import OUTCOME_NAME, build_report

    (out_dir / FINAL_STATS_NAME).write_text(json.dumps(outcome.final_stats, indent=2, sort_keys=True) + "\n")
    (out_dir / OUTCOME_NAME).write_text(
        json.dumps({"completed": outcome.reached_steps, "reason": outcome.reason}) + "\n"
    )
    restarts = outcome.final_stats.get("launcher", {}).get("restarts", {})
    if restarts:
        print(f"restarts by the supervisor: {restarts}", flush=True)
    return build_report(
        out_dir,
        extra={
            "job_wall_s": wall_s,
            "job_completed": outcome.reached_steps,
            "job_end_reason": outcome.reason,
            "restarts": restarts,  # service -> restarts by the launcher's supervisor
        },
        seed=seed,
    )


def run_job(
    config_path: Path,
    *,
    policy: str | None = None,
    steps: int | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
) -> int:
    """Run one job end to end, or with `resume` continue the one in its run_dir (module docstring);
    return the exit status."""
    from app.job import tracking
    from app.job.report import headline
    from app.job.trees import export_trees
    from app.launcher.deployment import Deployment, DeploymentError
    from app.ui.server import serve_for_job

    raw = effective_config(config_path, policy=policy, steps=steps, run_dir=run_dir)
    common = load_common(data=raw)
    job = load_section(JobConfig, "job", data=raw)
    out_dir = Path(common.run_dir).resolve()
    if resume:
        check_resumable(out_dir, common.run_id)
        print(f"resuming run {common.run_id} in {out_dir}", flush=True)
    else:
        moved = prepare_run_dir(out_dir)
        if moved is not None:
            print(f"previous run in {out_dir} moved to {moved}", flush=True)
    raw["run_dir"] = str(out_dir)
    effective = out_dir / CONFIG_NAME
    effective.write_text(yaml.safe_dump(raw, sort_keys=False))
    policy_name = (raw.get("scheduler") or {}).get("policy", "default")
    print(
        f"gyre run: run_id={common.run_id} policy={policy_name} steps={job.num_steps} run_dir={out_dir}",
        flush=True,
    )
    serve_for_job(out_dir, job.ui_port)  # the dashboard, or how to open it (app/ui/server.py)
    started = time.time()
    recorder = tracking.open_for_job(
        job, common.run_id, out_dir, {"policy": policy_name, "steps": job.num_steps}
    )
    listeners = [recorder.on_record] if recorder is not None else []
    try:
        service_args, extra_env = service_wiring(raw)
        with Deployment(
            effective,
            run_dir=out_dir,
            service_args=service_args,
            extra_env=extra_env,
            on_progress=lambda line: print(f"  {line}", flush=True),
        ) as dep:
            print(
                f"deployment up in {time.time() - started:.1f} s; endpoints in {out_dir / 'endpoints.json'}"
            )
            outcome = asyncio.run(drive(dep, common, job, out_dir, started=started, listeners=listeners))
            export_trees(dep.endpoints.database_url, common.run_id, out_dir)  # for `gyre ui` (app/ui/)
    except DeploymentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if not (out_dir / "events.jsonl").is_file():
            tracking.finish_for_job(recorder, None, out_dir)
            return 1
        outcome = JobOutcome(False, f"deployment failed: {exc.service}")
    wall_s = record_segment(out_dir, started, time.time())
    print(f"job ended: {outcome.reason} ({wall_s:.0f} s of job in all); writing the report", flush=True)
    try:
        report = finish_run(out_dir, outcome, wall_s=wall_s, seed=common.seed)
    except ValueError as exc:
        print(f"error: no report: {exc}", file=sys.stderr)
        tracking.finish_for_job(recorder, None, out_dir)
        return 1
    tracking.finish_for_job(recorder, report.analysis, out_dir)
    _print_headline(headline(report.analysis, None if outcome.reached_steps else outcome.reason))
    tps = report.analysis.time_per_step_s
    print(
        f"report: {report.report_path}  (plots in {out_dir / 'plots'}; "
        f"{'n/a' if math.isnan(tps) else f'{tps:.1f}'} s per step)",
        flush=True,
    )
    return 0 if outcome.reached_steps else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre run", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="run YAML (e.g. examples/quickstart.yaml)")
    parser.add_argument("--policy", choices=POLICIES, help="scheduling policy (overrides scheduler.policy)")
    parser.add_argument("--steps", type=int, help="trainer steps to run (overrides job.num_steps)")
    parser.add_argument("--run-dir", type=Path, help="run directory (overrides run_dir)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run directory (same run_id) instead of moving it aside and starting fresh",
    )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        return run_job(
            args.config, policy=args.policy, steps=args.steps, run_dir=args.run_dir, resume=args.resume
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GyreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: every service was stopped", file=sys.stderr)
        return 130
