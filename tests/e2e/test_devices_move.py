"""End to end: devices really move between rollout and training in a running job.

`gyre run examples/quickstart.yaml --policy P --steps N`, every service its own process, embedded
NATS and Postgres, the real model, engines and trainer (nothing faked). From the run's event log
and final service counters:
- colocate: devices go rollout -> train -> rollout (the whole pool alternates, by definition);
- elastic: devices go rollout -> train -> rollout too, by mechanism. The elastic case runs with
  synchronous admission (`rollout.max_staleness: 0`): the groups of version v start only once v is
  published, so the trainer, the faster side, waits for scored groups between steps. Each step is
  then a rollout phase (32 live executions, nothing scored for the trainer: rollout takes back its
  home share) followed by a training phase (no live execution, a
  batch for the trainer: one device while its step has not started (its work is not measured yet),
  all of rollout's while a step is running, as before the first step, when the trainer holds none). The
  device lent in one training phase is taken back in the next rollout phase: the load reports and
  the plan loop run every 0.1 s here (every 1-2 s in the quickstart), against training phases of
  0.1-0.6 s measured on the shared 2-core machine; and when the trainer holds every device, the
  waiting executions force the return. The policy's cost
  rule is switched off (`scheduler.elastic_min_step_over_switch: 0`): the quickstart's steps are
  too short for any optional move to pay under it (`make run` keeps it: there the round trip is
  the start-up one, all devices lent before the first step, two or three taken back after it);
- async: the fixed share reaches the trainer (rollout -> train) and the split holds. The issue asked
  for a round trip under async too, but a fixed split never hands a device back during a run, by
  definition; a device that went back to rollout would be a bug, so that is what is asserted;
- under all three: the trainer trained on leased devices (data-parallel ranks >= 1 on every step, train
  device time in the lease history), 0 executions interrupted, and every generated step stored
  exactly once by the trajectory service.
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

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
SAMPLE_S = 0.1  # seconds between load reports and between plans


def _run(policy: str, run_dir: Path, steps: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}  # embedded servers
    raw = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    # Elastic's cost rule lends only when a trainer step is 20 role changes long; the quickstart's
    # steps are a second or two, so in this test every move pays (the rule has its unit tests).
    raw["scheduler"]["elastic_min_step_over_switch"] = 0.0
    # The policy sees each phase of a step: loads reported and plans made every 0.1 s.
    raw["scheduler"]["plan_interval_s"] = SAMPLE_S
    for section in ("rollout", "trainer"):
        raw.setdefault(section, {})["report_load_interval_s"] = SAMPLE_S
    if policy == "elastic":
        # Synchronous admission: rollout and training alternate, so devices go both ways each step.
        raw["rollout"]["max_staleness"] = 0
        raw["scheduler"]["staleness_bound"] = 0
    config = run_dir.parent / f"{policy}.yaml"
    config.write_text(yaml.safe_dump(raw))
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from app.cli import main; sys.exit(main())",
            "run",
            str(config),
            "--policy",
            policy,
            "--steps",
            str(steps),
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )


def role_histories(records: list[dict]) -> dict[str, list[str]]:
    """Per device, the roles it served in order (each ACTIVE lease: registered or acquired)."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r["type"] != "LeaseEvent":
            continue
        ev = r["event"]
        if ev.get("kind") not in ("KIND_REGISTERED", "KIND_ACQUIRED"):
            continue
        lease = ev["lease"]
        role = str(lease.get("role", "DEVICE_ROLE_UNSPECIFIED")).removeprefix("DEVICE_ROLE_").lower()
        seq = out.setdefault(lease["device_id"], [])
        if not seq or seq[-1] != role:
            seq.append(role)
    return out


def went(history: list[str], *path: str) -> bool:
    """`history` passes through the roles of `path` in this order (other roles may sit between)."""
    it = iter(history)
    return all(any(role == want for role in it) for want in path)


def test_role_history_helpers() -> None:
    assert went(["rollout", "idle", "train", "rollout"], "rollout", "train", "rollout")
    assert not went(["rollout", "train"], "rollout", "train", "rollout")
    assert not went(["train", "rollout"], "rollout", "train")


@pytest.mark.parametrize("policy", ["colocate", "elastic", "async"])
def test_devices_move_between_rollout_and_training_without_interrupting_executions(
    policy: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / policy
    # A lend to the trainer needs a load report inside a training phase (0.1-0.6 s on the shared
    # machine) once the step's remaining work is measured (from its first micro-batch), and a plan
    # before the next report: reports every 0.25 s caught that in some steps only (a 3-step and,
    # later, a 6-step clean-clone run caught none, with 0.1-s phases), so reports and plans come
    # every 0.1 s and the elastic case runs twice as many steps.
    steps = 2 * STEPS if policy == "elastic" else STEPS
    proc = _run(policy, run_dir, steps)
    assert proc.returncode == 0, f"gyre run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    records = read_events(run_dir / "events.jsonl")
    stats = json.loads((run_dir / "final_stats.json").read_text())
    histories = role_histories(records)
    assert histories, "no lease events"

    if policy == "colocate":
        assert any(went(h, "rollout", "train", "rollout") for h in histories.values()), histories
    elif policy == "elastic":
        assert any(went(h, "rollout", "train", "rollout") for h in histories.values()), histories
    else:
        moved = [d for d, h in histories.items() if went(h, "rollout", "train")]
        assert moved, histories
        assert all(h[-1] == "train" for d, h in histories.items() if d in moved), histories
        assert any(h == ["rollout"] for h in histories.values()), "async keeps a fixed rollout share"

    # the trainer trained on leased devices only: one rank or more on every step
    weights = [r["event"] for r in records if r["type"] == "WeightsPublishedEvent"]
    assert len(weights) >= steps
    assert all(float(w["metrics"]["dp_size_mean"]) >= 1.0 for w in weights)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy"] == policy
    assert summary["num_reassignments"] > 0

    # no execution interrupted by a move; every generated step stored exactly once
    assert int(stats["rollout"].get("executions_interrupted", 0)) == 0
    step_ids = [r["event"]["event_id"] for r in records if r["type"] == "StepEvent"]
    assert step_ids, "the run published no steps"
    trajectory = stats["trajectory"]["values"]
    assert int(trajectory["stored_calls"]) == len(set(step_ids)), (trajectory, len(set(step_ids)))
    assert int(trajectory.get("steps_rejected", 0)) == 0
