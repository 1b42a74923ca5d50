"""A streamed step against the real trajectory service (real NATS and Postgres, real gRPC).

The trajectory service is configured so that its batching rules alone would hand out nothing
(`min_batch_fill` 1.0 of a large budget, a long `batch_max_wait_s`). A streaming trainer starts a
step on the first scored group; the next group is only published once the trainer is training the
previous part, so each part is pulled as its group was scored. The step is then compared with a
trainer without streaming that pulls the same groups, scored all at once in a second run, as one
batch: same loss, same parameters (float64; the weights cross the wire as float32 in both runs).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

from gyre import rpc, store
from gyre.bus import Bus, subjects
from gyre.config import CommonConfig
from gyre.service import Runtime
from gyre.v1 import trajectory_pb2, trajectory_pb2_grpc
from services.trainer.config import TrainerConfig
from services.trainer.data import TrajectoryBatchSource
from services.trainer.loop import Trainer
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from services.trajectory.synthetic import GeneratedExecution, WorkloadConfig, end_event, generate, step_event

pytestmark = pytest.mark.integration

MIGRATIONS = Path(__file__).parents[2] / "services" / "trajectory" / "migrations"
NUM_GROUPS = 3
WORKLOAD = WorkloadConfig(
    num_groups=NUM_GROUPS,
    group_size=3,
    task_prompt_tokens=48,
    num_turns=4,
    generated_tokens=12,
    observation_tokens=16,
    compaction_every=3,
    summary_tokens=8,
    retry_fraction=0.3,
    shared_early_turns=1,
    exact_duplicates_per_group=0,
    near_duplicates_per_group=1,
    seed=11,
)
BUDGET = 65_536  # the step's token budget: far more than the three groups


class Trajectory:
    """A TrajectoryService of one run on its own gRPC port."""

    async def start(self, nats_url: str, database_url: str, run_id: str, **cfg: object) -> Trajectory:
        await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
        self.run_id = run_id
        self.engine = store.create_engine(database_url)
        self.bus = await Bus.connect(nats_url, name="trajectory-test")
        await self.bus.ensure_streams()
        self.server, self.port = rpc.create_server()
        common = CommonConfig(run_id=run_id, nats_url=nats_url, database_url=database_url)
        self.service = TrajectoryService(
            common,
            TrajectoryConfig.model_validate(
                # group_size as the launcher sets it (rollout.group_size): a group is scored once all its
                # executions are in. With 0 it is scored once those seen so far have ended, which on a
                # loaded machine can be before the last execution's first event was ingested.
                {"ready_poll_s": 0.1, "max_batch_tokens": BUDGET, "group_size": WORKLOAD.group_size, **cfg}
            ),
        )
        await self.service.start(
            Runtime(
                common=common, bus=self.bus, engine=self.engine, server=self.server, port=self.port, name="t"
            )
        )
        await self.server.start()
        self.channel = rpc.channel(f"127.0.0.1:{self.port}")
        self.stub = trajectory_pb2_grpc.TrajectoryStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.service.stop()
        await self.channel.close()
        await self.server.stop(0)
        await self.bus.close()
        self.engine.dispose()

    async def publish(self, execs: list[GeneratedExecution]) -> None:
        for ex in execs:
            for c in ex.calls:
                await self.bus.publish(
                    subjects.steps(self.run_id, c.task_id),
                    step_event(self.run_id, c),
                    msg_id=f"{c.execution_id}.{c.call_seq}",
                )
        for i, ex in enumerate(execs):  # distinct rewards: every group has advantages to train
            ev = end_event(self.run_id, ex, 0.2 + 0.3 * i)
            await self.bus.publish(subjects.executions(self.run_id, ex.task_id), ev, msg_id=ev.event_id)

    async def stat(self, name: str) -> float:
        resp = await self.stub.GetStats(trajectory_pb2.GetStatsRequest(run_id=self.run_id))
        return resp.values.get(name, 0.0)

    def batches(self) -> dict[str, list[str]]:
        """batch id -> its state, from Postgres."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text("select batch_id, state from traj_batches where run_id=:r"), {"r": self.run_id}
            ).all()
        return {r[0]: r[1] for r in rows}


