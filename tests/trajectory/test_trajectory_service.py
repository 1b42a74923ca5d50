"""The trajectory service against real NATS and Postgres (fixtures start both on free ports)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import sqlalchemy as sa

from gyre import rpc, store
from gyre.bus import Bus, subjects
from gyre.config import CommonConfig
from gyre.service import Runtime
from gyre.v1 import common_pb2, events_pb2, trajectory_pb2, trajectory_pb2_grpc
from services.trajectory.cli import collect_export
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from services.trajectory.synthetic import WorkloadConfig, end_event, generate, step_event

pytestmark = pytest.mark.integration

MIGRATIONS = Path(__file__).parents[2] / "services" / "trajectory" / "migrations"
TINY = WorkloadConfig(
    num_groups=1,
    group_size=4,
    task_prompt_tokens=128,
    num_turns=6,
    generated_tokens=16,
    observation_tokens=32,
    compaction_every=3,
    summary_tokens=12,
    retry_fraction=0.3,
    shared_early_turns=1,
    seed=7,
)


@dataclass
class Running:
    service: TrajectoryService
    server: grpc.aio.Server
    bus: Bus
    engine: sa.Engine
    channel: grpc.aio.Channel
    stub: trajectory_pb2_grpc.TrajectoryStub
    server_port: int

    async def stop(self) -> None:
        await self.service.stop()
        await self.channel.close()
        await self.server.stop(0)
        await self.bus.close()
        self.engine.dispose()


async def start(nats_url: str, database_url: str, run_id: str, **cfg: object) -> Running:
    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    bus = await Bus.connect(nats_url, name="trajectory-test")
    await bus.ensure_streams()
    server, port = rpc.create_server()
    common = CommonConfig(run_id=run_id, nats_url=nats_url, database_url=database_url)
    service = TrajectoryService(
        common, TrajectoryConfig.model_validate({"ready_poll_s": 0.1, "batch_max_wait_s": 0.0, **cfg})
    )
    await service.start(
        Runtime(common=common, bus=bus, engine=engine, server=server, port=port, name="trajectory")
    )
    await server.start()
    channel = rpc.channel(f"127.0.0.1:{port}")
    return Running(service, server, bus, engine, channel, trajectory_pb2_grpc.TrajectoryStub(channel), port)


async def wait_for(predicate, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def stat(run: Running, name: str) -> float:
    resp = await run.stub.GetStats(trajectory_pb2.GetStatsRequest())
    return resp.values.get(name, 0.0)


def unique_run() -> str:
    return f"r{random.randrange(1 << 30)}"


async def test_steps_on_nats_are_stored_once_despite_duplicates_and_disorder(nats_url, database_url):
    run_id = unique_run()
    execs = generate(TINY)
    calls = [c for ex in execs for c in ex.calls]
    run = await start(nats_url, database_url, run_id)
    try:
        shuffled = calls + random.Random(1).sample(calls, len(calls) // 2)  # half of them twice
        random.Random(2).shuffle(shuffled)
        for i, c in enumerate(shuffled):
            # A distinct msg_id defeats JetStream's own dedup: the consumer must be idempotent itself.
            await run.bus.publish(
                subjects.steps(run_id, c.task_id),
                step_event(run_id, c),
                msg_id=f"{c.execution_id}.{c.call_seq}.{i}",
            )
        await wait_for(lambda: _received(run, len(shuffled)))
        assert await stat(run, "stored_calls") == len(calls)
        assert await stat(run, "steps_duplicate") == len(shuffled) - len(calls)
        # The same steps again through gRPC: all duplicates.
        summary = await run.stub.IngestSteps(iter([step_event(run_id, c) for c in calls]))
        assert (summary.num_stored, summary.num_duplicates) == (0, len(calls))
        # Lossless: export gives back every call exactly.
        ex = execs[0]
        resp = await collect_export(run.stub, ex.execution_id)
        assert [list(c.prompt_token_ids) for c in resp.calls] == [c.prompt.tolist() for c in ex.calls]
        assert [list(c.completion_token_ids) for c in resp.calls] == [c.completion.tolist() for c in ex.calls]
        assert [list(c.completion_logprobs) for c in resp.calls] == [c.logprobs.tolist() for c in ex.calls]
    finally:
        await run.stop()


async def _received(run: Running, n: int) -> bool:
    return await stat(run, "steps_received") >= n


async def publish_group(run: Running, run_id: str, execs, reward_of=None) -> None:  # type: ignore[no-untyped-def]
    for ex in execs:
        for c in ex.calls:
            await run.bus.publish(
                subjects.steps(run_id, c.task_id),
                step_event(run_id, c),
                msg_id=f"{c.execution_id}.{c.call_seq}",
            )
    for ex in execs:
        ev = end_event(run_id, ex, None if reward_of is None else reward_of(ex))
        await run.bus.publish(
            subjects.executions(run_id, ex.task_id), ev, msg_id=f"{ev.event_id}.{ev.reward}"
        )


async def pull(run: Running, **kw: object) -> list[trajectory_pb2.BatchChunk]:
    return [c async for c in run.stub.PullBatch(trajectory_pb2.PullBatchRequest(consumer="trainer-0", **kw))]  # type: ignore[arg-type]


@pytest.mark.slow
async def test_pull_batch_hands_each_path_out_once_even_across_a_restart(nats_url, database_url):
    run_id = unique_run()
    execs = generate(TINY)
    run = await start(nats_url, database_url, run_id)
    try:
        await publish_group(run, run_id, execs)
        chunks = await pull(run, wait_s=30.0)
        assert chunks and chunks[-1].last
        batch_id = chunks[0].batch_id
        assert sum(c.num_paths for c in chunks) > 0
        assert len(chunks[0].token_ids) == len(chunks[0].weight_pos) == len(chunks[0].position_ids)
        assert any(chunks[0].loss_mask)
        assert await pull(run, wait_s=0.3) == []
    finally:
        await run.stop()
    run = await start(nats_url, database_url, run_id)
    try:
        await asyncio.sleep(0.5)  # let the restarted service consume and poll whatever it sees again
        assert await pull(run, wait_s=0.5) == []
        # The tree was rebuilt from Postgres: every call still exports exactly.
        resp = await collect_export(run.stub, execs[1].execution_id)
        assert [list(c.prompt_token_ids) + list(c.completion_token_ids) for c in resp.calls] == [
            c.prompt.tolist() + c.completion.tolist() for c in execs[1].calls
        ]
        again = await pull(run, resume_batch_id=batch_id)
        assert [c.SerializeToString() for c in again] == [c.SerializeToString() for c in chunks]
        await run.stub.AckBatch(
            trajectory_pb2.AckBatchRequest(batch_id=batch_id, consumer="trainer-0", trained_at_version=1)
        )
        assert await stat(run, "batches_acked") == 1
        with engine_scope(run) as conn:
            n_paths = conn.execute(
                sa.text("select count(*) from traj_batch_paths where run_id=:r"), {"r": run_id}
            ).scalar()
            kinds = {
                r[0] for r in conn.execute(sa.text("select distinct jsonb_typeof(progress) from traj_calls"))
            }
        assert n_paths == sum(c.num_paths for c in chunks)
        assert kinds == {"object"}
    finally:
        await run.stop()


class engine_scope:  # noqa: N801 - reads as a with-statement helper
    def __init__(self, run: Running) -> None:
        self.conn = run.engine.connect()

    def __enter__(self) -> sa.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


@pytest.mark.slow
async def test_nan_reward_is_rejected_with_a_clear_error_and_nothing_is_lost(nats_url, database_url):
    run_id = unique_run()
    execs = generate(TINY)
    for ex in execs:
        ex.finished = True
    run = await start(nats_url, database_url, run_id)
    try:
        bad = execs[0].execution_id
        await publish_group(
            run, run_id, execs, reward_of=lambda ex: math.nan if ex.execution_id == bad else ex.reward
        )
        await wait_for(lambda: _has(run, "execution_events_rejected"))
        await wait_for(lambda: _stored(run, sum(len(ex.calls) for ex in execs)))
        with engine_scope(run) as conn:
            err = conn.execute(
                sa.text("select error from traj_rejections where run_id=:r"), {"r": run_id}
            ).scalar()
            ncalls = conn.execute(
                sa.text("select count(*) from traj_calls where run_id=:r and execution_id=:e"),
                {"r": run_id, "e": bad},
            ).scalar()
        assert "nan" in err and bad in err and "finite" in err
        assert ncalls == len(execs[0].calls)
        await asyncio.sleep(0.5)
        assert await stat(run, "groups_scored") == 0  # the group waits for a valid ending
        good = end_event(run_id, execs[0], reward=0.5)
        await run.bus.publish(subjects.executions(run_id, execs[0].task_id), good, msg_id="fixed")
        await wait_for(lambda: _has(run, "groups_scored"))
        assert await pull(run, wait_s=10.0)
    finally:
        await run.stop()


async def _stored(run: Running, n: int) -> bool:
    return await stat(run, "stored_calls") >= n


async def _has(run: Running, name: str) -> bool:
    return await stat(run, name) > 0


async def test_unknown_batch_and_execution_are_not_found(nats_url, database_url):
    run = await start(nats_url, database_url, unique_run())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect_export(run.stub, "nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pull(run, resume_batch_id="nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await run.stop()


@pytest.mark.slow
async def test_compact_steps_rebuild_exact_prompts_and_wait_for_their_base_call(nats_url, database_url):
    from services.trajectory.synthetic import compact_step_events

    run_id = unique_run()
    ex = generate(TINY)[0]
    compact = compact_step_events(run_id, ex.calls)
    assert sum(len(s.prompt_token_ids) for s in compact) < sum(len(c.prompt) for c in ex.calls) / 2
    run = await start(nats_url, database_url, run_id)
    try:
        early = await run.stub.IngestSteps(iter(compact[1:2]))  # its base call 0 has not arrived
        assert (early.num_stored, early.num_waiting) == (0, 1)
        # Over NATS, in reverse order: waiting steps are redelivered until their base is stored.
        for s in reversed(compact):
            await run.bus.publish(subjects.steps(run_id, s.task_id), s, msg_id=s.event_id)
        await wait_for(lambda: _stored(run, len(compact)), timeout_s=60)
        resp = await collect_export(run.stub, ex.execution_id)
        assert [list(c.prompt_token_ids) for c in resp.calls] == [c.prompt.tolist() for c in ex.calls]
        assert [list(c.completion_token_ids) for c in resp.calls] == [c.completion.tolist() for c in ex.calls]
    finally:
        await run.stop()


@pytest.mark.slow
async def test_unfinished_executions_are_scored_as_partial_after_the_configured_wait(nats_url, database_url):
    run_id = unique_run()
    execs = generate(TINY)
    run = await start(nats_url, database_url, run_id, train_unfinished_after_s=0.2)
    try:
        for ex in execs:
            for c in ex.calls:
                await run.bus.publish(
                    subjects.steps(run_id, c.task_id),
                    step_event(run_id, c),
                    msg_id=c.execution_id + f".{c.call_seq}",
                )
        for ex in execs[1:]:  # execs[0] never ends
            ev = end_event(run_id, ex)
            await run.bus.publish(subjects.executions(run_id, ex.task_id), ev, msg_id=ev.event_id)
        chunks = await pull(run, wait_s=30.0)
        assert sum(c.num_partial_paths for c in chunks) >= 1
        with engine_scope(run) as conn:
            partial, source = conn.execute(
                sa.text("select partial, source from traj_scores where run_id=:r and execution_id=:e"),
                {"r": run_id, "e": execs[0].execution_id},
            ).one()
        assert partial and source == "none"  # TINY steps carry no progress signal
    finally:
        await run.stop()


@pytest.mark.slow
async def test_groups_older_than_the_staleness_bound_are_dropped_not_trained(nats_url, database_url):
    run_id = unique_run()
    execs = generate(TINY)
    run = await start(
        nats_url, database_url, run_id, max_staleness=2, min_batch_fill=1.0, batch_max_wait_s=3600.0
    )
    try:
        await publish_group(run, run_id, execs)
        await wait_for(lambda: _has(run, "groups_scored"))
        # The trainer is at version 10 once it published it (a version never published is clamped).
        weights = common_pb2.WeightVersion(version=10, uri="file:///w/v10")
        event = events_pb2.WeightsPublishedEvent(
            event_id=f"weights.{run_id}.10", run_id=run_id, weights=weights
        )
        await run.bus.publish(subjects.weights(run_id), event, msg_id=event.event_id)
        await wait_for(lambda: _has(run, "latest_weights_version"))
        assert await pull(run, wait_s=0.2, current_version=10) == []  # tokens are version 0
        assert await stat(run, "groups_dropped_stale") == 1
        assert await pull(run, wait_s=0.2) == []  # dropped for good
    finally:
        await run.stop()


async def test_export_command_prints_every_call_as_json(nats_url, database_url, capsys):
    from services.trajectory import cli

    run_id = unique_run()
    ex = generate(TINY)[0]
    run = await start(nats_url, database_url, run_id)
    try:
        summary = await run.stub.IngestSteps(iter([step_event(run_id, c) for c in ex.calls]))
        assert summary.num_stored == len(ex.calls)
        import json as _json

        address = f"127.0.0.1:{run.server_port}"
        code = await asyncio.to_thread(
            cli.main, ["export", "--execution", ex.execution_id, "--address", address]
        )
        assert code == 0
        out = _json.loads(capsys.readouterr().out)
        assert [c["completion_token_ids"] for c in out["calls"]] == [c.completion.tolist() for c in ex.calls]
        assert [c["prompt_token_ids"] for c in out["calls"]] == [c.prompt.tolist() for c in ex.calls]
    finally:
        await run.stop()


@pytest.mark.slow
async def test_service_process_starts_migrates_serves_and_stops_cleanly(nats_url, database_url):
    import os
    import signal
    import sys

    env = {
        **os.environ,
        "GYRE_NATS_URL": nats_url,
        "GYRE_DATABASE_URL": database_url,
        "GYRE_RUN_ID": unique_run(),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.trajectory",
        "--port",
        "0",
        cwd=Path(__file__).parents[2],
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        assert line.startswith("GYRE_READY trajectory "), line
        port = int(line.split()[2])
        async with rpc.channel(f"127.0.0.1:{port}") as channel:
            stats = await trajectory_pb2_grpc.TrajectoryStub(channel).GetStats(
                trajectory_pb2.GetStatsRequest()
            )
        assert stats.values["stored_calls"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), timeout=60)
    assert code == 0


async def test_a_failed_commit_changes_nothing_and_the_retried_batch_is_stored_exactly(database_url):
    """The one fake here is at the outermost edge: the first Postgres commit is made to fail."""
    from services.trajectory.core import TrajectoryCore
    from services.trajectory.tree import TaskTree

    await asyncio.to_thread(store.upgrade, database_url, MIGRATIONS, "alembic_version_trajectory")
    engine = store.create_engine(database_url)
    execs = generate(TINY)
    core = TrajectoryCore("r", TrajectoryConfig(), engine)
    real_commit = core.store.commit_steps
    failures = iter([True])

    def flaky_commit(batch):  # type: ignore[no-untyped-def]
        if next(failures, False):
            raise RuntimeError("connection lost")
        real_commit(batch)

    core.store.commit_steps = flaky_commit  # type: ignore[method-assign]
    first = [step_event("r", c) for c in execs[0].calls]
    second = [step_event("r", c) for c in execs[1].calls]
    a = asyncio.create_task(core.ingest.ingest_steps(first))
    b = asyncio.create_task(
        core.ingest.ingest_steps(second)
    )  # if chained after the failing one, it fails too
    results = await asyncio.gather(a, b, return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    for batch in (first, second):  # redelivered: stored now, or already stored
        summary = await core.ingest.ingest_steps(batch)
        assert summary.num_stored + summary.num_duplicates == len(batch)
    assert (await fresh_count(engine)) == len(first) + len(second)
    expected = TaskTree("t")
    for ex in execs[:2]:
        for c in ex.calls:
            expected.insert_call(ex.execution_id, c.call_seq, c.prompt, c.completion, c.logprobs, c.versions)
    fresh = TrajectoryCore("r", TrajectoryConfig(), engine)
    await asyncio.to_thread(fresh.load)
    assert fresh.state.trees[execs[0].task_id].num_tokens == expected.num_tokens
    calls = [c for m in fresh.export(execs[0].execution_id) for c in m.calls]
    assert [list(c.prompt_token_ids) for c in calls] == [c.prompt.tolist() for c in execs[0].calls]
    engine.dispose()


async def fresh_count(engine: sa.Engine) -> int:
    def q() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("select count(*) from traj_calls")).scalar() or 0)

    return await asyncio.to_thread(q)


async def _collect(bus: Bus, subject: str, msg_type, out: list) -> None:  # type: ignore[no-untyped-def]
    async for msg in bus.tail(subject, msg_type, from_start=True):
        out.append(msg)


@pytest.mark.slow
async def test_a_group_with_nothing_to_train_is_skipped_and_pulled_batches_are_announced(
    nats_url, database_url
):
    from gyre.v1 import events_pb2
    from services.trajectory.synthetic import GeneratedCall, GeneratedExecution

    run_id = unique_run()
    # Only the poll loop's own batches would otherwise be announced: keep it from building any.
    run = await start(nats_url, database_url, run_id, min_batch_fill=1.0, batch_max_wait_s=3600.0)
    ready: list[events_pb2.BatchReadyEvent] = []
    scored: list[events_pb2.GroupScoredEvent] = []
    tails = [
        asyncio.create_task(
            _collect(run.bus, subjects.paths_batch(run_id), events_pb2.BatchReadyEvent, ready)
        ),
        asyncio.create_task(
            _collect(run.bus, subjects.paths_scored(run_id), events_pb2.GroupScoredEvent, scored)
        ),
    ]
    try:
        # Every execution of this group made one call that produced no completion token.
        silent = []
        for i in range(2):
            ex = GeneratedExecution("t-silent", "t-silent-g0", f"t-silent-g0-e{i}", reward=float(i))
            ex.calls.append(
                GeneratedCall(
                    ex.task_id, ex.group_id, ex.execution_id, 0,
                    np.arange(1, 17, dtype=np.int32), np.zeros(0, np.int32),
                    np.zeros(0, np.float32), np.zeros(0, np.int64),
                )
            )  # fmt: skip
            silent.append(ex)
        await publish_group(run, run_id, silent)
        await wait_for(lambda: _has(run, "groups_scored"))
        # A second group of the same task (its tree exists) whose executions ended before any call.
        stillborn = [GeneratedExecution("t-silent", "t-silent-g1", f"t-silent-g1-e{i}") for i in range(2)]
        await publish_group(run, run_id, stillborn)
        await wait_for(lambda: _stat_at_least(run, "groups_scored", 2))
        assert await pull(run, wait_s=0.3) == []
        assert await stat(run, "groups_skipped_empty") == 2
        assert await stat(run, "groups_state_empty") == 2

        execs = generate(TINY)
        await publish_group(run, run_id, execs)
        await wait_for(lambda: _stat_at_least(run, "groups_scored", 3))
        # below min_batch_fill (of the service's budget) a pull packs nothing and the poll loop builds
        # nothing; a pull whose own budget the scored groups fill packs one at pull time
        assert await pull(run, wait_s=0.3) == []
        chunks = await pull(run, wait_s=1.0, max_tokens=1)
        assert chunks and chunks[-1].last
        await wait_for(lambda: _len_at_least(ready, 1))
        (ev,) = ready
        assert ev.batch_id == chunks[0].batch_id
        assert ev.num_tokens == sum(len(c.token_ids) for c in chunks)
        assert ev.num_flat_tokens == sum(c.num_flat_tokens for c in chunks) > ev.num_tokens
        assert ev.num_paths == sum(c.num_paths for c in chunks)
        assert ev.max_policy_version >= ev.min_policy_version >= 0
        await wait_for(lambda: _len_at_least(scored, 3))
        assert {s.group_id for s in scored} == {"t-silent-g0", "t-silent-g1", execs[0].group_id}
    finally:
        for t in tails:
            t.cancel()
        await run.stop()


async def _len_at_least(items: list, n: int) -> bool:  # type: ignore[type-arg]
    return len(items) >= n


async def _stat_at_least(run: Running, name: str, n: float) -> bool:
    return await stat(run, name) >= n


async def test_a_group_whose_task_never_stored_a_call_is_skipped_and_announced_as_dropped(
    nats_url, database_url
):
    # Every agent of the group crashed before its first call (a broken agent install did this to a
    # whole run): the task has no tree at all. The group must still end (empty) and be announced as
    # dropped, so the rollout's admission gets its slot back; it once stayed open and the run stalled.
    from gyre.v1 import events_pb2
    from services.trajectory.synthetic import GeneratedExecution

    run_id = unique_run()
    run = await start(nats_url, database_url, run_id)
    dropped: list[events_pb2.GroupDroppedEvent] = []
    tail = asyncio.create_task(
        _collect(run.bus, subjects.paths_dropped(run_id), events_pb2.GroupDroppedEvent, dropped)
    )
    try:
        crashed = [GeneratedExecution("t-crash", "t-crash-g0", f"t-crash-g0-e{i}") for i in range(2)]
        await publish_group(run, run_id, crashed)
        await wait_for(lambda: _len_at_least(dropped, 1))
        assert [(d.group_id, d.reason) for d in dropped] == [("t-crash-g0", "empty")]
        assert await stat(run, "groups_state_empty") == 1
        assert await stat(run, "groups_state_open") == 0
    finally:
        tail.cancel()
        await run.stop()
