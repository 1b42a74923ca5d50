"""A run's faults and recoveries, read from its run directory: what the report's device plot and the
dashboard's lanes mark, and report.md's "Faults and recoveries" table.

Sources, each optional (a run without them had no fault):

    final_stats.json  launcher.restart_events   every restart by the launcher's supervisor
                                                (app.launcher.process.RestartRecord; "nats" and
                                                "postgres" for the embedded servers)
                      launcher.gave_up          services it stopped restarting, and why
    chaos.json        faults (`gyre chaos`) or kills (`gyre chaos --soak`): what was injected, when
    stall.json        the job watchdog's stall (else final_stats.json's "watchdog"): found_unix_s is
                      when it was found (a file written before that field: its modification time)

Times are seconds since t0, the run's first event (`RunAnalysis.start_unix_s`). An injected fault is
matched to the first unmatched restart of its target that exited at most `MATCH_SLACK_S` before it
(the supervisor sees a process gone shortly after the kill); an engine fault has no restart (the
rollout process lives), and a restart no injection explains (a crash, or a service whose connection
broke when Postgres went down) is a fault of its own.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FINAL_STATS_NAME = "final_stats.json"
CHAOS_NAME = "chaos.json"
STALL_NAME = "stall.json"  # app.job.watchdog.STALL_NAME (not imported: the watchdog pulls in the job)
MATCH_SLACK_S = 1.0


@dataclass(frozen=True)
class Restart:
    """One supervisor restart: the process gone at `exited_s`, serving again at `serving_s`."""

    service: str
    exited_s: float
    serving_s: float | None  # None: it never served again
    exit_code: int | None  # negative: killed by that signal; None: not known (embedded servers)
    error: str = ""  # why the restart failed, if it did

    @property
    def recovery_s(self) -> float | None:
        return None if self.serving_s is None else self.serving_s - self.exited_s

    @property
    def ended(self) -> str:
        """How the process ended, in words: "SIGKILL", "exit 1", or "" when not known."""
        if self.exit_code is None:
            return ""
        if self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        return f"exit {self.exit_code}"


@dataclass(frozen=True)
class InjectedFault:
    """One fault `gyre chaos` injected, and the supervisor restart it caused (None: none, e.g. an
    engine fault, or a kill that found no restart)."""

    target: str
    injected_s: float
    recovered: bool
    recovery_s: float | None  # injection -> target back (as chaos.json says)
    restart: Restart | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stall:
    """The watchdog's stall: nothing advanced from `started_s` until it was found at `found_s`."""

    started_s: float
    found_s: float
    version: int


@dataclass(frozen=True)
class Mark:
    """One fault on a timeline: a line at `t_s` and a span until `until_s` (None: never back)."""

    kind: str  # "fault" | "stall"
    label: str  # the service (or target) it hit
    t_s: float
    until_s: float | None
    what: str  # one line for a table or a tooltip

    @property
    def recovered_after_s(self) -> float | None:
        return None if self.until_s is None else self.until_s - self.t_s


@dataclass
class RunFaults:
    restarts: list[Restart] = field(default_factory=list)
    injected: list[InjectedFault] = field(default_factory=list)
    stall: Stall | None = None
    gave_up: dict[str, str] = field(default_factory=dict)  # service -> why no more restarts

    def marks(self) -> list[Mark]:
        """Every fault once, by time: each injected fault (spanning to its target's recovery), each
        restart no injection explains, and the stall."""
        out: list[Mark] = []
        for f in self.injected:
            until = f.injected_s + f.recovery_s if f.recovered and f.recovery_s is not None else None
            out.append(Mark("fault", f.target, f.injected_s, until, _injected_what(f, until)))
        matched = {id(f.restart) for f in self.injected if f.restart is not None}
        for r in self.restarts:
            if id(r) in matched:
                continue
            how = f" ({r.ended})" if r.ended else ""
            back = (
                ""
                if r.serving_s is not None
                else ", never served again" + (f" ({r.error})" if r.error else "")
            )
            what = f"{r.service} exited{how}, restarted by the supervisor{back}"
            out.append(Mark("fault", r.service, r.exited_s, r.serving_s, what))
        if self.stall is not None:
            s = self.stall
            out.append(
                Mark(
                    "stall",
                    "stall",
                    s.started_s,
                    None,
                    f"stall: nothing advanced for {s.found_s - s.started_s:.0f} s at weight version "
                    f"{s.version}; the watchdog ended the job at {s.found_s:.1f} s",
                )
            )
        return sorted(out, key=lambda m: m.t_s)


