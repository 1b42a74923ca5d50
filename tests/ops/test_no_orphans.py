"""Nothing outlives its job: a killed launcher (`gyre run`, `gyre up`, or any process that started
children through gyre.embedded.process) leaves no service, nats-server or Postgres behind, including
processes the supervisor restarted from its thread during the run (issue 49: those got no
parent-death signal and were left running with parent pid 1).

Real processes only. Every process of a run is found by a marker in its environment, which every
child inherits from the killed parent (Postgres backends included), and, for a run, by the run
directory or the Postgres cluster in its command line; the guardian itself carries the marker too,
so it must be gone as well. Each test polls until nothing is left, within a bounded wait; it
asserts what is left, never how long it took.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MARKER = "GYRE_TEST_NO_ORPHANS"
# Bounded waits (seconds): for what a test waits on, never asserted as a duration.
START_WAIT_S = 400.0
GONE_WAIT_S = 120.0


def _clean_env(marker: str) -> dict[str, str]:
    """This environment without the fixtures' servers (a run embeds its own) plus the marker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env[MARKER] = marker
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _mentions(proc: psutil.Process, places: list[str]) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(place in arg for arg in proc.cmdline() for place in places)
    return False


def _tree(roots: list[int]) -> list[psutil.Process]:
    """The processes `roots` and all their descendants, now (psutil.Process remembers each start
    time, so a pid reused later is not mistaken for one of them)."""
    found: list[psutil.Process] = []
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
    return found


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def _left(
    marker: str, places: list[str] | None = None, known: list[psutil.Process] | None = None
) -> list[psutil.Process]:
    """Live processes (not zombies) of the marked job: the marker in their environment, one of
    `places` (the run dir, the Postgres cluster) in their command line, or one of `known` (seen in
    the job's process tree before the kill: Postgres backends overwrite their environment with
    their process title, so they carry no readable marker). Never this process."""
    found = {p.pid: p for p in known or [] if p.pid != os.getpid() and _alive(p)}
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["pid"] == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARKER) == marker or (places and _mentions(proc, places)):
                found[proc.pid] = proc
    return list(found.values())


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            lines.append(f"{proc.pid} ppid={proc.ppid()} {' '.join(proc.cmdline())[:160]}")
    return "\n".join(lines)


def _wait_until_gone(
    marker: str, places: list[str] | None = None, known: list[psutil.Process] | None = None
) -> list[psutil.Process]:
    """Poll until no process of the job is left, at most GONE_WAIT_S; returns what is left."""
    deadline = time.monotonic() + GONE_WAIT_S
    left = _left(marker, places, known)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _left(marker, places, known)
    return left


def _kill_leftovers(
    marker: str, places: list[str] | None = None, known: list[psutil.Process] | None = None
) -> None:
    for proc in _left(marker, places, known):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _reap(proc: subprocess.Popen[str]) -> None:
    """Collect the exit status of a killed child of this test (it would stay a zombie otherwise)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(GONE_WAIT_S)


# -- any parent: a ProcessGroup started from a thread, and an embedded Postgres -----------------

_PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from gyre.embedded import EmbeddedPostgres, ProcessGroup

    work = Path(sys.argv[1])
    started = {}

    def spawn():  # from a thread, as the supervisor restarts a service: no parent-death signal
        # a child that forks a grandchild into a session of its own (as Postgres backends and
        # sandboxed agents do), so only the guardian can know it belongs to us
        started["group"] = ProcessGroup(
            "sleeper",
            [sys.executable, "-c", "import os, time; os.fork() or os.setsid(); time.sleep(600)"],
            work / "sleeper.log",
        )
        server = EmbeddedPostgres(work / "postgres", durable=False)
        server.start()
        started["postgres"] = server

    thread = threading.Thread(target=spawn)
    thread.start()
    thread.join()
    print("READY", started["group"].pid, started["postgres"].pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_children_started_from_a_thread_die_with_their_parent_postgres_backends_included(
    tmp_path: Path, sig: signal.Signals
) -> None:
    marker = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path)],
        cwd=ROOT,
        env=_clean_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    known: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.startswith("READY"), line + parent.stdout.read()
        postmaster = int(line.split()[2])
        backends = psutil.Process(postmaster).children()
        assert backends, "Postgres runs its checkpointer, writer, ... as children of the postmaster"
        assert any(os.getpgid(b.pid) != postmaster for b in backends), "backends leave the group"
        known = _tree([parent.pid])
        before = _left(marker, known=known)
        assert len(before) >= 6, _describe(before)  # parent, guardian, sleeper x2, postmaster + children
        parent.send_signal(sig)
        _reap(parent)
        left = _wait_until_gone(marker, known=known)
        assert left == [], _describe(left)
    finally:
        if parent.poll() is None:
            parent.kill()
        _kill_leftovers(marker, known=known)


def test_a_parent_that_stops_its_children_leaves_its_guardian_nothing_to_do_and_it_exits(
    tmp_path: Path,
) -> None:
    marker = uuid.uuid4().hex
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from gyre.embedded import ProcessGroup
        from gyre.embedded.guardian import guardian

        group = ProcessGroup("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                             Path(sys.argv[1]) / "sleeper.log")
        print(guardian().pid, flush=True)
        group.stop(5.0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT,
        env=_clean_env(marker),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[0]) > 0
    left = _wait_until_gone(marker)
    assert left == [], _describe(left)


# -- gyre run and gyre up, killed after a supervisor restart ------------------------------------


def _places(run_dir: Path) -> list[str]:
    """Where a run's processes name their files: the run dir, and the Postgres cluster (which lives
    outside the run dir when we are root)."""
    places = [str(run_dir)]
    link = run_dir / "postgres" / "pgdata"
    if link.is_symlink():
        places.append(os.readlink(link))
    return places


def _endpoints(run_dir: Path) -> dict[str, object] | None:
    with contextlib.suppress(OSError, ValueError):
        data: dict[str, object] = json.loads((run_dir / "endpoints.json").read_text())
        return data
    return None


def _service_pid(run_dir: Path, service: str) -> int | None:
    endpoints = _endpoints(run_dir)
    if endpoints is None:
        return None
    services = endpoints["services"]
    assert isinstance(services, dict)
    entry = services.get(service)
    return int(entry["pid"]) if entry else None


def _wait_for(what: str, proc: subprocess.Popen[str], check: object) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while not check():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            output = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"{what} never happened (exit {proc.poll()}):\n{output[-4000:]}")
        time.sleep(0.5)


def _restart_one_service(run_dir: Path, launcher: subprocess.Popen[str], service: str) -> int:
    """SIGKILL `service` and wait until the supervisor's thread started it again; returns the new pid."""
    _wait_for("endpoints.json", launcher, lambda: _service_pid(run_dir, service) is not None)
    first = _service_pid(run_dir, service)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    _wait_for(
        f"a restart of {service}", launcher, lambda: _service_pid(run_dir, service) not in (None, first)
    )
    second = _service_pid(run_dir, service)
    assert second is not None and psutil.pid_exists(second)
    return second


