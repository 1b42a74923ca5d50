"""Per-call progress credit in the trajectory service: the progress each StepEvent carries is kept
per call (in memory and, through the calls table, across a reload) and becomes the advantages of
that call's tokens. Real Postgres (fixture on a free port); no NATS needed at this level."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gyre import store
from gyre.v1 import common_pb2
from services.trajectory.config import TrajectoryConfig
from services.trajectory.core import TrajectoryCore
from services.trajectory.synthetic import WorkloadConfig, end_event, generate, step_event

pytestmark = pytest.mark.integration
MIGRATIONS = Path(__file__).parents[2] / "services" / "trajectory" / "migrations"
ONE_GROUP = WorkloadConfig(
    num_groups=1,
    group_size=4,
    task_prompt_tokens=32,
    num_turns=4,
    generated_tokens=4,
    observation_tokens=8,
    compaction_every=100,
    summary_tokens=4,
    retry_fraction=0.0,
    shared_early_turns=1,
    seed=11,
)


async def test_each_calls_progress_is_kept_and_credited_to_that_call(database_url):
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    execs = generate(ONE_GROUP)
    cfg = TrajectoryConfig(
        credit_assignment="progress", near_duplicate_threshold=1.0, normalise_advantage_std=False
    )
    core = TrajectoryCore("rp", cfg, engine)
    steps = []
    reached: dict[str, list[int]] = {}
    for i, ex in enumerate(execs):
        # execution i reaches a milestone at every call but its i-th (of 4 milestones)
        marks = [k for k in range(len(ex.calls)) if k != i][: ex.milestones_total]
        reached[ex.execution_id] = [sum(1 for m in marks if m <= k) for k in range(len(ex.calls))]
        for k, c in enumerate(ex.calls):
            st = step_event("rp", c)
            st.progress.CopyFrom(
                common_pb2.ProgressSignal(milestones_reached=reached[ex.execution_id][k], milestones_total=4)
            )
            steps.append(st)
    await core.ingest.ingest_steps(steps)
    for ex in execs:
        ex.finished, ex.milestones_reached = False, reached[ex.execution_id][-1]
    await core.ingest.ingest_executions([end_event("rp", ex) for ex in execs])
    for ex in execs:
        kept = core.state.executions[ex.execution_id].step_progress
        assert [kept[c.call_seq].milestones_reached for c in ex.calls] == reached[ex.execution_id]

    events = await core.scoring.score_ready_groups()
    assert len(events) == 1
    (group,) = [g.scored for g in core.state.groups.values() if g.scored is not None]
    # Exact duplicates (same tokens) are trained once with the mean of their members' per-call
    # advantages; this made-up progress differs between duplicates, so check the single ones.
    singles = [e for e in group.executions if e.multiplicity == 1]
    assert len(singles) >= 2
    for e in singles:
        calls = [c for ex in execs if ex.execution_id == e.execution_id for c in ex.calls]
        r = reached[e.execution_id]
        made = [r[0]] + [r[k] - r[k - 1] for k in range(1, len(r))]
        adv = [e.call_advantages[c.call_seq] for c in calls]
        # Every execution reaches 3 of 4 milestones in 4 calls: step rewards 0.25 x3 and 0 x1, group
        # mean 0.1875; discount 0 credits each call with its own progress only.
        assert adv == pytest.approx([0.0625 if m else -0.1875 for m in made])

    fresh = TrajectoryCore("rp", cfg, engine)
    await asyncio.to_thread(fresh.load)
    for ex in execs:
        kept = fresh.state.executions[ex.execution_id].step_progress
        assert [kept[c.call_seq].milestones_reached for c in ex.calls] == reached[ex.execution_id]
    engine.dispose()
