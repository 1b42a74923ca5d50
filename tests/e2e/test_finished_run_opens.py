"""End to end: a finished run opens from its directory alone. `gyre run` on the quickstart config
(embedded NATS and Postgres, every service in its own process), shortened, with an environment
override of the run id and of the trajectory's batch size; then, with the run's Postgres stopped:

- RUN_DIR/config.yaml is the effective configuration: the environment's run id and override in it;
- `gyre trajectory export RUN_DIR --execution X` (no other flag) starts the run's stopped embedded
  Postgres itself, returns every call of the execution, and stops it again;
- `gyre ui`'s trees come back from the same database when trees.jsonl is gone (app/ui/server.py
  ensure_trees), and again nothing is left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.job.eventlog import read_events
from app.ui.server import ensure_trees
from gyre.embedded.postgres import postgres_running

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GYRE = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())"]


def test_a_finished_run_is_read_back_from_its_directory_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(GYRE_RUN_ID="opens-again", GYRE_TRAJECTORY__BATCH_MAX_WAIT_S="0.5")
    proc = subprocess.run(
        [*GYRE, "run", "examples/quickstart.yaml", "--steps", "2", "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert not postgres_running(run_dir / "postgres")  # the run stopped its Postgres

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run_id"] == "opens-again"
    assert config["trajectory"]["batch_max_wait_s"] == 0.5
    assert config["job"]["num_steps"] == 2 and config["run_dir"] == str(run_dir.resolve())

    ended = [
        r["event"]
        for r in read_events(run_dir / "events.jsonl")
        if r["type"] == "ExecutionEvent" and r["event"].get("kind") not in (None, "KIND_STARTED")
    ]
    execution = ended[0]["execution_id"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}  # the directory alone
    out = subprocess.run(
        [*GYRE, "trajectory", "export", str(run_dir), "--execution", execution],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    exported = json.loads(out.stdout)
    assert exported["execution_id"] == execution
    assert len(exported["calls"]) == int(ended[0].get("num_calls", 0)) > 0
    assert all(c["prompt_token_ids"] and c["completion_token_ids"] for c in exported["calls"])
    assert not postgres_running(run_dir / "postgres")  # started for the export, stopped after

    trees = run_dir / "trajectory" / "trees.jsonl"
    before = trees.read_text()
    trees.unlink()
    assert ensure_trees(run_dir) == trees and trees.read_text() == before
    assert not postgres_running(run_dir / "postgres")
    print(f"exported {len(exported['calls'])} calls of {execution}; trees rebuilt ({len(before)} bytes)")
