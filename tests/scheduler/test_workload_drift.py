"""Drifting workloads (gyre/workload.py `Domain.schedule`): multipliers piecewise-linear over training
steps, read by the one sampler the simulator, paced devices and the `workload` environment share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gyre.workload import Domain, SchedulePoint, load_workload_file, sample_executions

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "workloads" / "small.yaml"
DRIFTING = sorted((ROOT / "examples" / "workloads").glob("drift_*.yaml"))


def _with_schedule(points: list[dict[str, float]], **update: object):
    w = load_workload_file(SMALL)
    domain = w.domains[0].model_copy(update={"schedule": [SchedulePoint(**p) for p in points]})
    return w.model_copy(update={"domains": [domain], **update})


def test_the_schedule_is_linear_between_points_and_held_outside_them() -> None:
    d = _with_schedule([{"step": 2, "context_scale": 1.0}, {"step": 6, "context_scale": 3.0}]).domains[0]
    assert [d.drift_at(s).context for s in (0, 2, 4, 6, 9)] == [1.0, 1.0, 2.0, 3.0, 3.0]


def test_an_all_ones_schedule_samples_exactly_the_stationary_workload() -> None:
    stationary = sample_executions(load_workload_file(SMALL))
    flat = sample_executions(_with_schedule([{"step": 0}, {"step": 5}]))
    assert [[e.final_context for e in s] for s in flat] == [[e.final_context for e in s] for s in stationary]


def test_a_growing_context_scale_lengthens_later_steps() -> None:
    w = _with_schedule([{"step": 0, "context_scale": 1.0}, {"step": 5, "context_scale": 3.0}], num_steps=6)
    steps = sample_executions(w)
    medians = [float(np.median([e.final_context for e in s])) for s in steps]
    assert medians[-1] > 2.0 * medians[0]


def test_turns_scale_changes_the_turn_count_at_the_same_length() -> None:
    base = sample_executions(_with_schedule([{"step": 0}], num_steps=2))
    more = sample_executions(_with_schedule([{"step": 0, "turns_scale": 2.0}], num_steps=2))
    turns = [len(e.gen) for e in base[0]]
    turns_more = [len(e.gen) for e in more[0]]
    # (more turns draw more numbers, so later executions' lengths differ: compare the totals)
    assert sum(turns_more) > 1.5 * sum(turns)


def test_schedule_steps_must_increase() -> None:
    domain = load_workload_file(SMALL).domains[0].model_dump()
    with pytest.raises(ValidationError, match="strictly increasing"):
        Domain.model_validate({**domain, "schedule": [{"step": 3}, {"step": 3}]})


@pytest.mark.parametrize("path", DRIFTING, ids=lambda p: p.name)
def test_every_shipped_drifting_workload_loads_and_drifts(path: Path) -> None:
    w = load_workload_file(path)
    assert any(d.schedule for d in w.domains)
    first, last = sample_executions(w)[0], sample_executions(w)[-1]
    assert np.mean([e.final_context for e in first]) != np.mean([e.final_context for e in last])


def test_three_drifting_workloads_ship() -> None:
    assert len(DRIFTING) >= 3


def test_the_drift_phases_of_a_phase_change_schedule_are_its_plateaus_after_warm_up() -> None:
    from services.scheduler.sim.compare import drift_phases

    w = load_workload_file(ROOT / "examples" / "workloads" / "drift_lengths.yaml")
    assert [(p.start, p.stop - 1) for p in drift_phases(w)] == [(2, 3), (4, 7), (8, 11), (12, 15)]
    stationary = load_workload_file(ROOT / "examples" / "workloads" / "small.yaml")
    assert drift_phases(stationary) == [range(stationary.warmup_steps, stationary.num_steps)]


def test_the_per_phase_oracle_is_never_slower_than_the_best_fixed_split_and_equals_it_without_drift() -> None:
    from services.scheduler.sim.compare import phase_oracle_time_per_step_s, sweep_async_runs

    for name, drifting in (("small.yaml", False), ("drift_turns.yaml", True)):
        w = load_workload_file(ROOT / "examples" / "workloads" / name)
        runs = sweep_async_runs(w)
        best = min(r.time_per_step_s for r in runs.values())
        oracle = phase_oracle_time_per_step_s(w, runs)
        if drifting:
            assert oracle <= best * (1 + 1e-12)
        else:
            assert oracle == pytest.approx(best, rel=1e-12)


def test_the_retuned_oracle_follows_its_splits_by_weight_version() -> None:
    from services.scheduler.policies import DeviceState, PoolSnapshot, Role
    from services.scheduler.sim.compare import RetunedAsyncPolicy

    policy = RetunedAsyncPolicy([1, 3], staleness_bound=1)
    devices = tuple(DeviceState(f"d{i}", Role.ROLLOUT) for i in range(4))

    def train_moves(version: int) -> int:
        snap = PoolSnapshot(devices, 0, 0, 4, 0, False, latest_version=version)
        return sum(m.to_role == Role.TRAIN for m in policy.plan(snap))

    assert (train_moves(0), train_moves(1), train_moves(7)) == (3, 1, 1)  # the last split holds


def test_the_retuned_oracle_is_one_real_run_never_slower_than_the_best_fixed_split() -> None:
    from services.scheduler.sim.compare import oracle_phases, phase_splits, retuned_async, sweep_async_runs

    for name, drifting in (("small.yaml", False), ("drift_turns.yaml", True)):
        w = load_workload_file(ROOT / "examples" / "workloads" / name)
        runs = sweep_async_runs(w)
        best = min(runs.values(), key=lambda r: r.time_per_step_s)
        oracle = retuned_async(w, runs)
        assert oracle.time_per_step_s <= best.time_per_step_s
        if not drifting:
            assert oracle is best
        else:
            # A ramp is cut step by step and in quarters; every split list covers every step.
            cuts = oracle_phases(w)
            assert len(cuts) == 2
            assert all(len(phase_splits(w, runs, c)) == w.num_steps for c in cuts)
