"""`gyre chaos --resume`: the whole machine goes down mid-run, and `gyre run --resume` finishes the job.

    gyre run CONFIG --steps N --run-dir D            (a child process: launcher, services, embedded
                                                     NATS and Postgres, exactly as an operator runs it)
    wait for trainer step s (seeded, in the first half of the run) and executions live in the event log
    SIGKILL every process at once: the launcher, everything under it, and whatever names D on its
    command line (the embedded Postgres daemonises away from the launcher)
    gyre run CONFIG --steps N --run-dir D --resume   (a second child; it must complete the run)

Then, from the run directory (the same counters as the other faults, app.chaos.tally, with the kill
as a rollout death), plus the step count's continuity:

    step_at_kill           the newest weight version in the event log when everything was killed
    final_step             the newest weight version published (the trainer may go past N while the
                           job stops)
    steps_continuous       the weight versions published over both runs are 1..final_step, each
                           once, and final_step >= N
    processes_killed       how many processes the kill reached (launcher, NATS, Postgres, services...)

The trajectory's batch table (for batches_lost) is read after the resumed run ended, from the run's
own Postgres data started again for that read and stopped.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from app.chaos_faults import LIVE_WAIT_S, Fault

KILL_WAIT_S = 1800.0  # longest wait for the kill point (startup and the first steps included)
RESUME_TIMEOUT_S = 3600.0


def _events(run_dir: Path) -> list[dict[str, Any]]:
    from app.job.eventlog import read_events

    path = run_dir / "events.jsonl"
    return read_events(path) if path.is_file() else []


def _versions(records: list[dict[str, Any]]) -> list[int]:
    return [
        int(r["event"].get("weights", {}).get("version", 0))
        for r in records
        if r["type"] == "WeightsPublishedEvent"
    ]


def _live(records: list[dict[str, Any]]) -> int:
    live: set[str] = set()
    for r in records:
        if r["type"] == "ExecutionEvent":
            eid = r["event"].get("execution_id", "")
            if r["event"].get("kind") == "KIND_STARTED":
                live.add(eid)
            elif r["event"].get("kind") != "KIND_RESUMED":
                live.discard(eid)
    return len(live)


def _names(arg: str, places: set[str]) -> bool:
    """Whether a command-line argument is one of `places` or a path below one."""
    return any(arg == place or arg.startswith(place + "/") for place in places)


def kill_everything(launcher_pid: int, run_dir: Path) -> int:
    """SIGKILL the launcher, its descendants and every process with an argument in `run_dir` (or in
    the embedded Postgres's cluster, which lives outside it when we are root), with theirs, all at
    once (as a machine that loses power); returns how many processes. Never this process or its
    ancestors (a shell or `timeout` that started `gyre chaos --run-dir D` names D too)."""
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    # the run dir, and where the embedded Postgres keeps its cluster when it is not under it (root)
    places = {str(run_dir), str((run_dir / "postgres" / "pgdata").resolve())}
    roots: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid in spared:
            continue
        if p.pid == launcher_pid or any(_names(arg, places) for arg in p.info["cmdline"] or []):
            roots.append(p)
    victims: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                victims[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    for pid in spared:
        victims.pop(pid, None)
    for p in victims.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and any(_alive(p) for p in victims.values()):
        time.sleep(0.05)  # dead once gone or a zombie (its parent, maybe us, reaps it later)
    return len(victims)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _batches_after(run_dir: Path, run_id: str) -> dict[str, dict[str, Any]] | None:
    """The trajectory's batch table, read from the run's Postgres data (started for it, then stopped)."""
    from app.chaos_counts import batch_states
    from gyre.embedded import EmbeddedPostgres

    try:
        with EmbeddedPostgres(run_dir / "postgres", database="gyre") as pg:
            assert pg.url is not None
            return batch_states(pg.url, run_id)
    except Exception as exc:  # reported: without it batches_lost cannot be judged
        print(f"  could not read the trajectory's batches: {exc!r}", file=sys.stderr)
        return None


def run_resume_chaos(
    config_path: Path, *, steps: int, seed: int, run_dir: Path, run_id: str
) -> dict[str, Any]:
    """Kill the whole deployment of a `gyre run` mid-run and resume it (module docstring)."""
    import json

    from app.chaos_counts import tally

    run_dir = run_dir.resolve()
    # In the first half: executions live at the kill need steps after the resume to finish in.
    kill_step = random.Random(seed).randint(1, max(1, (steps - 1) // 2))
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "run",
        str(config_path),
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("GYRE_NATS_URL", "GYRE_DATABASE_URL")}
    log_dir = run_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    fault = Fault("everything", kill_step, 0.0)
    started = time.time()
    with open(log_dir / f"{run_dir.name}.first.log", "wb") as out:
        first = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + KILL_WAIT_S
        while first.poll() is None and max(_versions(_events(run_dir)), default=0) < kill_step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run never reached step {kill_step} within {KILL_WAIT_S:.0f} s")
            time.sleep(0.2)
        live_deadline = time.monotonic() + LIVE_WAIT_S
        while first.poll() is None and _live(_events(run_dir)) == 0 and time.monotonic() < live_deadline:
            time.sleep(0.1)
        if first.poll() is not None:
            raise RuntimeError(f"the first run ended (status {first.returncode}) before the kill")
        records = _events(run_dir)
        fault.step_at_kill = max(_versions(records), default=0)
        fault.detail["live_in_event_log"] = _live(records)
        fault.detail["processes_killed"] = kill_everything(first.pid, run_dir)
        # The kill's time is when the last SIGKILL was sent, not when we decided to kill: finding
        # the processes takes a moment in which executions still end (and such an execution, ended
        # by the first run, is not one that was live at the kill).
        fault.injected_at = time.time()
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
    with open(log_dir / f"{run_dir.name}.resume.log", "wb") as out:
        resumed = subprocess.run(
            [*cmd, "--resume"], env=env, stdout=out, stderr=subprocess.STDOUT, timeout=RESUME_TIMEOUT_S
        )
    wall_s = time.time() - started
    fault.recovered = resumed.returncode == 0
    fault.detail["resume_exit_status"] = resumed.returncode
    fault.error = "" if fault.recovered else f"gyre run --resume exited with status {resumed.returncode}"
    try:
        final_stats = json.loads((run_dir / "final_stats.json").read_text())
    except (OSError, ValueError):
        final_stats = {}
    # The whole deployment died: every execution live at the kill died with its rollout.
    as_rollout_kill = Fault("rollout", kill_step, 0.0, injected_at=fault.injected_at)
    counters = tally(run_dir, final_stats, [as_rollout_kill], _batches_after(run_dir, run_id))
    versions = _versions(_events(run_dir))
    per_version = Counter(versions)
    summary: dict[str, Any] = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    try:  # why the resumed run ended (app/job/run.py writes it beside the report)
        end_reason = str(json.loads((run_dir / "outcome.json").read_text()).get("reason", ""))
    except (OSError, ValueError):
        end_reason = f"no outcome.json: see {log_dir / f'{run_dir.name}.resume.log'}"
    return {
        "fault": {**fault.__dict__},
        "wall_s": round(wall_s, 1),
        "step_at_kill": fault.step_at_kill,
        "processes_killed": fault.detail["processes_killed"],
        "final_step": max(versions, default=0),
        # every version from 1 to the last one published exactly once, the last one >= N (the
        # trainer may publish more while the job stops)
        "steps_continuous": bool(per_version)
        and sorted(per_version) == list(range(1, max(per_version) + 1))
        and max(per_version) >= steps
        and max(per_version.values()) == 1,
        "completed": bool(summary.get("completed")) and fault.recovered,
        "end_reason": end_reason,
        "summary": summary,
        **counters,
    }


__all__ = ["kill_everything", "run_resume_chaos"]
