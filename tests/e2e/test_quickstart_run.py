"""End to end: `gyre run` on the quickstart config, shortened, with every service in its own process.

Nothing is faked: embedded NATS and Postgres, the four service processes, the real model and
environment. Checks that the run completes and that what it produced is consistent:
- every step event the rollout published is stored by the trajectory service (GetStats at the end
  vs the distinct step events recorded from NATS);
- every trained path was scored (trained paths <= paths of scored groups; scored groups on NATS
  match the trajectory service's count);
- weight versions are published in strictly increasing order, up to the trainer's own version;
- report.md, summary.json and the plots exist, with reward_first20 / reward_last20;
- the TensorBoard event file, the offline W&B run and the MLflow run that `job.tracking` wrote
  each read back the report's reward series;
- the dashboard (`gyre ui`, a real server process) in a real headless Chromium draws one device
  lane per device of the pool and every node the trajectory store holds for a group; its
  screenshots go to docs/img/ when GYRE_DOC_SCREENSHOTS=1 (docs/quickstart.md, "Dashboard").
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.job.eventlog import read_events
from tests.helpers.browser import dump_dom, require_chromium, screenshot, screenshot_element

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler", "trajectory", "trainer", "rollout")
E2E_STEPS = 3
SINKS = ("tensorboard", "wandb", "mlflow")
DOC_IMAGES = ROOT / "docs" / "img"


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path_factory.mktemp("e2e") / "quickstart"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("GYRE_") and k != "WANDB_API_KEY"
    }  # embedded servers, not the fixtures'
    env["GYRE_JOB__TRACKING"] = f"[{', '.join(SINKS)}]"  # what `job.tracking` in the YAML turns on
    env["WANDB_MODE"] = "offline"
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
    """`gyre ui` over the finished run (its app, served in-process, no browser; the browser test
    below loads the real server in Chromium): the device lanes are the pool, and a group's page
    draws exactly the nodes the trajectory store holds for it (`store_num_nodes`, counted by SQL at
    export, not from the rebuilt view)."""
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


def _finite_curve(curve: list[float | None]) -> list[tuple[int, float]]:
    """(step, reward) of the report's curve where a step has a reward (its index is the step)."""
    return [(step, x) for step, x in enumerate(curve) if x is not None and math.isfinite(x)]


