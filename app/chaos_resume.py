"""`gyre chaos --resume`: the whole machine goes down mid-run, and `gyre run --resume` finishes the job.

    gyre run CONFIG --steps N --run-dir D            (a child process: launcher, services, embedded
                                                     NATS and Postgres, exactly as an operator runs it)
    wait for trainer step s (seeded, 1 <= s <= N-2) and executions live in the event log
    SIGKILL every process at once: the launcher, everything under it, and whatever names D on its
    command line (the embedded Postgres daemonises away from the launcher)
    gyre run CONFIG --steps N --run-dir D --resume   (a second child; it must complete the run)

Then, from the run directory (the same counters as the other faults, app.chaos.tally, with the kill
as a rollout death), plus the step count's continuity:

    step_at_kill           the newest weight version in the event log when everything was killed
    steps_continuous       the weight versions published over both runs are exactly 1..N, each once
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


def kill_everything(launcher_pid: int, run_dir: Path) -> int:
    """SIGKILL the launcher, its descendants and every process naming `run_dir` on its command line,
    with theirs, all at once (as a machine that loses power); returns how many processes."""
    roots: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        if p.pid == launcher_pid or str(run_dir) in " ".join(p.info["cmdline"] or []):
            roots.append(p)
    victims: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                victims[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    victims.pop(os.getpid(), None)
    for p in victims.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(victims.values()), timeout=30)
    return len(victims)


def _batches_after(run_dir: Path, run_id: str) -> dict[str, dict[str, Any]] | None:
    """The trajectory's batch table, read from the run's Postgres data (started for it, then stopped)."""
    from app.chaos import batch_states
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

    from app.chaos import tally

    run_dir = run_dir.resolve()
    kill_step = random.Random(seed).randint(1, max(1, steps - 2))
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
        fault.injected_at = time.time()
        fault.detail["processes_killed"] = kill_everything(first.pid, run_dir)
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
    return {
        "fault": {**fault.__dict__},
        "wall_s": round(wall_s, 1),
        "step_at_kill": fault.step_at_kill,
        "processes_killed": fault.detail["processes_killed"],
        "final_step": max(versions, default=0),
        # versions 1..N each published once (the trainer may publish one more while the job stops)
        "steps_continuous": sorted(per_version)[:steps] == list(range(1, steps + 1))
        and max(per_version.values()) == 1,
        "completed": bool(summary.get("completed")) and fault.recovered,
        "summary": summary,
        **counters,
    }


__all__ = ["kill_everything", "run_resume_chaos"]
