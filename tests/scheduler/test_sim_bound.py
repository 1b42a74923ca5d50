"""No simulated run, whatever the policy or the service semantics, ends before the makespan lower
bound of sim/bound.py (no tolerance): the bound is a true bound of the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.workload import ServiceSemantics
from services.scheduler.policies import AsyncPolicy, ColocatePolicy, ElasticPolicy, Policy
from services.scheduler.sim import load_workload_file
from services.scheduler.sim.bound import makespan_lower_bound_s
from services.scheduler.sim.compare import _prepared, simulate, with_semantics

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"
SEMANTICS = {
    "live": ServiceSemantics(),
    "step-resize": ServiceSemantics(trainer_resize="step"),
    "batch-synchronous": ServiceSemantics(trainer_streaming=False),
    "cut-after-60s": ServiceSemantics(train_unfinished_after_s=60.0),
}


def _policies(num_units: int) -> list[Policy]:
    out: list[Policy] = [
        ColocatePolicy(),
        ElasticPolicy(),
        ElasticPolicy(spread_idle=False, min_step_over_switch=0),
    ]
    return out + [AsyncPolicy(n) for n in range(1, num_units)]


@pytest.mark.parametrize("semantics", sorted(SEMANTICS))
@pytest.mark.parametrize("name", ["small.yaml", "tiny_pool.yaml"])
def test_no_policy_finishes_before_the_makespan_lower_bound(name: str, semantics: str) -> None:
    w = with_semantics(load_workload_file(WORKLOADS / name), SEMANTICS[semantics])
    execs, _ = _prepared(w)
    for policy in _policies(w.num_units):
        bound = makespan_lower_bound_s(w, execs, policy.staleness_bound)
        end = simulate(w, policy).step_done_s[-1]
        assert end >= bound, (policy.describe(), end, bound)
    # The bound is not vacuous: it is a sizable share of the fastest run.
    fastest = min(simulate(w, p).step_done_s[-1] for p in _policies(w.num_units))
    assert makespan_lower_bound_s(w, execs, 1) > 0.3 * fastest
