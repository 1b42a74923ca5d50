"""`gyre up`, `gyre status` and the Deployment API against the real services, each in its own
process, with embedded (or fixture) NATS and Postgres. The test checks for leftover processes by
an environment marker every child inherits, by process group and by recorded pid.

Only services whose `python -m services.<name>` entry point exists are started (the launcher takes
its list from the config's `launcher.services`); the test says which in its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from app.launcher.config import SERVICE_ORDER

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GYRE = str(Path(sys.executable).with_name("gyre"))
MARKER = "GYRE_TEST_LAUNCHER_MARKER"
AVAILABLE = list(SERVICE_ORDER)  # every service has a __main__: one that goes missing fails, never skips
# Services without torch start in seconds; tests that are about process handling, not about the
# services, use them so the suite stays within its time budget on a 2-core machine.
LIGHT = [s for s in AVAILABLE if s in ("scheduler", "trajectory")] or AVAILABLE[:2]


def _marked(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries `marker`."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == marker:
                found.append(proc)
    return found


def _write_config(tmp_path: Path, services: list[str]) -> Path:
    config = tmp_path / "run.yaml"
    run = {
        "run_id": f"ops{uuid.uuid4().hex[:6]}",
        "run_dir": str(tmp_path / "run"),
        "launcher": {"services": services, "start_timeout_s": 240, "stop_grace_s": 40},
    }
    config.write_text(yaml.safe_dump(run))
    return config


def _clean_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env[MARKER] = marker
    return env


@contextlib.contextmanager
def _gyre_up(config: Path, marker: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [GYRE, "up", "--config", str(config)],
        cwd=ROOT,
        env=_clean_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(120)
        if proc.poll() is None:
            proc.kill()
        for leftover in _marked(marker):
            leftover.kill()


def _wait_for_file(path: Path, proc: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            output = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"gyre up did not write {path} (exit {proc.poll()}):\n{output}")
        time.sleep(0.2)


@pytest.mark.slow
def test_gyre_up_serves_health_status_and_metrics_then_stops_on_sigterm_without_orphans(
    tmp_path: Path,
) -> None:
    print(f"services under test: {LIGHT}")
    marker = uuid.uuid4().hex
    config = _write_config(tmp_path, LIGHT)
    endpoints_path = tmp_path / "run" / "endpoints.json"
    with _gyre_up(config, marker) as up:
        _wait_for_file(endpoints_path, up, timeout_s=400)
        endpoints = json.loads(endpoints_path.read_text())
        assert sorted(endpoints["services"]) == sorted(LIGHT)
        assert sorted(endpoints["embedded"]) == ["nats", "postgres"]
        pids = [ep["pid"] for ep in endpoints["services"].values()]
        running = {p.pid for p in _marked(marker)}
        assert set(pids) <= running
        assert len(running) > len(pids)  # nats-server and postgres run too
        for pid in pids:
            assert os.getpgid(pid) == pid, "each service leads its own process group"

        status = subprocess.run(
            [GYRE, "status", "--run-dir", str(tmp_path / "run"), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        rows = json.loads(status.stdout)
        assert {r["name"]: r["health"] for r in rows} == dict.fromkeys(LIGHT, "SERVING")
        assert {r["metrics"] for r in rows} == {"ok"}

        for ep in endpoints["services"].values():
            reply = httpx.get(ep["metrics_url"], timeout=10)
            assert reply.status_code == 200
            assert "gyre_service_state" in reply.text  # the lifecycle gauge every service exports

        up.send_signal(signal.SIGTERM)
        assert up.wait(180) == 0
        output = up.stdout.read() if up.stdout else ""
    assert _marked(marker) == [], output
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not endpoints_path.exists()
    down = subprocess.run(
        [GYRE, "status", "--run-dir", str(tmp_path / "run")], capture_output=True, timeout=60
    )
    assert down.returncode == 2


@pytest.mark.slow
def test_gyre_up_check_starts_every_service_verifies_health_and_metrics_and_leaves_no_process_behind(
    tmp_path: Path,
) -> None:
    print(f"services under test: {AVAILABLE}")
    marker = uuid.uuid4().hex
    config = _write_config(tmp_path, AVAILABLE)
    proc = subprocess.run(
        [GYRE, "up", "--config", str(config), "--check"],
        cwd=ROOT,
        env=_clean_env(marker),
        capture_output=True,
        text=True,
        timeout=580,
    )
    leftovers = _marked(marker)
    for leftover in leftovers:
        leftover.kill()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # --check fails unless every service reports SERVING and serves Prometheus text on /metrics.
    assert f"{len(AVAILABLE)} services healthy" in proc.stderr
    for name in AVAILABLE:
        assert f"{name} serving on" in proc.stderr
    assert leftovers == []


@pytest.mark.slow
def test_a_service_that_dies_while_starting_fails_the_start_with_its_log_and_stops_the_rest(
    tmp_path: Path, nats_url: str, database_url: str
) -> None:
    from app.launcher import Deployment, DeploymentError

    marker = uuid.uuid4().hex
    started = LIGHT  # the first one starts and must be stopped again; the last one fails
    last = started[-1]
    deployment = Deployment(
        _write_config(tmp_path, started),
        nats_url=nats_url,
        database_url=database_url,
        extra_env={MARKER: marker},
        service_args={last: ["--no-such-flag"]},
    )
    with pytest.raises(DeploymentError) as failure:
        deployment.start()
    assert failure.value.service == last
    assert "--no-such-flag" in str(failure.value)  # the tail of its log: argparse's complaint
    assert _marked(marker) == []
    assert not (tmp_path / "run" / "endpoints.json").exists()


# A service that dies after start: restarted (or, with launcher.restart off, reported with its
# log) — tests/ops/test_supervision.py.
