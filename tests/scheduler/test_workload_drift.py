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
