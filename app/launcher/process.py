"""One service as its own OS process group, with a log file, a readiness line and a clean stop.

The process handling is the one runner of Gyre, `gyre.embedded.process.ProcessGroup` (its own
session and process group, output to the log file, the guardian's SIGTERM if the launcher dies, a
stop that leaves no process of the group or of its descendants behind); see its module docstring
for the guarantees.
This module adds what only a service has: its readiness line (GYRE_READY) read from the log, and
the restart policy of the supervisor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gyre.embedded.process import ProcessGroup

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


class ServiceProcess(ProcessGroup):
    """A started service process (see the module docstring for the guarantees): a
    `gyre.embedded.process.ProcessGroup` that also reads the service's log and its readiness line."""

    def __init__(self, name: str, cmd: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        super().__init__(name, cmd, log_path, env=env)

    def log_text(self) -> str:
        """What the service wrote since this start."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
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