async def wait_for(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _trainer(run_dir: Path, traj: Trajectory, streaming: bool, metrics: list[dict[str, float]]) -> Trainer:
    cfg = TrainerConfig(
        dtype="float64",
        device="cpu",
        lr=1e-2,
        checkpoint_every=1,
        batch_max_tokens=BUDGET,
        pull_wait_s=30.0,
        micro_batch_tokens=256,
        streaming=streaming,
        stream_wait_s=4.0,  # > the scoring delay of a group published meanwhile (poll: 0.1 s)
        trajectory_address=f"127.0.0.1:{traj.port}",
    )
    source = TrajectoryBatchSource(cfg.trajectory_address, traj.run_id, "trainer-0", BUDGET, cfg.pull_wait_s)

    async def sink(weights, step_metrics):  # type: ignore[no-untyped-def]
        metrics.append(step_metrics)

    return Trainer(cfg, run_dir, source, sink, seed=0)


def _groups() -> list[list[GeneratedExecution]]:
    execs = generate(WORKLOAD)
    return [[e for e in execs if e.group_id == g] for g in sorted({e.group_id for e in execs})]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_step_is_trained_from_parts_pulled_as_their_groups_were_scored(
    nats_url, database_url, tmp_path
):
    groups = _groups()
    run_id = f"stream{random.randrange(1 << 30)}"
    # the batching rules alone would hand out nothing: a full budget, or an hour's wait
    traj = await Trajectory().start(
        nats_url, database_url, run_id, min_batch_fill=1.0, batch_max_wait_s=3600.0
    )
    got: list[dict[str, float]] = []
    streamed = _trainer(tmp_path / "stream", traj, True, got)
    try:
        await traj.publish(groups[0])
        step = asyncio.create_task(streamed.run(max_steps=1))
        for g in range(1, NUM_GROUPS):
            # group g is published (and scored) only once the trainer trains the step's part g - 1
            await wait_for(lambda g=g: _parts_begun(streamed, step, g))
            assert await traj.stat("groups_state_scored") + await traj.stat("groups_state_batched") == g
            await traj.publish(groups[g])
        await step
        # each part is acked once the checkpoint that covers it is written
        assert await traj.stat("batches_acked") == NUM_GROUPS
        assert await traj.stat("batch_parts_delivered") == NUM_GROUPS
        assert set(traj.batches().values()) == {"acked"}
    finally:
        await streamed.source.close()  # type: ignore[attr-defined]
        await traj.stop()
    assert len(got) == 1 and got[0]["num_parts"] == NUM_GROUPS
    assert len(streamed.state.trained_batch_ids) == NUM_GROUPS

    # the same groups, published at once, pulled as one batch by a trainer without streaming (the batch
    # is built when the first scored group has waited 5 s: all three are scored by then)
    traj = await Trajectory().start(
        nats_url, database_url, run_id + "b", min_batch_fill=1.0, batch_max_wait_s=5.0
    )
    want: list[dict[str, float]] = []
    reference = _trainer(tmp_path / "ref", traj, False, want)
    try:
        for g in groups:
            await traj.publish(g)

        async def all_scored() -> bool:
            return (
                await traj.stat("groups_state_scored") + await traj.stat("groups_state_batched") == NUM_GROUPS
            )

        await wait_for(all_scored)
        await reference.run(max_steps=1)
    finally:
        await reference.source.close()  # type: ignore[attr-defined]
        await traj.stop()
    assert len(want) == 1 and want[0]["num_parts"] == 1 and reference.last_batch_groups == NUM_GROUPS
    assert want[0]["num_paths"] == got[0]["num_paths"] > 0
    for key in ("loss", "num_trained_tokens", "grad_norm", "reward_mean"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-6), key
    # The weights crossed the wire as float32, rounded once per part (w / N_i) in one run and once per
    # batch (w / N) in the other: a gradient element is exact up to that rounding of the terms it sums
    # (bounded against the largest element), and AdamW's first step, which divides each element by its
    # own magnitude, carries it into the update of an element whose gradient nearly cancels (bounded
    # against the learning rate). test_streaming.py checks the trainer's arithmetic itself in float64
    # at rtol 1e-6, without a wire.
    gmax = max(float(p.grad.abs().max()) for p in reference.model.parameters() if p.grad is not None)
    lr = streamed.cfg.lr
    fresh = _trainer(tmp_path / "fresh", traj, False, []).model.parameters()
    moved = 0.0
    for a, b, f in zip(streamed.model.parameters(), reference.model.parameters(), fresh, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6 * gmax)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-4 * lr)
        moved = max(moved, float((b - f).abs().max()))
    assert moved > 0.5 * lr, "the step hardly changed the parameters: the comparison would be vacuous"