@contextlib.contextmanager
def _launched(cmd: list[str], marker: str, run_dir: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_clean_env(marker), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        _reap(proc)
        _kill_leftovers(marker, _places(run_dir))


def _gyre(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())", *args]


def _trained_a_step(run_dir: Path) -> bool:
    """True once the job's event log holds a published weight version (the run is mid-run)."""
    with contextlib.suppress(OSError):
        return "WeightsPublishedEvent" in (run_dir / "events.jsonl").read_text()
    return False


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("command", ["run", "chaos"])
def test_a_job_killed_mid_run_after_a_supervisor_restart_leaves_no_process(
    tmp_path: Path, command: str, sig: signal.Signals
) -> None:
    """`gyre run` / `gyre chaos` on the quickstart: trajectory is SIGKILLed and restarted by the
    supervisor's thread, the job trains a step, then the command gets `sig`."""
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    args = ["--targets", "trajectory"] if command == "chaos" else []
    cmd = _gyre(command, "examples/quickstart.yaml", *args, "--steps", "50", "--run-dir", str(run_dir))
    with _launched(cmd, marker, run_dir) as job:
        restarted = _restart_one_service(run_dir, job, "trajectory")
        _wait_for("a trained step", job, lambda: _trained_a_step(run_dir))
        places = _places(run_dir)
        known = _tree([job.pid])
        assert any(p.pid == restarted for p in known)
        assert len(_left(marker, places, known)) >= 8  # launcher, guardian, nats, postgres+, 4 services
        job.send_signal(sig)
        _reap(job)
        left = _wait_until_gone(marker, places, known)
        assert left == [], _describe(left)
        if sig == signal.SIGTERM:  # a graceful stop: the launcher stopped everything itself
            output = job.stdout.read() if job.stdout else ""
            assert "stopping trajectory" in output, output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_gyre_up_killed_after_a_supervisor_restart_leaves_no_process(
    tmp_path: Path, sig: signal.Signals
) -> None:
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    light = {"services": ["scheduler", "trajectory"], "start_timeout_s": 240, "stop_grace_s": 20}
    config.write_text(yaml.safe_dump({"run_id": "orphans", "run_dir": str(run_dir), "launcher": light}))
    with _launched(_gyre("up", "--config", str(config)), marker, run_dir) as up:
        _restart_one_service(run_dir, up, "scheduler")
        places = _places(run_dir)
        known = _tree([up.pid])
        up.send_signal(sig)
        _reap(up)
        left = _wait_until_gone(marker, places, known)
        assert left == [], _describe(left)
        if sig == signal.SIGINT:
            assert up.returncode == 0, up.stdout.read() if up.stdout else ""