def test_the_run_wrote_tensorboard_wandb_and_mlflow_runs_whose_reward_series_is_the_reports(
    quickstart_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """`job.tracking: [tensorboard, wandb, mlflow]` (set by the fixture's environment): each
    format's own reader gets back the reward per trainer step of summary.json."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gyre.tracking import sink_dir
    from gyre.tracking.mlflow_sink import tracking_uri
    from gyre.tracking.wandb_reader import complete_run_log, history_rows

    proc, run_dir = quickstart_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"tracking: {', '.join(SINKS)} under" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    want = _finite_curve(summary["reward_curve"])
    assert want, "the report has no reward"

    acc = EventAccumulator(str(sink_dir(run_dir, "tensorboard")))
    acc.Reload()
    tensorboard = [(e.step, e.value) for e in acc.Scalars("learning/reward")]
    assert [s for s, _ in tensorboard] == [s for s, _ in want]
    assert [v for _, v in tensorboard] == pytest.approx([v for _, v in want], rel=1e-6)  # float32
    live = {tag.split("/")[0] for tag in acc.Tags()["scalars"]}
    assert {"trainer", "devices"} <= live  # the series logged while the run went on

    rows = history_rows(complete_run_log(sink_dir(run_dir, "wandb")))
    wandb = [(r["learning/step"], r["learning/reward"]) for r in rows if "learning/reward" in r]
    assert wandb == want

    client = MlflowClient(tracking_uri=tracking_uri(sink_dir(run_dir, "mlflow")))
    experiment = client.get_experiment_by_name("gyre")  # job.tracking_project's default
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == summary["run_id"]
    history = client.get_metric_history(run.info.run_id, "learning/reward")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == want


@pytest.fixture
def dashboard(quickstart_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path) -> Iterator[str]:
    """`gyre ui RUN_DIR --port 0` as its own process, until the test ends: its base URL (the test
    skips first, saying why, where there is no Chromium to look at it with)."""
    require_chromium()
    proc, run_dir = quickstart_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    out, err = tmp_path / "ui.out", tmp_path / "ui.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from app.cli import main; sys.exit(main())",
                "ui",
                str(run_dir),
                "--port",
                "0",
            ],
            cwd=ROOT,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            found = re.search(r"gyre ui: (http://127\.0\.0\.1:\d+/)", out.read_text())
            if found:
                url = found.group(1)
            elif server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"gyre ui did not start (exit {server.poll()}):\n{err.read_text()[-4000:]}")
            else:
                time.sleep(0.2)
        while True:  # it printed its address before serving; wait until it answers
            try:
                urllib.request.urlopen(url, timeout=2)
            except urllib.error.HTTPError:
                break  # 401 without the key: it is serving
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"gyre ui does not answer at {url}:\n{err.read_text()[-4000:]}")
                time.sleep(0.2)
            else:
                pytest.fail(f"gyre ui served {url} without the key")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} holds {len(data)} bytes: a blank page?"


def test_in_a_real_browser_the_dashboard_shows_one_lane_per_device_and_every_stored_node_of_a_group(
    quickstart_run: tuple[subprocess.CompletedProcess[str], Path], dashboard: str, tmp_path: Path
) -> None:
    """The real `gyre ui` server in headless Chromium (the DOM after its script ran): the overview
    draws the reward curve with the report's points and one lane per device of the pool; the page
    of the group with the most nodes draws as many tree nodes as the trajectory store holds for it.
    Screenshots of both go to the test's directory, and to docs/img/ with GYRE_DOC_SCREENSHOTS=1."""
    import yaml

    from app.ui.data import read_trees
    from app.ui.server import run_key

    _, run_dir = quickstart_run
    key, _ = run_key(run_dir)
    locked = dump_dom(dashboard)  # a fresh profile: no cookie yet
    assert "<h2>Key needed</h2>" in locked and '<g class="lane"' not in locked

    overview = dump_dom(f"{dashboard}?key={key}")  # sets the cookie, redirects to the overview
    pool = int(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["num_devices"])
    lanes = overview.count('<g class="lane"')
    assert lanes == pool
    assert f'data-devices="{pool}"' in overview
    summary = json.loads((run_dir / "summary.json").read_text())
    reward = re.search(r'<svg class="chart" data-chart="reward" data-points="(\d+)"', overview)
    assert reward is not None, "no reward chart on the overview"
    finite = len(_finite_curve(summary["reward_curve"]))
    assert finite > 0
    assert f'data-series="reward" data-points="{finite}"' in overview

    trees = read_trees(run_dir)
    assert trees, "the run exported no trees"
    group_id, group = max(trees.items(), key=lambda kv: len(kv[1]["nodes"]))
    page = dump_dom(f"{dashboard}groups/{group_id}?key={key}")
    drawn = len(re.findall(r'<g class="tree-node[^"]*" data-node-id=', page))
    assert drawn == group["store_num_nodes"] > 1
    assert f'<b id="store-num-nodes">{group["store_num_nodes"]}</b>' in page
    print(f"browser: {lanes} lanes (pool {pool}); group {group_id}: {drawn} nodes drawn")

    shots = {  # the overview's curves and lanes, the lanes alone, and the group's tree (whole at 1600)
        "ui_overview.png": screenshot(f"{dashboard}?key={key}", tmp_path / "ui_overview.png", 1280, 1000),
        "ui_lanes.png": screenshot_element(
            f"{dashboard}?key={key}", "#lanes", tmp_path / "ui_lanes.png", width=1280, height=1000
        ),
        "ui_group_tree.png": screenshot(
            f"{dashboard}groups/{group_id}?key={key}", tmp_path / "ui_group_tree.png", 1600, 1000
        ),
    }
    for path in shots.values():
        _assert_png(path)
    if os.environ.get("GYRE_DOC_SCREENSHOTS") == "1":
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        for name, path in shots.items():
            shutil.copyfile(path, DOC_IMAGES / name)
