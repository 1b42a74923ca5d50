"""A SYNTHETIC run directory's fault files, as `gyre chaos` leaves them (app/job/faults.py reads them):
final_stats.json's supervisor restarts, chaos.json's injected faults and the watchdog's stall.json.

What they say, in seconds after `t0`:

    10.0   scheduler SIGKILLed by chaos (injected 9.9), exit seen at 10.0, serving at 11.5
    20.0   engine fault injected (no restart: the rollout process lives), recovered after 3.0 s
    30.0   postgres shut down by chaos, exit seen 30.1 (code unknown), serving at 30.7; the scheduler,
           whose pool broke, exited 1 at 30.8 and served at 32.0 (a restart no injection explains)
    40.0   trainer exited 1 on its own; its restart never served (budget spent: gave up)
    50.0   the watchdog's stall: nothing advanced for 8 s when it was found at 58.0
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _restart(service: str, exit_code: int | None, exited: float, serving: float | None) -> dict[str, Any]:
    return {
        "service": service,
        "exit_code": exit_code,
        "exited_at": exited,
        "restarted_at": exited + 0.5,
        "serving_at": serving,
        "recovery_s": None if serving is None else serving - exited,
        "backoff_s": 0.5,
        "error": "" if serving is not None else "did not report SERVING",
    }


def write_fault_files(run_dir: Path, t0: float, *, stall: bool = True) -> None:
    """final_stats.json (launcher restarts), chaos.json (faults) and, with `stall`, stall.json."""
    events = [
        _restart("scheduler", -9, t0 + 10.0, t0 + 11.5),
        _restart("postgres", None, t0 + 30.1, t0 + 30.7),
        _restart("scheduler", 1, t0 + 30.8, t0 + 32.0),
        _restart("trainer", 1, t0 + 40.0, None),
    ]
    launcher = {
        "restarts": {"scheduler": 2, "postgres": 1, "trainer": 1},
        "num_restarts": 4,
        "gave_up": {"trainer": "5 restarts in 300 s"},
        "restart_events": events,
    }
    (run_dir / "final_stats.json").write_text(json.dumps({"launcher": launcher}))

    def fault(target: str, at: float, recovery_s: float, **detail: Any) -> dict[str, Any]:
        return {
            "target": target,
            "injected_at": t0 + at,
            "recovered": True,
            "recovery_s": recovery_s,
            "restarts": [],
            "detail": detail,
        }

    faults = [
        fault("scheduler", 9.9, 1.7),
        fault("engine", 20.0, 3.0, engine_killed="rollout-0-e1", requests_held=4),
        fault("postgres", 30.0, 2.1),
        {"target": "trainer", "injected_at": 0.0},  # planned, never made: not a fault
    ]
    (run_dir / "chaos.json").write_text(json.dumps({"faults": faults}))
    if stall:
        path = run_dir / "stall.json"
        path.write_text(json.dumps({"idle_s": 8.0, "version": 4, "waits": {}}))
        os.utime(path, (t0 + 58.0, t0 + 58.0))  # found then: the file's time is the stall's
