"""The simulator admits executions and scores groups by the live services' rules.

Admission: the live rollout's `ExecutionManager` (real, with a scripted agent at the outermost edge
that finishes every execution at once) and the simulator's batch admission, given the same weight
versions, start the same number of groups. Scoring: every group the simulator scores with a
partial-progress cut-off is scored at the first instant the live trajectory service's
`GroupScoring.ready` (real, on a `TrajectoryState` holding the same member endings) says it is
ready: ready then, and not ready an instant before.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from services.rollout.environments.longhorizon import LongHorizonFamily, LongHorizonSpec
from services.rollout.executions import ExecutionManager
from services.scheduler.policies import AsyncPolicy
from services.scheduler.sim import load_workload_file
from services.scheduler.sim.compare import _prepared, with_semantics
from services.scheduler.sim.engine import Simulation
from services.trajectory.config import TrajectoryConfig
from services.trajectory.group_scoring import GroupScoring
from services.trajectory.scoring import Ending
from services.trajectory.state import ExecInfo, TrajectoryState
from tests.helpers.agents import InstantAgent, settle

SMALL = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "small.yaml"


@pytest.mark.parametrize("bound", [0, 1, 2])
async def test_live_and_simulated_admission_start_the_same_groups_at_every_version(bound: int) -> None:
    w = load_workload_file(SMALL)
    groups_per_batch = w.tasks_per_step
    execs, capacity = _prepared(w)
    sim = Simulation(AsyncPolicy(1, staleness_bound=bound), w, execs, capacity)
    manager = ExecutionManager(
        InstantAgent(),  # type: ignore[arg-type]
        LongHorizonFamily(LongHorizonSpec(num_actions=4, max_turns=4, seed=0)),
        run_id="r",
        seed=0,
        max_live=1024,
        continuous=True,
        groups_per_version=groups_per_batch,
        staleness_bound=bound,
    )
    manager.start(num_tasks=groups_per_batch, group_size=1)
    try:
        for version in range(0, w.num_steps - bound - 1):
            await manager.on_version(version)
            await settle()
            sim.version = version
            sim._admit()
            assert manager.groups_started == sim.next_batch * groups_per_batch
    finally:
        await manager.stop()


def _live_ready(members: dict[int, float | None], at: float, cutoff: float) -> bool:
    """The live trajectory service's decision for one group whose members ended at the given times
    (None: still running) as seen at `at`."""
    state = TrajectoryState()
    group = state.group("g", "t")
    for eid, ended in members.items():
        done = ended is not None and ended <= at
        state.executions[f"e{eid}"] = ExecInfo(
            "g", "t", Ending.FINISHED if done else Ending.RUNNING, ended_unix_s=ended if done else None
        )
        group.members.add(f"e{eid}")
        if done:
            state.first_end["g"] = min(state.first_end.get("g", math.inf), ended)  # type: ignore[arg-type]
    cfg = TrajectoryConfig(train_unfinished_after_s=cutoff)
    scoring = GroupScoring("r", cfg, state, None, None, None, Counter())  # type: ignore[arg-type]
    return scoring.ready("g", group, at)


def test_the_simulator_scores_each_group_at_the_first_instant_the_live_service_would() -> None:
    cutoff = 120.0
    w = load_workload_file(SMALL)
    w = with_semantics(w, w.service.model_copy(update={"train_unfinished_after_s": cutoff}))
    execs, capacity = _prepared(w)
    sim = Simulation(AsyncPolicy(2, staleness_bound=w.staleness_bound), w, execs, capacity)
    sim.run()
    cut = whole = 0
    for step, task, at in sim.scored_log:
        members = {i: sim.execs[i].ended_at for i in sim.groups[(step, task)]}
        ended_by_then = [t for t in members.values() if t is not None and t <= at]
        if len(ended_by_then) < len(members):
            cut += 1
        else:
            whole += 1
        assert _live_ready(members, at, cutoff), (step, task, at)
        assert not _live_ready(members, math.nextafter(at, -math.inf), cutoff), (step, task, at)
    assert cut > 0 and whole > 0  # both branches of the rule were exercised