def _injected_what(f: InjectedFault, until: float | None) -> str:
    if f.target == "engine":
        engine, held = f.detail.get("engine_killed"), f.detail.get("requests_held")
        hit = f"engine {engine} failed" + (f" holding {held} requests" if held is not None else "")
        what = f"{hit if engine else 'engine fault'} (injected by gyre chaos)"
    else:
        how = f" ({f.restart.ended})" if f.restart is not None and f.restart.ended else ""
        verb = "shut down (fast)" if f.target == "postgres" else "killed"
        what = f"{f.target} {verb} by gyre chaos{how}"
    return what if until is not None else f"{what}, NOT recovered"


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _time(x: Any, t0: float) -> float | None:
    try:
        t = float(x)
    except (TypeError, ValueError):
        return None
    return t - t0 if math.isfinite(t) and t > 0 else None


def _restarts(events: list[dict[str, Any]], t0: float) -> list[Restart]:
    out = []
    for e in events:
        exited = _time(e.get("exited_at"), t0)
        if exited is None:
            continue
        code = e.get("exit_code")
        out.append(
            Restart(
                str(e.get("service", "?")),
                exited,
                _time(e.get("serving_at"), t0),
                int(code) if isinstance(code, int | float) else None,
                str(e.get("error") or ""),
            )
        )
    return sorted(out, key=lambda r: r.exited_s)


def _serves(target: str, service: str) -> bool:
    return service == target or (target == "nats-node" and service.startswith("nats-n"))


def _injected(chaos: dict[str, Any], restarts: list[Restart], t0: float) -> list[InjectedFault]:
    """chaos.json's faults (`gyre chaos`) or kills (`--soak`: "confirmed" is its recovered)."""
    out: list[InjectedFault] = []
    taken: set[int] = set()
    for f in chaos.get("faults") or chaos.get("kills") or []:
        at = _time(f.get("injected_at"), t0)
        if at is None:  # planned, never made
            continue
        target = str(f.get("target", "?"))
        restart = next(
            (
                r
                for r in restarts
                if id(r) not in taken and _serves(target, r.service) and r.exited_s >= at - MATCH_SLACK_S
            ),
            None,
        )
        if restart is not None:
            taken.add(id(restart))
        recovered = bool(f["recovered"] if "recovered" in f else f.get("confirmed"))
        rec = f.get("recovery_s")
        out.append(
            InjectedFault(
                target,
                at,
                recovered,
                float(rec) if isinstance(rec, int | float) else None,
                restart,
                dict(f.get("detail") or {}),
            )
        )
    return out


def _stall(run_dir: Path, final_stats: dict[str, Any], t0: float) -> Stall | None:
    path = run_dir / STALL_NAME
    found_in = path if path.is_file() else run_dir / FINAL_STATS_NAME
    info = _load(path) or final_stats.get("watchdog") or {}
    if not info or not found_in.is_file():
        return None
    # found_unix_s: when the watchdog found it (app/job/watchdog.py); older files: their write time
    found = float(info.get("found_unix_s") or found_in.stat().st_mtime) - t0
    return Stall(found - float(info.get("idle_s", 0.0)), found, int(info.get("version", 0)))


def read_faults(run_dir: Path, t0: float) -> RunFaults:
    """The faults and recoveries of the run in `run_dir` (module docstring), times since `t0`."""
    final_stats = _load(run_dir / FINAL_STATS_NAME)
    launcher = final_stats.get("launcher") or {}
    restarts = _restarts(list(launcher.get("restart_events") or []), t0)
    return RunFaults(
        restarts,
        _injected(_load(run_dir / CHAOS_NAME), restarts, t0),
        _stall(run_dir, final_stats, t0),
        {str(k): str(v) for k, v in (launcher.get("gave_up") or {}).items()},
    )


def faults_markdown(faults: RunFaults) -> list[str]:
    """report.md's "Faults and recoveries" section."""
    lines = [
        "## Faults and recoveries",
        "",
        "Every supervisor restart (final_stats.json), every fault `gyre chaos` injected (chaos.json) "
        "and the watchdog's stall (stall.json), seconds since the run's first event; the device plot "
        "marks each with a red line and shades it until its target served again.",
        "",
    ]
    marks = faults.marks()
    if not marks:
        lines += ["None: no restart, no injected fault, no stall.", ""]
    else:
        lines += ["| t (s) | what | recovered after (s) |", "|---:|---|---:|"]
        for m in marks:
            after = m.recovered_after_s
            lines.append(f"| {m.t_s:.1f} | {m.what} | {'never' if after is None else f'{after:.1f}'} |")
        lines.append("")
    if faults.gave_up:
        lines += [
            "The supervisor gave up on: "
            + "; ".join(f"{svc} ({why})" for svc, why in sorted(faults.gave_up.items())),
            "",
        ]
    return lines
