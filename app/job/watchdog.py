"""The job's watchdog: a run that stops moving ends with the reason, never hangs silently.

Progress is anything that moves the run: a new weight version, a stored call's step event, a scored
or dropped group (the events the job's collector already folds into `RunTracker`). When none came
for `stall_timeout_s`, the watchdog asks every service what its loops wait on (Waits.GetWaits,
gyre/waits.py). A trainer in the middle of a step is busy, not stalled: the clock starts again.
Otherwise it is a stall: the waits are printed, written to `<run_dir>/stall.json` and into the
report's final stats, and the job ends with a reason that names them (`gyre run` exits 1), so a
stall is a failure everywhere a run is checked (tests, `gyre chaos`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.job.progress import RunTracker

STALL_NAME = "stall.json"
SERVICES = ("scheduler", "rollout", "trajectory", "trainer")


@dataclass
class Stall:
    """A stall the watchdog found: how long nothing moved and what each service waited on."""

    idle_s: float
    version: int
    waits: dict[str, list[dict[str, Any]] | str] = field(default_factory=dict)  # service -> waits | error
    found_unix_s: float = field(default_factory=time.time)  # when the watchdog found it

    def reason(self) -> str:
        """One line for the job's end reason: the idle time and every wait, service by service."""
        parts = []
        for service, waits in self.waits.items():
            if isinstance(waits, str):
                parts.append(f"{service}: {waits}")
            elif waits:
                parts.append(
                    f"{service}: " + "; ".join(f"{w['loop']} waits for {w['waiting_for']}" for w in waits)
                )
            else:
                parts.append(f"{service}: no wait")
        return (
            f"stalled: nothing advanced for {self.idle_s:.0f} s at weight version {self.version} "
            f"(no version, stored call or scored group) — " + " | ".join(parts)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "idle_s": round(self.idle_s, 1),
            "version": self.version,
            "found_unix_s": self.found_unix_s,
            "waits": self.waits,
        }


class Watchdog:
    """Watches a `RunTracker` for progress; `check` returns a Stall once nothing moved for too long."""

    def __init__(self, tracker: RunTracker, stall_timeout_s: float) -> None:
        self.tracker = tracker
        self.stall_timeout_s = stall_timeout_s
        self._mark = self._progress()
        self._since = time.monotonic()

    def _progress(self) -> tuple[int, int, int, int]:
        t = self.tracker
        return (t.version, t.num_steps_seen, len(t.rewards), t.groups_dropped)

    def idle_s(self) -> float:
        """Seconds since the last progress (updates the mark first)."""
        mark = self._progress()
        if mark != self._mark:
            self._mark, self._since = mark, time.monotonic()
        return time.monotonic() - self._since

    async def check(self, endpoints: Any) -> Stall | None:
        """None while the run moves (or the trainer is busy in a step); else the stall and its waits."""
        if self.stall_timeout_s <= 0:
            return None
        idle = self.idle_s()
        if idle < self.stall_timeout_s:
            return None
        waits = await ask_all(endpoints)
        trainer = waits.get("trainer")
        if isinstance(trainer, list) and any(w["loop"] == "train" for w in trainer):
            self._since = time.monotonic()  # a long step: busy, not stalled
            return None
        return Stall(idle, self.tracker.version, waits)


async def ask_all(endpoints: Any) -> dict[str, list[dict[str, Any]] | str]:
    """Every service's waits (a service that does not answer: the error, in words)."""
    from google.protobuf import json_format

    from gyre.waits import ask_waits

    out: dict[str, list[dict[str, Any]] | str] = {}
    for name in SERVICES:
        service = endpoints.services.get(name)
        if service is None:
            continue
        try:
            reply = await ask_waits(service.grpc_address)
            out[name] = [
                json_format.MessageToDict(
                    w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                )
                for w in reply.waits
            ]
        except Exception as exc:  # a dead or hung service is part of the answer
            out[name] = f"no answer ({type(exc).__name__}: {exc})"
    return out


def record(stall: Stall, run_dir: Path) -> Path:
    """Write the stall to `<run_dir>/stall.json`; returns the path."""
    path = run_dir / STALL_NAME
    path.write_text(json.dumps(stall.to_json(), indent=2) + "\n")
    return path
