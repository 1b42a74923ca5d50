"""`gyre run --resume`: a job whose every process was SIGKILLed midway (as if the machine went down)
continues on its run directory to its target step, training no batch twice, with one report.

Real everything: `gyre run` on the quickstart (every service its own process, embedded NATS and
Postgres on the run_dir's data), with long horizons (40 to 48 turns instead of 3 to 8) so that every
execution lasts seconds, far longer than the event log lags the bus (with the quickstart's Pareto
horizons most executions last ~0.3 s and a kill could find none of those the log showed live);
the kill waits for a published step and a burst of executions running in the event log. The kill is the outermost edge: SIGKILL to the launcher, every process under it, and the
embedded servers found by their data directory in the run_dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from app.chaos import final_trainer_state
from app.job.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _long_horizon_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    raw["rollout"]["longhorizon_min_turns"] = 40
    raw["rollout"]["longhorizon_max_turns"] = 48
    path = tmp_path / "quickstart_long.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _gyre_run(config: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "run", str(config), "--steps", str(STEPS),
            "--run-dir", str(run_dir), *extra]  # fmt: skip


def _live_executions(run_dir: Path) -> int:
    """Executions the event log shows started and not ended (groups start in bursts after a weights
    version and most end within a second or two: a kill during a burst leaves them running)."""
    if not (run_dir / "events.jsonl").is_file():
        return 0
    live: set[str] = set()
    for r in read_events(run_dir / "events.jsonl"):
        if r["type"] == "ExecutionEvent":
            eid = r["event"].get("execution_id", "")
            if r["event"].get("kind") == "KIND_STARTED":
                live.add(eid)
            else:
                live.discard(eid)
    return len(live)


def _resume_lines(run_dir: Path) -> str:
    """What the rollout logged about its predecessor's executions (for a failing assertion)."""
    logs = sorted((run_dir / "logs").glob("rollout*.log"))
    lines = [ln for p in logs for ln in p.read_text(errors="replace").splitlines()]
    return "\n".join(ln for ln in lines if "previous rollout" in ln or "could not read" in ln) or "(none)"


def _versions(run_dir: Path) -> list[int]:
    if not (run_dir / "events.jsonl").is_file():
        return []
    return [
        int(r["event"].get("weights", {}).get("version", 0))
        for r in read_events(run_dir / "events.jsonl")
        if r["type"] == "WeightsPublishedEvent"
    ]


def _kill_everything(launcher: subprocess.Popen[bytes], run_dir: Path) -> int:
    """SIGKILL the launcher, its descendants and any process whose command line names the run_dir
    (the embedded Postgres daemonises away from the launcher), with theirs. Returns how many."""
    roots = [psutil.Process(launcher.pid)]
    for p in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            roots.append(p)
    victims: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                victims[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    for p in victims.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(victims.values()), timeout=30)
    return len(victims)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_job_killed_whole_midway_resumes_to_its_target_step_training_no_batch_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = _long_horizon_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    first = subprocess.Popen(_gyre_run(config, run_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while first.poll() is None and (
            max(_versions(run_dir), default=0) < 1 or _live_executions(run_dir) < 8
        ):
            assert time.monotonic() < deadline, "the first run never had a published step and executions live"
            time.sleep(0.2)
        assert first.poll() is None, "the first run ended before it could be killed"
        killed_at = max(_versions(run_dir))
        live_at_kill = _live_executions(run_dir)
        assert killed_at < STEPS
        assert _kill_everything(first, run_dir) >= 6  # launcher, NATS, Postgres, 4 services at least
    finally:
        if first.poll() is None:
            first.kill()
    resumed = subprocess.run(
        _gyre_run(config, run_dir, "--resume"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming run" in resumed.stdout

    records = read_events(run_dir / "events.jsonl")
    keys = Counter(f"{r['type']}:{r['event'].get('event_id', '')}" for r in records)
    assert max(keys.values()) == 1  # one log of the whole run, each event once
    versions = sorted(set(_versions(run_dir)))
    assert versions[:STEPS] == list(range(1, STEPS + 1))  # the step count continued from the kill
    trained = final_trainer_state(run_dir).get("trained_batch_ids", [])
    assert trained and max(Counter(trained).values()) == 1  # no batch trained twice
    starts = json.loads((run_dir / "service_starts.json").read_text())
    assert starts["rollout"] >= 2 and starts["trainer"] >= 2
    executions = [r["event"] for r in records if r["type"] == "ExecutionEvent"]
    assert any(e.get("kind") == "KIND_RESUMED" for e in executions), (  # live executions went on
        f"{live_at_kill} live in the log at the kill; rollout said: {_resume_lines(run_dir)}"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True
    assert len(json.loads((run_dir / "job_segments.json").read_text())) == 1  # the killed one wrote none
