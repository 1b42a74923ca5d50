"""End to end: `gyre run` on the quickstart config, shortened, with every service in its own process.

Nothing is faked: embedded NATS and Postgres, the four service processes, the real model and
environment. Checks that the run completes and that what it produced is consistent:
- every step event the rollout published is stored by the trajectory service (GetStats at the end
  vs the distinct step events recorded from NATS);
- every trained path was scored (trained paths <= paths of scored groups; scored groups on NATS
  match the trajectory service's count);
- weight versions are published in strictly increasing order, up to the trainer's own version;
- report.md, summary.json and the plots exist, with reward_first20 / reward_last20.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.job.eventlog import read_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler", "trajectory", "trainer", "rollout")
E2E_STEPS = 3


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path_factory.mktemp("e2e") / "quickstart"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("GYRE_")
    }  # embedded servers, not the fixtures'
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from app.cli import main; sys.exit(main())",
            "run",
            "examples/quickstart.yaml",
            "--steps",
            str(E2E_STEPS),
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    return proc, run_dir


def test_quickstart_run_completes_with_consistent_events_trees_and_weights(
    quickstart_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = quickstart_run
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "reward_first20" in proc.stdout and "reward_last20" in proc.stdout

    records = read_events(run_dir / "events.jsonl")
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r["event"])
    stats = json.loads((run_dir / "final_stats.json").read_text())

    # every step seen on NATS is stored by the trajectory service
    step_ids = {ev["event_id"] for ev in by_type.get("StepEvent", [])}
    assert step_ids, "the run published no steps"
    trajectory = stats["trajectory"]["values"]
    assert int(trajectory["stored_calls"]) == len(step_ids), (trajectory, len(step_ids))  # rows in Postgres
    assert int(trajectory.get("steps_rejected", 0)) == 0

    # every trained path was scored: the trainer trains only batches of scored groups, so the paths
    # it reports trained cannot outnumber the paths of the groups scored on NATS
    scored_paths = sum(int(ev.get("num_paths", 0)) for ev in by_type.get("GroupScoredEvent", []))
    trained_paths = sum(
        int(float(ev.get("metrics", {}).get("num_paths", 0)))
        for ev in by_type.get("WeightsPublishedEvent", [])
    )
    assert trained_paths > 0, "no path was trained"
    assert trained_paths <= scored_paths, (trained_paths, scored_paths)
    assert int(trajectory["groups_scored"]) == len({ev["group_id"] for ev in by_type["GroupScoredEvent"]})

    # weight versions only grow, and the trainer's latest is the last one published
    versions = [int(ev["weights"]["version"]) for ev in by_type.get("WeightsPublishedEvent", [])]
    assert versions and versions == sorted(set(versions)), versions
    assert versions[-1] >= E2E_STEPS
    assert int(stats["trainer"]["latest_weights"]["version"]) == versions[-1]

    # the report
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] >= E2E_STEPS
    # both windows are reported with their intervals (in a 3-step run the last window may be empty:
    # the trainer can publish its last versions faster than executions end)
    assert summary["reward_first20"]["n"] > 0
    assert set(summary["reward_last20"]) == {"mean", "low", "high", "n"}
    text = (run_dir / "report.md").read_text()
    assert "reward_first20" in text and "reward_last20" in text
    for name in ("reward", "device_roles", "tree_dedup", "staleness", "time_breakdown"):
        assert (run_dir / "plots" / f"{name}.png").is_file()


def test_the_dashboard_of_the_run_draws_one_lane_per_device_and_every_stored_node_of_a_group(
    quickstart_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """`gyre ui` over the finished run (its app, served in-process; no browser on CI machines): the
    device lanes are the pool, and a group's page draws exactly the nodes the trajectory store holds
    for it (`store_num_nodes`, counted by SQL at export, not from the rebuilt view)."""
    import re

    import yaml
    from starlette.testclient import TestClient

    from app.ui.data import read_trees
    from app.ui.server import create_app, run_key

    proc, run_dir = quickstart_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    key, key_path = run_key(run_dir)
    client = TestClient(create_app(run_dir, key, key_path))
    assert client.get("/").status_code == 401  # the key is needed
    overview = client.get(f"/?key={key}")  # sets the cookie and redirects
    assert overview.status_code == 200
    pool = int(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["num_devices"])
    assert overview.text.count('<g class="lane"') == pool
    assert f'data-devices="{pool}"' in overview.text

    trees = read_trees(run_dir)
    assert trees, "the run exported no trees"
    group_id, group = max(trees.items(), key=lambda kv: len(kv[1]["nodes"]))
    page = client.get(f"/groups/{group_id}")
    assert page.status_code == 200
    drawn = len(re.findall(r'<g class="tree-node[^"]*" data-node-id=', page.text))
    assert drawn == group["store_num_nodes"] == len(group["nodes"]) > 1
