"""One service as its own OS process group, with a log file, a readiness line and a clean stop.

Guarantees:

* the service leads its own session and process group (pgid == pid), so a terminal's Ctrl-C
  reaches only the launcher, and stopping the group reaches every process the service spawned;
* stdout and stderr go to the log file, never through a pipe to the launcher, so a busy or dead
  launcher can never block a service on a full pipe;
* `stop()` sends SIGTERM to the group, waits `grace_s`, SIGKILLs what is left of the group and of
  the service's descendants (also those that left the group), and reaps the process. Idempotent.
* started from the main thread on Linux, the service gets SIGTERM if the launcher dies (even by
  SIGKILL), so a killed launcher does not leave a running deployment behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

_PR_SET_PDEATHSIG = 1
READY_LINE = re.compile(r"^GYRE_READY (?P<name>\S+) (?P<grpc_port>\d+) (?P<metrics_port>\d+)\s*$", re.M)


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervisor starts an exited process again: after `backoff_s(n)` seconds for the n-th
    restart within `window_s` (exponential from `initial_backoff_s`, at most `max_backoff_s`), and
    only while fewer than `max_restarts` restarts happened within `window_s`."""

    max_restarts: int = 5
    window_s: float = 600.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def backoff_s(self, nth: int) -> float:
        """Seconds to wait before restart number `nth` (1-based) of the current window."""
        return float(min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, nth - 1)))

    def allows(self, recent_restarts: int) -> bool:
        """True while the budget has room for one more restart."""
        return recent_restarts < self.max_restarts


@dataclass
class RestartRecord:
    """One restart done by a supervisor (times in seconds since the Unix epoch)."""

    service: str  # service name, or "nats" / "postgres" for an embedded server
    exit_code: int | None  # how the previous process ended (negative: killed by that signal)
    exited_at: float  # when the supervisor saw it gone
    backoff_s: float  # waited before starting it again
    restarted_at: float = 0.0  # when the new process was spawned
    serving_at: float | None = None  # when it was ready again (gRPC health SERVING / accepting clients)
    error: str = ""  # why the restart failed, if it did

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the exit being seen to serving again; None if it never served again."""
        return None if self.serving_at is None else self.serving_at - self.exited_at


@dataclass(frozen=True)
class Ready:
    """What a service announced on its GYRE_READY line."""

    grpc_port: int
    metrics_port: int


def _parent_death_signal() -> Callable[[], None] | None:
    # PDEATHSIG follows the *thread* that forked; only the main thread lives as long as the launcher.
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None

    def _set() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return _set


class ServiceProcess:
    """A started service process (see the module docstring for the guarantees)."""

    def __init__(self, name: str, cmd: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] | None = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self._log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self._log_offset = self._log.tell()
        self._proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            list(cmd),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once the process ended (negative: killed by that signal), None while it runs."""
        return self._proc.poll()

    def log_text(self) -> str:
        """What the service wrote since this start."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def ready(self) -> Ready | None:
        """The GYRE_READY announcement if the service printed it (for this name), else None."""
        for match in READY_LINE.finditer(self.log_text()):
            if match["name"] == self.name:
                return Ready(int(match["grpc_port"]), int(match["metrics_port"]))
        return None

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, SIGKILL after `grace_s`, reap; returns the exit status. Idempotent."""
        children = self.descendants()
        if self._proc.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self._proc.wait()
        # The leader is gone; whatever is left of its group or its descendants goes too.
        if _group_alive(self.pid):
            _signal_group(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + min(grace_s, 5.0)
            while _group_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_group(self.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=5.0)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """True while some process (not a zombie) is still in process group `pgid`."""
    for proc in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) == pgid:
                return True
    return False
