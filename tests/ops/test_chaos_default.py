"""The `gyre chaos --json` a user tries first, exactly as shipped: the quickstart, every default
target killed in turn (scheduler, rollout, trajectory, trainer, nats, postgres).

It once stalled at weight version 19 after the Postgres restart (groups dropped untrained kept their
admission slots: services/rollout/executions.py). The job's watchdog now ends a stalled run with the
services' waits (app/job/watchdog.py), so a stall fails here with its reason instead of a timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.chaos_counts import LOSS_COUNTERS
from app.chaos_faults import DEFAULT_TARGETS
from tests.ops.test_chaos import run_chaos

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_default_chaos_run_completes_every_fault_recovered_nothing_lost_no_stall(tmp_path: Path) -> None:
    proc = run_chaos(["--json", "--run-dir", str(tmp_path / "chaos")], tmp_path, timeout_s=1500)
    assert proc.stdout.strip(), f"gyre chaos printed no result; stderr ends:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert not result["end_reason"].startswith("stalled"), result["end_reason"]
    assert result["completed"], f"{result['end_reason']}\n{proc.stderr[-4000:]}"
    assert [f["target"] for f in result["faults"]] == list(DEFAULT_TARGETS)
    assert all(f["recovered"] for f in result["faults"]), result["faults"]
    for counter in LOSS_COUNTERS:
        assert result[counter] == 0, (counter, result[counter])
    assert result["trainer_bitwise_equal"]
    assert result["ok"] and proc.returncode == 0
    assert not (tmp_path / "chaos" / "stall.json").exists()
