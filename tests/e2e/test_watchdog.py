"""End to end: a run that stops moving ends with the watchdog's reason instead of hanging.

A real `gyre run` of the quickstart whose rollout starts no execution (`rollout.num_tasks` 0, and no
job driver starting any): nothing can ever advance. The job must end on its own well before its
timeout, exit 1, and name what each service waited on (Waits.GetWaits of the real services), in its
end reason, in `stall.json` and in the report's final stats.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_where_nothing_advances_ends_with_the_waits_of_every_service(tmp_path: Path) -> None:
    run_dir = tmp_path / "stalled"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}  # embedded servers
    env["GYRE_ROLLOUT__NUM_TASKS"] = "0"  # no execution ever starts
    env["GYRE_JOB__STALL_TIMEOUT_S"] = "8"
    env["GYRE_JOB__TIMEOUT_S"] = "900"  # the watchdog, not the timeout, must end it
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from app.cli import main; sys.exit(main())",
            "run",
            "examples/quickstart.yaml",
            "--steps",
            "2",
            "--run-dir",
            str(run_dir),
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, f"expected a stalled run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert not outcome["completed"]
    assert outcome["reason"].startswith("stalled: nothing advanced"), outcome["reason"]
    stall = json.loads((run_dir / "stall.json").read_text())
    assert set(stall["waits"]) == {"scheduler", "rollout", "trajectory", "trainer"}
    # The trainer waits for a device (Elastic lends none while nothing is scored) or for a batch.
    trainer = {w["loop"]: w["waiting_for"] for w in stall["waits"]["trainer"]}
    assert "a TRAIN device" in trainer.get("devices", "") or "a batch for step 1" in trainer.get("pull", "")
    rollout = {w["loop"]: w["waiting_for"] for w in stall["waits"]["rollout"]}
    assert rollout["executions"].startswith("no live execution"), rollout
    assert "rollout: executions waits for no live execution" in outcome["reason"]
    final = json.loads((run_dir / "final_stats.json").read_text())
    assert final["watchdog"]["waits"] == stall["waits"]