async def _parts_begun(trainer: Trainer, step: asyncio.Task[None], n: int) -> bool:
    if step.done():
        step.result()  # raises what ended the loop
        raise AssertionError(f"the step ended before its part {n + 1} was published")
    return trainer.step_parts >= n


async def _two_scored_groups(traj: Trajectory) -> list:
    """Publish the first two synthetic groups and wait until the service has scored both."""
    groups = _groups()[:2]
    for g in groups:
        await traj.publish(g)

    async def both_scored() -> bool:
        return await traj.stat("groups_state_scored") == 2

    await wait_for(both_scored)
    return groups


async def _part(traj: Trajectory, **kw: object) -> list[trajectory_pb2.BatchChunk]:
    """One PullBatch with stream_part set, collected."""
    req = trajectory_pb2.PullBatchRequest(consumer="trainer-0", stream_part=True, **kw)  # type: ignore[arg-type]
    return [c async for c in traj.stub.PullBatch(req)]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_part_takes_a_group_at_once_and_a_full_step_is_answered_without_waiting(
    nats_url, database_url
):
    run_id = f"parts{random.randrange(1 << 30)}"
    traj = await Trajectory().start(
        nats_url, database_url, run_id, min_batch_fill=1.0, batch_max_wait_s=3600.0
    )
    try:
        groups = await _two_scored_groups(traj)

        # the step's first part: a budget of 1 token still takes one group (a tree is never split)
        first = await _part(traj, max_tokens=1, wait_s=0)
        assert len({g for c in first for g in c.group_ids}) == 1
        assert first[0].normaliser > 0 and {c.normaliser for c in first} == {first[0].normaliser}
        tokens = sum(len(c.token_ids) for c in first)
        # later parts: the budget left is strict; the other group does not fit 1 token, so the step is
        # full and the answer comes without the hour's wait (the bound below is only a hang guard)
        assert await asyncio.wait_for(_part(traj, max_tokens=1, step_tokens=tokens, wait_s=3600.0), 60) == []
        assert await traj.stat("groups_state_scored") == 1  # left for the next step, not dropped
        # without stream_part the batching rules hold: the waiting group is below min_batch_fill
        assert [
            c async for c in traj.stub.PullBatch(trajectory_pb2.PullBatchRequest(consumer="trainer-0"))
        ] == []
        second = await _part(traj, max_tokens=BUDGET, step_tokens=tokens, wait_s=0)
        assert {g for c in second for g in c.group_ids} == {groups[1][0].group_id}
        assert await traj.stat("batch_parts_delivered") == 2
    finally:
        await traj.stop()


@pytest.mark.slow
async def test_a_streamed_step_is_full_once_its_parts_hold_what_a_whole_batch_would(nats_url, database_url):
    run_id = f"fill{random.randrange(1 << 30)}"
    traj = await Trajectory().start(
        nats_url, database_url, run_id, min_batch_fill=0.5, batch_max_wait_s=3600.0
    )
    try:
        groups = await _two_scored_groups(traj)

        first = await _part(traj, max_tokens=1, wait_s=0)
        tokens = sum(len(c.token_ids) for c in first)
        # The step's budget is 2 x its tokens, so its parts already fill min_batch_fill (0.5): a
        # whole batch would hold no more. The other group fits, yet the step is answered full at
        # once (the bound is only a hang guard) and the group waits for the next step.
        assert (
            await asyncio.wait_for(_part(traj, max_tokens=tokens, step_tokens=tokens, wait_s=3600.0), 60)
            == []
        )
        assert await traj.stat("groups_state_scored") == 1
        # With room for more than twice its tokens the same step takes the other group.
        second = await _part(traj, max_tokens=BUDGET - tokens, step_tokens=tokens, wait_s=0)
        assert {g for c in second for g in c.group_ids} == {groups[1][0].group_id}
    finally:
        await traj.stop()
