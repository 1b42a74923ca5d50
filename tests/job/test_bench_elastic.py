"""`gyre bench elastic` without running it (its runs take minutes; the recorded output is in
docs/numbers/bench-elastic.json): the run configs it writes are valid for every service and make a
trainer step `tasks_per_step` groups, and its targets read the measurements right."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.bench_elastic import live_tokens_per_group, run_config, verdicts
from app.job.config import JobConfig
from gyre.config import load_common, load_section
from gyre.workload import load_workload_file
from services.rollout.config import RolloutConfig
from services.scheduler.config import SchedulerConfig
from services.trainer.config import TrainerConfig
from services.trajectory.config import TrajectoryConfig

WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "paced_longtail.yaml"


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic"])
def test_each_policys_run_config_is_valid_and_a_batch_is_one_simulated_steps_groups(
    policy: str, tmp_path: Path
) -> None:
    w = load_workload_file(WORKLOAD)
    raw = run_config(w, WORKLOAD, policy, time_scale=20.0, async_units=2, out=tmp_path, timeout_s=300.0)
    common = load_common(data=raw)
    assert common.devices.pacing.enabled and common.devices.pacing.time_scale == 20.0
    assert common.devices.pacing.switch_costs == ("whole_pool" if policy == "colocate" else "per_device")
    scheduler = load_section(SchedulerConfig, "scheduler", data=raw)
    trajectory = load_section(TrajectoryConfig, "trajectory", data=raw)
    rollout = load_section(RolloutConfig, "rollout", data=raw)
    trainer = load_section(TrainerConfig, "trainer", data=raw)
    load_section(JobConfig, "job", data=raw)
    assert scheduler.policy == policy and rollout.environment == "workload"
    assert scheduler.async_rollout_devices == (2 if policy == "async" else None)  # elastic: no sweep input
    assert (
        rollout.max_staleness
        == scheduler.staleness_bound
        == (0 if policy == "colocate" else w.staleness_bound)
    )
    # a batch is built at the tasks_per_step-th group scored, never before, and holds no more
    group = live_tokens_per_group(w)
    threshold = trajectory.min_batch_fill * trajectory.max_batch_tokens
    assert (w.tasks_per_step - 1) * group < threshold <= w.tasks_per_step * group
    assert w.tasks_per_step * group <= trajectory.max_batch_tokens < (w.tasks_per_step + 1) * group
    assert trainer.batch_max_tokens == trajectory.max_batch_tokens
    # the trainer the simulator predicts for: streaming when the workload's semantics say so
    assert trainer.streaming == w.service.trainer_streaming


def _row(s: float | None, err: float | None, interrupted: int = 0, handoffs: int = 1) -> dict[str, object]:
    return {
        "s_per_step": s,
        "relative_error": err,
        "executions_interrupted": interrupted,
        "train_handoffs": handoffs,
    }


def test_targets_read_the_measurements() -> None:
    good = verdicts(
        {"colocate": _row(26.0, -0.1, handoffs=0), "async": _row(13.0, 0.05), "elastic": _row(12.0, 0.15)}
    )
    assert good["no_execution_interrupted"] and good["train_handoff_under_async_and_elastic"]
    assert good["predictions_within_20pct"] and good["elastic_1.3x_colocate"]
    assert good["elastic_no_slower_than_async"]
    assert good["elastic_speedup_vs_colocate"] == pytest.approx(26 / 12)
    bad = verdicts(
        {"colocate": _row(14.0, 0.3), "async": _row(11.0, 0.0, handoffs=0), "elastic": _row(12.0, None, 1)}
    )
    assert not bad["no_execution_interrupted"] and not bad["train_handoff_under_async_and_elastic"]
    assert not bad["predictions_within_20pct"] and not bad["elastic_1.3x_colocate"]
    assert not bad["elastic_no_slower_than_async"]
